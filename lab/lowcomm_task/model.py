"""A small byte-level decoder-only transformer (GPT-2 shaped, pre-norm, tied embeddings), and the
same model as DeepSpeed pipeline layers (:func:`gpt_pipeline_layers`, :func:`gpt_pipeline_module`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = nn.Embedding(cfg.seq_len, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("proj.weight", "fc_out.weight")):
                nn.init.normal_(p, std=0.02 / (2 * cfg.n_layer) ** 0.5)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.tok.weight.T
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


# -- the GPT as DeepSpeed pipeline layers -------------------------------------------------------------
TIED_KEY = "tok"  # the token embedding, also the head (tied weights)
PARTITION_METHOD = "type:Block"  # the blocks evenly over the stages; embeddings first, head last


class AddPosition(nn.Module):
    """The position embedding added to the token embedding (the GPT's ``self.pos``)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.pos = nn.Embedding(cfg.seq_len, cfg.n_embd)

    def forward(self, x):
        return x + self.pos(torch.arange(x.shape[1], device=x.device))


def tied_head(tok: nn.Embedding, x: torch.Tensor) -> torch.Tensor:
    """The output head: the final hidden states against the (tied) token embedding."""
    return x @ tok.weight.T


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The GPT's loss on its logits (the pipeline's ``loss_fn``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def gpt_pipeline_layers(cfg: GPTConfig) -> list:
    """The GPT of ``cfg`` as a list of DeepSpeed ``LayerSpec`` / ``TiedLayerSpec``: the token
    embedding (tied, key "tok") and the position embedding, the blocks, the final norm and the head
    (the same tied embedding, applied by :func:`tied_head`). Forward and loss (:func:`gpt_loss`)
    are the plain :class:`GPT`'s for the same weights; see :func:`load_gpt_weights`."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    return [
        TiedLayerSpec(TIED_KEY, nn.Embedding, cfg.vocab_size, cfg.n_embd),
        LayerSpec(AddPosition, cfg),
        *(LayerSpec(Block, cfg) for _ in range(cfg.n_layer)),
        LayerSpec(nn.LayerNorm, cfg.n_embd),
        TiedLayerSpec(TIED_KEY, nn.Embedding, cfg.vocab_size, cfg.n_embd, forward_fn=tied_head),
    ]


def gpt_name(pipe_name: str, cfg: GPTConfig) -> str:
    """The plain GPT's name of a pipeline module's parameter (names as DeepSpeed gives them: the
    layer's index in :func:`gpt_pipeline_layers`, or ``tied_modules.<key>``)."""
    head, _, rest = pipe_name.partition(".")
    if head == "tied_modules":  # tied_modules.tok.weight
        return rest
    idx = int(head)
    if idx == 1:
        return rest  # AddPosition's pos.weight
    if idx < 2 + cfg.n_layer:
        return f"blocks.{idx - 2}.{rest}"
    return f"ln_f.{rest}"


@torch.no_grad()
def load_gpt_weights(module: nn.Module, gpt: GPT) -> None:
    """Copy a plain GPT's weights into the layers of ``module`` (a PipelineModule of
    :func:`gpt_pipeline_layers`) that this rank's stage holds."""
    source = gpt.state_dict()
    for name, tensor in module.state_dict().items():
        tensor.copy_(source[gpt_name(name, gpt.cfg)])


def gpt_pipeline_module(gpt: GPT, num_stages: int, **kwargs) -> nn.Module:
    """A ``deepspeed.pipe.PipelineModule`` of ``num_stages`` stages with ``gpt``'s weights (build
    the GPT on every rank from the same seed, then this; after ``deepspeed.init_distributed()``)."""
    from deepspeed.pipe import PipelineModule

    from ds_lowcomm.config import ConfigError

    module = PipelineModule(layers=gpt_pipeline_layers(gpt.cfg), num_stages=num_stages, loss_fn=gpt_loss,
                            partition_method=kwargs.pop("partition_method", PARTITION_METHOD), **kwargs)
    parts = list(module.parts)
    if any(b <= a for a, b in zip(parts, parts[1:])):
        raise ConfigError(f"--pipeline-stages {num_stages}: the GPT's {len(module._layer_specs)} layers leave a "
                          f"stage empty (partition {parts}); use fewer stages or more --n-layer")
    load_gpt_weights(module, gpt)
    return module
