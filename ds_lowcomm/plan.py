"""``ds-lowcomm plan``: what each method costs and buys for a given model, cluster and link.

For a model (its parameter shapes: a preset, or the reference GPT / a Llama of given size), a
number of replicas joined by a link (rate, one-way latency), the GPUs in each replica and their
ZeRO stage, and the step's compute time, per method:

- bytes each worker sends per sync and per step, from the codec's own wire format (the
  :class:`~ds_lowcomm.codec.SparseSpec` of every tensor the method exchanges, plus the health flag
  byte; dense syncs: the flat tensors and their one-byte health all-gather), two ways: in the
  ledger's convention (``comm/ledger.py``: an all-gather of P bytes counts P sent, an all-reduce
  of N bytes N), and on the wire at the given replica count (:func:`wire_bytes_sent`: a ring
  all-gather sends (n-1) P per worker, a ring all-reduce 2 (n-1) N / n). The two agree at 2
  replicas only: every byte ratio holds at a replica count;
- communication seconds per step: each collective as gloo and NCCL's ring run it between
  replicas (all-gather n-1 rounds of P bytes, all-reduce 2(n-1) rounds of N/n), each round one
  link latency plus its bytes, with Ethernet/IP/TCP framing, over the link's rate; and the part
  of it the step waits for (``exposed``): adamw's all-reduce overlapped with the backward pass as
  DDP and ZeRO (``overlap_comm``) run it, bucket by bucket, the last bucket exposed (or not at all,
  ``overlap_backward`` False: ds_lowcomm's own adamw, DeepSpeed ZeRO 1-2 without
  ``overlap_comm``); demo's ``overlap`` behind the next step's compute; a streaming outer sync
  behind the ``sync_delay`` inner steps it has to land, fragment by fragment;
- codec seconds per step (encode and decode of every exchanged element at a throughput measured
  by ``python -m lowcomm_bench codec``; the default, ds_lowcomm/measured.json's, is stated as such);
- the method's optimizer state per GPU, and its addition over adamw's, at the ZeRO stage and
  ``state_dtype`` (ZeRO 1-3 partition the optimizer state over the replica's GPUs);
- the comm/compute ratio (adamw's communication over the compute), and the predicted speed-up in
  time to a target loss against adamw: adamw's step time over (the method's step time x its
  steps-to-target ratio). The ratios default to those measured on the reference task
  (docs/benchmarks.md, "A fair fight"; ds_lowcomm/measured.json) and are an input.

Assumptions, stated where they matter: one replica's GPUs each exchange their own shard (1/G of
the elements) with their counterparts in the other replicas, so a worker's bytes are the model's
over G (exact at G = 1; within the codec's per-tensor rounding above); traffic inside a replica
is on its fast fabric and not counted; a collective pays its latency rounds once (a bucketed
all-reduce pays them per bucket: the model favours adamw there).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .codec import FLOAT_DTYPES, CodecSettings, SparseSpec
from .comm import phase_bytes
from .optim.mtdao import MTDAOSettings
from .optim.outer import resolve_exchange
from .optim.recipes import RECIPES
from .optim.registry import METHODS, LowcommConfig
from .settings import ConfigError

# Ethernet (14 + 4 FCS + 8 preamble + 12 gap are below tc: 14 counted), IPv4 20, TCP 32 (timestamps):
# a 1500-byte MTU carries 1448 bytes of payload in a 1514-byte frame, which a shaper counts.
WIRE_OVERHEAD = 1514 / 1448

# The measured defaults (ds_lowcomm/measured.json, package data; written by the benchmarks that
# measure each figure: lab/lowcomm_bench/measured.py), each with where it comes from:
# - the codec's throughput (GB/s of fp32 elements through encode + decode, one rank), per device.
#   CPU: in training, demo's recipe on the reference GPT at 0.44M, 6.5M and 101M parameters, 2
#   workers on 2 cores (``python -m lowcomm_bench plan_scale --record``): the cost per element grows
#   with the tensors (the 101M figure is several times below the isolated codec benchmark's 0.544
#   GB/s for one 1024x1024 tensor), so the default follows the model's size between those (its
#   ``by_elements``), the largest's beyond. GPU: in training too, demo's recipe at about 125M parameters
#   on the newest lent GPU (``bash launch/gpu_check.sh``);
# - steps to the target over adamw's own, measured on the reference task (2 hosts; ``python -m
#   lowcomm_bench time_to_loss --record``): adamw and demo against the tuned adamw's loss
#   (docs/bench/time_to_loss.csv, "A fair fight": 240 and 260 steps); the outer methods were not run
#   there, so theirs are against the untuned adamw's target (docs/bench/time_to_loss_issue17.csv:
#   adamw 225, diloco 285, dct_diloco 330, sparseloco 345, mtdao 360), where demo's was 195/225:
#   likely optimistic for them; dion: its recipe's steps on seed 0 against the tuned adamw's median
#   (issue 41's exploration: one seed, not tuned under the fair protocol). An input: --steps-ratio.
MEASURED_PATH = Path(__file__).with_name("measured.json")


def load_measured(path: Path = MEASURED_PATH) -> dict:
    """The measured defaults: {"codec_gbps": {device: entry}, "steps_ratio": {method: entry}}, an
    entry {"value": ..., "source": ..., ...}."""
    return json.loads(Path(path).read_text())


MEASURED = load_measured()
CODEC_GBPS = {device: (e["value"], e["source"]) for device, e in MEASURED["codec_gbps"].items()}
# Where a device's entry was measured at several model sizes (plan_scale at several widths): the
# codec's cost per element grows with the tensors (caches), so the default follows the model's size
CODEC_BY_ELEMENTS = {device: sorted((float(n), float(g)) for n, g in e.get("by_elements", ()))
                     for device, e in MEASURED["codec_gbps"].items()}

STEPS_RATIO = {m: e["value"] for m, e in MEASURED["steps_ratio"].items()}
STEPS_RATIO_SOURCE = {m: e["source"] for m, e in MEASURED["steps_ratio"].items()}


def default_codec_gbps(device: str, elements: float) -> float:
    """The measured codec throughput for ``elements`` parameters per worker: the device's figure;
    where it was measured at several sizes, linear in log(elements) between the two nearest, the
    nearest's beyond them."""
    points = CODEC_BY_ELEMENTS.get(device) or []
    if not points:
        return CODEC_GBPS[device][0]
    if elements <= points[0][0]:
        return points[0][1]
    for (n0, g0), (n1, g1) in zip(points, points[1:]):
        if elements <= n1:
            t = math.log(elements / n0) / math.log(n1 / n0)
            return g0 + t * (g1 - g0)
    return points[-1][1]


