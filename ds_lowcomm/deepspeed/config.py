"""Split a DeepSpeed JSON config into the lowcomm settings and what DeepSpeed itself gets."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..codec import ActivationSettings
from ..optim import AdamSettings, LowcommConfig
from ..optim.registry import DEFAULT_METHOD, OUTER_METHODS
from ..settings import ConfigError

INNER_OPTIMIZERS = ("adam", "adamw")
# DeepSpeed's Adam/AdamW switches that ds_lowcomm's optimizers (torch's AdamW update, decoupled
# weight decay, bias correction, no AMSGrad) can honour, with the values they honour. Any other
# key of optimizer.params is refused by name rather than ignored.
ADAM_SWITCHES = {
    "adam_w_mode": (True,),  # DeepSpeed's default for Adam too: decoupled weight decay
    "bias_correction": (True,),
    "amsgrad": (False,),
    "torch_adam": (True, False),  # the update is torch's AdamW either way (or apex's with lowcomm.inner_impl)
}


# lowcomm keys of ds_lowcomm's own inner optimizer that a DeepSpeed Muon section replaces, and where
# the section holds the same setting
MUON_SECTION_OWNS = {"inner_muon_lr": "optimizer.params.muon_lr (or lr)",
                     "inner_muon_momentum": "optimizer.params.momentum",
                     "inner_impl": "optimizer.params.torch_adam (its auxiliary Adam is torch's either way)",
                     "inner_optimizer": "optimizer.type Muon itself"}


@dataclass
class SplitConfig:
    lowcomm: LowcommConfig
    deepspeed: dict[str, Any]  # what deepspeed.initialize receives
    optimizer: AdamSettings | None  # lr, betas, eps, weight_decay of an Adam/AdamW "optimizer" (None: Muon)
    zero_stage: int
    activations: ActivationSettings  # lowcomm.activations: codecs between pipeline stages
    replicas: tuple = ()  # lowcomm.replicas: replicas of different shapes (hetero.ReplicaSpec), or ()
    fault_tolerance: Any = None  # lowcomm.fault_tolerance (FaultToleranceSettings): one replica of several jobs
    muon: Any = None  # optimizer.type Muon: DeepSpeed's Muon section (muon.MuonSection); then optimizer is None


def load_config(config: str | Path | dict) -> dict[str, Any]:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    path = Path(config)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"deepspeed config file not found: {path}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None


def split_config(raw: dict[str, Any]) -> SplitConfig:
    """Validate the ``lowcomm`` and ``optimizer`` sections and prepare DeepSpeed's config."""
    ds = copy.deepcopy(raw)
    section = ds.pop("lowcomm", None)
    activations = ActivationSettings()
    if isinstance(section, dict) and "activations" in section:  # a nested mapping of its own
        section = dict(section)
        activations = ActivationSettings.from_section(section.pop("activations"), where="lowcomm.activations")
    replicas, replica_size_given = (), isinstance(section, dict) and "replica_size" in section
    if isinstance(section, dict) and "replicas" in section:  # a list of mappings of its own
        from .hetero import parse_replicas

        section = dict(section)
        replicas = parse_replicas(section.pop("replicas"))
    fault_tolerance = None
    if isinstance(section, dict) and "fault_tolerance" in section:  # this job is one replica of several, over torchft
        from ..optim.fault_tolerance import FaultToleranceSettings

        section = dict(section)
        fault_tolerance = FaultToleranceSettings.from_section(section.pop("fault_tolerance"))
    _refuse_own_inner_keys_beside_muon(section, ds.get("optimizer"))  # before from_dict's own refusals of them
    lowcomm = LowcommConfig.from_dict(section, where="lowcomm")
    stage = int((ds.get("zero_optimization") or {}).get("stage", 0))
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3 with lowcomm; got {stage}")
    zero_section = ds.get("zero_optimization") or {}
    for key in ("offload_optimizer", "offload_param"):
        device = (zero_section.get(key) or {}).get("device", "none")
        if str(device).lower() != "none":
            raise ConfigError(f"zero_optimization.{key}.device must be none with lowcomm; got {device!r} (the "
                              "method steps ZeRO's partitions in place, which offloading moves off the device)")
    accumulate = str((ds.get("data_types") or {}).get("grad_accum_dtype", "")).lower()
    if stage == 1 and (ds.get("bf16") or {}).get("enabled") and accumulate in ("fp32", "float32"):
        # DeepSpeed then runs its BF16_Optimizer instead of ZeRO 1's, whose partitions zero.py steps
        raise ConfigError("data_types.grad_accum_dtype must not be fp32 with bf16 at zero_optimization.stage 1 "
                          "with lowcomm (DeepSpeed's BF16_Optimizer path); leave it out (bf16) or use stage 0 or 2")
    if (ds.get("zero_optimization") or {}).get("elastic_checkpoint"):
        raise ConfigError("zero_optimization.elastic_checkpoint must be false with lowcomm: elastic checkpoints "
                          "keep only per-group optimizer state and would drop the method's state")
    low_precision = [k for k in ("fp16", "bf16") if (ds.get(k) or {}).get("enabled")]
    if lowcomm.method == "dion" and (stage >= 1 or low_precision):
        # dion factors each weight matrix; there the optimizer holds flat pieces of them
        raise ConfigError(f"lowcomm.method dion needs zero_optimization.stage 0 in fp32 (ZeRO 1-3 and DeepSpeed's "
                          f"fp16/bf16 optimizers hand the optimizer flat pieces, not weight matrices); got stage "
                          f"{stage}{''.join(f', {k}.enabled true' for k in low_precision)}. Use another method there")
    if replicas and lowcomm.effective().get("sync_every_schedule"):
        raise ConfigError("lowcomm.sync_every_schedule is not supported with lowcomm.replicas (replicas of different "
                          "shapes run a fixed number of steps per sync, their inner_steps or sync_every); set "
                          "sync_every_schedule to [] there")
    fragments = lowcomm.effective().get("fragments", 1)
    if stage >= 1 and fragments > 1:
        raise ConfigError(f"lowcomm.fragments must be 1 with zero_optimization.stage {stage} (ZeRO 1-3 hand the "
                          f"optimizer one flat partition, which has no parameter fragments); got {fragments}. "
                          "Use stage 0 for streaming syncs, or fragments 1 (sync_delay still overlaps the sync)")
    opt = ds.get("optimizer")
    if not isinstance(opt, dict) or "params" not in opt:
        raise ConfigError('optimizer: a section {"type": "AdamW", "params": {"lr": ...}} is required (it is the '
                          "per-step optimizer, or the inner optimizer of outer-loop methods)")
    kind = str(opt.get("type", "")).lower()
    if kind not in (*INNER_OPTIMIZERS, "muon"):
        raise ConfigError(f"optimizer.type must be one of Adam, AdamW, Muon with lowcomm; got {opt.get('type')!r}")
    muon = None
    if kind == "muon":  # DeepSpeed's Muon: the inner optimizer of outer methods, or demo's Muon step (muon.py)
        from .muon import MuonSection

        muon = MuonSection.from_flat(dict(opt["params"]), where="optimizer.params", strict=True)
        muon.check_for(lowcomm.method)
    if muon is not None or lowcomm.effective().get("update") == "muon":
        if replicas:
            raise ConfigError("lowcomm.replicas (replicas of different shapes): not with Muon's step (lowcomm.update "
                              "muon or optimizer.type Muon) yet; use replica_size")
    if lowcomm.effective().get("inner_optimizer") == "muon" and replicas and stage >= 1:
        # each matrix is assembled over its replica's ZeRO partitions: replicas of one shape only
        raise ConfigError(f"lowcomm.replicas (replicas of different shapes): not with lowcomm.inner_optimizer muon at "
                          f"zero_optimization.stage {stage} yet; use replica_size, or stage 0")
    if muon is not None:
        optimizer = None
        params = {}
    else:
        params = dict(opt["params"])
    if muon is None:
        optimizer = _adam_settings(kind, params, opt)
    # ds_lowcomm builds the optimizer (every method, the adamw baseline included, so that its
    # bytes are counted the same way) and hands it to DeepSpeed as a client optimizer.
    ds.pop("optimizer")
    if stage >= 1:
        ds["zero_allow_untested_optimizer"] = True
    if replicas:
        from .hetero import check_replicas

        check_replicas(replicas, lowcomm, stage, replica_size_given)
    if fault_tolerance is not None:
        _check_fault_tolerance(fault_tolerance, lowcomm, ds, stage, replicas, replica_size_given)
    return SplitConfig(lowcomm, ds, optimizer, stage, activations, replicas, fault_tolerance, muon)


