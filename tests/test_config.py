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
        ({"method": "sgd"}, r"lowcomm.method must be one of adamw, demo, diloco, dct_diloco; got 'sgd'"),
        ({"method": "demo", "decay": 1.0}, r"lowcomm.decay must be a number in \[0.0, 1.0\); got 1.0"),
        ({"method": "demo", "decay": -0.1}, r"lowcomm.decay must be a number in \[0.0, 1.0\)"),
        ({"method": "dct_diloco", "value_dtype": "fp8"}, r"lowcomm.value_dtype must be one of fp32, bf16, fp16, int8"),
        ({"method": "diloco", "outer_lr": -1}, r"lowcomm.outer_lr must be a number > 0"),
        ({"method": "demo", "topK": 3}, r"unknown setting\(s\) topK; allowed: .*topk"),
        ({"method": "demo", "chunk": 2.5}, r"lowcomm.chunk must be an integer >= 1; got 2.5"),
        ({"method": "diloco", "state_dtype": "fp64"}, r"lowcomm.state_dtype must be one of fp32, bf16, fp16"),
        ({"method": "diloco", "inner_impl": "fused"}, r"lowcomm.inner_impl must be one of torch, apex"),
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


def test_method_defaults_and_ignored_settings():
    assert LowcommConfig.from_dict({"method": "dct_diloco"}).decay == 0.9
    assert LowcommConfig.from_dict({"method": "demo"}).decay == 0.999
    with pytest.warns(UserWarning, match="sync_every do not apply to method 'demo'"):
        LowcommConfig.from_dict({"method": "demo", "sync_every": 4})


@pytest.mark.parametrize(
    "args,message",
    [
        (["--methods", "adamw,foo"], "--methods: unknown method(s) foo; allowed: adamw, demo, diloco, dct_diloco"),
        (["--workers", "0"], "--workers must be >= 1"),
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
