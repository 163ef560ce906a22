"""``bench scale`` (issue 55): the recipe's settings derived from the dense run's, the summary's
medians and ratios per model size, the largest H within a ratio, and the collection of several
runs' rows into docs/bench/model-size/steps-to-target.csv. Its training path runs in the GPU check's dry run
(tests/test_gpu_check.py); that file itself is checked in tests/test_docs_figures.py."""

import json
import re
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


def test_long_h_dense_from_refuses_a_second_tuning_and_a_csv_without_this_run(tmp_path):
    """``long_h --dense-from``: dense Muon's tuning as measured before stands in for running it again,
    so never beside --tune-dense, and only from rows of the same model size, replicas and budget."""
    from lowcomm_bench import long_h

    with pytest.raises(SystemExit, match="--dense-from: dense Muon's tuning measured before; --tune-dense"):
        long_h.main(["--dense-from", LONG_H_CSV, "--tuned-from", LONG_H_CSV, "--tune-dense", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no dense Muon tuning row of 4"):
        long_h.main(["--dense-from", LONG_H_CSV, "--n-layer", "6", "--n-embd", "256", "--budget", "2000",
                     "--out", str(tmp_path)])


def test_long_h_tuned_from_carries_the_settings_of_the_replica_count_tuned_at(tmp_path):
    """``long_h --tuned-from``: dense Muon's best and each candidate's measured settings come from the
    rows of the (size, replicas, budget) where the candidates were tuned, not from rows those settings
    were carried to before (here 8 replicas, listed first, with other settings and a lower loss); a CSV
    holding two tunings, or two measured settings of a candidate, is refused."""
    from lowcomm_bench import long_h

    model = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--seq-len", "16", "--batch", "2",
             "--budget", "30", "--warmup", "2", "--eval-every", "10"]
    parameters = scale.parameters_of({"n_layer": 1, "n_embd": 16, "n_head": 2, "seq_len": 16})
    base = {c: None for c in long_h.COLUMNS}
    base.update(parameters=parameters, replicas=2, budget=30, seed=0, H=1, steps_to_target=20, target_loss=50.0,
                bytes_sent_per_worker=1e6, bytes_received_per_worker=1e6, last_step=30, device="cpu")
    dense_at = {lr: {"lr": 0.008, "peer.muon_lr": lr} for lr in (0.02, 0.03, 0.05)}
    tuned = long_h.recipe_settings(dense_at[0.02], {"sync_every": 5})
    carried_elsewhere = long_h.recipe_settings(dense_at[0.05], {"sync_every": 10})

    def row(entry, role, settings, final, **kw):
        return {**base, "entry": entry, "role": role, "final_val_loss": final, "settings": json.dumps(settings),
                **kw}

    eight = {"replicas": 8, "budget": 15}
    rows = [row("muon", "tune", dense_at[0.05], 3.0, **eight), row("recipe", "seed", carried_elsewhere, 3.5, **eight),
            row("muon", "tune", dense_at[0.03], 4.5), row("muon", "tune", dense_at[0.02], 4.0),
            row("recipe", "tune", tuned, 4.2), row("recipe", "seed", tuned, 4.2, seed=1)]
    scale.write_csv(tmp_path / "before.csv", rows, long_h.COLUMNS)
    result = long_h.main([*model, "--tuned-from", str(tmp_path / "before.csv"), "--candidates", "recipe",
                          "--seeds", "0", "--out", str(tmp_path / "out")])
    got = {(r["entry"], r["role"]): json.loads(r["settings"]) for r in result["rows"]}
    assert got == {("muon", "tune"): dense_at[0.02], ("muon", "seed"): dense_at[0.02], ("recipe", "seed"): tuned}

    scale.write_csv(tmp_path / "two.csv", [*rows, row("recipe", "tune", carried_elsewhere, 3.5, **eight)],
                    long_h.COLUMNS)
    with pytest.raises(SystemExit, match=f"tuned there: {parameters} parameters, 2 replicas, budget 30, contiguous "
                                         f"data shards, on a machine not recorded; {parameters} parameters, 8 "
                                         "replicas, budget 15"):
        long_h.main([*model, "--tuned-from", str(tmp_path / "two.csv"), "--out", str(tmp_path / "x")])
    scale.write_csv(tmp_path / "both.csv", [*rows, row("recipe", "seed", carried_elsewhere, 4.0, seed=2)],
                    long_h.COLUMNS)
    with pytest.raises(SystemExit, match="2 measured settings of recipe at .* 2 replicas, budget 30"):
        long_h.main([*model, "--tuned-from", str(tmp_path / "both.csv"), "--candidates", "recipe",
                     "--out", str(tmp_path / "x")])


def test_long_h_dense_from_tunes_candidates_to_the_carried_target_without_running_dense_muon(tmp_path):
    """The carried rows are the output's dense Muon rows (tune, and seed 0), the candidate's tuning run
    stops at the carried target, and no dense Muon run happens (the cache holds the candidate's alone).
    Every row names this machine; a cached run or dense Muon's rows of another kind are refused."""
    from lowcomm_bench import long_h
    from lowcomm_bench.runs import machine_kind

    model = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--seq-len", "16", "--batch", "2",
             "--budget", "30", "--warmup", "2", "--eval-every", "10"]
    parameters = scale.parameters_of({"n_layer": 1, "n_embd": 16, "n_head": 2, "seq_len": 16})
    dense = {c: None for c in long_h.COLUMNS}
    dense.update(entry="muon", parameters=parameters, replicas=2, budget=30, seed=0, H=1, steps_to_target=20,
                 bytes_sent_per_worker=1e6, bytes_received_per_worker=1e6, role="tune", target_loss=50.0,
                 final_val_loss=4.0, last_step=30, device="cpu", machine=machine_kind("cpu"),
                 settings=json.dumps({"lr": 0.008, "peer.muon_lr": 0.02}))
    worse = {**dense, "final_val_loss": 5.0, "target_loss": 60.0,
             "settings": json.dumps({"lr": 0.008, "peer.muon_lr": 0.05})}
    scale.write_csv(tmp_path / "before.csv", [worse, dense], long_h.COLUMNS)
    out = tmp_path / "out"
    result = long_h.main([*model, "--dense-from", str(tmp_path / "before.csv"), "--candidates", "recipe",
                          "--grid", 'recipe={"sync_every": [5]}', "--seeds", "0", "--seed-candidates", "none",
                          "--out", str(out)])
    rows = result["rows"]
    assert [(r["entry"], r["role"]) for r in rows] == [("muon", "tune"), ("muon", "tune"), ("recipe", "tune"),
                                                       ("muon", "seed")]
    assert rows[3]["settings"] == dense["settings"] and rows[3]["steps_to_target"] == 20
    candidate = rows[2]
    assert candidate["target_loss"] == 50.0 and candidate["last_step"] == candidate["steps_to_target"] == 10
    assert json.loads(candidate["settings"])["lowcomm.inner_muon_lr"] == 0.02  # the better dense row's Muon lr
    assert [p.name.split("-")[0] for p in (out / "cache").glob("*.json")] == ["recipe"]
    assert {r["machine"] for r in rows} == {machine_kind("cpu")}

    # a run cached on another kind of machine is refused, not taken as this one's
    cached = next((out / "cache").glob("*.json"))
    cached.write_text(json.dumps({**json.loads(cached.read_text()), "machine": "riscv64 elsewhere"}))
    with pytest.raises(SystemExit, match="a run cached on riscv64 elsewhere, and this machine is"):
        long_h.main([*model, "--dense-from", str(tmp_path / "before.csv"), "--candidates", "recipe",
                     "--grid", 'recipe={"sync_every": [5]}', "--seeds", "0", "--seed-candidates", "none",
                     "--out", str(out)])
    # dense Muon's rows of another kind do not stand in for this one's
    scale.write_csv(tmp_path / "elsewhere.csv", [{**worse, "machine": "riscv64 elsewhere"},
                                                  {**dense, "machine": "riscv64 elsewhere"}], long_h.COLUMNS)
    with pytest.raises(SystemExit, match=f"no dense Muon tuning row of .* budget 30, contiguous data shards, on {re.escape(machine_kind('cpu'))}"):
        long_h.main([*model, "--dense-from", str(tmp_path / "elsewhere.csv"), "--out", str(tmp_path / "x")])


