"""``python -m lowcomm_bench codec``: how fast is the codec, and how much of a step does it cost?

1. Throughput: ds_lowcomm's codec (:class:`SparseSpec`: batched-matmul DCT, per-block top-k,
   12-bit packed indices) against a per-parameter implementation of the same math written here
   the way the published DeMo reference does it (reshape into blocks, DCT by einsum with basis
   matrices cached per size, ``torch.topk`` with int64 indices and fp32 values, decode by
   ``scatter_reduce(mean, include_self=False)`` and inverse einsum). Timed per sync of one rank:
   encode its own tensor (top-k plus the dense reconstruction error feedback subtracts), then
   decode the mean of ``--world`` ranks' payloads (the other ranks' payloads are made beforehand,
   as if they had arrived). Per tensor shape x chunk size, and over the reference model's whole
   parameter list (ds_lowcomm: one :class:`SparseAllGather` over a loopback transport; reference:
   a loop over parameters). Both must decode the same tensors (``max_abs_diff``, ``agree``).
2. Share of a training step: the reference task trained for a few steps with ``demo`` and
   ``dct_diloco`` (their ``compare`` recipes) on 2 local worker processes; codec_s / train_s.

Single-threaded (``torch.set_num_threads(1)``) so timings do not depend on what else runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ds_lowcomm.codec import ChunkPlan, SparseSpec
from ds_lowcomm.comm import ByteLedger, Pending, SparseAllGather, Transport
from lowcomm_task.compare import build_specs
from lowcomm_task.model import GPT, GPTConfig
from lowcomm_task.spec import TrainSpec
from lowcomm_task.train import train_worker
from lowcomm_task.workers import run_local_workers

COLUMNS = ["implementation", "case", "shape", "numel", "chunk", "topk", "world", "encode_s", "decode_s",
           "median_s", "gbps", "ops", "kept_values", "wire_bytes", "wire_bytes_per_value", "max_abs_diff", "agree"]
SHARE_COLUMNS = ["method", "workers", "steps", "syncs", "train_s", "codec_s", "codec_share", "step_s",
                 "codec_s_per_sync", "final_val_loss"]
IMPLEMENTATIONS = ("ds_lowcomm", "reference")
REFERENCE_BYTES_PER_VALUE = 12  # int64 index + fp32 value, as the reference sends them
SHARE_METHODS = ("demo", "dct_diloco")

DEFAULTS = {"shapes": "256x256,1024x1024,4096x1024,65536", "chunks": "16,32,64", "repeats": 5,
            "steps": 60, "sync_every": None, "n_layer": 2, "n_embd": 128, "seq_len": 128, "batch": 16, "compile": 1}
QUICK = {"shapes": "64x64,96x80,1000", "chunks": "8,16", "repeats": 1,
         "steps": 4, "sync_every": 2, "n_layer": 1, "n_embd": 32, "seq_len": 32, "batch": 2, "compile": 0}


# ---------------------------------------------------------------------------------------------
# The reference: per tensor, the way the published implementation does it. It uses the same
# block geometry (ChunkPlan) and per-block k (topk_count) as ds_lowcomm, so both do equal work:
# the published code cuts vectors into pieces of at most `chunk` and keeps `topk` per block
# whatever its size; here vectors are pieces of chunk*chunk and small blocks keep fewer.
# ---------------------------------------------------------------------------------------------

_REF_BASES: dict[tuple[int, torch.device], torch.Tensor] = {}


def ref_basis(n: int, device: torch.device) -> torch.Tensor:
    """Orthonormal DCT-II matrix (n x n), built at the first use of each size and cached, as the
    reference builds one per size when it is set up."""
    key = (n, torch.device(device))
    if key not in _REF_BASES:
        k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
        i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
        basis = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
        basis[0] = math.sqrt(1.0 / n)
        _REF_BASES[key] = basis.to(torch.float32).to(device)
    return _REF_BASES[key]


def ref_to_blocks(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """x -> (num_blocks, h, w) with plain reshape/permute (the reference uses einops.rearrange)."""
    flat = x.reshape(-1)
    if plan.pad:
        flat = torch.cat([flat, flat.new_zeros(plan.pad)])
    r, c = plan.rows // plan.h, plan.cols // plan.w
    return flat.reshape(r, plan.h, c, plan.w).permute(0, 2, 1, 3).reshape(-1, plan.h, plan.w)


def ref_from_blocks(blocks: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    r, c = plan.rows // plan.h, plan.cols // plan.w
    flat = blocks.reshape(r, c, plan.h, plan.w).permute(0, 2, 1, 3).reshape(-1)
    return flat[: plan.numel].reshape(plan.shape)


def ref_encode(x: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """DCT of every block by einsum (1-D for vector pieces, 2-D for matrix blocks): (num_blocks, h*w)."""
    blocks = ref_to_blocks(x.float(), plan)
    cw = ref_basis(plan.w, x.device)
    if plan.h == 1:
        return torch.einsum("ni,bi->nb", blocks.reshape(-1, plan.w), cw)
    ch = ref_basis(plan.h, x.device)
    return torch.einsum("ai,nij,bj->nab", ch, blocks, cw).reshape(plan.num_blocks, -1)


def ref_decode(coeffs: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    cw = ref_basis(plan.w, coeffs.device)
    if plan.h == 1:
        return ref_from_blocks(torch.einsum("nb,bi->ni", coeffs, cw), plan)
    ch = ref_basis(plan.h, coeffs.device)
    blocks = torch.einsum("ai,nab,bj->nij", ch, coeffs.reshape(-1, plan.h, plan.w), cw)
    return ref_from_blocks(blocks, plan)


def ref_scatter_mean(idx: torch.Tensor, vals: torch.Tensor, plan: ChunkPlan) -> torch.Tensor:
    """Values into zero blocks, averaged over repeated indices (the ranks that sent them)."""
    blocks = torch.zeros(plan.num_blocks, plan.block_size, dtype=torch.float32, device=vals.device)
    return blocks.scatter_reduce_(-1, idx, vals, reduce="mean", include_self=False)


def ref_compress(x: torch.Tensor, plan: ChunkPlan, k: int):
    """x -> (int64 indices, fp32 values, the dense tensor they stand for). The reference decodes
    its own top-k right away: error feedback subtracts it from the momentum."""
    coeffs = ref_encode(x, plan)
    idx = torch.topk(coeffs.abs(), k, dim=-1, largest=True, sorted=False).indices
    vals = torch.gather(coeffs, -1, idx)
    return idx, vals, ref_decode(ref_scatter_mean(idx, vals, plan), plan)


def ref_decompress_mean(idx_per_rank, vals_per_rank, plan: ChunkPlan) -> torch.Tensor:
    """All ranks' (indices, values), concatenated per block, -> their mean as a dense tensor."""
    idx, vals = torch.cat(list(idx_per_rank), dim=-1), torch.cat(list(vals_per_rank), dim=-1)
    return ref_decode(ref_scatter_mean(idx, vals, plan), plan)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_encode_decode(setup, encode, decode, repeats: int, device: torch.device) -> tuple[float, float, float]:
    """Medians (encode, decode, encode+decode) over ``repeats`` calls after one warm-up call.
    ``setup()`` makes fresh inputs outside the timed region; ``decode`` takes what ``encode`` returned."""
    enc, dec, tot = [], [], []
    for i in range(repeats + 1):
        inputs = setup()
        _sync(device)
        t0 = time.perf_counter()
        out = encode(inputs)
        _sync(device)
        t1 = time.perf_counter()
        decode(out)
        _sync(device)
        t2 = time.perf_counter()
        if i:  # the first call warms up (allocations, bases, kernels)
            enc.append(t1 - t0)
            dec.append(t2 - t1)
            tot.append(t2 - t0)
    return statistics.median(enc), statistics.median(dec), statistics.median(tot)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.overloadpacket not in _NOT_KERNELS:
            self.ops += 1
        return func(*args, **(kwargs or {}))


