"""The tuning and seeds protocol of issue 27 ("a fair fight"): ``bench sweep`` over every
time_to_loss entry (methods, variants and peers, with ``peer.<key>`` grid keys), one row per
(configuration, seed), the count of configurations per entry, each entry's best configuration,
and ``time_to_loss --from-sweep`` running each entry at it."""

import csv
import dataclasses
import json

import pytest

from ds_lowcomm.bench import sweep, time_to_loss
from ds_lowcomm.bench.peers import PEER_KINDS
from ds_lowcomm.bench.time_to_loss import PEERS, entry_spec

MODEL = {"n_layer": 1, "n_embd": 32, "seq_len": 32}
TINY = ["--n-layer", "1", "--n-embd", "32", "--seq-len", "32"]


def _no_workers(*args, **kwargs):
    raise AssertionError("a worker started")


@pytest.mark.parametrize("argv, message", [
    (["--entry", "nope", "--grid", '{"lr": [0.001]}'], r"--entry: unknown 'nope'; allowed: adamw, .*powersgd_r8"),
    (["--entry", "demo", "--grid", '{"peer.rank": [4]}'], r"key 'peer.rank' is not a setting of demo; "
                                                           r"allowed: lr, betas, weight_decay, warmup, lowcomm.<key>"),
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
    argv = ["--hosts", "2", "--links", "unshaped", "--entries", "adamw,demo,powersgd_r8,diloco", "--steps", "30",
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
    calls.clear()
    time_to_loss.main(argv)
    assert [_unstopped(spec, peer) for _, _, spec, peer in calls[1:]] == [
        entry_spec(e, 90, 5, MODEL) for e in ("adamw", "demo", "powersgd_r8", "diloco")]
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
