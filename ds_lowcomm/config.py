"""The ``lowcomm`` settings: one validated object, whatever the entry point (CLI, DeepSpeed JSON, code).

Every error names the field and what it accepts, and is raised before any rank starts work.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

from .codec import AVERAGES, TRANSFORMS, VALUE_DTYPES

METHODS = ("adamw", "demo", "diloco", "dct_diloco", "sparseloco", "mtdao")
TRANSPORTS = ("torch", "mpi")
SYNC_CODECS = ("dense", "topk")
STATE_DTYPES = ("fp32", "bf16", "fp16")
INNER_IMPLS = ("torch", "apex")

# Which settings each method reads; a setting outside its method's set is ignored with a warning.
_COMPRESSION = ("topk", "chunk", "decay", "value_dtype", "average", "transform")
_OUTER = ("sync_every", "outer_lr", "outer_momentum", "nesterov", "inner_impl")
_STREAMING = ("fragments", "sync_delay", "fragment_mix")
_COMMON = ("method", "transport", "replica_size")
_MTDAO = ("sync_every", "momentum_betas", "momentum_weights", "momentum_sync_every", "second_moment_sync_every",
          "sync_codec")
METHOD_KEYS = {
    "adamw": _COMMON,
    "demo": _COMMON + _COMPRESSION + ("state_dtype",),
    "diloco": _COMMON + _OUTER + _STREAMING + ("state_dtype",),
    "dct_diloco": _COMMON + _OUTER + _STREAMING + _COMPRESSION + ("state_dtype",),
    # SparseLoCo has no outer momentum: its error-feedback buffer is the only memory.
    "sparseloco": _COMMON + ("sync_every", "outer_lr", "inner_impl") + _STREAMING + _COMPRESSION + ("state_dtype",),
    # The codec settings apply when sync_codec is "topk"; decay does not apply (plain error feedback).
    "mtdao": _COMMON + _MTDAO + ("topk", "chunk", "value_dtype", "average", "transform", "state_dtype"),
}
# Defaults that differ by method (ALGORITHMS.md): DeMo's momentum decay is 0.999, the DCT outer
# momentum's 0.9; SparseLoCo's published recipe (error feedback 0.95, 64 of 4096 per chunk, 2-bit
# values, no transform, outer lr 1, H 30); MT-DAO's sync periods of 32.
_METHOD_DEFAULTS = {
    "demo": {"decay": 0.999},
    "dct_diloco": {"decay": 0.9},
    "sparseloco": {"decay": 0.95, "topk": 64, "chunk": 64, "value_dtype": "2bit", "transform": "none",
                   "average": "world", "outer_lr": 1.0, "sync_every": 30},
    "mtdao": {"sync_every": 32, "average": "world"},
}


class ConfigError(ValueError):
    """A lowcomm setting that is missing, unknown, or out of range."""


@dataclass(frozen=True)
class LowcommConfig:
    method: str = "demo"
    topk: int = 32
    chunk: int = 64
    decay: float = 0.999
    sync_every: int = 128
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    value_dtype: str = "fp32"
    average: str = "senders"
    transform: str = "dct"
    replica_size: int = 1
    transport: str = "torch"
    state_dtype: str = "fp32"  # momenta, residuals and anchors (whatever the parameters' dtype)
    inner_impl: str = "torch"  # the inner AdamW: torch's, or NVIDIA apex's FusedAdam where installed
    # Streaming outer sync (DiLoCo family): parameters in `fragments` groups synced on a staggered
    # schedule; each sync lands `sync_delay` inner steps after it is sent, and the landed global
    # fragment replaces (fragment_mix 0) or is mixed with the local one.
    fragments: int = 1
    sync_delay: int = 0
    fragment_mix: float = 0.0
    # MT-DAO: first moments (one per beta, each with its weight in the update), their sync periods
    # (default: sync_every), the second moment's, and whether syncs are dense or top-k compressed.
    momentum_betas: tuple = (0.999,)
    momentum_weights: tuple = (0.7,)
    momentum_sync_every: tuple | None = None
    second_moment_sync_every: int | None = None
    sync_codec: str = "dense"

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, *, where: str = "lowcomm") -> "LowcommConfig":
        raw = dict(raw or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        method = raw.get("method", cls.method)
        _check_choice(where, "method", method, METHODS)
        ignored = sorted(set(raw) - set(METHOD_KEYS[method]))
        if ignored:
            warnings.warn(f"{where}: setting(s) {', '.join(ignored)} do not apply to method {method!r} and are ignored")
        values = {**_METHOD_DEFAULTS.get(method, {}), **raw}
        for key in ("momentum_betas", "momentum_weights", "momentum_sync_every"):
            if isinstance(values.get(key), list):  # JSON/YAML lists; kept as tuples (hashable, frozen)
                values[key] = tuple(values[key])
        cfg = cls(**values)
        cfg.validate(where)
        return cfg

    def validate(self, where: str = "lowcomm") -> None:
        _check_choice(where, "method", self.method, METHODS)
        _check_int(where, "chunk", self.chunk, 1)
        _check_int(where, "topk", self.topk, 1, self.chunk * self.chunk, hint=f"chunk*chunk = {self.chunk * self.chunk}")
        _check_float(where, "decay", self.decay, 0.0, 1.0)
        _check_int(where, "sync_every", self.sync_every, 1)
        if not (isinstance(self.outer_lr, (int, float)) and not isinstance(self.outer_lr, bool) and self.outer_lr > 0):
            raise ConfigError(f"{where}.outer_lr must be a number > 0; got {self.outer_lr!r}")
        _check_float(where, "outer_momentum", self.outer_momentum, 0.0, 1.0)
        if not isinstance(self.nesterov, bool):
            raise ConfigError(f"{where}.nesterov must be true or false; got {self.nesterov!r}")
        _check_choice(where, "value_dtype", self.value_dtype, VALUE_DTYPES)
        _check_choice(where, "average", self.average, AVERAGES)
        _check_choice(where, "transform", self.transform, TRANSFORMS)
        _check_int(where, "replica_size", self.replica_size, 1)
        _check_choice(where, "transport", self.transport, TRANSPORTS)
        _check_choice(where, "state_dtype", self.state_dtype, STATE_DTYPES)
        _check_choice(where, "inner_impl", self.inner_impl, INNER_IMPLS)
        _check_int(where, "fragments", self.fragments, 1, self.sync_every, hint="sync_every: one fragment sync per step at most")
        _check_int(where, "sync_delay", self.sync_delay, 0, self.sync_every - 1,
                   hint="a fragment's sync must land before its next one starts")
        if not (isinstance(self.fragment_mix, (int, float)) and not isinstance(self.fragment_mix, bool)
                and 0.0 <= self.fragment_mix <= 1.0):
            raise ConfigError(f"{where}.fragment_mix must be a number in [0, 1]; got {self.fragment_mix!r}")
        _check_choice(where, "sync_codec", self.sync_codec, SYNC_CODECS)
        self._validate_mtdao(where)

    def _validate_mtdao(self, where: str) -> None:
        betas, weights = self.momentum_betas, self.momentum_weights
        if not isinstance(betas, tuple) or not betas:
            raise ConfigError(f"{where}.momentum_betas must be a non-empty list of numbers in [0, 1); got {betas!r}")
        for b in betas:
            _check_float(where, "momentum_betas[]", b, 0.0, 1.0)
        if not isinstance(weights, tuple) or len(weights) != len(betas):
            raise ConfigError(f"{where}.momentum_weights must be a list with one weight per momentum_betas entry "
                              f"({len(betas)}); got {weights!r}")
        for w in weights:
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
                raise ConfigError(f"{where}.momentum_weights entries must be numbers in [0, 1]; got {weights!r}")
        if sum(weights) > 1.0 + 1e-12:
            raise ConfigError(f"{where}.momentum_weights must sum to at most 1 (the rest weighs the raw gradient); "
                              f"got {weights!r} (sum {sum(weights)})")
        periods = self.momentum_sync_every
        if periods is not None:
            if not isinstance(periods, tuple) or len(periods) != len(betas):
                raise ConfigError(f"{where}.momentum_sync_every must be a list with one period per momentum_betas "
                                  f"entry ({len(betas)}), or null for sync_every; got {periods!r}")
            for k in periods:
                _check_int(where, "momentum_sync_every[]", k, 1)
        if self.second_moment_sync_every is not None:
            _check_int(where, "second_moment_sync_every", self.second_moment_sync_every, 1)

    def effective(self) -> dict[str, Any]:
        """The settings the chosen method actually uses (compared across ranks, written to results)."""
        return {k: getattr(self, k) for k in METHOD_KEYS[self.method]}


def check_lr(lr: Any, where: str = "lr") -> float:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ConfigError(f"{where} must be a number > 0; got {lr!r}")
    return float(lr)


def _check_choice(where, name, value, allowed):
    if value not in allowed:
        raise ConfigError(f"{where}.{name} must be one of {', '.join(allowed)}; got {value!r}")


def _check_int(where, name, value, lo, hi=None, hint=""):
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        bound = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]" + (f" ({hint})" if hint else "")
        raise ConfigError(f"{where}.{name} must be {bound}; got {value!r}")


def _check_float(where, name, value, lo, hi):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value < hi
    if not ok:
        raise ConfigError(f"{where}.{name} must be a number in [{lo}, {hi}); got {value!r}")
