"""Checkpoints of a ds_lowcomm engine: ``save_checkpoint`` / ``load_checkpoint`` patched in."""

from __future__ import annotations

import json
import os
import types
from typing import Any

import torch.distributed as dist

CHECKPOINT_META = "lowcomm.json"


def patch_checkpoint(engine, run) -> None:
    save, load = engine.save_checkpoint, engine.load_checkpoint

    def replica_dir(base: str) -> str:
        # One DeepSpeed checkpoint per replica: DeepSpeed writes the files of data-parallel rank 0
        # (ZeRO 0) or of each data-parallel rank (ZeRO 1/2) of *its* group, so without this the
        # replicas would overwrite each other and every rank's method state but one would be lost.
        return os.path.join(base, f"replica{run.topology.replica:05d}")

    def meta(self) -> dict[str, Any]:
        return {"world_size": run.topology.world_size, "replica_size": run.topology.replica_size,
                "method": run.config.lowcomm.method, "zero_stage": run.config.zero_stage}

    def lowcomm_save(self, save_dir, tag=None, client_state={}, save_latest=True, **kwargs):
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"  # DeepSpeed's default
        if dist.get_rank() == 0:
            # DeepSpeed writes its "latest" file on global rank 0 only, so the other replicas'
            # directories lack it: the latest tag is kept here, for every replica.
            os.makedirs(save_dir, exist_ok=True)
            with open(os.path.join(save_dir, CHECKPOINT_META), "w") as f:
                json.dump({**meta(self), "latest": tag if save_latest else None}, f)
        return save(replica_dir(save_dir), tag, client_state=client_state, save_latest=save_latest, **kwargs)

    def lowcomm_load(self, load_dir, tag=None, **kwargs):
        path = os.path.join(load_dir, CHECKPOINT_META)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{load_dir}: no {CHECKPOINT_META}; not a checkpoint written by ds_lowcomm")
        with open(path) as f:
            saved = json.load(f)
        now = meta(self)
        diffs = [f"{k}: saved {saved.get(k)!r}, now {now[k]!r}" for k in now if saved.get(k) != now[k]]
        if diffs:
            raise ValueError(f"{load_dir}: checkpoint does not fit this run ({'; '.join(diffs)})")
        tag = tag if tag is not None else saved.get("latest")
        if tag is None:
            raise FileNotFoundError(f"{load_dir}: no latest checkpoint recorded; pass tag=")
        path, client_state = load(replica_dir(load_dir), tag, **kwargs)
        if path is None:
            raise FileNotFoundError(f"{replica_dir(load_dir)}/{tag}: DeepSpeed found no checkpoint to load")
        return path, client_state

    engine.save_checkpoint = types.MethodType(lowcomm_save, engine)
    engine.load_checkpoint = types.MethodType(lowcomm_load, engine)