# Ops that allocate or describe without computing: no kernel on a GPU.
_NOT_KERNELS = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided,
                torch.ops.aten.lift_fresh, torch.ops.aten._local_scalar_dense, torch.ops.aten._unsafe_view}


def count_ops(setup, encode, decode) -> int:
    """Compute ops (aten ops that are not views or bare allocations: on a GPU, about one kernel
    launch each) of one encode + decode; launches, not arithmetic, bound a GPU on small tensors."""
    inputs = setup()
    with _OpCounter() as counter:
        decode(encode(inputs))
    return counter.ops


def agreement(lowcomm: list[torch.Tensor], reference: list[torch.Tensor]) -> tuple[float, bool]:
    """Largest absolute difference between matching decoded tensors, and whether it is within fp32
    rounding (a larger one means the two picked different top-k: a bug, or a near-tie)."""
    diff, scale = 0.0, 1.0
    for a, b in zip(lowcomm, reference):
        diff = max(diff, (a.float() - b.float()).abs().max().item())
        scale = max(scale, b.abs().max().item())
    return diff, diff <= 1e-5 * scale


def make_row(impl, case, shape, numel, chunk, topk, world, times, ops, kept, wire, diff, agree) -> dict:
    enc, dec, tot = times
    return {"implementation": impl, "case": case, "shape": shape, "numel": numel, "chunk": chunk, "topk": topk,
            "world": world, "encode_s": enc, "decode_s": dec, "median_s": tot, "gbps": 4 * numel / tot / 1e9,
            "ops": ops,
            "kept_values": kept, "wire_bytes": wire, "wire_bytes_per_value": wire / kept,
            "max_abs_diff": diff, "agree": agree}


