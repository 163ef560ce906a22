"""The benchmarks at tiny size (seconds, so that they keep working), and the test hosts' set-up and
tear-down when running as root. The measurements themselves are in docs/results/."""

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowcomm_bench import netns
from lowcomm_bench.runs import loss_at_time, time_to_loss

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="network namespaces and tc need root")
TINY = ["--steps", "4", "--eval-every", "2", "--n-layer", "1", "--n-embd", "32", "--seq-len", "32"]


_SERVER = """import socket, sys
s = socket.create_server((sys.argv[1], 29999)); c, _ = s.accept(); c.sendall(b"hello from host 0"); c.close()"""
_CLIENT = """import socket, sys
c = socket.create_connection((sys.argv[1], 29999), timeout=10); print(c.recv(100).decode())"""


def _rows(path):
    return list(csv.DictReader(open(path)))


def test_time_to_loss_and_loss_at_time():
    h = [{"train_s": 1.0, "val_loss": 3.0}, {"train_s": 2.0, "val_loss": 2.0}, {"train_s": 3.0, "val_loss": 1.0}]
    assert time_to_loss(h, 2.5) == pytest.approx(1.5)
    assert time_to_loss(h, 0.5) is None
    assert loss_at_time(h, 2.5) == pytest.approx(1.5)
    assert loss_at_time(h, 9.0) == 1.0


