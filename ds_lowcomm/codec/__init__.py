"""Pure tensor math: chunked orthonormal DCT, per-block top-k, index/value packing, quantisers,
and the pipeline-activation codecs."""

from .settings import CodecSettings
from .activations import (
    ACTIVATION_CODECS,
    CODED_DTYPES,
    ActivationCodec,
    ActivationSettings,
    lowrank_basis,
    make_activation_codec,
)
from .shared_random import orthonormal_columns, shared_generator, shared_randn
from .dct import ChunkPlan, dct_basis, dct_decode, dct_encode, largest_divisor_at_most
from .sparse import (
    AVERAGES,
    FLOAT_DTYPES,
    TRANSFORMS,
    VALUE_DTYPES,
    SparseBatch,
    SparseSpec,
    ValueFormat,
    index_bits,
    pack_codes,
    pack_indices,
    pack_uint,
    packed_nbytes,
    topk_count,
    unpack_codes,
    unpack_indices,
    unpack_uint,
)

__all__ = [
    "ACTIVATION_CODECS", "CODED_DTYPES", "ActivationCodec", "ActivationSettings", "lowrank_basis",
    "make_activation_codec",
    "AVERAGES", "CodecSettings", "FLOAT_DTYPES", "TRANSFORMS", "VALUE_DTYPES", "ChunkPlan", "SparseBatch", "SparseSpec", "ValueFormat",
    "dct_basis", "dct_decode", "dct_encode", "index_bits", "largest_divisor_at_most",
    "pack_codes", "pack_indices", "pack_uint", "packed_nbytes", "topk_count", "unpack_codes", "unpack_indices",
    "unpack_uint", "orthonormal_columns", "shared_generator", "shared_randn",
]
