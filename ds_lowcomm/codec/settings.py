"""The codec's settings: how a tensor is cut into blocks, transformed, sparsified and sent."""

from __future__ import annotations

from dataclasses import dataclass

from ..settings import Settings, check_bool, check_choice, check_int
from .sparse import AVERAGES, TRANSFORMS, VALUE_DTYPES


@dataclass(frozen=True)
class CodecSettings(Settings):
    topk: int = 32  # components kept per chunk x chunk block (smaller blocks keep proportionally fewer)
    chunk: int = 64  # block side (matrices), or chunk**2 (vectors)
    value_dtype: str = "fp32"  # how kept values travel
    transform: str = "dct"  # orthonormal 2-D DCT-II per block, or none (top-k on the raw block)
    average: str = "senders"  # mean over the ranks that sent a component (the reference's), or sum / world
    # torch.compile the codec's exact ops (selection, packing, scatters); rounding ops stay eager,
    # so the bits are unchanged. Off: on CPU it measured no faster (docs/results/codec.md).
    compile: bool = False

    def check(self, where: str) -> None:
        check_int(where, "chunk", self.chunk, 1)
        check_int(where, "topk", self.topk, 1, self.chunk * self.chunk, hint=f"chunk*chunk = {self.chunk * self.chunk}")
        check_choice(where, "value_dtype", self.value_dtype, VALUE_DTYPES)
        check_choice(where, "average", self.average, AVERAGES)
        check_choice(where, "transform", self.transform, TRANSFORMS)
        check_bool(where, "compile", self.compile)
