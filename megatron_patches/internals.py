"""Every Megatron-Core internal that ``megatron_patches`` reads, replaces or copies, declared once
and checked against the installed megatron-core before anything is patched.

Megatron-Core's gradient buckets, its optimizers' mixed-precision copies and its pipeline p2p
communicator are not public API: they move between releases. So each one megatron_patches uses is
an :class:`~ds_lowcomm.reflect.Internal` in :data:`ITEMS` (module, name, kind, the parameters
used), and the rest of the package reaches them only through this module.
:func:`ensure_checked` (called first thing by ``apply`` and ``install_activation_compression``)
checks, before anything is touched:

- the megatron-core version is supported (:func:`ds_lowcomm.versions.check_supported`);
- every item exists with the declared kind and parameters (``inspect.signature`` of the installed
  code), and every instance attribute is stored by its class's code;
- what megatron_patches replaces is still looked up where Megatron uses it (:data:`LOOKED_UP`: a
  bucket group's ``start_grad_sync`` replaced per instance that DDP no longer calls by that name
  would leave Megatron's all-reduce running);
- Megatron's methods that megatron_patches rewrites (the bucket group's grad sync, the p2p
  ``_communicate``) have the bodies the rewrite was made from (:data:`COPIED`).

Anything missing or changed raises one :class:`FrameworkInternalsError` naming it and the
installed and supported versions. Afterwards :func:`live` gives a declared class or function,
:func:`get` / :func:`put` an attribute that exists only on constructed objects (bucket fields,
the communicator's ranks), checked again on the object where it is read (never a silent default),
:func:`replace_method` puts one of ours in place of a declared method on one object, and
:func:`rebind` a module-level name.
``ds_lowcomm/deepspeed/internals.py`` is the same for DeepSpeed; the checks and the access are one
implementation for both, :class:`ds_lowcomm.reflect.FrameworkInternals`, which this module builds
for Megatron-Core and exposes as its module-level functions.

Nothing here imports megatron at import time.
"""

from __future__ import annotations

from typing import Any

from ds_lowcomm.reflect import FrameworkInternals, FrameworkInternalsError, Internal

DISTRIBUTION = "megatron-core"

_BUFFER = "megatron.core.distributed.param_and_grad_buffer"
_DDP = "megatron.core.distributed.distributed_data_parallel"
_DDP_CONFIG = "megatron.core.distributed.distributed_data_parallel_config"
_DP_BASE = "megatron.core.distributed.data_parallel_base"
_MODULE = "megatron.core.transformer.module"
_TRANSFORMER_CONFIG = "megatron.core.transformer.transformer_config"
_OPTIMIZER = "megatron.core.optimizer.optimizer"
_OPTIMIZER_CONFIG = "megatron.core.optimizer.optimizer_config"
_DISTRIB_OPTIMIZER = "megatron.core.optimizer.distrib_optimizer"
_P2P = "megatron.core.pipeline_parallel.p2p_communication"
_SCHEDULES = "megatron.core.pipeline_parallel.schedules"
_MP_CONFIG = "megatron.core.model_parallel_config"
_RANDOM = "megatron.core.tensor_parallel.random"

# --- DDP's gradient buckets (grad_sync.py) ------------------------------------------------------
DDP = Internal(_DDP, "DistributedDataParallel", "class", use="wraps the model chunks whose grad sync it replaces")
DP_BASE = Internal(_DP_BASE, "_BaseDataParallel", "class",
                   use="tells Megatron FSDP and other data-parallel wrappers (refused) from DDP")
DDP_BUCKET_GROUPS = Internal(_DDP, "DistributedDataParallel.bucket_groups", "instance",
                             use="replaces the grad sync of every bucket group")
DDP_EXPERT_BUCKET_GROUPS = Internal(_DDP, "DistributedDataParallel.expert_parallel_bucket_groups", "instance",
                                    use="replaces the grad sync of every bucket group")
DDP_DDP_CONFIG = Internal(_DDP, "DistributedDataParallel.ddp_config", "instance",
                          use="refuses the distributed optimizer")
USE_DISTRIBUTED_OPTIMIZER = Internal(_DDP_CONFIG, "DistributedDataParallelConfig.use_distributed_optimizer", "field",
                                     use="refuses the distributed optimizer")
