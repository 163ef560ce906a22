"""A lost worker under torchrun's elastic agent (issue 15): ``--max-restarts 1``, one of two
``launch/train.py`` workers killed (SIGKILL) after a checkpoint mid-run; torchrun restarts the
group, which resumes from the latest complete checkpoint by itself and ends with the parameters
of an uninterrupted run that saved at the same steps (demo is deterministic), bit for bit."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from tests.test_deepspeed import ROOT, ds_config

STEPS = 12
ARGS = ["--steps", str(STEPS), "--eval-every", "6", "--warmup", "2", "--n-layer", "1", "--n-embd", "32",
        "--n-head", "2", "--seq-len", "32", "--max-train-bytes", "200000", "--save-every", "2"]


def _torchrun(tmp_path, name, port, kill_after_tags=()):
    """One torchrun of 2 workers; with ``kill_after_tags``, SIGKILL worker 1 as soon as ``latest``
    names one of them (any of several: on a fast machine two saves can fall between two polls).
    Returns (metrics, torchrun's stderr, seconds, the checkpoint step at the kill, the tags saved)."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(ds_config("demo")))
    save_dir, metrics = tmp_path / f"{name}_ckpt", tmp_path / f"{name}.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--max-restarts", "1",
           "--master_port", str(port), str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(cfg), *ARGS,
           "--save-dir", str(save_dir), "--metrics-out", str(metrics)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed_at = None
    if kill_after_tags:
        latest = save_dir / "latest"
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            tag = latest.read_text().strip() if latest.exists() else None
            if tag in kill_after_tags:
                workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                           if any("train.py" in part for part in p.cmdline())]
                victim = max(workers, key=lambda p: p.pid)  # one of the two (the later started)
                os.kill(victim.pid, signal.SIGKILL)
                killed_at = tag
                break
            time.sleep(0.005)
    out, err = proc.communicate(timeout=400)
    seconds = time.perf_counter() - start
    (tmp_path / f"{name}.log").write_text(out + err)
    assert proc.returncode == 0, (name, out[-2000:], err[-6000:])
    tags = sorted(p.name for p in save_dir.iterdir() if p.is_dir() and p.name.startswith("step"))
    return json.loads(metrics.read_text()), err, seconds, killed_at, tags


def test_a_killed_worker_restarts_the_group_which_resumes_from_the_latest_checkpoint(tmp_path):
    full, _, full_s, _, full_tags = _torchrun(tmp_path, "full", 29561)
    mid_run = tuple(f"step{s}" for s in range(2, STEPS, 2))  # a kill before the last save
    lost, err, lost_s, killed_at, _ = _torchrun(tmp_path, "lost", 29562, kill_after_tags=mid_run)
    assert killed_at in mid_run, "the run ended before a worker could be killed"
    assert "elastic restart 1: resuming from" in err  # the restarted group found the checkpoint itself
    assert f"step{STEPS}" in full_tags and killed_at in full_tags
    assert len(set(lost["params_digests"])) == 1  # replicas identical after the restart
    assert lost["params_digests"] == full["params_digests"]  # and equal to the uninterrupted run's
    assert lost["final_val_loss"] == full["final_val_loss"]
    print(f"elastic restart: uninterrupted {full_s:.1f} s, with a worker killed after {killed_at} {lost_s:.1f} s "
          f"(+{lost_s - full_s:.1f} s)")
