"""Every key of the ``"lowcomm"`` section on every road of ours, honoured or refused by name:
DeepSpeed with an Adam/AdamW section, DeepSpeed with DeepSpeed's Muon section (at ZeRO 0 and 2),
and plain torch (``LowcommConfig.from_dict`` then ``build_optimizer``, on a real one-rank gloo
group). Honoured: its value reaches the method's settings, the run's first log line
(``describe_settings``, DeepSpeed) and the built optimizer (plain torch), and nothing there
declares it unused (``Settings.unused_keys``). Refused: a ``ConfigError`` naming the key, before
any rank communicates. Nothing is accepted and ignored. (Megatron-Core's road: test_megatron_keys.py.)"""

import torch
import pytest

from ds_lowcomm.optim import METHODS, LowcommConfig, build_optimizer, model_param_groups
from ds_lowcomm.optim.registry import METHOD_CLASSES, _all_keys
from ds_lowcomm.settings import ConfigError

# a valid value other than the default for every key (candidates in turn: the first that differs
# from the method's default is walked)
SAMPLE = {
    "state_dtype": ("bf16",), "decay": (0.5,), "topk": (8,), "chunk": (16,), "value_dtype": ("bf16", "fp32"),
    "transform": ("none", "dct"), "average": ("world", "senders"), "compile": (True,), "overlap": (True,),
    "update": ("adam",), "mean_momentum": (0.5,), "keep_sent": (0.5,), "beta2": (0.99,), "eps": (1e-6,),
    "sync_every": (8,), "outer_lr": (0.5,), "outer_optimizer": ("adam", "sgd"), "outer_betas": ((0.8, 0.9),),
    "outer_eps": (1e-7,), "outer_weight_decay": (0.1,), "inner_impl": ("apex",), "inner_optimizer": ("muon",),
    "inner_muon_lr": (0.05,), "inner_muon_momentum": (0.9,), "fragments": (2,), "sync_delay": (1,),
    "fragment_mix": (0.5,), "carry_local_steps": (True,), "sync_every_schedule": (((4, 8),),),
    "outer_momentum": (0.5,), "nesterov": (False,),
    "momentum_betas": ((0.99,),), "momentum_weights": ((0.5,),), "momentum_sync_every": ((3,),),
    "second_moment_sync_every": (4,), "sync_codec": ("topk",), "switch_step": (3,), "warm_betas": ((0.8, 0.99),),
    "switch_lr_scale": (0.5,), "rank_fraction": (0.5,), "mu": (0.9,), "matrix_lr": (0.02,), "epsilon": (1e-7,),
    "transport": ("mpi",), "replica_size": (2,), "timeout_s": (60.0,), "nonfinite": ("raise",),
    "exchange": ("all_gather",),
}
# the settings under which a key that is refused alone (nothing reads it at the defaults) is read
ACTIVE_WITH = {
    "beta2": {"update": "adam"}, "eps": {"update": "adam"},  # demo's update adam (mtdao reads its beta2 always)
    "outer_betas": {"outer_optimizer": "adam"}, "outer_eps": {"outer_optimizer": "adam"},
    "inner_muon_lr": {"inner_optimizer": "muon"}, "inner_muon_momentum": {"inner_optimizer": "muon"},
    "carry_local_steps": {"sync_delay": 1},
    "warm_betas": {"switch_step": 3},
    # mtdao: its outer SGD's, its codec's
    "outer_lr": {"outer_optimizer": "sgd"}, "outer_momentum": {"outer_optimizer": "sgd"},
    "nesterov": {"outer_optimizer": "sgd"},
    **{k: {"sync_codec": "topk"} for k in ("topk", "chunk", "value_dtype", "transform", "average", "compile")},
}
ADAMW = {"type": "AdamW", "params": {"lr": 1e-3}}
MUON = {"type": "Muon", "params": {"lr": 0.02}}


def _names_key(err: ConfigError, key: str) -> bool:
    text = str(err)
    return f"lowcomm.{key}" in text or key in text.split(";")[0]


def _deepspeed_road(optimizer, stage):
    def parse(section):
        from ds_lowcomm.deepspeed.config import split_config
        from ds_lowcomm.deepspeed.engine import describe_settings

        split = split_config({"train_micro_batch_size_per_gpu": 2, "optimizer": optimizer,
                              "zero_optimization": {"stage": stage}, "lowcomm": section})
        # the first log line, with the lowcomm settings every rank agreed on (as initialize logs it)
        line = describe_settings(split, {f"lowcomm.{k}": v for k, v in split.lowcomm.effective().items()})
        return split.lowcomm, line, None
    return parse


def _torch_road(section):
    cfg = LowcommConfig.from_dict(section)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    opt = build_optimizer(cfg, model_param_groups(cfg, model, model.parameters()), lr=1e-3)
    return cfg, None, opt


