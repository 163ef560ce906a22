"""The compressed collective backend: transports, the byte ledger, sparse and dense collectives."""

from .assemble import Matrix, MatrixAssembly, MatrixPiece
from .build import build_transport
from .compressed_allreduce import CompressedAllReduce, phase_bytes
from .collectives import (NonFiniteError, Pieces, SparseAllGather, all_finite, all_reduce_mean_,
                          start_all_reduce_mean_)
from .consistency import assert_same_across_ranks, gather_json
from .ledger import ByteLedger
from .shard import ReplicaShard
from .routes import Piece, Routes
from .topology import ReplicaTopology
from .transport import CollectiveError, Pending, TorchDistTransport, Transport, backend_device

__all__ = [
    "ByteLedger", "CollectiveError", "CompressedAllReduce", "phase_bytes", "Matrix", "MatrixAssembly", "MatrixPiece", "NonFiniteError", "all_finite", "Pending", "Pieces", "Piece", "ReplicaShard", "ReplicaTopology", "Routes", "SparseAllGather", "assert_same_across_ranks", "TorchDistTransport", "Transport", "all_reduce_mean_", "backend_device", "build_transport", "start_all_reduce_mean_",
]
