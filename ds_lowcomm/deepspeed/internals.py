"""Every private DeepSpeed internal the integration reads, replaces or copies, declared once and
checked against the installed deepspeed before anything is touched.

DeepSpeed has no public hooks for what ds_lowcomm does (its communication backend, ZeRO's
per-group optimizer step, the pipeline's instruction map, its grid's groups, its loader set-up,
its checkpoint engine), so the glue uses its private internals, which move between releases.
Each one is an :class:`~ds_lowcomm.reflect.Internal` in :data:`ITEMS` (module, name, kind, the
parameters used), and the rest of ``ds_lowcomm.deepspeed`` reaches them only through this module.
:func:`ensure_checked` (called first thing by ``initialize``, ``replica_layout``,
``enter_subworld``, ``count_deepspeed_collectives`` and ``install_activation_compression``)
checks, before anything is touched:

- the deepspeed version is supported (:func:`ds_lowcomm.versions.check_supported`);
- every item exists with the declared kind and parameters (``inspect.signature`` of the installed
  code, seen through decorators), and every instance attribute is stored by its class's code;
- what ds_lowcomm replaces is still looked up where DeepSpeed uses it (:data:`LOOKED_UP`: a
  replaced ``_optimizer_step`` that ZeRO's ``step`` no longer calls would silently step the
  method once per parameter group);
- DeepSpeed's methods whose bodies activations.py copies have the bodies it copied (:data:`COPIED`).

Anything missing or changed raises one :class:`FrameworkInternalsError` naming it and the
installed and supported versions. Afterwards :func:`live` gives a declared class, function or
attribute, :func:`get` / :func:`put` an attribute that exists only on constructed objects (checked
again on the object where it is read: never a silent default), :func:`method` /
:func:`replace_method` a private method of one object.
``megatron_patches/internals.py`` is the same for Megatron-Core; the checks and the access are one
implementation for both, :class:`ds_lowcomm.reflect.FrameworkInternals`, which this module builds
for DeepSpeed and exposes as its module-level functions.

This module declares; it does nothing. What ds_lowcomm does with DeepSpeed's communication backend
(starting it, the stale JIT build lock, the /dev/shm buffers, the sub-world's swap, the signatures
the sub-world and the byte counter read) is ``backend.py``, through these declarations.

Nothing here imports deepspeed at import time.
"""

from __future__ import annotations

from typing import Any

from ..reflect import FrameworkInternals, FrameworkInternalsError, Internal

DISTRIBUTION = "deepspeed"

_COMM = "deepspeed.comm.comm"
_BACKEND = "deepspeed.comm.torch"
_Z12 = "deepspeed.runtime.zero.stage_1_and_2"
_Z3 = "deepspeed.runtime.zero.stage3"
_ENGINE = "deepspeed.runtime.engine"
_PIPE = "deepspeed.runtime.pipe.engine"
_SCHEDULE = "deepspeed.runtime.pipe.schedule"
_MODULE = "deepspeed.runtime.pipe.module"
_TOPOLOGY = "deepspeed.runtime.pipe.topology"
_CKPT = "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine"
_CONST = "deepspeed.checkpoint.constants"

# --- The communication backend (backend.py, subworld.py, comm_counter.py) --------------------------------------
# Backend methods that take a process group, as the sub-world translates them: name -> which of
# their parameters are ranks (virtual -> global). The parameters themselves, in order, come from the
# live backend (backend_signature). A group-taking method named neither here nor in SUBWORLD_OWN is
# refused by the sub-world: passed on untranslated it would run over the whole job, across replicas.
GROUP_METHODS = {
    "all_reduce": (), "inference_all_reduce": (), "all_reduce_coalesced": (),
    "reduce": ("dst",), "reduce_scatter": (), "reduce_scatter_tensor": (),
    "broadcast": ("src",), "broadcast_object_list": ("src",),
    "all_gather": (), "all_gather_into_tensor": (), "all_gather_base": (), "all_gather_coalesced": (),
    "all_gather_object": (), "all_to_all_single": (), "all_to_all": (),
    "send": ("dst",), "recv": ("src",), "isend": ("dst",), "irecv": ("src",),
    "gather": ("dst",), "scatter": ("src",),
    "barrier": (), "monitored_barrier": (), "get_backend": (),
}
# Backend methods the sub-world implements itself: name -> the parameters its versions take.
SUBWORLD_OWN = {
    "get_rank": ("group",), "get_world_size": ("group",), "get_world_group": (),
    "get_global_rank": ("group", "group_rank"), "new_group": ("ranks",),
    "init_device_mesh": ("mesh_shape", "mesh_dim_names"), "batch_isend_irecv": ("p2p_op_list",),
    "destroy_process_group": ("group",),
}
# The arguments the byte counter reads by name from each method it counts.
COUNTED_READS = {
    "all_reduce": ("tensor", "group"), "inference_all_reduce": ("tensor", "group"),
    "all_reduce_coalesced": ("tensors", "group"), "reduce": ("tensor", "group"),
    "reduce_scatter_tensor": ("output_tensor", "input_tensor", "group"),
    "all_gather_into_tensor": ("output_tensor", "input_tensor", "group"),
    "all_gather_base": ("output_tensor", "input_tensor", "group"),
    "all_gather": ("tensor_list", "tensor", "group"), "broadcast": ("tensor", "src", "group"),
}

