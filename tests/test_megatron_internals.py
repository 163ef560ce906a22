"""The supported Megatron-Core versions and every Megatron-Core internal megatron_patches uses
(megatron_patches/internals.py): the declared list against the installed megatron-core and against
real constructed objects, the named error where one is missing or changed, the list against the
package's own code, the version check and its escape, and the supported ranges against
pyproject.toml's pins."""

import ast
import os
import tomllib
import warnings
from pathlib import Path

import pytest

from ds_lowcomm import reflect, versions
from ds_lowcomm.reflect import FrameworkInternalsError
from ds_lowcomm.versions import ALLOW_ENV, SUPPORTED, UnsupportedVersionError

from .internals_scan import own_names

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_patches"


# --- the version check (no megatron needed) ---------------------------------------------------------

def test_supported_ranges_equal_pyproject_pins():
    """The gate's ranges are the pins in pyproject.toml, read here on their own (tomllib): every
    requirement with a version range, extras included; and the gate read them from the installed
    package's metadata (a stale editable install, whose metadata predates a pin, fails here)."""
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins: dict[str, list[SpecifierSet]] = {}
    for line in [*project["dependencies"], *(d for ds in project["optional-dependencies"].values() for d in ds)]:
        req = Requirement(line)
        if req.specifier:
            pins.setdefault(req.name, []).append(req.specifier)
    assert "metadata" in versions.SOURCE, versions.SOURCE
    assert set(SUPPORTED) == set(pins) >= {"deepspeed", "megatron-core", "torchft", "transformers", "accelerate",
                                           "lightning"}
    for name, spec in SUPPORTED.items():
        for pinned in pins[name]:
            assert pinned == SpecifierSet(spec), f"pyproject.toml pins {name}{pinned}; versions.SUPPORTED: {spec}"
        # both bounds, and the version the suite runs on inside them
        assert {s.operator for s in SpecifierSet(spec)} == {">=", "<"}, spec
        installed = versions.installed_version(name)
        if installed is not None:
            assert versions.check_supported(name) == installed
    assert SUPPORTED["megatron-core"] == ">=0.16.1,<0.17"  # as the messages write it: lower bound first


def test_without_metadata_the_source_tree_pins_or_a_clear_refusal(monkeypatch, tmp_path):
    import importlib.metadata

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "requires", not_installed)
    # a source tree on PYTHONPATH: the pyproject.toml beside the package, read the same way
    assert versions.load_supported() == (SUPPORTED, str(ROOT / "pyproject.toml"))
    # neither: nothing is supported, and the check says why instead of passing
    found, why = versions.load_supported(tmp_path / "pyproject.toml")
    assert found == {} and "no ds_lowcomm distribution is installed" in why
    monkeypatch.setattr(versions, "SUPPORTED", found)
    monkeypatch.setattr(versions, "SOURCE", why)
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(UnsupportedVersionError, match=r"cannot tell which megatron-core versions it supports.*"
                                                      r"no ds_lowcomm distribution is installed.*pip install -e"):
        versions.check_supported("megatron-core", installed="0.16.1")
    monkeypatch.setenv(ALLOW_ENV, "1")
    monkeypatch.setattr(versions, "_warned", set())
    with pytest.warns(RuntimeWarning, match="cannot tell which megatron-core versions.*going on"):
        assert versions.check_supported("megatron-core", installed="0.16.1") == "0.16.1"


