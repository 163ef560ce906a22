"""Checkpoints of a ds_lowcomm engine: ``save_checkpoint`` / ``load_checkpoint`` patched in.

Layout of ``engine.save_checkpoint(dir)`` (tag ``T``)::

    dir/lowcomm.json          world size, replica size, method, ZeRO stage, latest tag
    dir/latest                T (as DeepSpeed writes it)
    dir/zero_to_fp32.py       DeepSpeed's recovery scripts (zero_to_torch.py too), at every stage
    dir/T/                    a plain DeepSpeed checkpoint of replica 0 (the export, see below)
    dir/replica00000/latest   T
    dir/replica00000/T/...    replica 0's DeepSpeed checkpoint, the method's state included
    dir/replica00001/latest   T
    dir/replica00001/T/...    replica 1's ...

Why one DeepSpeed checkpoint per replica: DeepSpeed's data-parallel group is one replica, so it
writes the files of data-parallel rank 0 (ZeRO 0) or of each data-parallel rank (ZeRO 1/2/3) of
*its* group under the same names in every replica: the replicas would overwrite each other and
every rank's method state (momenta, residuals, anchors) but one replica's would be lost. At ZeRO 0
with several ranks a replica, each rank syncs (and alone holds the method state of) its share of
the parameters: before the save, that state and each rank's ledger are sent to the replica's other
ranks (``collect_replica_state``), so the replica's one file holds all of it, and a load gives
each rank its own back.

Why ``dir/T/`` is replica 0: it makes ``dir`` a DeepSpeed checkpoint for DeepSpeed's own tools
(``zero_to_fp32``, a plain engine's ``load_checkpoint(dir, load_module_only=True)``), which know
one data-parallel group. Replicas hold identical parameters after a sync with every method; in
the local phase of the outer methods (diloco, dct_diloco, sparseloco, mtdao between two outer
steps) they differ, and the export is replica 0's parameters.
- ZeRO 1/2/3: ``dir/T/`` holds hard links to replica 0's files (model states, its ranks' ZeRO
  partitions): no byte is copied and the export cannot drift from
  what a resume loads; where the file system refuses hard links they are copied.
- ZeRO 0: DeepSpeed's stage-0 checkpoint has no ``*_optim_states.pt`` and no parameter shapes,
  which ``zero_to_fp32`` needs. ``dir/T/`` then gets a model-states file (module, buffer names,
  parameter shapes, no optimizer) and one stage-0 "partition" file holding the flat fp32
  parameters, in the format ``zero_to_fp32`` reads (world size 1): two model-sized files written
  by global rank 0. A bf16/fp16 engine exports its module's values.
Global rank 0 builds ``dir/.T.lowcomm-tmp`` after every rank of every replica has reported its
save done (one agreement over the whole job: a failure anywhere is raised on every rank and nothing
is published) and renames it to ``dir/T``; ``lowcomm.json`` and ``latest`` are written (by replace)
after that, so a crash leaves the previous latest checkpoint named.

``load_checkpoint(dir)`` on a directory without ``lowcomm.json`` is a warm start from a plain
DeepSpeed checkpoint: every rank loads the module from ``dir/<latest>/`` (DeepSpeed's
``load_module_only`` path). Adam's moments follow where they map (a ZeRO 0 checkpoint into a ZeRO 0
fp32 run of adamw, or of an outer method's inner AdamW; not with ``load_module_only=True``); all
other method state (anchors, momenta, residuals, the learning-rate schedule) starts fresh. A log
line on rank 0 says which.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import types
from collections import OrderedDict
from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint_io import (DIGEST_SUFFIX, CheckpointError, agree_on_problems, check_digests, load_file, save_file,
                             write_text)
from ..comm import ByteLedger, TorchDistTransport, gather_json
from ..comm.consistency import settings_differences
from ..settings import ConfigError
from . import internals

CHECKPOINT_META = "lowcomm.json"
LATEST = "latest"  # DeepSpeed's name
LEDGERS_KEY = "lowcomm_ledgers"  # in DeepSpeed's client state: the run's ledgers besides the method's
REPLICA_DIR = re.compile(r"replica\d{5}")

logger = logging.getLogger(__name__)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _stage0_export(engine, path: str) -> None:
    """``zero_to_fp32``-readable files of a ZeRO 0 engine (see the module docstring)."""
    (BUFFER_NAMES, FROZEN_PARAM_FRAGMENTS, FROZEN_PARAM_SHAPES, OPTIMIZER_STATE_DICT, PARAM_SHAPES, PARTITION_COUNT,
     SINGLE_PARTITION_OF_FP32_GROUPS, ZERO_STAGE) = (internals.live(item) for item in internals.CHECKPOINT_KEYS)
    version = internals.live(internals.DS_VERSION)

    # One group, the module's trainable parameters in named_parameters() order (shared ones once:
    # zero_to_fp32 restores them from shared_params); the optimizer's groups are not used, since a
    # bf16/fp16 engine's hold flat master copies.
    named = list(engine.module.named_parameters())
    trainable = [(n, p) for n, p in named if p.requires_grad]
    frozen = [(n, p) for n, p in named if not p.requires_grad]
    model = {
        "module": engine.module_state_dict(),
        BUFFER_NAMES: internals.method(engine, internals.GET_BUFFER_NAMES)(),
        "optimizer": None,
        PARAM_SHAPES: [OrderedDict((n, p.shape) for n, p in trainable)],
        FROZEN_PARAM_SHAPES: OrderedDict((n, p.shape) for n, p in frozen),
        FROZEN_PARAM_FRAGMENTS: OrderedDict((n, p.detach().cpu()) for n, p in frozen),
        "shared_params": internals.method(engine, internals.GET_SHARED_PARAMS)(),
        "lr_scheduler": None,
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "dp_world_size": 1,
        "mp_world_size": engine.mp_world_size,
        "ds_config": engine.config,
        "ds_version": version,
    }
    flat = [torch.cat([p.detach().reshape(-1).float().cpu() for _, p in trainable] or [torch.zeros(0)])]
    optim = {OPTIMIZER_STATE_DICT: {ZERO_STAGE: 0, PARTITION_COUNT: 1, SINGLE_PARTITION_OF_FP32_GROUPS: flat},
             "ds_config": engine.config, "ds_version": version}
    save_file(model, os.path.join(path, "mp_rank_00_model_states.pt"))
    save_file(optim, os.path.join(path, "zero_pp_rank_0_mp_rank_00_optim_states.pt"))


def _adam_target(run, engine) -> torch.optim.Optimizer | None:
    """The torch AdamW whose state a plain DeepSpeed checkpoint's Adam state can fill: the adamw
    method itself, or an outer method's inner AdamW; at ZeRO 0 with fp32 parameters only (ZeRO
    1/2 and bf16/fp16 engines hand the optimizer flat partitions or master copies)."""
    if run.config.zero_stage != 0 or engine.optimizer is not run.optimizer:
        return None
    from ..optim import AllReduceAdamW

    target = run.optimizer if isinstance(run.optimizer, AllReduceAdamW) else getattr(run.optimizer, "inner", None)
    return target if isinstance(target, torch.optim.AdamW) else None


def _map_adam_state(target: torch.optim.Optimizer, saved: Any) -> str | None:
    """Load Adam moments saved by a plain DeepSpeed ZeRO 0 engine (torch's AdamW or DeepSpeed's
    FusedAdam) into ``target``, keeping target's hyperparameters (the config's). Returns why
    not, or None when loaded."""
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
        return "the checkpoint holds no optimizer state of ZeRO 0"
    groups = target.param_groups
    if [len(g["params"]) for g in saved["param_groups"]] != [len(g["params"]) for g in groups]:
        return "its parameter groups do not match this model's"
    state = {}
    for sg, tg in zip(saved["param_groups"], groups):
        for i, p in zip(sg["params"], tg["params"]):
            st = saved["state"].get(i)
            if not st:
                continue
            step = st.get("step", sg.get("step"))
            if step is None or not {"exp_avg", "exp_avg_sq"} <= st.keys() or st["exp_avg"].shape != p.shape \
                    or st["exp_avg_sq"].shape != p.shape:
                return "its optimizer state is not Adam's moments of these parameters"
            state[i] = {"step": torch.as_tensor(float(step)), "exp_avg": st["exp_avg"], "exp_avg_sq": st["exp_avg_sq"]}
    torch.optim.Optimizer.load_state_dict(target, {
        "state": state,
        "param_groups": [{**{k: v for k, v in tg.items() if k != "params"}, "params": list(sg["params"])}
                         for sg, tg in zip(saved["param_groups"], groups)]})
    return None


def _deepspeed_globals() -> list:
    """The classes DeepSpeed's own checkpoint files hold besides data, allowed by name at load
    (its ZeRO stage enum, its loss scalers: plain attribute holders); nothing else is unpickled."""
    return [internals.live(item) for item in internals.CHECKPOINT_CLASSES]


def safe_checkpoint_engine(engine) -> None:
    """The engine's checkpoint engine writes every file atomically with its digest beside it and
    loads with ``weights_only=True`` (DeepSpeed's own loads with ``weights_only=False``: a
    pickled call in a checkpoint would run). Files DeepSpeed wrote without ds_lowcomm (a warm
    start's) have no digest; the load checks it where there is one."""
    ce = internals.get(engine, internals.CHECKPOINT_ENGINE)
    if not isinstance(ce, internals.live(internals.TORCH_CHECKPOINT_ENGINE)):
        raise ConfigError(f"checkpoint.writer / datastates: DeepSpeed chose its {type(ce).__name__}; ds_lowcomm "
                          "replaces the checkpoint engine's save and load and supports DeepSpeed's default "
                          "TorchCheckpointEngine only: leave checkpoint.writer and datastates out of the config")
    zipfile = internals.get(ce, internals.ZIPFILE_SERIALIZATION)
    allowed = _deepspeed_globals()
    internals.replace_method(ce, internals.CHECKPOINT_SAVE, lambda state_dict, path: save_file(
        state_dict, path, _use_new_zipfile_serialization=zipfile))
    internals.replace_method(ce, internals.CHECKPOINT_LOAD, lambda path, map_location=None: load_file(
        path, map_location, allowed=allowed, digest="if_present"))


def patch_checkpoint(engine, run) -> None:
    safe_checkpoint_engine(engine)
    # wrapped below; declared with the parameters the wrappers pass by name
    save = internals.method(engine, internals.SAVE_CHECKPOINT)
    load = internals.method(engine, internals.LOAD_CHECKPOINT)
    topology = run.topology
    # Agreements of the whole job (torch.distributed's default group, every replica whatever the
    # layout), each wait bounded by lowcomm.timeout_s; their few bytes are checkpoint traffic,
    # in no ledger's totals.
    job = TorchDistTransport(ledger=ByteLedger(), timeout_s=run.config.lowcomm.comm.timeout_s)

    def agree(problems: list[str], **what) -> None:
        agree_on_problems(problems, gather=lambda mine: gather_json(job, mine), **what)

    def replica_dir(base: str) -> str:
        return os.path.join(base, f"replica{topology.replica:05d}")

    def meta(self) -> dict[str, Any]:
        out = {"world_size": topology.world_size, "replica_size": len(topology.replicas[0]),
               "method": run.config.lowcomm.method, "zero_stage": run.config.zero_stage}
        if run.config.replicas:  # replicas of different shapes: the layout too
            out["replicas"] = [spec.describe() for spec in run.config.replicas]
        return out

    def export(self, save_dir: str, tag: str) -> None:
        """Global rank 0: ``save_dir/tag`` becomes replica 0's checkpoint (module docstring)."""
        final, tmp = os.path.join(save_dir, tag), os.path.join(save_dir, f".{tag}.lowcomm-tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        from deepspeed.runtime.pipe.engine import PipelineEngine

        if run.config.zero_stage == 0 and not isinstance(self, PipelineEngine):  # pipelines save per layer
            _stage0_export(self, tmp)
        else:
            src = os.path.join(replica_dir(save_dir), tag)
            for name in sorted(os.listdir(src)):
                if os.path.isfile(os.path.join(src, name)):
                    _link_or_copy(os.path.join(src, name), os.path.join(tmp, name))
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)

    def lowcomm_save(self, save_dir, tag=None, client_state={}, save_latest=True, **kwargs):
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"  # DeepSpeed's default
        if REPLICA_DIR.fullmatch(tag) or tag.startswith("."):
            raise ValueError(f"tag {tag!r}: names like replicaNNNNN and dot-names are ds_lowcomm's own")
        run.optimizer.leave_syncs(f"save_checkpoint {tag!r}")  # a whole-job step: no sync until every rank is here
        problems, out = [], None
        try:
            # The run's other ledgers travel beside the method's (which is in the optimizer's state):
            # every total of summary() then counts the whole run after a resume. The checkpoint's own
            # traffic (DeepSpeed's tag check and barriers, here and at load) is in no total, so a
            # resumed run's totals equal an uninterrupted one's.
            ledgers = {k: ledger.state_dict() for k, ledger in run.ledgers().items()}
            client_state = {**client_state, LEDGERS_KEY: ledgers}
            try:
                # ZeRO 0 writes one file per replica (its data-parallel rank 0's): it must hold the
                # method state the replica's other ranks own (each syncs its share of the parameters)
                run.optimizer.collect_replica_state()
                out = save(replica_dir(save_dir), tag, client_state=client_state, save_latest=save_latest, **kwargs)
            finally:
                run.optimizer.drop_collected_state()  # on ranks whose state DeepSpeed did not ask for
                for k, ledger in run.ledgers().items():
                    ledger.load_state_dict(ledgers[k])
            if save_latest and topology.local_rank == 0 and topology.replica != 0:
                write_text(os.path.join(replica_dir(save_dir), LATEST), tag)  # DeepSpeed: global rank 0 only
        except Exception as err:  # noqa: BLE001 - every rank must hear of it, whatever it was
            problems.append(f"{type(err).__name__}: {err}")
        # DeepSpeed's own closing barrier spans one replica's world only with replicas of different
        # shapes (subworld.py): every replica of the job must be done, and well, before rank 0
        # publishes; otherwise a `latest` naming an unfinished checkpoint could be left behind.
        agree(problems, what=f"checkpoint {tag!r} not saved ({save_dir}: latest left as it was)")
        if dist.get_rank() == 0:
            export(self, save_dir, tag)
            # DeepSpeed copies zero_to_fp32.py / zero_to_torch.py next to the tags it saves (here the
            # replica folders, and at ZeRO 1-3 only): they belong beside the export too.
            internals.method(self, internals.COPY_RECOVERY_SCRIPT)(save_dir)
            path = os.path.join(save_dir, CHECKPOINT_META)
            latest = tag
            if not save_latest and os.path.exists(path):
                with open(path) as f:
                    latest = json.load(f).get("latest")
            elif not save_latest:
                latest = None
            write_text(path, json.dumps({**meta(self), "latest": latest}))
            if save_latest:
                write_text(os.path.join(save_dir, LATEST), tag)
        agree([])  # no rank reads the directory before it is complete
        return out

    def warm_start(self, load_dir, tag, kwargs):
        """A plain DeepSpeed checkpoint: the module on every rank; Adam's moments where they map
        (ZeRO 0: adamw, or an outer method's inner AdamW); the rest of the method's state fresh."""
        opt = run.optimizer
        inner = getattr(opt, "inner", None)
        if any(opt.state.values()) or (inner is not None and any(inner.state.values())):
            raise ValueError(f"{load_dir}: a plain DeepSpeed checkpoint (no {CHECKPOINT_META}) is a warm start; "
                             "load it before the first step")
        want_optimizer = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only", False)
        kwargs = {**kwargs, "load_module_only": True, "load_optimizer_states": False,
                  "load_lr_scheduler_states": False}
        path, client_state = load(load_dir, tag, **kwargs)
        if path is None:
            raise FileNotFoundError(f"{load_dir}: DeepSpeed found no checkpoint to load (tag {tag!r})")
        method = run.config.lowcomm.method
        if not want_optimizer:
            why = "load_module_only / load_optimizer_states=False"
        elif (target := _adam_target(run, self)) is None:
            why = f"only a ZeRO 0 fp32 run's adamw or inner AdamW can take it ({method}, ZeRO {run.config.zero_stage})"
        else:
            file = os.path.join(path, "mp_rank_00_model_states.pt") if os.path.isdir(path) else path
            saved = self.checkpoint_engine.load(file, map_location="cpu").get("optimizer")
            why = _map_adam_state(target, saved)
        if dist.get_rank() == 0:
            if why is None:
                logger.warning("ds_lowcomm: warm start from the plain DeepSpeed checkpoint %s: module and Adam's "
                               "moments loaded on every rank; the rest of the %s state starts fresh", path, method)
            else:
                logger.warning("ds_lowcomm: warm start from the plain DeepSpeed checkpoint %s: module loaded on every "
                               "rank; the optimizer and the %s method state start fresh (%s)", path, method, why)
        return path, client_state

    def lowcomm_load(self, load_dir, tag=None, **kwargs):
        path = os.path.join(load_dir, CHECKPOINT_META)
        if not os.path.exists(path):
            if tag is None and not os.path.isfile(os.path.join(load_dir, LATEST)):
                raise FileNotFoundError(f"{load_dir}: neither {CHECKPOINT_META} (ds_lowcomm) nor {LATEST} "
                                        "(DeepSpeed): not a checkpoint directory, or pass tag=")
            return warm_start(self, load_dir, tag, kwargs)
        with open(path) as f:
            saved = json.load(f)
        now = meta(self)
        # only the run's fields: the file's "latest" is no setting
        diffs = settings_differences({k: saved.get(k) for k in now}, now, "saved", "now")
        if diffs:
            raise ValueError(f"{load_dir}: checkpoint does not fit this run ({diffs})")
        tag = tag if tag is not None else saved.get("latest")
        if tag is None:
            raise FileNotFoundError(f"{load_dir}: no latest checkpoint recorded; pass tag=")
        # Every file of this replica's checkpoint matches the digest written with it, on every
        # rank, before any rank loads (a rank that stopped alone would leave the others waiting).
        tag_dir = os.path.join(replica_dir(load_dir), str(tag))
        files = [os.path.join(tag_dir, n) for n in sorted(os.listdir(tag_dir))
                 if not n.endswith(DIGEST_SUFFIX) and not n.startswith(".")] if os.path.isdir(tag_dir) else []
        agree(check_digests(f for f in files if os.path.isfile(f)) if files
                          else [f"{tag_dir}: no such checkpoint"])
        problems, (path, client_state) = [], (None, None)
        try:
            path, client_state = load(replica_dir(load_dir), tag, **kwargs)
        except CheckpointError as err:  # a file that is not plain data: refused, and by every rank
            problems.append(str(err))
        agree(problems)
        if path is None:
            raise FileNotFoundError(f"{replica_dir(load_dir)}/{tag}: DeepSpeed found no checkpoint to load")
        run.optimizer.check_replicas_agree()  # the replicas' copies of what must be equal are
        saved_ledgers = (client_state or {}).pop(LEDGERS_KEY, None)
        if saved_ledgers is not None:  # checkpoints from before ds_lowcomm saved them: totals from the resume
            for k, ledger in run.ledgers().items():
                ledger.load_state_dict(saved_ledgers[k])
        return path, client_state

    engine.save_checkpoint = types.MethodType(lowcomm_save, engine)
    engine.load_checkpoint = types.MethodType(lowcomm_load, engine)
