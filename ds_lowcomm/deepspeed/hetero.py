"""Replicas of different shapes in one job (``lowcomm.replicas``).

Example, 3 ranks: replica 0 is rank 0 with the whole model; replica 1 is ranks 1-2, a 2-stage
pipeline with compressed activations between its stages::

    "lowcomm": {"method": "sparseloco", "sync_every": 8,
                "replicas": [{"ranks": 1},
                             {"ranks": 2, "pipeline_stages": 2, "inner_steps": 4,
                              "activations": {"forward": "lowrank", "backward": "lowrank"}}]}

Replicas take consecutive ranks in the listed order. In the script, before building the model::

    place = ds_lowcomm.deepspeed.replica_layout(config)   # this rank's replica
    model = PipelineModule(layers=specs, num_stages=place.pipeline_stages, ...)
    engine, *_ = ds_lowcomm.deepspeed.initialize(model=model, config=config, training_data=ds)

How: each replica runs its own DeepSpeed world (``subworld.py``: DeepSpeed sees the replica's
ranks as the whole world, so its pipeline grid, ZeRO 1 partitions, loader and checkpoints are
the replica's), and the method syncs across replicas along routes matched by parameter name
(``comm/routes.py``), whatever the stage boundaries or ZeRO partitions. Every replica is built
from the same layer list: ``PipelineModule`` names parameters by layer index (``3.weight``,
``tied_modules.embed.weight``) whatever the number of stages; a plain module whose names match
works too.

Weights: each replica's pseudo-gradient (or gradient, or momentum) counts its tokens per sync:
``inner_steps`` (outer methods; per-step methods sync every step) x its data-parallel ranks
(every data-parallel rank of every replica takes the same micro-batch x accumulation steps, as
in DeepSpeed), as in the Heterogeneous SparseLoCo code, which weights replicas by tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..codec import ActivationSettings
from ..comm import ReplicaTopology, Routes
from ..comm.routes import Piece, whole
from ..optim.registry import OUTER_METHODS
from ..settings import ConfigError
from . import internals as ds
from .state import STATE
from .zero import stage12_partitions

SPEC_KEYS = ("ranks", "pipeline_stages", "inner_steps", "activations")


@dataclass(frozen=True)
class ReplicaSpec:
    """One entry of ``lowcomm.replicas``."""

    ranks: int
    pipeline_stages: int = 1
    inner_steps: int | None = None  # outer methods: inner steps per outer step (default lowcomm.sync_every)
    activations: ActivationSettings | None = None  # pipeline replicas: codecs between stages

    @property
    def data_parallel(self) -> int:
        return self.ranks // self.pipeline_stages

    def steps_per_sync(self, sync_every: int) -> int:
        """Engine steps this replica runs per sync: its inner_steps, else lowcomm.sync_every."""
        return self.inner_steps or sync_every

    def describe(self) -> dict[str, Any]:
        out = {"ranks": self.ranks, "pipeline_stages": self.pipeline_stages, "inner_steps": self.inner_steps}
        if self.activations is not None:
            out["activations"] = self.activations.flat()
        return out


def _positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} must be a positive integer; got {value!r}")
    return value


def parse_replicas(raw: Any, where: str = "lowcomm.replicas") -> tuple[ReplicaSpec, ...]:
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where} must be a non-empty list of replicas such as "
                          f'[{{"ranks": 1}}, {{"ranks": 2, "pipeline_stages": 2}}]; got {raw!r}')
    out = []
    for i, entry in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{at} must be a mapping with keys {', '.join(SPEC_KEYS)}; got {entry!r}")
        unknown = sorted(set(entry) - set(SPEC_KEYS))
        if unknown:
            raise ConfigError(f"{at}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(SPEC_KEYS)}")
        if "ranks" not in entry:
            raise ConfigError(f"{at}.ranks (how many ranks the replica has) is required")
        ranks = _positive_int(f"{at}.ranks", entry["ranks"])
        stages = _positive_int(f"{at}.pipeline_stages", entry.get("pipeline_stages", 1))
        if ranks % stages:
            raise ConfigError(f"{at}.pipeline_stages must divide its ranks {ranks} (stages x data-parallel "
                              f"pipelines); got {stages} (allowed: "
                              f"{', '.join(str(d) for d in range(1, ranks + 1) if ranks % d == 0)})")
        inner = entry.get("inner_steps")
        if inner is not None:
            inner = _positive_int(f"{at}.inner_steps", inner)
        activations = None
        if "activations" in entry:
            if stages == 1:
                raise ConfigError(f"{at}.activations: codecs between pipeline stages need pipeline_stages > 1")
            activations = ActivationSettings.from_section(entry["activations"], where=f"{at}.activations")
        out.append(ReplicaSpec(ranks, stages, inner, activations))
    return tuple(out)


def check_replicas(specs: tuple[ReplicaSpec, ...], lowcomm, zero_stage: int, replica_size_given: bool) -> None:
    """What ``lowcomm.replicas`` rules out with the rest of the config (before any rank works)."""
    if replica_size_given:
        raise ConfigError("lowcomm.replica_size and lowcomm.replicas: give one (replicas describes every "
                          "replica's ranks)")
    if zero_stage > 1:
        raise ConfigError(f"zero_optimization.stage must be 0 or 1 with lowcomm.replicas (DeepSpeed's pipeline "
                          f"engine refuses 2 and 3, and every replica runs the same stage); got {zero_stage}")
    if lowcomm.comm.transport != "torch":
        raise ConfigError(f"lowcomm.transport must be torch with lowcomm.replicas (syncs go over per-route "
                          f"torch.distributed groups); got {lowcomm.comm.transport!r}")
    effective = lowcomm.effective()
    if effective.get("fragments", 1) > 1:
        raise ConfigError("lowcomm.fragments must be 1 with lowcomm.replicas (fragments are cut by tensor "
                          f"position, which differs between replica shapes); got {effective['fragments']}")
    steps = {spec.inner_steps for spec in specs if spec.inner_steps is not None}
    if steps and lowcomm.method not in OUTER_METHODS:
        raise ConfigError(f"lowcomm.replicas[].inner_steps: {lowcomm.method} syncs every step, so every replica "
                          f"must take the same steps; inner_steps is for the outer methods "
                          f"({', '.join(OUTER_METHODS)}) only")


# -- this rank's place -------------------------------------------------------------------------
@dataclass(frozen=True)
class ReplicaPlace:
    """Where this rank is: replica ``index`` of ``specs``, global ``ranks`` of that replica."""

    index: int
    ranks: tuple[int, ...]
    spec: ReplicaSpec
    specs: tuple[ReplicaSpec, ...]
    # Engine steps (train_batch() calls) this replica runs per sync across replicas: its
    # inner_steps, else lowcomm.sync_every (1 for the per-step methods). Every replica must run the
    # same number of syncs, so a script runs syncs x steps_per_sync steps on each (docs/deepspeed.md).
    steps_per_sync: int = 1

    @property
    def pipeline_stages(self) -> int:
        return self.spec.pipeline_stages

    @property
    def replicas(self) -> list[list[int]]:
        out, at = [], 0
        for spec in self.specs:
            out.append(list(range(at, at + spec.ranks)))
            at += spec.ranks
        return out




def enter_replica(specs: tuple[ReplicaSpec, ...], timeout_s: float | None, sync_every: int = 1) -> ReplicaPlace:
    """This rank's replica under ``specs`` (torch.distributed up): checks the layout against the
    world size and makes DeepSpeed see this replica as its world (``engine.replica_layout``)."""
    from .subworld import enter_subworld

    world, rank = dist.get_world_size(), dist.get_rank()
    total = sum(spec.ranks for spec in specs)
    if total != world:
        raise ConfigError(f"lowcomm.replicas: the replicas' ranks add up to {total} "
                          f"({' + '.join(str(s.ranks) for s in specs)}) but the job has {world} ranks")
    at = 0
    for index, spec in enumerate(specs):
        if at <= rank < at + spec.ranks:
            place = ReplicaPlace(index, tuple(range(at, at + spec.ranks)), spec, specs, spec.steps_per_sync(sync_every))
            break
        at += spec.ranks
    # (a later engine may run another method: its steps per sync are its own)
    if STATE.place is not None and dataclasses.replace(STATE.place, steps_per_sync=place.steps_per_sync) != place:
        raise ConfigError("replica_layout: called again with another layout; one layout per process")
    enter_subworld(list(place.ranks), timeout_s=timeout_s)
    STATE.place = place
    return place


def current_place(specs: tuple[ReplicaSpec, ...]) -> ReplicaPlace:
    if STATE.place is None:
        raise ConfigError("lowcomm.replicas: call ds_lowcomm.deepspeed.replica_layout(config) first, before "
                          "building the model (each replica builds its own shape)")
    if STATE.place.specs != specs:
        raise ConfigError("lowcomm.replicas differs from the layout given to replica_layout()")
    return STATE.place


def check_model(model, place: ReplicaPlace) -> None:
    from deepspeed.pipe import PipelineModule

    stages = ds.get(ds.grid(model), ds.GRID_PIPE_SIZE) if isinstance(model, PipelineModule) else 1
    if stages != place.pipeline_stages:
        raise ConfigError(f"lowcomm.replicas[{place.index}].pipeline_stages is {place.pipeline_stages} but this "
                          f"rank's model has {stages} stage(s): build PipelineModule(..., "
                          f"num_stages=place.pipeline_stages) from replica_layout()")


def topology(place: ReplicaPlace, model, timeout_s: float | None) -> ReplicaTopology:
    """The job's replicas for ds_lowcomm's own bookkeeping (data sharding over every replica,
    checkpoints per replica). DeepSpeed itself sees only this replica (subworld.py)."""
    from deepspeed.pipe import PipelineModule

    local = place.ranks.index(dist.get_rank())
    dp_id = ds.get(ds.grid(model), ds.GRID_DATA_ID) if isinstance(model, PipelineModule) else local
    first = sum(spec.data_parallel for spec in place.specs[: place.index])
    return ReplicaTopology(dist.get_world_size(), dist.get_rank(), place.replicas, None, None, None,
                           data_rank=first + dp_id, data_world=sum(s.data_parallel for s in place.specs),
                           data_per_replica=place.spec.data_parallel)


def replica_weights(place: ReplicaPlace, lowcomm) -> list[float]:
    """Tokens per sync of each replica (module docstring); ``lowcomm``: the job's section (the
    same on every rank), not a replica's own."""
    outer = lowcomm.method in OUTER_METHODS
    default = lowcomm.effective().get("sync_every", 1)
    return [float(spec.steps_per_sync(default) if outer else 1) * spec.data_parallel for spec in place.specs]


