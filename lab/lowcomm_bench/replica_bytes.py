"""``python -m lowcomm_bench replica_bytes``: bytes each worker sends on its link per step as
replicas grow, measured on test hosts (2, 4 and 8 here) and computed from the wire format beyond
(16, 64, 256) with the planner's formula (the method's declared messages,
:func:`ds_lowcomm.optim.registry.planned_wire`, on the wire as :func:`ds_lowcomm.plan.wire_bytes`
puts them: a ring all-gather forwards (n - 1) payloads, a ring all-reduce sends 2 (n - 1) / n of
its buffer, the compressed all-reduce's all-to-all its (n - 1) parts; each receives what it sends).

``--exchanges``: for the outer methods with a dense sign / 2-bit payload (dct_diloco, sparseloco),
one row per ``lowcomm.exchange`` setting (auto, all_gather, all_reduce; the ``exchange`` column is
the setting, ``exchange_used`` what it resolved to at that replica count; an explicit setting
equal to auto's choice is measured once, as auto).

Measured: each entry trains the reference task on n test hosts (unshaped) for ``--steps`` K1 and
then K2 steps in the same test network; every host's veth counts the bytes it transmits (IP
packets with their TCP and Ethernet headers, ACKs of what it receives included). The second run's
bytes less the first's, over K2 - K1 steps, is a step's (start-up, the settings check, the final
evaluation's all-reduce cancel out). Outer-loop methods run with ``sync_every`` 1, so a step is a
sync: their per-step figure is that over H. The formula's payload times the framing of full
segments (:data:`ds_lowcomm.plan.WIRE_OVERHEAD`) is printed beside it; small messages carry
relatively more headers, so a measured figure above the formula's by a few percent is framing.
Each host's veth also counts what it receives (``measured_received_bytes_per_sync``), and the
workers' ledgers give the same difference in their own convention (``ledger_sent_bytes_per_sync``,
``ledger_received_bytes_per_sync``: what ``ds-lowcomm compare`` reports; an all-gather books its
payload once sent and (n - 1) times received, so the larger of the two is the wire's).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import subprocess
from pathlib import Path

from ds_lowcomm import plan as planner
from ds_lowcomm.optim.outer import EXCHANGES, resolve_exchange
from ds_lowcomm.optim.registry import LowcommConfig, planned_wire

from .codec import write_csv
from .hosts import run_on_hosts
from .netns import LinkShape, TestNetwork, check_can_create
from .runs import add_model_args, model_of
from .time_to_loss import ENTRIES, entry_spec

COLUMNS = ["entry", "method", "replicas", "sync_every", "measured", "wire_bytes_per_sync", "framed_bytes_per_sync",
           "measured_bytes_per_sync", "measured_over_framed", "wire_bytes_per_step", "exchange", "exchange_used",
           "measured_received_bytes_per_sync", "ledger_sent_bytes_per_sync", "ledger_received_bytes_per_sync"]
DEFAULT_ENTRIES = "adamw,muon_bf16,demo_muon,demo_muon_c16,dion,muloco,muloco_sparse"


def tx_bytes(net: TestNetwork, counter: str = "tx_bytes") -> list[int]:
    """Bytes each test host has transmitted (``counter`` rx_bytes: received) on its veth since
    the network was made."""
    out = []
    for i in range(net.hosts):
        path = f"/sys/class/net/{net.interface(i)}/statistics/{counter}"
        out.append(int(subprocess.run(net.command(i, ["cat", path]), capture_output=True, text=True,
                                      check=True).stdout))
    return out


def powersgd_all_reduces(shapes, rank: int, min_compression_rate: float = 2.0) -> list[int]:
    """Bytes of the three fp32 all-reduces torch's ``powerSGD_hook`` issues per bucket once compressing
    (one bucket here, ``bench.peers.peer_setup``): the tensors it leaves uncompressed, then the Ps,
    then the Qs. Each tensor is viewed as (shape[0], -1) and compressed at rank min(n, m, rank) when
    (n + m) x rank x ``min_compression_rate`` < n x m, as the hook's ``_should_compress`` decides."""
    plain = ps = qs = 0
    for s in shapes:
        n = s[0]
        m = math.prod(s) // n
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            ps, qs = ps + n * r, qs + m * r
        else:
            plain += n * m
    return [4 * plain, 4 * ps, 4 * qs]


def planned(entry: str, spec, peer: dict | None, model: dict, replicas: int) -> tuple[str, int, float]:
    """(method, steps per sync, payload bytes a worker puts on its link per sync) by the formula."""
    shapes = planner.gpt_shapes(model["n_layer"], model["n_embd"], seq_len=model["seq_len"])
    matrices = planner.hidden_matrices("reference", shapes)
    if peer is not None and peer.get("kind") == "ddp_powersgd":
        return "powersgd", 1, sum(planner.wire_bytes(planner.Message("powersgd", "all_reduce", n), replicas)
                                  for n in powersgd_all_reduces(shapes, peer["rank"]))
    if peer is not None:  # DDP: one all-reduce of every gradient a step, fp32 or bf16 (its hooks; no health flag)
        grad = 2 if peer.get("compress") == "bf16" else 4
        n = sum(math.prod(s) for s in shapes) * grad
        return "ddp", 1, planner.wire_bytes(planner.Message("ddp", "all_reduce", n), replicas)
    cfg = LowcommConfig.from_dict(spec.lowcomm)
    wire = planned_wire(cfg, shapes, matrices=matrices, replicas=replicas)
    return cfg.method, wire.sync_every, sum(planner.wire_bytes(m, replicas) for m in wire.messages)