# ---------------------------------------------------------------------------------------------
# 1a. One tensor
# ---------------------------------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.lower().split("x"))


def rank_inputs(shape, world: int, device, seed: int = 0) -> list[torch.Tensor]:
    """One tensor per simulated rank; different data, so the ranks' top-k overlap only in part."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).to(device) for _ in range(world)]


def bench_tensor(shape, chunk: int, topk: int, args, device) -> list[dict]:
    xs = rank_inputs(shape, args.world, device)
    spec = SparseSpec.build(shape, chunk=chunk, topk=topk, value_dtype="fp32")
    plan, k = spec.plan, spec.k
    # What the other ranks sent, made beforehand: this rank only decodes it.
    others = [spec.compress(x)[0] for x in xs[1:]]
    ref_others = [ref_compress(x, plan, k)[:2] for x in xs[1:]]

    def lc_encode(x):
        return spec.compress(x)

    def lc_decode(out):
        return spec.decompress_mean(torch.stack([out[0], *others]), "senders")

    def ref_encode_one(x):
        return ref_compress(x, plan, k)

    def ref_decode_all(out):
        return ref_decompress_mean([out[0], *(o[0] for o in ref_others)], [out[1], *(o[1] for o in ref_others)], plan)

    # Equal work: the same error-feedback reconstruction and the same mean over ranks.
    lc_out, ref_out = lc_encode(xs[0]), ref_encode_one(xs[0])
    diff, agree = agreement([lc_out[1], lc_decode(lc_out)], [ref_out[2], ref_decode_all(ref_out)])

    name, numel = "x".join(map(str, shape)), math.prod(shape)
    rows = []
    for impl, enc, dec, wire in (("ds_lowcomm", lc_encode, lc_decode, spec.nbytes),
                                 ("reference", ref_encode_one, ref_decode_all, REFERENCE_BYTES_PER_VALUE * spec.count)):
        times = time_encode_decode(lambda: xs[0], enc, dec, args.repeats, device)
        ops = count_ops(lambda: xs[0], enc, dec)
        rows.append(make_row(impl, "tensor", name, numel, chunk, topk, args.world, times, ops, spec.count, wire,
                             diff, agree))
    return rows


# ---------------------------------------------------------------------------------------------
# 1b. The reference model's whole parameter list
# ---------------------------------------------------------------------------------------------


class LoopbackTransport(Transport):
    """Rank 0 of a simulated world: an all-gather returns this rank's payload stacked on payloads
    the other ranks sent earlier. No bytes move, so SparseAllGather's own code is what is timed."""

    def __init__(self, others: list[torch.Tensor], device):
        self.rank, self.world_size = 0, 1 + len(others)
        self.ledger, self.device = ByteLedger(), torch.device(device)
        self.others = others

    def start_all_gather_bytes(self, payload, op="all_gather"):
        return Pending(lambda: torch.stack([payload, *self.others]), None)


