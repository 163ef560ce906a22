"""Training runs of the reference task on test hosts over shaped links, shared by the network and
peers benchmarks: specs (the compare recipes, or a peer baseline), a result cache keyed by the
exact spec, host count and link (the same run is never trained twice), and the time-to-loss
arithmetic."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import lru_cache
from pathlib import Path

from lowcomm_task.compare import build_specs
from lowcomm_task.spec import TrainSpec

from .hosts import run_on_hosts
from .netns import LinkShape, TestNetwork, netem_available

# Links: one-way delay on each host's egress (netem) and a token-bucket rate.
LINKS = {
    "unshaped": LinkShape(),
    "1gbit-5ms": LinkShape("1gbit", 5),
    "100mbit-20ms": LinkShape("100mbit", 20),
    # rate only: the slow links of time_to_loss, where communication dominates a step
    "100mbit": LinkShape("100mbit"),
    "25mbit": LinkShape("25mbit"),
    "10mbit": LinkShape("10mbit"),
    "3mbit": LinkShape("3mbit"),
}


# CPU flags that decide which kernels bf16 matrix products take (and so a run's losses)
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def machine_kind(device: str = "cpu") -> str:
    """The kind of machine a run's figures belong to: the GPU's name, or the CPU's architecture,
    torch's CPU capability and its native-bf16 flags ("x86_64 AVX512 avx512_bf16 amx_bf16"). The
    same commit gives other losses on another kind (lab/notes/long-h.md), so a comparison's rows
    must all name one."""
    import platform

    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(0)
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    return " ".join([platform.machine(), torch.backends.cpu.get_cpu_capability(),
                     *(f for f in BF16_CPU_FLAGS if f in flags)])


# what rows written before the column existed name as their machine
NOT_RECORDED = "a machine not recorded"


def run_group(r: dict) -> tuple:
    """What a long_h row's figures are compared within (its summary's, the figures', measured.json's):
    its model size, replica count, budget, machine and data shards."""
    return (r["parameters"], r["replicas"], r["budget"], r.get("machine") or NOT_RECORDED,
            r.get("data_shards") or "contiguous")


@lru_cache(maxsize=1)
def _netem() -> bool:
    return netem_available()


def effective_shape(shape: LinkShape) -> tuple[LinkShape, bool]:
    """The shape this kernel can apply, and whether the delay is in it (netem may be missing)."""
    if shape.delay_ms and not _netem():
        return LinkShape(shape.rate, 0.0), False
    return shape, True


def add_model_args(ap) -> None:
    """The reference model's size options of the link benchmarks; :func:`model_of` reads them."""
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=128)


def add_repeat_args(ap) -> None:
    """Repeats per run (times are medians), on every link and entry or only some; :func:`repeats_per_run`
    reads them."""
    ap.add_argument("--repeats", type=int, default=1, help="times are medians over repeats")
    ap.add_argument("--repeat-links", default=None,
                    help="comma list: repeat only on these links (default: every link); the others run once")
    ap.add_argument("--repeat-entries", default=None,
                    help="comma list: repeat only these methods or peers (default: every one); the others run once")


def repeats_per_run(args, links: list[str], entries: list[str],
                    entries_flag: str = "--entries") -> dict[tuple[str, str], int]:
    """{(link, entry): repeats}: ``--repeats`` where both the link and the entry are repeated, else 1."""
    def chosen(flag: str, value: str | None, allowed: list[str], what: str) -> list[str]:
        names = allowed if value is None else [x.strip() for x in value.split(",")]
        if any(x not in allowed for x in names):
            raise SystemExit(f"{flag} must name {what} ({', '.join(allowed)}); got {value}")
        return names

    repeat_links = chosen("--repeat-links", args.repeat_links, links, "links of --links")
    repeat_entries = chosen("--repeat-entries", args.repeat_entries, entries, f"entries of {entries_flag}")
    return {(link, e): args.repeats if link in repeat_links and e in repeat_entries else 1
            for link in links for e in entries}


def model_of(args) -> dict:
    return {"n_layer": args.n_layer, "n_embd": args.n_embd, "seq_len": args.seq_len}