def _refuse_own_inner_keys_beside_muon(section, opt) -> None:
    """A Muon section beside an outer method is the inner optimizer, at its settings: a key choosing
    or tuning ds_lowcomm's own inner optimizer would be accepted and ignored (refused by name); beside
    demo it chooses the update rule of each half, so demo's own ``update`` would be."""
    section = section if isinstance(section, dict) else {}
    if not (isinstance(opt, dict) and str(opt.get("type", "")).lower() == "muon"):
        return
    if section.get("method", DEFAULT_METHOD) == "demo" and section.get("update", "muon") != "muon":
        # demo's groups take their rule from the section's halves (muon.demo_groups): update muon's
        raise ConfigError(f"lowcomm.update must be muon (or left out) with optimizer.type Muon (demo's step is then "
                          f"Muon's on the section's Muon half and sign's on the rest); got {section['update']!r}")
    if section.get("method", DEFAULT_METHOD) not in OUTER_METHODS:
        return
    if section.get("inner_optimizer") == "muon":
        raise ConfigError("lowcomm.inner_optimizer muon with optimizer.type Muon: DeepSpeed's Muon is the inner "
                          "optimizer already; leave inner_optimizer out (adamw) or use optimizer.type AdamW")
    for key, instead in MUON_SECTION_OWNS.items():
        if key in section and not (key == "inner_impl" and section[key] == "torch"):
            raise ConfigError(f"lowcomm.{key}: not with optimizer.type Muon (DeepSpeed's Muon is the inner "
                              f"optimizer, at {instead}); leave it out")