def model_shapes() -> list[tuple[int, ...]]:
    return [tuple(p.shape) for p in GPT(GPTConfig()).parameters()]


def bench_model(chunk: int, topk: int, args, device) -> list[dict]:
    shapes = model_shapes()
    per_rank = [list(t) for t in zip(*[rank_inputs(s, args.world, device, seed=i) for i, s in enumerate(shapes)])]
    specs = [SparseSpec.build(s, chunk=chunk, topk=topk, value_dtype="fp32") for s in shapes]  # as SparseAllGather's
    healthy = torch.ones(1, dtype=torch.uint8, device=device)  # SparseAllGather's trailing health flag byte
    others = [torch.cat([spec.compress(x)[0] for spec, x in zip(specs, bufs)] + [healthy]) for bufs in per_rank[1:]]
    sag, compiled = (SparseAllGather(shapes, chunk=chunk, topk=topk, value_dtype="fp32", compile=c,
                                     transport=LoopbackTransport(others, device), average="senders")
                     for c in (False, True))
    ref_others = [[ref_compress(x, s.plan, s.k)[:2] for s, x in zip(specs, bufs)] for bufs in per_rank[1:]]

    def fresh():  # exchanges subtract what they send from their buffers (error feedback)
        return [x.clone() for x in per_rank[0]]

    def ref_encode_all(bufs):
        sent = []
        for s, buf in zip(specs, bufs):
            idx, vals, dense = ref_compress(buf, s.plan, s.k)
            buf.sub_(dense)
            sent.append((idx, vals))
        return sent

    def ref_decode_all(sent):
        out = []
        for i, s in enumerate(specs):
            idx = [sent[i][0], *(o[i][0] for o in ref_others)]
            vals = [sent[i][1], *(o[i][1] for o in ref_others)]
            out.append(ref_decompress_mean(idx, vals, s.plan))
        return out

    lc_bufs, ref_bufs = fresh(), fresh()
    lc_means = sag.exchange(lc_bufs)
    ref_means = ref_decode_all(ref_encode_all(ref_bufs))
    diff, agree = agreement(lc_means + lc_bufs, ref_means + ref_bufs)  # the means and the residuals

    numel = sum(math.prod(s) for s in shapes)
    kept = sum(s.count for s in specs)
    name = f"GPT({len(shapes)} tensors)"
    rows = []
    impls = [("ds_lowcomm", sag.start, Pending.wait, sag.payload_bytes),
             ("reference", ref_encode_all, ref_decode_all, REFERENCE_BYTES_PER_VALUE * kept)]
    if args.compile:  # the codec's "compile" setting; its graphs compile here (tens of seconds), untimed
        compiled.exchange(fresh())
        impls.insert(1, ("ds_lowcomm compile", compiled.start, Pending.wait, compiled.payload_bytes))
    for impl, enc, dec, wire in impls:
        times = time_encode_decode(fresh, enc, dec, args.repeats, device)
        # under the op counter's dispatch mode compiled code runs eagerly: no count for it
        ops = None if impl.endswith("compile") else count_ops(fresh, enc, dec)
        rows.append(make_row(impl, "model", name, numel, chunk, topk, args.world, times, ops, kept, wire, diff,
                             agree))
    return rows


# ---------------------------------------------------------------------------------------------
# 2. The codec's share of a training step
# ---------------------------------------------------------------------------------------------


