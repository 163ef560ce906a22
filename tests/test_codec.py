"""The codec against independent references: the DCT from its definition and scipy, dense loops."""

import math

import numpy as np
import pytest
import scipy.fft
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_lowcomm.codec import (
    ChunkPlan,
    SparseSpec,
    ValueFormat,
    dct_basis,
    dct_decode,
    dct_encode,
    index_bits,
    pack_codes,
    pack_indices,
    unpack_codes,
    unpack_indices,
    pack_uint,
    topk_count,
    unpack_uint,
)
from ds_lowcomm.codec.dct import to_blocks

from .conftest import dct_by_definition


@pytest.mark.parametrize("n", [1, 2, 3, 7, 8, 64])
def test_basis_matches_definition_and_is_orthonormal(n):
    basis = dct_basis(n, torch.float64, torch.device("cpu")).numpy()
    np.testing.assert_allclose(basis, dct_by_definition(n), atol=1e-12)
    np.testing.assert_allclose(basis @ basis.T, np.eye(n), atol=1e-12)


def test_chunked_encode_matches_scipy_per_block():
    x = torch.randn(128, 192, dtype=torch.float64)
    plan = ChunkPlan.for_shape(x.shape, 64)
    assert (plan.h, plan.w, plan.num_blocks) == (64, 64, 6)
    coeffs = dct_encode(x, plan)
    blocks = x.numpy().reshape(2, 64, 3, 64).transpose(0, 2, 1, 3).reshape(6, 64, 64)
    for b in range(6):
        expected = scipy.fft.dctn(blocks[b], norm="ortho")
        np.testing.assert_allclose(coeffs[b].reshape(64, 64).numpy(), expected, atol=1e-10)


@pytest.mark.parametrize(
    "shape,chunk,hw,pad",
    [((128, 192), 64, (64, 64), 0), ((100, 30), 64, (50, 30), 0), ((97, 8), 64, (1, 8), 0),
     ((16, 3, 5, 5), 64, (16, 25), 0), ((), 64, (1, 1), 0), ((4096,), 64, (1, 4096), 0),
     ((60,), 8, (1, 60), 0), ((300,), 8, (8, 8), 20), ((4099,), 64, (64, 64), 4093)],
)
def test_plan_uses_largest_divisors_and_pads_long_vectors(shape, chunk, hw, pad):
    plan = ChunkPlan.for_shape(shape, chunk)
    assert (plan.h, plan.w, plan.pad) == (*hw, pad)
    assert plan.num_blocks * plan.block_size == max(1, math.prod(shape)) + pad


def test_a_long_vector_is_coded_in_chunk_by_chunk_blocks():
    """A vector longer than chunk*chunk: each piece of chunk*chunk elements, read row-major as a
    chunk x chunk block, gets the 2-D DCT (scipy's dctn of that block), the tail zero-padded;
    decoding gives the vector back."""
    x = torch.randn(3 * 256 + 100, dtype=torch.float64)
    plan = ChunkPlan.for_shape(x.shape, 16)
    coeffs = dct_encode(x, plan)
    padded = np.concatenate([x.numpy(), np.zeros(plan.pad)])
    for b in range(4):
        expected = scipy.fft.dctn(padded[b * 256 : (b + 1) * 256].reshape(16, 16), norm="ortho")
        np.testing.assert_allclose(coeffs[b].reshape(16, 16).numpy(), expected, atol=1e-10)
    np.testing.assert_allclose(dct_decode(coeffs, plan).numpy(), x.numpy(), atol=1e-10)


