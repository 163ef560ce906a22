"""The framework versions ds_lowcomm supports, and the start-up check against them (the gate).

The integrations reach into private internals of their frameworks (declared in each one's
``internals.py``, checked by :mod:`ds_lowcomm.reflect`), and those move between releases. So each
framework's supported range is pinned once, in ``pyproject.toml``, as one of the package's
requirements (deepspeed and torch in the dependencies; torchft, megatron-core, transformers,
accelerate and lightning in the ``ft``, ``megatron`` and ``hf`` extras), and :data:`SUPPORTED` is
read from the package's own metadata (``importlib.metadata.requires("ds_lowcomm")``), never copied
by hand. ``ds_lowcomm.deepspeed.initialize``, ``megatron_patches.apply``, ``install()`` and the
torchft glue call :func:`check_supported` before they touch anything. Outside the range the run
stops with the installed and supported versions, unless ``DS_LOWCOMM_ALLOW_UNSUPPORTED_VERSIONS=1``
is set: then it warns once and goes on, and the internals checks still stop it where something it
needs moved.

Without installed metadata (a source tree on ``PYTHONPATH``, never pip-installed) the pins are read
from the ``pyproject.toml`` beside the package, the file the metadata is built from, in the same
way. With neither, :data:`SUPPORTED` is empty and :func:`check_supported` refuses every framework,
saying why (the escape above applies): a check is never skipped silently. An editable install's
metadata is written when it is installed: after changing a pin, reinstall (``launch/env.sh`` does
when ``pyproject.toml`` changes; a test compares the two).

A leaf module: it imports nothing of ds_lowcomm.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from pathlib import Path

DISTRIBUTION = "ds_lowcomm"
ALLOW_ENV = "DS_LOWCOMM_ALLOW_UNSUPPORTED_VERSIONS"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"  # beside the package in a source tree

_warned: set[str] = set()


class UnsupportedVersionError(RuntimeError):
    """An installed framework outside the range ds_lowcomm supports."""


def _with_extra(requirement: str, extra: str) -> str:
    """A requirement of pyproject's extra ``extra`` as the metadata writes it (``; extra == "x"``)."""
    spec, _, marker = requirement.partition(";")
    return f'{spec}; ({marker.strip()}) and extra == "{extra}"' if marker.strip() else f'{spec}; extra == "{extra}"'


def _requirements(pyproject: Path) -> tuple[list[str], list[str], str] | None:
    """ds_lowcomm's requirements, its extras and where they were read: the installed metadata, else
    ``pyproject`` (a source tree). None where there is neither."""
    try:
        requires = importlib.metadata.requires(DISTRIBUTION) or []
        extras = importlib.metadata.metadata(DISTRIBUTION).get_all("Provides-Extra") or []
        return list(requires), list(extras), f"the installed {DISTRIBUTION} distribution's metadata"
    except importlib.metadata.PackageNotFoundError:
        pass
    if not pyproject.is_file():
        return None
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomli, where installed
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            return None
    project = tomllib.loads(pyproject.read_text()).get("project", {})
    if project.get("name") != DISTRIBUTION:
        return None
    optional = project.get("optional-dependencies", {})
    requires = list(project.get("dependencies", []))
    requires += [_with_extra(line, extra) for extra, lines in optional.items() for line in lines]
    return requires, list(optional), str(pyproject)


def pinned_ranges(requirements, extras=()) -> dict[str, str]:
    """Distribution (canonical name) -> its range (``>=low,<high``), for every requirement with a
    version specifier whose marker holds here, in the base install or in one of ``extras``. A
    distribution pinned in several places gets every pin at once (they are meant to be equal)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    found = {}
    for line in requirements:
        req = Requirement(line)
        if not req.specifier:
            continue
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
            continue
        name = canonicalize_name(req.name)
        found[name] = found[name] & req.specifier if name in found else req.specifier
    order = {">": 0, ">=": 0, "~=": 0, "==": 1, "===": 1, "!=": 2, "<=": 3, "<": 3}  # lower bounds first

    def written(spec) -> str:
        return ",".join(dict.fromkeys(str(s) for s in sorted(spec, key=lambda s: (order.get(s.operator, 1), str(s)))))

    return {name: written(spec) for name, spec in found.items()}


def load_supported(pyproject: Path = PYPROJECT) -> tuple[dict[str, str], str]:
    """:data:`SUPPORTED` and where it was read (:data:`SOURCE`); ``({}, why)`` without metadata."""
    found = _requirements(pyproject)
    if found is None:
        return {}, (f"no {DISTRIBUTION} distribution is installed (importlib.metadata finds none) and no "
                    f"pyproject.toml of {DISTRIBUTION} that this Python can read (tomllib) is beside the package "
                    f"({pyproject})")
    requires, extras, source = found
    return pinned_ranges(requires, extras), source


# distribution -> the range the suite runs on (lower bound: the version the suite was run against;
# upper bound: the next minor release, whose internals nobody has checked yet), from pyproject's pins
SUPPORTED, SOURCE = load_supported()


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def supported_range(distribution: str) -> str:
    """The range ds_lowcomm supports for ``distribution`` (``>=0.19.8,<0.20``); UnsupportedVersionError
    where its metadata is missing, KeyError where it pins nothing for it (ds_lowcomm's own mistake)."""
    from packaging.utils import canonicalize_name

    if not SUPPORTED:
        raise UnsupportedVersionError(
            f"ds_lowcomm cannot tell which {distribution} versions it supports: they are read from its own "
            f"metadata (the pins in its pyproject.toml), and {SOURCE}. Install it (pip install ds_lowcomm, or "
            f"pip install -e <its source tree>), or set {ALLOW_ENV}=1 to go on unchecked")
    name = canonicalize_name(distribution)
    if name not in SUPPORTED:
        raise KeyError(f"ds_lowcomm pins no range for {distribution} (pinned in {SOURCE}: {', '.join(SUPPORTED)})")
    return SUPPORTED[name]


def _allowed(key: str, message: str) -> bool:
    if os.environ.get(ALLOW_ENV, "") in ("", "0"):
        return False
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"{message}: {ALLOW_ENV} is set, going on", RuntimeWarning, stacklevel=3)
    return True


def check_supported(distribution: str, installed: str | None = None) -> str:
    """Raise :class:`UnsupportedVersionError` unless ``distribution`` (installed version, or
    ``installed`` when given) is inside :data:`SUPPORTED`; returns the version checked. With
    ``DS_LOWCOMM_ALLOW_UNSUPPORTED_VERSIONS=1`` a version outside the range warns instead."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    version = installed if installed is not None else installed_version(distribution)
    try:
        spec = supported_range(distribution)
    except UnsupportedVersionError as err:  # no metadata to read the range from
        if version is not None and _allowed(f"{distribution} (no metadata)", str(err)):
            return version
        raise
    if version is None:
        raise UnsupportedVersionError(f"{distribution} is not installed; ds_lowcomm supports {distribution}{spec}")
    # A local build of a supported release (0.19.8+cu121) counts as it.
    if Version(Version(version).base_version) in SpecifierSet(spec):
        return version
    message = (f"{distribution} {version} is installed; ds_lowcomm supports {distribution}{spec} (the private "
               f"internals it uses are checked against those versions). Install a supported version "
               f"(pip install '{distribution}{spec}'), or set {ALLOW_ENV}=1 to try this one anyway")
    if _allowed(distribution, message):
        return version
    raise UnsupportedVersionError(message)
