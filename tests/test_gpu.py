"""The GPU path, where a CUDA device is present (CI has none: these skip there; run them on a
GPU machine with ``pytest tests/test_gpu.py``).

- A payload does not depend on the device that made it: encoded on the GPU, it decodes on the
  CPU to what the GPU sent, and the GPU keeps the components the CPU keeps.
- Every method on CUDA parameters, in 2 real gloo processes (the transport stages its buffers
  through host memory), against the same run on the CPU: same bytes, same loss up to float
  rounding, replicas identical after a sync; bf16 parameters too.
- Resume is exact with the optimizer state on the GPU; NCCL runs the methods (a world of one on a
  single-GPU machine, one GPU per rank where there are more).
"""

import shutil
from dataclasses import replace
from importlib.util import find_spec

import pytest
import torch

from ds_lowcomm.codec import SparseSpec
from lowcomm_task.workers import run_local_workers
from lowcomm_task.train import train_worker

from .test_mpi import check_mpi_equals_torch
from .test_resume import LOWCOMM, STREAMING, TINY

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = [(256, 192), (1000,), (8, 3, 3, 3)]
# One rounding step of each value format, relative to the values (|x| <= about 4 here): a value
# that the CPU and the GPU compute a float-rounding apart may round to neighbouring codes.
VALUE_STEP = {"fp32": 1e-5, "bf16": 2e-2, "fp16": 2e-3, "int8": 4e-2, "2bit": 1.0}
# Top-k of AdamW's parameter changes (mtdao's top-k sync) picks among near-ties (every change is
# about +-lr early on), which float rounding decides differently on each device: the runs diverge.
NEAR_TIES = {"mtdao_topk"}


@pytest.mark.parametrize("transform", ["dct", "none"])
@pytest.mark.parametrize("value_dtype", ["fp32", "bf16", "fp16", "int8", "2bit"])
def test_payload_made_on_gpu_decodes_on_cpu(value_dtype, transform):
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        spec = SparseSpec.build(shape, chunk=16, topk=8, value_dtype=value_dtype, transform=transform)
        x = torch.randn(shape, generator=gen)
        payload_cpu, sent_cpu = spec.compress(x.clone())
        payload_gpu, sent_gpu = spec.compress(x.cuda())
        assert payload_gpu.device.type == "cuda" and payload_gpu.dtype == torch.uint8
        assert payload_gpu.numel() == payload_cpu.numel() == spec.nbytes
        # the GPU's payload, read on the CPU, is what the GPU subtracted as sent
        decoded_on_cpu = spec.decompress_mean(payload_gpu.cpu().unsqueeze(0), "world")
        torch.testing.assert_close(decoded_on_cpu, sent_gpu.cpu(), rtol=1e-5, atol=1e-5)
        # and the GPU kept what the CPU kept, up to one rounding step of the value format
        torch.testing.assert_close(sent_gpu.cpu(), sent_cpu, rtol=0, atol=VALUE_STEP[value_dtype])
        if transform == "none":  # the kept positions themselves, exactly
            assert torch.equal(sent_gpu.cpu() != 0, sent_cpu != 0)


def _run(lowcomm: dict, device: str, dtype: str = "fp32", world: int = 2, backend: str = "gloo", **extra):
    spec = replace(TINY, lowcomm=lowcomm, device=device, dtype=dtype, **extra)
    return run_local_workers(train_worker, world, spec, backend=backend)


@pytest.mark.parametrize("method", list(LOWCOMM))
def test_method_on_gpu_matches_cpu(method):
    cpu, gpu = _run(LOWCOMM[method], "cpu"), _run(LOWCOMM[method], "cuda")
    for c, g in zip(cpu, gpu):
        assert g["bytes_sent"] == c["bytes_sent"] and g["bytes_received"] == c["bytes_received"]
        assert g["ledger"]["steps"] == c["ledger"]["steps"] == TINY.steps
        if method not in NEAR_TIES:
            assert abs(g["final_val_loss"] - c["final_val_loss"]) < 2e-3, (g["final_val_loss"], c["final_val_loss"])
    if method not in STREAMING:  # 9 steps = 3 outer intervals: replicas identical on the GPU too
        assert gpu[0]["params_digest"] == gpu[1]["params_digest"]


@pytest.mark.parametrize("method", ["demo", "dct_diloco", "sparseloco", "mtdao"])
def test_bf16_parameters_on_gpu(method):
    cpu, gpu = _run(LOWCOMM[method], "cpu", "bf16"), _run(LOWCOMM[method], "cuda", "bf16")
    assert gpu[0]["bytes_sent"] == cpu[0]["bytes_sent"]
    assert gpu[0]["params_digest"] == gpu[1]["params_digest"]
    first, last = gpu[0]["history"][0]["val_loss"], gpu[0]["final_val_loss"]
    assert last < first  # it trains
    assert abs(last - cpu[0]["final_val_loss"]) < 0.05  # bf16 rounding differs between the devices


@pytest.mark.parametrize("method", ["demo", "sparseloco", "mtdao_topk", "dct_diloco_streaming"])
def test_resume_is_exact_on_gpu(method, tmp_path):
    full = _run(LOWCOMM[method], "cuda", save_at=5, save_dir=str(tmp_path))
    resumed = _run(LOWCOMM[method], "cuda", resume_from=str(tmp_path))
    for a, b in zip(full, resumed):
        assert a["params_digest"] == b["params_digest"]
        assert a["bytes_sent"] == b["bytes_sent"]
        assert a["final_val_loss"] == b["final_val_loss"]


@pytest.mark.parametrize("method", ["adamw", "demo", "dct_diloco", "sparseloco", "mtdao"])
def test_nccl(method):
    world = min(2, torch.cuda.device_count())  # NCCL takes one GPU per rank
    nccl = _run(LOWCOMM[method], "cuda", world=world, backend="nccl")
    gloo = _run(LOWCOMM[method], "cuda", world=world)
    for n, g in zip(nccl, gloo):
        assert n["bytes_sent"] == g["bytes_sent"]
        assert abs(n["final_val_loss"] - g["final_val_loss"]) < 2e-3
    assert len({r["params_digest"] for r in nccl}) == 1


@pytest.mark.skipif(shutil.which("mpirun") is None or find_spec("mpi4py") is None, reason="needs mpirun and mpi4py")
def test_mpi_transport_with_gpu_tensors_equals_torch(tmp_path):
    check_mpi_equals_torch(2, tmp_path, "cuda")
