"""The GPU check (``bash launch/gpu_check.sh``), run dry on the CPU at tiny sizes as the GPU run
would be, so the script cannot rot before a GPU is lent: every part ends well, every method and
DeepSpeed case trains with replicas equal after a sync, and the planner's GPU default is what a GPU
run records (ds_lowcomm/measured.json), never a dry run's."""

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
    """One dry run of every part, as a user runs it: no --out (nor $OUT), so into a new temporary
    folder that it names (under the test's own TMPDIR here)."""
    import re

    from lowcomm_bench.committed import BENCH

    tmp = tmp_path_factory.mktemp("gpu_check_tmp")
    measured = plan.MEASURED_PATH.read_bytes()
    committed = sorted(p.name for p in (BENCH / "gpu").iterdir())
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh"), "--dry-run", "--parts", ",".join(gpu_check.PARTS)],
                          env={**env, "PYTHON": sys.executable, "TMPDIR": str(tmp)}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert plan.MEASURED_PATH.read_bytes() == measured  # a dry run records nothing for the planner
    out = Path(re.search(r"files in (\S+)", proc.stdout)[1])
    files = {p.name.split("-", 4)[-1].rsplit(".", 1)[0]: p for p in out.iterdir()}
    return proc.stdout, files, out, tmp, committed


def test_a_dry_run_writes_outside_the_checkout(dry_run):
    """Without --out (and $OUT) a dry run writes into a new temporary folder, which it names, never
    into docs/bench/gpu beside the GPU figures; a GPU run's default is docs/bench/gpu."""
    import shutil
    import tempfile

    from lowcomm_bench.committed import BENCH

    _, files, out, tmp, committed = dry_run
    assert out.parent == tmp and {"codec", "summary"} <= set(files)
    assert sorted(p.name for p in (BENCH / "gpu").iterdir()) == committed
    assert Path(gpu_check.default_out(dry_run=False)) == BENCH / "gpu"
    fresh = Path(gpu_check.default_out(dry_run=True))
    assert fresh.is_dir() and Path(tempfile.gettempdir()) in fresh.parents
    shutil.rmtree(fresh)


def test_every_part_ends_well(dry_run):
    stdout, files = dry_run[:2]
    summary = json.loads(files["summary"].read_text())
    assert summary["dry_run"] and summary["device"] == "cpu"
    assert {part: s["status"] for part, s in summary["parts"].items()} == {part: "ok" for part in gpu_check.PARTS}
    assert "== gpu_check on cpu" in stdout


def test_methods_train_and_replicas_agree(dry_run):
    _, files = dry_run[:2]
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


def test_a_longer_methods_part_for_a_few_entries():
    """``--entries`` picks the methods part's entries (names checked before anything runs), and the
    part's time limit grows with the work asked of it, never below the default."""
    import argparse

    def args(steps, entries):
        return argparse.Namespace(steps=steps, entries=",".join(entries))

    every = gpu_check.METHOD_ENTRIES
    assert gpu_check.part_scale(args(24, every), "methods") == 1.0
    assert gpu_check.part_scale(args(24, every[:3]), "methods") == 1.0  # never below the default
    assert gpu_check.part_scale(args(240, every[:3]), "methods") == pytest.approx(10 * 3 / len(every))
    assert gpu_check.part_scale(args(240, every), "codec") == 1.0
    with pytest.raises(SystemExit, match="--entries must name"):
        gpu_check.main(["--dry-run", "--entries", "muon,nonesuch"])


def test_codec_newton_schulz_and_tests_parts(dry_run):
    _, files = dry_run[:2]
    codec = _rows(files["codec"])
    assert {r["case"] for r in codec} == set(gpu_check.CODEC_CASES)
    assert all(float(r["gbps_bf16"]) > 0 and int(r["wire_bytes"]) > 0 for r in codec)
    assert {r["implementation"] for r in _rows(files["newton_schulz"])} == {
        "ds_lowcomm.orthogonalize fp32", "torch.optim.Muon.step (bf16 NS)"}
    collected = _rows(files["tests"])
    assert len(collected) >= 30 and all(r["outcome"] == "collected" for r in collected)