@needs_root
def test_test_hosts_are_created_shaped_and_removed():
    shape = netns.LinkShape("100mbit")
    with netns.TestNetwork(2, shape, prefix="dslct") as net:
        assert sorted(net.existing()) == ["dslct-h0", "dslct-h1", "dslct-hub"]
        # real TCP from host 1 to host 0 through the bridge
        server = subprocess.Popen(net.command(0, [sys.executable, "-c", _SERVER, net.address(0)]), stdout=subprocess.PIPE)
        time.sleep(1.0)
        client = subprocess.run(net.command(1, [sys.executable, "-c", _CLIENT, net.address(0)]), capture_output=True,
                                timeout=30)
        server.wait(timeout=30)
        assert client.stdout.strip() == b"hello from host 0", client.stderr
        qdisc = subprocess.run(net.command(0, ["tc", "qdisc", "show", "dev", net.interface(0)]),
                               capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        # nothing of it is visible in the machine's own namespace
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert net.interface(0) not in links
    assert net.existing() == []


@needs_root
def test_a_second_test_network_waits_for_the_first_to_be_removed(capfd):
    """Two test networks at once (a benchmark and a test, say): the second waits on the machine's
    lock, saying so, and is made only after the first is gone; before, it removed the first's
    namespaces as leftovers and cut a running benchmark's links."""
    import threading

    events = []
    first = netns.TestNetwork(1, prefix="dslct")
    with first:
        def second():
            with netns.TestNetwork(1, prefix="dslcu") as net:
                events.append(("second made", sorted(net.existing())))

        t = threading.Thread(target=second)
        t.start()
        t.join(timeout=3.0)
        assert t.is_alive() and events == []  # still waiting
        assert sorted(first.existing()) == ["dslct-h0", "dslct-hub"]  # untouched
        events.append(("first removed", None))
    t.join(timeout=60)
    assert events == [("first removed", None), ("second made", ["dslcu-h0", "dslcu-hub"])]
    assert f"TestNetwork: waiting for the test network of pid {os.getpid()}" in capfd.readouterr().err


# One TCP connection from host 1 (sender) to host 0 (receiver): the receiver asks for n bytes with an
# 8-byte request after an idle gap and times from writing the request to the last byte's arrival.
_RECEIVER = """import socket, sys, time
s = socket.create_server((sys.argv[1], 29998)); c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); buf = bytearray(1 << 20)
for n in map(int, sys.argv[2].split(",")):
    time.sleep(0.1)  # idle: the shaper's buckets fill, as before each of demo's per-step messages
    t0 = time.perf_counter(); c.sendall(n.to_bytes(8, "big")); got = 0
    while got < n:
        k = c.recv_into(buf, min(len(buf), n - got)); assert k, "sender closed early"; got += k
    print(n, time.perf_counter() - t0, flush=True)
c.sendall(bytes(8))"""
_SENDER = """import socket, sys, time
for _ in range(100):
    try: c = socket.create_connection((sys.argv[1], 29998), timeout=30); break
    except OSError: time.sleep(0.1)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    h = b""
    while len(h) < 8:
        k = c.recv(8 - len(h)); assert k, "receiver closed"; h += k
    n = int.from_bytes(h, "big")
    if not n: break
    c.sendall(bytes(n))"""


@needs_root
def test_shaped_link_holds_its_rate_for_a_small_message_and_a_bulk_transfer():
    """At 10 Mbit/s a 14,169-byte message (demo's per-step payload on the reference task, sent after
    100 ms idle, so every bucket of the shaper is full) and a 1 MB transfer each take within 10% of
    size / rate. Timed on the receiving host (host 0) over TCP from host 1: from writing an 8-byte
    request for n bytes until the last of them arrives, so the time holds the request's way over (74
    bytes on the wire), the sender's wake-up (about 0.2 ms here: the same exchange unshaped) and the
    frames' headers (66 bytes per 1448 of payload: 4.6%, which a real link carries too). Three rounds,
    the median of each size. The old shaper (burst 16 KiB, no peak rate) passed the 14 KB message in
    about 0.2 ms, where size / rate is 11.3 ms."""
    sizes, rounds = (14_169, 1_000_000), 3
    with netns.TestNetwork(2, netns.LinkShape("10mbit"), prefix="dslcr") as net:
        receiver = subprocess.Popen(net.command(0, [sys.executable, "-c", _RECEIVER, net.address(0),
                                                    ",".join(map(str, sizes * rounds))]),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sender = subprocess.Popen(net.command(1, [sys.executable, "-c", _SENDER, net.address(0)]),
                                  stderr=subprocess.PIPE, text=True)
        out, err = receiver.communicate(timeout=60)
        sender.wait(timeout=30)
        assert receiver.returncode == 0 and sender.returncode == 0, (err, sender.stderr.read())
    times: dict[int, list[float]] = {}
    for line in out.split("\n"):
        if line.strip():
            n, t = line.split()
            times.setdefault(int(n), []).append(float(t))
    for n in sizes:
        ideal = n * 8 / 10e6
        ratios = sorted(t / ideal for t in times[n])
        assert 0.9 <= ratios[1] <= 1.1, \
            f"{n} bytes took {[round(r, 3) for r in ratios]} x size / rate ({ideal * 1e3:.1f} ms)"


def test_network_benchmark_refuses_without_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="needs root"):
        netns.check_can_create()


def test_network_benchmark_refuses_repeat_links_outside_links():
    from lowcomm_bench import network

    with pytest.raises(SystemExit, match=r"--repeat-links must name links of --links \(unshaped\); got 1gbit-5ms"):
        network.main(["--links", "unshaped", "--repeat-links", "1gbit-5ms"])


def test_repeats_per_run_repeats_only_the_chosen_links_and_entries():
    from argparse import Namespace

    from lowcomm_bench.runs import repeats_per_run

    args = Namespace(repeats=3, repeat_links="10mbit", repeat_entries="demo,diloco")
    got = repeats_per_run(args, ["unshaped", "10mbit"], ["adamw", "demo", "diloco"])
    assert got == {("unshaped", "adamw"): 1, ("unshaped", "demo"): 1, ("unshaped", "diloco"): 1,
                   ("10mbit", "adamw"): 1, ("10mbit", "demo"): 3, ("10mbit", "diloco"): 3}
    args.repeat_entries = "sparseloco"
    with pytest.raises(SystemExit, match=r"--repeat-entries must name entries of --entries \(adamw, demo, diloco\); "
                                         r"got sparseloco"):
        repeats_per_run(args, ["unshaped", "10mbit"], ["adamw", "demo", "diloco"])


def test_time_to_loss_keeps_the_other_host_counts_of_an_earlier_run(tmp_path):
    import json

    from lowcomm_bench.time_to_loss import earlier_results

    from lowcomm_bench.time_to_loss import Result

    row2, row4 = {"hosts": 2, "link": "10mbit", "entry": "adamw"}, {"hosts": 4, "link": "10mbit", "entry": "adamw"}

    def saved(a):
        return {"runs": {"1": [{"a": a}]}, "timing": None, "steps": {"1": 100}, "seconds": {"1": 9.0}, "estimate": {}}

    (tmp_path / "time_to_loss.json").write_text(json.dumps(
        {"args": {}, "rows": [row2, row4], "results": {"2@10mbit@adamw": saved(2), "4@10mbit@adamw": saved(4)}}))
    assert earlier_results(tmp_path, [4]) == ({(2, "10mbit", "adamw"): Result({1: [{"a": 2}]}, None, {1: 100},
                                                                               {1: 9.0}, {})}, [row2])
    assert earlier_results(tmp_path, [2, 4]) == ({}, [])
    assert earlier_results(tmp_path / "none", [4]) == ({}, [])


@needs_root
def test_network_and_peers_benchmarks_tiny(tmp_path):
    from lowcomm_bench import network, peers

    cache = str(tmp_path / "cache")
    rows = network.main(["--hosts", "2", "--links", "unshaped", "--methods", "adamw,demo", "--budget-factor", "1",
                         "--cache", cache, "--out", str(tmp_path / "net"), *TINY])
    assert [r["method"] for r in rows] == ["adamw", "demo"]
    assert rows[0]["speedup_vs_adamw"] == 1.0 and rows[0]["time_to_target_s"] > 0
    assert (tmp_path / "net" / "network-2h.png").stat().st_size > 10_000
    # peers reuses the cached adamw run and adds DDP + PowerSGD
    rows = {r["name"]: r for r in peers.main(["--names", "adamw,powersgd_r4", "--slow-link", "100mbit-20ms",
                                               "--cache", cache, "--out", str(tmp_path / "peers"), *TINY])}
    assert rows["adamw"]["compression_vs_adamw"] == 1.0
    assert 1.0 < rows["powersgd_r4"]["compression_vs_adamw"] < 20  # PowerSGD's all-reduces were counted
    assert _rows(tmp_path / "peers" / "peers.csv")[1]["name"] == "powersgd_r4"


@needs_root
def test_streaming_benchmark_tiny(tmp_path):
    from lowcomm_bench import streaming

    rows = streaming.main(["--links", "unshaped", "--steps", "8", "--sync-every", "4", "--fragments", "2",
                           "--sync-delay", "1", "--n-layer", "1", "--n-embd", "32", "--seq-len", "32", "--batch", "4",
                           "--out", str(tmp_path)])
    assert [r["syncs"] for r in rows] == [2, 3]  # diloco lands at 4, 8; streaming at 3, 5, 7 (9 is past the end)
    assert (tmp_path / "streaming.csv").exists()


def test_scaling_benchmark_tiny(tmp_path):
    from lowcomm_bench import scaling

    result = scaling.main(["--workers", "2", "--widths", "32", "--steps", "5", "--methods", "adamw,demo",
                           "--replica-sizes", "1", "--out", str(tmp_path)])
    by = {r["method"]: r for r in result["workers"]}
    assert by["demo"]["bytes_received_per_sync"] < by["adamw"]["bytes_received_per_sync"] / 10
    assert result["replicas"][0]["replicas_identical"]
    assert (tmp_path / "scaling.png").exists()


def test_time_to_loss_arithmetic():
    from lowcomm_bench.time_to_loss import bytes_to_target, comm_compute_ratio, steps_to_target

    h = [{"step": 5, "val_loss": 3.0, "bytes_sent": 10}, {"step": 10, "val_loss": 2.0, "bytes_sent": 20}]
    assert steps_to_target(h, 2.5) == 10 and steps_to_target(h, 1.0) is None
    assert bytes_to_target(h, 2.5, 99) == 20 and bytes_to_target(h, 1.0, 99) == 99
    assert comm_compute_ratio({"train_s": 10.0, "comm_s": 6.0, "codec_s": 1.0}) == pytest.approx(2.0)


def test_time_to_loss_records_the_planners_steps_ratios(tmp_path):
    """--record over the committed fair run (committed.ADAMW_TTL, tuned by a sweep): demo's
    ratio from the entry at its recipe (demo_recipe, 260 steps), not the sweep's demo (445), over
    adamw's 240: the figure ds_lowcomm/measured.json holds; the other methods' untouched."""
    from types import SimpleNamespace

    from ds_lowcomm import plan
    from lowcomm_bench.time_to_loss import record_steps_ratios

    from lowcomm_bench.committed import ADAMW_TTL, ADAMW_TUNING, BENCH

    rows = [{**r, "hosts": int(r["hosts"]), "steps_to_target": float(r["steps_to_target"] or 0)}
            for r in _rows(BENCH / ADAMW_TTL)]
    measured = tmp_path / "measured.json"
    measured.write_bytes(plan.MEASURED_PATH.read_bytes())
    args = SimpleNamespace(seeds="0,1,2", steps=300, from_sweep=f"docs/bench/{ADAMW_TUNING}")
    record_steps_ratios(rows, 2, args, (BENCH / ADAMW_TTL).parent, measured)
    before, after = plan.load_measured(), plan.load_measured(measured)
    assert after["steps_ratio"]["demo"]["value"] == before["steps_ratio"]["demo"]["value"] == 260 / 240
    assert "3 seed(s)" in after["steps_ratio"]["demo"]["source"]
    assert {m: e for m, e in after["steps_ratio"].items() if m != "demo"} == \
        {m: e for m, e in before["steps_ratio"].items() if m != "demo"}


@needs_root
def test_time_to_loss_benchmark_tiny(tmp_path):
    """A slow link raises adamw's comm/compute ratio; the CSV holds the columns users read."""
    from lowcomm_bench import time_to_loss

    rows = time_to_loss.main(["--hosts", "2", "--links", "unshaped,10mbit", "--entries", "adamw,demo",
                              "--budget-factor", "1", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path),
                              *TINY])
    by = {(r["link"], r["entry"]): r for r in rows}
    assert by["10mbit", "adamw"]["comm_compute_ratio"] > 3 * by["unshaped", "adamw"]["comm_compute_ratio"]
    assert by["10mbit", "adamw"]["speedup_vs_dense"] == 1.0
    assert by["10mbit", "demo"]["bytes_sent_per_worker"] < by["10mbit", "adamw"]["bytes_sent_per_worker"] / 10
    header = _rows(tmp_path / "time_to_loss.csv")[0].keys()
    assert {"setting", "comm_compute_ratio", "entry", "steps_to_target", "time_to_target_s",
            "bytes_sent_per_worker"} <= set(header)


