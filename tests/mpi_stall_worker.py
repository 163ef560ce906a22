"""Run under mpirun by tests/test_mpi.py: rank 1 stalls (a stopped process, a hung data loader)
past the MPI transport's timeout; rank 0 must fail with the transport's error, not wait forever,
in an all-gather and in a broadcast.
Writes OUT/rank0.json, then leaves with a failure code (mpirun then stops rank 1)."""

import json
import os
import sys
import time

import torch

from ds_lowcomm.comm import CollectiveError
from ds_lowcomm.comm.mpi import MPITransport

out = sys.argv[1]
transport = MPITransport(timeout_s=2.0)
transport.all_gather_bytes(torch.ones(4, dtype=torch.uint8))  # both ranks are up
if transport.rank == 1:
    time.sleep(30)
start = time.monotonic()
try:
    transport.all_gather_bytes(torch.ones(4, dtype=torch.uint8), op="sparse_all_gather")
    result = {"error": None}
except CollectiveError as err:
    result = {"error": str(err)}
result["waited_s"] = time.monotonic() - start
start = time.monotonic()  # a broadcast from the stalled rank (ReplicaShard's kind) is bounded too
try:
    transport.broadcast_(torch.zeros(4), src=1, op="replica_broadcast")
    result["broadcast_error"] = None
except CollectiveError as err:
    result["broadcast_error"] = str(err)
result["broadcast_waited_s"] = time.monotonic() - start
with open(os.path.join(out, "rank0.json"), "w") as f:
    json.dump(result, f)
sys.stdout.flush()
os._exit(3)
