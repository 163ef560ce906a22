"""The ``"lowcomm"`` section on a Megatron command line.

:func:`add_lowcomm_args` is usable as Megatron-LM's ``extra_args_provider`` (or on any argparse
parser): one ``--lowcomm-<key>`` per flat key of the section (``--lowcomm-sync-every``, ...),
taken from the settings classes (:mod:`ds_lowcomm.optim.registry`), so a new setting appears here
without an edit, plus ``--lowcomm-config FILE``, a JSON section the flags override.

:func:`lowcomm_config` builds the :class:`~ds_lowcomm.optim.registry.LowcommConfig` with
``LowcommConfig.from_dict(..., where="lowcomm")``: the same checks, and the same
:class:`~ds_lowcomm.settings.ConfigError` naming ``lowcomm.<key>``, as the DeepSpeed path.
Command-line strings are read as the JSON a config file would hold: ``true``/``false``, ``null``,
numbers, comma-separated lists for list settings (or a JSON list, ``[[500, 10], [2000, 30]]`` for
``--lowcomm-sync-every-schedule``), else the string itself; whether the value fits is for the
settings' own checks to say.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from ds_lowcomm.codec.activations import ActivationSettings
from ds_lowcomm.comm.settings import CommSettings
from ds_lowcomm.optim.registry import METHOD_CLASSES, METHODS, LowcommConfig, _all_keys
from ds_lowcomm.settings import ConfigError

PREFIX = "lowcomm_"
ACTIVATIONS_PREFIX = "lowcomm_activations_"


def _defaults_by_key() -> dict[str, list[Any]]:
    """Every flat key -> its default in each settings class that reads it (for help and typing)."""
    out: dict[str, list[Any]] = {}
    for cls in (CommSettings, *(c.settings_class for c in METHOD_CLASSES.values())):
        for key, value in cls().flat().items():
            out.setdefault(key, [])
            if value not in out[key]:
                out[key].append(value)
    return out


def _list_keys() -> set[str]:
    """Keys that hold lists: by a default that is one, or by the field's type where the default is
    None (MT-DAO's ``momentum_sync_every``)."""
    out = {k for k, values in _defaults_by_key().items() if any(isinstance(v, (tuple, list)) for v in values)}

    def typed(cls) -> None:
        nested = cls.nested()
        for f in dataclasses.fields(cls):
            if f.name in nested:
                typed(nested[f.name])
            elif str(f.type).startswith(("tuple", "list")):
                out.add(f.name)

    for cls in (CommSettings, *(c.settings_class for c in METHOD_CLASSES.values())):
        typed(cls)
    return out


def _str_keys() -> set[str]:
    return {k for k, values in _defaults_by_key().items() if values and all(isinstance(v, str) for v in values)}


def _scalar(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("null", "none"):
        return None
    try:
        return json.loads(text)  # numbers as JSON reads them: 5 -> int, 0.7 / 1e-3 -> float
    except ValueError:
        return text


def parse_value(key: str, text: str) -> Any:
    """A command-line string as the JSON value a config file would hold for ``key``."""
    if key == "method" or key in _str_keys():
        return text
    if key in _list_keys():
        if text.strip().lower() in ("null", "none"):
            return None
        if text.strip().startswith("["):  # a JSON list, as a file holds it (lists of lists: sync_every_schedule)
            try:
                return json.loads(text)
            except ValueError:
                raise ConfigError(f"lowcomm.{key}: {text!r} is not a JSON list") from None
        return [_scalar(part) for part in text.split(",") if part.strip()]
    return _scalar(text)


def add_lowcomm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--lowcomm-*`` options (a group named "lowcomm"); returns the parser, as
    Megatron-LM's ``extra_args_provider`` must."""
    group = parser.add_argument_group("lowcomm", "ds_lowcomm low-communication optimizer (the 'lowcomm' section)")
    group.add_argument("--lowcomm-config", dest="lowcomm_config", default=None, metavar="FILE",
                       help="JSON file holding a lowcomm section ({\"method\": ..., ...}); flags override it")
    defaults = _defaults_by_key()
    for key in _all_keys():
        if key == "method":
            help_ = f"one of {', '.join(METHODS)}"
        else:
            shown = ", ".join(repr(v) for v in defaults.get(key, []))
            help_ = f"default (by method): {shown}"
        group.add_argument(f"--lowcomm-{key.replace('_', '-')}", dest=PREFIX + key, default=None, type=str,
                           metavar="VALUE", help=help_)
    for key, value in ActivationSettings().flat().items():  # the "activations" mapping of the section
        group.add_argument(f"--lowcomm-activations-{key.replace('_', '-')}", dest=ACTIVATIONS_PREFIX + key,
                           default=None, type=str, metavar="VALUE",
                           help=f"pipeline activations (lowcomm.activations.{key}); default {value!r}")
    return parser


def _config_file_section(args: argparse.Namespace) -> dict[str, Any] | None:
    """The lowcomm section of ``--lowcomm-config FILE`` (a copy), or None."""
    path = getattr(args, "lowcomm_config", None)
    if not path:
        return None
    try:
        with open(path) as f:
            section = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--lowcomm-config {path}: cannot read a JSON lowcomm section: {err}") from None
    if isinstance(section, dict) and isinstance(section.get("lowcomm"), dict):
        section = section["lowcomm"]  # a whole config file with a lowcomm section
    if not isinstance(section, dict):
        raise ConfigError(f"--lowcomm-config {path}: lowcomm must be a mapping of settings; got {section!r}")
    return dict(section)


def refuse_fault_tolerance(section: dict) -> None:
    if "fault_tolerance" in section:
        raise ConfigError("lowcomm.fault_tolerance is not supported with Megatron: its replicas are data-parallel "
                          "groups of one job (docs/reliability.md, Live fault tolerance); use the DeepSpeed or plain torch path")


def lowcomm_section(args: argparse.Namespace) -> dict[str, Any] | None:
    """The flat section the arguments give (the file's, then the flags), or None if none is set."""
    section = _config_file_section(args)
    if section is not None:
        refuse_fault_tolerance(section)
        section.pop("activations", None)  # its own settings: activation_settings(args)
        if not section:
            section = None
    for key in _all_keys():
        text = getattr(args, PREFIX + key, None)
        if text is not None:
            section = section if section is not None else {}
            section[key] = parse_value(key, text)
    return section


def lowcomm_config(args: argparse.Namespace) -> LowcommConfig | None:
    """The validated :class:`LowcommConfig` of the ``--lowcomm-*`` arguments; None where none is
    given (plain Megatron training)."""
    from .keys import refuse_unhonoured

    section = lowcomm_section(args)
    if section is None:
        return None
    config = LowcommConfig.from_dict(section, where="lowcomm")
    refuse_unhonoured(config, section)  # every key honoured with Megatron-Core, or refused by name
    return config


def activation_settings(args: argparse.Namespace) -> ActivationSettings | None:
    """The pipeline-activation codecs (``lowcomm.activations``: the file's mapping, then the
    ``--lowcomm-activations-*`` flags), checked as on the DeepSpeed path; None where none is given."""
    file_section = _config_file_section(args) or {}
    raw = file_section.get("activations")
    raw = dict(raw) if isinstance(raw, dict) else raw
    for key, default in ActivationSettings().flat().items():
        text = getattr(args, ACTIVATIONS_PREFIX + key, None)
        if text is not None:
            raw = {} if raw is None else raw  # a file value that is no mapping stays, for from_section to refuse
            if not isinstance(raw, dict):
                break
            raw[key] = text if isinstance(default, str) else _scalar(text)
    if raw is None:
        return None
    return ActivationSettings.from_section(raw, where="lowcomm.activations")


__all__ = ["activation_settings", "add_lowcomm_args", "lowcomm_config", "lowcomm_section", "parse_value",
           "ConfigError"]
