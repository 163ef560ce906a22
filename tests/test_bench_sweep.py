"""The tuning and seeds protocol of issue 27 ("a fair fight"): ``bench sweep`` over every
time_to_loss entry (methods, variants and peers, with ``peer.<key>`` grid keys), one row per
(configuration, seed), the count of configurations per entry, each entry's best configuration,
and ``time_to_loss --from-sweep`` running each entry at it."""

import csv
import dataclasses
import json

import pytest

from lowcomm_bench import sweep, time_to_loss
from lowcomm_bench.peers import PEER_KINDS
from lowcomm_bench.time_to_loss import PEERS, entry_spec

MODEL = {"n_layer": 1, "n_embd": 32, "seq_len": 32}
TINY = ["--n-layer", "1", "--n-embd", "32", "--seq-len", "32"]


def _no_workers(*args, **kwargs):
    raise AssertionError("a worker started")


@pytest.mark.parametrize("argv, message", [
    (["--entry", "nope", "--grid", '{"lr": [0.001]}'], r"--entry: unknown 'nope'; allowed: adamw, .*powersgd_r8"),
    (["--entry", "demo", "--grid", '{"peer.rank": [4]}'], r"key 'peer.rank' is not a setting of demo; "
                                                           r"allowed: lr, betas, weight_decay, warmup, clip_grad, lr_decay, lowcomm.<key>"),
    (["--entry", "powersgd_r8", "--grid", '{"lowcomm.topk": [2]}'],
     r"key 'lowcomm.topk' is not a setting of powersgd_r8; allowed: lr, .*peer.rank, peer.start_iter$"),
    (["--entry", "torchft_streaming_diloco", "--grid", '{"peer.alpha": [0.5]}'],
     r"key 'peer.alpha' .* allowed: .*peer.sync_every, peer.fragments, peer.sync_delay, peer.fragment_update_alpha"),
    (["--entry", "adamw", "--grid", '{"batch": [8]}'], r"key 'batch' is not a setting of adamw"),
    (["--entry", "demo", "--grid", '{"lowcomm.bogus": [1]}'], r"unknown setting\(s\) bogus; allowed: .*topk"),
    (["--entry", "demo", "--grid", '{"lr": [-1.0]}'], r"--grid \{\"lr\": -1.0\}: .*lr"),
    (["--entry", "demo", "--grid", '{"lr": []}'], r"--grid: a JSON object"),
    (["--entry", "demo", "--grid", '{"lr": [0.001, 0.002]}', "--budget-configs", "3"],
     r"--grid has 2 configurations; --budget-configs asks for 3"),
    (["--entry", "demo", "--grid", '{"lr": [0.001]}', "--seeds", "0,0"], r"--seeds: a comma list"),
])
def test_bad_grids_entries_and_seeds_are_refused_before_any_worker_starts(monkeypatch, tmp_path, argv, message):
    monkeypatch.setattr(sweep, "run_local_workers", _no_workers)
    with pytest.raises(SystemExit, match=message):
        sweep.main([*argv, "--out", str(tmp_path), *TINY])


def test_every_peer_kind_and_peer_setting_is_sweepable():
    """The grid's peer keys cover every peer kind and every setting time_to_loss's peers set."""
    assert set(sweep.PEER_SETTINGS) == set(PEER_KINDS)
    for name, peer in PEERS.items():
        assert set(peer) - {"kind"} <= set(sweep.PEER_SETTINGS[peer["kind"]]), name


def test_settings_go_to_the_spec_its_lowcomm_section_and_a_copy_of_the_peer():
    spec, peer = entry_spec("torchft_streaming_diloco", 30, 5, MODEL)
    tuned, tuned_peer = sweep.with_settings(spec, peer, {"lr": 0.002, "peer.fragment_update_alpha": 0.5,
                                                         "peer.sync_delay": 2})
    assert tuned.lr == 0.002 and spec.lr == 0.001
    assert tuned_peer == {**PEERS["torchft_streaming_diloco"], "fragment_update_alpha": 0.5, "sync_delay": 2}
    assert "fragment_update_alpha" not in PEERS["torchft_streaming_diloco"]  # the entry's own settings untouched
    demo, none = sweep.with_settings(*entry_spec("demo", 30, 5, MODEL), {"lowcomm.decay": 0.99})
    assert none is None and demo.lowcomm["decay"] == 0.99 and demo.lowcomm["method"] == "demo"
    # no settings: the very spec and peer time_to_loss builds (its runs' cache keys unchanged)
    assert sweep.with_settings(spec, peer, {}) == (spec, peer)


