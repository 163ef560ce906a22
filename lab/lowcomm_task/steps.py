"""The training loop's pluggable step: what trains one step on its batches, and what it trains.

A step (the :class:`Step` protocol) owns the module, the optimizer or engine, the learning-rate
schedule, the byte ledger(s) and the checkpoints. The loop (:func:`lowcomm_task.train.train_worker`)
owns the data, the evaluations, the history and when to save or stop. A step is built by a factory
``make_step(model, spec, rank, loss)`` after the model is (``loss(module, x, y)`` is the task's):

- :class:`TorchStep`: a plain torch optimizer (a ds_lowcomm method, or what a ``setup`` hook
  builds: the benchmarks' DDP + PowerSGD peers): forward, backward, ``opt.step()``,
  ``opt.zero_grad()``, scheduler step.
- :class:`DeepSpeedStep`: a DeepSpeed engine from :func:`ds_lowcomm.deepspeed.initialize`:
  micro-batches with gradient accumulation, ``engine.backward``, ``engine.step``, checkpoints by
  ``engine.save_checkpoint`` / ``load_checkpoint``.
- :class:`PipelineStep`: a DeepSpeed pipeline engine (``spec.pipeline_stages`` > 0; the model as
  pipeline layers, see :func:`lowcomm_task.model.gpt_pipeline_module`): ``engine.train_batch``
  on an iterator of the micro-batches, the held-out loss through ``engine.eval_batch``. Megatron
  would be another implementation of the protocol.

Every rank reads the data shard of ``(step.data_rank, step.data_world)``: its own rank and the
world size, except in a pipeline, whose ranks all read their pipeline's batches (the first stage
its inputs, the last its targets): the pipeline's data-parallel index and the number of pipelines.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Callable, Iterable, Protocol

import torch

from ds_lowcomm.checkpoint_io import LATEST, agree_on_problems, check_digests, load_file, read_latest, save_file, write_text
from ds_lowcomm.codec import FLOAT_DTYPES
from ds_lowcomm.comm import build_transport
from ds_lowcomm.config import ConfigError
from ds_lowcomm.optim import LowcommOptimizer, build_optimizer, model_param_groups

from .spec import TrainSpec

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


class Step(Protocol):
    module: torch.nn.Module  # the model itself (evaluated and digested by the loop)
    device: torch.device  # where batches go
    micro_batch: int  # sequences per micro-batch
    accumulation: int  # micro-batches per step
    label: str  # progress lines' default label
    data_rank: int  # which data shard this rank reads (task.train_batch's rank) ...
    data_world: int  # ... out of how many (task.train_batch's world_size)

    def train_step(self, batches: Iterable[Batch]) -> list[torch.Tensor]:
        """One optimizer step on ``accumulation`` micro-batches (made as they are read); their losses."""

    def evaluation(self, task) -> Callable[[], dict[str, float]]:
        """The task's held-out evaluation of this step's model: () -> metrics, "val_loss" first."""

    def traffic(self) -> dict[str, int]:
        """Byte counters so far, for the history rows."""

    def report(self) -> dict:
        """This step's part of the run's results (method, bytes, ledgers)."""

    def save(self, directory: str, step: int) -> None:
        """A checkpoint of every rank under tag ``step<step>``; ``latest`` names it once complete."""

    def load(self, directory: str, tag: str = "latest") -> int:
        """Resume from checkpoint ``tag`` of ``directory`` (``latest``: the last complete one);
        the number of steps done."""


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def lr_lambda(warmup: int, total: int, floor: float = 0.1, decay: str = "cosine"):
    """Linear warm-up, then cosine down to ``floor`` x the peak (``decay`` "none": the peak held)."""

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if decay == "none":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def reference_schedule(spec: TrainSpec) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    """The reference schedule of ``spec`` for an optimizer."""
    return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(spec.warmup or 1, spec.steps,
                                                                        decay=spec.lr_decay))


def worker_device(name: str, rank: int) -> torch.device:
    """``spec.device``: "cpu", or "cuda" for this rank's GPU (LOCAL_RANK modulo the GPUs present,
    as torchrun would place it), or an explicit "cuda:N"."""
    if name == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device(name)


def lowcomm_setup(model: torch.nn.Module, spec: TrainSpec, transport=None):
    """The module to run, the optimizer and its byte ledger: the ds_lowcomm method of spec.lowcomm
    (over ``transport``, default the one its settings name)."""
    cfg = spec.lowcomm_config
    if transport is None:
        transport = build_transport(cfg.transport, timeout_s=cfg.comm.timeout_s)
    opt = build_optimizer(cfg, model_param_groups(cfg, model, model.parameters()), lr=spec.lr,
                          weight_decay=spec.weight_decay, betas=spec.betas, transport=transport,
                          clip_grad=spec.clip_grad)  # the method clips the gradient its step uses
    return model, opt, opt.ledger


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _evaluate_module(step, task) -> Callable[[], dict[str, float]]:
    evaluate = task.evaluation(step.micro_batch, step.device)
    return lambda: evaluate(step.module)


class TorchStep:
    """A torch optimizer's step; ``net`` (the module forward runs through, e.g. a DDP wrapper) may
    differ from ``module`` (the model, saved and evaluated). With ``spec.fault_tolerance`` this
    process is one replica of a torchft quorum (``fault_tolerance``: its FaultTolerance)."""

    accumulation = 1
    fault_tolerance = None

    def __init__(self, module, net, optimizer, ledger, spec: TrainSpec, rank: int, loss: LossFn, device):
        self.module, self.net, self.opt, self.ledger = module, net, optimizer, ledger
        self.spec, self.rank, self.loss, self.device = spec, rank, loss, device
        self.micro_batch, self.label = spec.batch, spec.lowcomm_config.method
        self.sched = reference_schedule(spec)(optimizer)
        self.data_rank, self.data_world = rank, _world()[1]

    @classmethod
    def build(cls, model, spec: TrainSpec, rank: int, loss: LossFn, setup=lowcomm_setup) -> "TorchStep":
        """Place the model (``spec.device``, ``spec.dtype``), then ``setup(model, spec) -> (net,
        optimizer, ledger)``: a ds_lowcomm method by default; benchmarks pass their peers'."""
        device = worker_device(spec.device, rank)
        model = model.to(device=device, dtype=FLOAT_DTYPES[spec.dtype])
        if spec.fault_tolerance is None:
            net, opt, ledger = setup(model, spec)
            return cls(model, net, opt, ledger, spec, rank, loss, device)
        # A replica as its own job over torchft: its method over the quorum's transport; the first
        # quorum taken here (a restarted replica heals from a peer: the scheduler's position too)
        from ds_lowcomm.optim.fault_tolerance import FaultTolerance

        if setup is not lowcomm_setup:
            raise ConfigError("lowcomm.fault_tolerance works with ds_lowcomm's methods, not a peer's step")
        ft = FaultTolerance(spec.fault_tolerance)
        net, opt, ledger = lowcomm_setup(model, spec, transport=ft.transport)
        step = cls(model, net, opt, ledger, spec, rank, loss, device)
        ft.attach(opt, step.sched, after_step=(step.sched.step,))  # train_step steps the scheduler after opt
        step.fault_tolerance = ft
        step.data_rank, step.data_world = spec.fault_tolerance.data_shard()  # by replica, not by who is alive
        return step

    def train_step(self, batches):
        (x, y), = batches
        loss = self.loss(self.net, x.to(self.device), y.to(self.device))
        loss.backward()
        if self.spec.clip_grad and not isinstance(self.opt, LowcommOptimizer):
            # a peer's torch optimizer (DDP's gradients are already the mean here); ds_lowcomm's
            # methods clip inside their step, where the gradient they use is known
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.spec.clip_grad)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.sched.step()
        return [loss]

    def evaluation(self, task):
        return _evaluate_module(self, task)

    def traffic(self):
        return {"bytes_sent": self.ledger.sent, "bytes_received": self.ledger.received}

    def report(self):
        cfg, summary = self.spec.lowcomm_config, self.ledger.summary()
        return {
            "method": cfg.method,
            "settings": cfg.effective(),
            "bytes_sent": summary["bytes_sent"],
            "bytes_received": summary["bytes_received"],
            "ledger": summary,
            "codec_s": summary["seconds"].get("codec", 0.0),
            "comm_s": summary["seconds"].get("comm", 0.0),
            **({"fault_tolerance": self.fault_tolerance.report()}
               if self.fault_tolerance is not None else {}),
        }

    def _path(self, directory: str, tag: str) -> str:
        return os.path.join(directory, tag, f"rank{self.rank}.pt")

    def save(self, directory, step):
        tag = f"step{step}"
        os.makedirs(os.path.join(directory, tag), exist_ok=True)
        save_file({"model": self.module.state_dict(), "optimizer": self.opt.state_dict(),
                   "scheduler": self.sched.state_dict(), "step": step}, self._path(directory, tag))
        _barrier()  # every rank's file is complete before ``latest`` names the tag
        if self.rank == 0:
            write_text(os.path.join(directory, LATEST), tag)
        _barrier()

    def load(self, directory, tag="latest"):
        tag = read_latest(directory) if tag == "latest" else tag
        path = self._path(directory, tag)
        agree_on_problems(check_digests([path]))  # every rank stops if any rank's file is bad
        ckpt = load_file(path, map_location=self.device, digest="checked")
        self.module.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        self.sched.load_state_dict(ckpt["scheduler"])
        self.opt.check_replicas_agree()
        return ckpt["step"]


