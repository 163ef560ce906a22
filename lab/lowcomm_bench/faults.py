"""``python -m lowcomm_bench faults``: replicas that die and come back, on the reference task.

``--replicas`` (3) replicas, each its own job on its own test host (a network namespace, the link
shaped as in ``time_to_loss``: ``--link``, default 10mbit), train the reference task; from the
start, every ``--kill-every`` seconds one replica (1, 2, 1, ...: never replica 0, whose figures are
reported) is SIGKILLed and started again at once. Each entry runs under that schedule and without
faults:

- a ds_lowcomm method over torchft (``lowcomm.fault_tolerance``; ``diloco``, ``demo``, ...): a
  torchft lighthouse on host 0; the others go on in a quorum without the dead replica, the
  restarted one heals from a live peer at the next quorum; ``diloco_lean``: diloco whose heal
  leaves the inner optimizer's state out (``heal_inner_state`` false: the joiner's AdamW starts afresh);
- ``torchft_diloco``: torchft's own DiLoCo (the network benchmark's peer, the diloco recipe's H,
  outer lr and momentum), a Manager per replica with the same lighthouse; it heals from a peer
  with torchft's own logic (its HTTP checkpoint transport, advertising the test host's address
  and loading tensors and plain data only, as ds_lowcomm's: torchft's advertises the hostname,
  which a test host cannot reach);
- ``restart``: today's stop-and-restart elastic path (docs/reliability.md, "Lost workers"), diloco in one world
  checkpointing at every sync: a dead worker stops every rank, and all restart from the last
  checkpoint (what ``torchrun --max-restarts`` does: its agent stops the others when one fails).

Per entry (``faults.csv``): replica 0's steps per second in both runs (its steps over the seconds
from the launch to its last step: start-up, and the restart path's restarts, included), seconds
from the launch to adamw's held-out loss (adamw trained ``--target-steps`` steps, default half of
``--steps``, on the same replicas, unshaped link; the methods need more steps than adamw to its
loss at equal steps, so at ``--steps`` none would reach it inside the run), the
held-out loss at the end in both runs, the heal bytes (the restarted replicas' loads, from their
logs) and the kills done. ``faults.json`` adds each replica's heals, the syncs replica 0 discarded (and its
fault-tolerance report: syncs tried again, sat out),
how long each restarted replica took to be back in sync (restart to heal) and one sync interval's
seconds to compare with. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lowcomm_task.spec import TrainSpec

from .netns import TestNetwork, check_can_create
from .network import PEERS
from .runs import LINKS, add_model_args, effective_shape, method_spec, model_of, peer_spec, run_cached

COLUMNS = ["entry", "kill_every_s", "kills", "survivor_steps_per_s", "no_fault_steps_per_s", "time_to_target_s",
           "final_val_loss", "no_fault_final_val_loss", "heal_bytes"]
ENTRIES = ("diloco", "diloco_lean", "demo", "sparseloco", "torchft_diloco", "restart")
# entry -> (its method, what it adds to lowcomm.fault_tolerance): diloco_lean heals without the
# inner optimizer's state (the joiner starts its AdamW afresh: half the heal's bytes)
FT_ENTRIES = {"diloco_lean": ("diloco", {"heal_inner_state": False})}
LIGHTHOUSE_PORT = 29510
JOIN_TIMEOUT_MS = 10_000
HEALED = re.compile(r"healed from a peer at step (\d+): (\d+) bytes at ([0-9.]+)")
PROGRESS = re.compile(r"\] step\s+(\d+)/\d+\s+train \S+\s+val (\S+)")
_port = 29900


def _fresh_port() -> int:
    global _port
    _port += 1
    return _port


class Processes:
    """Workers on the test hosts (host i runs worker i), started, killed and restarted; their
    output in log files, polled for progress lines (timestamped when first seen)."""

    def __init__(self, net: TestNetwork, tmp: Path):
        self.net, self.tmp = net, tmp
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: list[Path] = []
        self.seen: list[tuple[float, int, float]] = []  # (time, step, val loss) of rank 0's progress lines
        self._read = {}

    def start(self, i: int, job: dict, env: dict, watch: bool = False) -> None:
        n = len(self.logs)
        job_path, prefix, log = self.tmp / f"job{n}.json", self.tmp / f"out{n}", self.tmp / f"log{n}.txt"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", **env}
        argv = self.net.command(i, [sys.executable, "-m", "lowcomm_bench.worker", str(job_path), str(prefix)])
        self.procs[i] = subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.procs[i].result, self.procs[i].log = prefix, log  # type: ignore[attr-defined]
        self.logs.append(log)
        if watch:
            self._read[log] = 0

    def poll_progress(self) -> None:
        for log, offset in self._read.items():
            text = log.read_text(errors="replace")
            end = text.rfind("\n") + 1
            for line in text[offset:end].splitlines():
                m = PROGRESS.search(line)
                if m:
                    self.seen.append((time.time(), int(m.group(1)), float(m.group(2))))
            self._read[log] = end

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p.poll() is None:
            p.kill()
        p.wait()

    def kill_all(self) -> None:
        for i in self.procs:
            self.kill(i)

    def result(self, i: int, rank: int = 0) -> dict | None:
        path = Path(f"{self.procs[i].result}.rank{rank}.json")
        return json.loads(path.read_text()) if path.exists() else None

    def heals(self) -> list[tuple[int, int, float]]:
        """(step, bytes, unix time) of every heal any replica logged."""
        out = []
        for log in self.logs:
            out += [(int(a), int(b), float(c)) for a, b, c in HEALED.findall(log.read_text(errors="replace"))]
        return out

    def tail(self, i: int | None = None) -> str:
        """Worker ``i``'s latest log's end; None: every exited worker's."""
        if i is not None:  # from its last traceback, if any (torchft's logging follows it)
            text = self.procs[i].log.read_text(errors="replace")
            at = text.rfind("Traceback (most recent call last)")
            return text[at:][:6000] if at >= 0 else text[-3000:]
        return "\n".join(f"worker {j} exited with {p.returncode}:\n{self.tail(j)}"
                         for j, p in self.procs.items() if p.poll() is not None)


