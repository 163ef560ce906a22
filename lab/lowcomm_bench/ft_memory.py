"""``python -m lowcomm_bench ft_memory``: the memory live fault tolerance takes on top of a method.

A replica over torchft (a lighthouse in this process, one replica: every exchange runs, with no
peer to wait for) trains a model of ``--layers`` square ``--width`` linear layers (fp32, on the
CPU) with each method. Measured in a fresh process per method, with glibc told to map every
allocation above 64 KiB on its own (``MALLOC_MMAP_THRESHOLD_``), so that a freed tensor leaves
the resident set and the peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``)
is the peak of the live tensors:

- ``peak_mb``: the peak resident set over a sync step's ``optimizer.step()`` (the gradients
  already made), and ``resident_mb`` the resident set just before it; ``extra_peak_mb`` and
  ``extra_resident_mb``: the same less the same method's without fault tolerance (one process,
  its own world of one): what fault tolerance adds, held between steps or for the step;
- ``kept_mb``: the copies fault tolerance makes before an exchange, for a try that fails
  (counted: the bytes of the tensors copied in optim/base.py);
- ``snapshot_mb``: the bytes of the state a joining replica is served (the heal snapshot), and
  ``snapshot_device_mb`` the bytes of it first copied on the parameters' own device (``clone``:
  a GPU's memory where the parameters are on one; 0 where it is copied straight to CPU memory).

``--also LABEL=DIR`` measures another checkout of ds_lowcomm the same way, in rows of its own
(docs/bench/fault-tolerance/2026-11-27-cpu-memory.csv's "before": the commit before issue 44's changes, ``git worktree add
DIR 63636f6``). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

METHODS = ("diloco", "sparseloco", "demo", "adamw")
COLUMNS = ["method", "code", "params_mb", "peak_mb", "resident_mb", "extra_peak_mb", "extra_resident_mb", "kept_mb",
           "snapshot_mb", "snapshot_device_mb"]
MB = 1e6


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS


def worker(method: str, layers: int, width: int, lighthouse: str | None) -> dict:
    """One method's figures, in this process (ds_lowcomm from sys.path: this checkout or another);
    ``lighthouse`` None: without fault tolerance."""
    import torch

    from ds_lowcomm.optim.registry import METHOD_CLASSES

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    if lighthouse is None:
        import torch.distributed as dist

        from ds_lowcomm.comm import TorchDistTransport

        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        ft, transport = None, TorchDistTransport()
    else:
        from ds_lowcomm.optim.fault_tolerance import FaultTolerance, FaultToleranceSettings

        ft = FaultTolerance(FaultToleranceSettings(lighthouse=lighthouse, replica_id="0", timeout_s=30),
                            host="127.0.0.1")
        transport = ft.transport
    sync_every = 2
    codec = {"topk": 32, "chunk": 64} if method in ("demo", "sparseloco") else {}
    if method in ("demo", "adamw"):
        opt = METHOD_CLASSES[method](model.parameters(), lr=1e-3, transport=transport, **codec)
    else:
        opt = METHOD_CLASSES[method](torch.optim.AdamW(model.parameters(), lr=1e-3), transport=transport,
                                     sync_every=sync_every, **codec)
    if ft is not None:
        ft.attach(opt)
    kept = [0]
    clone = torch.Tensor.clone

    def counted_clone(t, *a, **k):  # the copies fault tolerance makes before an exchange (optim/base.py's)
        if sys._getframe(1).f_code.co_filename.endswith(os.path.join("optim", "base.py")):
            kept[0] += t.numel() * t.element_size()
        return clone(t, *a, **k)

    x = torch.randn(8, width)
    for _ in range(3 * sync_every - 1):  # the state made, two syncs done, up to the step before the third
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    model(x).square().mean().backward()
    resident = _status("VmRSS")
    _reset_peak()
    torch.Tensor.clone = counted_clone
    try:
        opt.step()  # the sync step
    finally:
        torch.Tensor.clone = clone
    peak = _status("VmHWM")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    row = {"method": method, "params_mb": params / MB, "peak_mb": peak / MB, "resident_mb": resident / MB,
           "kept_mb": kept[0] / MB, "snapshot_mb": 0.0, "snapshot_device_mb": 0.0}
    if ft is None:
        return row
    from ds_lowcomm.optim.fault_tolerance import tensor_bytes

    device_bytes = [0]

    def counted_clone_device(t, *a, **k):  # a snapshot's copy made on the parameters' own device (clone)
        if sys._getframe(1).f_code.co_filename.endswith(os.path.join("optim", "fault_tolerance.py")):
            device_bytes[0] += t.numel() * t.element_size()
        return clone(t, *a, **k)

    torch.Tensor.clone = counted_clone_device
    try:
        snapshot = ft._state()
    finally:
        torch.Tensor.clone = clone
    ft.shutdown()
    return {**row, "snapshot_mb": tensor_bytes(snapshot) / MB, "snapshot_device_mb": device_bytes[0] / MB}


def _run(method: str, code: str, lighthouse: str | None, args) -> dict:
    env = {**os.environ, "PYTHONPATH": code, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "", "RUST_LOG": "error"}
    cmd = [sys.executable, "-c", "import runpy, sys; sys.argv[0] = 'ft_memory'; "
           f"runpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')",
           "--worker", method, "--layers", str(args.layers), "--width", str(args.width),
           *(("--lighthouse", lighthouse) if lighthouse else ())]
    done = subprocess.run(cmd, env=env, cwd=code, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"{method}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench ft_memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/ft_memory")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--also", action="append", default=[], metavar="LABEL=DIR",
                    help="measure the ds_lowcomm checkout in DIR too, its rows' code column LABEL")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.layers, args.width, args.lighthouse)))
        return []
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=100, heartbeat_timeout_ms=2000)
    address = "127.0.0.1:" + server.address().rsplit(":", 1)[1]
    here = str(Path(__file__).resolve().parents[2])
    codes = [("this", here), *(tuple(item.split("=", 1)) for item in args.also)]
    rows = []
    try:
        for method in args.methods.split(","):
            plain = _run(method, here, None, args)  # the method without fault tolerance
            for label, code in codes:
                row = _run(method, code, address, args)
                row.update(code=label, extra_peak_mb=row["peak_mb"] - plain["peak_mb"],
                           extra_resident_mb=row["resident_mb"] - plain["resident_mb"])
                rows.append(row)
                print(", ".join(f"{k} {row[k]:.1f}" if isinstance(row[k], float) else f"{k} {row[k]}"
                                for k in COLUMNS), flush=True)
    finally:
        server.shutdown()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "ft_memory.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