@pytest.mark.parametrize("installed", ["0.17.0", "0.16.0", "1.0.0rc1"])
def test_a_version_outside_the_range_is_refused_naming_both(installed, monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    with pytest.raises(UnsupportedVersionError) as err:
        versions.check_supported("megatron-core", installed=installed)
    assert f"megatron-core {installed} is installed" in str(err.value)
    assert "megatron-core>=0.16.1,<0.17" in str(err.value) and ALLOW_ENV in str(err.value)


def test_versions_inside_the_range_and_the_escape(monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    assert versions.check_supported("megatron-core", installed="0.16.1") == "0.16.1"
    assert versions.check_supported("megatron-core", installed="0.16.9+local") == "0.16.9+local"
    monkeypatch.setenv(ALLOW_ENV, "1")
    monkeypatch.setattr(versions, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"megatron-core 0\.17\.0 is installed.*>=0\.16\.1,<0\.17.*going on"):
        assert versions.check_supported("megatron-core", installed="0.17.0") == "0.17.0"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        versions.check_supported("megatron-core", installed="0.17.0")


def test_apply_checks_the_version_before_anything(monkeypatch):
    # apply(None, None, ...) would fail on its first look at the model: the check comes first.
    from megatron_patches import apply

    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr(versions, "installed_version", lambda name: "0.17.1" if name == "megatron-core" else None)
    with pytest.raises(UnsupportedVersionError, match=r"megatron-core 0\.17\.1 is installed.*>=0\.16\.1,<0\.17"):
        apply(None, None, {"method": "diloco"})


# --- the declared list against megatron_patches' own code (no megatron needed) ----------------------

def _trees():
    return {path.name: ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.glob("*.py"))}


def test_every_megatron_internal_goes_through_internals_py():
    """Outside internals.py: megatron is imported only for parallel_state (public functions), no
    private name of anyone but megatron_patches' own is read, and no attribute is probed with a
    default (getattr(x, name, default) / hasattr), so a renamed internal cannot go unnoticed. Every
    declared item is used."""
    trees = _trees()
    own = own_names(sorted(PACKAGE.glob("*.py")))  # names megatron_patches defines itself
    bad, used = [], set()
    for name, tree in trees.items():
        if name == "internals.py":
            continue
        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
                if node.module != "megatron.core" or [a.name for a in node.names] != ["parallel_state"]:
                    bad.append(f"{where}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("megatron") for a in node.names):
                if any(a.name != "megatron_patches.cpu_shim" for a in node.names):
                    bad.append(f"{where}: import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Attribute):
                if node.attr.startswith("_") and not node.attr.startswith("__") and node.attr not in own:
                    bad.append(f"{where}: .{node.attr}")
                if isinstance(node.value, ast.Name) and node.value.id == "mi":
                    used.add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                probes = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
                # args.py reads argparse namespaces, not Megatron's objects
                if probes and not (name == "args.py" and ast.unparse(node.args[0]) == "args"):
                    bad.append(f"{where}: {ast.unparse(node)}")
    assert not bad, "Megatron internals reached around megatron_patches/internals.py:\n" + "\n".join(bad)

    from megatron_patches import internals as mi

    declared = {name for name, value in vars(mi).items() if isinstance(value, reflect.Internal)}
    fields_read = {n.attr for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.Attribute)}
    unused = [name for name in declared if name not in used
              and not (getattr(mi, name).kind == "field" and getattr(mi, name).attr in fields_read)]
    assert not unused, f"declared in internals.py but not used: {unused}"
    assert len(mi.ITEMS) == len(declared)


# --- the declared list against the installed megatron-core and live objects ------------------------

def _other_communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                       wait_on_reqs=True, extra=None):
    return None


def _start_grad_sync_without_buckets(self, *unused):
    return None


def _worker(rank, world):
    from megatron_patches import cpu_shim
    cpu_shim.install()  # before megatron (a no-op with a GPU)
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ds_lowcomm.settings import ConfigError
    from megatron_patches import apply
    from megatron_patches import internals as mi
    from megatron_patches.grad_sync import BucketGroupSync
    from megatron_patches.wrapper import chained

    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    out = {"problems": mi.problems()}

    def build(bf16):
        torch.manual_seed(0)
        dtype = torch.bfloat16 if bf16 else torch.float32
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                                   params_dtype=dtype, pipeline_dtype=dtype, bf16=bf16)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32,
                         max_sequence_length=8)
        if bf16:
            model = Float16Module(config, model)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=bf16), model)
        return model, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, bf16=bf16), [model])

    def error(fn, *args):
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001  (the test reads the type and the message)
            return f"{type(err).__name__}: {err}"
        return None

    # Every instance attribute declared, read from a real object of its class.
    fp32_model, fp32_opt = build(bf16=False)
    bf16_model, bf16_opt = build(bf16=True)
    group = mi.get(fp32_model, mi.DDP_BUCKET_GROUPS)[0]
    bucket = mi.get(group, mi.GROUP_BUCKETS)[0]
    chained_opt = mi.live(mi.CHAINED_OPTIMIZER)(chained(fp32_opt))
    communicator = mi.live(mi.SCHEDULES_P2P)(pp_group=ps.get_pipeline_model_parallel_group(), config=fp32_model.config)
    owners = {"DistributedDataParallel": fp32_model, "_ParamAndGradBucketGroup": group, "_ParamAndGradBucket": bucket,
              "_ParamAndGradBuffer": mi.get(bucket, mi.BUCKET_PARAMS_LIST)[0],  # main_grad: set on its params
              "MegatronModule": fp32_model, "MegatronOptimizer": chained(fp32_opt)[0],
              "Float16OptimizerWithFloat16Params": chained(bf16_opt)[0], "ChainedOptimizer": chained_opt,
              "P2PCommunicator": communicator}
    out["instances_read"] = []
    for item in mi.ITEMS:
        if item.kind == "instance":
            mi.get(owners[item.owner], item)  # raises naming it where it is missing
            out["instances_read"].append(item.name)
    out["optimizer_kinds"] = [type(o).__name__ for o in chained(fp32_opt) + chained(bf16_opt)]

    # (a) The bf16 model copy after a sync, gone: apply refuses before patching anything (it used
    # to skip the copy silently, leaving the model on its old weights).
    with pytest.MonkeyPatch.context() as mp:
        mp.delattr(mi.live(mi.FLOAT16_OPTIMIZER), "_copy_main_params_to_model_params")
        mp.setattr(mi._INTERNALS, "checked", False)
        out["copy_removed"] = error(apply, [bf16_model], bf16_opt, {"method": "diloco", "sync_every": 2})
        out["patched_after_refusal"] = [name for g in mi.get(bf16_model, mi.DDP_BUCKET_GROUPS)
                                        for name in ("start_grad_sync", "finish_grad_sync") if name in vars(g)]
    # (b) A changed signature of a method megatron_patches overrides.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mi.live(mi.SCHEDULES_P2P), "_communicate", _other_communicate)
        out["signature_changed"] = mi.problems()
    # (c) A replaced method that Megatron no longer calls by its name.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DistributedDataParallel, "start_grad_sync", _start_grad_sync_without_buckets)
        out["not_looked_up"] = mi.problems()
    # (d) An instance attribute missing on the live object, where megatron_patches reads it.
    with pytest.MonkeyPatch.context() as mp:
        mp.delattr(group, "buckets")
        out["instance_missing"] = error(BucketGroupSync, group, None)
    # (e) An optimizer of no supported type: refused by type, not probed.
    out["unknown_optimizer"] = error(apply, [fp32_model], object(), {"method": "diloco"})
    out["checked_after"] = error(mi.ensure_checked)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the 'megatron' extra)")
    import os

    from lowcomm_task.workers import run_local_workers

    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path on every machine
    try:
        return run_local_workers(_worker, 1, threads=1)[0]
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden


def test_every_declared_internal_is_in_the_installed_megatron_core(results):
    from megatron_patches import internals as mi

    assert results["problems"] == []
    assert results["checked_after"] is None
    instances = sorted(item.name for item in mi.ITEMS if item.kind == "instance")
    assert sorted(results["instances_read"]) == instances and len(instances) >= 15
    assert results["optimizer_kinds"] == ["FP32Optimizer", "Float16OptimizerWithFloat16Params"]


def test_a_missing_method_stops_apply_naming_it_and_the_versions(results):
    message = results["copy_removed"]
    assert message.startswith("FrameworkInternalsError: megatron-core 0.16.1: method "
                              "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params."
                              "_copy_main_params_to_model_params"), message
    assert "is missing" in message and "megatron-core>=0.16.1,<0.17" in message
    assert results["patched_after_refusal"] == []


def test_a_changed_signature_or_lookup_is_named(results):
    changed = [p for p in results["signature_changed"] if "P2PCommunicator._communicate" in p]
    assert any("now takes (tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape, wait_on_reqs, "
               "extra)" in p for p in changed), results["signature_changed"]
    assert all("megatron-core>=0.16.1,<0.17" in p for p in changed)
    assert any("_ParamAndGradBucketGroup.start_grad_sync" in p and "is no longer read by megatron.core.distributed."
               "distributed_data_parallel.DistributedDataParallel.start_grad_sync" in p
               for p in results["not_looked_up"]), results["not_looked_up"]