@pytest.fixture(scope="module")
def torchft_cache(tmp_path_factory):
    """The torchft peer tests' run cache: their adamw target run (the same spec) runs once."""
    return tmp_path_factory.mktemp("torchft_cache")


@needs_root
def test_torchft_diloco_peer_trains_as_ds_lowcomm_diloco(tmp_path, torchft_cache):
    """torchft's DiLoCo (its Manager, lighthouse and outer SGD, one replica group per test host)
    as a peer: on the diloco recipe (H, outer lr 0.7, Nesterov 0.9, inner AdamW) it reaches the
    same held-out losses as ds_lowcomm's diloco at every evaluation, an independent implementation
    of the same algorithm; its pseudo-gradient all-reduces are counted (one fp32 model per sync)."""
    from lowcomm_bench import time_to_loss

    steps = ["--steps", "20", "--eval-every", "10", "--n-layer", "1", "--n-embd", "32", "--seq-len", "32"]
    time_to_loss.main(["--hosts", "2", "--links", "unshaped", "--entries", "adamw,diloco,torchft_diloco",
                       "--budget-factor", "2", "--cache", str(torchft_cache), "--out", str(tmp_path), *steps])
    runs = json.loads((tmp_path / "time_to_loss.json").read_text())["results"]
    ours, peer = runs["2@unshaped@diloco"]["runs"]["0"][0], runs["2@unshaped@torchft_diloco"]["runs"]["0"][0]
    assert [h["val_loss"] for h in peer["history"]] == pytest.approx([h["val_loss"] for h in ours["history"]],
                                                                     rel=1e-6)
    assert peer["replicas_identical"]
    from lowcomm_task.model import GPT, GPTConfig

    model_bytes = 4 * sum(p.numel() for p in GPT(GPTConfig(n_layer=1, n_embd=32, seq_len=32)).parameters())
    syncs = peer["history"][-1]["step"] // 20
    assert peer["bytes_sent_per_worker"] == syncs * model_bytes