def _kill_times(start: float, every: float | None, most: int = 0):
    """When to kill: every ``every`` seconds from ``start`` (``most`` > 0: that many times at most)."""
    k = 1
    while every and (not most or k <= most):
        yield start + k * every
        k += 1


def run_replicas(net: TestNetwork, spec: TrainSpec, peer: dict | None, kill_every: float | None, kills_at_most: int = 0,
                 timeout: float = 3600, ft_settings: dict | None = None) -> dict:
    """``net.hosts`` replicas over torchft (``peer`` None: ds_lowcomm's method, else torchft's
    DiLoCo), replica k > 0 killed and restarted under the schedule; replica 0's results."""
    n = net.hosts
    # DSLC_FAULTS_KEEP=1: the workers' and the lighthouse's logs stay (a temporary folder named on stderr)
    keep = os.environ.get("DSLC_FAULTS_KEEP") == "1"
    folder = contextlib.nullcontext(tempfile.mkdtemp(prefix="dslc-faults-")) if keep else \
        tempfile.TemporaryDirectory(prefix="dslc-faults-")
    with folder as tmp_dir:
        if keep:
            print(f"faults: logs in {tmp_dir}", file=sys.stderr, flush=True)
        tmp = Path(tmp_dir)
        lighthouse_log = open(tmp / "lighthouse.txt", "w")
        lighthouse_bin = str(Path(sys.executable).parent / "torchft_lighthouse")
        # join timeout 10 s, above a sync interval (about 7 s here): a quorum waits for a replica that
        # is alive (heartbeating) but not there yet. At 1 s, a replica a restart had slowed by more
        # than that missed its peers' quorum, the next one formed without another, and the three
        # never met again: two-member quorums in turn, one replica healing at every sync (measured).
        # A dead replica stops heartbeating: it is not waited for past the 2 s heartbeat timeout.
        lighthouse = subprocess.Popen(net.command(0, [lighthouse_bin, "--bind", f"0.0.0.0:{LIGHTHOUSE_PORT}",
                                                      "--min_replicas", "1", "--join_timeout_ms", str(JOIN_TIMEOUT_MS),
                                                      "--heartbeat_timeout_ms", "2000"]),
                                      stdout=lighthouse_log, stderr=subprocess.STDOUT)
        address = f"{net.address(0)}:{LIGHTHOUSE_PORT}"
        procs, go = Processes(net, tmp), tmp / "go"

        def start(i: int, first: bool) -> None:
            section = {"lighthouse": address, "replica_id": str(i), "num_replica_groups": n, "host": net.address(i),
                       "timeout_s": 30.0, **(ft_settings or {})}
            if peer is None:
                job = {"spec": dataclasses.replace(spec, lowcomm={**spec.lowcomm, "fault_tolerance": section}).to_dict(),
                       "peer": None}
            else:
                job = {"spec": spec.to_dict(), "peer": {**peer, "fault_tolerance": section}}
            env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_fresh_port()),
                   "REPLICA_GROUP_ID": str(i),
                   "GLOO_SOCKET_IFNAME": net.interface(i)}
            if first:
                env["DSLC_START_FILE"] = str(go)
            procs.start(i, job, env)

        try:
            began = time.time()  # the schedule and the seconds count from the launch, start-up included
            for i in range(n):
                start(i, first=True)
            up = time.time()
            while not all(Path(f"{go}.ready{i}").exists() for i in range(n)):  # imported, waiting for the go
                if time.time() - up > 300 or any(p.poll() is not None for p in procs.procs.values()):
                    raise RuntimeError(f"a replica did not start:\n{procs.tail(None)}")
                time.sleep(0.05)
            go.touch()
            kills, restarts = 0, []
            schedule = _kill_times(began, kill_every, kills_at_most)
            next_kill = next(schedule, None)
            while procs.procs[0].poll() is None:
                if time.time() - began > timeout:
                    raise RuntimeError(f"replica 0 ran past {timeout:.0f} s:\n{procs.tail(0)}")
                victim = 1 + kills % (n - 1)
                if next_kill is not None and time.time() >= next_kill and procs.procs[victim].poll() is None:
                    procs.kill(victim)
                    start(victim, first=False)
                    restarts.append(time.time())
                    kills += 1
                    next_kill = next(schedule, None)
                time.sleep(0.05)
            r0 = procs.result(0)
            if r0 is None:
                raise RuntimeError(f"replica 0 failed:\n{procs.tail(0)}")
            time.sleep(5.0)  # the others finish their last step
            heals = procs.heals()
            return {"r0": r0, "began": began, "kills": kills, "restarts": restarts, "heals": heals}
        finally:
            procs.kill_all()
            lighthouse.kill()
            lighthouse.wait()
            lighthouse_log.close()


