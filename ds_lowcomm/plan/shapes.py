"""The planner's models: each preset's parameter shapes, in order, and which tensors take an
orthogonalised step (Muon's, dion's) as Muon is run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..settings import ConfigError


def gpt_shapes(n_layer: int, n_embd: int, vocab: int = 256, seq_len: int = 128) -> list[tuple[int, ...]]:
    """The reference GPT's parameters (lab/lowcomm_task/model.py: tied embeddings, biases), in order."""
    d = n_embd
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d), (seq_len, d), *block * n_layer, (d,), (d,)]


def llama_shapes(hidden: int, layers: int, ffn: int, vocab: int, heads: int, kv_heads: int,
                 tied: bool = False) -> list[tuple[int, ...]]:
    """A Llama's parameters (transformers' LlamaForCausalLM: no biases, RMSNorm weights)."""
    hd = hidden // heads
    layer = [(hidden * 1, hidden), (kv_heads * hd, hidden), (kv_heads * hd, hidden), (hidden, hidden),
             (ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    return [(vocab, hidden), *layer * layers, (hidden,), *([] if tied else [(vocab, hidden)])]


@dataclass(frozen=True)
class Model:
    shapes: Callable[[], list[tuple[int, ...]]]
    about: str
    embeddings: int  # leading tensors that are embeddings (token, and the GPTs' position table)
    head: bool = False  # the last tensor is an untied output head


MODELS: dict[str, Model] = {
    "reference": Model(lambda: gpt_shapes(2, 128), "the reference GPT (2 layers, 128 wide, byte vocabulary)", 2),
    "gpt-125m": Model(lambda: gpt_shapes(12, 768, 50257, 1024), "GPT-2 small shapes (12 x 768, vocab 50257)", 2),
    "gpt-350m": Model(lambda: gpt_shapes(24, 1024, 50257, 1024), "GPT-2 medium shapes (24 x 1024, vocab 50257)", 2),
    "llama-1b": Model(lambda: llama_shapes(2048, 16, 8192, 128256, 32, 8, tied=True), "Llama 3.2 1B shapes", 1),
    "llama-8b": Model(lambda: llama_shapes(4096, 32, 14336, 128256, 32, 8), "Llama 3.1 8B shapes", 1, head=True),
    "llama-70b": Model(lambda: llama_shapes(8192, 80, 28672, 128256, 64, 8), "Llama 3.1 70B shapes", 1, head=True),
}


def _model(model: str) -> Model:
    if model not in MODELS:
        raise ConfigError(f"plan: model must be one of {', '.join(MODELS)}; got {model!r}")
    return MODELS[model]


def model_shapes(model: str) -> list[tuple[int, ...]]:
    return _model(model).shapes()


def other_rule_tensors(model: str, shapes=None) -> set[int]:
    """Indices of :func:`model_shapes`'s 2-D tensors that take the other rule as Muon is run
    (:func:`ds_lowcomm.optim.muon.takes_muon_step`): the embeddings and an untied output head."""
    info = _model(model)
    shapes = model_shapes(model) if shapes is None else shapes
    return {*range(info.embeddings), *([len(shapes) - 1] if info.head else [])}


def hidden_matrices(model: str, shapes=None) -> list[bool]:
    """Per tensor of :func:`model_shapes`, whether it takes an orthogonalised step (dion, Muon):
    2-D, and not one of :func:`other_rule_tensors`."""
    shapes = model_shapes(model) if shapes is None else shapes
    other = other_rule_tensors(model, shapes)
    return [len(s) == 2 and i not in other for i, s in enumerate(shapes)]