# Entries that are a method's recipe with more settings: Streaming DiLoCo as configs/diloco_streaming.json
# sets it (4 fragments, each landing 4 inner steps after it is sent).
# demo_recipe: demo at its recipe under another name, for a run where "demo" takes a sweep's
# configuration (time_to_loss --from-sweep) and the recipe is shown beside it.
# demo_topk2: the recipe keeping 2 of each 8x8 block's 64 DCT components (issue 32's exploration:
# the steps to the target least spread over seeds, at twice the bytes).
# demo_muon: the recipe stepping along Muon's orthogonalised q (embeddings by sign), issue 32's
# fewest steps; demo_muon_c16: the same keeping 2 of each 16x16 block's 256 components (its bytes
# target with its steps target).
# muloco: diloco with Muon (Nesterov) on the hidden matrices and AdamW on the rest as its inner
# optimizer (MuLoCo, arXiv 2505.23725); muloco_sparse: the same inner optimizer inside sparseloco
# (top-k of an error-feedback buffer, 2-bit values: MuLoCo's compressed design).
VARIANTS = {"diloco_streaming": ("diloco", {"fragments": 4, "sync_delay": 4}), "demo_recipe": ("demo", {}),
            "demo_topk2": ("demo", {"topk": 2}), "demo_muon": ("demo", {"update": "muon"}),
            "demo_muon_c16": ("demo", {"update": "muon", "chunk": 16, "topk": 2}),
            "muloco": ("diloco", {"inner_optimizer": "muon"}),
            "muloco_sparse": ("sparseloco", {"inner_optimizer": "muon"}),
            # issue 41: Muon's step taken locally, then its pseudo-gradient every 5 steps through demo's
            # codec (4 of each 8x8 block's 64 DCT components, 2-bit values, error feedback): MuLoCo's design
            # with DCT, ds_lowcomm's dct_diloco with inner_optimizer muon
            "muloco_dct": ("dct_diloco", {"inner_optimizer": "muon", "inner_muon_lr": 0.05, "sync_every": 5, "topk": 4,
                                          "chunk": 8, "value_dtype": "2bit", "decay": 0.99, "outer_lr": 1.0,
                                          "outer_momentum": 0.0, "average": "world"})}
# muloco_sign: the same outer loop with every element of the pseudo-gradient sent as one sign bit
# (a per-tensor scale, the mean magnitude; error feedback keeps the rest): no top-k, so no index
# travels, 1 bit a parameter a sync where muloco_dct's top-8 of 64 in 2 bits costs 1.25
VARIANTS["muloco_sign"] = ("dct_diloco", {**VARIANTS["muloco_dct"][1], "topk": 64, "transform": "none",
                                          "value_dtype": "sign", "inner_muon_lr": 0.05})
# The same two with their sync overlapped: sent without blocking and landing sync_delay inner steps
# later, the steps run meanwhile carried onto the new anchor (carry_local_steps). The delay is set
# from the link, not tuned on the loss: the fewest unshaped steps (0.084 s each on the bench's
# model) that cover one sync's payload at 3 Mbit/s (muloco_dct's 70 kB: 0.19 s, 3 steps;
# muloco_sparse's 195 kB: 0.52 s, 7 steps). muloco_sparse_overlap is MuLoCo's design with
# ds_lowcomm's overlap, to tell the codec's share of a lead from the overlap's.
VARIANTS["muloco_dct_overlap"] = ("dct_diloco", {**VARIANTS["muloco_dct"][1], "sync_delay": 3, "carry_local_steps": True})
VARIANTS["muloco_sparse_overlap"] = ("sparseloco", {"inner_optimizer": "muon", "sync_every": 10, "sync_delay": 7,
                                                    "carry_local_steps": True})
# muloco_sign_h10: the same at H 10, its grid's fewest bytes at muloco_dct's steps (the entries are
# tuned by steps, which picks H 5)
VARIANTS["muloco_sign_h10"] = ("dct_diloco", {**VARIANTS["muloco_sign"][1], "sync_every": 10})
# muloco_sign's payload (one bit a parameter, 56 kB): 0.15 s at 3 Mbit/s, 2 steps
VARIANTS["muloco_sign_overlap"] = ("dct_diloco", {**VARIANTS["muloco_sign"][1], "sync_delay": 2, "carry_local_steps": True})
# ... and by the same rule at 10 Mbit/s: 0.045 s, within one step
VARIANTS["muloco_sign_overlap_d1"] = ("dct_diloco", {**VARIANTS["muloco_sign_overlap"][1], "sync_delay": 1})


