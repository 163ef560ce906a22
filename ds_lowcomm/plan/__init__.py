"""``ds-lowcomm plan``: what each method and recipe costs and buys for a given model, cluster and link.

For a model (its parameter shapes: a preset, or the reference GPT / a Llama of given size), a
number of replicas joined by a link (rate, one-way latency), the GPUs in each replica and their
ZeRO stage, and the step's compute time, per row (a method at its settings, a dense baseline, a
recommended recipe, or your DeepSpeed config):

- bytes each worker sends per sync and per step, from what the method declares it sends
  (:meth:`~ds_lowcomm.optim.base.LowcommOptimizer.planned_wire`: the messages the optimizers'
  ledger tests check against their ledgers), two ways: in the ledger's convention (an all-gather
  of P bytes counts P sent, an all-reduce of N bytes N), and on the wire at the given replica
  count (:func:`wire_bytes_sent`: a ring all-gather sends (n-1) P per worker, a ring all-reduce
  2 (n-1) N / n). The two agree at 2 replicas only: every byte ratio holds at a replica count;
- communication seconds per step (:mod:`.cost`: each collective as a ring between replicas, each
  round a latency plus its framed bytes at the link's rate), and the part the step waits for: a
  dense gradient all-reduce overlapped with the backward pass as DDP and ZeRO (``overlap_comm``)
  run it, bucket by bucket (or not, ``overlap_backward`` False); any other message behind the
  steps of compute its method declares it runs behind (demo's ``overlap``, a sync's ``sync_delay``;
  the compressed all-reduce's second phase one step less than its first);
- codec seconds per step (encode and decode of every exchanged element at a measured throughput);
- the optimizer state per GPU (the method's declared state, ZeRO 1-3 partitioning it over the
  replica's GPUs), and its addition over the row's baseline's;
- the predicted speed-up in time to a target loss over the row's dense baseline (adamw, or dense
  Muon for the recipes around Muon): the baseline's step time over (the row's step time x its
  steps-to-target ratio). The ratio is that measured for the recipe the row's settings run
  (ds_lowcomm/measured.json, with its source), or given; a row that runs no measured recipe has none.

The package: :mod:`.shapes` (the models), :mod:`.cost` (links, rings, overlap, seconds),
:mod:`.measured` (the measured defaults), :mod:`.pricing` (the rows) and :mod:`.cli` (the command).
"""

from ..comm.wire import Message
from .cli import add_arguments, config_methods, format_table, run_plan
from .cost import (FIRST_BUCKET_BYTES, WIRE_OVERHEAD, Link, exposed_seconds, gradient_exposed_seconds,
                   last_bucket_elements, message_seconds, ring_rounds, share, wire_bytes, wire_bytes_sent)
from .measured import (CODEC_BY_ELEMENTS, CODEC_GBPS, MEASURED, MEASURED_PATH, STEPS_RATIO, STEPS_RATIO_SOURCE,
                       default_codec_gbps, load_measured, measured_steps_ratio)
from .pricing import PlanInputs, baseline_of, matching_recipe, muon_memory, plan, plan_method
from .shapes import MODELS, gpt_shapes, hidden_matrices, llama_shapes, model_shapes, other_rule_tensors

__all__ = [
    "CODEC_BY_ELEMENTS", "CODEC_GBPS", "FIRST_BUCKET_BYTES", "Link", "MEASURED", "MEASURED_PATH", "MODELS", "Message",
    "PlanInputs", "STEPS_RATIO", "STEPS_RATIO_SOURCE", "WIRE_OVERHEAD", "add_arguments", "baseline_of",
    "config_methods", "default_codec_gbps", "exposed_seconds", "format_table", "gpt_shapes",
    "gradient_exposed_seconds", "hidden_matrices", "last_bucket_elements", "llama_shapes", "load_measured",
    "matching_recipe", "measured_steps_ratio", "message_seconds", "model_shapes", "muon_memory",
    "other_rule_tensors", "plan", "plan_method", "ring_rounds", "run_plan", "share", "wire_bytes", "wire_bytes_sent",
]