CDB = Internal(_COMM, "cdb", "attribute",
              use="replaces it for the sub-world (backend.py) and wraps its methods (comm_counter.py)")
TORCH_BACKEND = Internal(_BACKEND, "TorchBackend", "class",
                         use="translates and counts its methods (subworld.py, comm_counter.py)")
BACKEND_METHODS = tuple(
    [Internal(_BACKEND, f"TorchBackend.{name}", "method",
              tuple(dict.fromkeys(("group", *GROUP_METHODS.get(name, ()), *COUNTED_READS.get(name, ())))), "has",
              use="binds a call's arguments to its signature and reads these (subworld.py, comm_counter.py)")
     for name in sorted({*GROUP_METHODS, *COUNTED_READS})]
    + [Internal(_BACKEND, f"TorchBackend.{name}", "method", params, "override",
                use="has its own version of it in the sub-world (subworld.py)")
       for name, params in SUBWORLD_OWN.items()])
DEVICE_MESH_SPLIT_UNSUPPORTED = Internal("deepspeed.utils.groups", "_DEVICE_MESH_SPLIT_UNSUPPORTED", "attribute",
                                         use="refuses a DeviceMesh in the sub-world with DeepSpeed's own message "
                                             "(subworld.py)")

# --- ZeRO 1/2 (zero.py, hetero.py) -------------------------------------------------------------------
_use12 = "reads ZeRO 1/2's partitions and refuses the paths it does not handle (zero.py, hetero.py)"
ZERO12 = Internal(_Z12, "DeepSpeedZeroOptimizer", "class", use=_use12)
ZERO12_OPTIMIZER_STEP = Internal(_Z12, "DeepSpeedZeroOptimizer._optimizer_step", "method", ("group_no",), "override",
                                 use="steps the method once over every group, at the last one (zero.py)")
ZERO12_LAZY_INIT_HP = Internal(_Z12, "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state", "method", (),
                               use="links the optimizer state after the step, as _optimizer_step does (zero.py)")
ZERO12_AUTOCAST_SCALER = Internal(_Z12, "DeepSpeedZeroOptimizer.torch_autocast_gradscaler", "instance", use=_use12)
ZERO12_ZENFLOW = Internal(_Z12, "DeepSpeedZeroOptimizer.zenflow", "instance", use=_use12)
ZERO12_CPU_OFFLOAD = Internal(_Z12, "DeepSpeedZeroOptimizer.cpu_offload", "instance", use=_use12)
ZERO12_OPTIMIZER = Internal(_Z12, "DeepSpeedZeroOptimizer.optimizer", "instance", use=_use12)
ZERO12_PARAMS = Internal(_Z12, "DeepSpeedZeroOptimizer.round_robin_bit16_groups", "instance", use=_use12)
ZERO12_OFFSETS = Internal(_Z12, "DeepSpeedZeroOptimizer.round_robin_bit16_offsets", "instance", use=_use12)
ZERO12_PARTITION_SIZE = Internal(_Z12, "DeepSpeedZeroOptimizer.partition_size", "instance", use=_use12)
ZERO12_DP_GROUPS = Internal(_Z12, "DeepSpeedZeroOptimizer.real_dp_process_group", "instance", use=_use12)
ZERO12_FP32_PARTITIONS = Internal(_Z12, "DeepSpeedZeroOptimizer.single_partition_of_fp32_groups", "instance",
                                  use=_use12)
ZERO12_BIT16_PARTITIONS = Internal(_Z12, "DeepSpeedZeroOptimizer.parallel_partitioned_bit16_groups", "instance",
                                   use=_use12)

