"""Pipeline-activation codecs: payload sizes, shapes, the documented error bounds (checked
against plain per-row references), raw passage of non-float tensors, byte ratios, settings."""

import math

import pytest
import torch

from ds_lowcomm.codec import ACTIVATION_CODECS, ActivationSettings, lowrank_basis, make_activation_codec
from ds_lowcomm.settings import ConfigError

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SHAPES = ((4, 16, 64), (3, 7), (5,), (0, 8), ())
SETTINGS = ActivationSettings(topk_fraction=0.125, rank=4, seed=3)


def sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g))  # uneven magnitudes
    if x.dim() >= 2 and x.shape[0] > 1:
        x[1] = 0.0  # an all-zero row
    return x.to(dtype)


def rows64(x):
    return x.double().reshape(-1, x.shape[-1] if x.dim() else 1)


def rounding(dtype, magnitude):
    """Half an ulp of the output dtype at ``magnitude``, plus fp32 slack."""
    return torch.finfo(dtype).eps * magnitude + 1e-6 * magnitude


@pytest.mark.parametrize("name", ACTIVATION_CODECS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_roundtrip_within_bound(name, dtype, shape):
    codec = make_activation_codec(name, SETTINGS)
    x = sample(shape, dtype)
    data = codec.encode(x)
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert data.numel() == codec.nbytes(x.shape, x.dtype)
    y = codec.decode(data, x.shape, x.dtype)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device
    if x.numel() == 0:
        assert data.numel() == 0
        return
    xr, yr = rows64(x), rows64(y)
    err = (xr - yr).abs()
    absmax = xr.abs().amax(dim=1, keepdim=True)
    if name == "none":
        assert torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
    elif name in ("int8", "int4"):
        qmax = 127 if name == "int8" else 7
        assert (err <= absmax / (2 * qmax) * (1 + 1e-5) + rounding(dtype, absmax)).all()
    elif name == "topk":
        cols = xr.shape[1]
        k = max(1, math.ceil(0.125 * cols))
        kth = xr.abs().sort(dim=1, descending=True).values[:, k - 1 : k]
        kept = yr != 0
        assert (kept.sum(dim=1) <= k).all()
        assert torch.equal(yr[kept], xr[kept])  # kept entries are exact
        assert (xr.abs()[~kept] <= kth.expand_as(xr)[~kept]).all()
    else:  # lowrank: the projection onto span(Q), computed in float64
        q = lowrank_basis(xr.shape[1], SETTINGS.rank, SETTINGS.seed, dtype=torch.float64)
        expected = xr @ q @ q.T
        tol = 8 * torch.finfo(dtype).eps * (xr.norm(dim=1, keepdim=True) + 1e-30)
        assert ((yr - expected).abs() <= tol).all()


@pytest.mark.parametrize("name", ACTIVATION_CODECS)
def test_integer_and_bool_tensors_travel_raw(name):
    codec = make_activation_codec(name, SETTINGS)
    g = torch.Generator().manual_seed(1)
    for x in (torch.randint(-(2**40), 2**40, (3, 5, 9), generator=g), torch.rand(4, 11, generator=g) > 0.5,
              torch.arange(7, dtype=torch.int32)):
        data = codec.encode(x)
        assert data.numel() == codec.nbytes(x.shape, x.dtype) == x.numel() * x.element_size()
        y = codec.decode(data, x.shape, x.dtype)
        assert y.dtype == x.dtype and torch.equal(y, x)


def test_none_is_bit_identical_including_nan_and_negative_zero():
    x = torch.tensor([[1.5, -0.0, float("nan"), float("inf")], [1e-40, -3.0, 65504.0, 2.0**-24]])
    codec = make_activation_codec("none")
    for dtype in DTYPES + (torch.float64,):
        xd = x.to(dtype)
        y = codec.decode(codec.encode(xd), xd.shape, dtype)
        assert torch.equal(y.view(torch.uint8), xd.view(torch.uint8))


def test_decode_from_an_unaligned_slice_and_fresh_memory():
    codec = make_activation_codec("topk", SETTINGS)
    x = sample((6, 300), torch.float32)  # 300 columns: int16 indices
    data = codec.encode(x)
    buffer = torch.cat([torch.zeros(3, dtype=torch.uint8), data])
    y = codec.decode(buffer[3:], x.shape, x.dtype)
    assert torch.equal(y, codec.decode(data, x.shape, x.dtype))
    raw = make_activation_codec("none")
    payload = raw.encode(x).clone()  # encode itself may view x's memory (no copy on the send side)
    z = raw.decode(payload, x.shape, x.dtype)
    payload.zero_()
    assert torch.equal(z, x)  # the decoded tensor does not alias the receive buffer
    with pytest.raises(ValueError, match="must be"):
        codec.decode(data[:-1], x.shape, x.dtype)


def test_lowrank_exact_in_span_and_basis_orthonormal():
    settings = ActivationSettings(rank=16, seed=7)
    codec = make_activation_codec("lowrank", settings)
    q = lowrank_basis(96, 16, 7)
    assert q.shape == (96, 16) and torch.allclose(q.T @ q, torch.eye(16), atol=1e-6)
    assert torch.equal(q, lowrank_basis(96, 16, 7))
    assert not torch.equal(q, lowrank_basis(96, 16, 8))
    z = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(0))
    x = z @ q.T
    y = codec.decode(codec.encode(x), x.shape, x.dtype)
    assert torch.allclose(y, x, atol=1e-5, rtol=0)
    # rank above the row length: a full orthonormal basis, so every input comes back
    small = torch.randn(4, 8)
    full = make_activation_codec("lowrank", ActivationSettings(rank=32))
    assert full.nbytes(small.shape, small.dtype) == small.numel() * 4
    assert torch.allclose(full.decode(full.encode(small), small.shape, small.dtype), small, atol=1e-5)


