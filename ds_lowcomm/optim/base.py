"""What every ds_lowcomm optimizer shares: a transport with its ledger, the start-up
consistency check, lazily built per-parameter state and sync layouts, and a state_dict that
keeps state dtypes and the communication state.

State and layouts are built at the first real step, for whatever parameters the param_groups
hold then: DeepSpeed swaps them after construction (fp32 master copies for bf16/fp16, flat
partitions for ZeRO 1/2, which also steps one group at a time).
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import ReplicaShard, SparseAllGather, TorchDistTransport, Transport, assert_same_across_ranks


def ordered_params(param_groups) -> list[torch.Tensor]:
    return [p for g in param_groups for p in g["params"]]


class LowcommOptimizer(torch.optim.Optimizer):
    """Base class. Subclasses set ``method`` and may add counters via ``_extra_state``."""

    method = ""
    # The optimizer closes a ledger step at the end of step(); the DeepSpeed glue turns this off
    # and closes it at the engine's step boundary instead.
    manage_ledger_steps = True
    # Set by the DeepSpeed glue at ZeRO 0 with replicas of several ranks: this rank syncs only the
    # parameters it owns and shares them inside its replica (see comm/shard.py).
    shard: ReplicaShard | None = None

    def _init_comm(self, transport: Transport | None, settings: dict[str, Any], codec: dict[str, Any] | None = None) -> None:
        self.transport = transport if transport is not None else TorchDistTransport()
        self._codec = codec
        self._syncs: dict[tuple[int, ...], SparseAllGather] = {}
        params = ordered_params(self.param_groups)
        settings = {
            "method": self.method,
            "world_size": self.transport.world_size,
            **settings,
            **(codec or {}),
            "param_shapes": [list(p.shape) for p in params],
            "param_dtypes": [str(p.dtype) for p in params],
        }
        self.settings = settings
        assert_same_across_ranks(self.transport, settings, params)

    @property
    def ledger(self):
        return self.transport.ledger

    def _current_params(self) -> list[torch.Tensor]:
        return ordered_params(self.param_groups)

    def _sync_for(self, params: list[torch.Tensor], op: str) -> SparseAllGather:
        """The compressed exchange for this exact list of tensors (built once, then reused)."""
        key = tuple(id(p) for p in params)
        sync = self._syncs.get(key)
        if sync is None:
            sync = SparseAllGather([p.shape for p in params], transport=self.transport, op=op, **self._codec)
            self._syncs[key] = sync
        return sync

    @staticmethod
    def _evaluate_closure(closure):
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _is_placeholder_step(self, params: list[torch.Tensor]) -> bool:
        """DeepSpeed's fp16/bf16 wrapper calls step() once at construction with zero gradients.
        Before any state exists, a step whose gradients are all missing or zero changes nothing
        worth keeping; skipping it keeps counters, weight decay and schedules exact."""
        if any(self.state.get(p) for p in params):
            return False
        return all(p.grad is None or not p.grad.any() for p in params)

    def _owned(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        return params if self.shard is None else self.shard.owned(params)

    def _share(self, params: list[torch.Tensor]) -> None:
        if self.shard is not None:
            self.shard.share(params)

    def _finish_step(self) -> None:
        if self.manage_ledger_steps:
            self.ledger.end_step()

    # -- checkpointing ------------------------------------------------------------------
    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["lowcomm"] = {"settings": self.settings, "ledger": self.ledger.state_dict(), **self._extra_state()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        lowcomm = state_dict.pop("lowcomm", None)
        if lowcomm is None:
            raise ValueError(f"not a ds_lowcomm {self.method} optimizer state (no 'lowcomm' entry)")
        mine, saved = self.settings, lowcomm["settings"]
        if mine != saved:
            diffs = [k for k in sorted(set(mine) | set(saved)) if mine.get(k) != saved.get(k)]
            raise ValueError(
                "checkpoint was saved with other lowcomm settings: "
                + "; ".join(f"{k}: saved {saved.get(k)!r}, now {mine.get(k)!r}" for k in diffs)
            )
        load_preserving_dtypes(self, state_dict)
        self.ledger.load_state_dict(lowcomm["ledger"])
        self._load_extra_state(lowcomm)


def load_preserving_dtypes(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``Optimizer.load_state_dict`` casts floating state to each parameter's dtype, which would
    round fp32 momenta of bf16/fp16 parameters; load, then put the saved dtypes back."""
    torch.optim.Optimizer.load_state_dict(optimizer, state_dict)
    params = ordered_params(optimizer.param_groups)
    saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    by_id = dict(zip(saved_ids, params))
    for pid, saved in state_dict["state"].items():
        p = by_id[pid]
        for key, value in saved.items():
            if torch.is_tensor(value) and value.is_floating_point() and key != "step":
                optimizer.state[p][key] = value.to(device=p.device, copy=True)