START_GRAD_SYNC = Internal(_BUFFER, "_ParamAndGradBucketGroup.start_grad_sync", "method",
                           params=("force_all_reduce",), match="override",
                           use="replaces it per bucket group (grad_sync.BucketGroupSync.start_grad_sync)")
FINISH_GRAD_SYNC = Internal(_BUFFER, "_ParamAndGradBucketGroup.finish_grad_sync", "method",
                            params=("force_all_reduce",), match="override",
                            use="replaces it per bucket group (grad_sync.BucketGroupSync.finish_grad_sync)")
GROUP_BUCKETS = Internal(_BUFFER, "_ParamAndGradBucketGroup.buckets", "instance",
                         use="reads the buckets of a bucket group")
GROUP_IS_FIRST_BATCH = Internal(_BUFFER, "_ParamAndGradBucketGroup.is_first_batch", "instance",
                                use="reads it as Megatron's start_grad_sync does")
GROUP_PARAM_GATHER_DISPATCHED = Internal(_BUFFER, "_ParamAndGradBucketGroup.param_gather_dispatched", "instance",
                                         use="resets it as Megatron's finish_grad_sync does")
GROUP_DDP_CONFIG = Internal(_BUFFER, "_ParamAndGradBucketGroup.ddp_config", "instance",
                            use="reads check_for_nan_in_grad / check_for_large_grads")
CHECK_GRADS = Internal(_BUFFER, "_ParamAndGradBucketGroup.check_grads", "method",
                       params=("check_for_nan_or_inf", "check_for_large"),
                       use="runs Megatron's NaN / Inf / large-gradient checks where its grad sync would have")
CHECK_FOR_NAN_IN_GRAD = Internal(_DDP_CONFIG, "DistributedDataParallelConfig.check_for_nan_in_grad", "field",
                                 use="Megatron's --check-for-nan-in-loss-and-grad, honoured")
CHECK_FOR_LARGE_GRADS = Internal(_DDP_CONFIG, "DistributedDataParallelConfig.check_for_large_grads", "field",
                                 use="Megatron's --check-for-large-grads, honoured")
BUCKET_PARAMS_LIST = Internal(_BUFFER, "_ParamAndGradBucket.params_list", "instance",
                              use="exchanges a bucket group's gradients in its parameter order")
# Set by the buffer on every parameter it holds (read from the parameter).
MAIN_GRAD = Internal(_BUFFER, "_ParamAndGradBuffer.main_grad", "instance",
                     use="exchanges each parameter's main_grad, the buffer's gradient view")

# --- Modules' settings (install.py) -------------------------------------------------------------
MEGATRON_MODULE = Internal(_MODULE, "MegatronModule", "class", use="reads a Megatron module's config")
FLOAT16_MODULE = Internal(_MODULE, "Float16Module", "class", use="unwraps model chunks for checkpoints (Megatron-LM's names)")
MODULE_CONFIG = Internal(_MODULE, "MegatronModule.config", "instance", use="reads a Megatron module's config")
PER_TOKEN_LOSS = Internal(_TRANSFORMER_CONFIG, "TransformerConfig.calculate_per_token_loss", "field",
                          use="refuses per-token loss (summed gradients)")

# --- Optimizers (install.py, wrapper.py, outer.py) ---------------------------------------------
OPTIMIZER_INNER = Internal(_OPTIMIZER, "MegatronOptimizer.optimizer", "instance",
                           use="reads and replaces the torch optimizer inside (demo, mtdao)")
OPTIMIZER_CONFIG = Internal(_OPTIMIZER, "MegatronOptimizer.config", "instance", use="reads fp16 and clip_grad")
FP16 = Internal(_OPTIMIZER_CONFIG, "OptimizerConfig.fp16", "field", use="refuses fp16 with demo and mtdao")
CLIP_GRAD = Internal(_OPTIMIZER_CONFIG, "OptimizerConfig.clip_grad", "field",
                     use="the run's first log line shows it")
FLOAT16_OPTIMIZER = Internal(_OPTIMIZER, "Float16OptimizerWithFloat16Params", "class",
                             use="bf16/fp16 model parameters with fp32 main copies")
FLOAT16_GROUPS = Internal(_OPTIMIZER, "Float16OptimizerWithFloat16Params.float16_groups", "instance",
                          use="maps the model's bf16 parameters to their param groups (demo)")