def exchange_used(spec, replicas: int) -> str | None:
    """What an outer method's ``lowcomm.exchange`` resolves to at ``replicas`` (None: no such setting)."""
    settings = LowcommConfig.from_dict(spec.lowcomm).settings
    return resolve_exchange(settings.exchange, settings.codec, replicas) if hasattr(settings, "exchange") else None


def measure(entry: str, spec, peer: dict | None, model: dict, n: int, h: int, measured: bool,
            steps: tuple[int, int]) -> dict:
    """One row: the formula's bytes per sync at ``n`` replicas and, ``measured``, n test hosts'
    veth counters and ledgers (the K2-step run less the K1-step run, over K2 - K1 syncs)."""
    method, every, wire = planned(entry, spec, peer, model, n)
    row = {"entry": entry, "method": method, "replicas": n, "sync_every": h, "measured": measured,
           "wire_bytes_per_sync": wire, "framed_bytes_per_sync": wire * planner.WIRE_OVERHEAD,
           "measured_bytes_per_sync": None, "measured_over_framed": None, "wire_bytes_per_step": wire / h,
           "measured_received_bytes_per_sync": None, "ledger_sent_bytes_per_sync": None,
           "ledger_received_bytes_per_sync": None}
    if measured:
        k1, k2 = steps
        check_can_create()
        with TestNetwork(n, LinkShape()) as net:
            counts, ledgers = [], []
            for k in (k1, k2):
                metrics, _ = run_on_hosts(net, dataclasses.replace(spec, steps=k, eval_every=k, warmup=1), peer)
                counts.append((tx_bytes(net), tx_bytes(net, "rx_bytes")))
                ledgers.append([(m.get("bytes_sent", 0), m.get("bytes_received", 0)) for m in metrics])
        # counters since the network was made: the second run's own less the first's
        (tx1, rx1), (tx2, rx2) = counts
        syncs = k2 - k1
        row["measured_bytes_per_sync"] = sum((b - a) - a for a, b in zip(tx1, tx2)) / n / syncs
        row["measured_received_bytes_per_sync"] = sum((b - a) - a for a, b in zip(rx1, rx2)) / n / syncs
        row["measured_over_framed"] = row["measured_bytes_per_sync"] / row["framed_bytes_per_sync"]
        row["ledger_sent_bytes_per_sync"] = sum(b[0] - a[0] for a, b in zip(*ledgers)) / n / syncs
        row["ledger_received_bytes_per_sync"] = sum(b[1] - a[1] for a, b in zip(*ledgers)) / n / syncs
    print(f"{entry:<16} n={n:<3} formula {wire / 1e3:10.1f} kB/sync (framed {wire * planner.WIRE_OVERHEAD / 1e3:.1f})"
          + (f", measured sent {row['measured_bytes_per_sync'] / 1e3:.1f} / received "
             f"{row['measured_received_bytes_per_sync'] / 1e3:.1f} kB, ledger sent "
             f"{row['ledger_sent_bytes_per_sync'] / 1e3:.1f} / received {row['ledger_received_bytes_per_sync'] / 1e3:.1f}"
             if measured else "")
          + f"; per step {wire / h / 1e3:.2f} kB (H {h})", flush=True)
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench replica_bytes", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/replica_bytes")
    ap.add_argument("--entries", default=DEFAULT_ENTRIES, help=f"comma list of {', '.join(ENTRIES)}")
    ap.add_argument("--hosts", default="2,4,8", help="measured on this many test hosts")
    ap.add_argument("--replicas", default="16,64,256", help="computed from the wire format for these")
    ap.add_argument("--exchanges", default="auto", help=f"comma list of {', '.join(EXCHANGES)}: each a row for the "
                    "entries that have the setting (dct_diloco, sparseloco)")
    ap.add_argument("--steps", default="3,8", help="K1,K2: the two runs' steps")
    add_model_args(ap)
    args = ap.parse_args(argv)
    entries = [e.strip() for e in args.entries.split(",")]
    bad = [e for e in entries if e not in ENTRIES]
    if bad:
        raise SystemExit(f"--entries: unknown {', '.join(bad)}; allowed: {', '.join(ENTRIES)}")
    exchanges = [e.strip() for e in args.exchanges.split(",")]
    if [e for e in exchanges if e not in EXCHANGES]:
        raise SystemExit(f"--exchanges: one of {', '.join(EXCHANGES)} each; got {args.exchanges}")
    k1, k2 = (int(x) for x in args.steps.split(","))
    hosts = [int(h) for h in args.hosts.split(",")]
    model = model_of(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for entry in entries:
        spec, peer = entry_spec(entry, k2, k2, model)
        if "sync_every" in spec.lowcomm or LowcommConfig.from_dict(spec.lowcomm).method in ("diloco", "dct_diloco",
                                                                                              "sparseloco"):
            h = LowcommConfig.from_dict(spec.lowcomm).effective()["sync_every"]
            spec = dataclasses.replace(spec, lowcomm={**spec.lowcomm, "sync_every": 1, "fragments": 1,
                                                      "sync_delay": 0})
        else:
            h = 1
        has_exchange = "exchange" in LowcommConfig.from_dict(spec.lowcomm).effective()
        for exchange in exchanges if has_exchange else [None]:
            variant = dataclasses.replace(spec, lowcomm={**spec.lowcomm, "exchange": exchange}) if exchange else spec
            for n in sorted({*hosts, *(int(r) for r in args.replicas.split(","))}):
                used = exchange_used(variant, n)
                if exchange not in (None, "auto") and "auto" in exchanges and used == exchange_used(spec, n):
                    continue  # auto's row is this one
                rows.append(measure(entry, variant, peer, model, n, h, n in hosts, (k1, k2)))
                rows[-1].update(exchange=exchange, exchange_used=used)
                write_csv(out / "replica_bytes.csv", rows, COLUMNS)
    (out / "replica_bytes.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
