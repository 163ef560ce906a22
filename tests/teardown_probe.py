"""Runs a training script as its launcher would (``__main__``, its own arguments), then records on
this rank what the script's end left behind: whether torch's default process group is still
alive, and how many gloo worker threads (``pt_gloo_runloop``) still run, against the count when
the script destroyed the default group. A worker still running at interpreter shutdown may hold
its last collective's tensors, and releasing them then aborts the process
(pytorch/pytorch#190489); a script that ends right leaves none.

    <launcher> tests/teardown_probe.py SCRIPT ARGS...   (writes $TEARDOWN_PROBE_OUT/rank<R>.json)
"""

import json
import os
import runpy
import sys
import weakref

import torch.distributed as dist


def gloo_workers() -> int:
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().strip() == "pt_gloo_runloop"
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return count


seen = {}
_destroy = dist.destroy_process_group


def _destroy_noting_the_world(group=None):
    if group is None and "default_group" not in seen:
        seen["default_group"] = weakref.ref(dist.group.WORLD)
        seen["rank"] = dist.get_rank()
        seen["workers_at_destroy"] = gloo_workers()
    return _destroy(group)


dist.destroy_process_group = _destroy_noting_the_world  # looked up by callers at call time
# the script's arguments as its launcher gave them (the deepspeed launcher's --local_rank comes first)
at = next(i for i, arg in enumerate(sys.argv) if i and arg.endswith(".py"))
script, sys.argv = sys.argv[at], [sys.argv[at], *sys.argv[1:at], *sys.argv[at + 1:]]
runpy.run_path(script, run_name="__main__")
report = {"destroyed": "default_group" in seen, "workers_at_destroy": seen.get("workers_at_destroy"),
          "default_group_alive": "default_group" in seen and seen["default_group"]() is not None,
          "workers_after": gloo_workers()}
with open(os.path.join(os.environ["TEARDOWN_PROBE_OUT"], f"rank{seen.get('rank', os.environ.get('RANK'))}.json"), "w") as f:
    json.dump(report, f)