FP32_FROM_FLOAT16_GROUPS = Internal(_OPTIMIZER, "Float16OptimizerWithFloat16Params.fp32_from_float16_groups", "instance",
                                    use="maps the fp32 main copies to the model's bf16 parameters (demo's state)")
COPY_MAIN_TO_MODEL = Internal(_OPTIMIZER, "Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
                              "method", params=(), use="copies the synced fp32 main parameters into the model")
FP32_OPTIMIZER = Internal(_OPTIMIZER, "FP32Optimizer", "class", use="fp32 training: steps the model's parameters")
CHAINED_OPTIMIZER = Internal(_OPTIMIZER, "ChainedOptimizer", "class", use="reads the optimizers it chains")
CHAINED_OPTIMIZERS = Internal(_OPTIMIZER, "ChainedOptimizer.chained_optimizers", "instance",
                              use="reads the optimizers it chains")
DISTRIBUTED_OPTIMIZER = Internal(_DISTRIB_OPTIMIZER, "DistributedOptimizer", "class",
                                 use="refuses the distributed optimizer")

_MUON = "megatron.core.optimizer.muon"
MEGATRON_MUON_OPTIMIZER = Internal(_MUON, "get_megatron_muon_optimizer", "function",
                                   params=("config", "model_chunks"), use="builds Megatron's Muon (--optimizer muon)")
HAVE_EMERGING_OPTIMIZERS = Internal(_MUON, "HAVE_EMERGING_OPTIMIZERS", "attribute",
                                    use="refuses --optimizer muon by name where its package is missing")
TENSOR_PARALLEL_MUON = Internal(_MUON, "TensorParallelMuon", "class",
                                use="refuses Megatron's Muon under demo and mtdao, which replace its step")
LAYER_WISE_OPTIMIZER = Internal("megatron.core.optimizer.layer_wise_optimizer", "LayerWiseDistributedOptimizer",
                                "class", use="refuses the layer-wise distributed optimizer")

# --- Pipeline p2p (activations.py) ----------------------------------------------------------------
SCHEDULES_P2P = Internal(_SCHEDULES, "P2PCommunicator", "class",
                         use="rebinds the name the schedules build their communicator from")
P2P_COMMUNICATE = Internal(_P2P, "P2PCommunicator._communicate", "method",
                           params=("tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next", "tensor_shape",
                                   "wait_on_reqs"), match="override",
                           use="overrides it to code activations on the wire")
P2P_CONFIG = Internal(_P2P, "P2PCommunicator.config", "instance", use="reads the pipeline settings")
P2P_PP_GROUP = Internal(_P2P, "P2PCommunicator.pp_group", "instance", use="sends on the pipeline group")
P2P_PREV_RANK = Internal(_P2P, "P2PCommunicator.prev_rank", "instance", use="sends to the previous stage")
P2P_NEXT_RANK = Internal(_P2P, "P2PCommunicator.next_rank", "instance", use="sends to the next stage")
_P2P_OPS_PARAMS = ("tensor_send_prev", "tensor_recv_prev", "tensor_send_next", "tensor_recv_next", "group",
                   "prev_pipeline_rank", "next_pipeline_rank")
BATCHED_P2P_OPS = Internal(_P2P, "_batched_p2p_ops", "function", params=_P2P_OPS_PARAMS,
                           use="moves the coded payloads (batch_p2p_comm)")
P2P_OPS = Internal(_P2P, "_p2p_ops", "function", params=_P2P_OPS_PARAMS, use="moves the coded payloads")
PIPELINE_DTYPE = Internal(_MP_CONFIG, "ModelParallelConfig.pipeline_dtype", "field", use="sizes the payloads")
VARIABLE_SEQ_LENGTHS = Internal(_MP_CONFIG, "ModelParallelConfig.variable_seq_lengths", "field",
                                use="refuses variable sequence lengths")
MTP_STANDALONE = Internal(_MP_CONFIG, "ModelParallelConfig.mtp_standalone", "field",
                          use="refuses variable sequence lengths")
USE_RING_EXCHANGE_P2P = Internal(_MP_CONFIG, "ModelParallelConfig.use_ring_exchange_p2p", "field",
                                 use="refuses the ring exchange")
