"""The configs users copy are valid, and the per-method ones are the recipes of the reference results."""

import json
from pathlib import Path

import pytest

from ds_lowcomm.optim.recipes import RECIPES
from ds_lowcomm.config import METHODS, LowcommConfig
from ds_lowcomm.deepspeed.config import split_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path):
    split_config(json.loads(path.read_text()))


@pytest.mark.parametrize("method", METHODS)
def test_each_method_has_a_config_with_its_recipe(method):
    split = split_config(json.loads((CONFIGS[0].parent / f"{method}.json").read_text()))
    recipe = RECIPES[method]
    assert split.optimizer.lr == recipe["lr"]
    assert split.deepspeed["gradient_clipping"] == recipe.get("clip_grad", 0.0)
    for key, value in recipe["lowcomm"].items():
        got = getattr(split.lowcomm, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_flat_section_lands_in_the_components_and_back(path):
    """Every key of a shipped (flat) lowcomm section reaches the component that owns it, and the
    effective settings give the same section back."""
    section = json.loads(path.read_text())["lowcomm"]
    section.pop("replicas", None)  # nested sections have components of their own (hetero.ReplicaSpec)
    cfg = split_config(json.loads(path.read_text())).lowcomm
    effective = cfg.effective()
    for key, value in section.items():
        assert effective[key] == _tupled(value), key
    assert LowcommConfig.from_dict(effective) == cfg
    owners = {"method": cfg, "transport": cfg.comm, "replica_size": cfg.comm}
    settings = cfg.settings
    for name in ("codec", "streaming"):
        for key in getattr(getattr(settings, name, None), "__dataclass_fields__", {}):
            owners[key] = getattr(settings, name)
    for key, value in section.items():
        owner = owners.get(key, settings)
        got = getattr(owner, key)
        assert got == _tupled(value), key


def _tupled(value):
    """A JSON list as the settings hold it: tuples, nested ones too (sync_every_schedule's pairs)."""
    return tuple(_tupled(v) for v in value) if isinstance(value, list) else value


@pytest.mark.parametrize("path", sorted((CONFIGS[0].parent / "megatron").glob("*.json")), ids=lambda p: p.name)
def test_shipped_megatron_section_is_valid(path, tmp_path):
    """configs/megatron/: lowcomm sections for Megatron's --lowcomm-config, read as pretrain_gpt reads them."""
    import argparse

    from megatron_patches.args import add_lowcomm_args, lowcomm_config

    args = add_lowcomm_args(argparse.ArgumentParser()).parse_args(["--lowcomm-config", str(path)])
    assert lowcomm_config(args).effective()["method"] == json.loads(path.read_text())["method"]


def test_mtdao_recipe_warm_start_follows_the_run_length():
    """compare's mtdao recipe is the authors': its switch and warm-up a third of --steps, their
    clipping and held peak; an override may drop the warm start (the recipe before issue 43)."""
    from lowcomm_task.compare import build_specs
    from lowcomm_task.spec import TrainSpec

    spec, = build_specs(["mtdao"], TrainSpec(steps=300, warmup=20), {}, workers=2)
    assert (spec.lowcomm["switch_step"], spec.warmup, spec.clip_grad, spec.lr_decay) == (100, 100, 1.0, "none")
    assert spec.lowcomm_config.settings.switch_lr_scale == 4.0 and spec.lowcomm_config.settings.beta2 == 0.999
    old, = build_specs(["mtdao"], TrainSpec(steps=300, warmup=20),
                       {"mtdao": {"warm_start": 0, "clip_grad": 0.0, "lr_decay": "cosine"}}, workers=2)
    assert ("switch_step" not in old.lowcomm, old.warmup, old.clip_grad, old.lr_decay) == (True, 20, 0.0, "cosine")


@pytest.mark.parametrize("name", ["muloco_sign_long", "muloco_sign_long_zero2_bf16"])
def test_the_long_h_configs_run_the_recipe_the_benchmark_picked(name):
    """configs/muloco_sign_long*.json: the outer settings of recipes.RECOMMENDED's long-H recipe (what
    the planner prices and docs/bench/long_h.csv measured), the inner Muon at the lr dense Muon was
    tuned to over that benchmark's budget (the recipe runs its inner optimizer at the dense settings)."""
    import csv

    from ds_lowcomm.optim.recipes import RECOMMENDED, USER_SETTINGS
    from lowcomm_bench.committed import BENCH, LONG_H

    raw = json.loads((CONFIGS[0].parent / f"{name}.json").read_text())
    recipe = RECOMMENDED["muloco_sign_long"]["lowcomm"]
    assert {k: v for k, v in raw["lowcomm"].items() if k not in USER_SETTINGS} == recipe
    rows = [r for r in csv.DictReader(open(BENCH / LONG_H)) if r["entry"] == "muon" and r["role"] == "tune"
            and r["parameters"] == "445952" and r["replicas"] == "2"]
    tuned = json.loads(min(rows, key=lambda r: float(r["final_val_loss"]))["settings"])
    muon_lr = raw["lowcomm"].get("inner_muon_lr") or raw["optimizer"]["params"]["muon_lr"]
    assert muon_lr == tuned["peer.muon_lr"]
    assert raw["optimizer"]["params"].get("lr", raw["optimizer"]["params"].get("adam_lr")) == tuned["lr"]