def test_one_row_per_configuration_and_seed_appended_to_a_file_without_the_seed_column(monkeypatch, tmp_path):
    """Every configuration at every seed of --seeds, in its own workers, with the fair protocol's
    evaluation every 5 steps by default; an older sweep.csv (no seed column) gets the column, its
    rows' seed empty and read as 0."""
    seen = []

    def fake_workers(fn, world, spec, peer):
        seen.append((spec, peer))
        loss = 2.0 + spec.seed / 10 + spec.lr
        return [{"history": [{"step": 5, "val_loss": 3.0}, {"step": 10, "val_loss": loss}],
                 "final_val_loss": loss, "bytes_sent": 100.0 * (rank + 1)} for rank in range(world)]

    monkeypatch.setattr(sweep, "run_local_workers", fake_workers)
    old = ["demo", "2", "900", '{"lr": 0.002}', "240", "2.105", "2.1075", "3400209.0"]
    with open(tmp_path / "sweep.csv", "w", newline="") as f:
        csv.writer(f).writerows([sweep.COLUMNS[:-1], old])
    rows = sweep.main(["--entry", "powersgd_r8", "--grid", '{"lr": [0.001, 0.002], "peer.start_iter": [30]}',
                       "--seeds", "0,1,2", "--target", "2.2", "--budget", "40", "--out", str(tmp_path), *TINY])
    assert [(json.loads(r["settings"])["lr"], r["seed"]) for r in rows] == [
        (0.001, 0), (0.001, 1), (0.001, 2), (0.002, 0), (0.002, 1), (0.002, 2)]
    assert [spec.seed for spec, _ in seen] == [0, 1, 2, 0, 1, 2]
    assert all(spec.eval_every == 5 and spec.steps == 40 for spec, _ in seen)
    assert all(peer == {"kind": "ddp_powersgd", "rank": 8, "start_iter": 30} for _, peer in seen)
    assert [r["steps_to_target"] for r in rows] == [10, 10, None, 10, 10, None]  # 2.2 + the seed's 0.2: above
    assert rows[0]["bytes_sent_per_worker"] == 150.0
    with open(tmp_path / "sweep.csv", newline="") as f:
        raw = list(csv.reader(f))
    assert raw[0] == sweep.COLUMNS and raw[0][-1] == "seed"
    assert raw[1] == [*old, ""] and len(raw) == 1 + 1 + 6
    read = sweep.read_rows(tmp_path / "sweep.csv")
    assert [r["seed"] for r in read] == [0, 0, 1, 2, 0, 1, 2]
    assert read[0]["settings"] == {"lr": 0.002} and read[0]["steps_to_target"] == 240


def _synthetic(path, rows, seed_column=True):
    columns = sweep.COLUMNS if seed_column else sweep.COLUMNS[:-1]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        for entry, settings, steps, final, *rest in rows:
            budget, target, seed = (rest + [900, 2.114, 0][len(rest):])[:3]
            row = {"method": entry, "workers": 2, "budget": budget, "settings": json.dumps(settings),
                   "steps_to_target": "" if steps is None else steps, "final_val_loss": final,
                   "target_loss": target, "bytes_sent_per_worker": 1.0, "seed": seed}
            w.writerow({k: row[k] for k in columns})
    return path