ROADS = {"deepspeed_adamw_z0": _deepspeed_road(ADAMW, 0), "deepspeed_adamw_z2": _deepspeed_road(ADAMW, 2),
         "deepspeed_muon_z0": _deepspeed_road(MUON, 0), "deepspeed_muon_z2": _deepspeed_road(MUON, 2),
         "torch": _torch_road}


def _honoured(method, key, value, built, context):
    """The key's value reached what runs; nothing declares it unused."""
    cfg, line, opt = built
    effective = cfg.effective()
    defaults = {"method": method, **cfg.comm.__class__().flat(), **METHOD_CLASSES[method].settings_class().flat()}
    assert effective == {**defaults, **context, key: value}, (method, key)
    assert key not in {k for k in cfg.settings.unused_keys() if k in (key,)}, (method, key)
    if line is not None:
        assert f"lowcomm.{key}={value}" in line, (method, key, line)
    if opt is not None:
        held = {**opt.transport.__dict__, **opt.settings.flat()}  # the method's settings, the transport's
        assert held.get(key, effective[key]) == value, (method, key)
        if key in ("timeout_s", "nonfinite"):
            assert getattr(opt.transport, key) == value, (method, key)


def _walk(road, parse):
    outcomes = {}
    for method in METHODS:
        try:
            parse({"method": method})
        except ConfigError as err:  # the whole road refuses the method (dion at ZeRO 2, mtdao beside Muon)
            assert "lowcomm.method" in str(err), (road, method, err)
            outcomes[(method, "method")] = "refused"
            continue
        for key in _all_keys():
            if key == "method":
                continue
            for context in ({}, ACTIVE_WITH.get(key)):
                if context is None or not set(context) <= set(parse({"method": method})[0].effective()):
                    break
                outcome = None
                for value in SAMPLE[key]:
                    section = {"method": method, **context, key: value}
                    try:
                        built = parse(section)
                    except ConfigError as err:
                        assert any(_names_key(err, k) for k in (key, *context)), (road, method, key, str(err))
                        outcome = "refused"
                        continue
                    if built[0].effective()[key] == value and value != _default(method, key):
                        _honoured(method, key, value, built, context)
                        outcome = "honoured"
                        break
                outcomes[(method, key) + ((tuple(context),) if context else ())] = outcome
                if outcome == "honoured":
                    break
            assert outcomes.get((method, key)) or outcomes.get((method, key, tuple(ACTIVE_WITH.get(key, ())))), \
                (road, method, key)
    return outcomes


def _default(method, key):
    return {**LowcommConfig.from_dict({"method": method}).effective()}.get(key)


@pytest.mark.parametrize("road", list(ROADS))
def test_every_key_is_honoured_or_refused_by_name(road, one_rank_group):
    outcomes = _walk(road, ROADS[road])
    assert set(SAMPLE) == set(_all_keys()) - {"method"}, "a key without a sample value"
    honoured = sum(v == "honoured" for v in outcomes.values())
    refused = sum(v == "refused" for v in outcomes.values())
    assert honoured > 40 and refused > 100, (road, honoured, refused)
    # the keys that were accepted and ignored before (issue 54), refused alone and honoured where read
    expect = {("demo", "sync_every"): "refused", ("diloco", "topk"): "refused", ("demo", "beta2"): "refused",
              ("demo", "beta2", ("update",)): "honoured", ("diloco", "outer_betas"): "refused",
              ("diloco", "outer_betas", ("outer_optimizer",)): "honoured", ("mtdao", "topk"): "refused",
              ("mtdao", "topk", ("sync_codec",)): "honoured", ("mtdao", "warm_betas"): "refused",
              ("mtdao", "outer_lr"): "refused", ("diloco", "inner_muon_lr"): "refused"}
    if road.startswith("deepspeed_muon"):  # beside a Muon section: DeepSpeed's Muon is the inner optimizer
        expect.update({("diloco", "inner_optimizer"): "refused", ("diloco", "inner_impl"): "refused",
                       ("diloco", "inner_muon_lr", ("inner_optimizer",)): None, ("mtdao", "method"): "refused",
                       ("dion", "method"): "refused", ("adamw", "method"): "refused"})
        expect = {k: v for k, v in expect.items() if k[0] not in ("mtdao",) or k[1] == "method"}
        # demo beside Muon: each half's rule is the section's (Muon's, sign's), not lowcomm.update
        expect.update({("demo", "update"): "refused", ("demo", "beta2", ("update",)): "refused"})
    elif road == "torch":  # no transport given: torch.distributed's default group, each rank a replica
        expect.update({("diloco", "transport"): "refused", ("diloco", "replica_size"): "refused",
                       ("diloco", "timeout_s"): "honoured", ("diloco", "inner_muon_lr", ("inner_optimizer",)): "honoured"})
    else:
        expect.update({("diloco", "transport"): "honoured", ("diloco", "replica_size"): "honoured"})
    for k, v in expect.items():
        if v is not None:
            assert outcomes.get(k) == v, (road, k, outcomes.get(k))
