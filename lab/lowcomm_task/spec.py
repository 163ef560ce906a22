"""One training run, described: :class:`TrainSpec`, with its defaults and checks written once.

``ds-lowcomm compare``, ``launch/train.py``, the benchmarks and the tests build it; the training
loop (:func:`lowcomm_task.train.train_worker`) reads it. It is plain data: ``to_dict()`` gives
JSON (benchmarks write it to files and key their result cache with it), ``from_dict`` reads it
back, and a frozen copy pickles to worker processes. Both command lines fill it from their flags
(:meth:`TrainSpec.from_args`), so their defaults are the ones here and a bad value is reported
under the flag's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field
from typing import Any, Mapping

import torch

from ds_lowcomm.codec import FLOAT_DTYPES, ActivationSettings
from ds_lowcomm.config import ConfigError, LowcommConfig, check_lr
from ds_lowcomm.optim.fault_tolerance import FaultToleranceSettings, check_method

from .data import DATA_SHARDS, MAX_TRAIN_BYTES, MAX_VAL_BYTES
from .model import GPTConfig

DEVICES = ("cpu", "cuda")  # or "cuda:N"
BACKENDS = ("gloo", "nccl")
LR_DECAYS = ("cosine", "none")  # after the warm-up: cosine to 10% of the peak, or constant (MT-DAO's authors')

# The flags of ``ds-lowcomm compare`` and ``launch/train.py`` that set spec fields (nested model
# fields as "model.<name>"). A flag whose value is 0 leaves an optional field unset (ZERO_IS_UNSET).
FLAGS = {
    "--steps": "steps", "--batch": "batch", "--warmup": "warmup", "--eval-every": "eval_every", "--seed": "seed",
    "--data": "data", "--data-shards": "data_shards", "--max-train-bytes": "max_train_bytes", "--device": "device", "--backend": "backend",
    "--save-dir": "save_dir", "--save-at": "save_at", "--save-every": "save_every",
    "--deepspeed_config": "deepspeed_config",
    "--pipeline-stages": "pipeline_stages", "--lr-decay": "lr_decay",
    "--seq-len": "model.seq_len", "--n-layer": "model.n_layer", "--n-head": "model.n_head", "--n-embd": "model.n_embd",
}
ZERO_IS_UNSET = ("eval_every", "save_at", "save_every")


@dataclass(frozen=True)
class TrainSpec:
    """A run of the reference task (or of another task the loop is given: it then ignores
    ``model``, ``data`` and the byte limits). With ``deepspeed_config`` the step is a DeepSpeed
    engine's, and that config, not the fields here, gives the method, the optimizer settings,
    the micro-batch, gradient accumulation, device and dtype."""

    # The method: the "lowcomm" section (LowcommConfig.from_dict) and the per-step (or inner)
    # optimizer's settings.
    lowcomm: dict = field(default_factory=dict)
    lr: float = 1e-3
    betas: tuple = (0.9, 0.95)
    weight_decay: float = 0.0
    # > 0: the gradient a step uses is scaled to this global 2-norm at most (torch's
    # clip_grad_norm_, as DeepSpeed's gradient_clipping and Megatron's --clip-grad): for a
    # synchronous step the mean gradient, for a local step this rank's own (see LowcommOptimizer).
    # 0: no clipping. With deepspeed_config, that config's gradient_clipping sets it.
    clip_grad: float = 0.0
    # Model and data (model: a GPTConfig, or a mapping of its fields).
    model: GPTConfig = field(default_factory=GPTConfig)
    data: str | None = None  # text file or directory; None: the Python standard library's sources
    data_shards: str = "contiguous"  # how the training bytes are split between workers (data.DATA_SHARDS)
    max_train_bytes: int = MAX_TRAIN_BYTES
    max_val_bytes: int = MAX_VAL_BYTES
    batch: int = 16  # sequences per worker per step
    val_batches: int = 8
    seed: int = 0  # initialisation and batches
    # Schedule: linear warm-up, then (lr_decay) cosine to 10% of the peak over ``steps`` or
    # constant; evaluations.
    steps: int = 300
    warmup: int = 20
    lr_decay: str = "cosine"
    eval_every: int | None = None  # None: steps / 10
    # Checkpoints and early stops.
    save_dir: str | None = None
    save_at: int | None = None  # save after this step
    save_every: int | None = None  # and after every multiple of this step
    stop_after_save: bool = False
    resume_from: str | None = None  # a save_dir to resume from
    resume_tag: str = "latest"  # which of its checkpoints: a tag (step40), or the latest complete one
    stop_at_val_loss: float | None = None  # stop at the first evaluation that reaches it
    stop_at_step: int | None = None  # stop after this step, the schedule still spread over ``steps``
    # Where it runs.
    device: str = "cpu"  # cpu, cuda (this rank's GPU: LOCAL_RANK modulo the GPUs present) or cuda:N
    dtype: str = "fp32"  # of the parameters
    backend: str = "gloo"  # of the worker processes' torch.distributed group
    deepspeed_config: str | None = None  # a DeepSpeed JSON with a "lowcomm" section
    # > 0: the model as a DeepSpeed pipeline of this many stages (task.steps.PipelineStep): a
    # DeepSpeed engine (deepspeed_config's, or one made from the fields here), replicas of
    # lowcomm.replica_size ranks (default: this, one pipeline per replica); 0: no pipeline.
    pipeline_stages: int = 0
    # Reporting.
    label: str | None = None  # in progress lines; None: the step's own (the method)
    verbose: bool = True  # progress lines on rank 0

    # How errors name the fields, e.g. a command line's flags (default: the field names).
    names: InitVar[Mapping[str, str] | None] = None

    def __post_init__(self, names: Mapping[str, str] | None) -> None:
        if isinstance(self.model, Mapping):
            object.__setattr__(self, "model", _model_config(self.model))
        object.__setattr__(self, "betas", tuple(self.betas))
        object.__setattr__(self, "_lowcomm_config", self._check(dict(names or {})))

    def _check(self, names: dict[str, str]) -> LowcommConfig:
        """Every field's check; returns the parsed lowcomm section."""

        def name(f: str) -> str:
            return names.get(f, f)

        def at_least(f: str, value: Any, lo: int, optional: bool = False) -> None:
            if optional and value is None:
                return
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= lo):
                raise ConfigError(f"{name(f)} must be >= {lo}; got {value!r}")

        for f in ("steps", "batch", "val_batches", "max_train_bytes", "max_val_bytes"):
            at_least(f, getattr(self, f), 1)
        at_least("warmup", self.warmup, 0)
        at_least("pipeline_stages", self.pipeline_stages, 0)
        at_least("eval_every", self.eval_every, 1, optional=True)
        at_least("save_at", self.save_at, 1, optional=True)
        at_least("save_every", self.save_every, 1, optional=True)
        at_least("stop_at_step", self.stop_at_step, 1, optional=True)
        for f in dataclasses.fields(GPTConfig):
            at_least(f"model.{f.name}", getattr(self.model, f.name), 1)
        if self.model.n_embd % self.model.n_head:
            raise ConfigError(f"{name('model.n_embd')} must be a multiple of {name('model.n_head')}; got "
                              f"{self.model.n_embd} and {self.model.n_head}")
        for f in ("save_at", "save_every"):
            if getattr(self, f) is not None and not self.save_dir:
                raise ConfigError(f"{name(f)} needs {name('save_dir')}")
        if not isinstance(self.resume_tag, str) or not self.resume_tag or "/" in self.resume_tag \
                or self.resume_tag.startswith("."):
            raise ConfigError(f"{name('resume_tag')} must be a checkpoint tag such as step40, or latest; "
                              f"got {self.resume_tag!r}")
        explicit_gpu = isinstance(self.device, str) and self.device.startswith("cuda:") and self.device[5:].isdigit()
        if self.device not in DEVICES and not explicit_gpu:
            raise ConfigError(f"{name('device')} must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if self.device != "cpu" and not torch.cuda.is_available():
            raise ConfigError(f"{name('device')} {self.device}: no CUDA device is visible here; allowed: cpu")
        if self.data_shards not in DATA_SHARDS:
            raise ConfigError(f"{name('data_shards')} must be one of {', '.join(DATA_SHARDS)}; got {self.data_shards!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"{name('backend')} must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.dtype not in FLOAT_DTYPES:
            raise ConfigError(f"{name('dtype')} must be one of {', '.join(FLOAT_DTYPES)}; got {self.dtype!r}")
        if self.pipeline_stages and not self.deepspeed_config and self.dtype != "fp32":
            raise ConfigError(f"{name('dtype')} must be fp32 with {name('pipeline_stages')} and no "
                              f"{name('deepspeed_config')} (a DeepSpeed config's bf16 section sets it); got {self.dtype}")
        section = dict(self.lowcomm)
        if "replicas" in section:  # replicas of different shapes: checked with the rest by the DeepSpeed glue
            from ds_lowcomm.deepspeed.hetero import parse_replicas

            parse_replicas(section.pop("replicas"), where=f"{name('lowcomm')}.replicas")
        if "activations" in section:  # codecs between pipeline stages (a nested mapping of its own)
            if not self.pipeline_stages and "replicas" not in self.lowcomm:
                raise ConfigError(f"{name('lowcomm')}.activations: codecs between pipeline stages need "
                                  f"{name('pipeline_stages')} > 0")
            ActivationSettings.from_section(section.pop("activations"), where=f"{name('lowcomm')}.activations")
        fault_tolerance = None
        if "fault_tolerance" in section:  # replicas as independent jobs over torchft (a nested mapping)
            fault_tolerance = _fault_tolerance(section.pop("fault_tolerance"), f"{name('lowcomm')}.fault_tolerance")
            if self.deepspeed_config or self.pipeline_stages or self.resume_from:
                raise ConfigError(f"{name('lowcomm')}.fault_tolerance works with a torch optimizer's step so far: not "
                                  f"with {name('deepspeed_config')}, {name('pipeline_stages')} or "
                                  f"{name('resume_from')} (a restarted replica heals from a live peer instead)")
        object.__setattr__(self, "_fault_tolerance", fault_tolerance)
        cfg = LowcommConfig.from_dict(section, where=name("lowcomm"))
        if fault_tolerance is not None:
            check_method(cfg.effective(), where=name("lowcomm"))
        check_lr(self.lr, where=name("lr"))
        if not (isinstance(self.clip_grad, (int, float)) and not isinstance(self.clip_grad, bool)
                and 0 <= self.clip_grad < float("inf")):
            raise ConfigError(f"{name('clip_grad')} must be a number >= 0 (0: no clipping); got {self.clip_grad!r}")
        if self.clip_grad and self.deepspeed_config:
            raise ConfigError(f"{name('clip_grad')}: with {name('deepspeed_config')} the config's gradient_clipping "
                              f"sets it; leave {name('clip_grad')} at 0")
        if self.lr_decay not in LR_DECAYS:
            raise ConfigError(f"{name('lr_decay')} must be one of {', '.join(LR_DECAYS)}; got {self.lr_decay!r}")
        return cfg

    @property
    def fault_tolerance(self):
        """``lowcomm.fault_tolerance`` parsed (a FaultToleranceSettings), or None."""
        return self._fault_tolerance

    @property
    def lowcomm_config(self) -> LowcommConfig:
        """The ``lowcomm`` section, parsed and validated."""
        return self._lowcomm_config

    @property
    def eval_interval(self) -> int:
        return self.eval_every or max(1, self.steps // 10)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], names: Mapping[str, str] | None = None) -> "TrainSpec":
        """The inverse of :meth:`to_dict`; missing fields take their defaults."""
        _refuse_unknown("spec", raw, cls)
        return cls(**raw, names=names)

    @classmethod
    def from_args(cls, args, **fields: Any) -> "TrainSpec":
        """The spec a parsed command line gives: each flag of :data:`FLAGS` the parser has, then
        ``fields``; errors name the flags."""
        values: dict[str, Any] = {}
        model: dict[str, Any] = {}
        for flag, target in FLAGS.items():
            dest = flag.lstrip("-").replace("-", "_")
            if not hasattr(args, dest):
                continue
            value = getattr(args, dest)
            if target in ZERO_IS_UNSET and value == 0:
                value = None
            if target.startswith("model."):
                model[target[len("model."):]] = value
            else:
                values[target] = value
        return cls(**{"model": model, **values, **fields}, names={target: flag for flag, target in FLAGS.items()})


def _refuse_unknown(where: str, raw: Mapping[str, Any], cls) -> None:
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; allowed: {', '.join(known)}")


def _model_config(raw: Mapping[str, Any]) -> GPTConfig:
    _refuse_unknown("model", raw, GPTConfig)
    return GPTConfig(**raw)


DEFAULTS = TrainSpec()  # the command lines' defaults


def _fault_tolerance(raw, where: str) -> FaultToleranceSettings:
    settings = FaultToleranceSettings.from_section(raw, where=where)
    settings.data_shard(where)  # the loop reads the replica's own shard
    return settings
