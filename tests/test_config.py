"""Bad settings fail with a message that names the field and what it accepts, before any rank starts."""

import subprocess
import sys
import time

import pytest
import torch

from ds_lowcomm.config import ConfigError, LowcommConfig, check_lr


@pytest.mark.parametrize(
    "raw,message",
    [
        ({"method": "demo", "topk": 5000}, r"lowcomm.topk must be an integer in \[1, 4096\] \(chunk\*chunk = 4096\); got 5000"),
        ({"method": "diloco", "sync_every": 0}, r"lowcomm.sync_every must be an integer >= 1; got 0"),
        ({"method": "sgd"}, r"lowcomm.method must be one of adamw, demo, diloco, dct_diloco, sparseloco, mtdao, dion; got 'sgd'"),
        ({"method": "demo", "decay": 1.0}, r"lowcomm.decay must be a number in \[0.0, 1.0\); got 1.0"),
        ({"method": "demo", "decay": -0.1}, r"lowcomm.decay must be a number in \[0.0, 1.0\)"),
        ({"method": "dct_diloco", "value_dtype": "fp8"}, r"lowcomm.value_dtype must be one of fp32, bf16, fp16, int8, 2bit"),
        ({"method": "diloco", "outer_lr": -1}, r"lowcomm.outer_lr must be a number > 0"),
        ({"method": "demo", "topK": 3}, r"unknown setting\(s\) topK; allowed: .*topk"),
        ({"method": "demo", "chunk": 2.5}, r"lowcomm.chunk must be an integer >= 1; got 2.5"),
        ({"method": "diloco", "state_dtype": "fp64"}, r"lowcomm.state_dtype must be one of fp32, bf16, fp16"),
        ({"method": "diloco", "inner_impl": "fused"}, r"lowcomm.inner_impl must be one of torch, apex"),
        ({"method": "diloco", "transport": "nccl"}, r"lowcomm.transport must be one of torch, mpi; got 'nccl'"),
        # SparseLoCo
        ({"method": "sparseloco", "topk": 0}, r"lowcomm.topk must be an integer in \[1, 4096\]"),
        ({"method": "sparseloco", "value_dtype": "1bit"}, r"lowcomm.value_dtype must be one of .*2bit, sign; got '1bit'"),
        ({"method": "sparseloco", "decay": 1.5}, r"lowcomm.decay must be a number in \[0.0, 1.0\)"),
        # streaming outer sync
        ({"method": "diloco", "sync_every": 4, "fragments": 5}, r"lowcomm.fragments must be an integer in \[1, 4\]"),
        ({"method": "dct_diloco", "sync_every": 4, "sync_delay": 4},
         r"lowcomm.sync_delay must be an integer in \[0, 3\] \(a fragment's sync must land before its next one"),
        ({"method": "sparseloco", "fragment_mix": 1.5}, r"lowcomm.fragment_mix must be a number in \[0, 1\]; got 1.5"),
        ({"method": "dct_diloco", "carry_local_steps": True},
         r"lowcomm.carry_local_steps needs lowcomm.sync_delay >= 1 \(with 0 a sync lands at its send"),
        ({"method": "diloco", "sync_delay": 1, "carry_local_steps": True, "fragment_mix": 0.5},
         r"lowcomm.carry_local_steps and lowcomm.fragment_mix are two ways to land a sync: set fragment_mix to 0"),
        ({"method": "diloco", "sync_delay": 1, "carry_local_steps": 1}, r"lowcomm.carry_local_steps must be"),
        # H growing during training
        *[({"method": "diloco", "sync_every_schedule": bad}, r"lowcomm.sync_every_schedule must be a list of "
           r"\[from_step, H\] pairs of integers >= 1 with from_step strictly ascending \(empty: sync_every throughout\); got " + got)
          for bad, got in [([[0, 5]], r"the entry \[0, 5\]"), ([[5, 0]], r"the entry \[5, 0\]"),
                           ([[5]], r"the entry \[5\]"), ([[5, True]], r"the entry \[5, True\]"),
                           ([[5, 2.5]], r"the entry \[5, 2.5\]"), ([5, 3], "the entry 5"), ("5:3", "'5:3'"),
                           ([[5, 3], [5, 4]], "from_step 5 after 5"), ([[9, 3], [5, 4]], "from_step 5 after 9")]],
        ({"method": "diloco", "sync_every": 8, "sync_every_schedule": [[10, 2]], "sync_delay": 2},
         r"lowcomm.sync_delay must be an integer in \[0, 1\] \(a fragment's sync must land before its next one starts, "
         r"at the smallest H of sync_every and sync_every_schedule\); got 2"),
        ({"method": "dct_diloco", "sync_every": 8, "sync_every_schedule": [[10, 2]], "fragments": 3},
         r"lowcomm.fragments must be an integer in \[1, 2\] \(the smallest H of sync_every and sync_every_schedule"),
        # MT-DAO
        ({"method": "mtdao", "momentum_betas": [0.9, 0.99], "momentum_weights": [0.5]},
         r"lowcomm.momentum_weights must be a list with one weight per momentum_betas entry \(2\)"),
        ({"method": "mtdao", "momentum_betas": [0.9, 0.99], "momentum_weights": [0.6, 0.6]},
         r"lowcomm.momentum_weights must sum to at most 1"),
        ({"method": "mtdao", "momentum_betas": [1.0]}, r"lowcomm.momentum_betas\[\] must be a number in \[0.0, 1.0\); got 1.0"),
        ({"method": "mtdao", "momentum_betas": []}, r"lowcomm.momentum_betas must be a non-empty list"),
        ({"method": "mtdao", "momentum_sync_every": [8, 8]}, r"lowcomm.momentum_sync_every must be a list with one period"),
        ({"method": "mtdao", "second_moment_sync_every": 0}, r"lowcomm.second_moment_sync_every must be an integer >= 1"),
        ({"method": "mtdao", "sync_codec": "powersgd"}, r"lowcomm.sync_codec must be one of dense, topk; got 'powersgd'"),
        ({"method": "mtdao", "beta2": 1.0}, r"lowcomm.beta2 must be a number in \[0.0, 1.0\); got 1.0"),
        ({"method": "mtdao", "switch_step": -1}, r"lowcomm.switch_step must be an integer >= 0; got -1"),
        ({"method": "mtdao", "warm_betas": [0.9]}, r"lowcomm.warm_betas must be a list of two numbers"),
        ({"method": "mtdao", "switch_lr_scale": 0}, r"lowcomm.switch_lr_scale must be a number > 0; got 0"),
        ({"method": "mtdao", "outer_optimizer": "adam"}, r"lowcomm.outer_optimizer must be one of none, sgd; got 'adam'"),
        ({"method": "mtdao", "outer_optimizer": "sgd", "sync_codec": "topk"},
         r"lowcomm.outer_optimizer sgd needs sync_codec dense"),
    ],
)
def test_bad_settings(raw, message):
    with pytest.raises(ConfigError, match=message):
        LowcommConfig.from_dict(raw)