def run_restart(net: TestNetwork, spec: TrainSpec, kill_every: float | None, kills_at_most: int = 0,
                timeout: float = 3600) -> dict:
    """Today's elastic path: one world of ``net.hosts`` ranks, a checkpoint at every sync; under the
    schedule a worker dies, the others are stopped and all restart from the last checkpoint."""
    n = net.hosts
    with tempfile.TemporaryDirectory(prefix="dslc-restart-") as tmp_dir:
        tmp = Path(tmp_dir)
        save = tmp / "ckpt"
        spec = dataclasses.replace(spec, save_dir=str(save), save_every=sync_every(spec, None), verbose=True)
        procs = Processes(net, tmp)

        def start_world() -> None:
            resume = (save / "latest").exists()
            run = dataclasses.replace(spec, resume_from=str(save) if resume else None)
            port = _fresh_port()
            for i in range(n):
                procs.start(i, {"spec": run.to_dict(), "peer": None},
                            {**net.env(i, port), "RANK": str(i), "WORLD_SIZE": str(n)}, watch=i == 0)

        began = time.time()
        start_world()
        kills, schedule = 0, _kill_times(began, kill_every, kills_at_most)
        next_kill = next(schedule, None)
        try:
            while True:
                procs.poll_progress()
                codes = [p.poll() for p in procs.procs.values()]
                if all(c == 0 for c in codes):
                    break
                if any(c not in (None, 0) for c in codes):
                    raise RuntimeError(f"a worker failed:\n{procs.tail(None)}")
                if time.time() - began > timeout:
                    raise RuntimeError(f"the run went past {timeout:.0f} s")
                # (once a worker has finished its run the job is ending: a restart then would
                # resume after the last step and train nothing)
                if next_kill is not None and time.time() >= next_kill and all(c is None for c in codes):
                    procs.kill(1 + kills % (n - 1))
                    procs.kill_all()  # the elastic agent stops the rest of the group
                    kills += 1
                    next_kill = next(schedule, None)
                    start_world()
                time.sleep(0.05)
            procs.poll_progress()
            r0 = procs.result(0)
            return {"r0": r0, "began": began, "kills": kills, "seen": procs.seen}
        finally:
            procs.kill_all()


