"""Cross-replica syncs matched by parameter name, for replicas of different shapes.

Replicas of one shape pair rank ``j`` of every replica (the cross group of
:class:`~ds_lowcomm.comm.topology.ReplicaTopology`). Replicas of different shapes do not: one
replica holds the whole model on one rank, another holds it as pipeline stages on several ranks,
a third partitions it ZeRO-1 style over two ranks. Here every rank describes what it holds, as
pieces of named parameters (:class:`Piece`), and the ranks agree at start-up on:

- segments: each parameter cut at every edge any rank's piece has (a stage boundary never cuts a
  parameter; a ZeRO partition edge may), so a segment lies whole inside one piece on every holder;
- routes: the segments held by the same ranks form one route, synced by one collective over a
  process group of exactly those ranks. Routes run in one global order (sorted by their ranks),
  each rank taking part in its own, so no two ranks wait on each other in opposite orders.

A segment may have several holders in one replica (tied layers on two stages, data-parallel
copies at ZeRO 0); their values are identical, so each counts ``1/copies`` of its replica's
weight. Replica weights make the route's mean a weighted one (tokens per outer step).

Every check runs before any training and raises on every rank alike: a parameter a replica does
not cover, or one whose shape differs between ranks.
"""

from __future__ import annotations

import atexit
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch
import torch.distributed as dist

from ..settings import ConfigError
from .collectives import Pieces, SparseAllGather, _numel, start_all_reduce_mean_
from .consistency import assert_same_across_ranks, gather_json
from .ledger import ByteLedger
from .transport import CollectiveError, Pending, TorchDistTransport


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, start + length)`` of parameter ``name`` (of ``shape``, flattened) lie at
    ``offset`` in one of this rank's tensors (flattened)."""

    name: str
    shape: tuple[int, ...]
    start: int
    length: int
    offset: int


def whole(name: str, shape: Sequence[int]) -> Piece:
    """A tensor that is the whole parameter ``name``."""
    shape = tuple(int(d) for d in shape)
    return Piece(name, shape, 0, _numel(shape), 0)