@needs_root
def test_torchft_streaming_diloco_peer_trains_as_ds_lowcomm_streaming(tmp_path, monkeypatch, torchft_cache):
    """torchft's Streaming DiLoCo (4 fragments of the model, one synced every H / 4 steps) on the
    same fragments and schedule as ds_lowcomm's diloco with ``fragments: 4``: the same held-out
    losses at every evaluation. With a delay the two differ only in phase (torchft sends a fragment
    ``sync_delay`` steps before its slot, ds_lowcomm at its slot), so both run without one here.
    Each sync sends one fragment, about a quarter of the model."""
    from lowcomm_bench import runs, time_to_loss

    monkeypatch.setitem(runs.VARIANTS, "diloco_streaming", ("diloco", {"fragments": 4, "sync_delay": 0}))
    monkeypatch.setitem(time_to_loss.PEERS, "torchft_streaming_diloco",
                        {**time_to_loss.PEERS["torchft_streaming_diloco"], "sync_delay": 0})
    steps = ["--steps", "20", "--eval-every", "10", "--n-layer", "1", "--n-embd", "32", "--seq-len", "32"]
    time_to_loss.main(["--hosts", "2", "--links", "unshaped", "--entries",
                       "adamw,diloco_streaming,torchft_streaming_diloco", "--budget-factor", "2",
                       "--cache", str(torchft_cache), "--out", str(tmp_path), *steps])
    runs_ = json.loads((tmp_path / "time_to_loss.json").read_text())["results"]
    ours = runs_["2@unshaped@diloco_streaming"]["runs"]["0"][0]
    peer = runs_["2@unshaped@torchft_streaming_diloco"]["runs"]["0"][0]
    assert [h["val_loss"] for h in peer["history"]] == pytest.approx([h["val_loss"] for h in ours["history"]],
                                                                     rel=1e-6)
    assert not peer["replicas_identical"] and not ours["replicas_identical"]  # fragments 0-2 trained on locally
    from lowcomm_task.model import GPT, GPTConfig

    model_bytes = 4 * sum(p.numel() for p in GPT(GPTConfig(n_layer=1, n_embd=32, seq_len=32)).parameters())
    syncs = peer["history"][-1]["step"] // 5
    assert 0.15 * syncs * model_bytes < peer["bytes_sent_per_worker"] < 0.35 * syncs * model_bytes


