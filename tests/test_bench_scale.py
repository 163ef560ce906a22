"""``bench scale`` (issue 55): the recipe's settings derived from the dense run's, the summary's
medians and ratios per model size, the largest H within a ratio, and the collection of several
runs' rows into docs/bench/model-size/steps-to-target.csv. Its training path runs in the GPU check's dry run
(tests/test_gpu_check.py); that file itself is checked in tests/test_docs_figures.py."""

import json
from pathlib import Path

import pytest

from ds_lowcomm.optim.recipes import SIGN_OUTER, sign_recipe
from ds_lowcomm.settings import ConfigError
from lowcomm_bench import scale
from lowcomm_bench.codec import summary_path


def test_sign_recipe_takes_the_inner_settings_from_the_dense_run():
    muon = sign_recipe("muon", muon_lr=0.03, muon_momentum=0.9, sync_every=10)
    assert muon == {**SIGN_OUTER, "sync_every": 10, "inner_optimizer": "muon", "inner_muon_lr": 0.03,
                    "inner_muon_momentum": 0.9}
    assert sign_recipe("adamw") == SIGN_OUTER  # AdamW inside: the run's own lr, the method's default inner
    with pytest.raises(ConfigError, match="sign_recipe.muon_lr must be a number > 0"):
        sign_recipe("muon")
    with pytest.raises(ConfigError, match="inner_muon_lr are not outer settings"):
        sign_recipe("muon", muon_lr=0.03, inner_muon_lr=0.05)
    with pytest.raises(ConfigError, match="sign_recipe.dense must be one of muon, adamw"):
        sign_recipe("lion")


def test_derived_recipe_is_the_dense_runs_settings_and_the_outer_ones():
    got = scale.derived_recipe("muon", {"lr": 0.004, "peer.muon_lr": 0.02, "warmup": 40}, 20)
    assert got["lr"] == 0.004 and got["warmup"] == 40
    assert got["lowcomm.inner_muon_lr"] == 0.02 and got["lowcomm.sync_every"] == 20
    assert not any(k.startswith("peer.") for k in got)
    adamw = scale.derived_recipe("adamw", {"lr": 0.003}, 5)
    assert adamw["lr"] == 0.003 and "lowcomm.inner_optimizer" not in adamw


def _row(entry, form, parameters, seed, h, steps, sent):
    return {"entry": entry, "form": form, "parameters": parameters, "device": "cpu", "role": "seed", "seed": seed,
            "H": h, "steps_to_target": steps, "bytes_sent_per_worker": sent, "target_loss": 1.5,
            "settings": json.dumps({"lr": 0.008})}


def test_summary_medians_ratios_and_largest_h_per_size(tmp_path):
    rows = []
    for params, dense_steps, recipe in ((446_000, (100, 110, 120), {5: (110, 115, 130), 10: (150, 150, None)}),
                                        (4_800_000, (200, 200, 210), {5: (210, 210, 220), 10: (215, 220, 230)})):
        for seed, steps in zip((1, 2, 3), dense_steps):
            rows.append(_row("muon", "muon", params, seed, 1, steps, 1000.0))
            for h, per_seed in recipe.items():
                rows.append(_row("muloco_sign", "muon", params, seed, h, per_seed[seed - 1], 10.0 / h))
    summary = scale.summarize(rows)
    small = {r["H"]: r for r in summary if r["parameters"] == 446_000}
    assert small[1]["median_steps"] == 110 and small[5]["median_steps"] == 115
    assert small[5]["ratio_to_dense"] == pytest.approx(115 / 110, abs=1e-4)
    assert small[10]["median_steps"] is None and small[10]["ratio_to_dense"] is None  # a seed missed
    assert small[5]["bytes_ratio_to_dense"] == 500.0
    assert scale.largest_h_within(summary, "muon", 1.10, 446_000) == 5
    assert scale.largest_h_within(summary, "muon", 1.10, 4_800_000) == 10  # 220 / 200
    for name, part in (("a.csv", rows[:12]), ("b.csv", rows[12:])):
        scale.write_csv(tmp_path / name, part, scale.COLUMNS)
    collected = scale.collect(tmp_path / "scale.csv", [str(tmp_path / "a.csv"), str(tmp_path / "b.csv")])
    assert len(collected) == len(rows)
    again = scale.collect(tmp_path / "scale.csv", [str(tmp_path / "b.csv")])  # rows replaced, not doubled
    assert len(again) == len(rows)
    assert (tmp_path / "scale-summary.csv").exists() and summary_path(tmp_path / "scale.csv").exists()


LONG_H_CSV = str(Path(__file__).resolve().parents[1] / "docs" / "bench" / "long_h.csv")


@pytest.mark.parametrize("argv", [["--target", "0.9"],
                                  ["--target", "0.9", "--tuned-from", LONG_H_CSV, "--seeds", "0,1"],
                                  ["--target", "0.9", "--tuned-from", LONG_H_CSV, "--tune-dense"]])
def test_long_h_given_target_replaces_only_dense_muons_seed_0_run(argv, tmp_path):
    """``long_h --target``: dense Muon's target as measured before stands in for its seed-0 run, so
    only beside the settings it came from (--tuned-from) and without seed 0 among the measured."""
    from lowcomm_bench import long_h

    with pytest.raises(SystemExit, match="--target: only with --tuned-from, without --tune-dense, and --seeds "
                                         "leaving out 0"):
        long_h.main([*argv, "--out", str(tmp_path)])