BATCH_P2P_COMM = Internal(_MP_CONFIG, "ModelParallelConfig.batch_p2p_comm", "field",
                          use="picks Megatron's p2p function as Megatron does")
BATCH_P2P_SYNC = Internal(_MP_CONFIG, "ModelParallelConfig.batch_p2p_sync", "field",
                          use="synchronises after batched p2p as Megatron does")

# --- Distributed checkpoints (sharded_state.py, checkpoint.py) ---------------------------------------
_DIST_CKPT = "megatron.core.dist_checkpointing"
SHARDED_TENSOR = Internal(_DIST_CKPT + ".mapping", "ShardedTensor", "class",
                          use="puts each rank's method state into Megatron's distributed checkpoints")
DIST_SAVE = Internal(_DIST_CKPT + ".serialization", "save", "function",
                     params=("sharded_state_dict", "checkpoint_dir", "content_metadata"),
                     use="saves launch/pretrain_gpt.py's torch_dist checkpoints as Megatron-LM does")
DIST_LOAD = Internal(_DIST_CKPT + ".serialization", "load", "function", params=("sharded_state_dict", "checkpoint_dir"),
                     use="loads launch/pretrain_gpt.py's torch_dist checkpoints as Megatron-LM does")
DIST_CONTENT_METADATA = Internal(_DIST_CKPT + ".serialization", "load_content_metadata", "function",
                                 params=("checkpoint_dir",), use="reads the method's shapes before loading")
SHARDED_TENSOR_FACTORY = Internal(_DIST_CKPT + ".mapping", "ShardedTensorFactory", "class",
                                  use="maps a parameter's factory-built shards to the method's state of it")
MAKE_SHARDED_OPTIMIZER_TENSOR = Internal(_DIST_CKPT + ".optimizer", "make_sharded_optimizer_tensor", "function",
                                         params=("model_param", "optim_param", "prefix"),
                                         use="shards the method's state of a parameter as the parameter is sharded")
# Read from (or replaced in, with dataclasses.replace) the parameters' ShardedTensors / factories.
SHARDED_KEY = Internal(_DIST_CKPT + ".mapping", "ShardedTensor.key", "field", use="names a parameter's state after it")
SHARDED_LOCAL_SHAPE = Internal(_DIST_CKPT + ".mapping", "ShardedTensor.local_shape", "field",
                               use="sizes the method's state of a parameter to load")
SHARDED_GLOBAL_OFFSET = Internal(_DIST_CKPT + ".mapping", "ShardedTensor.global_offset", "field",
                                 use="tells the shards of one parameter apart")
SHARDED_PREPEND_AXIS_NUM = Internal(_DIST_CKPT + ".mapping", "ShardedTensor.prepend_axis_num", "field",
                                    use="tells a stacked parameter (a block's layers) by its global layer")
SHARDED_REPLICA_ID = Internal(_DIST_CKPT + ".mapping", "ShardedTensor.replica_id", "field",
                              use="saves a replica's own state once per replica")
FACTORY_REPLICA_ID = Internal(_DIST_CKPT + ".mapping", "ShardedTensorFactory.replica_id", "field",
                              use="saves a replica's own state once per replica")
RNG_TRACKER = Internal("megatron.core.tensor_parallel.random", "get_cuda_rng_tracker", "function", params=(),
                       use="saves and restores the RNG tracker's streams (dropout resumes exactly)")

# --- The RNG tracker on the CPU (cpu_shim.py) ------------------------------------------------------
SET_CUDA_RNG_STATE = Internal(_RANDOM, "_set_cuda_rng_state", "function", params=("new_state", "device", "graph_safe"),
                              match="override", use="sets the emulated device RNG (the CPU's) at once under cpu_shim")

ITEMS: tuple[Internal, ...] = tuple(v for v in list(globals().values()) if isinstance(v, Internal))