@dataclass
class Route:
    """Segments held by the same ranks: one collective over ``transport`` (those ranks)."""

    ranks: tuple[int, ...]  # global, ascending
    transport: TorchDistTransport
    weights: list[float]  # per rank of the route (in ``ranks`` order)
    names: list[tuple[str, int, int]]  # (parameter, start, length) per segment, for checks and errors
    # per segment: (tensor index, offset in the flattened tensor, shape it is coded with)
    segments: list[tuple[int, int, tuple[int, ...]]]

    @property
    def numel(self) -> int:
        return sum(_numel(shape) for _, _, shape in self.segments)

    def pieces(self) -> Pieces:
        out, offset = [], 0
        for _, _, shape in self.segments:
            out.append((offset, shape))
            offset += _numel(shape)
        return Pieces(offset, tuple(out))

    def gather(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """This route's segments of ``tensors``, end to end (a new tensor)."""
        parts = [tensors[i].reshape(-1)[o : o + _numel(s)] for i, o, s in self.segments]
        flat = torch.cat(parts)
        return flat if dtype is None else flat.to(dtype)

    def scatter(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        """Write ``flat`` (as from :meth:`gather`) back into the segments of ``tensors``."""
        at = 0
        for i, o, s in self.segments:
            n = _numel(s)
            view = tensors[i].view(-1)[o : o + n]
            view.copy_(flat[at : at + n].to(view.dtype))
            at += n


class Routes:
    """This rank's routes over a fixed list of tensors (see the module docstring).

    Build with :meth:`build` (collective over the whole job). Then:
    :meth:`sparse_all_gather` / :meth:`start_all_reduce_mean_` / :meth:`broadcast_` take tensors in
    the order of the holdings given to :meth:`build`.
    """

    def __init__(self, routes: list[Route], numels: list[int], ledger: ByteLedger, board: "SyncBoard | None" = None):
        self.routes = routes
        self.numels = numels
        self.ledger = ledger
        self.board = board  # with ``sync_board``: where every peer is, checked before each exchange

    def leave(self, what: str, final: bool = False) -> None:
        """Tell the peers this rank goes on to ``what`` after the exchanges so far: a step every
        rank of the job takes (a checkpoint), or, ``final``, no more exchanges at all (the end of
        training). A peer waiting for a further exchange is told at once (:class:`SyncBoard`).
        Nothing without a board."""
        if self.board is not None:
            self.board.leave(what, final)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, holdings: Sequence[Sequence[Piece]], numels: Sequence[int], replicas: Sequence[Sequence[int]],
              replica_weights: Sequence[float] | None = None, *, ledger: ByteLedger | None = None,
              timeout_s: float | None = None, what: str = "parameter", sync_board: str | None = None) -> "Routes":
        """``holdings[i]``: the pieces of this rank's tensor ``i`` (of ``numels[i]`` elements);
        ``replicas``: each replica's global ranks; ``replica_weights``: each replica's weight in
        the means (default equal). ``sync_board``: keep a :class:`SyncBoard` of the exchanges,
        this text added to its errors (what each replica must run). Collective: every rank of the
        job calls it, at the same point."""
        if len(holdings) != len(numels):
            raise ValueError("holdings and numels: one entry per tensor")
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = [[(p.name, list(p.shape), p.start, p.length, p.offset, i) for p in pieces]
                for i, pieces in enumerate(holdings)]
        # every rank's holdings (a bounded collective over the whole job; start-up, in no ledger)
        job = TorchDistTransport(ledger=ByteLedger(), timeout_s=timeout_s)
        everyone = gather_json(job, [x for tensor in mine for x in tensor])
        replica_of = {r: k for k, ranks in enumerate(replicas) for r in ranks}
        if sorted(replica_of) != list(range(world)):
            raise ValueError(f"replicas must cover ranks 0..{world - 1} once; got {replicas}")
        weights = [1.0] * len(replicas) if replica_weights is None else [float(w) for w in replica_weights]
        plan = _plan(everyone, replicas, replica_of, what)
        timeout = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
        ledger = ledger if ledger is not None else ByteLedger()
        routes = []
        for ranks, segments in plan:  # every rank creates every group, in the same (sorted) order
            group = _group(ranks, timeout)
            if rank not in ranks:
                continue
            copies = {}
            for r in ranks:
                copies[replica_of[r]] = copies.get(replica_of[r], 0) + 1
            route_weights = [weights[replica_of[r]] / copies[replica_of[r]] for r in ranks]
            local = []
            for name, shape, start, length in segments:
                # the piece of mine that holds this segment
                for pname, _, pstart, plength, poffset, index in everyone[rank]:
                    if pname == name and pstart <= start and start + length <= pstart + plength:
                        coded = tuple(shape) if length == _numel(shape) else (length,)
                        local.append((index, poffset + start - pstart, coded))
                        break
            routes.append(Route(ranks, TorchDistTransport(group, ledger=ledger), route_weights,
                                [(n, s, l) for n, _, s, l in segments], local))
        board = None
        if sync_board is not None:
            peers = sorted({r for route in routes for r in route.ranks} - {rank})
            board = SyncBoard(peers, replica_of, timeout_s, sync_board)
        return cls(routes, list(numels), ledger, board)

    # -- collectives -------------------------------------------------------------------------
    def check_same(self, settings: dict, tensors: Sequence[torch.Tensor]) -> None:
        """Every route's ranks have the same settings and segments, and start from the same values."""
        for route in self.routes:
            assert_same_across_ranks(route.transport, {**settings, "segments": route.names, "weights": route.weights},
                                     [route.gather(tensors)])

    def broadcast_(self, tensors: Sequence[torch.Tensor], op: str = "broadcast") -> None:
        """Every holder takes the values of the route's first rank (the lowest global rank)."""
        for route in self.routes:
            flat = route.gather(tensors)
            route.transport.broadcast_(flat, src=0, op=op)
            route.scatter(flat, tensors)

    def start_all_reduce_mean_(self, tensors: Sequence[torch.Tensor], op: str = "all_reduce") -> Pending:
        """Weighted mean over each route's ranks, in place once ``wait()`` returns."""
        if self.board is not None:
            self.board.enter(op)
        started = []
        for route in self.routes:
            flat = route.gather(tensors)
            started.append((route, flat, start_all_reduce_mean_([flat], route.transport, op, route.weights)))

        def finish():
            for route, flat, pending in started:
                pending.wait()
                route.scatter(flat, tensors)
            return list(tensors)

        return Pending(finish, None)

    def sparse_all_gather(self, op: str = "sparse_all_gather", **codec) -> "RoutedSparseAllGather":
        return RoutedSparseAllGather(self, op, codec)


class RoutedSparseAllGather:
    """:class:`SparseAllGather` per route, with the same ``start``/``exchange`` contract over the
    rank's whole tensor list: error feedback in place, and per tensor the weighted mean over the
    holders (fp32; elements in no piece, such as ZeRO padding, are 0)."""

    def __init__(self, routes: Routes, op: str, codec: dict):
        self.routes = routes
        self.op = op
        self.syncs = [SparseAllGather([route.pieces()], transport=route.transport, op=op, weights=route.weights,
                                      **codec) for route in routes.routes]

    @property
    def payload_bytes(self) -> int:
        return sum(s.payload_bytes for s in self.syncs)

    def exchange(self, buffers: Sequence[torch.Tensor], healthy: bool = True) -> list[torch.Tensor]:
        return self.start(buffers, healthy).wait()

    def start(self, buffers: Sequence[torch.Tensor], healthy: bool = True) -> Pending:
        if len(buffers) != len(self.routes.numels):
            raise ValueError(f"expected {len(self.routes.numels)} tensors, got {len(buffers)}")
        if self.routes.board is not None:
            self.routes.board.enter(self.op)
        started = []
        for route, sync in zip(self.routes.routes, self.syncs):
            flat = route.gather(buffers)
            pending = sync.start([flat], healthy)  # removes what it sends from flat (error feedback)
            route.scatter(flat, buffers)
            started.append((route, pending))

        def finish():
            start = time.perf_counter()
            out = [torch.zeros(b.shape, dtype=torch.promote_types(b.dtype, torch.float32), device=b.device)
                   for b in buffers]
            for route, pending in started:
                route.scatter(pending.wait()[0], out)
            self.routes.ledger.add_time("codec", time.perf_counter() - start)
            return out

        return Pending(finish, None)


class SyncBoard:
    """Where each rank is in the sequence of exchanges, on torch.distributed's store (the job's
    rendezvous store, beside the collectives), so that replicas which run different numbers of
    syncs are told so at the first sync one of them will never join, instead of at ``timeout_s``.

    Replicas of different shapes run their own loops (``inner_steps`` apart): a script that runs
    the same number of steps on every replica makes one replica sync more often than the other
    ever will. Every rank posts ``"<exchanges entered>|<steps left for>|<where>"`` under its rank:
    before each exchange, and when it leaves the exchanges, either for a step every rank of the job
    takes (a checkpoint: ``leave``) or for good (the end of training, exit: ``final``). Before
    exchange ``k`` a rank waits until every peer of its routes has entered exchange ``k`` too. A peer
    that entered fewer and left for good will never come; one that left for a job-wide step this
    rank has not taken waits there for this rank: either way every rank that sees it raises,
    naming both. (A peer still posted in a job-wide step this rank has taken too is on its way
    back.) One store write and a few reads per exchange: latency, no payload.
    """

    _count = 0  # boards built in this process: every rank builds them in the same order

    def __init__(self, peers: list[int], replica_of: dict[int, int], timeout_s: float | None, hint: str):
        SyncBoard._count += 1
        # torch's default store (private to torch.distributed, but every launcher's rendezvous store)
        self.store = dist.PrefixStore(f"lowcomm/board{SyncBoard._count}/", dist.distributed_c10d._get_default_store())
        self.rank, self.peers, self.replica_of = dist.get_rank(), peers, replica_of
        self.timeout_s, self.hint = timeout_s, hint
        self.entered = 0  # exchanges this rank entered
        self.steps = 0  # job-wide steps this rank left the exchanges for
        atexit.register(self._exit)

    def _post(self, where: str) -> None:
        self.store.set(str(self.rank), f"{self.entered}|{self.steps}|{where}")

    def leave(self, what: str, final: bool = False) -> None:
        if not final:
            self.steps += 1
        self._post(("final " if final else "") + what)

    def _exit(self) -> None:
        try:
            self.leave("exited", final=True)
        except Exception:  # noqa: BLE001 - the store may be gone with rank 0's process
            pass

    def _where(self, peer: int) -> tuple[int, int, str]:
        key = str(peer)
        if not self.store.check([key]):
            return 0, 0, "exchange (not yet posted)"
        entered, steps, where = self.store.get(key).decode().split("|", 2)
        return int(entered), int(steps), where

    def _name(self, r: int) -> str:
        return f"rank {r} (replica {self.replica_of[r]})"

    def enter(self, op: str) -> None:
        self.entered += 1
        k = self.entered
        self._post(f"exchange {op}")
        waiting, pause = set(self.peers), 0.0005
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while waiting:
            for peer in sorted(waiting):
                entered, steps, where = self._where(peer)
                if entered >= k:
                    waiting.discard(peer)
                elif where.startswith("final ") or (not where.startswith("exchange") and steps > self.steps):
                    raise CollectiveError(
                        f"{op}: this {self._name(self.rank)} is at its sync {k}, but {self._name(peer)} left the "
                        f"syncs after {entered} ({where.removeprefix('final ')}) and will not join it: the replicas "
                        f"ran different numbers of syncs. {self.hint}")
            if waiting and deadline is not None and time.monotonic() > deadline:
                states = "; ".join(f"{self._name(p)}: sync {entered} ({where})"
                                   for p in sorted(waiting) for entered, _, where in [self._where(p)])
                raise CollectiveError(f"{op}: this {self._name(self.rank)} waited {self.timeout_s} s at its sync {k} "
                                      f"for {states}: a peer stalled or died, or the replicas run different "
                                      f"numbers of syncs. {self.hint}")
            if waiting:
                time.sleep(pause)
                pause = min(2 * pause, 0.05)


# default group -> {(ranks, timeout): group}, reused by later builds; weakly, as comm/topology.py's
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _group(ranks: tuple[int, ...], timeout: dict):
    key = (ranks, tuple(timeout.items()))
    built = _GROUPS.setdefault(dist.distributed_c10d._get_default_group(), {})
    if key in built:
        return built[key]
    group = dist.new_group(list(ranks), **timeout)
    if dist.get_rank() not in ranks:
        # Keep every rank's count of groups in step: torch names a group made with local
        # synchronisation (DeepSpeed's inside a replica, subworld.py) from the count its members
        # hold, and a member that holds one group fewer would wait for a differently named one.
        dist.new_group([dist.get_rank()], use_local_synchronization=True)
    built[key] = group
    return group


def _plan(everyone, replicas, replica_of, what: str):
    """[(ranks, [(name, shape, start, length), ...]), ...] sorted by ranks: the routes of the job."""
    order: dict[str, int] = {}  # parameters in first-seen order (rank by rank)
    shapes: dict[str, tuple[list[int], int]] = {}
    spans: dict[str, list[tuple[int, int, int]]] = {}  # name -> (start, end, rank)
    for rank, pieces in enumerate(everyone):
        for name, shape, start, length, _, _ in pieces:
            order.setdefault(name, len(order))
            seen = shapes.setdefault(name, (shape, rank))
            if seen[0] != shape:
                raise ConfigError(f"{what} {name!r} has shape {tuple(seen[0])} on rank {seen[1]} but "
                                  f"{tuple(shape)} on rank {rank}: replicas must hold the same model")
            spans.setdefault(name, []).append((start, start + length, rank))
    routes: dict[tuple[int, ...], list] = {}
    for name in sorted(order, key=order.get):
        shape = shapes[name][0]
        numel = _numel(shape)
        for k, ranks in enumerate(replicas):
            held = sorted((s, e) for s, e, r in spans[name] if replica_of[r] == k)
            covered = 0
            for s, e in held:
                if s > covered:
                    break
                covered = max(covered, e)
            if covered < numel:
                which = "no rank" if not held else f"elements up to {covered} of {numel} only"
                raise ConfigError(f"{what} {name!r}: replica {k} (ranks {list(ranks)}) holds {which}; every "
                                  f"replica must hold every {what} (same names): it has no counterpart there")
        edges = sorted({0, numel, *(x for s, e, _ in spans[name] for x in (s, e))})
        for lo, hi in zip(edges[:-1], edges[1:]):
            holders = tuple(sorted(r for s, e, r in spans[name] if s <= lo and hi <= e))
            routes.setdefault(holders, []).append((name, shape, lo, hi - lo))
    return sorted(routes.items())
