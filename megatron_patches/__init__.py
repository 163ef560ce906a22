"""ds_lowcomm inside Megatron-Core (0.16.x; the ``megatron`` extra).

- :mod:`.cpu_shim`: ``cpu_shim.install()`` before megatron on a machine without a GPU (opt-in,
  undone by ``uninstall()``; a no-op with a GPU).
- :mod:`.args`: ``add_lowcomm_args`` (Megatron's ``extra_args_provider``) and ``lowcomm_config``.
- :mod:`.internals`: every private Megatron-Core internal used here, declared and checked (with
  the supported version range, ``megatron-core>=0.16.1,<0.17``) before anything is patched.
- :mod:`.checkpoint`: Megatron-LM's ``torch_dist`` and ``torch`` checkpoint formats with the
  method's state (:mod:`.sharded_state`: what the wrapped optimizer's ``sharded_state_dict``
  gives Megatron's distributed checkpoints, each parameter's state sharded as the parameter, so
  they reshard).
- :func:`apply` (:mod:`.install`): ``apply(model_chunks, optimizer, config)`` installs any method
  across Megatron's data-parallel replicas: in place of DDP's bucket-level gradient all-reduce
  (:mod:`.grad_sync`: adamw, demo), or around Megatron's optimizer step (:mod:`.outer`: diloco,
  dct_diloco, sparseloco; mtdao in place of its inner Adam).

See ``launch/pretrain_gpt.py`` for a whole training script. Nothing here imports megatron at
import time.
"""


def apply(model_chunks, optimizer, config):
    """See :func:`megatron_patches.install.apply`."""
    from .install import apply as _apply

    return _apply(model_chunks, optimizer, config)


__all__ = ["apply"]
