"""ds_lowcomm inside Megatron-Core (0.16.1; the ``megatron`` extra).

- :mod:`.cpu_shim`: import before megatron on a machine without a GPU (a no-op with one).
- :mod:`.args`: ``add_lowcomm_args`` (Megatron's ``extra_args_provider``) and ``lowcomm_config``.
- :mod:`.outer`: ``apply(model_chunks, optimizer, config)``: the outer-loop methods across
  Megatron's data-parallel replicas.

See ``launch/pretrain_gpt.py`` for a whole training script. Nothing here imports megatron at
import time except :mod:`.outer`'s ``apply``.
"""