def test_a_missing_instance_attribute_is_named_where_it_is_read(results):
    assert results["instance_missing"] == (
        f"FrameworkInternalsError: megatron-core 0.16.1: instance megatron.core.distributed.param_and_grad_buffer."
        f"_ParamAndGradBucketGroup.buckets (ds_lowcomm reads the buckets of a bucket group) is missing on a "
        f"_ParamAndGradBucketGroup; ds_lowcomm supports megatron-core{SUPPORTED['megatron-core']}, where it is as "
        f"declared: install a supported version (pip install 'megatron-core{SUPPORTED['megatron-core']}')")
    assert FrameworkInternalsError.__name__ in results["instance_missing"]


def test_an_unsupported_optimizer_type_is_refused(results):
    message = results["unknown_optimizer"]
    assert message.startswith("ConfigError: object is not supported by ds_lowcomm yet"), message
    assert "Float16OptimizerWithFloat16Params, FP32Optimizer" in message


_SHIM_PROBE = r"""
import json, logging, sys, torch
import ds_lowcomm, megatron_patches, megatron_patches.install, megatron_patches.checkpoint  # the normal path
out = {"imported_by_package": "megatron_patches.cpu_shim" in sys.modules}
from megatron_patches import cpu_shim
out["active_after_import"] = cpu_shim.is_installed() or torch.cuda.current_device.__module__ == cpu_shim.__name__
names = [(torch.cuda, n) for n in ("current_device", "synchronize", "get_rng_state", "set_rng_state", "manual_seed",
                                   "manual_seed_all")]
names += [(torch.cuda.random, n) for n in ("get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all")]
names += [(torch.Tensor, "cuda"), (torch.Tensor, "type")]
before = [getattr(o, n) for o, n in names]
tensor_dict = set(torch.Tensor.__dict__)
from megatron.core.tensor_parallel import random as mrandom
set_state = mrandom._set_cuda_rng_state
filters = list(logging.getLogger("megatron.core.tensor_parallel.random").filters)
with cpu_shim.installed() as active:
    out["active"] = active
    out["device"] = str(torch.zeros(1, device="cuda").device)
    out["type"] = torch.zeros(1).type()
    # Megatron's RNG tracker: a fork draws from its own stream, and its states restore exactly
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.add("model-parallel-rng", 1234)  # as model_parallel_cuda_manual_seed does for TP rank 0
    saved = {k: v.clone() for k, v in tracker.get_states().items()}
    outside = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(4)
    out["cpu_state_kept"] = bool(torch.equal(outside, torch.get_rng_state()))
    with tracker.fork():
        second = torch.rand(4)
    tracker.set_states(saved)
    with tracker.fork():
        again = torch.rand(4)
    out["stream_advances"] = not torch.equal(first, second)
    out["restored_exactly"] = bool(torch.equal(first, again))
out["restored"] = all(getattr(o, n) is b for (o, n), b in zip(names, before))
out["tensor_dict_same"] = set(torch.Tensor.__dict__) == tensor_dict
out["mode_stack"] = torch._C._len_torch_function_stack()
out["megatron_setter_back"] = mrandom._set_cuda_rng_state is set_state
out["filters_back"] = list(logging.getLogger("megatron.core.tensor_parallel.random").filters) == filters
out["device_after"] = str(torch.zeros(1, device="cpu").device)
print(json.dumps(out))
"""


def test_cpu_shim_is_opt_in_scoped_and_leaves_torch_as_it_found_it():
    """Nothing of the package's normal path imports the shim, importing it changes nothing;
    installed, Megatron's RNG tracker works as on a GPU (forks draw from their own stream, the
    CPU generator outside is untouched, saved states restore the same draws); uninstalled, every
    replaced torch and Megatron attribute is the original object again and no mode is left."""
    import json
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _SHIM_PROBE], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[1], env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out == {"imported_by_package": False, "active_after_import": False, "active": True, "device": "cpu",
                   "type": "torch.cuda.FloatTensor", "cpu_state_kept": True, "stream_advances": True,
                   "restored_exactly": True, "restored": True, "tensor_dict_same": True, "mode_stack": 0,
                   "megatron_setter_back": True, "filters_back": True, "device_after": "cpu"}
