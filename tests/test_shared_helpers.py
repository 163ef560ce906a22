"""Helpers the layers share, defined once: the parameters' digest, the wording of a settings
difference, the outer-loop methods. Checked against plain computations and the hand lists they
replaced, so digests and messages compared across runs and ranks keep their values."""

import hashlib

import torch

from ds_lowcomm.checkpoint_io import params_digest
from ds_lowcomm.comm.consistency import settings_differences


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2)).to(dtype)


def test_params_digest_is_sha256_of_the_stored_bytes():
    model = _model()
    # the value the tests and the training loop computed before (fp32 bytes, parameters in order)
    plain = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    assert params_digest(model) == plain
    assert params_digest(list(model.parameters())) == plain  # the tensors themselves
    assert params_digest([model[0], model[1]]) == plain  # a model's chunks, in order

    half = _model(torch.bfloat16)  # no numpy dtype: its raw 2-byte words
    words = b"".join(p.detach().view(torch.int16).numpy().tobytes() for p in half.parameters())
    assert params_digest(half) == hashlib.sha256(words).hexdigest()

    with torch.no_grad():  # one ulp anywhere changes it
        model[1].bias[0] = torch.nextafter(model[1].bias[0], torch.tensor(1.0))
    assert params_digest(model) != plain


def test_settings_differences_names_each_field_and_both_values():
    a = {"method": "demo", "topk": 4, "chunk": 64}
    b = {"method": "demo", "topk": 2, "sync_every": 3}
    assert settings_differences(a, b, "rank 0 has", "rank 1 has") == (
        "chunk: rank 0 has 64, rank 1 has None; sync_every: rank 0 has None, rank 1 has 3; "
        "topk: rank 0 has 4, rank 1 has 2")
    assert settings_differences(a, dict(a), "saved", "now") == ""


def test_outer_methods_defined_once():
    from ds_lowcomm.deepspeed import hetero
    from ds_lowcomm.optim import registry

    assert registry.OUTER_METHODS == ("diloco", "dct_diloco", "sparseloco")  # the hand list it replaced
    assert hetero.OUTER_METHODS is registry.OUTER_METHODS