def inner_steps(place: ReplicaPlace, lowcomm):
    """The lowcomm config this replica's optimizer takes: its own inner steps per outer step."""
    import dataclasses

    if place.spec.inner_steps is None:
        return lowcomm
    return dataclasses.replace(lowcomm, settings=dataclasses.replace(lowcomm.settings,
                                                                     sync_every=place.spec.inner_steps))


# -- what each rank holds, by name ----------------------------------------------------------------
def _names(model) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def broadcast_initial_state(model, timeout_s: float | None) -> None:
    """Every replica starts from replica 0's parameters and buffers, matched by name (collective)."""
    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    names = [n for n, _ in model.named_parameters()] + [f"buffer:{n}" for n, _ in model.named_buffers()]
    routes = Routes.build([[whole(n, t.shape)] for n, t in zip(names, tensors)], [t.numel() for t in tensors],
                          STATE.place.replicas, timeout_s=timeout_s)
    with torch.no_grad():
        routes.broadcast_([t.data for t in tensors])


def method_routes(model, optimizer, zero, zero_stage: int, place: ReplicaPlace, lowcomm,
                  timeout_s: float | None) -> Routes:
    """The routes of the tensors the method steps: the parameters themselves (ZeRO 0) or this
    rank's ZeRO 1 partitions, as pieces of named parameters (collective)."""
    names = _names(model)
    tensors = optimizer._current_params()
    if zero_stage == 0:
        holdings = []
        for t in tensors:
            if id(t) not in names:
                raise ConfigError("lowcomm.replicas: the optimizer steps a tensor that is not a parameter of the "
                                  "model (fp16/bf16 master copies at ZeRO 0): use zero_optimization.stage 1")
            holdings.append([whole(names[id(t)], t.shape)])
    else:
        holdings = _partition_pieces(zero, names)
        if len(holdings) != len(tensors):
            raise RuntimeError("ZeRO partitions and the optimizer's tensors do not line up")
    default = lowcomm.effective().get("sync_every", 1)
    per_replica = ", ".join(f"replica {i}: {spec.steps_per_sync(default)}" for i, spec in enumerate(place.specs))
    hint = (f"With lowcomm.replicas every replica runs the same number of syncs, so each runs syncs x "
            f"place.steps_per_sync engine steps (steps per sync: {per_replica}).")
    return Routes.build(holdings, [t.numel() for t in tensors], place.replicas, replica_weights(place, lowcomm),
                        sync_board=hint,
                        ledger=optimizer.ledger, timeout_s=timeout_s)


def _partition_pieces(zero, names: dict[int, str]) -> list[list[Piece]]:
    """ZeRO 1: each group's flat partition as pieces of named parameters (``zero.stage12_partitions``)."""
    return [[Piece(names[id(s.param)], tuple(s.param.shape), s.start, s.length, s.at) for s in part.slices]
            for part in stage12_partitions(zero)]