def test_configs_per_entry_counts_configurations_not_seeds(tmp_path):
    path = _synthetic(tmp_path / "sweep.csv", [
        ("adamw", {"lr": 0.001}, 225, 2.11, 900, 2.114, 0), ("adamw", {"lr": 0.001}, 240, 2.12, 900, 2.114, 1),
        ("adamw", {"lr": 0.002}, 180, 2.10, 900, 2.114, 0), ("adamw", {"lr": 0.002}, 190, 2.10, 900, 2.114, 1),
        ("demo", {"lr": 0.002}, 195, 2.09), ("demo", {"lr": 0.002, "lowcomm.decay": 0.99}, 195, 2.10),
        ("demo", {"lowcomm.decay": 0.99, "lr": 0.002}, 195, 2.10),  # the same configuration, keys in another order
        ("demo", {"lr": 0.002}, 225, 1.16, 1500),  # another budget: another configuration
        ("powersgd_r8", {"peer.rank": 4}, None, 2.3),
    ])
    assert sweep.configs_per_entry(path) == {"adamw": 2, "demo": 3, "powersgd_r8": 1}
    old = _synthetic(tmp_path / "old.csv", [("demo", {"lr": 0.002}, 240, 2.1), ("demo", {"lr": 0.003}, 405, 2.09)],
                     seed_column=False)
    assert sweep.configs_per_entry(old) == {"demo": 2}


def test_best_is_the_fewest_steps_on_the_tuning_seed_ties_by_final_loss(tmp_path):
    path = _synthetic(tmp_path / "sweep.csv", [
        ("adamw", {"lr": 0.001}, 225, 2.11), ("adamw", {"lr": 0.003}, 165, 2.09), ("adamw", {"lr": 0.002}, 180, 2.08),
        ("adamw", {"lr": 0.004}, 150, 2.05, 900, 2.114, 1),  # better, but on another seed than the tuning one
        ("demo", {"lowcomm.decay": 0.99}, 195, 2.1038), ("demo", {"lowcomm.decay": 0.995}, 195, 2.0932),
        ("demo", {"lowcomm.decay": 0.9}, 285, 2.05),
        ("demo", {"lr": 0.001}, 120, 1.4, 1500),  # another budget
        ("diloco", {"lowcomm.outer_lr": 1.0}, None, 2.11), ("diloco", {"lowcomm.sync_every": 10}, None, 2.37),
        ("sparseloco", {"lr": 0.001}, 100, 2.0, 900, 2.1075),  # an older, looser target: not comparable
        ("sparseloco", {"lr": 0.002}, 345, 2.06), ("sparseloco", {"lr": 0.003}, 360, 2.07),
        ("torchft_diloco", {"peer.fragment_update_alpha": 0.5, "lr": 0.002}, 300, 2.1),
    ])
    chosen = {e: r["settings"] for e, r in sweep.best(path, budget=900).items()}
    assert chosen == {"adamw": {"lr": 0.003}, "demo": {"lowcomm.decay": 0.995}, "diloco": {"lowcomm.outer_lr": 1.0},
                      "sparseloco": {"lr": 0.002}, "torchft_diloco": {"peer.fragment_update_alpha": 0.5, "lr": 0.002}}
    assert sweep.best(path, budget=900)["adamw"]["steps_to_target"] == 165
    assert sweep.best(path, seed=1)["adamw"]["settings"] == {"lr": 0.004}
    assert sweep.best(path)["demo"]["settings"] == {"lr": 0.001}  # no budget given: that of demo's last row
    old = _synthetic(tmp_path / "old.csv", [("demo", {"lr": 0.002}, 240, 2.1), ("demo", {"lr": 0.003}, 405, 2.09)],
                     seed_column=False)
    assert sweep.best(old)["demo"]["settings"] == {"lr": 0.002}  # rows without a seed column: seed 0


def _unstopped(spec, peer):
    assert spec.stop_at_val_loss == 2.0  # the target: the (fake) adamw run's loss
    return dataclasses.replace(spec, stop_at_val_loss=None), peer


