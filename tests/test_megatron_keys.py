"""Every key of the "lowcomm" section on the Megatron-Core road, walked: honoured (its value reaches
the method's settings object and the run's first log line) or refused by name before any rank
starts (megatron_patches/keys.py). The command line as Megatron-LM users give it (--lowcomm-*)."""

import argparse

import pytest

from ds_lowcomm.optim.recipes import SIGN_OUTER, sign_recipe
from ds_lowcomm.optim.registry import METHODS, _all_keys
from ds_lowcomm.settings import ConfigError
from megatron_patches.args import add_lowcomm_args, lowcomm_config
from megatron_patches.keys import ONLY_VALUE, SUPPORTED_METHODS, describe, honoured_keys, method_keys

# Values per key as the command line writes them, the first valid one other than the method's default
# taken (a new key fails the walk until it has one here, and so until the Megatron road says what it
# does with it).
SAMPLE = {
    "transport": "mpi", "replica_size": "2", "timeout_s": "123.0", "nonfinite": "raise", "state_dtype": "bf16",
    "decay": "0.5", "topk": "8", "chunk": "16", "value_dtype": "bf16", "transform": ("dct", "none"),
    "average": ("world", "senders"), "compile": "true", "overlap": "true", "update": "adam", "mean_momentum": "0.5",
    "keep_sent": "0.5", "beta2": "0.99", "eps": "1e-06", "sync_every": "7", "outer_lr": "0.5",
    "outer_optimizer": ("adam", "sgd"), "outer_betas": "0.8,0.9", "outer_eps": "1e-07", "outer_weight_decay": "0.1",
    "inner_impl": "apex", "inner_optimizer": "muon", "inner_muon_lr": "0.05", "inner_muon_momentum": "0.9",
    "fragments": "2", "sync_delay": "1", "fragment_mix": "0.5", "carry_local_steps": "true",
    "sync_every_schedule": "[[4, 8]]", "outer_momentum": "0.5",
    "nesterov": "false", "momentum_betas": "0.99", "momentum_weights": "0.5", "momentum_sync_every": "3",
    "second_moment_sync_every": "4", "sync_codec": "topk", "switch_step": "3", "warm_betas": "0.8,0.99",
    "switch_lr_scale": "0.5", "rank_fraction": "0.5", "mu": "0.9", "matrix_lr": "0.02", "epsilon": "1e-07",
    "exchange": "all_gather",
}


def _config(section: dict):
    parser = add_lowcomm_args(argparse.ArgumentParser())
    argv = [a for k, v in section.items() for a in (f"--lowcomm-{k.replace('_', '-')}", str(v))]
    return lowcomm_config(parser.parse_args(argv))

# what a key needs beside it to be read at all (fragments divide the sync period; carrying local steps
# needs steps in flight; demo's beta2 and eps are its adam update's; ...), where the method has those keys
REQUIRES = {"fragments": {"sync_every": 8}, "carry_local_steps": {"sync_delay": 1},
            "fragment_mix": {"fragments": 2, "sync_every": 8}, "beta2": {"update": "adam"}, "eps": {"update": "adam"},
            "outer_betas": {"outer_optimizer": "adam"}, "outer_eps": {"outer_optimizer": "adam"},
            "warm_betas": {"switch_step": 3}, "switch_lr_scale": {"switch_step": 3},
            **{k: {"inner_optimizer": "muon"} for k in ("inner_muon_lr", "inner_muon_momentum")},
            **{k: {"outer_optimizer": "sgd"} for k in ("outer_lr", "outer_momentum", "nesterov")},
            **{k: {"sync_codec": "topk"} for k in ("topk", "chunk", "value_dtype", "transform", "average", "compile")}}


def _values(key: str) -> tuple:
    return SAMPLE[key] if isinstance(SAMPLE[key], tuple) else (SAMPLE[key],)


def test_every_key_is_honoured_or_refused_by_name_on_the_megatron_road():
    assert set(SAMPLE) == set(_all_keys()) - {"method"}, "a key without a sample value: say what Megatron does with it"
    walked = {"honoured": 0, "refused": 0}
    for method in SUPPORTED_METHODS:
        for key in _all_keys():
            if key == "method":
                continue
            honoured = key in honoured_keys(method) and key not in ONLY_VALUE
            extra = REQUIRES.get(key, {})
            extra = extra if {key, *extra} <= set(method_keys(method)) else {}
            default = _config({"method": method, **extra}).effective()
            if not honoured:
                for value in _values(key):
                    with pytest.raises(ConfigError) as err:
                        _config({"method": method, key: value, **extra})
                    assert f"lowcomm.{key}" in str(err.value) or key in str(err.value).split(";")[0], (method, key)
                walked["refused"] += 1
                continue
            config = None
            for value in _values(key):
                try:
                    config = _config({"method": method, key: value, **extra})
                except ConfigError as err:  # a value this method's checks refuse: the next one
                    assert f"lowcomm.{key}" in str(err), (method, key, err)
                    continue
                if config.effective()[key] != default[key]:
                    break
            assert config is not None and config.effective()[key] != default[key], (method, key)
            value = config.effective()[key]
            assert config.effective() == {**default, key: value}, (method, key)  # it reached the settings
            assert f"{key}={value}" in describe(config, "Megatron's Adam"), (method, key)  # the first log line
            walked["honoured"] += 1
    assert walked["honoured"] > 60 and walked["refused"] > 100, walked


@pytest.mark.parametrize("method", [m for m in METHODS if m not in SUPPORTED_METHODS])
def test_a_method_megatron_does_not_run_is_refused_by_name(method):
    with pytest.raises(ConfigError, match=f"lowcomm.method {method!r} is not supported with Megatron-Core"):
        _config({"method": method})


def test_the_keys_megatron_honours_only_at_one_value_are_taken_there():
    for key, (value, _why) in ONLY_VALUE.items():
        method = next(m for m in SUPPORTED_METHODS if key in method_keys(m))
        config = _config({"method": method, key: str(value).lower()})
        assert config.effective()[key] == value


def test_the_sign_recipe_runs_with_megatrons_optimizer_as_its_inner_one():
    """SIGN_OUTER (dct_diloco, one-bit values) is outer settings only: every key honoured; the recipe's
    Muon form (MuLoCo: ds_lowcomm's inner Muon, which takes the place of the Adam inside Megatron's
    optimizer) honoured with its lr and momentum; inner_impl refused; the Muon keys without
    inner_optimizer muon refused by name (nothing would read them)."""
    config = _config(sign_recipe("adamw"))
    assert {k: config.effective()[k] for k in SIGN_OUTER} == SIGN_OUTER
    line = describe(config, "Megatron's Adam")
    assert "value_dtype=sign" in line and "inner_muon_lr" not in line and "inner_impl" not in line
    config = _config({**sign_recipe("muon", muon_lr=0.02), "inner_muon_momentum": 0.9})
    assert {k: config.effective()[k] for k in SIGN_OUTER} == SIGN_OUTER
    line = describe(config, "Megatron's FP32Optimizer of Muon (...) + AdamW (...)")
    assert "inner_optimizer=muon, inner_muon_lr=0.02, inner_muon_momentum=0.9" in line and "inner_impl" not in line
    with pytest.raises(ConfigError, match="lowcomm.inner_impl must be torch"):
        _config({**SIGN_OUTER, "inner_optimizer": "muon", "inner_impl": "apex"})
    with pytest.raises(ConfigError, match="lowcomm.inner_muon_lr"):
        _config({**SIGN_OUTER, "inner_muon_lr": 0.05})