def share_specs(args) -> list[TrainSpec]:
    """Worker specs as ``ds-lowcomm compare`` builds them, with the methods' recipes."""
    small_data = {"max_train_bytes": 200_000, "max_val_bytes": 20_000, "val_batches": 2} if args.quick else {}
    base = TrainSpec(steps=args.steps, batch=args.batch, warmup=max(1, args.steps // 10), eval_every=args.steps,
                     model=GPTConfig(n_layer=args.n_layer, n_embd=args.n_embd, seq_len=args.seq_len), verbose=False,
                     **small_data)
    overrides = {"dct_diloco": {"lowcomm": {"sync_every": args.sync_every}}} if args.sync_every else {}
    return build_specs(list(SHARE_METHODS), base, overrides, args.workers)


def share_row(spec: TrainSpec, per_rank: list[dict], workers: int) -> dict:
    train_s = statistics.mean(r["train_s"] for r in per_rank)
    codec_s = statistics.mean(r["codec_s"] for r in per_rank)
    ops = per_rank[0]["ledger"]["by_op"]
    syncs = sum(v["calls"] for op, v in ops.items() if op != "setup")
    return {"method": spec.lowcomm["method"], "workers": workers, "steps": spec.steps, "syncs": syncs,
            "train_s": train_s, "codec_s": codec_s, "codec_share": codec_s / train_s if train_s else 0.0,
            "step_s": train_s / spec.steps, "codec_s_per_sync": codec_s / syncs if syncs else 0.0,
            "final_val_loss": per_rank[0]["final_val_loss"], "settings": per_rank[0]["settings"]}


def train_methods(rank: int, world_size: int, specs: list[TrainSpec]) -> list[dict]:
    """One worker trains every method in turn: the processes start once, not once per method."""
    return [train_worker(rank, world_size, spec) for spec in specs]


def bench_share(args) -> list[dict]:
    specs = share_specs(args)
    per_rank = run_local_workers(train_methods, args.workers, specs)
    rows = []
    for i, spec in enumerate(specs):
        row = share_row(spec, [results[i] for results in per_rank], args.workers)
        rows.append(row)
        print(f"share {row['method']:<11} train {row['train_s']:.2f} s, codec {row['codec_s']:.3f} s "
              f"({100 * row['codec_share']:.1f}%), {row['syncs']} syncs", flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# Outputs and the command line
# ---------------------------------------------------------------------------------------------


def read_typed_csv(path, ints=(), floats=()) -> list[dict]:
    """A benchmark's CSV rows, the columns ``ints`` and ``floats`` typed (None where empty)."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            for keys, kind in ((ints, int), (floats, float)):
                for k in keys:
                    r[k] = kind(r[k]) if r.get(k) not in (None, "") else None
            out.append(r)
    return out


def summary_path(out) -> Path:
    """Where a collected CSV's summary goes: beside it, ``<stem>-summary.csv``."""
    return Path(out).with_name(f"{Path(out).stem}-summary.csv")


def collect_csv(out, sources: list[str], read, key: tuple, order, columns: list[str], summarize,
                summary_columns: list[str]) -> list[dict]:
    """Every row of ``sources`` (a benchmark's CSVs, read by ``read``) into ``out`` and their summary
    beside it (:func:`summary_path`); a row ``out`` already holds with the same ``key`` columns is
    replaced; rows sorted by ``order``."""
    rows = {}
    for path in ([out] if Path(out).exists() else []) + list(sources):
        for r in read(path):
            rows[tuple(r[k] for k in key)] = r
    rows = sorted(rows.values(), key=order)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_csv(Path(out), rows, columns)
    write_csv(summary_path(out), summarize(rows), summary_columns)
    return rows


def collect_args(argv: list[str], what: str) -> tuple[str, list[str]] | None:
    """``--collect OUT SOURCE...`` as a benchmark's first arguments: (OUT, SOURCEs); None without it."""
    if argv[:1] != ["--collect"]:
        return None
    if len(argv) < 3:
        raise SystemExit(f"--collect OUT SOURCE [SOURCE...]: the {what} to write, then the runs' CSVs")
    return argv[1], argv[2:]


def write_csv(path: Path, rows: list[dict], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def plot(path: Path, rows: list[dict], device: str = "cpu") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    tensor_rows = [r for r in rows if r["case"] == "tensor"]
    chunks = sorted({r["chunk"] for r in tensor_rows})
    for impl, style, vector_marker in zip(IMPLEMENTATIONS, ("-", "--"), ("x", "+")):
        for i, chunk in enumerate(chunks):  # one colour per chunk size, one line style per implementation
            mine = [r for r in tensor_rows if r["implementation"] == impl and r["chunk"] == chunk]
            matrices = sorted((r["numel"], r["gbps"]) for r in mine if "x" in r["shape"])
            vectors = [(r["numel"], r["gbps"]) for r in mine if "x" not in r["shape"]]
            if matrices:
                ax.plot(*zip(*matrices), style, marker="o", color=f"C{i}", label=f"{impl}, chunk {chunk}")
            if vectors:  # vectors are cut differently (pieces of chunk^2): points off the lines
                ax.plot(*zip(*vectors), vector_marker, ms=9, color=f"C{i}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tensor size (elements, log)")
    ax.set_ylabel("encode + decode throughput (GB/s of fp32 input, log)")
    world = rows[0]["world"] if rows else 0
    where = "1 CPU thread" if device == "cpu" else device
    ax.set_title(f"Codec per sync of one rank (mean of {world} ranks' payloads), {where};\n"
                 "x / +: 1-D vectors (ds_lowcomm / reference)", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_rows(rows: list[dict]) -> None:
    for r in rows:
        print(f"{r['implementation']:<11}{r['shape']:>18} chunk {r['chunk']:>3}  {r['median_s'] * 1e3:9.2f} ms "
              f"{r['gbps']:8.3f} GB/s {r['ops'] if r['ops'] is not None else '-':>6} ops  {r['wire_bytes_per_value']:5.2f} B/value  diff {r['max_abs_diff']:.1e}",
              flush=True)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m lowcomm_bench codec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench/codec")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and 1 repeat (smoke test)")
    ap.add_argument("--repeats", type=int,
                    help=f"timed calls per case, after a warm-up (default {DEFAULTS['repeats']})")
    ap.add_argument("--shapes", help=f"comma list of RxC or N (default {DEFAULTS['shapes']})")
    ap.add_argument("--chunks", help=f"comma list of chunk sizes (default {DEFAULTS['chunks']})")
    ap.add_argument("--density", type=float, default=1 / 128, help="kept fraction topk/chunk^2 (DeMo's 32/4096)")
    ap.add_argument("--world", type=int, default=2, help="simulated ranks whose payloads are decoded")
    ap.add_argument("--device", default="cpu", help="device of the throughput part (the training part runs on CPU)")
    ap.add_argument("--workers", type=int, default=2, help="worker processes of the training part")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--sync-every", type=int, help="dct_diloco's H (default: its recipe's)")
    ap.add_argument("--n-layer", type=int)
    ap.add_argument("--n-embd", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--skip-share", action="store_true", help="throughput only")
    ap.add_argument("--compile", type=int, choices=(0, 1),
                    help=f"add the model list with the codec's compile setting (default {DEFAULTS['compile']})")
    args = ap.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.world < 1 or args.repeats < 1:
        raise SystemExit("--world and --repeats must be >= 1")
    return args


def run_throughput(args) -> list[dict]:
    device = torch.device(args.device)
    rows = []
    for chunk in (int(c) for c in args.chunks.split(",")):
        topk = max(1, round(args.density * chunk * chunk))
        for shape in (parse_shape(s) for s in args.shapes.split(",")):
            rows += bench_tensor(shape, chunk, topk, args, device)
        rows += bench_model(chunk, topk, args, device)
        print_rows(rows[-(2 * len(args.shapes.split(",")) + 2 + args.compile):])
    bad = [r for r in rows if not r["agree"]]
    if bad:
        print(f"WARNING: ds_lowcomm and the reference decoded different tensors in {len(bad)} rows "
              f"(max diff {max(r['max_abs_diff'] for r in bad):.2e}): a bug, or top-k near-ties")
    return rows


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # stable timings on a shared machine; the training part sets its own
    try:
        rows = run_throughput(args)
    finally:
        torch.set_num_threads(threads)
    share = [] if args.skip_share else bench_share(args)
    write_csv(out / "codec.csv", rows, COLUMNS)
    write_csv(out / "codec_share.csv", share, SHARE_COLUMNS)
    summary = {"args": vars(args), "threads": 1, "rows": rows, "share": share}
    (out / "codec.json").write_text(json.dumps(summary, indent=1))
    plot(out / "codec.png", rows, args.device)
    return {"rows": rows, "share": share}