@pytest.mark.parametrize("shape", [(128, 192), (100, 30), (97, 8), (300,), (16, 3, 5, 5), (), (7,), (4099,)])
def test_round_trip_and_energy(shape):
    x = torch.randn(shape, dtype=torch.float64)
    plan = ChunkPlan.for_shape(x.shape, 8)
    coeffs = dct_encode(x, plan)
    torch.testing.assert_close(dct_decode(coeffs, plan), x, atol=1e-12, rtol=0)
    assert math.isclose(coeffs.pow(2).sum().item(), x.pow(2).sum().item(), rel_tol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs_transform_in_fp32(dtype):
    x = torch.randn(64, 64).to(dtype)
    plan = ChunkPlan.for_shape(x.shape, 32)
    coeffs = dct_encode(x, plan)
    assert coeffs.dtype == torch.float32
    torch.testing.assert_close(dct_decode(coeffs, plan), x.float(), atol=1e-5, rtol=0)


def test_full_k_is_lossless():
    x = torch.randn(128, 64)
    spec = SparseSpec.build(x.shape, chunk=64, topk=64 * 64, value_dtype="fp32")
    payload, sent = spec.compress(x)
    torch.testing.assert_close(sent, x, atol=1e-5, rtol=0)
    torch.testing.assert_close(spec.decompress_mean(payload[None]), x, atol=1e-5, rtol=0)


def test_topk_keeps_the_largest_coefficients_of_each_block():
    x = torch.randn(64, 128, dtype=torch.float64)
    spec = SparseSpec.build(x.shape, chunk=64, topk=32, value_dtype="fp32")
    payload, sent = spec.compress(x)
    coeffs = dct_encode(x, spec.plan)
    sent_coeffs = dct_encode(sent, spec.plan)
    for b in range(spec.plan.num_blocks):
        order = np.argsort(-np.abs(coeffs[b].numpy()))
        expected = np.zeros(spec.plan.block_size)
        expected[order[:32]] = coeffs[b].numpy()[order[:32]]
        np.testing.assert_allclose(sent_coeffs[b].numpy(), expected, atol=1e-6)


def test_index_bits_and_payload_size():
    assert index_bits(64 * 64) == 12  # two indices in three bytes for 64x64 blocks
    assert index_bits(256) == 8 and index_bits(257) == 12 and index_bits(4097) == 16 and index_bits(70000) == 32
    spec = SparseSpec.build((64, 64), chunk=64, topk=32, value_dtype="fp32")
    assert spec.nbytes == 32 * 12 // 8 + 32 * 4
    assert SparseSpec.build((64, 64), chunk=64, topk=32, value_dtype="bf16").nbytes == 48 + 32 * 2
    assert SparseSpec.build((64, 64), chunk=64, topk=32, value_dtype="int8").nbytes == 48 + 32 + 8
    # SparseLoCo's wire: 64 of 4096 per chunk, 12-bit indices, 2-bit values + a 4-entry fp32 lookup
    assert SparseSpec.build((64, 64), chunk=64, topk=64, value_dtype="2bit").nbytes == 96 + 16 + 16
    # odd counts round up to whole bytes
    assert SparseSpec.build((4096 * 3,), chunk=64, topk=1, value_dtype="2bit").nbytes == 5 + 16 + 1


def test_every_position_sends_no_indices():
    """k the whole block: no index travels, only the quantised values of every element in order.
    One sign bit each and a scale (the mean |x|) without a transform: the payload is 4 + n/8
    bytes, every receiver decodes sign(x) * scale, and two ranks' mean is the mean of theirs."""
    torch.manual_seed(5)
    xs = [torch.randn(16, 24) for _ in range(2)]  # 8x8 blocks
    spec = SparseSpec.build(xs[0].shape, chunk=8, topk=64, value_dtype="sign", transform="none")
    assert spec.every_position and spec.index_bytes == 0
    assert spec.nbytes == 4 + 16 * 24 // 8
    payloads, expected = [], []
    for x in xs:
        payload, sent = spec.compress(x)
        scale = x.double().abs().mean().item()
        reference = np.where(x.numpy() < 0, -scale, scale)
        np.testing.assert_allclose(sent.numpy(), reference, rtol=1e-6)
        payloads.append(payload)
        expected.append(reference)
    got = spec.decompress_mean(torch.stack(payloads), "world")
    np.testing.assert_allclose(got.numpy(), (expected[0] + expected[1]) / 2, rtol=1e-6)
    # A 1-D tensor's smaller blocks keep every position too (topk_count scales k to the block).
    small = SparseSpec.build((37,), chunk=8, topk=64, value_dtype="2bit")
    assert small.every_position and small.nbytes == 16 + (37 + 3) // 4
    # One coefficient short of the block, the indices travel.
    assert not SparseSpec.build((16, 24), chunk=8, topk=63, value_dtype="sign").every_position


def test_topk_is_proportional_for_small_blocks():
    assert topk_count(ChunkPlan.for_shape((64, 64), 64), 32, 64) == 32
    assert topk_count(ChunkPlan.for_shape((128,), 64), 32, 64) == 1  # 1-D: density topk/chunk**2
    assert topk_count(ChunkPlan.for_shape((4096,), 64), 32, 64) == 32
    assert topk_count(ChunkPlan.for_shape((8, 8), 64), 4096, 64) == 64  # never more than the block


@settings(max_examples=50, deadline=None)
@given(st.sampled_from([1, 2, 4]), st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=64))
def test_uint_packing_round_trip(width, values):
    limit = 1 << (8 * width) if width < 4 else 1 << 31
    vals = torch.tensor([v % limit for v in values])
    packed = pack_uint(vals, width)
    assert packed.dtype == torch.uint8 and packed.numel() == len(values) * width
    assert torch.equal(unpack_uint(packed, width), vals)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from([8, 12, 16, 32]), st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=65))
