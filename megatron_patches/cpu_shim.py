"""Let Megatron-Core (0.16.1) run on a machine without a GPU.

Import this module before anything of ``megatron`` (``import megatron_patches.cpu_shim`` or
:func:`install`); it does nothing where ``torch.cuda.is_available()``. Megatron-Core asks CUDA
for things unconditionally even when the model is built with ``use_cpu_initialization=True``:

- ``torch.cuda.current_device()`` as a device argument -> ``"cpu"``;
- ``torch.cuda.synchronize()`` -> no-op;
- the CUDA RNG helpers its RNG tracker uses (``get_rng_state``, ``manual_seed``, ...) -> the CPU
  generator's state is read; seeding and setting the CUDA state does nothing (Megatron's own
  ``_set_cuda_rng_state`` queues its callback until CUDA initialises, i.e. never). The tracker's
  forks therefore draw from the CPU generator: dropout stays random, not per-TP-rank reproducible;
- ``device="cuda"`` (e.g. in ``pipeline_parallel/schedules.py``) -> CPU, by a
  ``TorchFunctionMode`` that stays entered for the process;
- ``Tensor.cuda()`` -> the tensor itself;
- ``Tensor.type()`` (no argument: the type's name) -> the CUDA name (``torch.cuda.BFloat16Tensor``)
  for a CPU tensor: Megatron's mixed-precision optimizer and gradient clipping test parameters by
  these names and refuse anything else. ``Tensor.type(dtype)`` (a conversion) is unchanged.

Nothing else is changed: the model, the collectives (gloo) and the schedules are Megatron's own.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

_installed = False
_mode: TorchFunctionMode | None = None


def _cpu(device):
    """``device`` with any CUDA device replaced by the CPU; anything else as given."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.split(":")[0] == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device=`` keyword arguments (and ``Tensor.to``'s positional device) naming CUDA."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs = {**kwargs, "device": _cpu(kwargs["device"])}
        if func in (torch.Tensor.to,) and len(args) > 1:
            args = (args[0], _cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


_tensor_type = torch.Tensor.type


def _type_named_as_cuda(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs:
        name = _tensor_type(self)
        if self.device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name
    return _tensor_type(self, dtype, non_blocking, **kwargs)


def install() -> bool:
    """Apply the patches once (a no-op with a GPU). Returns whether they are in place."""
    global _installed, _mode
    if _installed:
        return True
    if torch.cuda.is_available():
        return False
    cuda = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.synchronize = lambda *a, **k: None
    for mod in (cuda, cuda.random):
        mod.get_rng_state = lambda device="cuda": torch.get_rng_state()
        mod.set_rng_state = lambda new_state, device="cuda": None
        mod.manual_seed = lambda seed: None
        mod.manual_seed_all = lambda seed: None
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.Tensor.type = _type_named_as_cuda
    _mode = _CudaToCpu()
    _mode.__enter__()  # for the whole process
    _installed = True
    return True


install()
