"""Save at step k, load, continue == the uninterrupted run, bit for bit, for every method."""

import pytest

from ds_lowcomm.comm import run_local_workers
from ds_lowcomm.task.train import train_worker

TINY = {
    "steps": 9, "batch": 4, "lr": 3e-3, "warmup": 2, "eval_every": 3, "seed": 3,
    "model": {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32},
    "data_limits": {"max_train_bytes": 100_000, "max_val_bytes": 10_000}, "val_batches": 2, "verbose": False,
}
LOWCOMM = {
    "adamw": {"method": "adamw"},
    "demo": {"method": "demo", "topk": 8, "chunk": 16},
    # save at step 5: in the middle of an outer interval, so local progress and anchors must survive
    "diloco": {"method": "diloco", "sync_every": 3},
    "dct_diloco": {"method": "dct_diloco", "sync_every": 3, "topk": 8, "chunk": 16, "value_dtype": "int8"},
}


@pytest.mark.parametrize("method", list(LOWCOMM))
def test_resume_is_exact(method, tmp_path):
    spec = {**TINY, "lowcomm": LOWCOMM[method], "save_at": 5, "save_dir": str(tmp_path)}
    full = run_local_workers(train_worker, 2, spec)
    resumed = run_local_workers(train_worker, 2, {**spec, "save_at": None, "resume_from": str(tmp_path)})
    for a, b in zip(full, resumed):
        assert a["params_digest"] == b["params_digest"]
        assert a["bytes_sent"] == b["bytes_sent"] and a["bytes_received"] == b["bytes_received"]
        assert a["ledger"]["steps"] == b["ledger"]["steps"] == 9
        assert a["final_val_loss"] == b["final_val_loss"]
    assert full[0]["params_digest"] == full[1]["params_digest"]  # 9 = 3 outer intervals: replicas equal for every method


def test_loading_with_other_settings_is_refused(tmp_path):
    spec = {**TINY, "lowcomm": LOWCOMM["demo"], "save_at": 2, "save_dir": str(tmp_path), "stop_after_save": True}
    run_local_workers(train_worker, 2, spec)
    other = {**spec, "lowcomm": {**LOWCOMM["demo"], "topk": 4}, "save_at": None, "resume_from": str(tmp_path)}
    with pytest.raises(RuntimeError, match="checkpoint was saved with other lowcomm settings: topk: saved 8, now 4"):
        run_local_workers(train_worker, 2, other)