def test_time_to_loss_from_sweep_runs_each_entry_at_its_best_configuration(monkeypatch, tmp_path):
    """With --from-sweep each entry's spec and peer are its best row's settings over its recipe
    (adamw's target run too); an entry without rows runs its recipe; without the option, the
    recipes exactly as before."""
    calls = []

    def fake_run(cache, hosts, link, spec, repeat=0, peer=None):
        calls.append((spec.label, spec.steps, spec, peer))
        history = [{"step": 5, "val_loss": 2.0, "train_s": 1.0, "bytes_sent": 10.0}]
        return {"final_val_loss": 2.0, "history": history, "train_s": 1.0, "comm_s": 0.5, "codec_s": 0.0,
                "bytes_sent_per_worker": 10.0}

    monkeypatch.setattr(time_to_loss, "check_can_create", lambda: None)
    monkeypatch.setattr(time_to_loss, "run_cached", fake_run)
    monkeypatch.setattr(time_to_loss, "plot", lambda *a: None)
    path = _synthetic(tmp_path / "sweep.csv", [
        ("adamw", {"lr": 0.003}, 165, 2.09, 90), ("adamw", {"lr": 0.002}, 180, 2.08, 90),
        ("demo", {"lowcomm.decay": 0.99, "lr": 0.0025}, 20, 2.0, 90),
        ("powersgd_r8", {"peer.rank": 2, "peer.start_iter": 10, "lr": 0.002}, 30, 2.0, 90),
        ("powersgd_r8", {"peer.rank": 16}, 15, 2.0, 900),  # another budget than this run's
    ])
    argv = ["--hosts", "2", "--links", "unshaped", "--entries", "adamw,demo,powersgd_r8,diloco,adamw_overlap_bf16",
            "--steps", "30",
            "--budget-factor", "3", "--eval-every", "5", "--out", str(tmp_path / "out"), *TINY]
    time_to_loss.main([*argv, "--from-sweep", str(path)])
    target, *runs = calls
    assert target[:2] == ("adamw", 30) and target[2].lr == 0.003  # the tuned adamw's loss is the target
    by = {label: (spec, peer) for label, steps, spec, peer in runs}
    assert by["adamw"][0].lr == 0.003
    assert by["demo"][0].lr == 0.0025 and by["demo"][0].lowcomm["decay"] == 0.99
    assert by["powersgd_r8"][0].lr == 0.002 and by["powersgd_r8"][1] == {"kind": "ddp_powersgd", "rank": 2,
                                                                          "start_iter": 10}
    assert _unstopped(*by["diloco"]) == entry_spec("diloco", 90, 5, MODEL)  # no rows: its recipe
    # adamw's DDP form without rows of its own: adamw's settings (the same optimizer), its own peer
    assert by["adamw_overlap_bf16"][0].lr == 0.003 and by["adamw_overlap_bf16"][1]["compress"] == "bf16"
    calls.clear()
    time_to_loss.main([*argv, "--from-sweep", str(path), "--tune-by", "final_loss", "--tune-budget", "90"])
    assert calls[0][2].lr == 0.002  # the lowest final loss among adamw's rows at budget 90
    calls.clear()
    time_to_loss.main(argv)
    assert [_unstopped(spec, peer) for _, _, spec, peer in calls[1:]] == [
        entry_spec(e, 90, 5, MODEL) for e in ("adamw", "demo", "powersgd_r8", "diloco", "adamw_overlap_bf16")]
    assert calls[0][2] == entry_spec("adamw", 30, 5, MODEL)[0]


def test_sweep_of_a_peer_and_a_method_tiny(tmp_path):
    """Real 2-worker runs on a tiny model: DDP + PowerSGD at two ranks and demo at one lr, each on
    seeds 0 and 1. Each row has its settings and seed; the rank moves the bytes, the seed the loss."""
    common = ["--seeds", "0,1", "--budget", "6", "--eval-every", "2", "--target", "9.0", "--out", str(tmp_path), *TINY]
    peer_rows = sweep.main(["--entry", "powersgd_r8", "--grid", '{"peer.rank": [1, 2], "peer.start_iter": [2]}',
                            "--budget-configs", "2", *common])
    demo_rows = sweep.main(["--entry", "demo", "--grid", '{"lr": [0.002]}', *common])
    assert [(r["method"], json.loads(r["settings"]), r["seed"]) for r in peer_rows + demo_rows] == [
        ("powersgd_r8", {"peer.rank": 1, "peer.start_iter": 2}, 0), ("powersgd_r8", {"peer.rank": 1, "peer.start_iter": 2}, 1),
        ("powersgd_r8", {"peer.rank": 2, "peer.start_iter": 2}, 0), ("powersgd_r8", {"peer.rank": 2, "peer.start_iter": 2}, 1),
        ("demo", {"lr": 0.002}, 0), ("demo", {"lr": 0.002}, 1)]
    assert all(r["steps_to_target"] == 2 for r in peer_rows + demo_rows)  # the first evaluation is below 9.0
    r1, r2 = peer_rows[0], peer_rows[2]
    assert r1["bytes_sent_per_worker"] < r2["bytes_sent_per_worker"]  # rank 2 sends larger P and Q
    assert r1["bytes_sent_per_worker"] == peer_rows[1]["bytes_sent_per_worker"]  # same shapes on every seed
    assert r1["final_val_loss"] != peer_rows[1]["final_val_loss"]  # the seed: init and batches
    assert demo_rows[0]["final_val_loss"] != demo_rows[1]["final_val_loss"]
    read = sweep.read_rows(tmp_path / "sweep.csv")
    assert [(r["method"], r["seed"]) for r in read] == [(r["method"], r["seed"]) for r in peer_rows + demo_rows]
    assert sweep.configs_per_entry(tmp_path / "sweep.csv") == {"powersgd_r8": 2, "demo": 1}


