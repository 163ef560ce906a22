"""The methods by name; the ``"lowcomm"`` section that picks one (:class:`LowcommConfig`); and
``build_optimizer``, the optimizer it names.

The section is flat (``{"method": "sparseloco", "topk": 256, "sync_every": 20}``), as users write
it in a DeepSpeed JSON, a YAML file or on the command line; :meth:`LowcommConfig.from_dict` sorts
its keys into the method's settings object (``settings``, e.g. :class:`~.outer.SparseLoCoSettings`,
whose defaults are the method's own) and the backend's (``comm``: transport, replica_size).
Every error names the field and what it accepts, and is raised before any rank starts work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from ..comm import ReplicaShard, TorchDistTransport, Transport
from ..comm.settings import CommSettings
from ..comm.wire import WirePlan
from ..settings import ConfigError, Settings, check_choice
from .adamw import AdamSettings, AllReduceAdamW
from .base import LowcommOptimizer
from .demo import DeMo, DeMoSettings, muon_param_groups
from .dion import Dion
from .mtdao import MTDAO
from .muon import MuonWithAdamW, split_muon_params, split_told_params
from .outer import DCTDiLoCo, DiLoCo, OuterLoop, SparseLoCo

# name -> class; each class names its settings class (``settings_class``).
METHOD_CLASSES: dict[str, type[LowcommOptimizer]] = {
    cls.method: cls for cls in (AllReduceAdamW, DeMo, DiLoCo, DCTDiLoCo, SparseLoCo, MTDAO, Dion)
}
METHODS = tuple(METHOD_CLASSES)
# The methods with inner steps between syncs (an outer loop): derived, so a new one joins by its class.
OUTER_METHODS = tuple(name for name, cls in METHOD_CLASSES.items() if issubclass(cls, OuterLoop))
DEFAULT_METHOD = "demo"


def _all_keys() -> tuple[str, ...]:
    keys = ["method", *CommSettings.flat_keys()]
    for cls in METHOD_CLASSES.values():
        keys += [k for k in cls.settings_class.flat_keys() if k not in keys]
    return tuple(keys)


@dataclass(frozen=True)
class LowcommConfig:
    method: str = DEFAULT_METHOD
    settings: Settings = field(default_factory=DeMoSettings)  # the method's own (its class's settings_class)
    comm: CommSettings = field(default_factory=CommSettings)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None, *, where: str = "lowcomm") -> "LowcommConfig":
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(f"{where} must be a mapping of settings such as {{\"method\": \"demo\"}}; got {raw!r}")
        raw = dict(raw or {})
        known = _all_keys()
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"{where}: unknown setting(s) {', '.join(unknown)}; allowed: {', '.join(sorted(known))}")
        method = raw.get("method", DEFAULT_METHOD)
        check_choice(where, "method", method, METHODS)
        settings_class = METHOD_CLASSES[method].settings_class
        applies = {"method", *CommSettings.flat_keys(), *settings_class.flat_keys()}
        foreign = [k for k in raw if k not in applies]
        if foreign:  # nothing accepted and ignored
            raise ConfigError(f"{where}: setting(s) {', '.join(foreign)} do not apply to method {method!r}: remove "
                              f"them; its settings: {', '.join([*settings_class.flat_keys(), *CommSettings.flat_keys()])}")
        settings = settings_class.from_flat(raw, where=where)
        # a key nothing reads at the other settings, given a value of its own (its default, as
        # effective() writes it out, changes nothing either way)
        chosen, defaults = settings.flat(), settings_class().flat()
        for key, why in settings.unused_keys().items():
            if key in raw and chosen[key] != defaults[key]:
                raise ConfigError(f"{where}.{key}: {why}; leave it out")
        return cls(method, settings, CommSettings.from_flat(raw, where=where))

    def validate(self, where: str = "lowcomm") -> None:
        check_choice(where, "method", self.method, METHODS)
        expected = METHOD_CLASSES[self.method].settings_class
        if type(self.settings) is not expected:
            raise ConfigError(f"{where}: method {self.method!r} takes {expected.__name__}; got "
                              f"{type(self.settings).__name__}")
        self.settings.validate(where)
        self.comm.validate(where)

    def effective(self) -> dict[str, Any]:
        """The flat settings the chosen method uses (compared across ranks, written to results)."""
        return {"method": self.method, **self.comm.flat(), **self.settings.flat()}

    def __getattr__(self, name: str) -> Any:
        # The section's flat keys read as attributes (cfg.topk, cfg.sync_every) where they apply.
        if name.startswith("_") or name in ("method", "settings", "comm"):
            raise AttributeError(name)
        flat = self.effective()
        if name in flat:
            return flat[name]
        raise AttributeError(f"{name!r} is not a setting of method {self.method!r}")


def _config(cfg: "LowcommConfig | dict") -> LowcommConfig:
    return cfg if isinstance(cfg, LowcommConfig) else LowcommConfig.from_dict(cfg, where="plan")


def planned_wire(cfg: "LowcommConfig | dict", shapes, *, matrices=None, replicas: int = 2, grad_bytes: int = 4,
                 param_bytes: int = 4) -> WirePlan:
    """What ``cfg``'s method puts on the wire for tensors of ``shapes`` among ``replicas`` workers,
    as its class declares it (:meth:`LowcommOptimizer.planned_wire`)."""
    cfg = _config(cfg)
    return METHOD_CLASSES[cfg.method].planned_wire(cfg.settings, shapes, matrices=matrices, replicas=replicas,
                                                   grad_bytes=grad_bytes, param_bytes=param_bytes)


def planned_state_bytes(cfg: "LowcommConfig | dict", shapes, *, matrices=None, param_bytes: int = 4,
                        local_optimizer: str | None = None) -> float:
    """The bytes of state ``cfg``'s method holds for tensors of ``shapes``, as its class declares it."""
    cfg = _config(cfg)
    return METHOD_CLASSES[cfg.method].planned_state_bytes(cfg.settings, shapes, matrices=matrices,
                                                          param_bytes=param_bytes, local_optimizer=local_optimizer)