class DeepSpeedStep:
    """A DeepSpeed engine's step (ds_lowcomm's ``initialize``; only its public surface and
    ``engine.lowcomm``'s summary and engine ledger are used)."""

    def __init__(self, engine, loss: LossFn):
        self.engine, self.loss = engine, loss
        self.module, self.device = engine.module, engine.device
        self.micro_batch = engine.train_micro_batch_size_per_gpu()
        self.accumulation = engine.gradient_accumulation_steps()
        summary = engine.lowcomm.summary()
        self.label = f"{summary['method']} zero{summary['zero_stage']}"
        self.data_rank, self.data_world = _world()
        # DeepSpeed's own collectives from here on are the training's (a resume's load included)
        self.engine_ops_at_start = copy.deepcopy(engine.lowcomm.engine_ledger.by_op)

    @classmethod
    def build(cls, model, spec: TrainSpec, rank: int, loss: LossFn) -> "DeepSpeedStep":
        """An engine from ``spec.deepspeed_config``; its "scheduler" section, or the reference schedule."""
        from ds_lowcomm.deepspeed import initialize

        with open(spec.deepspeed_config) as f:
            config = json.load(f)
        schedule = None if "scheduler" in config else reference_schedule(spec)
        engine, _, _, _ = initialize(model=model, config=config, lr_scheduler=schedule)
        return cls(engine, loss)

    def train_step(self, batches):
        losses = []
        for x, y in batches:
            loss = self.loss(self.engine, x.to(self.device), y.to(self.device))
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss)
        return losses

    def evaluation(self, task):
        return _evaluate_module(self, task)

    def traffic(self):
        return {"bytes_sent": self.engine.lowcomm.summary()["bytes_sent"]}

    def report(self):
        summary = self.engine.lowcomm.summary()
        at_start = self.engine_ops_at_start
        return {
            "method": summary["method"],
            "bytes_sent": summary["bytes_sent"],
            "lowcomm": summary,
            # DeepSpeed's own collectives issued after initialisation: [calls, sent, received] per op
            "engine_ops_during_training": {
                op: [a - b for a, b in zip(row, at_start.get(op, [0, 0, 0]))]
                for op, row in self.engine.lowcomm.engine_ledger.by_op.items()
                if row != at_start.get(op)
            },
        }

    def save(self, directory, step):
        self.engine.save_checkpoint(directory, tag=f"step{step}", client_state={"step": step})

    def load(self, directory, tag="latest"):
        _, client = self.engine.load_checkpoint(directory, tag=None if tag == "latest" else tag)
        return client["step"]