def test_index_packing_round_trip(bits, values):
    vals = torch.tensor([v % (1 << min(bits, 31)) for v in values])
    packed = pack_indices(vals, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == (len(values) * bits + 7) // 8
    assert torch.equal(unpack_indices(packed, bits, len(values)), vals)
    # rows of several ranks unpack at once
    assert torch.equal(unpack_indices(torch.stack([packed, packed]), bits, len(values)), torch.stack([vals, vals]))


def test_12bit_layout_is_the_documented_one():
    # (a, b) = (0xABC, 0x123) -> bytes 0xBC, 0x3A, 0x12
    assert pack_indices(torch.tensor([0xABC, 0x123]), 12).tolist() == [0xBC, 0x3A, 0x12]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=33), st.sampled_from([1, 2]))
def test_code_packing_round_trip(codes, width):
    c = torch.tensor(codes) % (1 << width)
    packed = pack_codes(c, width)
    assert packed.numel() == (len(codes) * width + 7) // 8
    assert torch.equal(unpack_codes(packed, len(codes), width), c)


def test_1bit_layout_is_the_documented_one():
    assert pack_codes(torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 1]), 1).tolist() == [0b1001, 1]


def test_sign_values_against_their_definition():
    """One sign bit per value (the first in the lowest bit) after one fp32 scale, the mean |v|."""
    torch.manual_seed(4)
    x = torch.randn(2, 37)
    fmt = ValueFormat("sign")
    data, sent = fmt.pack(x)
    assert data.numel() == fmt.nbytes(x.numel()) == 4 + (x.numel() + 7) // 8
    scale = x.double().abs().mean().item()
    np.testing.assert_allclose(sent.numpy(), np.where(x.numpy() < 0, -scale, scale), rtol=1e-6)
    assert torch.equal(fmt.unpack(data, x.numel()), sent.reshape(-1))  # receivers decode the same bits