# --- ZeRO 3 (zero.py, engine.py) -----------------------------------------------------------------------
_use3 = "reads ZeRO 3's sub-groups and refuses the paths it does not handle (zero.py)"
ZERO3 = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3", "class", use=_use3)
ZERO3_OPTIMIZER_STEP = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3._optimizer_step", "method", ("sub_group_id",),
                                "override", use="steps the method once over every sub-group, at the last one (zero.py)")
ZERO3_SET_FP32_GROUPS = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3._set_fp32_optimizer_param_groups", "method", (),
                                 use=_use3)
ZERO3_CLEAR_FP32_GROUPS = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3._clear_fp32_optimizer_param_groups", "method",
                                   (), use=_use3)
ZERO3_PUBLISH = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3._reassign_or_swap_out_partitioned_parameters", "method",
                         ("sub_group_id",), use="publishes the sub-groups stepped after ZeRO copied them (zero.py)")
ZERO3_AUTOCAST_SCALER = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.torch_autocast_gradscaler", "instance", use=_use3)
ZERO3_ZENFLOW = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.zenflow", "instance", use=_use3)
ZERO3_OFFLOAD_OPTIMIZER = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.offload_optimizer", "instance", use=_use3)
ZERO3_OFFLOAD_PARAM = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.offload_param", "instance", use=_use3)
ZERO3_SWAP_OPTIMIZER = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.swap_optimizer", "instance", use=_use3)
ZERO3_OPTIMIZER = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.optimizer", "instance", use=_use3)
ZERO3_DP_GROUP = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.dp_process_group", "instance", use=_use3)
ZERO3_PARAMS = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.fp16_groups", "instance", use=_use3)
ZERO3_FP32_FLAT = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.fp32_partitioned_groups_flat", "instance", use=_use3)
# set on every parameter by zero.Init (_convert_to_deepspeed_param): read from the parameter
_PARAMS = "deepspeed.runtime.zero.partition_parameters"
PARAM_DS_TENSOR = Internal(_PARAMS, "Init.ds_tensor", "instance", use="reads a ZeRO 3 parameter's partition (zero.py)")
PARAM_DS_NUMEL = Internal(_PARAMS, "Init.ds_numel", "instance",
                          use="reads a ZeRO 3 parameter's whole size (zero.py, engine.py)")
PARAM_DS_SHAPE = Internal(_PARAMS, "Init.ds_shape", "instance", use="reads a ZeRO 3 parameter's whole shape (zero.py)")

# ZeRO 3's sub-group -> param group map (a sub-group's matrices take their group's Muon settings: zero.py)
ZERO3_SUBGROUP_TO_GROUP = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.sub_group_to_group_id", "instance",
                                   use="reads which param group each ZeRO 3 sub-group steps in (zero.py)")

# --- DeepSpeed's Muon (muon.py): its grouping, its optimizer, its Newton-Schulz ----------------------
_MUON = "deepspeed.runtime.zero.muon.original_muon"
_MUON_OPT = "deepspeed.runtime.zero.muon.muon_optimizer"
_usemuon = "builds DeepSpeed's Muon as its optimizer section says (muon.py)"
MUON_PARAM_GROUPS = Internal(_ENGINE, "DeepSpeedEngine._muon_param_groups", "function",
                             ("model_parameters", "optimizer_parameters"), use=_usemuon)
MUON_WITH_AUX_ADAM = Internal(_MUON_OPT, "MuonWithAuxAdam", "class", use=_usemuon)
MUON_WITH_AUX_ADAM_INIT = Internal(_MUON_OPT, "MuonWithAuxAdam.__init__", "method",
                                   ("param_groups", "adam_optimizer", "adam_optimizer_kwargs", "adam_w_mode",
                                    "fallback_to_inline"), use=_usemuon)
_usens = "orthogonalises the matrices assembled from ZeRO partitions with DeepSpeed's own iteration (muon.py)"
GRAM_NEWTON_SCHULZ = Internal(_MUON, "zeropower_via_gram_newtonschulz", "function", ("G", "steps"), use=_usens)
NEWTON_SCHULZ5 = Internal(_MUON, "zeropower_via_newtonschulz5", "function", ("G", "steps"), use=_usens)
ASPECT_RATIO_SCALE = Internal(_MUON, "_aspect_ratio_scale", "function", ("rows", "cols"), use=_usens)
MUON_UPDATE = Internal(_MUON, "muon_update", "function", ("grad", "momentum", "beta", "ns_steps", "nesterov",
                                                          "ns_method"),
                       use="ZeroMuonUpdate does its steps on ZeRO partitions (muon.py); its body is digested below")

