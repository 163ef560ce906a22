"""Each replica its own DeepSpeed job, meeting the others through torchft (``lowcomm.fault_tolerance``).

The job's DeepSpeed world is one replica (ZeRO 0, 1 or 2, or pipelines, inside it, as usual); the others
are other jobs at the same lighthouse. Every rank runs a torchft manager (rank 0's serves the
replica; ranks meet in a TCPStore rank 0 serves): rank r of each replica exchanges its share with
rank r of the others over torchft's process group, and a replica joins, dies and rejoins while
the others keep training (``ds_lowcomm/optim/fault_tolerance.py`` says how a sync is committed or
discarded). What the DeepSpeed job adds, here:

- :class:`EngineState`: the engine's position (``global_steps``, ``global_samples``,
  ``micro_steps``, ``skipped_steps``) and its learning-rate scheduler, healed from the peer; a
  replica healed outside a step runs the rest of the peer's step (the scheduler's step, the
  counters) as DeepSpeed's ``_take_model_step`` does after the optimizer's.
- :class:`ModelWeights`: the model's own tensors (ZeRO 1/2: the 16-bit or fp32 weights DeepSpeed
  computes with, which the method's partitions only feed after a step; every stage: buffers).
- :class:`PositionSampler`: the loader of ``training_data`` reads this replica's shard (by
  ``replica_id``, not by who is alive) from where the replica stands: a healed replica reads on
  where its peer is, not from its shard's start (less the steps it jumped over to sit out a sync
  after its heal: those batches are read, not skipped).
"""

from __future__ import annotations

from typing import Callable

import torch

from . import internals

_STEPS, _SAMPLES, _MICRO, _SKIPPED = internals.ENGINE_POSITION


class EngineState:
    """The engine's position and learning-rate schedule, as a heal gives them (plain data only)."""

    def __init__(self, engine):
        self.engine = engine

    def state_dict(self) -> dict:
        e = self.engine
        scheduler = internals.get(e, internals.ENGINE_LR_SCHEDULER)
        return {"position": [int(internals.get(e, item)) for item in internals.ENGINE_POSITION],
                "scheduler": scheduler.state_dict() if scheduler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        for item, value in zip(internals.ENGINE_POSITION, state["position"]):
            internals.put(self.engine, item, int(value))
        scheduler = internals.get(self.engine, internals.ENGINE_LR_SCHEDULER)
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])

    def finish_step(self) -> None:
        """What DeepSpeed's engine does after the optimizer's step (``_take_model_step``, then ``step``)."""
        e = self.engine
        scheduler = internals.get(e, internals.ENGINE_LR_SCHEDULER)
        if scheduler is not None:
            scheduler.step()
        internals.put(e, _STEPS, internals.get(e, _STEPS) + 1)
        internals.put(e, _SAMPLES, internals.get(e, _SAMPLES) + e.train_batch_size())
        if not isinstance(e, internals.live(internals.PIPELINE_ENGINE)):  # train_batch does not count micro_steps
            internals.put(e, _MICRO, internals.get(e, _MICRO) + 1)


class ModelWeights:
    """The model's tensors a heal must carry besides the method's: parameters (``params``: ZeRO
    1/2, where the method steps partitions) and buffers."""

    def __init__(self, model: torch.nn.Module, params: bool):
        self.tensors = [*(model.parameters() if params else ()), *model.buffers()]

    def state_dict(self) -> dict:
        return {"tensors": list(self.tensors)}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if len(state["tensors"]) != len(self.tensors):
            raise ValueError(f"a peer's model has {len(state['tensors'])} tensors, this one {len(self.tensors)}")
        for mine, theirs in zip(self.tensors, state["tensors"]):
            mine.copy_(theirs)


class PositionSampler(torch.utils.data.Sampler):
    """This data-parallel rank's shard (``data_rank`` of ``data_world``; as ``DistributedSampler``:
    shuffled by ``seed`` + epoch, equal lengths), read from ``position()`` samples into it: at each
    ``iter``, where the replica stands (its engine's steps x samples per step and rank)."""

    def __init__(self, size: int, data_rank: int, data_world: int, position: Callable[[], int],
                 shuffle: bool = True, seed: int = 0):
        self.size, self.data_rank, self.data_world = size, data_rank, data_world
        self.position, self.shuffle, self.seed = position, shuffle, seed
        self.per_rank = size // data_world
        if self.per_rank < 1:
            raise ValueError(f"training_data has {size} samples, fewer than the {data_world} data-parallel ranks "
                             "of every replica")

    def __len__(self) -> int:
        return self.per_rank - self.position() % self.per_rank

    def __iter__(self):
        epoch, start = divmod(self.position(), self.per_rank)
        if self.shuffle:
            order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()
        else:
            order = list(range(self.size))
        mine = order[: self.per_rank * self.data_world][self.data_rank :: self.data_world]
        return iter(mine[start:])


def _positioned(engine, training_data, topology, shuffle: bool, lag: Callable[[], int]):
    gas, micro = engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu()

    def position() -> int:  # lag: the steps the replica jumped over (fault tolerance's data_lag)
        return (internals.get(engine, _STEPS) - lag()) * gas * micro

    sampler = PositionSampler(len(training_data), topology.data_rank, topology.data_world, position, shuffle)
    engine.training_data = training_data
    return engine.deepspeed_io(training_data, data_sampler=sampler)


def build_loader(engine, training_data, topology, lag: Callable[[], int]):
    """DeepSpeed's loader of ``training_data`` (``engine.deepspeed_io``: micro batch size, collate_fn,
    ...) over this replica's shard, read on from the engine's position less ``lag()`` steps."""
    loader = _positioned(engine, training_data, topology, shuffle=True, lag=lag)
    engine.training_dataloader = loader
    return loader


def build_pipeline_loader(engine, training_data, topology, lag: Callable[[], int]):
    """A pipeline engine's repeating loader as DeepSpeed builds it (in order, not shuffled; first and
    last stage), over this pipeline's shard of every replica's, read on from the engine's position
    (each pass of the repeating loader starts where the engine stands)."""
    from deepspeed.utils import RepeatingLoader

    engine.set_dataloader(RepeatingLoader(_positioned(engine, training_data, topology, shuffle=False, lag=lag)))
    first_or_last = engine.is_first_stage() or engine.is_last_stage()
    return engine.training_dataloader if first_or_last else None


__all__ = ["EngineState", "ModelWeights", "PositionSampler", "build_loader", "build_pipeline_loader"]