def _adam_settings(kind: str, params: dict, opt: dict) -> AdamSettings:
    """An Adam/AdamW section's params, checked (DeepSpeed's switches honoured where they match)."""
    for key, allowed in ADAM_SWITCHES.items():
        if key in params and params.pop(key) not in allowed:
            raise ConfigError(f"optimizer.params.{key} must be {' or '.join(str(a).lower() for a in allowed)} with "
                              f"lowcomm; got {opt['params'][key]!r}")
    unknown = sorted(set(params) - set(AdamSettings.flat_keys()))
    if unknown:
        raise ConfigError(f"optimizer.params: unknown key(s) {', '.join(unknown)} with lowcomm; allowed: "
                          f"{', '.join([*AdamSettings.flat_keys(), *ADAM_SWITCHES])}")
    if "lr" not in params:
        raise ConfigError("optimizer.params.lr must be a number > 0; got None")
    # DeepSpeed's AdamW, like torch's, decays weights by 0.01 unless told otherwise.
    params.setdefault("weight_decay", 0.01 if kind == "adamw" else 0.0)
    return AdamSettings.from_flat(params, where="optimizer.params")


def _check_fault_tolerance(settings, lowcomm, ds: dict, stage: int, replicas, replica_size_given: bool) -> None:
    """What each replica as its own job over torchft takes (``lowcomm.fault_tolerance``), refused by name."""
    from ..optim.fault_tolerance import check_method

    where = "lowcomm.fault_tolerance"
    settings.data_shard(where)  # every replica reads its own shard of the data: replica_id of num_replica_groups
    check_method(lowcomm.effective())
    if replicas or replica_size_given:
        raise ConfigError(f"{where}: this job is one replica (DeepSpeed's whole world); leave lowcomm.replicas and "
                          "lowcomm.replica_size out (the other replicas are the other jobs at the lighthouse)")
    if stage not in (0, 1, 2):
        raise ConfigError(f"zero_optimization.stage must be 0, 1 or 2 with {where}; got {stage} (ZeRO 3's "
                          "partitioned parameters are not healed from a peer yet)")
    if (ds.get("fp16") or {}).get("enabled"):
        raise ConfigError(f"fp16.enabled must be false with {where} (replicas of separate jobs do not agree on "
                          "a loss-scale overflow yet): use bf16 or fp32")
