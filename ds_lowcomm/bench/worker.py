"""One worker process of a benchmark, started by :func:`ds_lowcomm.bench.hosts.run_on_hosts`
inside its network namespace: ``python -m ds_lowcomm.bench.worker SPEC.json OUT_PREFIX``.

It joins the gloo process group from the environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE,
GLOO_SOCKET_IFNAME), runs the reference task's ``train_worker`` with the spec (a ds_lowcomm
method, or with ``spec["peer"]`` a peer baseline from :mod:`ds_lowcomm.bench.peers`) and writes
its metrics to ``OUT_PREFIX.rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from ..task.train import train_worker


def main(argv: list[str]) -> None:
    spec_path, out_prefix = argv
    spec = json.loads(open(spec_path).read())
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    if "peer" in spec:
        from .peers import peer_setup

        metrics = train_worker(rank, world, spec, setup=peer_setup)
    else:
        metrics = train_worker(rank, world, spec)
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(metrics, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # see deepspeed/train.py: gloo threads can abort a normal interpreter exit


if __name__ == "__main__":
    main(sys.argv[1:])
