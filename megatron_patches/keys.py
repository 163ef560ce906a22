"""Every key of the ``"lowcomm"`` section on the Megatron-Core road: honoured, or refused by name.

With Megatron-Core some keys have nothing to act on: an outer method's inner optimizer is
Megatron's own (``--optimizer adam`` or ``muon``), so ``inner_impl`` (the kernel of ds_lowcomm's
inner AdamW) would be accepted and ignored; a key of another method (``topk`` beside ``diloco``)
would be too. ``inner_optimizer muon`` (with ``inner_muon_lr``, ``inner_muon_momentum``) is
honoured: ds_lowcomm's Muon + AdamW in place of the Adam inside Megatron's optimizer
(megatron_patches/inner_muon.py).
:func:`refuse_unhonoured` refuses each of them naming the key, before any rank communicates
(``lowcomm_config`` and ``apply`` call it); every other key of the method's settings reaches the
method's object. :func:`describe` is the run's first log line: the inner (or per-step) optimizer
and every honoured setting with its value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ds_lowcomm.comm.settings import CommSettings
from ds_lowcomm.optim.registry import METHOD_CLASSES, OUTER_METHODS, LowcommConfig
from ds_lowcomm.settings import ConfigError

SUPPORTED_METHODS = ("adamw", "demo", "diloco", "dct_diloco", "sparseloco", "mtdao")
# keys that choose or tune the inner optimizer ds_lowcomm builds: with Megatron the inner optimizer
# is Megatron's (its --lr, --weight-decay, --optimizer), its Adam swapped for ds_lowcomm's Muon + AdamW
# by inner_optimizer muon; inner_impl (the inner AdamW's kernel) has nothing to act on
INNER_OPTIMIZER_KEYS = ("inner_optimizer", "inner_impl", "inner_muon_lr", "inner_muon_momentum")
# keys honoured only at one value with Megatron-Core (the value each must have, why)
ONLY_VALUE = {
    "transport": ("torch", "the data-parallel group's collectives"),
    "overlap": (False, "DeMo's exchange already runs in Megatron's bucket-level gradient sync "
                       "(overlap_grad_reduce overlaps it with the backward pass)"),
    "inner_impl": ("torch", "the inner optimizer is Megatron's own (its Adam is Megatron's choice of kernel)"),
}


def method_keys(method: str) -> tuple[str, ...]:
    """The flat keys ``method``'s settings and the transport's read."""
    return ("method", *CommSettings.flat_keys(), *METHOD_CLASSES[method].settings_class.flat_keys())


def honoured_keys(method: str) -> tuple[str, ...]:
    """The keys Megatron's road honours for ``method`` at any valid value (``ONLY_VALUE``'s at theirs,
    ``replica_size`` at 1 or the model-parallel size, install._check_supported)."""
    return tuple(k for k in method_keys(method) if k != "inner_impl" or method not in OUTER_METHODS)


def _defaults(method: str) -> dict[str, Any]:
    return {"method": method, **CommSettings().flat(), **METHOD_CLASSES[method].settings_class().flat()}


def refuse_unhonoured(config: LowcommConfig, given: Iterable[str] | None = None) -> None:
    """Refuse, naming the key, every setting Megatron's road would accept and ignore. ``given``: the
    keys the user wrote (the section's); without it (a built :class:`LowcommConfig`) the keys whose
    value differs from the method's default."""
    method = config.method
    if method not in SUPPORTED_METHODS:
        raise ConfigError(f"lowcomm.method {method!r} is not supported with Megatron-Core yet"
                          + (" (its orthonormal step needs whole weight matrices and two all-reduces inside the "
                             "optimizer step)" if method == "dion" else "")
                          + f"; allowed: {', '.join(SUPPORTED_METHODS)}")
    effective, defaults = config.effective(), _defaults(method)
    if given is None:
        given = [k for k, v in effective.items() if v != defaults.get(k)]
    given = list(given)
    foreign = sorted(k for k in given if k not in method_keys(method))
    if foreign:
        raise ConfigError(f"lowcomm: setting(s) {', '.join(foreign)} do not apply to method {method!r}, and with "
                          "Megatron-Core nothing is accepted to be ignored: remove them; the method's settings: "
                          f"{', '.join(k for k in honoured_keys(method) if k != 'method')}")
    for key, (value, why) in ONLY_VALUE.items():
        if key in effective and effective[key] != value:
            shown = "false" if value is False else value
            raise ConfigError(f"lowcomm.{key} must be {shown} with Megatron-Core ({why}); got {effective[key]!r}")


def describe(config: LowcommConfig, inner: str) -> str:
    """The run's first log line: ``inner`` (Megatron's optimizer, with its settings) in its role,
    then every setting Megatron's road honours for the method, with its value."""
    effective = config.effective()
    role = "inner optimizer" if config.method in OUTER_METHODS else "optimizer"
    unused = config.settings.unused_keys()  # keys nothing reads at the other settings
    shown = ", ".join(f"{k}={effective[k]}" for k in honoured_keys(config.method) if k in effective and k not in unused)
    return f"ds_lowcomm: {config.method} on Megatron-Core, {role}: {inner}; settings: {shown}"


__all__ = ["INNER_OPTIMIZER_KEYS", "ONLY_VALUE", "SUPPORTED_METHODS", "describe", "honoured_keys", "method_keys",
           "refuse_unhonoured"]
