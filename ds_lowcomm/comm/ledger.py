"""The byte ledger: what this worker put on the wire and took off it, recorded at each collective.

Conventions (payload bytes, independent of the collective's algorithm):
- all-gather of P bytes per rank: sent P, received (n - 1) * P.
- all-reduce of N bytes: sent N, received N (every worker contributes and gets back N bytes;
  this is how the DeMo paper reports its AdamW-DDP baseline).
"""

from __future__ import annotations

from array import array

import torch

# Start-up traffic (the settings check): counted in the run totals, in no step.
SETUP_OP = "setup"


class ByteLedger:
    def __init__(self) -> None:
        self.sent = 0
        self.received = 0
        self.calls = 0
        self.by_op: dict[str, list[int]] = {}  # op -> [calls, sent, received]
        self.seconds: dict[str, float] = {}  # "codec", "comm": wall time spent there
        self._step_sent = array("q")
        self._step_received = array("q")
        self._open_sent = 0
        self._open_received = 0
        # Exchanges a rank sat out for non-finite values: op -> {global rank (str): times}
        self.nonfinite: dict[str, dict[str, int]] = {}

    def record_nonfinite(self, op: str, ranks: list[int]) -> None:
        row = self.nonfinite.setdefault(op, {})
        for r in ranks:
            row[str(r)] = row.get(str(r), 0) + 1

    def record(self, op: str, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received
        self.calls += 1
        if op != SETUP_OP:
            self._open_sent += sent
            self._open_received += received
        row = self.by_op.setdefault(op, [0, 0, 0])
        row[0] += 1
        row[1] += sent
        row[2] += received

    def add_time(self, kind: str, seconds: float) -> None:
        self.seconds[kind] = self.seconds.get(kind, 0.0) + seconds

    def end_step(self) -> None:
        """Close the current optimizer step: its bytes become one entry of the per-step history."""
        self._step_sent.append(self._open_sent)
        self._step_received.append(self._open_received)
        self._open_sent = self._open_received = 0

    def drop_open_step(self) -> None:
        """Leave the bytes recorded since the last closed step out of every step (they stay in the
        totals): start-up traffic recorded under other op names than ``SETUP_OP``."""
        self._open_sent = self._open_received = 0

    @property
    def steps(self) -> int:
        return len(self._step_sent)

    def step_bytes(self, step: int = -1) -> tuple[int, int]:
        """(sent, received) of one closed step (default: the last)."""
        return self._step_sent[step], self._step_received[step]

    def summary(self) -> dict:
        return {
            "steps": self.steps,
            "bytes_sent": self.sent,
            "bytes_received": self.received,
            "calls": self.calls,
            "by_op": {k: {"calls": c, "sent": s, "received": r} for k, (c, s, r) in self.by_op.items()},
            "seconds": dict(self.seconds),
            "nonfinite": {k: dict(v) for k, v in self.nonfinite.items()},
        }

    def state_dict(self) -> dict:
        return {
            "sent": self.sent,
            "received": self.received,
            "calls": self.calls,
            "by_op": {k: list(v) for k, v in self.by_op.items()},
            "seconds": dict(self.seconds),
            "step_sent": torch.tensor(self._step_sent, dtype=torch.int64),
            "step_received": torch.tensor(self._step_received, dtype=torch.int64),
            "nonfinite": {k: dict(v) for k, v in self.nonfinite.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.sent, self.received, self.calls = state["sent"], state["received"], state["calls"]
        self.by_op = {k: list(v) for k, v in state["by_op"].items()}
        self.seconds = dict(state["seconds"])
        self._step_sent = array("q", state["step_sent"].tolist())
        self._step_received = array("q", state["step_received"].tolist())
        self._open_sent = self._open_received = 0
        self.nonfinite = {k: dict(v) for k, v in state.get("nonfinite", {}).items()}