def test_apex_inner_optimizer_is_optional():
    pytest.importorskip("torch")
    try:
        import apex.optimizers  # noqa: F401  (NVIDIA apex: only on GPU machines that built it)
    except ImportError:
        from ds_lowcomm.optim import build_optimizer

        with pytest.raises(ConfigError, match="lowcomm.inner_impl is 'apex' but NVIDIA apex is not importable"):
            build_optimizer(LowcommConfig.from_dict({"method": "diloco", "inner_impl": "apex"}),
                            [torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    else:
        pytest.skip("apex installed: the error path does not apply")


def test_negative_lr():
    with pytest.raises(ConfigError, match="lr must be a number > 0; got -0.001"):
        check_lr(-0.001)


def test_method_defaults_and_refused_settings():
    assert LowcommConfig.from_dict({"method": "dct_diloco"}).decay == 0.9
    assert LowcommConfig.from_dict({"method": "demo"}).decay == 0.999
    with pytest.raises(ConfigError, match="sync_every do not apply to method 'demo': remove them"):
        LowcommConfig.from_dict({"method": "demo", "sync_every": 4})  # nothing accepted and ignored
    sl = LowcommConfig.from_dict({"method": "sparseloco"})  # the published recipe
    assert (sl.decay, sl.topk, sl.chunk, sl.value_dtype, sl.transform, sl.outer_lr, sl.sync_every) == \
        (0.95, 64, 64, "2bit", "none", 1.0, 30)
    with pytest.raises(ConfigError, match="outer_momentum do not apply to method 'sparseloco'"):
        LowcommConfig.from_dict({"method": "sparseloco", "outer_momentum": 0.9})
    mt = LowcommConfig.from_dict({"method": "mtdao", "momentum_betas": [0.9, 0.999], "momentum_weights": [0.3, 0.5]})
    assert mt.momentum_betas == (0.9, 0.999) and mt.sync_every == 32 and mt.sync_codec == "dense"


@pytest.mark.parametrize(
    "args,message",
    [
        (["--methods", "adamw,foo"], "--methods: unknown method(s) foo; allowed: adamw, demo, diloco, dct_diloco, sparseloco, mtdao"),
        (["--workers", "0"], "--workers must be >= 1"),
        (["--device", "tpu"], "--device must be one of cpu, cuda; got 'tpu'"),
        (["--backend", "mpi"], "--backend must be one of gloo, nccl; got 'mpi'"),
        (["--backend", "nccl"], "--backend nccl needs --device cuda and one GPU per worker"),
    ],
)
def test_cli_refuses_before_starting_workers(args, message, tmp_path):
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ds_lowcomm.cli", "compare", "--out", str(tmp_path), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert not (tmp_path / "results.csv").exists()
    assert time.perf_counter() - start < 60  # no worker was started (each costs seconds of imports)


def test_cli_refuses_bad_override_file(tmp_path):
    cfg = tmp_path / "over.json"
    cfg.write_text('{"demo": {"lr": -1}}')
    proc = subprocess.run([sys.executable, "-m", "ds_lowcomm.cli", "compare", "--methods", "demo", "--config", str(cfg),
                           "--out", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "demo.lr must be a number > 0; got -1" in proc.stderr