def method_spec(method: str, steps: int, eval_every: int, **model) -> TrainSpec:
    """The spec ``ds-lowcomm compare`` would run for ``method`` (its recipe, or a variant's
    settings over it), with ``steps``."""
    base = TrainSpec(steps=steps, warmup=max(1, steps // 15), eval_every=eval_every, model=model, label=method,
                     verbose=False)
    recipe, lowcomm = VARIANTS.get(method, (method, {}))
    return build_specs([recipe], base, {recipe: {"lowcomm": lowcomm}}, workers=2)[0]


def peer_spec(label: str, steps: int, eval_every: int, **model) -> TrainSpec:
    """A peer baseline's spec: the adamw recipe's data, model, learning rate and schedule (the
    peer itself goes to :func:`run_cached` beside it)."""
    return dataclasses.replace(method_spec("adamw", steps, eval_every, **model), label=label)


def run_cached(cache: Path, hosts: int, link: str, spec: TrainSpec, repeat: int = 0, peer: dict | None = None) -> dict:
    """Train ``spec`` on ``hosts`` test hosts over ``link`` (or load the cached result); ``peer``:
    a peer baseline's settings (see :mod:`lowcomm_bench.peers`) instead of the spec's method."""
    shape, delay_applied = effective_shape(LINKS[link])
    key = json.dumps({"spec": spec.to_dict(), "peer": peer, "hosts": hosts, "shape": [shape.rate, shape.delay_ms],
                      "repeat": repeat}, sort_keys=True)
    path = cache / f"{spec.label}-{hosts}h-{link}-r{repeat}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.json"
    if path.exists():
        return json.loads(path.read_text())
    with TestNetwork(hosts, shape) as net:
        per_rank, wall = run_on_hosts(net, spec, peer)
    r0 = per_rank[0]
    result = {
        "label": spec.label, "hosts": hosts, "link": link, "delay_applied": delay_applied, "repeat": repeat,
        "final_val_loss": r0["final_val_loss"], "wall_s": wall, "train_s": r0["train_s"],
        "bytes_sent_per_worker": sum(r["bytes_sent"] for r in per_rank) / hosts,
        "bytes_received_per_worker": sum(r["bytes_received"] for r in per_rank) / hosts,
        "comm_s": r0["comm_s"], "codec_s": r0["codec_s"], "history": r0["history"],
        "replicas_identical": len({r["params_digest"] for r in per_rank}) == 1,
    }
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return result


def at_target(history: list[dict], target: float, key: str) -> float | None:
    """``key`` of the evaluations (``train_s``, ``step``) where held-out loss first reaches
    ``target``, interpolated linearly in loss between evaluations from 0 before the first; None
    if it never does."""
    prev, prev_loss = 0.0, float("inf")
    for h in history:
        if h["val_loss"] <= target:
            if prev_loss == float("inf"):
                return h[key]
            frac = (prev_loss - target) / (prev_loss - h["val_loss"])
            return prev + frac * (h[key] - prev)
        prev, prev_loss = h[key], h["val_loss"]
    return None


def time_to_loss(history: list[dict], target: float) -> float | None:
    """Training seconds (evaluations left out) until held-out loss first reaches ``target``,
    interpolated linearly between evaluations; None if it never does."""
    return at_target(history, target, "train_s")


def loss_at_time(history: list[dict], budget: float) -> float:
    """Held-out loss reached within ``budget`` training seconds (the last evaluation before it,
    interpolated to the budget); the final loss when the run ended sooner."""
    prev = None
    for h in history:
        if h["train_s"] >= budget:
            if prev is None:
                return float("nan")  # no evaluation inside the budget
            frac = (budget - prev["train_s"]) / (h["train_s"] - prev["train_s"])
            return prev["val_loss"] + frac * (h["val_loss"] - prev["val_loss"])
        prev = h
    return history[-1]["val_loss"]