def test_sweep_benchmark_tiny(tmp_path):
    """Each grid point trains with its settings over the recipe: a larger demo lr moves the loss,
    and the recorded steps to target are those of the history."""
    from lowcomm_bench import sweep

    rows = sweep.main(["--method", "demo", "--grid", '{"lr": [0.001, 0.004], "lowcomm.topk": [2]}',
                       "--budget", "20", "--eval-every", "10", "--target", "9.0", "--out", str(tmp_path),
                       "--n-layer", "1", "--n-embd", "32", "--seq-len", "32"])
    assert [json.loads(r["settings"]) for r in rows] == [{"lr": 0.001, "lowcomm.topk": 2},
                                                        {"lr": 0.004, "lowcomm.topk": 2}]
    assert all(r["steps_to_target"] == 10 for r in rows)  # the first evaluation is below 9.0
    assert rows[0]["final_val_loss"] != rows[1]["final_val_loss"]
    assert len(_rows(tmp_path / "sweep.csv")) == 2
    with pytest.raises(SystemExit, match="--grid"):
        sweep.main(["--method", "demo", "--grid", '{"lr": []}', "--out", str(tmp_path)])


def test_megatron_benchmark_refuses_iterations_shorter_than_a_sync_interval(monkeypatch, tmp_path):
    """--iters 10 with diloco's 20-step interval would send nothing and report 0 bytes: refused
    before any run, naming the entries and their intervals (an override among the extra arguments
    counts)."""
    from lowcomm_bench import megatron

    monkeypatch.setattr(megatron, "run_entry", lambda *a: (_ for _ in ()).throw(AssertionError("a run started")))
    with pytest.raises(SystemExit, match=r"--iters 10 is shorter than the sync interval of diloco \(20 iterations\), "
                                         r"mtdao \(132 iterations\): it would never sync; use --iters >= 132"):
        megatron.main(["--iters", "10", "--entries", "stock", "demo", "diloco", "mtdao", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match=r"sync interval of diloco \(40 iterations\)"):
        megatron.main(["--iters", "30", "--entries", "diloco", "--out", str(tmp_path), "--", "--lowcomm-sync-every",
                       "40"])
    assert megatron.steps_per_sync("diloco", ["--lowcomm-sync-every", "5"]) == 5
    assert [megatron.steps_per_sync(e, []) for e in ("stock", "adamw", "demo", "sparseloco")] == [1, 1, 1, 20]


@needs_root
def test_faults_benchmark_tiny(tmp_path):
    """bench faults at tiny size, 2 replicas, replica 1 killed once 2 s after the launch (in its
    start-up or just after; a kill after a worker has finished would restart nothing): torchft's
    DiLoCo as replicas of their own jobs (the survivor goes on; the restarted one heals or the run
    ends first), and the stop-and-restart path, which resumes every rank from the last checkpoint
    and so ends exactly where the run without faults does."""
    from lowcomm_bench import faults

    rows = faults.main(["--entries", "torchft_diloco,restart", "--replicas", "2", "--steps", "160", "--eval-every", "80",
                        "--kill-every", "2", "--kills", "1", "--target", "9", "--n-layer", "1", "--n-embd", "32",
                        "--seq-len", "32", "--out", str(tmp_path)])
    assert [r["entry"] for r in rows] == ["torchft_diloco", "restart"]
    with open(tmp_path / "faults.csv") as f:
        assert next(csv.reader(f)) == faults.COLUMNS
    ft, restart = rows
    assert ft["kills"] == 1 and restart["kills"] == 1
    assert restart["final_val_loss"] == restart["no_fault_final_val_loss"]  # resumed exactly
    assert 0 < ft["survivor_steps_per_s"] and 0 < restart["survivor_steps_per_s"] < restart["no_fault_steps_per_s"]
    assert ft["time_to_target_s"] > 0  # --target 9: the first evaluation reaches it


def test_absent_benchmark_leaves_a_replica_out_of_the_syncs_it_names(tmp_path):
    """bench absent at tiny size, 2 replicas, one sync (diloco's H 20 at step 20): with replica 1
    out of it the outer step is replica 0's pseudo-gradient alone, so the loss after it differs
    from the run with both; a replica outside the run is refused before anything starts."""
    from lowcomm_bench import absent

    tiny = ["--replicas", "2", "--steps", "20", "--eval-every", "20", "--n-layer", "1", "--n-embd", "32",
            "--seq-len", "32", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="replicas must be 0..1"):
        absent.main([*tiny, "--absent", "2:20"])
    rows = absent.main([*tiny, "--absent", "1:20"])
    assert [r["absent"] for r in rows] == ["none", "1:20"]
    assert rows[0]["final_val_loss"] != rows[1]["final_val_loss"]
    assert _rows(tmp_path / "absent.csv")[1]["absent"] == "1:20"
    assert absent.parse_absent("1:100,120; 2:200") == {1: {100, 120}, 2: {200}}