def pipeline_deepspeed_config(spec: TrainSpec) -> dict:
    """The DeepSpeed config of a pipeline run: ``spec.deepspeed_config``'s, or (``ds-lowcomm
    compare``) one made from the spec: ``spec.batch`` sequences per pipeline per step in one
    micro-batch, the spec's AdamW settings, ZeRO 0, the spec's clipping, fp32, ``spec.lowcomm``. Either way
    ``lowcomm.replica_size`` defaults to ``spec.pipeline_stages`` (one pipeline per replica)."""
    if spec.deepspeed_config:
        with open(spec.deepspeed_config) as f:
            config = json.load(f)
    else:
        config = {
            "train_micro_batch_size_per_gpu": spec.batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": float(spec.clip_grad), "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": spec.lr, "betas": list(spec.betas),
                                                      "weight_decay": spec.weight_decay}},
            "zero_optimization": {"stage": 0}, "lowcomm": copy.deepcopy(spec.lowcomm),
        }
    lowcomm = config.get("lowcomm")
    if isinstance(lowcomm, dict) and "replicas" not in lowcomm:
        lowcomm.setdefault("replica_size", spec.pipeline_stages)
    return config


def has_replica_layout(spec: TrainSpec) -> bool:
    """Whether the run's lowcomm section describes replicas of different shapes (``replicas``)."""
    if spec.deepspeed_config:
        with open(spec.deepspeed_config) as f:
            return "replicas" in (json.load(f).get("lowcomm") or {})
    return "replicas" in spec.lowcomm


