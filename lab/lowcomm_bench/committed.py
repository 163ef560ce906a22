"""The committed measurements under docs/bench/ that code reads: the figures of the results pages
(:mod:`lowcomm_bench.figures`), ``plan_check`` and the tests. One place names each file, relative to
docs/bench/, so that a file moves in one line; docs/bench/README.md says what each holds and
docs/bench/moved.csv where the files of earlier names went.

A benchmark writes its own fixed names under ``--out`` (``time_to_loss.csv``, ``sweep.csv``, ...);
a run kept as evidence is copied here under a name saying what it measured: its date, the
hardware and what it is.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "bench"

# the README's first command (ds-lowcomm compare ... --out runs/compare)
COMPARE_RESULTS = "compare/results.csv"

# time to the target on shaped links (python -m lowcomm_bench time_to_loss): dense Muon and the
# one-bit recipes; the same with evaluations every step (the overlapped syncs); the first run
# against dense Muon (the peers with Muon inside); the top-k formats overlapped; the tuning rows
# every entry of those runs takes its configuration from (--from-sweep)
MUON_RECIPES_TTL = "slow-links/2026-11-28-cpu-muon-recipes-time-to-loss.csv"
MUON_EVERY_STEP_TTL = "slow-links/2026-11-28-cpu-muon-overlap-every-step-time-to-loss.csv"
MUON_PEERS_TTL = "slow-links/2026-11-27-cpu-muon-peers-time-to-loss.csv"
MUON_TOPK_OVERLAP_TTL = "slow-links/2026-11-27-cpu-muon-topk-overlap-time-to-loss.csv"
MUON_TUNING = "slow-links/2026-11-27-cpu-muon-tuning.csv"
# the same against a tuned AdamW (AdamW inside every entry), its tuning rows, and the check of the
# timing runs against whole runs at 100 Mbit/s; DeMo with Muon's step beside them
ADAMW_TTL = "slow-links/2026-11-25-cpu-adamw-time-to-loss.csv"
ADAMW_TUNING = "slow-links/2026-11-25-cpu-adamw-tuning.csv"
ADAMW_TTL_CHECK = "slow-links/2026-11-25-cpu-adamw-time-to-loss-100mbit-check.csv"
DEMO_MUON_TTL = "slow-links/2026-11-26-cpu-demo-muon-time-to-loss.csv"
# the outer methods' steps against an untuned AdamW's target (the planner's steps ratios for them)
UNTUNED_ADAMW_TTL = "slow-links/2026-11-25-cpu-untuned-adamw-time-to-loss.csv"
# the step a DiLoCo sync or a streamed fragment lands on (python -m lowcomm_bench streaming)
STREAMING = "slow-links/2026-11-22-cpu-streaming-stall.csv"
# the network benchmark's runs (every method's step on shaped links; plan_check's step inputs)
NETWORK_2_HOSTS = "slow-links/2026-11-23-cpu-network-2hosts.json"
NETWORK_4_HOSTS = "slow-links/2026-11-23-cpu-network-4hosts.json"
NETWORK_2_HOSTS_TODAY = "slow-links/2026-11-27-cpu-network-2hosts-adamw-demo.json"  # the codec of 2026-11-27

# bytes and steps as replicas grow (python -m lowcomm_bench replica_bytes, bench sweep)
ONE_BIT_BYTES_PER_SYNC = "replicas/2026-12-01-cpu-one-bit-bytes-per-sync.csv"
ONE_BIT_STEPS = "replicas/2026-12-01-cpu-one-bit-steps-to-target.csv"
BYTES_PER_STEP_BY_METHOD = "replicas/2026-11-27-cpu-bytes-per-step-by-method.csv"
SHARDED_REPLICA_BYTES = "replicas/2026-11-22-cpu-sharded-replica-bytes.csv"
WORKERS_AND_SIZE_BYTES = "replicas/2026-11-22-cpu-bytes-by-workers-and-size.csv"

# steps against model size (python -m lowcomm_bench scale; --collect writes both), a CNN
SCALE = "model-size/steps-to-target.csv"
SCALE_SUMMARY = "model-size/steps-to-target-summary.csv"
CNN = "model-size/2026-11-22-cpu-cnn-digits.csv"
# long outer intervals over long budgets (python -m lowcomm_bench long_h; --collect writes both):
# dense Muon and each long-H candidate, tuned alike, at 2 and 8 replicas and two model sizes
LONG_H = "long_h.csv"
LONG_H_SUMMARY = "long_h-summary.csv"
CNN_ABLATION = "model-size/2026-11-23-cpu-cnn-digits-ablation.csv"

# replicas killed and restarted (python -m lowcomm_bench faults, absent)
FAULTS_PEERS = "fault-tolerance/2026-11-26-cpu-kill-every-30s.csv"
FAULTS_HEALS = "fault-tolerance/2026-11-27-cpu-kill-every-30s-heals.csv"
FAULTS_DEMO = "fault-tolerance/2026-11-27-cpu-kill-every-30s-demo.csv"
ABSENT = "fault-tolerance/2026-11-27-cpu-absent-replica-controls.csv"

# the codec (python -m lowcomm_bench codec)
CODEC_CPU = "codec/2026-11-24-cpu-codec-throughput.csv"
CODEC_SHARE = "codec/2026-11-24-cpu-codec-share-of-step.csv"
CODEC_H100 = "codec/2026-11-23-h100-codec-throughput.csv"

# through the frameworks (python -m lowcomm_bench megatron, hf; pipelines, replicas of two shapes)
MEGATRON = "frameworks/2026-11-24-cpu-megatron-core-bytes.csv"
HF_TRAINER = "frameworks/2026-11-26-cpu-hf-trainer-llama.csv"
HF_ONE_BIT = "frameworks/2026-11-29-cpu-hf-trainer-one-bit-recipe.csv"
PIPELINE_ACTIVATIONS = "frameworks/2026-11-23-cpu-pipeline-activations.csv"
MIXED_REPLICAS = "frameworks/2026-11-23-cpu-mixed-replica-shapes.csv"

# peers run as their authors run them (python -m lowcomm_bench mtdao)
MTDAO = "peers/2026-11-27-cpu-mtdao-authors-recipe.csv"

# the planner's checks (python -m lowcomm_bench plan_check, plan_scale; docs/planning.md)
PLAN_SCALE = "plan_scale.csv"