def test_2bit_quantiser_against_its_definition():
    """4 equal bins over mean +- 3 sigma; each value decodes to the mean of its bin's values."""
    torch.manual_seed(3)
    x = torch.cat([torch.randn(500) * 2 + 0.3, torch.tensor([40.0, -40.0])])  # outliers land in the end bins
    fmt = ValueFormat("2bit")
    data, sent = fmt.pack(x)
    assert data.numel() == fmt.nbytes(x.numel()) == 16 + (x.numel() + 3) // 4
    xs = x.double().numpy()
    mean, sigma = xs.mean(), xs.std()
    edges = mean + sigma * np.array([-1.5, 0.0, 1.5])  # inner edges of the 4 bins over [mean-3s, mean+3s]
    bins = np.searchsorted(edges, xs, side="right")
    expected = np.array([xs[bins == b].mean() for b in bins])
    np.testing.assert_allclose(sent.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(fmt.unpack(data, x.numel()), sent)  # receivers decode the same bits
    assert len(set(sent.tolist())) == 4


@pytest.mark.parametrize("value_dtype", ["fp32", "bf16", "fp16", "int8", "2bit", "sign"])
def test_wire_round_trip_is_exact_for_every_value_dtype(value_dtype):
    torch.manual_seed(0)
    x = torch.randn(96, 64)
    spec = SparseSpec.build(x.shape, chunk=32, topk=64, value_dtype=value_dtype)
    payload, sent = spec.compress(x)
    assert payload.dtype == torch.uint8 and payload.numel() == spec.nbytes
    decoded = spec.decompress_mean(payload[None])
    # The receiver reconstructs bit for bit what the sender says it sent (error feedback relies on it).
    assert torch.equal(decoded, sent)
    tol = {"fp32": 1e-6, "bf16": 2e-2, "fp16": 2e-3, "int8": 5e-2, "2bit": 0.5, "sign": 1.0}[value_dtype]
    best = dct_decode(_keep_topk(dct_encode(x, spec.plan), spec.k), spec.plan)
    assert (decoded - best).abs().max() < tol * x.abs().max()


def _keep_topk(coeffs, k):
    idx = coeffs.abs().topk(k, dim=-1).indices
    return torch.zeros_like(coeffs).scatter_(-1, idx, coeffs.gather(-1, idx))


@pytest.mark.parametrize("average", ["senders", "world"])
def test_mean_decode_matches_dense_reference_and_is_deterministic(average):
    torch.manual_seed(1)
    spec = SparseSpec.build((64, 128), chunk=32, topk=16, value_dtype="fp32")
    xs = [torch.randn(64, 128) for _ in range(4)]
    payloads = torch.stack([spec.compress(x)[0] for x in xs])
    got = spec.decompress_mean(payloads, average)
    # Reference: dense coefficient tensors and sender masks, summed in float64.
    total = torch.zeros(spec.plan.num_blocks, spec.plan.block_size, dtype=torch.float64)
    count = torch.zeros_like(total)
    for x in xs:
        sparse = _keep_topk(dct_encode(x, spec.plan), spec.k).double()
        total += sparse
        count += (sparse != 0).double()
    mean = total / 4 if average == "world" else total / count.clamp(min=1)
    expected = dct_decode(mean, spec.plan)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=0)
    assert torch.equal(spec.decompress_mean(payloads, average), got)
    assert count.max() > 1  # the case exercised collisions


def test_blocks_are_row_major():
    x = torch.arange(16.0).reshape(4, 4)
    blocks = to_blocks(x, ChunkPlan.for_shape((4, 4), 2))
    assert blocks[1].tolist() == [[2.0, 3.0], [6.0, 7.0]]


@pytest.mark.parametrize("value_dtype", ["fp32", "fp16", "int8", "2bit", "sign"])
def test_single_rank_decode_of_an_unaligned_slice(value_dtype):
    """A world of one: the row is a slice at an odd offset of the flat payload (no copy is made
    by slicing one row), and decoding must still work."""
    spec = SparseSpec.build((7,), chunk=4, topk=1, value_dtype=value_dtype)
    payload, sent = spec.compress(torch.randn(7))
    flat = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])  # offset 3 in the gathered buffer
    assert torch.equal(spec.decompress_mean(flat[None, 3:]), sent)


# A real model's parameter list (the reference GPT's shapes) plus shapes that take the other paths:
# a long vector (chunk x chunk pieces), an odd 12-bit count (a group of its own), a 3-D weight,
# a scalar-like vector, and a mixed-dtype pair.
def _model_list():
    from lowcomm_task.model import GPT, GPTConfig

    shapes = [tuple(p.shape) for p in GPT(GPTConfig()).parameters()]
    return shapes + [(65536,), (7, 9), (50, 3, 3), (3,), (1000,)]


