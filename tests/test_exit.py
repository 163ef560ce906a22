"""A user's script that trains with ds_lowcomm and ends by destroying its process group, with no
clean-up step of its own, exits 0 every time, with either exchange, and an unused layer of its
model never moves (lowcomm_bench/exit_script.py, 3 ranks under torchrun, several launches in a row).

A gloo worker thread still running at interpreter shutdown can abort the process there
("terminate called without an active exception", SIGABRT, pytorch/pytorch#190489): after the
script destroys its group no gloo thread is left (ds_lowcomm/__init__.py: torch's dynamo, imported
after the group is made, would keep it alive), and the transports keep their last operation's
tensors (comm/transport.py), so a worker never drops the last reference to one."""

import pytest

from lowcomm_bench.exits import launch
RUNS = 2  # launches per exchange here; the 30-launch check is python -m lowcomm_bench exits


@pytest.mark.parametrize("exchange", ["all_gather", "all_reduce"])
def test_a_users_script_exits_0_and_its_unused_layer_never_moves(exchange):
    for run in range(RUNS):
        done = launch(exchange, 3)
        assert done["returncode"] == 0 and not done["aborted"], (run, done["stderr"])
        assert done["result"] == {"exchange": exchange, "unused_moved": 0.0, "gloo_threads_left": 0}, done