def test_planner_gpu_default_is_the_newest_run(tmp_path):
    """gpu_check's methods CSV recorded as the planner's GPU codec default (lowcomm_bench.measured):
    demo's row, never a dry run's file, never over a newer figure; plan reads what was recorded."""
    from lowcomm_bench.measured import gpu_codec_from_methods_csv, record

    for date, gbps in (("2026-11-01", "1.5"), ("2026-12-01", "2.5")):
        with open(tmp_path / f"{date}-h100-methods.csv", "w") as f:
            f.write("entry,ok,device,parameters,codec_gbps\nadamw,True,NVIDIA H100,125000000,\n"
                    f"demo,True,NVIDIA H100,125000000,{gbps}\n")
    (tmp_path / "2026-12-24-cpu-methods.csv").write_text("entry,ok,codec_gbps\ndemo,True,99\n")  # a dry run: not a GPU
    assert gpu_codec_from_methods_csv(tmp_path / "2026-12-24-cpu-methods.csv") is None
    measured = tmp_path / "measured.json"
    measured.write_bytes(plan.MEASURED_PATH.read_bytes())
    assert record("codec_gbps", "gpu", gpu_codec_from_methods_csv(tmp_path / "2026-12-01-h100-methods.csv"), measured)
    assert not record("codec_gbps", "gpu", gpu_codec_from_methods_csv(tmp_path / "2026-11-01-h100-methods.csv"), measured)
    gpu = plan.load_measured(measured)["codec_gbps"]["gpu"]
    assert gpu["value"] == 2.5 and gpu["date"] == "2026-12-01"
    assert gpu["source"] == ("NVIDIA H100, demo's recipe in training at 125M parameters, 2026-12-01 "
                             "(docs/bench/gpu/2026-12-01-h100-methods.csv)")
    # the planner's defaults are the package's file, as committed
    committed = plan.load_measured()
    assert plan.CODEC_GBPS == {d: (e["value"], e["source"]) for d, e in committed["codec_gbps"].items()}
    assert plan.STEPS_RATIO["demo"] == committed["steps_ratio"]["demo"]["steps"] / committed["steps_ratio"]["demo"]["adamw_steps"]


def test_scale_part_runs_the_recipe_at_the_dense_settings(dry_run):
    """The scale part (issue 55: run first when a GPU is lent, ``--parts scale``): dense Muon at its
    settings on seed 0 sets the target (its loss at 2/3 of the budget, so it reaches it there), and
    the one-bit recipe runs at each H with its inner optimizer at exactly those settings."""
    rows = _rows(dry_run[1]["scale"])
    dense = [r for r in rows if r["entry"] == "muon"]
    recipe = {int(r["H"]): r for r in rows if r["entry"] == "muloco_sign"}
    assert set(recipe) == {2, 4} and {r["role"] for r in dense} == {"tune", "seed"}
    assert all(int(r["steps_to_target"]) == 8 for r in dense)  # 2/3 of the dry run's 12 steps
    assert json.loads(dense[0]["settings"]) == {"lr": 0.008, "peer.muon_lr": 0.03}
    for h, r in recipe.items():
        settings = json.loads(r["settings"])
        assert settings["lr"] == 0.008 and settings["lowcomm.inner_muon_lr"] == 0.03
        assert settings["lowcomm.sync_every"] == h and settings["lowcomm.value_dtype"] == "sign"
        assert float(r["bytes_sent_per_worker"]) * 10 < float(dense[0]["bytes_sent_per_worker"])
    # the long-H recipe (recipes.RECOMMENDED's), its growth of H scaled from 3000 steps to the 12 here
    long, = [r for r in rows if r["entry"] == "muloco_sign_long"]
    settings = json.loads(long["settings"])
    assert settings["lowcomm.sync_every"] == 5 and settings["lowcomm.inner_muon_lr"] == 0.03
    assert settings["lowcomm.sync_every_schedule"] == [[1, 10], [2, 20], [3, 30]] and int(long["H"]) == 30