# What megatron_patches replaces takes effect only where Megatron looks it up by name at each use:
# (internal, the functions that must read it).
LOOKED_UP = (
    (START_GRAD_SYNC, _DDP, ("DistributedDataParallel.start_grad_sync",)),
    (START_GRAD_SYNC, _BUFFER, ("_ParamAndGradBucketGroup.finish_grad_sync",
                                "_ParamAndGradBucketGroup.register_grad_ready")),
    (FINISH_GRAD_SYNC, _DDP, ("DistributedDataParallel.finish_grad_sync",)),
    (OPTIMIZER_INNER, _OPTIMIZER, ("MixedPrecisionOptimizer.step_with_ready_grads",
                                   "FP32Optimizer.step_with_ready_grads")),
    (SET_CUDA_RNG_STATE, _RANDOM, ("CudaRNGStatesTracker.add", "CudaRNGStatesTracker.fork")),
    (SCHEDULES_P2P, _SCHEDULES, ("forward_backward_pipelining_without_interleaving",
                                 "forward_backward_pipelining_with_interleaving")),
    (P2P_COMMUNICATE, _P2P, tuple(f"P2PCommunicator.{name}" for name in (
        "recv_forward", "recv_backward", "send_forward", "send_backward", "send_forward_recv_backward",
        "send_backward_recv_forward", "send_forward_recv_forward", "send_backward_recv_backward"))),
)

# Megatron methods megatron_patches rewrites (grad_sync.BucketGroupSync keeps their first-batch and
# param-gather bookkeeping; activations.py's _communicate their checks and p2p calls): a digest of
# each body's tokens (comments and layout left out) as rewritten, from megatron-core 0.16.1. A
# changed body means Megatron changed what the rewrite is built on: it must be looked at again.
COPIED = {
    START_GRAD_SYNC: "3d4c3c07d44461e6",
    FINISH_GRAD_SYNC: "45c994edb3319f77",
    P2P_COMMUNICATE: "2f9ba7a7e63539c0",
}


# --- The checks and the access (one implementation for both integrations: reflect.FrameworkInternals) ----
_INTERNALS = FrameworkInternals(
    DISTRIBUTION, ITEMS, LOOKED_UP, COPIED, "megatron.", user="megatron_patches",
    copies="megatron_patches' version of it was written from", label="Megatron-Core")

problems = _INTERNALS.problems  # every way the installed megatron-core differs from ITEMS, LOOKED_UP and COPIED
ensure_checked = _INTERNALS.ensure_checked  # the version, then (once per process) every internal; the version
live = _INTERNALS.live  # (item): the live class / function / method item declares (checked)
get = _INTERNALS.get  # (obj, item): obj's instance attribute item; the named error where it is missing
put = _INTERNALS.put  # (obj, item, value): set it; it must already be there
check_override = _INTERNALS.check_override  # (item, fn, takes_self=False): fn takes what Megatron passes, or TypeError
replace_method = _INTERNALS.replace_method  # (obj, item, fn): fn in place of the method item on this one object
method = _INTERNALS.method  # (obj, item, of_class=False): obj's method item, bound (of_class: its class's)


def rebind(item: Internal, value: Any) -> None:
    """Set the module-level name ``item`` declares (in its module) to ``value``."""
    import importlib

    if "." in item.name:
        raise ValueError(f"{item.path} is not a module-level name")
    live(item)
    setattr(importlib.import_module(item.module), item.name, value)


def tensor_parallel_shard(param) -> int | None:
    """The dimension along which ``param`` is split over the tensor-parallel group (Megatron's
    ``tensor_model_parallel`` and ``partition_dim``, as its ``set_tensor_model_parallel_attributes``
    sets them and its optimizers read them), or None for a parameter every tensor-parallel rank
    holds whole."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    return int(getattr(param, "partition_dim"))


def is_embedding_or_output(param) -> bool:
    """Megatron marks its word embeddings and output layer with ``is_embedding_or_output_parameter``
    (its own Muon leaves them to Adam, as ds_lowcomm's decision does)."""
    return bool(getattr(param, "is_embedding_or_output_parameter", False))


def is_expert_parallel(param) -> bool:
    """Megatron marks expert-parallel parameters with ``allreduce = False`` and leaves the
    attribute off every other parameter: absent means True, as Megatron's own readers take it
    (DistributedDataParallel, get_megatron_optimizer)."""
    return not getattr(param, "allreduce", True)


__all__ = ["COPIED", "DISTRIBUTION", "FrameworkInternalsError", "ITEMS", "LOOKED_UP", "check_override",
           "ensure_checked", "get", "is_embedding_or_output", "is_expert_parallel", "live", "problems", "put",
           "rebind", "replace_method", "tensor_parallel_shard"]