def test_byte_ratios_against_none():
    shape, dtype = (8, 128, 256), torch.float32
    raw = make_activation_codec("none").nbytes(shape, dtype)
    assert raw == 8 * 128 * 256 * 4
    settings = ActivationSettings(topk_fraction=0.125, rank=32)
    ratio = {name: raw / make_activation_codec(name, settings).nbytes(shape, dtype) for name in ACTIVATION_CODECS}
    assert ratio["none"] == 1
    assert ratio["int8"] == pytest.approx(256 * 4 / (256 + 4))  # ~3.94
    assert ratio["int4"] == pytest.approx(256 * 4 / (128 + 4))  # ~7.76
    assert ratio["topk"] == pytest.approx(256 * 4 / (32 * (1 + 4)))  # 6.4: uint8 indices, fp32 values
    assert ratio["lowrank"] == pytest.approx(8.0)
    # bf16 values halve topk's value bytes; int16 indices past 256 columns
    topk = make_activation_codec("topk", settings)
    assert topk.nbytes((2, 256), torch.bfloat16) == 2 * 32 * (1 + 2)
    assert topk.nbytes((2, 512), torch.float32) == 2 * 64 * (2 + 4)
    assert topk.nbytes((1, 40000), torch.float32) == 5000 * (4 + 4)


def test_settings_from_section_and_errors():
    assert ActivationSettings.from_section(None) == ActivationSettings()
    s = ActivationSettings.from_section({"forward": "int8", "backward": "topk", "topk_fraction": 0.25})
    assert (s.forward, s.backward, s.topk_fraction, s.rank) == ("int8", "topk", 0.25, 32)
    with pytest.raises(ConfigError, match=r"lowcomm\.activations\.forward must be one of none, int8, int4, "
                                          r"topk, lowrank; got 'x'"):
        ActivationSettings.from_section({"forward": "x"})
    with pytest.raises(ConfigError, match=r"lowcomm\.activations\.backward"):
        ActivationSettings.from_section({"backward": "fp8"})
    with pytest.raises(ConfigError, match=r"unknown setting\(s\) fwd; allowed: forward, backward, topk_fraction, "
                                          r"rank, seed"):
        ActivationSettings.from_section({"fwd": "int8"})
    for key, bad in (("topk_fraction", 0.0), ("topk_fraction", 1.5), ("topk_fraction", "0.1"), ("rank", 0),
                     ("rank", 2.0), ("seed", -1)):
        with pytest.raises(ConfigError, match=rf"lowcomm\.activations\.{key} must be"):
            ActivationSettings.from_section({key: bad})
    with pytest.raises(ConfigError, match=r"lowcomm\.activations must be a mapping"):
        ActivationSettings.from_section(["forward"])
    with pytest.raises(ValueError, match="activation codec must be one of"):
        make_activation_codec("fp8")
    with pytest.raises(ConfigError, match=r"lowcomm\.activations\.rank"):
        make_activation_codec("lowrank", ActivationSettings(rank=0))
