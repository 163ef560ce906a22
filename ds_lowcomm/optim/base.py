"""What every ds_lowcomm optimizer shares: a transport with its ledger, the start-up
consistency check, and a state_dict that keeps state dtypes and the communication state."""

from __future__ import annotations

from typing import Any

import torch

from ..comm import TorchDistTransport, Transport, assert_same_across_ranks


def ordered_params(param_groups) -> list[torch.Tensor]:
    return [p for g in param_groups for p in g["params"]]


class LowcommOptimizer(torch.optim.Optimizer):
    """Base class. Subclasses set ``method`` and may add counters via ``_extra_state``."""

    method = ""

    def _init_comm(self, transport: Transport | None, settings: dict[str, Any]) -> None:
        self.transport = transport if transport is not None else TorchDistTransport()
        params = ordered_params(self.param_groups)
        settings = {
            "method": self.method,
            "world_size": self.transport.world_size,
            **settings,
            "param_shapes": [list(p.shape) for p in params],
            "param_dtypes": [str(p.dtype) for p in params],
        }
        self.settings = settings
        assert_same_across_ranks(self.transport, settings, params)

    @property
    def ledger(self):
        return self.transport.ledger

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
        lowcomm = state_dict.pop("lowcomm")
        if lowcomm["settings"] != self.settings:
            mine, saved = self.settings, lowcomm["settings"]
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
