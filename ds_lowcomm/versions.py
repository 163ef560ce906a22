"""The framework versions the integrations support, and the start-up check against them.

The DeepSpeed glue and ``megatron_patches`` reach into private internals of their frameworks (each
through its own ``internals.py``, which checks every one at first use). Those internals move
between releases, so the supported ranges are pinned here, once, and in ``pyproject.toml`` (a test
keeps the two equal); ``ds_lowcomm.deepspeed.initialize`` and ``megatron_patches.apply`` call
:func:`check_supported` before they touch anything. Outside the range the run stops with the
installed and supported versions, unless ``DS_LOWCOMM_ALLOW_UNSUPPORTED_VERSIONS=1`` is set: then
it warns once and goes on, and the internals checks still stop it where something it needs moved.

A leaf module: it imports nothing of ds_lowcomm.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings

# distribution name -> the range the suite runs on (lower bound: the version the suite was run
# against; upper bound: the next minor release, whose internals nobody has checked yet)
SUPPORTED = {
    "deepspeed": ">=0.19.8,<0.20",
    "megatron-core": ">=0.16.1,<0.17",
}

ALLOW_ENV = "DS_LOWCOMM_ALLOW_UNSUPPORTED_VERSIONS"

_warned: set[str] = set()


class UnsupportedVersionError(RuntimeError):
    """An installed framework outside the range ds_lowcomm supports."""


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_supported(distribution: str, installed: str | None = None) -> str:
    """Raise :class:`UnsupportedVersionError` unless ``distribution`` (installed version, or
    ``installed`` when given) is inside :data:`SUPPORTED`; returns the version checked. With
    ``DS_LOWCOMM_ALLOW_UNSUPPORTED_VERSIONS=1`` a version outside the range warns instead."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    spec = SUPPORTED[distribution]
    version = installed if installed is not None else installed_version(distribution)
    if version is None:
        raise UnsupportedVersionError(f"{distribution} is not installed; ds_lowcomm supports {distribution}{spec}")
    # A local build of a supported release (0.19.8+cu121) counts as it.
    if Version(Version(version).base_version) in SpecifierSet(spec):
        return version
    message = (f"{distribution} {version} is installed; ds_lowcomm supports {distribution}{spec} (the private "
               f"internals it uses are checked against those versions). Install a supported version "
               f"(pip install '{distribution}{spec}'), or set {ALLOW_ENV}=1 to try this one anyway")
    if os.environ.get(ALLOW_ENV, "") not in ("", "0"):
        if distribution not in _warned:
            _warned.add(distribution)
            warnings.warn(f"{message}: {ALLOW_ENV} is set, going on", RuntimeWarning, stacklevel=2)
        return version
    raise UnsupportedVersionError(message)
