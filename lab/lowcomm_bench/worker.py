"""One worker process of a benchmark, started by :func:`lowcomm_bench.hosts.run_on_hosts`
inside its network namespace: ``python -m lowcomm_bench.worker JOB.json OUT_PREFIX``.

It joins the gloo process group from the environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE,
GLOO_SOCKET_IFNAME), runs the training loop on the job's ``spec`` (a :class:`TrainSpec` as JSON:
a ds_lowcomm method, or with ``peer`` a peer baseline's step from :mod:`lowcomm_bench.peers`)
and writes its metrics to ``OUT_PREFIX.rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lowcomm_task.spec import TrainSpec
from lowcomm_task.train import train_worker
from lowcomm_task.workers import exit_without_teardown


def main(argv: list[str]) -> None:
    job_path, out_prefix = argv
    job = json.loads(open(job_path).read())
    spec = TrainSpec.from_dict(job["spec"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    # replicas as separate jobs (bench faults): each says it is up, then all start together
    start_file = os.environ.get("DSLC_START_FILE")
    if start_file:
        open(f"{start_file}.ready{os.environ.get('REPLICA_GROUP_ID', rank)}", "w").close()
    while start_file and not os.path.exists(start_file):
        time.sleep(0.05)
    make_step = None
    if job.get("peer"):
        from .peers import peer_step

        make_step = peer_step(job["peer"])
    metrics = train_worker(rank, world, spec, make_step=make_step)
    with open(f"{out_prefix}.rank{rank}.json", "w") as f:
        json.dump(metrics, f)
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown(0)  # see lowcomm_task/workers.py: gloo threads can abort a normal interpreter exit


if __name__ == "__main__":
    main(sys.argv[1:])
