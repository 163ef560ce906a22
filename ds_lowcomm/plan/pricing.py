"""What each entry costs and buys for a model, cluster and link: its rows of ``ds-lowcomm plan``.

An entry is a lowcomm section (a method at its settings) and the dense optimizer of its local
steps where the section does not choose it. Its bytes and state are the method's own declaration
(:meth:`~ds_lowcomm.optim.base.LowcommOptimizer.planned_wire`, ``planned_state_bytes``), the
declaration the optimizers' ledger tests check; their seconds are the cost model's (cost.py).
Its baseline and steps ratio come from the measured recipe its settings match (recipes.PLANNED,
ds_lowcomm/measured.json), compared by settings, not by name: a config that runs the one-bit
recipe is priced as that recipe, and one that matches none has no steps ratio, said as such.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from ..comm.wire import elements
from ..optim.muon import DENSE_OPTIMIZERS, dense_state_bytes
from ..optim.recipes import DENSE_BASELINES, PLANNED, USER_SETTINGS
from ..optim.registry import METHODS, LowcommConfig, local_optimizer, planned_state_bytes, planned_wire
from ..settings import ConfigError
from .cost import Link, exposed_seconds, gradient_exposed_seconds, share, wire_bytes
from .measured import CODEC_GBPS, DEFAULT_BASELINE, default_codec_gbps, measured_steps_ratio
from .shapes import hidden_matrices, model_shapes


@dataclass
class PlanInputs:
    model: str = "llama-8b"
    replicas: int = 2
    gpus_per_replica: int = 1
    zero_stage: int = 1
    link_gbit: float = 10.0  # between replicas, each worker's own
    latency_ms: float = 1.0  # one way
    compute_s: float = 1.0  # one step's forward and backward (and local update), without communication
    grad_bytes: int = 4  # bytes per element of a dense gradient mean (fp32: 4, bf16: 2)
    param_bytes: int = 4  # bytes per element of the parameters (a dense optimizer's state follows them)
    device: str = "gpu"  # which measured codec throughput is the default
    # a gradient all-reduce as DDP and ZeRO (overlap_comm) run it: bucket by bucket while the backward
    # pass runs, the last bucket after it; False: after the backward pass (ds_lowcomm's adamw method,
    # DeepSpeed ZeRO 1-2 without overlap_comm, its default)
    overlap_backward: bool = True
    backward_fraction: float = 2 / 3  # the backward pass's share of compute_s (twice the forward's FLOPs)
    # MiB of gradients per bucket (DDP's bucket_cap_mb; DeepSpeed: reduce_bucket_size x bytes / 2**20)
    bucket_cap_mb: float = 25.0
    codec_gbps: float | None = None  # GB/s of fp32 elements through encode + decode; None: the device's default
    # What to price, by row name: its lowcomm section (the method: the name, where the section names
    # none), and the dense optimizer of its local steps where the section does not choose it
    # (DeepSpeed's Muon section; "adamw" or "muon"). Default: every entry recipes.PLANNED names.
    methods: dict[str, dict] = field(default_factory=lambda: {m: dict(e["lowcomm"]) for m, e in PLANNED.items()})
    optimizers: dict[str, str] = field(default_factory=lambda: {m: e["optimizer"] for m, e in PLANNED.items()
                                                                  if "optimizer" in e})
    # Given steps to the target over the row's baseline's; a row not named here takes the measured
    # ratio of the recipe its settings match, if any
    steps_ratio: dict[str, float] = field(default_factory=dict)
    # Given fractions of a run's steps spent synchronous before the method's own scheme starts
    # (mtdao's warm start: a dense gradient all-reduce every step, not overlapped); a row not named
    # here takes its matching recipe's
    warm_start: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        def positive(name, value, integer=False):
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0
                    or (integer and not isinstance(value, int)) or not math.isfinite(value)):
                raise ConfigError(f"plan: {name} must be a positive {'integer' if integer else 'number'}; got {value!r}")

        model_shapes(self.model)
        for name in ("replicas", "gpus_per_replica"):
            positive(name, getattr(self, name), integer=True)
        for name in ("link_gbit", "compute_s", "bucket_cap_mb"):
            positive(name, getattr(self, name))
        if not isinstance(self.overlap_backward, bool):
            raise ConfigError(f"plan: overlap_backward must be true or false; got {self.overlap_backward!r}")
        if (not isinstance(self.backward_fraction, (int, float)) or isinstance(self.backward_fraction, bool)
                or not 0 <= self.backward_fraction <= 1):
            raise ConfigError(f"plan: backward_fraction must be a number in [0, 1]; got {self.backward_fraction!r}")
        if self.codec_gbps is not None:
            positive("codec_gbps", self.codec_gbps)
        if not isinstance(self.latency_ms, (int, float)) or self.latency_ms < 0:
            raise ConfigError(f"plan: latency_ms must be >= 0; got {self.latency_ms!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"plan: zero_stage must be one of 0, 1, 2, 3; got {self.zero_stage!r}")
        for name in ("grad_bytes", "param_bytes"):
            if getattr(self, name) not in (2, 4):
                raise ConfigError(f"plan: {name} must be 2 (bf16/fp16) or 4 (fp32); got {getattr(self, name)!r}")
        if self.device not in CODEC_GBPS:
            raise ConfigError(f"plan: device must be one of {', '.join(CODEC_GBPS)}; got {self.device!r}")
        unknown = [m for m, section in self.methods.items()
                   if m not in PLANNED and m not in METHODS and not (isinstance(section, dict) and "method" in section)]
        if unknown or not self.methods:
            raise ConfigError(f"plan: methods must name some of {', '.join(dict.fromkeys([*PLANNED, *METHODS]))} (or "
                              f"give a section with its method); got {', '.join(unknown) or 'none'}")
        for m, kind in self.optimizers.items():
            if kind not in DENSE_OPTIMIZERS:
                raise ConfigError(f"plan: optimizers.{m} must be one of {', '.join(DENSE_OPTIMIZERS)}; got {kind!r}")
        for m, ratio in self.steps_ratio.items():
            positive(f"steps_ratio.{m}", ratio)
        for m, f in self.warm_start.items():
            if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 <= f < 1:
                raise ConfigError(f"plan: warm_start.{m} must be a fraction in [0, 1); got {f!r}")


# -- which measured recipe an entry runs -------------------------------------------------------
def _signature(cfg: LowcommConfig, optimizer: str | None) -> str:
    """What makes a recipe: its method, the dense optimizer of its local steps, and every setting
    but those it leaves to the user (recipes.USER_SETTINGS)."""
    settings = {k: v for k, v in cfg.settings.flat().items() if k not in USER_SETTINGS}
    return json.dumps([cfg.method, local_optimizer(cfg, optimizer), settings], sort_keys=True, default=str)


@lru_cache(maxsize=None)
def _planned_signatures() -> dict[str, str]:
    return {name: _signature(LowcommConfig.from_dict(e["lowcomm"], where=f"recipes.PLANNED.{name}"), e.get("optimizer"))
            for name, e in PLANNED.items()}


def matching_recipe(cfg: LowcommConfig, optimizer: str | None = None) -> str | None:
    """The entry of recipes.PLANNED that ``cfg`` (with ``optimizer`` as its local optimizer) runs,
    by its settings; None where it runs none of them."""
    mine = _signature(cfg, optimizer)
    return next((name for name, sig in _planned_signatures().items() if sig == mine), None)


def baseline_of(cfg: LowcommConfig, optimizer: str | None, recipe: str | None) -> str:
    """The dense entry a row is set against: its recipe's; else the dense baseline with its local
    optimizer (dense Muon for an outer loop around Muon); else adamw."""
    if recipe is not None:
        return PLANNED[recipe]["baseline"]
    kind = local_optimizer(cfg, optimizer)
    return next((name for name, e in DENSE_BASELINES.items() if e["optimizer"] == kind), DEFAULT_BASELINE)


# -- one row -----------------------------------------------------------------------------------
def _section(name: str, inputs: PlanInputs) -> tuple[dict, str | None]:
    """(the lowcomm section, the local optimizer) of row ``name``: the inputs', else recipes.PLANNED's."""
    if name in inputs.methods:
        return {"method": name, **inputs.methods[name]}, inputs.optimizers.get(name)
    if name in PLANNED:
        return dict(PLANNED[name]["lowcomm"]), PLANNED[name].get("optimizer")
    raise ConfigError(f"plan: no entry {name!r}; methods must name some of {', '.join(PLANNED)}")


def plan_method(name: str, inputs: PlanInputs, shapes=None) -> dict[str, Any]:
    """Row ``name`` of the plan: its bytes, seconds and state per worker, its baseline, and its
    steps ratio (given, measured for the recipe it runs, or None)."""
    shapes = shapes if shapes is not None else model_shapes(inputs.model)
    section, optimizer = _section(name, inputs)
    cfg = LowcommConfig.from_dict(section, where=f"plan.methods.{name}")
    g, n = inputs.gpus_per_replica, inputs.replicas
    matrices = hidden_matrices(inputs.model, shapes)
    wire = planned_wire(cfg, shapes, matrices=matrices, replicas=n, grad_bytes=inputs.grad_bytes,
                        param_bytes=inputs.param_bytes)
    link = Link(n, g, inputs.link_gbit * 1e9, inputs.latency_ms / 1e3)
    messages, every, parameters = wire.messages, wire.sync_every, elements(shapes)
    # one worker's share: the model's bytes over its replica's G workers
    per_worker_sync = sum(share(m, g).nbytes for m in messages)
    wire_sync = sum(wire_bytes(share(m, g), n) for m in messages)
    comm_sync = sum(link.seconds(part) for part in wire.fragments)
    gbps = inputs.codec_gbps or default_codec_gbps(inputs.device, parameters / g)
    codec_sync = sum(m.codec_elements for m in messages) / g * 4 / (gbps * 1e9)
    if wire.gradients and inputs.overlap_backward:
        exposed_sync = gradient_exposed_seconds(messages, link, shapes, backward_s=inputs.backward_fraction * inputs.compute_s,
                                                bucket_cap_mb=inputs.bucket_cap_mb, param_bytes=inputs.param_bytes,
                                                grad_bytes=inputs.grad_bytes)
    else:  # each fragment's sync, as far as it outlasts the compute it runs behind
        exposed_sync = sum(exposed_seconds(part, link, inputs.compute_s) for part in wire.fragments)
    comm_step, codec_step, exposed_step = comm_sync / every, codec_sync / every, exposed_sync / every
    bytes_step, wire_step = per_worker_sync / every, wire_sync / every
    recipe = matching_recipe(cfg, optimizer)
    warm = inputs.warm_start.get(name, PLANNED[recipe].get("warm_start", 0.0) if recipe else 0.0)
    if warm and not wire.warm:
        raise ConfigError(f"plan: warm_start.{name}: method {cfg.method} has no synchronous warm start")
    if warm:  # that share of the steps all-reduce the gradients in the step (not overlapped)
        comm_warm = link.seconds(wire.warm)
        comm_step = warm * comm_warm + (1 - warm) * comm_step
        exposed_step = warm * comm_warm + (1 - warm) * exposed_step
        codec_step *= 1 - warm
        bytes_step = warm * sum(share(m, g).nbytes for m in wire.warm) + (1 - warm) * bytes_step
        wire_step = warm * sum(wire_bytes(share(m, g), n) for m in wire.warm) + (1 - warm) * wire_step
    state = planned_state_bytes(cfg, shapes, matrices=matrices, param_bytes=inputs.param_bytes, local_optimizer=optimizer)
    baseline = baseline_of(cfg, optimizer, recipe)
    ratio, source = _steps_ratio(name, recipe, baseline, inputs, parameters)
    return {"method": name, "runs": cfg.method, "optimizer": local_optimizer(cfg, optimizer), "recipe": recipe,
            "baseline": baseline, "sync_every": every, "replicas": n, "ops": list(dict.fromkeys(m.op for m in messages)),
            "bytes_per_sync": per_worker_sync, "bytes_per_step": bytes_step, "wire_bytes_per_sync": wire_sync,
            "wire_bytes_per_step": wire_step, "warm_start": warm, "messages_per_sync": len(messages),
            "comm_s_per_step": comm_step, "exposed_comm_s_per_step": exposed_step, "codec_s_per_step": codec_step,
            "step_s": inputs.compute_s + codec_step + exposed_step,
            "state_bytes_per_gpu": state / g if inputs.zero_stage >= 1 else state, "parameters": parameters,
            "codec_gbps": gbps, "steps_ratio": ratio, "steps_ratio_source": source, "settings": cfg.effective()}


def _steps_ratio(name: str, recipe: str | None, baseline: str, inputs: PlanInputs,
                 parameters: int) -> tuple[float | None, str]:
    """(steps to the target over the baseline's, where it comes from) of row ``name``."""
    if name in inputs.steps_ratio:
        return inputs.steps_ratio[name], "given"
    if recipe == baseline:
        return 1.0, "definition"
    measured = measured_steps_ratio(recipe, parameters) if recipe else None
    if measured is None:
        return None, ("no measured recipe runs these settings" if recipe is None
                      else f"{recipe}'s steps to the target were not measured")
    ratio, against, source = measured
    if against != baseline:
        raise ConfigError(f"ds_lowcomm/measured.json: steps_ratio.{recipe} is against {against}, where "
                          f"recipes.PLANNED sets {recipe} against {baseline}")
    return ratio, source


# -- the table -----------------------------------------------------------------------------------
def plan(inputs: PlanInputs) -> dict[str, Any]:
    """Every row of ``inputs.methods``, with adamw and each row's baseline -> the table: rows grouped
    by baseline (adamw's first), each baseline's row first in its group."""
    inputs.validate()
    shapes = model_shapes(inputs.model)
    rows = {m: plan_method(m, inputs, shapes) for m in dict.fromkeys([DEFAULT_BASELINE, *inputs.methods])}
    for row in list(rows.values()):
        if row["baseline"] not in rows:
            rows[row["baseline"]] = plan_method(row["baseline"], inputs, shapes)
    baselines = list(dict.fromkeys(r["baseline"] for r in rows.values()))
    ordered = [r for b in baselines
               for r in [rows[b], *(r for name, r in rows.items() if r["baseline"] == b and name != b)]]
    for row in ordered:
        base = rows[row["baseline"]]
        ratio = row["steps_ratio"]
        row["added_state_bytes_per_gpu"] = row["state_bytes_per_gpu"] - base["state_bytes_per_gpu"]
        row["speedup_vs_baseline"] = base["step_s"] / (ratio * row["step_s"]) if ratio else None
        # fewer bytes than the baseline's per step, on the wire at this replica count (the ledger's
        # ratio is the wire's at 2 replicas: an all-gather's wire bytes grow with n, an all-reduce's do not)
        wire, ledger = row["wire_bytes_per_step"], row["bytes_per_step"]
        row["wire_bytes_vs_baseline"] = base["wire_bytes_per_step"] / wire if wire else None
        row["ledger_bytes_vs_baseline"] = base["bytes_per_step"] / ledger if ledger else None
    adamw = rows[DEFAULT_BASELINE]
    return {"inputs": dataclasses.asdict(inputs), "parameters": adamw["parameters"],
            "comm_compute_ratio": adamw["comm_s_per_step"] / inputs.compute_s, "codec_gbps": adamw["codec_gbps"],
            "codec_default": None if inputs.codec_gbps else CODEC_GBPS[inputs.device][1], "rows": ordered}


def muon_memory(shapes, other: set[int], gpus: int, zero_stage: int, state_bytes: int = 4) -> dict[str, float]:
    """Optimizer bytes per GPU of demo with Muon's step (``update`` muon) against DeepSpeed's own Muon,
    both over ``shapes`` (``other``: the indices of the tensors that take the other rule:
    embeddings, an output head; 1-D ones always), partitioned over ``gpus`` at ZeRO >= 1.
    Persistent: DeepSpeed's Muon keeps dense Muon's state in fp32 (a momentum per Muon element,
    Adam's two moments per other element); demo one momentum (``state_bytes``) per element.
    Transient, demo's step at ZeRO >= 1: the exchanged mean and the direction of its partition
    (fp32 each) and the whole matrices it owns while they are orthogonalised (about its share of
    the Muon elements)."""
    matrices = [len(s) == 2 and i not in other for i, s in enumerate(shapes)]
    muon = sum(math.prod(s) for s, m in zip(shapes, matrices) if m)
    total = elements(shapes)
    part = gpus if zero_stage >= 1 else 1
    deepspeed = dense_state_bytes("muon", shapes, matrices, 4) / part
    demo = state_bytes * total / part
    transient = (2 * 4 * total + 4 * muon) / part if zero_stage >= 1 else 2 * 4 * total
    return {"muon_elements": muon, "elements": total, "deepspeed_muon_state_bytes_per_gpu": deepspeed,
            "demo_muon_state_bytes_per_gpu": demo, "added_state_bytes_per_gpu": demo - deepspeed,
            "demo_muon_transient_bytes_per_gpu": transient}
