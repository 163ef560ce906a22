"""The configs users copy are valid, and the per-method ones are the recipes of the reference results."""

import json
from pathlib import Path

import pytest

from ds_lowcomm.compare import RECIPES
from ds_lowcomm.config import METHODS
from ds_lowcomm.deepspeed.config import split_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_is_valid(path):
    split_config(json.loads(path.read_text()))


@pytest.mark.parametrize("method", METHODS)
def test_each_method_has_a_config_with_its_recipe(method):
    split = split_config(json.loads((CONFIGS[0].parent / f"{method}.json").read_text()))
    recipe = RECIPES[method]
    assert split.optimizer_params["lr"] == recipe["lr"]
    for key, value in recipe["lowcomm"].items():
        got = getattr(split.lowcomm, key)
        assert (list(got) if isinstance(got, tuple) else got) == value, key
