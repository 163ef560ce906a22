"""What every component's settings share: the error type, field checks, and flat parsing.

Each component owns a small frozen dataclass of its settings, next to its code (the codec's in
``codec/settings.py``, each method's beside the method, the transport's in ``comm/settings.py``),
with its defaults and its checks written once. This module is the leaf they all build on: it
imports nothing of ds_lowcomm.

A ``"lowcomm"`` section is flat (``{"method": "dct_diloco", "topk": 32, "sync_every": 20}``):
:meth:`Settings.from_flat` takes the keys a dataclass declares, descending into nested settings
(a method's codec, its streaming schedule) with the same flat keys, so each key is named once.
Every error names the field and what it accepts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping


class ConfigError(ValueError):
    """A setting that is missing, unknown, or out of range."""


# -- field checks: each raises ConfigError naming ``where.name`` and what it accepts -----------
def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_choice(where: str, name: str, value: Any, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(f"{where}.{name} must be one of {', '.join(allowed)}; got {value!r}")


def check_int(where: str, name: str, value: Any, lo: int, hi: int | None = None, hint: str = "") -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= lo and (hi is None or value <= hi)
    if not ok:
        bound = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]" + (f" ({hint})" if hint else "")
        raise ConfigError(f"{where}.{name} must be {bound}; got {value!r}")


def check_fraction(where: str, name: str, value: Any, lo: float = 0.0, hi: float = 1.0) -> None:
    """A number in [lo, hi): decays, momenta, betas."""
    if not (_is_number(value) and lo <= value < hi):
        raise ConfigError(f"{where}.{name} must be a number in [{lo}, {hi}); got {value!r}")


def check_unit(where: str, name: str, value: Any) -> None:
    """A number in [0, 1], both ends included: mixing weights."""
    if not (_is_number(value) and 0.0 <= value <= 1.0):
        raise ConfigError(f"{where}.{name} must be a number in [0, 1]; got {value!r}")


def _check_positive_field(field: str, value: Any) -> float:
    if not (_is_number(value) and value > 0 and math.isfinite(value)):
        raise ConfigError(f"{field} must be a number > 0; got {value!r}")
    return float(value)


def check_positive(where: str, name: str, value: Any) -> float:
    """A finite number > 0: learning rates."""
    return _check_positive_field(f"{where}.{name}", value)


def check_nonnegative(where: str, name: str, value: Any) -> float:
    """A finite number >= 0: weight decays, epsilons."""
    if not (_is_number(value) and value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{where}.{name} must be a number >= 0; got {value!r}")
    return float(value)


def check_bool(where: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{name} must be true or false; got {value!r}")


def check_lr(lr: Any, where: str = "lr") -> float:
    """A learning rate: a finite number > 0 (``where`` is the whole field name)."""
    return _check_positive_field(where, lr)


# -- settings dataclasses ----------------------------------------------------------------------
class Settings:
    """Base of the components' frozen settings dataclasses.

    Subclasses declare fields with defaults and implement :meth:`check`; a field whose default is
    another :class:`Settings` (``field(default_factory=...)``) is nested: it reads the same flat
    keys, starting from the defaults its factory gives (so a method may change its codec's
    defaults in one place).
    """

    def check(self, where: str) -> None:  # pragma: no cover - every subclass overrides it
        raise NotImplementedError

    def validate(self, where: str = "lowcomm") -> None:
        """Check this object and every nested one."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Settings):
                value.validate(where)
        self.check(where)

    @classmethod
    def nested(cls) -> dict[str, type["Settings"]]:
        """Fields that hold nested settings, by name."""
        out = {}
        for f in dataclasses.fields(cls):
            if f.default_factory is not dataclasses.MISSING:
                default = f.default_factory()
                if isinstance(default, Settings):
                    out[f.name] = type(default)
        return out

    @classmethod
    def flat_keys(cls) -> tuple[str, ...]:
        """Every flat key this settings object reads, nested ones included, in declaration order."""
        keys: list[str] = []
        nested = cls.nested()
        for f in dataclasses.fields(cls):
            for key in (nested[f.name].flat_keys() if f.name in nested else (f.name,)):
                if key not in keys:
                    keys.append(key)
        return tuple(keys)

    @classmethod
    def from_flat(cls, raw: Mapping[str, Any], *, where: str = "lowcomm", base: "Settings | None" = None,
                  strict: bool = False):
        """Build from a flat mapping: the keys this class reads are taken; any other key is an
        error with ``strict``, else ignored (the caller sorts them out). Lists become tuples
        (frozen, hashable). Validated."""
        if strict:
            unknown = sorted(set(raw) - set(cls.flat_keys()))
            if unknown:
                raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}; "
                                  f"allowed: {', '.join(cls.flat_keys())}")
        base = base if base is not None else cls()
        values = {}
        for f in dataclasses.fields(cls):
            current = getattr(base, f.name)
            if isinstance(current, Settings):
                values[f.name] = type(current).from_flat(raw, where=where, base=current)
            elif f.name in raw:
                value = raw[f.name]
                values[f.name] = tuple(value) if isinstance(value, list) else value
        out = dataclasses.replace(base, **values)
        out.check(where)
        return out

    def unused_keys(self) -> dict[str, str]:
        """Flat keys whose value nothing reads at this object's other values, each with why (the
        section that names one is refused: nothing accepted and ignored). Nested objects' included."""
        out: dict[str, str] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Settings):
                out.update(value.unused_keys())
        return out

    def flat(self) -> dict[str, Any]:
        """The flat mapping this object was (or could be) built from."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Settings):
                out.update(value.flat())
            else:
                out[f.name] = value
        return out
