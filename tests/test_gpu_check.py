"""The GPU check (``bash launch/gpu_check.sh``), run dry on the CPU at tiny sizes as the GPU run
would be, so the script cannot rot before a GPU is lent: every part ends well, every method and
DeepSpeed case trains with replicas equal after a sync, and the planner's GPU default comes from
the newest committed GPU run."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ds_lowcomm import plan
from lowcomm_bench import gpu_check

ROOT = Path(__file__).resolve().parents[1]


def _rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    proc = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    files = {p.name.split("-", 4)[-1].rsplit(".", 1)[0]: p for p in out.iterdir()}
    return proc.stdout, files


def test_every_part_ends_well(dry_run):
    stdout, files = dry_run
    summary = json.loads(files["summary"].read_text())
    assert summary["dry_run"] and summary["device"] == "cpu"
    assert {part: s["status"] for part, s in summary["parts"].items()} == {part: "ok" for part in gpu_check.PARTS}
    assert "== gpu_check on cpu" in stdout


def test_methods_train_and_replicas_agree(dry_run):
    _, files = dry_run
    rows = {r["entry"]: r for r in _rows(files["methods"])}
    assert set(rows) == set(gpu_check.METHOD_ENTRIES)
    for entry, r in rows.items():
        assert r["ok"] == "True", (entry, r.get("error"))
        assert float(r["final_val_loss"]) < 5.4  # below the untrained loss (ln 256 = 5.55)
        assert r["replicas_identical"] == ("" if entry == "diloco_streaming" else "True"), entry
        assert float(r["bytes_sent_per_step"]) > 0
    # the codec's seconds reach the ledger for the methods that code, and only for them
    assert float(rows["demo"]["codec_s_per_step"]) > 0 and float(rows["adamw"]["codec_s_per_step"]) == 0
    # compression: demo sends far less than the dense all-reduce
    assert float(rows["demo"]["bytes_sent_per_step"]) * 20 < float(rows["adamw"]["bytes_sent_per_step"])
    ds = {r["case"]: r for r in _rows(files["deepspeed"])}
    assert len(ds) == len(gpu_check.DS_CASES)
    for case, r in ds.items():
        assert r["ok"] == "True" and r["replicas_identical"] == "True", (case, r.get("error"))
        assert float(r["last_loss"]) < float(r["first_loss"]), case


def test_codec_newton_schulz_and_tests_parts(dry_run):
    _, files = dry_run
    codec = _rows(files["codec"])
    assert {r["case"] for r in codec} == set(gpu_check.CODEC_CASES)
    assert all(float(r["gbps_bf16"]) > 0 and int(r["wire_bytes"]) > 0 for r in codec)
    assert {r["implementation"] for r in _rows(files["newton_schulz"])} == {
        "ds_lowcomm.orthogonalize fp32", "torch.optim.Muon.step (bf16 NS)"}
    collected = _rows(files["tests"])
    assert len(collected) >= 30 and all(r["outcome"] == "collected" for r in collected)


def test_planner_gpu_default_is_the_newest_run(tmp_path):
    for date, gbps in (("2026-11-01", "1.5"), ("2026-12-01", "2.5")):
        with open(tmp_path / f"{date}-h100-methods.csv", "w") as f:
            f.write("entry,ok,device,codec_gbps\nadamw,True,NVIDIA H100,\n"
                    f"demo,True,NVIDIA H100,{gbps}\n")
    (tmp_path / "2026-12-24-cpu-methods.csv").write_text("entry,ok,codec_gbps\ndemo,True,99\n")  # a dry run: not a GPU
    gbps, source = plan.gpu_codec_default(tmp_path)
    assert gbps == 2.5 and "2026-12-01" in source and "NVIDIA H100" in source
    empty = tmp_path / "none"
    empty.mkdir()
    assert plan.gpu_codec_default(empty) == plan.GPU_CODEC_FALLBACK