@pytest.mark.parametrize("value_dtype", ["fp32", "bf16", "int8", "2bit", "sign"])
@pytest.mark.parametrize("chunk,topk,transform", [(64, 32, "dct"), (16, 2, "dct"), (8, 3, "none"), (8, 64, "none")])
def test_batched_codec_gives_the_bits_of_each_tensor_alone(value_dtype, chunk, topk, transform):
    """SparseBatch (one top-k, pack, scatter per block shape) == every tensor through its own
    SparseSpec: the same payload bytes, the same error-feedback tensors, the same means, whichever
    averaging and weights; with far fewer groups than tensors."""
    from ds_lowcomm.codec import SparseBatch

    shapes = _model_list()
    specs = [SparseSpec.build(s, chunk=chunk, topk=topk, value_dtype=value_dtype, transform=transform)
             for s in shapes]
    batch = SparseBatch(specs)
    gen = torch.Generator().manual_seed(0)
    xs = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    xs[0][-1] = xs[0][-1].double()  # a mixed-dtype list: the fp64 tensor keeps fp64 coefficients
    payloads = []
    for rank_xs in xs:
        payload, sent = batch.compress(rank_xs)
        alone = [spec.compress(x) for spec, x in zip(specs, rank_xs)]
        assert torch.equal(payload, torch.cat([p for p, _ in alone]))
        assert payload.numel() == batch.nbytes == sum(s.nbytes for s in specs)
        for (_, expected), got in zip(alone, sent):
            assert got.dtype == expected.dtype and torch.equal(got, expected)
        payloads.append(payload)
    rows = torch.stack(payloads)
    for average in ("senders", "world"):
        for weights in (None, [1.0, 2.0, 0.5]):
            means = batch.decompress_mean(rows, average, weights)
            for spec, lo, hi, got in zip(specs, batch.offsets[:-1], batch.offsets[1:], means):
                assert torch.equal(got, spec.decompress_mean(rows[:, lo:hi], average, weights))
    assert len(batch.groups) <= 12 < len(specs)


def test_compiled_codec_gives_the_same_bits():
    """``compile: true`` (torch.compile around each group, rounding ops kept eager) gives the
    eager codec's payload bytes, error-feedback tensors and means, bit for bit, for the value
    formats whose headers round (int8 min/step, sign's mean magnitude) and a plain float one,
    with every averaging; and the setting is checked like the others."""
    from ds_lowcomm.codec import CodecSettings, SparseBatch
    from ds_lowcomm.config import ConfigError

    shapes = [(96, 128), (128,), (5000,), (7, 9)]  # a matrix, vectors (one as 2-D pieces), an odd count
    gen = torch.Generator().manual_seed(0)
    xs = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    # ("sign", 8, 64): every position, no indices
    for value_dtype, chunk, topk in (("fp32", 64, 32), ("int8", 16, 2), ("sign", 16, 2), ("sign", 8, 64)):
        specs = [SparseSpec.build(s, chunk=chunk, topk=topk, value_dtype=value_dtype) for s in shapes]
        eager, compiled = SparseBatch(specs), SparseBatch(specs, compile=True)
        payloads = []
        for rank_xs in xs:
            (p_e, sent_e), (p_c, sent_c) = eager.compress(rank_xs), compiled.compress(rank_xs)
            assert torch.equal(p_e, p_c), value_dtype
            assert all(torch.equal(a, b) for a, b in zip(sent_e, sent_c)), value_dtype
            payloads.append(p_e)
        rows = torch.stack(payloads)
        for average, weights in (("senders", None), ("world", None), ("senders", [1.0, 2.0, 0.5])):
            got = compiled.decompress_mean(rows, average, weights)
            assert all(torch.equal(a, b) for a, b in zip(eager.decompress_mean(rows, average, weights), got))
    with pytest.raises((ConfigError, ValueError), match="compile"):
        CodecSettings(compile="yes").check("lowcomm")
