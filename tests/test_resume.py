"""Save at step k, load, continue == the uninterrupted run, bit for bit, for every method."""

import os
from dataclasses import replace

import pytest

from lowcomm_task.spec import TrainSpec
from lowcomm_task.train import train_worker
from lowcomm_task.workers import run_local_workers

TINY = TrainSpec(
    steps=9, batch=4, lr=3e-3, warmup=2, eval_every=3, seed=3,
    model={"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32},
    max_train_bytes=100_000, max_val_bytes=10_000, val_batches=2, verbose=False,
)
LOWCOMM = {
    "adamw": {"method": "adamw"},
    "demo": {"method": "demo", "topk": 8, "chunk": 16},
    # overlap: the save at step 5 happens with step 5's exchange in flight
    "demo_overlap": {"method": "demo", "topk": 8, "chunk": 16, "overlap": True},
    # save at step 5: in the middle of an outer interval, so local progress and anchors must survive
    "diloco": {"method": "diloco", "sync_every": 3},
    "dct_diloco": {"method": "dct_diloco", "sync_every": 3, "topk": 8, "chunk": 16, "value_dtype": "int8"},
    "sparseloco": {"method": "sparseloco", "sync_every": 3, "topk": 8, "chunk": 16},
    "mtdao": {"method": "mtdao", "sync_every": 3, "momentum_betas": [0.9, 0.99], "momentum_weights": [0.3, 0.4],
              "momentum_sync_every": [1, 3], "second_moment_sync_every": 3},
    "mtdao_topk": {"method": "mtdao", "sync_every": 3, "sync_codec": "topk", "topk": 8, "chunk": 16, "value_dtype": "bf16"},
    # streaming: one fragment sent every step (offsets 1, 2, 3), landing a step later, so the save
    # at step 5 happens with a sync in flight
    "diloco_streaming": {"method": "diloco", "sync_every": 3, "fragments": 3, "sync_delay": 1},
    "dct_diloco_streaming": {"method": "dct_diloco", "sync_every": 3, "fragments": 3, "sync_delay": 2,
                             "fragment_mix": 0.5, "topk": 8, "chunk": 16},
    # carry_local_steps: each replica's start of the in-flight steps is state too (saved at step 5)
    "dct_diloco_carry": {"method": "dct_diloco", "sync_every": 3, "fragments": 3, "sync_delay": 2,
                         "carry_local_steps": True, "topk": 8, "chunk": 16},
}
STREAMING = {"diloco_streaming", "dct_diloco_streaming", "dct_diloco_carry"}


def _runs_worker(rank, world, workdir, resume):
    """Every method's uninterrupted run (saving at step 5) in one launch, or every method's resume
    from those checkpoints in a second one: each resume still starts in fresh processes."""
    out = {}
    for method, lowcomm in LOWCOMM.items():
        spec = replace(TINY, lowcomm=lowcomm, save_at=5, save_dir=os.path.join(workdir, method))
        if method == "demo":  # periodic saves too (4, 8): its resume names tag step5, not the latest
            spec = replace(spec, save_every=4)
        if resume:
            spec = replace(spec, save_at=None, save_every=None, resume_from=spec.save_dir,
                           resume_tag="step5" if method == "demo" else "latest")
        out[method] = train_worker(rank, world, spec)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("resume"))
    full = run_local_workers(_runs_worker, 2, workdir, False)
    resumed = run_local_workers(_runs_worker, 2, workdir, True)
    return {method: ([r[method] for r in full], [r[method] for r in resumed]) for method in LOWCOMM}


def test_checkpoint_tags_and_latest(runs, tmp_path_factory):
    """Every save is a tag of its own (step4, step5, step8) with one file and one digest per
    rank; ``latest`` names the last complete one."""
    demo = tmp_path_factory.getbasetemp() / "resume0" / "demo"
    assert (demo / "latest").read_text().strip() == "step8"
    for tag in ("step4", "step5", "step8"):
        assert sorted(p.name for p in (demo / tag).iterdir()) == [
            "rank0.pt", "rank0.pt.sha256", "rank1.pt", "rank1.pt.sha256"], tag


@pytest.mark.parametrize("method", list(LOWCOMM))
def test_resume_is_exact(method, runs):
    full, resumed = runs[method]
    for a, b in zip(full, resumed):
        assert a["params_digest"] == b["params_digest"]
        assert a["bytes_sent"] == b["bytes_sent"] and a["bytes_received"] == b["bytes_received"]
        assert a["ledger"]["steps"] == b["ledger"]["steps"] == 9
        assert a["final_val_loss"] == b["final_val_loss"]
    if method not in STREAMING:  # 9 = 3 outer intervals: replicas equal (streaming keeps fragments in flight)
        assert full[0]["params_digest"] == full[1]["params_digest"]


def test_loading_with_other_settings_is_refused(tmp_path):
    spec = replace(TINY, lowcomm=LOWCOMM["demo"], save_at=2, save_dir=str(tmp_path), stop_after_save=True)
    run_local_workers(train_worker, 2, spec)
    other = replace(spec, lowcomm={**LOWCOMM["demo"], "topk": 4}, save_at=None, resume_from=str(tmp_path))
    with pytest.raises(RuntimeError, match="checkpoint was saved with other lowcomm settings: topk: saved 8, now 4"):
        run_local_workers(train_worker, 2, other)
