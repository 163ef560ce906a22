"""Degenerate inputs get a clear answer (issue 15 item 5): an empty parameter takes no part in a
method's exchange (before: ZeroDivisionError in the codec), the codec names an empty shape, and
``compare --methods ,`` is refused instead of printing an empty table."""

import pytest
import torch

from ds_lowcomm.codec import SparseSpec
from ds_lowcomm.config import ConfigError
from lowcomm_task.workers import run_local_workers

METHODS = {
    "adamw": {"method": "adamw"},
    "demo": {"method": "demo", "topk": 2, "chunk": 4},
    "diloco": {"method": "diloco", "sync_every": 1},
    "dct_diloco": {"method": "dct_diloco", "sync_every": 1, "topk": 2, "chunk": 4},
    "sparseloco": {"method": "sparseloco", "sync_every": 1, "topk": 2, "chunk": 4},
    "mtdao": {"method": "mtdao", "sync_every": 1, "sync_codec": "topk", "topk": 2, "chunk": 4},
}


def _empty_param_worker(rank, world):
    from ds_lowcomm.optim import LowcommConfig, build_optimizer

    out = {}
    for name, section in METHODS.items():
        torch.manual_seed(0)
        weight, empty = torch.nn.Parameter(torch.randn(4, 4)), torch.nn.Parameter(torch.zeros(0))
        opt = build_optimizer(LowcommConfig.from_dict(section), [weight, empty], lr=0.1)
        for _ in range(2):
            weight.grad = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
            empty.grad = torch.zeros(0)
            opt.step()
        out[name] = (weight.detach().clone(), opt.ledger.sent)
    return out


def test_an_empty_parameter_takes_no_part():
    results = run_local_workers(_empty_param_worker, 2)
    for name in METHODS:
        (w0, sent0), (w1, sent1) = results[0][name], results[1][name]
        assert torch.isfinite(w0).all() and sent0 > 0, name
        assert torch.equal(w0, w1), name  # every method here syncs every step: replicas agree


def test_codec_names_an_empty_shape():
    with pytest.raises(ValueError, match=r"cannot code an empty tensor \(shape \(0, 3\)\)"):
        SparseSpec.build((0, 3), chunk=4, topk=2, value_dtype="fp32")


def test_compare_refuses_no_methods():
    from ds_lowcomm.cli import _parser
    from lowcomm_task.compare import run_compare

    with pytest.raises(ConfigError, match="--methods must name at least one of"):
        run_compare(_parser().parse_args(["compare", "--methods", " , "]))