# --- Pipelines (pipeline.py, hetero.py, engine.py) ----------------------------------------------------
_usegrid = "reads the pipeline grid, and narrows its data-parallel group to a replica (pipeline.py)"
MODULE_GRID = Internal(_MODULE, "PipelineModule.mpu", "method", (),
                       use="reads the module's grid (pipeline.py, hetero.py, engine.py)")
MODULE_TOPOLOGY = Internal(_MODULE, "PipelineModule.topology", "method", (),
                           use="reads the module's topology (pipeline.py)")
GRID = Internal(_TOPOLOGY, "PipelineParallelGrid", "class", use=_usegrid)
GRID_PIPE_SIZE = Internal(_TOPOLOGY, "PipelineParallelGrid.pipe_parallel_size", "instance", use=_usegrid)
GRID_DATA_SIZE = Internal(_TOPOLOGY, "PipelineParallelGrid.data_parallel_size", "instance", use=_usegrid)
GRID_MODEL_SIZE = Internal(_TOPOLOGY, "PipelineParallelGrid.model_parallel_size", "instance", use=_usegrid)
GRID_DATA_ID = Internal(_TOPOLOGY, "PipelineParallelGrid.data_parallel_id", "instance", use=_usegrid)
GRID_DP_RANKS = Internal(_TOPOLOGY, "PipelineParallelGrid.dp_group", "instance", use=_usegrid)
GRID_DP_GROUPS = Internal(_TOPOLOGY, "PipelineParallelGrid.dp_groups", "instance", use=_usegrid)
GRID_DP_PROC_GROUP = Internal(_TOPOLOGY, "PipelineParallelGrid.dp_proc_group", "instance", use=_usegrid)
TOPOLOGY_FILTER_MATCH = Internal(_TOPOLOGY, "ProcessTopology.filter_match", "method", ("pipe", "data"),
                                 use="finds a stage's rank in a pipeline (pipeline.py)")
PIPELINE_ENGINE = Internal(_PIPE, "PipelineEngine", "class", use="tells pipeline engines apart (activations.py)")
PIPELINE_BACKWARD_ALLREDUCE = Internal(_PIPE, "PipelineEngine.pipeline_enable_backward_allreduce", "instance",
                                       use="switches the gradient all-reduce off with one rank per replica stage "
                                           "(engine.py)")
BUILD_DATA_ITER = Internal(_PIPE, "PipelineEngine._build_data_iter", "method", ("dataset",),
                           use="builds the pipeline loader sharded over every replica (data.py)")

# --- Activation compression (activations.py) ---------------------------------------------------------
_useact = "reads and writes it in its copies of DeepSpeed's instructions, as they do (activations.py)"
INSTRUCTION_MAP = Internal(_PIPE, "PipelineEngine._INSTRUCTION_MAP", "attribute",
                           use="replaces four instructions on the engine instance (activations.py)")
_exec = {name: Internal(_PIPE, f"PipelineEngine.{name}", "method", ("buffer_id",), "override",
                        use="puts its own version of it in the instance's instruction map (activations.py)")
         for name in ("_exec_send_activations", "_exec_recv_activations", "_exec_send_grads", "_exec_recv_grads")}
