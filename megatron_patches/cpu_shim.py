"""Let Megatron-Core (0.16.x) run on a machine without a GPU: opt-in, scoped, and undone.

Nothing happens at import. :func:`install` (before anything of ``megatron`` is imported, where
``torch.cuda.is_available()`` is False; with a GPU it does nothing and returns False) changes the
few things Megatron-Core asks of CUDA unconditionally even for a model built with
``use_cpu_initialization=True``; :func:`uninstall` puts every one of them back as it found them;
``with cpu_shim.installed():`` does both. What is changed while installed:

- ``torch.cuda.current_device()`` -> ``"cpu"``; ``torch.cuda.synchronize()`` -> no-op;
- the CUDA RNG, emulated by the CPU generator: ``torch.cuda.get_rng_state`` /
  ``set_rng_state`` / ``manual_seed`` (and ``torch.cuda.random``'s) read, set and seed the CPU
  generator, and Megatron's ``tensor_parallel.random._set_cuda_rng_state`` (which queues its
  work until CUDA initialises, i.e. never) sets it at once. Megatron's RNG tracker therefore
  works as on a GPU: a fork (dropout inside tensor-parallel regions) draws from the tracker's own
  stream, per tensor-parallel rank, and ``get_states()`` / ``set_states()`` save and restore it
  exactly. The tracker's warning that the CPU state changed inside a fork is silenced (here they
  are one generator);
- ``device="cuda"`` keyword arguments (e.g. in ``pipeline_parallel/schedules.py``) and
  ``Tensor.to("cuda")`` -> CPU, by a ``TorchFunctionMode`` entered by install and left by uninstall;
- ``Tensor.cuda()`` -> the tensor itself;
- ``Tensor.type()`` (no argument: the type's name) -> the CUDA name (``torch.cuda.BFloat16Tensor``)
  for a CPU tensor: Megatron's mixed-precision optimizer and gradient clipping test parameters by
  these names and refuse anything else. ``Tensor.type(dtype)`` (a conversion) is unchanged.

Nothing else is changed: the model, the collectives (gloo) and the schedules are Megatron's own.
The package never installs it by itself: ``launch/pretrain_gpt.py``, ``launch/megatron_lm_pretrain.py``
and the tests call :func:`install` where there is no GPU. The torch function mode stack is per
thread: install in the thread that trains.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

_RNG_LOGGER = "megatron.core.tensor_parallel.random"
_FORK_WARNING = "CPU RNG state changed within GPU RNG context"

_saved: list[tuple[Any, str, Any]] | None = None  # (owner, name, original) of everything replaced
_mode: TorchFunctionMode | None = None
_filter: logging.Filter | None = None


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


def _set_rng_state_now(new_state, device=-1, graph_safe=False):
    """Megatron's ``_set_cuda_rng_state`` on the emulated device: the CPU generator, at once."""
    torch.set_rng_state(new_state)


class _QuietForkWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _FORK_WARNING not in record.getMessage()


_ABSENT = object()  # a class attribute that was inherited, not in the class's own dict


def _replace(owner: Any, name: str, value: Any) -> None:
    assert _saved is not None
    original = owner.__dict__.get(name, _ABSENT) if isinstance(owner, type) else getattr(owner, name)
    _saved.append((owner, name, original))
    setattr(owner, name, value)


def is_installed() -> bool:
    return _saved is not None


def install() -> bool:
    """Apply the changes (once; a no-op with a GPU). Returns whether they are in place."""
    global _saved, _mode, _filter
    if _saved is not None:
        return True
    if torch.cuda.is_available():
        return False
    _saved = []
    cuda = torch.cuda
    _replace(cuda, "current_device", lambda: "cpu")
    _replace(cuda, "synchronize", lambda *a, **k: None)
    for mod in (cuda, cuda.random):
        _replace(mod, "get_rng_state", lambda device="cuda": torch.get_rng_state())
        _replace(mod, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
        _replace(mod, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)) and None)
        _replace(mod, "manual_seed_all", lambda seed: torch.default_generator.manual_seed(int(seed)) and None)
    _replace(torch.Tensor, "cuda", lambda self, *a, **k: self)
    _replace(torch.Tensor, "type", _type_named_as_cuda)
    _mode = _CudaToCpu()
    _mode.__enter__()
    _filter = _QuietForkWarning()
    logging.getLogger(_RNG_LOGGER).addFilter(_filter)
    # Megatron's own RNG setter (declared and checked in megatron_patches.internals).
    from . import internals as mi

    try:
        mi.ensure_checked()  # a megatron-core outside the supported range, or changed internals, stop here
        original = mi.live(mi.SET_CUDA_RNG_STATE)
    except BaseException:
        uninstall()
        raise
    _saved.append((None, "megatron _set_cuda_rng_state", original))
    mi.rebind(mi.SET_CUDA_RNG_STATE, _set_rng_state_now)
    return True


def uninstall() -> None:
    """Put back everything :func:`install` changed, in reverse order (a no-op if not installed)."""
    global _saved, _mode, _filter
    if _saved is None:
        return
    from . import internals as mi

    for owner, name, original in reversed(_saved):
        if owner is None:
            mi.rebind(mi.SET_CUDA_RNG_STATE, original)
        elif original is _ABSENT:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    if _mode is not None:
        _mode.__exit__(None, None, None)
    if _filter is not None:
        logging.getLogger(_RNG_LOGGER).removeFilter(_filter)
    _saved, _mode, _filter = None, None, None


@contextlib.contextmanager
def installed() -> Iterator[bool]:
    """``with installed() as active:`` the shim inside the block (where there is no GPU)."""
    active = install()
    try:
        yield active
    finally:
        if active:
            uninstall()


__all__ = ["install", "installed", "is_installed", "uninstall"]