def planned_ledger(cfg: "LowcommConfig | dict", shapes, steps: int, *, matrices=None,
                   replicas: int = 2) -> dict[str, tuple[int, int]]:
    """What a run of ``steps`` steps of ``cfg``'s method records in its ledger per op (start-up
    left out): (calls, bytes sent), by its declared wire plan."""
    return planned_wire(cfg, shapes, matrices=matrices, replicas=replicas).ledger(steps)


def local_optimizer(cfg: "LowcommConfig | dict", given: str | None = None) -> str | None:
    """The dense optimizer of ``cfg``'s local steps ("adamw", "muon"; None: the method's own update)."""
    cfg = _config(cfg)
    return METHOD_CLASSES[cfg.method].local_optimizer(cfg.settings, given)


def _apex_fused_adamw(params, adam: AdamSettings):
    try:
        from apex.optimizers import FusedAdam  # NVIDIA apex, built from source on GPU machines
    except ImportError:
        raise ConfigError("lowcomm.inner_impl is 'apex' but NVIDIA apex is not importable here; "
                          "allowed: torch, apex (apex only where it is installed)") from None
    return FusedAdam(params, adam_w_mode=True, **adam.torch_kwargs())


def _muon_and_adamw(cfg: LowcommConfig) -> bool:
    """dion, or an outer loop with ``inner_optimizer`` "muon": Muon's step on some parameters, AdamW's on the rest."""
    return cfg.method == "dion" or (cfg.method in OUTER_METHODS and cfg.settings.inner_optimizer == "muon")


def takes_muon_decision(cfg: LowcommConfig) -> bool:
    """Whether ``cfg``'s method orthogonalises some parameters' steps (demo's update "muon", dion,
    an outer loop's inner Muon), and so needs the one decision of which (``takes_muon_step``)."""
    return (cfg.method == "demo" and cfg.settings.update == "muon") or _muon_and_adamw(cfg)


def model_param_groups(cfg: LowcommConfig, model: torch.nn.Module, params: Iterable) -> Iterable:
    """What :func:`build_optimizer` takes for ``model``'s ``params``: the params as they are, or for
    demo's update "muon" the model's parameters split as Muon is run (:func:`muon_param_groups`:
    the embeddings by sign), or for dion and an outer loop's ``inner_optimizer`` "muon" two groups marked
    ``use_muon`` True (Muon's) and False (AdamW's), by :func:`ds_lowcomm.optim.muon.split_muon_params`.
    The one place that decides it, for the plain loop and DeepSpeed alike."""
    if cfg.method == "demo" and cfg.settings.update == "muon":
        return muon_param_groups(model)
    if _muon_and_adamw(cfg):
        muon, other = split_muon_params(model, params)
        return [g for g in ({"params": muon, "use_muon": True}, {"params": other, "use_muon": False}) if g["params"]]
    return params


def _muon_inner(params: Iterable, adam: AdamSettings, settings) -> MuonWithAdamW:
    """An outer loop's inner optimizer for ``inner_optimizer`` "muon": torch's Muon (Nesterov, at
    ``inner_muon_lr`` and ``inner_muon_momentum``, AdamW's weight decay) on the parameters that
    take Muon's step (:func:`~ds_lowcomm.optim.muon.split_told_params`), AdamW (``adam``) on the others."""
    muon, other = split_told_params(params, "lowcomm.inner_optimizer is 'muon'")
    return MuonWithAdamW(muon, other, adamw=adam.torch_kwargs(),
                         muon={"lr": settings.inner_muon_lr, "momentum": settings.inner_muon_momentum,
                               "nesterov": True, "weight_decay": adam.weight_decay})


