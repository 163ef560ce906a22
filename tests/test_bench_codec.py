"""The codec benchmark: a --quick run writes its files with sane numbers, and its per-parameter
reference implementation decodes exactly what ds_lowcomm's codec decodes."""

import csv
import math

import pytest
import torch

from lowcomm_bench import codec
from ds_lowcomm.codec import SparseSpec


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("codec")
    result = codec.main(["--quick", "--out", str(out)])
    return out, result


def _read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_quick_run_writes_its_files(quick_run):
    out, _ = quick_run
    for name in ("codec.csv", "codec_share.csv", "codec.json", "codec.png"):
        assert (out / name).stat().st_size > 0, name


def test_codec_csv_rows(quick_run):
    out, _ = quick_run
    rows = _read(out / "codec.csv")
    assert list(rows[0]) == codec.COLUMNS
    shapes = codec.QUICK["shapes"].split(",")
    chunks = codec.QUICK["chunks"].split(",")
    expected = {(impl, shape, chunk) for impl in codec.IMPLEMENTATIONS for chunk in chunks
                for shape in shapes + ["GPT(28 tensors)"]}
    assert {(r["implementation"], r["shape"], r["chunk"]) for r in rows} == expected
    assert len(rows) == len(expected)
    for r in rows:
        gbps = float(r["gbps"])
        assert math.isfinite(gbps) and gbps > 0
        assert r["agree"] == "True" and float(r["max_abs_diff"]) <= 1e-5, r
    # Packed indices and fp32 values against int64 + fp32: well under half the reference's bytes.
    for lc in (r for r in rows if r["implementation"] == "ds_lowcomm"):
        ref = next(r for r in rows if r["implementation"] == "reference" and r["shape"] == lc["shape"]
                   and r["chunk"] == lc["chunk"])
        assert lc["kept_values"] == ref["kept_values"]
        assert float(ref["wire_bytes_per_value"]) == 12
        assert int(lc["wire_bytes"]) < int(ref["wire_bytes"]) / 2


def test_codec_share_rows(quick_run):
    out, _ = quick_run
    rows = _read(out / "codec_share.csv")
    assert [r["method"] for r in rows] == list(codec.SHARE_METHODS)
    for r in rows:
        assert 0 < float(r["codec_share"]) < 1
        assert int(r["syncs"]) > 0


@pytest.mark.parametrize("shape, chunk, topk", [((64, 48), 16, 4), ((12, 5, 8), 8, 2), ((1000,), 16, 3), ((7,), 4, 8)])
def test_reference_decodes_what_ds_lowcomm_decodes(shape, chunk, topk):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    spec = SparseSpec.build(shape, chunk=chunk, topk=topk, value_dtype="fp32")
    payload, sent = spec.compress(x)
    idx, vals, ref_sent = codec.ref_compress(x, spec.plan, spec.k)
    assert idx.dtype == torch.int64 and vals.dtype == torch.float32
    torch.testing.assert_close(sent, ref_sent, rtol=0, atol=1e-6)
    # one rank: its decoded payload
    mean = spec.decompress_mean(payload.unsqueeze(0), "senders")
    torch.testing.assert_close(mean, codec.ref_decompress_mean([idx], [vals], spec.plan), rtol=0, atol=1e-6)
    # two ranks: the mean over the ranks that sent each coefficient
    y = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    idx_y, vals_y, _ = codec.ref_compress(y, spec.plan, spec.k)
    mean = spec.decompress_mean(torch.stack([payload, spec.compress(y)[0]]), "senders")
    ref_mean = codec.ref_decompress_mean([idx, idx_y], [vals, vals_y], spec.plan)
    torch.testing.assert_close(mean, ref_mean, rtol=0, atol=1e-6)
