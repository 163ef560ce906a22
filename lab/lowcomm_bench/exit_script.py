"""A user's script, as a user writes it (tests/test_exit.py and python -m lowcomm_bench exits launch it with torchrun): its own
model, one of whose layers the forward pass never uses, ds_lowcomm's one-bit outer loop from
build_optimizer (EXCHANGE: auto, all_gather or all_reduce), a few steps, then the process group
destroyed and nothing else: no clean-up step of its own. Prints, on rank 0, how far the unused
layer moved."""

import json
import sys

import torch
import torch.distributed as dist

from ds_lowcomm.config import LowcommConfig
from ds_lowcomm.optim import build_optimizer


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.used = torch.nn.Linear(16, 16)
        self.unused = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.used(x)


dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = Model()
cfg = LowcommConfig.from_dict({"method": "dct_diloco", "sync_every": 2, "topk": 64, "chunk": 8, "transform": "none",
                               "value_dtype": "sign", "outer_lr": 1.0, "outer_momentum": 0.0, "exchange": sys.argv[1]})
opt = build_optimizer(cfg, model.parameters(), lr=1e-2)
before = [p.detach().clone() for p in model.unused.parameters()]
for step in range(8):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * rank + step))
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
moved = max((p - b).abs().max().item() for p, b in zip(model.unused.parameters(), before))
if rank == 0:
    print(json.dumps({"exchange": opt.exchange, "unused_moved": moved}), flush=True)
dist.destroy_process_group()