def build_optimizer(
    cfg: LowcommConfig,
    params: Iterable,
    *,
    lr: float,
    transport: Transport | None = None,
    shard: ReplicaShard | None = None,
    ledger_steps: bool = True,
    inner_factory: Callable[[Iterable], torch.optim.Optimizer] | None = None,
    inner_factory_honours: tuple[str, ...] = ("adamw",),
    clip_grad: float = 0.0,
    **adam,
) -> LowcommOptimizer:
    """The optimizer for ``cfg.method``. ``lr`` and ``adam`` (betas, eps, weight_decay; see
    :class:`AdamSettings` for their defaults) are the per-step optimizer's (AdamW's, DeMo's;
    MT-DAO takes its beta2 from ``betas[1]`` unless its settings name one, its first moments from
    its settings) or, for outer-loop methods, the inner AdamW's (with ``inner_optimizer`` "muon", the
    AdamW beside Muon; ``params`` then as :func:`model_param_groups` gives them), unless
    ``inner_factory(params)`` builds another inner optimizer (``inner_factory_honours``: the
    ``inner_optimizer`` values it builds as named, e.g. Megatron's Adam swapped for Muon; any other
    is refused). ``transport``, ``shard``,
    ``ledger_steps`` and ``clip_grad``: see :class:`LowcommOptimizer`;
    without ``transport``, torch.distributed's default group. ``cfg.comm.timeout_s`` bounds every
    collective of the transport and of the shard's, the start-up check included."""
    cfg.validate()
    if transport is None and cfg.comm.transport != "torch":  # the default below is torch.distributed's
        raise ConfigError(f"lowcomm.transport {cfg.comm.transport!r}: build_optimizer was given no transport; pass "
                          "transport=ds_lowcomm.comm.build_transport(cfg.comm.transport, ...)")
    if transport is None and shard is None and cfg.comm.replica_size > 1:
        raise ConfigError(f"lowcomm.replica_size {cfg.comm.replica_size}: build_optimizer was given no transport or "
                          "shard, so every rank of the default group would be a replica of its own; pass the "
                          "cross-replica transport (and the replica's shard), as the DeepSpeed glue does")
    hyper = AdamSettings.from_flat({"lr": lr, **adam}, where="optimizer", strict=True)
    cls = METHOD_CLASSES[cfg.method]
    optimizer = _build(cfg, cls, params, hyper, transport, shard, ledger_steps, inner_factory, clip_grad,
                       inner_factory_honours)
    optimizer.transport.nonfinite = cfg.comm.nonfinite  # what the collectives do about a rank with NaN/inf
    return optimizer


def _timed(cfg: LowcommConfig, transport: Transport | None, shard: ReplicaShard | None) -> Transport:
    """``transport`` (torch.distributed's default group if None) and the shard's, their waits bounded
    by ``cfg.comm.timeout_s``: set before the optimizer's start-up check, the first collective to
    wait on a peer, and after every setting error (which needs no process group)."""
    transport = transport if transport is not None else TorchDistTransport()
    for t in (transport, shard.transport if shard is not None else None):
        if t is not None:
            t.timeout_s = cfg.comm.timeout_s
    return transport


def _build(cfg, cls, params, hyper, transport, shard, ledger_steps, inner_factory, clip_grad,
           inner_factory_honours=("adamw",)) -> LowcommOptimizer:
    inner = None
    if issubclass(cls, OuterLoop):  # the inner optimizer first: inner_impl's error comes before any collective
        if inner_factory is not None:
            if cfg.settings.inner_optimizer not in inner_factory_honours:
                raise ConfigError(f"lowcomm.inner_optimizer {cfg.settings.inner_optimizer!r} chooses the inner optimizer "
                                  "ds_lowcomm builds; here the caller builds it (inner_factory, Megatron's optimizer): "
                                  "leave inner_optimizer adamw and choose Muon in that optimizer")
            inner = inner_factory(params)
        elif cfg.settings.inner_optimizer == "muon":
            inner = _muon_inner(params, hyper, cfg.settings)
        elif cfg.settings.inner_impl == "apex":
            inner = _apex_fused_adamw(params, hyper)
        else:
            inner = torch.optim.AdamW(params, **hyper.torch_kwargs())
    transport = _timed(cfg, transport, shard)
    comm = dict(settings=cfg.settings, transport=transport, shard=shard, ledger_steps=ledger_steps,
                clip_grad=clip_grad)
    if cls is AllReduceAdamW:
        return AllReduceAdamW(params, transport=transport, shard=shard, ledger_steps=ledger_steps,
                              clip_grad=clip_grad, **hyper.torch_kwargs())
    if cls is DeMo:
        return DeMo(params, lr=hyper.lr, weight_decay=hyper.weight_decay, **comm)
    if cls is Dion:
        return Dion(params, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay, **comm)
    if cls is MTDAO:
        return MTDAO(params, lr=hyper.lr, beta2=hyper.betas[1], eps=hyper.eps, weight_decay=hyper.weight_decay, **comm)
    assert inner is not None, cls
    return cls(inner, **comm)