def test_best_by_final_loss_ranks_every_entry_as_adamw_was_tuned(tmp_path):
    """The fair protocol's rule: the lowest final held-out loss at the tuning budget, whatever the
    steps to the target (adamw's target is its own tuned final loss)."""
    path = _synthetic(tmp_path / "sweep.csv", [
        ("adamw", {"lr": 0.002}, 175, 1.9401, 300), ("adamw", {"lr": 0.003}, 190, 1.9333, 300),
        ("adamw", {"lr": 0.004}, None, 2.05, 300), ("adamw", {"lr": 0.001}, 150, 1.5, 300, 2.114, 1),
        ("demo", {"lr": 0.002}, None, 2.09, 300), ("demo", {"lr": 0.003}, None, 2.01, 300),
        ("demo", {"lr": 0.001}, 100, 1.5, 900),  # another budget
    ])
    chosen = sweep.best(path, budget=300, rank_by="final_loss")
    assert {e: r["settings"] for e, r in chosen.items()} == {"adamw": {"lr": 0.003}, "demo": {"lr": 0.003}}
    assert sweep.best(path, budget=300)["adamw"]["settings"] == {"lr": 0.002}  # by steps: the fewest
    with pytest.raises(ValueError, match="rank_by must be one of steps, final_loss; got 'loss'"):
        sweep.best(path, rank_by="loss")


def _eval_rows(steps, seconds_at, loss_at, every=5):
    return [{"step": s, "val_loss": loss_at(s), "train_s": seconds_at(s), "bytes_sent": 10.0 * s}
            for s in range(every, steps + 1, every)]


def test_seconds_at_a_step_from_a_timing_run_and_the_step_at_the_target():
    """A timing run of 40 steps: 2 s a step for the first 10 (start-up), then 1 s. Inside it, its
    seconds interpolated; past it, its last seconds plus the second half's rate (1 s a step).
    The step at the target is interpolated between evaluations as the seconds are."""
    seconds = lambda s: 2.0 * s if s <= 10 else 20.0 + (s - 10)  # noqa: E731
    timing = {"history": _eval_rows(40, seconds, lambda s: 3.0)}
    assert time_to_loss.seconds_at_step(timing, 10) == 20.0
    assert time_to_loss.seconds_at_step(timing, 12.5) == pytest.approx(22.5)
    assert time_to_loss.seconds_at_step(timing, 2.5) == pytest.approx(5.0)
    assert time_to_loss.seconds_at_step(timing, 100) == pytest.approx(50.0 + 60)
    history = _eval_rows(30, seconds, lambda s: 3.0 - 0.1 * s)  # 2.0 at step 10; 1.5 at 15
    assert time_to_loss.step_at_target(history, 1.6) == pytest.approx(14.0)
    assert time_to_loss.step_at_target(history, 2.5) == pytest.approx(5.0)  # the first evaluation
    assert time_to_loss.step_at_target(history, -1.0) is None
    # a run's own seconds at its interpolated step are time_to_loss's
    from lowcomm_bench.runs import time_to_loss as seconds_to_loss
    assert time_to_loss.seconds_at_step({"history": history}, 14.0) == pytest.approx(seconds_to_loss(history, 1.6))


