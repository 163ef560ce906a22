"""Run the reference task's workers as separate processes, each in its own test host (network
namespace) of a :class:`~lowcomm_bench.netns.TestNetwork`, so gloo talks real TCP through
the shaped links."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lowcomm_task.spec import TrainSpec

from .netns import TestNetwork

_port = 29700


def run_on_hosts(net: TestNetwork, spec: TrainSpec, peer: dict | None = None,
                 timeout: float = 3600) -> tuple[list[dict], float]:
    """Start ``net.hosts`` workers on ``spec`` (and ``peer``: see :mod:`lowcomm_bench.worker`);
    return (metrics per rank, wall seconds)."""
    global _port
    _port += 1  # a fresh rendezvous port per run (the previous may linger in TIME_WAIT)
    with tempfile.TemporaryDirectory(prefix="dslc-bench-") as tmp:
        job_path, prefix = Path(tmp) / "job.json", Path(tmp) / "metrics"
        job_path.write_text(json.dumps({"spec": spec.to_dict(), "peer": peer}))
        procs, logs = [], []
        start = time.perf_counter()
        for i in range(net.hosts):
            env = {**os.environ, **net.env(i, _port), "RANK": str(i), "WORLD_SIZE": str(net.hosts), "LOCAL_RANK": "0",
                   "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            argv = net.command(i, [sys.executable, "-m", "lowcomm_bench.worker", str(job_path), str(prefix)])
            # output to a file, not a pipe: a pipe nobody drains while we wait for another worker
            # fills (64 kB; torchft logs every quorum) and blocks its writer mid-run
            logs.append(open(Path(tmp) / f"worker{i}.log", "w+"))
            procs.append(subprocess.Popen(argv, env=env, stdout=logs[-1], stderr=subprocess.STDOUT, text=True))
        deadline = start + timeout
        try:
            for p in procs:
                p.wait(timeout=max(1.0, deadline - time.perf_counter()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"benchmark workers ran past {timeout:.0f} s") from None
        finally:  # on any way out (a timeout, an interrupt) no worker is left waiting for its peers
            for q in procs:
                if q.poll() is None:
                    q.kill()
                    q.wait()
            outputs = []
            for log in logs:
                log.seek(0)
                outputs.append(log.read())
                log.close()
        wall = time.perf_counter() - start
        failed = [(i, p.returncode, out) for i, (p, out) in enumerate(zip(procs, outputs)) if p.returncode != 0]
        if failed:  # every failed worker's tail: the first to fail is not always rank 0
            raise RuntimeError("\n".join(f"benchmark worker {i} exited with {rc}:\n{out[-2500:]}" for i, rc, out in failed))
        return [json.loads((Path(f"{prefix}.rank{i}.json")).read_text()) for i in range(net.hosts)], wall
