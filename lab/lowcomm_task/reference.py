"""The reference task as the training loop sees it: the byte corpus, the GPT, its loss and its
held-out evaluation (see :class:`lowcomm_task.train.Task`)."""

from __future__ import annotations

import torch

from .data import ByteCorpus
from .model import GPT
from .spec import TrainSpec


@torch.no_grad()
def evaluate(model, batches) -> float:
    model.eval()
    loss = sum(model(x, y).item() for x, y in batches) / len(batches)
    model.train()
    return loss


class ReferenceTask:
    def __init__(self, spec: TrainSpec):
        self.spec = spec
        self.corpus = ByteCorpus(spec.data, max_train_bytes=spec.max_train_bytes, max_val_bytes=spec.max_val_bytes)

    def build_model(self) -> torch.nn.Module:
        return GPT(self.spec.model)

    def train_batch(self, rank: int, world_size: int, index: int, batch: int):
        return self.corpus.train_batch(rank, world_size, index, batch, self.spec.model.seq_len, self.spec.seed,
                                       self.spec.data_shards)

    @staticmethod
    def loss(module, x, y):
        return module(x, y)

    def val_batches(self, batch: int):
        return self.corpus.val_batches(self.spec.val_batches, batch, self.spec.model.seq_len)

    def evaluation(self, batch: int, device):
        val = [(x.to(device), y.to(device)) for x, y in self.val_batches(batch)]
        return lambda module: {"val_loss": evaluate(module, val)}