def _fake_runs(calls, slow_per_step):
    """run_cached's stand-in: a seed's loss falls 0.1 an evaluation from 3.0 - 0.01 x seed (so seeds
    reach the target at different steps); seconds per step 1 unshaped, ``slow_per_step[entry]``
    on the slow links. Every call recorded."""
    def fake(cache, hosts, link, spec, repeat=0, peer=None):
        calls.append((link, spec.label, spec.seed, spec.stop_at_step, spec.stop_at_val_loss, peer))
        per_step = 1.0 if link == "unshaped" else slow_per_step[spec.label]
        loss = lambda s: 3.0 - 0.01 * spec.seed - 0.02 * s  # noqa: E731
        last = spec.stop_at_step or spec.steps
        if spec.stop_at_val_loss is not None:
            last = min(last, next(s for s in range(5, spec.steps + 1, 5) if loss(s) <= spec.stop_at_val_loss))
        h = _eval_rows(last, lambda s: per_step * s, loss)
        return {"final_val_loss": h[-1]["val_loss"], "history": h, "train_s": h[-1]["train_s"],
                "comm_s": 0.25 * h[-1]["train_s"], "codec_s": 0.0, "bytes_sent_per_worker": h[-1]["bytes_sent"]}
    return fake


def test_time_to_loss_steps_from_seeds_seconds_from_timing_runs_checked_on_one_link(monkeypatch, tmp_path):
    """--seeds 1,2,3 --timing-steps 20 --check-links 10mbit: every seed trains to the target on the
    unshaped link (its steps) and on the check link; every link has one 20-step timing run per
    entry (40 for PowerSGD starting at step 20), its seconds at each seed's step from the unshaped
    runs; rows carry medians and ranges over the seeds, and on the check link the estimate beside.
    --steps-only runs the unshaped seeds alone."""
    calls = []
    monkeypatch.setattr(time_to_loss, "check_can_create", lambda: None)
    monkeypatch.setattr(time_to_loss, "run_cached", _fake_runs(calls, {"adamw": 4.0, "demo": 2.0, "powersgd_r8": 3.0}))
    monkeypatch.setattr(time_to_loss, "plot", lambda *a: None)
    monkeypatch.setitem(time_to_loss.PEERS, "powersgd_r8", {"kind": "ddp_powersgd", "rank": 8, "start_iter": 20})
    argv = ["--hosts", "2", "--links", "unshaped,10mbit,3mbit", "--entries", "adamw,demo,powersgd_r8",
            "--steps", "100", "--budget-factor", "2", "--eval-every", "5", "--out", str(tmp_path), *TINY]
    rows = time_to_loss.main([*argv, "--seeds", "1,2,3", "--timing-steps", "20", "--check-links", "10mbit"])
    target = 3.0 - 0.02 * 100  # adamw's target run: seed 0, 100 steps
    assert calls[0] == ("unshaped", "adamw", 0, None, None, None)
    timing = [c for c in calls if c[3] is not None]
    assert sorted((c[0], c[1], c[2], c[3]) for c in timing) == [
        (link, e, 1, 40 if e == "powersgd_r8" else 20) for link in ("10mbit", "3mbit", "unshaped")
        for e in ("adamw", "demo", "powersgd_r8")]
    full = {(c[0], c[1], c[2]) for c in calls[1:] if c[3] is None}
    assert all(c[4] == target for c in calls[1:] if c[3] is None)
    assert full == {(link, e, s) for link in ("unshaped", "10mbit") for e in ("adamw", "demo", "powersgd_r8")
                    for s in (1, 2, 3)}  # none on 3mbit
    by = {(r["link"], r["entry"]): r for r in rows}
    # seed s reaches 1.0 at (2.0 - 0.01 s) / 0.02 = 99.5, 99, 98.5 steps: evaluations 100, 100, 100
    for key, r in by.items():
        assert r["seeds"] == 3 and r["steps_to_target"] == 100 and r["steps_range"] == "100-100"
    assert by["unshaped", "demo"]["time_to_target_s"] == pytest.approx(99.0)  # the median seed, 1 s a step
    assert by["3mbit", "demo"]["time_to_target_s"] == pytest.approx(2 * 99.0)
    assert by["3mbit", "adamw"]["time_to_target_s"] == pytest.approx(4 * 99.0)
    assert by["3mbit", "demo"]["time_range_s"] == "197.0-199.0"
    assert by["3mbit", "demo"]["speedup_vs_dense"] == pytest.approx(2.0)
    assert by["3mbit", "demo"]["time_from"] == "timing run of 20 steps"
    assert by["unshaped", "demo"]["time_from"] == "timing run of 20 steps"
    assert by["10mbit", "demo"]["time_from"] == "runs to the target"
    assert by["10mbit", "demo"]["estimate_s"] == pytest.approx(by["10mbit", "demo"]["time_to_target_s"])
    assert by["10mbit", "demo"]["estimate_within_range"] is True
    assert by["3mbit", "demo"]["estimate_s"] is None and by["unshaped", "demo"]["estimate_s"] is None
    assert by["3mbit", "adamw"]["comm_compute_ratio"] == pytest.approx(1 / 3)  # from its timing run
    assert by["3mbit", "demo"]["bytes_sent_per_worker"] == 1000.0  # to step 100, from the unshaped run
    assert set(time_to_loss.COLUMNS) == set(rows[0])
    saved = json.loads((tmp_path / "time_to_loss.json").read_text())
    assert saved["results"]["2@3mbit@demo"]["seconds"] == {"1": pytest.approx(199.0), "2": pytest.approx(198.0),
                                                          "3": pytest.approx(197.0)}
    assert time_to_loss.earlier_results(tmp_path, [4])[0][2, "3mbit", "demo"].seconds[2] == pytest.approx(198.0)
    calls.clear()
    assert time_to_loss.main([*argv, "--seeds", "4", "--timing-steps", "20", "--steps-only"]) == []
    assert [(c[0], c[1], c[2], c[3]) for c in calls] == [("unshaped", "adamw", 0, None), ("unshaped", "adamw", 4, None),
                                                        ("unshaped", "demo", 4, None), ("unshaped", "powersgd_r8", 4, None)]
    for extra, message in [(["--check-links", "10mbit"], "--check-links needs --timing-steps"),
                           (["--steps-only"], "--steps-only needs --timing-steps"),
                           (["--timing-steps", "20", "--check-links", "25mbit"], "--check-links must name shaped links"),
                           (["--timing-steps", "20", "--check-links", "unshaped"], "--check-links must name shaped"),
                           (["--timing-steps", "1"], "--timing-steps must be >= 2")]:
        with pytest.raises(SystemExit, match=message):
            time_to_loss.main([*argv, *extra])


