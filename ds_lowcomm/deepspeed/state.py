"""What ds_lowcomm keeps per process for DeepSpeed, in one object.

DeepSpeed holds process-wide state of its own (its communication backend, the ``mpu`` in
``deepspeed.utils.groups``); what ds_lowcomm adds beside it is here, set once where noted and read
by the functions that need it after ``initialize`` returns. (Process-group caches keyed to the
default group, in ``comm/topology.py`` and ``comm/routes.py``, are caches, not state.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ProcessState:
    # replica_layout(): this rank's replica under lowcomm.replicas (hetero.py); one layout per process
    place: Any = None
    # enter_subworld(): the backend through which DeepSpeed sees one replica as its world (subworld.py)
    subworld: Any = None
    # initialize(): the last engine's replica topology, for data_parallel_rank() / _world_size()
    # (data.py); its numbers only. Nothing here holds a process group: state that outlives the
    # engine would keep torch's groups (and their gloo worker threads) alive past
    # destroy_process_group() into interpreter shutdown (pytorch/pytorch#190489)
    topology: Any = None


STATE = ProcessState()
