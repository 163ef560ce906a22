"""The vision benchmark at tiny size: a CNN on scikit-learn's digits, every method, real workers."""

import math

import pytest

pytest.importorskip("sklearn")


def test_vision_benchmark_quick(tmp_path):
    from lowcomm_bench import vision

    rows = {r["method"]: r for r in vision.main(["--quick", "--out", str(tmp_path)])}
    assert set(rows) == set(vision.RECIPES)
    for method, r in rows.items():
        assert 0.0 <= r["held_out_accuracy"] <= 1.0 and math.isfinite(r["held_out_loss"]), method
        assert r["history"][-1]["val_loss"] < r["history"][0]["val_loss"] + 1e-6 or method != "adamw"
    assert rows["adamw"]["held_out_accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert rows["demo"]["mb_sent_per_worker"] < rows["adamw"]["mb_sent_per_worker"] / 5
    assert rows["dct_diloco"]["mb_sent_per_worker"] < rows["diloco"]["mb_sent_per_worker"]
    assert (tmp_path / "vision.png").exists() and (tmp_path / "vision.csv").exists()


def test_vision_ablation_quick(tmp_path):
    from lowcomm_bench import vision

    rows = vision.main(["--ablate", "--quick", "--jobs", "2", "--out", str(tmp_path)])
    assert [r["variant"] for r in rows] == list(vision.ABLATIONS)[:2]
    recipe, fp32 = rows
    # fp32 values: the same components at 4 bytes instead of 2 (indices unchanged)
    assert fp32["mb_sent_per_worker"] > recipe["mb_sent_per_worker"]
    assert (tmp_path / "vision_ablation.csv").read_text().startswith("variant,settings,")
