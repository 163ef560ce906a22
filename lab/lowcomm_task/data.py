"""The reference task's data: bytes of a real text corpus, split by file, sharded by rank.

Default corpus: the Python standard library's own ``.py`` sources, present wherever Python is.
A user file or directory works the same way. Every 20th file (in sorted path order) is held
out; the training bytes are cut into one shard per worker, and the batch of step ``s`` on rank
``r`` is drawn from a generator seeded by (seed, r, s), so a resumed run sees exactly the batches
the uninterrupted run would have seen.

Shards (``DATA_SHARDS``): "contiguous" (one run of files per worker: each replica sees other
packages, so replicas that train apart drift apart) or "interleaved" (4 KiB blocks dealt in turn:
each worker's shard a sample of the whole corpus, as a DistributedSampler's shuffled indices
give DeepSpeed and Megatron replicas).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

HELD_OUT_EVERY = 20
MAX_TRAIN_BYTES = 4_000_000  # the training bytes read, before they are cut into shards
MAX_VAL_BYTES = 200_000
DATA_SHARDS = ("contiguous", "interleaved")
SHARD_BLOCK = 4096  # bytes of an interleaved shard's blocks (a few sequences each)


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _corpus_files(source: str | Path | None) -> list[Path]:
    if source is None:
        root = stdlib_dir()
        skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
        return sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    path = Path(source)
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file())
    raise FileNotFoundError(f"data: no such file or directory: {source}")


class ByteCorpus:
    def __init__(self, source: str | Path | None = None, max_train_bytes: int = MAX_TRAIN_BYTES,
                 max_val_bytes: int = MAX_VAL_BYTES):
        files = _corpus_files(source)
        if not files:
            raise ValueError(f"data: no files found in {source}")
        train, val = bytearray(), bytearray()
        if len(files) == 1:  # a single file: its last 5% is held out
            data = files[0].read_bytes()
            cut = int(len(data) * 0.95)
            train, val = bytearray(data[:cut][:max_train_bytes]), bytearray(data[cut:][:max_val_bytes])
        else:
            for i, f in enumerate(files):
                dest, cap = (val, max_val_bytes) if i % HELD_OUT_EVERY == 0 else (train, max_train_bytes)
                if len(dest) < cap:
                    dest += f.read_bytes()[: cap - len(dest)]
                if len(train) >= max_train_bytes and len(val) >= max_val_bytes:
                    break
        self.train = torch.tensor(list(train), dtype=torch.int64) if len(train) < 1024 else torch.frombuffer(train, dtype=torch.uint8).to(torch.int64)
        self.val = torch.tensor(list(val), dtype=torch.int64) if len(val) < 1024 else torch.frombuffer(val, dtype=torch.uint8).to(torch.int64)
        self.source = str(source) if source is not None else f"python-stdlib:{stdlib_dir()}"
        self._shards: dict[tuple, torch.Tensor] = {}  # an interleaved shard is a copy: made once

    def shard(self, rank: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
        if layout not in DATA_SHARDS:
            raise ValueError(f"data_shards must be one of {', '.join(DATA_SHARDS)}; got {layout!r}")
        if layout == "interleaved":  # every world_size-th block, from this rank's on
            key = (rank, world_size)
            if key not in self._shards:
                blocks = self.train[: self.train.numel() // (SHARD_BLOCK * world_size) * SHARD_BLOCK * world_size]
                self._shards[key] = blocks.view(-1, SHARD_BLOCK)[rank::world_size].reshape(-1)
            return self._shards[key]
        n = self.train.numel() // world_size
        return self.train[rank * n : (rank + 1) * n]

    def train_batch(self, rank: int, world_size: int, step: int, batch: int, seq: int, seed: int = 0,
                    layout: str = "contiguous"):
        shard = self.shard(rank, world_size, layout)
        if shard.numel() <= seq + 1:
            raise ValueError(f"data: each worker's shard ({shard.numel()} bytes) is shorter than seq_len+1")
        gen = torch.Generator().manual_seed(hash((seed, rank, step)) & 0x7FFF_FFFF_FFFF)
        starts = torch.randint(0, shard.numel() - seq - 1, (batch,), generator=gen)
        return _windows(shard, starts, seq)

    def val_batches(self, num_batches: int, batch: int, seq: int):
        """Fixed, evenly spaced held-out windows: the same on every rank and every run."""
        total = num_batches * batch
        if self.val.numel() <= seq + 1:
            raise ValueError("data: held-out split is shorter than seq_len+1")
        starts = torch.linspace(0, self.val.numel() - seq - 2, total).long()
        return [_windows(self.val, starts[i * batch : (i + 1) * batch], seq) for i in range(num_batches)]


def _windows(data: torch.Tensor, starts: torch.Tensor, seq: int):
    idx = starts.unsqueeze(1) + torch.arange(seq + 1).unsqueeze(0)
    chunk = data[idx]
    return chunk[:, :-1], chunk[:, 1:]
