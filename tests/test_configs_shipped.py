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
        assert effective[key] == (tuple(value) if isinstance(value, list) else value), key
    assert LowcommConfig.from_dict(effective) == cfg
    owners = {"method": cfg, "transport": cfg.comm, "replica_size": cfg.comm}
    settings = cfg.settings
    for name in ("codec", "streaming"):
        for key in getattr(getattr(settings, name, None), "__dataclass_fields__", {}):
            owners[key] = getattr(settings, name)
    for key, value in section.items():
        owner = owners.get(key, settings)
        got = getattr(owner, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key


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
