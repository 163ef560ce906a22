"""Checkpoint files that are never half-written, load without running code, and prove their bytes.

Every checkpoint file ds_lowcomm writes (its own, and DeepSpeed's through the engine's checkpoint
engine) goes through :func:`save_file`: written under a temporary name, flushed to disk, renamed,
with a sidecar ``<file>.sha256`` holding the digest of the bytes as they were written (hashed on
the way out, not re-read). :func:`load_file` checks that digest, then reads the file with
``torch.load(weights_only=True)``: tensors, containers and plain types only, so a pickled
``os.system`` in a checkpoint is refused, not run. Which checkpoint is the latest is written last
(:func:`write_text`), so a crash mid-save leaves the previous complete one named.
:func:`params_digest` is the digest of parameters themselves, by which runs, resumes and
replicas are compared bit for bit (one function for the library, the integrations and the tests).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

DIGEST_SUFFIX = ".sha256"
LATEST = "latest"  # the file naming a directory's last complete checkpoint (DeepSpeed's name)


class CheckpointError(RuntimeError):
    """A checkpoint file is corrupt, incomplete, or holds something other than data."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some file systems do not open directories
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HashingWriter:
    """A file that hashes what goes through it (torch.save writes only forward)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def atomic_write(path: str | os.PathLike, write: Callable[[Any], None]) -> str:
    """``write(f)`` into a temporary file beside ``path``, fsync, rename; returns the sha256 of
    the bytes written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            hashing = _HashingWriter(f)
            write(hashing)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)
    return hashing.sha.hexdigest()


def write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write(path, lambda f: f.write(text.encode()))


def read_latest(directory: str | os.PathLike) -> str:
    """The tag ``directory/latest`` names (written only once its checkpoint was complete)."""
    path = Path(directory) / LATEST
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory}: no {LATEST} file, so no complete checkpoint there") from None


def save_file(obj: Any, path: str | os.PathLike, **torch_save_kwargs) -> None:
    """``torch.save`` atomically, then the digest sidecar (a file without a valid sidecar is
    never taken for complete)."""
    digest = atomic_write(path, lambda f: torch.save(obj, f, **torch_save_kwargs))
    write_text(f"{path}{DIGEST_SUFFIX}", digest + "\n")


def write_digest(path: str | os.PathLike) -> None:
    """The digest sidecar for a complete file another library wrote (Megatron's distributed
    checkpoints), checked like :func:`save_file`'s by :func:`check_digest`."""
    write_text(f"{path}{DIGEST_SUFFIX}", file_digest(path) + "\n")


def file_digest(path: str | os.PathLike) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def params_digest(model: torch.nn.Module | Iterable[torch.nn.Module | torch.Tensor]) -> str:
    """sha256 over parameters' bytes as they are stored (any dtype, on any device), in order: of
    a module, of a model's chunks (Megatron's virtual pipeline stages), or of the tensors given.
    Equal digests mean bit-identical parameters: runs and replicas are compared by it."""
    items = [model] if isinstance(model, torch.nn.Module) else model
    sha = hashlib.sha256()
    for item in items:
        for t in item.parameters() if isinstance(item, torch.nn.Module) else [item]:
            # the stored bytes, uncast: bf16 has no numpy dtype; bytes are what bit-identical means
            sha.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def check_digest(path: str | os.PathLike, required: bool = True) -> str | None:
    """Why ``path`` fails its digest check (missing, no sidecar, bytes changed), or None."""
    path = Path(path)
    sidecar = Path(f"{path}{DIGEST_SUFFIX}")
    if not path.exists():
        return f"{path}: missing"
    if not sidecar.exists():
        return f"{path}: no {sidecar.name} (not written by ds_lowcomm, or the save did not finish)" if required else None
    expected = sidecar.read_text().strip()
    if file_digest(path) != expected:
        return f"{path}: sha256 differs from {sidecar.name} (the file changed after it was written)"
    return None


def check_digests(paths: Iterable[str | os.PathLike], required: bool = True) -> list[str]:
    return [why for p in paths if (why := check_digest(p, required)) is not None]


def agree_on_problems(problems: list[str], what: str = "checkpoint not loaded",
                      gather: Callable[[list[str]], list[list[str]]] | None = None) -> None:
    """Collective (the whole job): raise on every rank if any rank found a problem, naming them
    all, so that no rank goes on into collectives the others never join. ``what``: the error's
    opening words; ``gather``: every rank's list from this rank's (a collective bounded by the
    caller's timeout), by default torch.distributed's ``all_gather_object`` on the default group."""
    import torch.distributed as dist

    everyone = [problems]
    if gather is not None:
        everyone = gather(problems)
    elif dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problems)
    found = [f"rank {r}: {why}" for r, mine in enumerate(everyone) for why in mine]
    if found:
        raise CheckpointError(f"{what}: " + "; ".join(found))


def load_file(path: str | os.PathLike, map_location=None, *, allowed: Iterable[Any] = (),
              digest: str = "required") -> Any:
    """The digest check, then ``torch.load(weights_only=True)``; ``allowed``: classes a framework's
    checkpoints hold besides data (enums, say), allowed by name and nothing more. ``digest``:
    "required", "if_present" (files DeepSpeed wrote on its own), or "checked" (the caller did)."""
    if digest != "checked":
        why = check_digest(path, required=digest == "required")
        if why is not None:
            raise CheckpointError(why)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # torch's UnpicklingError names the global it refused
        if "weights_only" in str(err) or "Unsupported global" in str(err):
            lines = [ln.strip() for ln in str(err).splitlines() if "Unsupported" in ln or "GLOBAL" in ln]
            raise CheckpointError(f"{path} holds objects other than tensors and plain data, and is not loaded "
                                  f"(no code runs from a checkpoint): {lines[0] if lines else str(err).splitlines()[0]}"
                                  ) from None
        raise