def test_a_timing_run_is_the_first_steps_of_the_full_schedule(tmp_path):
    """stop_at_step: the run ends after that step (evaluated there), its steps those of the full
    schedule's run (the same losses), not those of a shorter schedule."""
    from lowcomm_task.workers import run_local_workers

    spec, _ = entry_spec("adamw", 8, 2, MODEL)
    full = run_local_workers(sweep.train_one, 2, spec, None)[0]["history"]
    first = run_local_workers(sweep.train_one, 2, dataclasses.replace(spec, stop_at_step=5), None)[0]["history"]
    assert [h["step"] for h in first] == [2, 4, 5]
    assert [h["val_loss"] for h in first[:2]] == [h["val_loss"] for h in full[:2]]
    shorter = run_local_workers(sweep.train_one, 2, dataclasses.replace(spec, steps=5), None)[0]["history"]
    assert shorter[1]["val_loss"] != full[1]["val_loss"]  # another schedule: the stop is not a shorter run


def test_demo_recipe_is_demo_at_its_recipe_under_another_name():
    """With --from-sweep, "demo" takes the sweep's best configuration; "demo_recipe" (no rows of
    its own) keeps the recipe beside it."""
    spec, peer = entry_spec("demo_recipe", 90, 5, MODEL)
    assert peer is None and spec == dataclasses.replace(entry_spec("demo", 90, 5, MODEL)[0], label="demo_recipe")