# -- the model's shapes ---------------------------------------------------------------------------
def gpt_shapes(n_layer: int, n_embd: int, vocab: int = 256, seq_len: int = 128) -> list[tuple[int, ...]]:
    """The reference GPT's parameters (lab/lowcomm_task/model.py: tied embeddings, biases), in order."""
    d = n_embd
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d), (seq_len, d), *block * n_layer, (d,), (d,)]


def llama_shapes(hidden: int, layers: int, ffn: int, vocab: int, heads: int, kv_heads: int,
                 tied: bool = False) -> list[tuple[int, ...]]:
    """A Llama's parameters (transformers' LlamaForCausalLM: no biases, RMSNorm weights)."""
    hd = hidden // heads
    layer = [(hidden * 1, hidden), (kv_heads * hd, hidden), (kv_heads * hd, hidden), (hidden, hidden),
             (ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]
    return [(vocab, hidden), *layer * layers, (hidden,), *([] if tied else [(vocab, hidden)])]


# name -> (shapes, what it is)
MODELS: dict[str, tuple] = {
    "reference": (lambda: gpt_shapes(2, 128), "the reference GPT (2 layers, 128 wide, byte vocabulary)"),
    "gpt-125m": (lambda: gpt_shapes(12, 768, 50257, 1024), "GPT-2 small shapes (12 x 768, vocab 50257)"),
    "gpt-350m": (lambda: gpt_shapes(24, 1024, 50257, 1024), "GPT-2 medium shapes (24 x 1024, vocab 50257)"),
    "llama-1b": (lambda: llama_shapes(2048, 16, 8192, 128256, 32, 8, tied=True), "Llama 3.2 1B shapes"),
    "llama-8b": (lambda: llama_shapes(4096, 32, 14336, 128256, 32, 8), "Llama 3.1 8B shapes"),
    "llama-70b": (lambda: llama_shapes(8192, 80, 28672, 128256, 64, 8), "Llama 3.1 70B shapes"),
}


def model_shapes(model: str) -> list[tuple[int, ...]]:
    if model not in MODELS:
        raise ConfigError(f"plan: model must be one of {', '.join(MODELS)}; got {model!r}")
    return MODELS[model][0]()


def hidden_matrices(model: str, shapes=None) -> list[bool]:
    """Per tensor of :func:`model_shapes`, whether it takes an orthonormal step (dion, Muon), as Muon
    is run (:func:`ds_lowcomm.optim.muon.takes_muon_step`): 2-D, and not an embedding (the GPTs'
    leading token and position embeddings, the Llamas' leading token embedding) or the untied head
    (the Llamas' trailing (vocab, hidden))."""
    shapes = model_shapes(model) if shapes is None else shapes
    embeddings = 1 if model.startswith("llama") else 2
    head = len(shapes) - 1 if model.startswith("llama") and len(shapes[-1]) == 2 else None
    return [len(s) == 2 and i >= embeddings and i != head for i, s in enumerate(shapes)]


# -- inputs ---------------------------------------------------------------------------------------
@dataclass
class PlanInputs:
    model: str = "llama-8b"
    replicas: int = 2
    gpus_per_replica: int = 1
    zero_stage: int = 1
    link_gbit: float = 10.0  # between replicas, each worker's own
    latency_ms: float = 1.0  # one way
    compute_s: float = 1.0  # one step's forward and backward (and local update), without communication
    grad_bytes: int = 4  # bytes per element of what adamw and diloco's dense syncs send (fp32: 4, bf16: 2)
    param_bytes: int = 4  # bytes per element of the parameters (the inner AdamW's state follows them)
    device: str = "gpu"  # which measured codec throughput is the default
    # adamw's all-reduce as DDP and ZeRO (overlap_comm) run it: bucket by bucket while the backward
    # pass runs, the last bucket after it; False: after the backward pass (ds_lowcomm's adamw method,
    # DeepSpeed ZeRO 1-2 without overlap_comm, its default)
    overlap_backward: bool = True
    backward_fraction: float = 2 / 3  # the backward pass's share of compute_s (twice the forward's FLOPs)
    # MiB of gradients per bucket (DDP's bucket_cap_mb; DeepSpeed: reduce_bucket_size x bytes / 2**20)
    bucket_cap_mb: float = 25.0
    codec_gbps: float | None = None  # GB/s of fp32 elements through encode + decode; None: the device's default
    methods: dict[str, dict] = field(default_factory=lambda: {m: dict(RECIPES[m]["lowcomm"]) for m in RECIPES})
    steps_ratio: dict[str, float] = field(default_factory=lambda: dict(STEPS_RATIO))
    # The fraction of a run's steps a method spends synchronous before its own scheme starts (mtdao's
    # warm start: a dense gradient all-reduce every step, as adamw's): its steps are averaged over both
    warm_start: dict[str, float] = field(default_factory=lambda: {m: RECIPES[m]["warm_start"] for m in RECIPES
                                                                   if "warm_start" in RECIPES[m]})

    def validate(self) -> None:
        def positive(name, value, integer=False):
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0
                    or (integer and not isinstance(value, int)) or not math.isfinite(value)):
                raise ConfigError(f"plan: {name} must be a positive {'integer' if integer else 'number'}; got {value!r}")

        model_shapes(self.model)
        for name in ("replicas", "gpus_per_replica"):
            positive(name, getattr(self, name), integer=True)
        for name in ("link_gbit", "compute_s", "bucket_cap_mb"):
            positive(name, getattr(self, name))
        if not isinstance(self.overlap_backward, bool):
            raise ConfigError(f"plan: overlap_backward must be true or false; got {self.overlap_backward!r}")
        if (not isinstance(self.backward_fraction, (int, float)) or isinstance(self.backward_fraction, bool)
                or not 0 <= self.backward_fraction <= 1):
            raise ConfigError(f"plan: backward_fraction must be a number in [0, 1]; got {self.backward_fraction!r}")
        if self.codec_gbps is not None:
            positive("codec_gbps", self.codec_gbps)
        if not isinstance(self.latency_ms, (int, float)) or self.latency_ms < 0:
            raise ConfigError(f"plan: latency_ms must be >= 0; got {self.latency_ms!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"plan: zero_stage must be one of 0, 1, 2, 3; got {self.zero_stage!r}")
        for name in ("grad_bytes", "param_bytes"):
            if getattr(self, name) not in (2, 4):
                raise ConfigError(f"plan: {name} must be 2 (bf16/fp16) or 4 (fp32); got {getattr(self, name)!r}")
        if self.device not in CODEC_GBPS:
            raise ConfigError(f"plan: device must be one of {', '.join(CODEC_GBPS)}; got {self.device!r}")
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ConfigError(f"plan: methods must name some of {', '.join(METHODS)}; got {', '.join(unknown) or 'none'}")
        for m, ratio in self.steps_ratio.items():
            positive(f"steps_ratio.{m}", ratio)
        for m, f in self.warm_start.items():
            if not isinstance(f, (int, float)) or isinstance(f, bool) or not 0 <= f < 1:
                raise ConfigError(f"plan: warm_start.{m} must be a fraction in [0, 1); got {f!r}")


# -- what a method sends --------------------------------------------------------------------------
@dataclass(frozen=True)
class Message:
    """One collective of a sync: ``kind`` "all_gather" or "all_reduce", ``nbytes`` as the ledger
    counts them sent per worker, and how many elements the codec encodes and decodes for it."""

    op: str
    kind: str
    nbytes: int
    codec_elements: int = 0


def sparse_message(op: str, shapes, codec: dict) -> Message:
    specs = [SparseSpec.build(s, chunk=codec["chunk"], topk=codec["topk"], value_dtype=codec["value_dtype"],
                              transform=codec.get("transform", "dct")) for s in shapes]
    return Message(op, "all_gather", sum(s.nbytes for s in specs) + 1, sum(math.prod(s) for s in shapes))


def outer_exchange(settings: dict, replicas: int) -> str:
    """"all_gather" or "all_reduce": how dct_diloco / sparseloco exchange at ``replicas`` workers,
    by :func:`ds_lowcomm.optim.outer.resolve_exchange` itself (auto: the compressed all-reduce from 4
    replicas for a dense sign payload, every element sent)."""
    codec = CodecSettings.from_flat(settings, where="plan")
    return resolve_exchange(settings.get("exchange", "auto"), codec, replicas)


def compressed_all_reduce_messages(op: str, shapes, replicas: int) -> list[Message]:
    """The two collectives of :class:`ds_lowcomm.comm.compressed_allreduce.CompressedAllReduce` at
    ``replicas`` = n workers, as its ledger books them (its own count, :func:`phase_bytes`: the most
    any rank sends): phase 1 an all-to-all of each chunk's sign bits and scales to its owner, phase 2
    an all-gather of each owner's counts."""
    phases = phase_bytes([tuple(s) for s in shapes], max(2, replicas))
    elements = sum(math.prod(s) for s in shapes)
    return [Message(f"{op}_scatter", "all_to_all", phases["scatter"][0], elements),
            Message(f"{op}_gather", "all_gather", phases["gather"][0], elements)]


def dense_messages(op: str, elements: int, nbytes_per: int) -> list[Message]:
    """A dense mean: its one-byte health all-gather beside one all-reduce (one dtype)."""
    return [Message(f"{op}_health", "all_gather", 1), Message(op, "all_reduce", elements * nbytes_per)]


def _state_bytes(settings: dict) -> int:
    """Bytes per element of the method's state (its ``state_dtype``)."""
    return FLOAT_DTYPES[settings.get("state_dtype", "fp32")].itemsize


def planned_ledger(method: str, settings: dict, shapes, steps: int,
                   matrices: list[bool] | None = None, replicas: int = 2) -> dict[str, tuple[int, int]]:
    """What a run of ``steps`` steps records in its ledger per op (start-up left out): (calls, bytes
    sent). A streaming outer method's fragments each sync on their own step of every H; mtdao's
    ``switch_step`` S: S steps of a dense gradient mean, then syncs counted from S."""
    every = sync_messages(method, settings, shapes, matrices=matrices, replicas=replicas)[0]
    warm = min(steps, settings.get("switch_step", 0)) if method == "mtdao" else 0
    out: dict[str, tuple[int, int]] = {}

    def add(m: Message, n: int) -> None:
        if n:
            calls, sent = out.get(m.op, (0, 0))
            out[m.op] = (calls + n, sent + n * m.nbytes)

    for m in warm_messages(shapes) if warm else []:
        add(m, warm)
    fragments = fragment_messages(method, settings, shapes, matrices=matrices, replicas=replicas)
    for f, messages in enumerate(fragments):
        if every == 1:
            syncs = steps - warm
        elif len(fragments) == 1:
            syncs = (steps - warm) // every
        else:
            syncs = fragment_syncs(settings, f, steps - warm)
        for m in messages:
            add(m, syncs)
    return out


def fragment_syncs(settings: dict, fragment: int, steps: int) -> int:
    """How many syncs fragment ``fragment`` of an outer method starts in ``steps`` steps (the
    method's schedule, optim/outer.py: fragment f at steps (f + 1) H // P, then every H)."""
    h, p = settings["sync_every"], settings.get("fragments", 1)
    offset = (fragment + 1) * h // p
    return 0 if steps < offset else 1 + (steps - offset) // h


def fragment_shapes(settings: dict, shapes) -> list[list[tuple[int, ...]]]:
    """``shapes`` cut into the method's streaming fragments (one list without streaming), by the
    method's own rule (optim/outer.py ``contiguous_fragments``)."""
    n = settings.get("fragments", 1)
    if n <= 1:
        return [list(shapes)]
    import torch

    from .optim.outer import contiguous_fragments

    tensors = [torch.empty(s, device="meta") for s in shapes]
    return [[tuple(t.shape) for t in group] for group in contiguous_fragments(tensors, n)]


def fragment_messages(method: str, settings: dict, shapes, grad_bytes: int = 4,
                      param_bytes: int = 4, matrices: list[bool] | None = None,
                      replicas: int = 2) -> list[list[Message]]:
    """The messages of one sync of each streaming fragment (one list without streaming)."""
    parts = fragment_shapes(settings, shapes)
    if len(parts) == 1:
        return [sync_messages(method, settings, shapes, grad_bytes, param_bytes, matrices, replicas)[1]]
    if method == "dion":
        raise ConfigError("plan: dion has no streaming fragments")
    return [sync_messages(method, settings, part, grad_bytes, param_bytes, replicas=replicas)[1] for part in parts]


def warm_messages(shapes, grad_bytes: int = 4) -> list[Message]:
    """One step of mtdao's warm start: the gradients' dense mean."""
    return dense_messages("mtdao_grad_all_reduce", sum(math.prod(s) for s in shapes), grad_bytes)


def dion_factor_shapes(shape: tuple[int, ...], rank_fraction: float) -> tuple[int, int, int]:
    """(rows, cols, r) of a dion matrix's factors: P is rows x r, R and Q cols x r (the matrix
    viewed tall: its first dimension by the rest, transposed when wide)."""
    from .optim.dion import dion_rank

    a, b = shape[0], math.prod(shape[1:])
    return max(a, b), min(a, b), dion_rank(shape, rank_fraction)


def sync_messages(method: str, settings: dict, shapes, grad_bytes: int = 4, param_bytes: int = 4,
                  matrices: list[bool] | None = None, replicas: int = 2) -> tuple[int, list[Message]]:
    """(steps between syncs, the messages of one sync) for ``method`` with ``settings`` (the
    effective flat settings) over tensors of ``shapes`` (one worker's); ``matrices``: which of
    them take an orthonormal step (dion's factors; see :func:`hidden_matrices`); ``replicas``:
    the workers exchanging (dct_diloco / sparseloco's exchange and its chunks depend on it)."""
    elements = sum(math.prod(s) for s in shapes)
    if method == "adamw":
        return 1, dense_messages("all_reduce", elements, grad_bytes)
    if method == "dion":
        if matrices is None:
            raise ConfigError("plan: dion's bytes need which tensors are hidden matrices (hidden_matrices)")
        wire = FLOAT_DTYPES[settings["value_dtype"]].itemsize
        factors = [dion_factor_shapes(s, settings["rank_fraction"]) for s, m in zip(shapes, matrices) if m]
        others = sum(math.prod(s) for s, m in zip(shapes, matrices) if not m)
        first = sum(rows * r for rows, _, r in factors) + others  # every P, with the others' gradients
        second = sum(cols * r for _, cols, r in factors)  # every R
        return 1, [*dense_messages("dion_all_reduce", first, wire), *dense_messages("dion_all_reduce", second, wire)]
    if method == "demo":
        return 1, [sparse_message("sparse_all_gather", shapes, settings)]
    state = _state_bytes(settings)
    if method == "diloco":
        return settings["sync_every"], dense_messages("outer_all_reduce", elements, state)
    if method in ("dct_diloco", "sparseloco"):
        if outer_exchange(settings, replicas) == "all_reduce":
            return settings["sync_every"], compressed_all_reduce_messages("outer_compressed_all_reduce", shapes,
                                                                          replicas)
        return settings["sync_every"], [sparse_message("outer_sparse_all_gather", shapes, settings)]
    if method == "mtdao":
        periods = MTDAOSettings.from_flat(settings, where="plan").periods()  # the method's own schedule
        if len(set(periods.values())) != 1:
            raise ConfigError("plan: mtdao with different periods per state is not modelled; give one sync_every")
        names = list(periods)
        if settings["sync_codec"] == "dense":  # everything due at once: one flat all-reduce per dtype
            groups: dict[int, int] = {}
            for name in names:  # the parameters in their own dtype, the moments in state_dtype
                size = param_bytes if name == "param" else state
                groups[size] = groups.get(size, 0) + elements * size
            return settings["sync_every"], [Message("mtdao_all_reduce_health", "all_gather", 1),
                                            *(Message("mtdao_all_reduce", "all_reduce", n) for n in groups.values())]
        # topk: everything but v compressed in one all-gather; v dense
        compressed = [s for name in names if name != "v" for s in shapes]
        return settings["sync_every"], [*dense_messages("mtdao_all_reduce", elements, state),
                                        sparse_message("mtdao_sparse_all_gather", compressed, settings)]
    raise ConfigError(f"plan: method must be one of {', '.join(METHODS)}; got {method!r}")


def state_bytes_per_element(method: str, settings: dict, param_bytes: int = 4, shapes=None,
                            matrices: list[bool] | None = None) -> float:
    """Bytes of optimizer state per parameter element (scalars such as step counters left out);
    ``shapes`` and ``matrices`` (which take an orthonormal step): for dion and a Muon inner optimizer."""
    state = _state_bytes(settings)
    if method == "adamw":
        return 2 * param_bytes  # exp_avg, exp_avg_sq in the parameters' dtype
    if method == "dion" or settings.get("inner_optimizer") == "muon":
        if shapes is None or matrices is None:
            raise ConfigError(f"plan: {method}'s state needs the shapes and which are hidden matrices")
        elements = sum(math.prod(s) for s in shapes)
        on_matrices = sum(math.prod(s) for s, m in zip(shapes, matrices) if m)
    if method == "dion":  # momentum and Q on the matrices, AdamW's two moments on the rest, all state_dtype
        q = sum(cols * r for s, m in zip(shapes, matrices) if m
                for _, cols, r in [dion_factor_shapes(s, settings["rank_fraction"])])
        return (state * on_matrices + state * q + 2 * state * (elements - on_matrices)) / elements
    if method == "demo":
        return state  # the momentum
    if method == "mtdao":
        moments = len(settings["momentum_betas"])
        extra = 2 * 4 * (1 + moments) if settings["sync_codec"] == "topk" else 0  # synced + unsent, fp32
        outer = 2 * state if settings.get("outer_optimizer", "none") == "sgd" else 0  # anchor, outer momentum
        return state * (moments + 1) + extra + outer
    outer = settings.get("outer_optimizer", "sgd")
    outer_state = (state if settings.get("outer_momentum", 0.0) else 0) if outer == "sgd" else 2 * state
    residual = state if method in ("dct_diloco", "sparseloco") else 0
    inner = 2 * param_bytes  # AdamW's two moments; Muon keeps one momentum buffer on the matrices
    if settings.get("inner_optimizer") == "muon":
        inner = (param_bytes * on_matrices + 2 * param_bytes * (elements - on_matrices)) / elements
    # carry_local_steps: while a sync is in flight, a copy of its parameters as they were at the send
    # (their own dtype); counted whole, the peak with one fragment
    carried = param_bytes if settings.get("carry_local_steps") else 0
    return inner + state + outer_state + residual + carried  # inner optimizer, anchor, outer optimizer, residual


def muon_memory(shapes, other: set[int], gpus: int, zero_stage: int, state_bytes: int = 4) -> dict[str, float]:
    """Optimizer bytes per GPU of demo with Muon's step (``update`` muon) against DeepSpeed's own Muon,
    both over ``shapes`` (``other``: the indices of the tensors that take the other rule:
    embeddings, an output head; 1-D ones always), partitioned over ``gpus`` at ZeRO >= 1.
    Persistent: DeepSpeed's Muon keeps a momentum (fp32) per Muon element and Adam's two moments
    per other element; demo one momentum (``state_bytes``) per element. Transient, demo's step at
    ZeRO >= 1: the exchanged mean and the direction of its partition (fp32 each) and the whole
    matrices it owns while they are orthogonalised (about its share of the Muon elements)."""
    muon = sum(math.prod(s) for i, s in enumerate(shapes) if len(s) >= 2 and i not in other)
    total = sum(math.prod(s) for s in shapes)
    share = gpus if zero_stage >= 1 else 1
    deepspeed = (4 * muon + 8 * (total - muon)) / share
    demo = state_bytes * total / share
    transient = (2 * 4 * total + 4 * muon) / share if zero_stage >= 1 else 2 * 4 * total
    return {"muon_elements": muon, "elements": total, "deepspeed_muon_state_bytes_per_gpu": deepspeed,
            "demo_muon_state_bytes_per_gpu": demo, "added_state_bytes_per_gpu": demo - deepspeed,
            "demo_muon_transient_bytes_per_gpu": transient}


# -- bytes on the wire and the time model --------------------------------------------------------
def ring_rounds(kind: str, replicas: int) -> tuple[int, float]:
    """(rounds, the share of the payload each round carries) of one collective between ``replicas``
    workers as a ring (gloo's, and NCCL's ring algorithm): an all-gather is n-1 rounds of the whole
    payload, an all-reduce 2(n-1) rounds of 1/n of it (a reduce-scatter, then an all-gather); an
    all-to-all (whose ``nbytes`` already counts every part to the others) n-1 rounds of 1/(n-1)."""
    n = replicas
    if n <= 1:
        return 0, 0.0
    if kind == "all_to_all":
        return n - 1, 1.0 / (n - 1)
    return (n - 1, 1.0) if kind == "all_gather" else (2 * (n - 1), 1.0 / n)


def wire_bytes(msg: Message, replicas: int) -> float:
    """:func:`wire_bytes_sent` of one message."""
    return wire_bytes_sent(msg.kind, msg.nbytes, replicas)


def wire_bytes_per_step(method: str, settings: dict, shapes, replicas: int, grad_bytes: int = 4,
                        param_bytes: int = 4, matrices: list[bool] | None = None) -> float:
    """Bytes one worker sends on its link per step with ``replicas`` workers (:func:`wire_bytes` of
    each message of a sync, over the steps between syncs): the figure of ``bench replica_bytes``."""
    every, messages = sync_messages(method, settings, shapes, grad_bytes, param_bytes, matrices, replicas)
    return sum(wire_bytes(m, replicas) for m in messages) / every


def wire_bytes_sent(kind: str, nbytes: float, replicas: int) -> float:
    """Bytes one worker puts on the wire (payload, before framing) for one collective of
    ``nbytes`` per worker between ``replicas`` workers as a ring: an all-gather (n-1) x nbytes, an
    all-reduce 2 (n-1) / n x nbytes, an all-to-all its ``nbytes`` (the parts to the others). The
    ledger counts ``nbytes`` sent for all three (comm/ledger.py): they agree at 2 workers only. Each
    of these receives what it sends, so this is also a worker's bytes received on the wire (the
    ledger's received column: (n-1) x nbytes for an all-gather). Checked against what gloo writes
    to its sockets (tests/test_plan.py)."""
    rounds, share = ring_rounds(kind, replicas)
    return rounds * share * nbytes


def message_seconds(msg: Message, replicas: int, rate_bits: float, latency_s: float) -> float:
    """One collective between ``replicas`` workers as a ring: each round a latency, and the bytes
    of every round framed into Ethernet frames at the link's rate."""
    rounds, _ = ring_rounds(msg.kind, replicas)
    return rounds * latency_s + wire_bytes_sent(msg.kind, msg.nbytes, replicas) * WIRE_OVERHEAD * 8 / rate_bits


def _share(msg: Message, g: int) -> Message:
    """One worker's share of ``msg`` in a replica of ``g`` GPUs (each exchanges 1/G of the elements)."""
    return dataclasses.replace(msg, nbytes=msg.nbytes / g) if g > 1 else msg


# DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES): the gradients ready first
FIRST_BUCKET_BYTES = 1 << 20


def last_bucket_elements(shapes, bucket_cap_mb: float, element_bytes: int) -> int:
    """The elements of the bucket DDP all-reduces last: parameters in reverse order (the order the
    backward pass produces their gradients), a bucket closed once it holds at least its cap (1 MiB
    for the first, ``bucket_cap_mb`` MiB after), a parameter never split (DDP's
    ``_compute_bucket_assignment_by_size``); what is left at the end is the last bucket."""
    cap, size, elements, last = FIRST_BUCKET_BYTES, 0, 0, 0
    for shape in reversed(list(shapes)):
        n = math.prod(shape)
        size, elements = size + n * element_bytes, elements + n
        if size >= cap:
            last, size, elements, cap = elements, 0, 0, bucket_cap_mb * (1 << 20)
    return elements or last


def adamw_exposed_seconds(messages: list[Message], inputs: PlanInputs, shapes, rate: float, latency: float) -> float:
    """adamw's communication the step waits for. With ``overlap_backward`` (DDP; ZeRO with
    ``overlap_comm``) the gradients are all-reduced bucket by bucket while the backward pass
    (``backward_fraction`` of the compute) runs: the last bucket is all-reduced after it, and the
    rest only where the link is slower than the backward pass, so the wait is the larger of the
    last bucket's all-reduce and the whole all-reduce less the backward pass (its latency rounds
    paid once, not per bucket: in adamw's favour). Without it, all of it (with ds_lowcomm's health
    all-gather beside it)."""
    g = inputs.gpus_per_replica
    if not inputs.overlap_backward:
        return sum(message_seconds(_share(m, g), inputs.replicas, rate, latency) for m in messages)
    grads = [m for m in messages if m.kind == "all_reduce"]  # DDP has no health flag
    whole = sum(message_seconds(_share(m, g), inputs.replicas, rate, latency) for m in grads)
    # buckets sized in the gradients' own dtype (the parameters'), sent at grad_bytes an element
    last = Message("all_reduce", "all_reduce",
                   last_bucket_elements(shapes, inputs.bucket_cap_mb, inputs.param_bytes) * inputs.grad_bytes)
    last_s = message_seconds(_share(last, g), inputs.replicas, rate, latency)
    return max(last_s, whole - inputs.backward_fraction * inputs.compute_s)


def plan_method(method: str, inputs: PlanInputs, shapes=None) -> dict[str, Any]:
    shapes = shapes if shapes is not None else model_shapes(inputs.model)
    raw = {**inputs.methods.get(method, {}), "method": method}
    settings = LowcommConfig.from_dict(raw, where=f"plan.methods.{method}").effective()
    g, n = inputs.gpus_per_replica, inputs.replicas
    matrices = hidden_matrices(inputs.model, shapes)
    every = sync_messages(method, settings, shapes, inputs.grad_bytes, inputs.param_bytes, matrices, n)[0]
    fragments = fragment_messages(method, settings, shapes, inputs.grad_bytes, inputs.param_bytes, matrices, n)
    messages = [m for part in fragments for m in part]  # one sync of every fragment: H steps' worth
    elements = sum(math.prod(s) for s in shapes)
    # one worker's share: the model's bytes over its replica's G workers
    per_worker_sync = sum(_share(m, g).nbytes for m in messages)
    wire_sync = sum(wire_bytes_sent(m.kind, _share(m, g).nbytes, n) for m in messages)
    rate, latency = inputs.link_gbit * 1e9, inputs.latency_ms / 1e3
    fragment_s = [sum(message_seconds(_share(m, g), n, rate, latency) for m in part) for part in fragments]
    comm_sync = sum(fragment_s)
    gbps = inputs.codec_gbps or default_codec_gbps(inputs.device, elements / g)
    codec_sync = sum(m.codec_elements for m in messages) / g * 4 / (gbps * 1e9)
    if method == "adamw":
        exposed_sync = adamw_exposed_seconds(messages, inputs, shapes, rate, latency)
    elif settings.get("overlap"):  # demo: the exchange lands during the next step's compute
        exposed_sync = max(0.0, comm_sync - inputs.compute_s)
    elif settings.get("sync_delay"):  # streaming: each fragment's sync lands sync_delay inner steps later
        window = settings["sync_delay"] * inputs.compute_s
        exposed_sync = sum(max(0.0, s - window) for s in fragment_s)
    else:
        exposed_sync = comm_sync
    comm_step, codec_step, exposed_step = comm_sync / every, codec_sync / every, exposed_sync / every
    bytes_step, wire_step = per_worker_sync / every, wire_sync / every
    warm = inputs.warm_start.get(method, 0.0)
    if warm:  # mtdao's warm start: that share of the steps all-reduce the gradients in the step (not overlapped)
        warm_msgs = [_share(m, g) for m in warm_messages(shapes, inputs.grad_bytes)]
        comm_warm = sum(message_seconds(m, n, rate, latency) for m in warm_msgs)
        comm_step = warm * comm_warm + (1 - warm) * comm_step
        exposed_step = warm * comm_warm + (1 - warm) * exposed_step
        codec_step *= 1 - warm
        bytes_step = warm * sum(m.nbytes for m in warm_msgs) + (1 - warm) * bytes_step
        wire_step = warm * sum(wire_bytes_sent(m.kind, m.nbytes, n) for m in warm_msgs) + (1 - warm) * wire_step
    step_s = inputs.compute_s + codec_step + exposed_step
    state = state_bytes_per_element(method, settings, inputs.param_bytes, shapes, matrices) * elements
    per_gpu = state / g if inputs.zero_stage >= 1 else state
    return {"method": method, "sync_every": every, "replicas": n, "bytes_per_sync": per_worker_sync,
            "bytes_per_step": bytes_step, "wire_bytes_per_sync": wire_sync, "wire_bytes_per_step": wire_step,
            "warm_start": warm, "messages_per_sync": len(messages),
            "comm_s_per_step": comm_step, "exposed_comm_s_per_step": exposed_step, "codec_s_per_step": codec_step,
            "step_s": step_s, "state_bytes_per_gpu": per_gpu, "parameters": elements, "codec_gbps": gbps,
            "settings": settings}


def plan(inputs: PlanInputs) -> dict[str, Any]:
    """Every method of ``inputs.methods`` (and adamw, the baseline) -> the table's rows."""
    inputs.validate()
    shapes = model_shapes(inputs.model)
    methods = list(dict.fromkeys(["adamw", *inputs.methods]))
    rows = {m: plan_method(m, inputs, shapes) for m in methods}
    base = rows["adamw"]
    for m, row in rows.items():
        ratio = inputs.steps_ratio.get(m)
        row["added_state_bytes_per_gpu"] = row["state_bytes_per_gpu"] - base["state_bytes_per_gpu"]
        row["steps_ratio"] = ratio
        row["steps_ratio_source"] = STEPS_RATIO_SOURCE.get(m) if ratio == STEPS_RATIO.get(m) else "given"
        row["speedup_vs_adamw"] = base["step_s"] / (ratio * row["step_s"]) if ratio else None
        # fewer bytes than adamw's per step, on the wire at this replica count (the ledger's ratio
        # is the wire's at 2 replicas: an all-gather's wire bytes grow with n, an all-reduce's do not)
        wire, ledger = row["wire_bytes_per_step"], row["bytes_per_step"]
        row["wire_bytes_vs_adamw"] = base["wire_bytes_per_step"] / wire if wire else None
        row["ledger_bytes_vs_adamw"] = base["bytes_per_step"] / ledger if ledger else None
    return {"inputs": dataclasses.asdict(inputs), "parameters": base["parameters"],
            "comm_compute_ratio": base["comm_s_per_step"] / inputs.compute_s,
            "codec_gbps": base["codec_gbps"],
            "codec_default": None if inputs.codec_gbps else CODEC_GBPS[inputs.device][1],
            "rows": [rows[m] for m in methods]}


def format_table(result: dict) -> str:
    i = result["inputs"]
    overlap = (f"adamw's all-reduce overlapped with the backward pass ({i['backward_fraction']:.2g} of compute, "
               f"{i['bucket_cap_mb']:g} MiB buckets)" if i["overlap_backward"]
               else "adamw's all-reduce after the backward pass")
    lines = [f"{i['model']} ({result['parameters'] / 1e6:,.1f}M parameters), {i['replicas']} replicas x "
             f"{i['gpus_per_replica']} GPUs, ZeRO {i['zero_stage']}, {i['link_gbit']:g} Gbit/s, "
             f"{i['latency_ms']:g} ms, compute {i['compute_s']:g} s/step; comm/compute ratio "
             f"{result['comm_compute_ratio']:.2f}; {overlap}; codec {result['codec_gbps']:g} GB/s"
             + (f" ({result['codec_default']})" if result["codec_default"] else ""),
             f"bytes per worker per step: the ledger's (an all-gather of P counts P, an all-reduce of N counts N) "
             f"and on the wire at {i['replicas']} replicas (ring: (n-1) P, 2 (n-1) N / n); x fewer: adamw's wire "
             f"bytes over the method's, at {i['replicas']} replicas",
             f"{'method':<11} {'H':>4} {'ledger MB':>10} {'wire MB':>10} {'x fewer':>8} {'comm s':>8} {'waited s':>8} "
             f"{'codec s':>8} {'step s':>8} {'+state GB':>9} {'steps x':>7} {'speed-up':>8}"]
    for r in result["rows"]:
        lines.append(f"{r['method']:<11} {r['sync_every']:>4} {r['bytes_per_step'] / 1e6:>10.4f} "
                     f"{r['wire_bytes_per_step'] / 1e6:>10.4f} {r['wire_bytes_vs_adamw'] or float('nan'):>8.1f} "
                     f"{r['comm_s_per_step']:>8.4f} {r['exposed_comm_s_per_step']:>8.4f} {r['codec_s_per_step']:>8.4f} "
                     f"{r['step_s']:>8.4f} {r['added_state_bytes_per_gpu'] / 1e9:>9.2f} "
                     f"{r['steps_ratio'] or float('nan'):>7.2f} {r['speedup_vs_adamw'] or float('nan'):>8.2f}")
    return "\n".join(lines)


def add_arguments(p) -> None:
    d = PlanInputs()
    p.add_argument("--model", default=d.model, help=f"one of {', '.join(MODELS)}")
    p.add_argument("--replicas", type=int, default=d.replicas)
    p.add_argument("--gpus-per-replica", type=int, default=d.gpus_per_replica)
    p.add_argument("--zero-stage", type=int, default=None,
                   help=f"default: --config's zero_optimization.stage, else {d.zero_stage}")
    p.add_argument("--link-gbit", type=float, default=d.link_gbit, help="Gbit/s between replicas, per worker")
    p.add_argument("--latency-ms", type=float, default=d.latency_ms, help="one-way, between replicas")
    p.add_argument("--compute-s", type=float, default=d.compute_s, help="one step's compute, no communication")
    p.add_argument("--grad-bytes", type=int, default=None,
                   help=f"4 (fp32) or 2 (bf16) per dense element; default: 2 where --config enables bf16 or fp16, "
                        f"else {d.grad_bytes}")
    p.add_argument("--param-bytes", type=int, default=d.param_bytes)
    p.add_argument("--device", default=d.device, help="whose measured codec throughput is the default: gpu, cpu")
    p.add_argument("--codec-gbps", type=float, default=None, help="your `bench codec` figure (GB/s)")
    p.add_argument("--no-overlap", dest="overlap_backward", action="store_false",
                   help="adamw's all-reduce after the backward pass (ZeRO 1-2 without overlap_comm), not during it")
    p.add_argument("--backward-fraction", type=float, default=d.backward_fraction,
                   help="the backward pass's share of --compute-s (adamw's overlap window)")
    p.add_argument("--bucket-cap-mb", type=float, default=d.bucket_cap_mb,
                   help="MiB of gradients per all-reduce bucket: DDP's bucket_cap_mb (25); DeepSpeed ZeRO 1-2: "
                        "reduce_bucket_size x bytes per element / 2**20 (5e8 elements in bf16: 954)")
    p.add_argument("--methods", default=",".join(RECIPES), help="comma list; settings: the compare recipes")
    p.add_argument("--config", default=None, help="JSON {method: {lowcomm settings}} over the recipes")
    p.add_argument("--steps-ratio", default=None, help="JSON {method: steps to target over adamw's}")
    p.add_argument("--json", default=None, help="also write the result here")
    p.add_argument("--muon", action="store_true",
                   help="also: optimizer bytes per GPU of demo's Muon step against DeepSpeed's own Muon")


def config_methods(raw: Any, where: str = "--config") -> tuple[dict[str, dict], bool]:
    """``--config``'s JSON -> ({method: lowcomm settings}, whether they replace the recipes'). Either
    a DeepSpeed config with a ``"lowcomm"`` section (the files users copy, ``configs/*.json``): its
    method at exactly those settings; or ``{method: {settings}}`` over the compare recipes."""
    if isinstance(raw, dict) and "lowcomm" in raw:
        section = raw["lowcomm"]
        if not isinstance(section, dict) or "method" not in section:
            raise ConfigError(f"{where}: the config's lowcomm section must be an object with a method, one of "
                              f"{', '.join(METHODS)}; got {section!r}")
        if "replicas" in section:
            raise ConfigError(f"{where}: lowcomm.replicas (replicas of different shapes) is not planned: the planner's "
                              "replicas are alike (--replicas, --gpus-per-replica); drop it from a copy to plan one shape")
        settings = {k: v for k, v in section.items() if k != "method"}
        return {section["method"]: settings}, True
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise ConfigError(f"{where} must be a DeepSpeed config with a \"lowcomm\" section, or an object "
                          "{method: {lowcomm settings}} over the recipes; got " + repr(raw)[:200])
    return raw, False


def config_framework(raw: dict) -> dict[str, int]:
    """What a DeepSpeed config says of the planner's inputs: its ZeRO stage, and 2-byte gradients
    where bf16 or fp16 is enabled (DeepSpeed reduces them in that dtype)."""
    out = {}
    zero = raw.get("zero_optimization")
    if isinstance(zero, dict) and "stage" in zero:
        out["zero_stage"] = zero["stage"]
    if any(isinstance(raw.get(k), dict) and raw[k].get("enabled") for k in ("bf16", "fp16")):
        out["grad_bytes"] = 2
    return out


def run_plan(args) -> dict:
    methods = {m.strip(): dict(RECIPES[m.strip()]["lowcomm"]) if m.strip() in RECIPES else {}
               for m in args.methods.split(",") if m.strip()}
    given, framework = {}, {}
    if args.config:
        with open(args.config) as f:
            raw = json.load(f)
        given, replace = config_methods(raw, f"--config {args.config}")
        framework = config_framework(raw) if replace else {}  # a DeepSpeed config's, not a {method: settings}
        for m, over in given.items():
            methods[m] = dict(over) if replace else {**methods.get(m, {}), **over}
    defaults = PlanInputs()
    zero_stage = args.zero_stage if args.zero_stage is not None else framework.get("zero_stage", defaults.zero_stage)
    grad_bytes = args.grad_bytes if args.grad_bytes is not None else framework.get("grad_bytes", defaults.grad_bytes)
    given_ratio = json.loads(args.steps_ratio) if args.steps_ratio else {}
    ratio = {**STEPS_RATIO, **given_ratio}
    inputs = PlanInputs(model=args.model, replicas=args.replicas, gpus_per_replica=args.gpus_per_replica,
                        zero_stage=zero_stage, link_gbit=args.link_gbit, latency_ms=args.latency_ms,
                        compute_s=args.compute_s, grad_bytes=grad_bytes, param_bytes=args.param_bytes,
                        device=args.device, overlap_backward=args.overlap_backward,
                        backward_fraction=args.backward_fraction, bucket_cap_mb=args.bucket_cap_mb,
                        codec_gbps=args.codec_gbps, methods=methods, steps_ratio=ratio)
    result = plan(inputs)
    print(format_table(result))
    if framework:
        print(f"from --config: {', '.join(f'{k} {v}' for k, v in framework.items())} (a flag overrides it)")
    for m in given:
        if m != "adamw" and m not in given_ratio:
            print(f"{m}: steps x is its compare recipe's measured ratio, not your settings' "
                  "(--steps-ratio '{\"" + m + "\": R}' gives yours)")
    if getattr(args, "muon", False):
        shapes = model_shapes(args.model)
        # the embeddings (the GPT's token and position tables) and an untied output head
        other = {0, *([1] if args.model.startswith("gpt") or args.model == "reference" else []),
                 *([len(shapes) - 1] if args.model.startswith("llama") and len(shapes[-1]) == 2 else [])}
        result["muon"] = m = muon_memory(shapes, other, args.gpus_per_replica, zero_stage)
        print(f"Muon at ZeRO {zero_stage}, per GPU: DeepSpeed's Muon state "
              f"{m['deepspeed_muon_state_bytes_per_gpu'] / 1e9:.3f} GB, demo (update muon) "
              f"{m['demo_muon_state_bytes_per_gpu'] / 1e9:.3f} GB: added {m['added_state_bytes_per_gpu'] / 1e9:+.3f} GB; "
              f"demo's step adds {m['demo_muon_transient_bytes_per_gpu'] / 1e9:.3f} GB while it runs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return result