def test_long_h_summary_compares_each_machine_only_with_itself():
    """Two kinds of machine's rows of one size, replicas and budget stay apart: each candidate's
    ratio is against its own machine's dense Muon (none where that machine ran none)."""
    from lowcomm_bench import long_h

    def row(entry, machine, steps, seed):
        return {c: None for c in long_h.COLUMNS} | dict(
            entry=entry, machine=machine, steps_to_target=steps, seed=seed, role="seed", parameters=1000, replicas=2,
            budget=30, H=1 if entry == "muon" else 5, bytes_sent_per_worker=10.0, bytes_received_per_worker=10.0,
            settings=entry)
    rows = [row("muon", "a", 100, s) for s in (1, 2, 3)] + [row("recipe", "a", 110, s) for s in (1, 2, 3)]
    rows += [row("muon", "b", 200, s) for s in (1, 2, 3)] + [row("recipe", "b", 220, s) for s in (1, 2, 3)]
    rows += [row("growing", "c", 105, s) for s in (1, 2, 3)]
    ratio = {(r["entry"], r["machine"]): r["ratio_to_muon"] for r in long_h.summarize(rows)}
    assert ratio == {("muon", "a"): 1.0, ("recipe", "a"): 1.1, ("muon", "b"): 1.0, ("recipe", "b"): 1.1,
                     ("growing", "c"): None}