EXEC_SEND_ACTIVATIONS, EXEC_RECV_ACTIVATIONS, EXEC_SEND_GRADS, EXEC_RECV_GRADS = _exec.values()
SEND_ACTIVATION, RECV_ACTIVATION, SEND_GRAD, RECV_GRAD = (
    Internal(_SCHEDULE, name, "class", use="replaces these instructions (activations.py)")
    for name in ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad"))
SEND_TENSOR_META = Internal(_PIPE, "PipelineEngine._send_tensor_meta", "method", ("buffer", "recv_stage"),
                            use="runs DeepSpeed's own meta exchange before the coded activations (activations.py)")
RECV_TENSOR_META = Internal(_PIPE, "PipelineEngine._recv_tensor_meta", "method", ("send_stage",),
                            use="runs DeepSpeed's own meta exchange before the coded activations (activations.py)")
SEND_OUTPUT_TIMER, RECV_INPUT_TIMER, SEND_GRAD_TIMER, RECV_GRAD_TIMER = (
    Internal(_PIPE, name, "attribute", use="times the replaced instructions with DeepSpeed's timers (activations.py)")
    for name in ("PIPE_SEND_OUTPUT_TIMER", "PIPE_RECV_INPUT_TIMER", "PIPE_SEND_GRAD_TIMER", "PIPE_RECV_GRAD_TIMER"))
PIPE_INSTANCE = tuple(Internal(_PIPE, f"PipelineEngine.{name}", "instance", use=_useact) for name in (
    "pipe_buffers", "pipe_recv_buf", "grad_layer", "first_output_send", "dynamic_shape", "has_attention_mask",
    "has_bool_tensors", "is_pipe_partitioned", "is_grad_partitioned", "next_stage", "prev_stage"))
IS_PIPE_PARTITIONED = next(i for i in PIPE_INSTANCE if i.attr == "is_pipe_partitioned")
IS_GRAD_PARTITIONED = next(i for i in PIPE_INSTANCE if i.attr == "is_grad_partitioned")
P2P_SEND = Internal("deepspeed.runtime.pipe.p2p", "send", "function", ("tensor", "dest_stage"),
                    use="moves the coded activations (activations.py)")
P2P_RECV = Internal("deepspeed.runtime.pipe.p2p", "recv", "function", ("tensor", "src_stage"),
                    use="moves the coded activations (activations.py)")

# --- The engine (engine.py, data.py, checkpoint.py) -----------------------------------------------------
_usedata = "takes DeepSpeed's loader and batch size over every replica (data.py)"
ENGINE = Internal(_ENGINE, "DeepSpeedEngine", "class", use="wires the method into it")
BACKWARD_ALLREDUCE = Internal(_ENGINE, "DeepSpeedEngine.enable_backward_allreduce", "instance",
                              use="switches the gradient all-reduce off with one rank per replica (engine.py)")
ENGINE_DEVICE = Internal(_ENGINE, "DeepSpeedEngine.device", "instance", use=_useact)
ENGINE_MPU = Internal(_ENGINE, "DeepSpeedEngine.mpu", "instance", use=_usedata)
ENGINE_DP_WORLD_SIZE = Internal(_ENGINE, "DeepSpeedEngine.dp_world_size", "instance", use=_usedata)
TRAINING_DATALOADER = Internal(_ENGINE, "DeepSpeedEngine.training_dataloader", "instance", use=_usedata)
TPUT_TIMER = Internal(_ENGINE, "DeepSpeedEngine.tput_timer", "instance", use=_usedata)
TIMER_BATCH_SIZE = Internal("deepspeed.utils.timer", "ThroughputTimer.batch_size", "instance",
                            use="makes the throughput timer count every replica's samples (data.py)")
TRAIN_BATCH_SIZE = Internal(_ENGINE, "DeepSpeedEngine.train_batch_size", "method", (), "override", use=_usedata)
SET_TRAIN_BATCH_SIZE = Internal(_ENGINE, "DeepSpeedEngine.set_train_batch_size", "method", ("train_batch_size",),
                                "override", use=_usedata)
DEEPSPEED_IO = Internal(_ENGINE, "DeepSpeedEngine.deepspeed_io", "method", ("dataset",), "has", use=_usedata)
DEEPSPEED_INITIALIZE = Internal("deepspeed", "initialize", "function", (
    "args", "model", "optimizer", "model_parameters", "training_data", "lr_scheduler", "distributed_port", "mpu",
    "dist_init_required", "collate_fn", "config", "mesh_param", "config_params"), "override",
    use="routes it to ds_lowcomm's where the config has a lowcomm section (install.py)")
GROUPS_MPU = Internal("deepspeed.utils.groups", "mpu", "attribute",
                     use="refuses a plain engine after a ds_lowcomm one in one process: DeepSpeed keeps the "
                         "earlier engine's mpu there (install.py)")
_useheal = "heals a restarted replica's position and schedule from a live peer (fault_tolerance.py)"
ENGINE_POSITION = tuple(Internal(_ENGINE, f"DeepSpeedEngine.{name}", "instance", use=_useheal)
                        for name in ("global_steps", "global_samples", "micro_steps", "skipped_steps"))
ENGINE_LR_SCHEDULER = Internal(_ENGINE, "DeepSpeedEngine.lr_scheduler", "instance", use=_useheal)
GET_BUFFER_NAMES = Internal(_ENGINE, "DeepSpeedEngine._get_buffer_names", "method", (),
                            use="writes the ZeRO 0 export with it (checkpoint.py)")
GET_SHARED_PARAMS = Internal(_ENGINE, "DeepSpeedEngine._get_shared_params", "method", (),
                             use="writes the ZeRO 0 export with it (checkpoint.py)")
COPY_RECOVERY_SCRIPT = Internal(_ENGINE, "DeepSpeedEngine._copy_recovery_script", "method", ("save_path",),
                                use="copies zero_to_fp32.py beside the export (checkpoint.py)")
SAVE_CHECKPOINT = Internal(_ENGINE, "DeepSpeedEngine.save_checkpoint", "method",
                           ("save_dir", "tag", "client_state", "save_latest"), "has", use="wraps it (checkpoint.py)")
LOAD_CHECKPOINT = Internal(_ENGINE, "DeepSpeedEngine.load_checkpoint", "method",
                           ("load_dir", "tag", "load_module_only", "load_optimizer_states", "load_lr_scheduler_states"),
                           "has", use="wraps it (checkpoint.py)")
CHECKPOINT_ENGINE = Internal(_ENGINE, "DeepSpeedEngine.checkpoint_engine", "instance",
                             use="replaces its save/load (checkpoint.py)")
TORCH_CHECKPOINT_ENGINE = Internal(_CKPT, "TorchCheckpointEngine", "class",
                                   use="replaces its save/load (checkpoint.py)")
ZIPFILE_SERIALIZATION = Internal(_CKPT, "TorchCheckpointEngine.zipfile_serialization", "instance",
                                 use="keeps DeepSpeed's serialisation in the save it replaces (checkpoint.py)")
CHECKPOINT_SAVE = Internal(_CKPT, "TorchCheckpointEngine.save", "method", ("state_dict", "path"), "override",
                           use="replaces it: atomic writes with a digest beside (checkpoint.py)")
CHECKPOINT_LOAD = Internal(_CKPT, "TorchCheckpointEngine.load", "method", ("path", "map_location"), "override",
                           use="replaces it: weights_only loads (checkpoint.py)")
# (in this order: checkpoint.py unpacks them)
CHECKPOINT_KEYS = tuple(Internal(_CONST, name, "attribute", use="writes the ZeRO 0 export's keys (checkpoint.py)")
                        for name in ("BUFFER_NAMES", "FROZEN_PARAM_FRAGMENTS", "FROZEN_PARAM_SHAPES",
                                     "OPTIMIZER_STATE_DICT", "PARAM_SHAPES", "PARTITION_COUNT",
                                     "SINGLE_PARTITION_OF_FP32_GROUPS", "ZERO_STAGE"))
DS_VERSION = Internal("deepspeed.git_version_info", "version", "attribute",
                      use="writes the ZeRO 0 export's ds_version (checkpoint.py)")
CHECKPOINT_CLASSES = tuple(
    Internal(module, name, "class", use="allows it by name in DeepSpeed's checkpoint files at load (checkpoint.py)")
    for module, name in (("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                         ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
                         ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                         ("deepspeed.utils.tensor_fragment", "fragment_address")))

# --- fp16: the loss scaler's overflow decision, agreed over every replica (overflow.py) -----------------
_use16 = "agrees the fp16 overflow decision over every replica (overflow.py)"
_FUSED, _UNFUSED = "deepspeed.runtime.fp16.fused_optimizer", "deepspeed.runtime.fp16.unfused_optimizer"
FP16_FUSED = Internal(_FUSED, "FP16_Optimizer", "class", use=_use16)
FP16_UNFUSED = Internal(_UNFUSED, "FP16_UnfusedOptimizer", "class", use=_use16)
FUSED_OVERFLOW_CHECKER = Internal(_FUSED, "FP16_Optimizer.overflow_checker", "instance", use=_use16)
UNFUSED_OVERFLOW_CHECKER = Internal(_UNFUSED, "FP16_UnfusedOptimizer.overflow_checker", "instance", use=_use16)
CHECK_OVERFLOW = Internal("deepspeed.runtime.utils", "CheckOverflow", "class", use=_use16)
CHECKER_HAS_OVERFLOW = Internal("deepspeed.runtime.utils", "CheckOverflow.has_overflow", "method", ("params",), "has",
                                use=_use16)
CHECKER_USING_NORM = Internal("deepspeed.runtime.utils", "CheckOverflow.check_using_norm", "method", ("norm_group",),
                              "has", use=_use16)
ZERO12_HAS_OVERFLOW = Internal(_Z12, "DeepSpeedZeroOptimizer.has_overflow", "method", ("partition_gradients",), "has",
                               use=_use16)
ZERO3_HAS_OVERFLOW = Internal(_Z3, "DeepSpeedZeroOptimizer_Stage3.has_overflow", "method", ("partition_gradients",),
                              "has", use=_use16)
_BF16 = "deepspeed.runtime.bf16_optimizer"
BF16_OPTIMIZER = Internal(_BF16, "BF16_Optimizer", "class", use="agrees the bf16 skip of a step over every replica "
                          "(overflow.py)")
BF16_GRADS_FOR_NORM = Internal(_BF16, "BF16_Optimizer.get_grads_for_norm", "method", ("for_clipping",), "override",
                               use="agrees the bf16 skip of a step over every replica (overflow.py)")

# --- DeepSpeed's CPU comm op: its shared-memory all-reduce, its JIT build (backend.py) ----------------------
SHM_COMM_OP = Internal(_BACKEND, "TorchBackend.shm_comm_op", "instance",
                       use="unlinks its shared-memory buffer's name once every rank has mapped it (backend.py)")
# The name DeepSpeed's CPU comm op (ops/csrc/cpu/comm/shm.cpp, shm_initialize) gives each rank's buffer
# when every rank is on one host. A name, not Python: the check above cannot see it; if DeepSpeed
# renames it, backend.init_distributed finds no such file and unlinks nothing.
SHM_BUFFER_NAME = "deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}"
# The accelerator's op builder whose op TorchBackend JIT-loads at every start (comm/torch.py,
# build_shm_op): a name, not Python; another name gives no builder, and no lock is looked at.
SHM_COMM_BUILDER = "ShareMemCommBuilder"
OP_BUILDER_NAME = Internal("deepspeed.ops.op_builder.builder", "OpBuilder.name", "instance",
                           use="finds the build directory of the CPU comm op torch JIT-loads (backend.py)")


def _collect(values) -> tuple[Internal, ...]:
    out: dict[str, Internal] = {}
    for value in values:
        for item in (value if isinstance(value, tuple) else (value,)):
            if isinstance(item, Internal):
                out.setdefault(item.path, item)
    return tuple(out.values())


ITEMS: tuple[Internal, ...] = _collect(v for k, v in list(globals().items()) if not k.startswith("_"))

# What ds_lowcomm replaces or switches takes effect only where DeepSpeed reads it by name at each
# use: (the internal, the functions that must read it, in its module or the one given).
LOOKED_UP = (
    (CDB, _COMM, ("all_reduce", "broadcast", "send", "recv", "barrier", "new_group", "get_rank")),
    (ZERO12_OPTIMIZER_STEP, _Z12, ("DeepSpeedZeroOptimizer.step",)),
    (ZERO3_OPTIMIZER_STEP, _Z3, ("DeepSpeedZeroOptimizer_Stage3.step",)),
    (INSTRUCTION_MAP, _PIPE, ("PipelineEngine._exec_schedule",)),
    (PIPELINE_BACKWARD_ALLREDUCE, _PIPE, ("PipelineEngine._exec_reduce_grads",)),
    (BACKWARD_ALLREDUCE, _ENGINE, ("DeepSpeedEngine._backward_epilogue", "DeepSpeedEngine.step")),
    # data.py hands these a world-wide view of mpu / dp_world_size for the call
    (ENGINE_MPU, _PIPE, ("PipelineEngine._build_data_iter",)),
    (ENGINE_DP_WORLD_SIZE, _PIPE, ("PipelineEngine._build_data_iter",)),
    (ENGINE_MPU, _ENGINE, ("DeepSpeedEngine.deepspeed_io",)),
    # overflow.py replaces these on the instance that decides
    (CHECKER_HAS_OVERFLOW, "deepspeed.runtime.utils", ("CheckOverflow.check",)),
    (CHECKER_HAS_OVERFLOW, _FUSED, ("FP16_Optimizer.step",)),
    (CHECKER_USING_NORM, _FUSED, ("FP16_Optimizer.step_fused_adam",)),
    (CHECKER_USING_NORM, _UNFUSED, ("FP16_UnfusedOptimizer.step_fused_lamb",)),
    (ZERO12_HAS_OVERFLOW, _Z12, ("DeepSpeedZeroOptimizer._check_overflow",)),
    (ZERO3_HAS_OVERFLOW, _Z3, ("DeepSpeedZeroOptimizer_Stage3._check_overflow",)),
    (BF16_GRADS_FOR_NORM, _BF16, ("BF16_Optimizer.step",)),
)

# Instance attributes stored by a function outside their class: (module, function).
STORED_ELSEWHERE = {
    # bound onto the stage 3 optimizer by its create_zenflow_hooks
    ZERO3_ZENFLOW.path: ("deepspeed.runtime.zenflow.engine_stage3", "_initialize_zenflow_stage3_prologue"),
}

# DeepSpeed methods whose bodies activations.py copies (its versions code what they send): a digest
# of each body's tokens (comments and layout left out) as copied, from deepspeed 0.19.8. Another
# body means DeepSpeed changed what the copy is built on: the copy must be looked at again.
COPIED = {
    MUON_UPDATE: "6235d166a43d9e65",  # muon.ZeroMuonUpdate follows it step by step
    EXEC_SEND_ACTIVATIONS: "8fa315232e8c1e46",
    EXEC_RECV_ACTIVATIONS: "cee17a4f74c1f4ab",
    EXEC_SEND_GRADS: "e7b788327412b7d7",
    EXEC_RECV_GRADS: "4027e2a7fb69e2f6",
}


# --- The checks and the access (one implementation for both integrations: reflect.FrameworkInternals) -------
_INTERNALS = FrameworkInternals(
    DISTRIBUTION, ITEMS, LOOKED_UP, COPIED, "deepspeed", stored_elsewhere=STORED_ELSEWHERE, user="ds_lowcomm",
    copies="ds_lowcomm's version of it was copied or written from (ds_lowcomm/deepspeed/activations.py, muon.py)",
    label="deepspeed")

stored_by_class = _INTERNALS.stored_by_class  # (cls, attr): whether DeepSpeed code of cls stores attr
problems = _INTERNALS.problems  # every way the installed DeepSpeed differs from ITEMS, LOOKED_UP and COPIED
ensure_checked = _INTERNALS.ensure_checked  # the version, then (once per process) every internal; the version
live = _INTERNALS.live  # (item): the live class / function / attribute item declares (checked)
static = _INTERNALS.static  # (item): the function of a declared static method
get = _INTERNALS.get  # (obj, item): obj's instance attribute item; the named error where it is missing
put = _INTERNALS.put  # (obj, item, value): set it; it must already be there
method = _INTERNALS.method  # (obj, item, of_class=False): obj's method item, bound; the named error where missing
check_override = _INTERNALS.check_override  # (item, fn): fn accepts what the framework passes the replaced item
replace_method = _INTERNALS.replace_method  # (obj, item, fn): fn in place of the method item on this one object


def grid(module) -> Any:
    """A ``PipelineModule``'s grid (``PipelineParallelGrid``: read its fields with :func:`get`)."""
    return method(module, MODULE_GRID)()


# --- torch's JIT build of DeepSpeed's ops (backend.py: a build lock left by a killed process) ------------
# torch.utils.cpp_extension.load, through which DeepSpeed JIT-loads its CPU comm op at every engine
# start, holds a lock file in the op's build directory while it checks or builds the op; these are
# torch's, checked against torch's supported range (its own FrameworkInternals, not in ITEMS).
_CPP_EXTENSION = "torch.utils.cpp_extension"
TORCH_BUILD_DIRECTORY = Internal(_CPP_EXTENSION, "_get_build_directory", "function", ("name", "verbose"),
                                 use="finds the build lock of DeepSpeed's CPU comm op (backend.py)")
TORCH_FILE_BATON = Internal("torch.utils.file_baton", "FileBaton", "class",
                            use="clears its lock file where the process holding it is gone (backend.py)")
# The file FileBaton takes in the build directory (_jit_compile: os.path.join(build_directory, 'lock')),
# created with O_EXCL and held open until released. A name, not Python.
JIT_LOCK_NAME = "lock"
TORCH_JIT = FrameworkInternals(
    "torch", (TORCH_BUILD_DIRECTORY, TORCH_FILE_BATON),
    ((TORCH_FILE_BATON, _CPP_EXTENSION, ("_jit_compile",),
      "the lock ds_lowcomm clears is not the one torch waits on"),),
    {}, "torch.", user="ds_lowcomm", copies="", label="torch")


__all__ = ["COPIED", "DISTRIBUTION", "FrameworkInternalsError", "GROUP_METHODS", "ITEMS", "LOOKED_UP", "TORCH_JIT",
           "ensure_checked", "get", "grid", "live", "method", "problems", "put", "replace_method", "static"]