def sync_every(spec: TrainSpec, peer: dict | None) -> int:
    """Steps between an entry's syncs (1: a per-step method)."""
    return (peer or {}).get("sync_every") or spec.lowcomm_config.effective().get("sync_every", 1)


def entry_run(entry: str, steps: int, eval_every: int, model: dict) -> tuple[TrainSpec, dict | None]:
    if entry == "torchft_diloco":
        return peer_spec(entry, steps, eval_every, **model), dict(PEERS[entry])
    method = "diloco" if entry == "restart" else FT_ENTRIES[entry][0] if entry in FT_ENTRIES else entry
    return method_spec(method, steps, eval_every, **model), None


def measure(entry: str, net: TestNetwork, spec: TrainSpec, peer, kill_every: float | None, kills_at_most: int = 0) -> dict:
    if entry == "restart":
        run = run_restart(net, spec, kill_every, kills_at_most)
        rows = [(t - run["began"], step, val) for t, step, val in run["seen"]]
        return {"steps_per_s": spec.steps / rows[-1][0], "rows": rows, "kills": run["kills"],
                "final_val_loss": run["r0"]["final_val_loss"], "heal_bytes": 0, "heals": [], "discarded": None,
                "back_in_sync_s": []}
    run = run_replicas(net, spec, peer, kill_every, kills_at_most, ft_settings=FT_ENTRIES.get(entry, (None, None))[1])
    r0 = run["r0"]
    rows = [(h["time"] - run["began"], h["step"], h["val_loss"]) for h in r0["history"]]
    # a restarted replica is back in sync when it heals: the first heal after each restart
    back = []
    for t in run["restarts"]:
        later = [h_time for _, _, h_time in run["heals"] if h_time >= t]
        back.append(min(later) - t if later else None)
    return {"steps_per_s": spec.steps / rows[-1][0], "rows": rows, "kills": run["kills"],
            "final_val_loss": r0["final_val_loss"], "heal_bytes": sum(b for _, b, _ in run["heals"]),
            "heals": run["heals"], "discarded": (r0.get("fault_tolerance") or {}).get("discarded"),
            "fault_tolerance": r0.get("fault_tolerance"), "back_in_sync_s": back}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench faults", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/faults")
    ap.add_argument("--cache", default="runs/bench/cache", help="adamw's target run (shared with the others)")
    ap.add_argument("--entries", default="diloco,demo,torchft_diloco,restart", help=f"of {', '.join(ENTRIES)}")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--link", default="10mbit", choices=list(LINKS))
    ap.add_argument("--kill-every", type=float, default=30.0, help="seconds between kills")
    ap.add_argument("--kills", type=int, default=0, help="kills at most (0: until the run ends)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--target-steps", type=int, default=None,
                    help="the target is adamw's held-out loss after this many steps of its own schedule (default: "
                         "half of --steps: a loss the entries reach inside the run, where adamw's loss at --steps "
                         "takes them more steps than adamw: time_to_loss)")
    ap.add_argument("--target", type=float, default=None, help="a held-out loss to reach instead of adamw's")
    ap.add_argument("--from-json", default=None,
                    help="the runs of an earlier faults.json (same entries): only the target and the rows are new")
    add_model_args(ap)
    args = ap.parse_args(argv)
    entries = [e.strip() for e in args.entries.split(",")]
    unknown = [e for e in entries if e not in ENTRIES]
    if unknown or args.replicas < 2 or args.kill_every <= 0 or args.kills < 0:
        raise SystemExit(f"--entries must name {', '.join(ENTRIES)} (got {', '.join(unknown) or 'ok'}); "
                         f"--replicas >= 2; --kill-every > 0; --kills >= 0")
    check_can_create()
    model = model_of(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.target is None:
        target_steps = args.target_steps or args.steps // 2
        adamw = run_cached(Path(args.cache), args.replicas, "unshaped",
                           method_spec("adamw", target_steps, args.eval_every, **model))
        target = adamw["final_val_loss"]
        print(f"target: adamw's held-out loss after {target_steps} steps on {args.replicas} replicas: {target:.4f}",
              flush=True)
    else:
        target = args.target
    earlier = json.loads(Path(args.from_json).read_text())["runs"] if args.from_json else {}
    shape, _ = effective_shape(LINKS[args.link])
    rows, details = [], {}
    for entry in entries:
        runs = earlier.get(entry, {})
        spec, peer = entry_run(entry, args.steps, args.eval_every, model)
        for label, every in (("no_fault", None), ("faults", args.kill_every)):
            if label not in runs:
                with TestNetwork(args.replicas, shape) as net:
                    runs[label] = measure(entry, net, spec, peer, every, args.kills)
            print(f"{entry:<15} {label:<9} steps/s {runs[label]['steps_per_s']:.2f}  val {runs[label]['final_val_loss']:.4f}"
                  f"  kills {runs[label]['kills']}  heal bytes {runs[label]['heal_bytes']}", flush=True)
        faults, clean = runs["faults"], runs["no_fault"]
        rows.append({"entry": entry, "kill_every_s": args.kill_every, "kills": faults["kills"],
                     "survivor_steps_per_s": faults["steps_per_s"], "no_fault_steps_per_s": clean["steps_per_s"],
                     "time_to_target_s": _seconds_to(faults["rows"], target),
                     "final_val_loss": faults["final_val_loss"], "no_fault_final_val_loss": clean["final_val_loss"],
                     "heal_bytes": faults["heal_bytes"]})
        details[entry] = {"no_fault": clean, "faults": faults,
                          "no_fault_time_to_target_s": _seconds_to(clean["rows"], target),
                          "sync_interval_s": sync_every(spec, peer) / clean["steps_per_s"]}
    with open(out / "faults.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    (out / "faults.json").write_text(json.dumps({"args": vars(args), "target": target, "rows": rows,
                                                 "runs": details}, indent=1))
    return rows


def _seconds_to(rows: list, target: float) -> float | None:
    """Seconds from the launch to the first evaluation at or below ``target`` (to the 4 decimals
    the restart path's progress lines print), or None."""
    return next((t for t, _, val in rows if val <= round(target, 4)), None)


if __name__ == "__main__":
    main()
