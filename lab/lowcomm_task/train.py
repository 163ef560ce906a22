"""The training loop: one worker of a run, whatever trains the steps.

``train_worker(rank, world_size, spec)`` runs inside an initialised torch.distributed process
group (see :func:`lowcomm_task.workers.run_local_workers`) and returns its metrics. It serves
``ds-lowcomm compare``, ``launch/train.py`` (a DeepSpeed engine's step), the benchmarks and the
tests; what differs is the task (the reference task by default) and the step (a torch optimizer,
or a DeepSpeed engine when ``spec.deepspeed_config`` is set, a DeepSpeed pipeline engine when
``spec.pipeline_stages`` is; see :mod:`lowcomm_task.steps`).
All method-specific communication goes through the step's optimizer and is in its ledger; the
evaluation metrics are averaged over ranks with a separate all-reduce that is not method traffic.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from ds_lowcomm.checkpoint_io import params_digest
from ds_lowcomm.comm import backend_device

from .reference import ReferenceTask
from .spec import TrainSpec
from .steps import DeepSpeedStep, PipelineStep, Step, TorchStep, has_replica_layout


class Task(Protocol):
    """What the loop trains, built from the spec on every rank (before the model)."""

    def build_model(self) -> torch.nn.Module:
        """Called right after ``torch.manual_seed(spec.seed)``: the same start on every rank."""

    def train_batch(self, rank: int, world_size: int, index: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Micro-batch ``index`` (step x accumulation + micro-step) of ``rank``, on the CPU."""

    def loss(self, module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...

    def evaluation(self, batch: int, device) -> Callable[[torch.nn.Module], dict[str, float]]:
        """The held-out evaluation: module -> metrics, "val_loss" first."""

    def val_batches(self, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The held-out batches, on the CPU (only pipeline steps ask: they evaluate by eval_batch)."""


def mean_over_ranks(*values: float) -> list[float]:
    """Evaluation metrics averaged over ranks (a plain all-reduce: not method traffic)."""
    t = torch.tensor(values, dtype=torch.float64, device=backend_device())
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def default_step(spec: TrainSpec):
    if spec.pipeline_stages or has_replica_layout(spec):  # replicas of different shapes: pipelines too
        return PipelineStep.build
    return DeepSpeedStep.build if spec.deepspeed_config else TorchStep.build


def train_worker(rank: int, world_size: int, spec: TrainSpec, task_type=ReferenceTask, make_step=None) -> dict:
    """Train ``task_type(spec)`` with the step ``make_step(model, spec, rank, task.loss)`` builds
    (default: :func:`default_step`); benchmarks pass their own tasks and peer baselines' steps."""
    task = task_type(spec)
    torch.manual_seed(spec.seed)  # same init on every rank and for every method (and device)
    step: Step = (make_step or default_step(spec))(task.build_model(), spec, rank, task.loss)
    evaluate = step.evaluation(task)
    start_step = step.load(spec.resume_from, spec.resume_tag) if spec.resume_from else 0
    # a replica over torchft: its position is the quorum's (a heal, at start or later, moves it), and
    # it reads its shard from its data_step (the steps it jumped over to sit out a sync, read later)
    ft = getattr(step, "fault_tolerance", None)
    position = (lambda done: done) if ft is None else (lambda done: ft.step)
    lag = (lambda: 0) if ft is None else (lambda: ft.data_lag)
    start_step = position(start_step)

    steps, accum, eval_every = spec.steps, step.accumulation, spec.eval_interval
    label = spec.label or step.label
    history, recent, train_s, step_times = [], [], 0.0, []
    before = step.report()  # the start-up checks' seconds are not the steps'
    started = time.perf_counter()
    i = start_step
    while i < steps:
        t0 = time.perf_counter()
        losses = step.train_step(task.train_batch(step.data_rank, step.data_world, (i - lag()) * accum + m,
                                                  step.micro_batch) for m in range(accum))
        step_times.append(time.perf_counter() - t0)
        train_s += step_times[-1]
        recent = (recent + [[loss.item() for loss in losses]])[-eval_every:]  # the losses of the last steps
        done = i + 1
        if done % eval_every == 0 or done == steps or done == spec.stop_at_step:
            window = [loss for losses in recent for loss in losses]
            metrics = evaluate()
            train_loss, *averaged = mean_over_ranks(sum(window) / len(window), *metrics.values())
            row = {"step": done, "train_loss": train_loss, **dict(zip(metrics, averaged)), **step.traffic(),
                   "train_s": train_s,  # training time so far, evaluations left out
                   "time": time.time()}  # when (a run of several jobs lines their rows up by it)
            history.append(row)
            if rank == 0 and spec.verbose:
                print(f"[{label}] step {done:5d}/{steps}  train {train_loss:.4f}  val {row['val_loss']:.4f}  "
                      f"sent {row['bytes_sent'] / 1e6:9.3f} MB", flush=True)
        if spec.save_at == done or (spec.save_every and done % spec.save_every == 0):
            step.save(spec.save_dir, done)
            if spec.stop_after_save:
                break
        target = spec.stop_at_val_loss
        if target is not None and history and history[-1]["step"] == done and history[-1]["val_loss"] <= target:
            break  # the held-out loss is averaged over ranks: every rank stops at the same step
        if done == spec.stop_at_step:
            break  # a timing run: the first steps of the full schedule
        i = position(done)
    if ft is not None:
        ft.shutdown()

    return {
        "label": label,
        "num_params": sum(p.numel() for p in step.module.parameters()),
        "history": history,
        "final_train_loss": history[-1]["train_loss"] if history else float("nan"),
        "final_val_loss": history[-1]["val_loss"] if history else float("nan"),
        "train_s": train_s,
        "step_times": step_times,  # wall seconds of each step (forward, backward, optimizer incl. its syncs)
        "wall_s": time.perf_counter() - started,  # the loop's, evaluations included
        "params_digest": params_digest(step.module),
        **_seconds_since(before, step.report()),
    }


def _seconds_since(before: dict, report: dict) -> dict:
    """``report`` with its ``codec_s`` and ``comm_s`` counted from ``before`` (the training steps'
    own, without the start-up checks; evaluations do not go through the method's ledger)."""
    return {**report, **{k: report[k] - before.get(k, 0.0) for k in ("codec_s", "comm_s") if k in report}}