class PipelineStep(DeepSpeedStep):
    """A DeepSpeed pipeline engine's step (ds_lowcomm's ``initialize`` with a ``PipelineModule``):
    one ``engine.train_batch`` on an iterator of the step's micro-batches. The loss it returns is
    the mean over the micro-batches and the replica's pipelines, on every stage (DeepSpeed
    broadcasts it from the last stage); the held-out loss goes through ``engine.eval_batch`` (the
    last stage's, broadcast to every stage), so every rank's history has the same val_loss.

    ``module`` is this rank's stage (``engine.module``): the loop's ``params_digest`` is of the
    stage's own layers (tied copies included), equal on the stage-matched ranks of the other
    replicas after a sync; the report's ``num_params`` is the whole model's, ``stage_num_params``
    the stage's. Batches: the pipeline's data-parallel index and count
    (``engine.lowcomm.topology.data_rank`` / ``data_world``), so both ends of a pipeline read the
    same ones. The task's ``loss(module, x, y)`` is not used: the pipeline module has its own
    ``loss_fn``. In the report and history, ``bytes_sent`` / ``bytes_received`` are the method's
    cross-replica bytes (what ``ds-lowcomm compare`` sets against its other runs);
    ``engine_bytes_sent`` (DeepSpeed's own collectives inside a replica: tied-weight gradients,
    loss broadcasts) and ``activation_bytes_sent`` (between stages, evaluations' forward passes
    included) are beside them. Checkpoints as :class:`DeepSpeedStep`'s."""

    def __init__(self, engine, loss: LossFn = None, num_params: int | None = None):
        super().__init__(engine, loss)
        self.num_params = num_params  # the whole model's (None: unknown)
        topology = engine.lowcomm.topology
        self.data_rank, self.data_world = topology.data_rank, topology.data_world
        self.stage = engine.stage_id
        self.label = f"{self.label} pipe{engine.num_stages}"

    @classmethod
    def build(cls, model, spec: TrainSpec, rank: int, loss: LossFn = None, to_pipeline=None) -> "PipelineStep":
        """``to_pipeline(model, num_stages)``: the model as a PipelineModule with the model's weights
        (default: the reference GPT's, :func:`lowcomm_task.model.gpt_pipeline_module`); built on
        every rank from the same seed, as the loop does."""
        import deepspeed
        import torch.distributed as dist

        from ds_lowcomm.config import ConfigError
        from ds_lowcomm.deepspeed import initialize
        from .model import GPT, gpt_pipeline_module

        config = pipeline_deepspeed_config(spec)
        deepspeed.init_distributed(dist_backend=dist.get_backend())  # before the PipelineModule (its grid)
        if "replicas" in (config.get("lowcomm") or {}):  # replicas of different shapes: this rank's own
            from ds_lowcomm.deepspeed import replica_layout

            place = replica_layout(config)
            if len({s.inner_steps for s in place.specs}) > 1:
                raise ConfigError("lowcomm.replicas[].inner_steps: the reference task's loop runs the same steps on "
                                  "every rank; give every replica the same inner_steps (or none)")
            stages = place.pipeline_stages
        else:
            stages, world = spec.pipeline_stages, dist.get_world_size()
            if world % stages:
                raise ConfigError(f"--pipeline-stages {stages} must divide the number of ranks ({world})")
        if to_pipeline is None:
            if not isinstance(model, GPT):
                raise ConfigError(f"--pipeline-stages: the task's model ({type(model).__name__}) has no pipeline "
                                  "form; pass PipelineStep.build a to_pipeline function")
            to_pipeline = gpt_pipeline_module
        schedule = None if "scheduler" in config else reference_schedule(spec)
        module = to_pipeline(model, stages)
        num_params = sum(p.numel() for p in model.parameters())
        del model  # the stage's layers have its weights
        engine, _, _, _ = initialize(model=module, config=config, lr_scheduler=schedule)
        return cls(engine, loss, num_params)

    def train_step(self, batches):
        return [self.engine.train_batch(iter(batches))]  # middle stages read nothing

    def evaluation(self, task):
        """The mean loss over ``task.val_batches(micro_batch)``, one eval_batch of that many
        micro-batches through the pipeline (every rank calls it: it is collective)."""
        batches = task.val_batches(self.micro_batch)

        def evaluate():
            loss = self.engine.eval_batch(iter(batches), num_micro_batches=len(batches))
            return {"val_loss": float(loss.item())}

        return evaluate

    def traffic(self):
        s = self.engine.lowcomm.summary()
        return {"bytes_sent": s["cross_replica_bytes_sent"], "bytes_received": s["cross_replica_bytes_received"],
                "engine_bytes_sent": s["engine_bytes_sent"], "activation_bytes_sent": s["activation_bytes_sent"]}

    def report(self):
        out = super().report()
        s = out["lowcomm"]
        return {
            **out,
            **self.traffic(),
            "stage": self.stage,
            "stage_num_params": sum(p.numel() for p in self.module.parameters()),
            **({"num_params": self.num_params} if self.num_params is not None else {}),  # the whole model's
            "settings": self.engine.lowcomm.config.lowcomm.effective(),
            "ledger": s["method_ledger"],
            "codec_s": s["method_seconds"].get("codec", 0.0),
            "comm_s": s["method_seconds"].get("comm", 0.0),
        }
