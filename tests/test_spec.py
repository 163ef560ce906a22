"""TrainSpec: a JSON round trip, the command lines' defaults are the spec's, and errors name the flag."""

import dataclasses
import json

import pytest

from ds_lowcomm.cli import _parser
from ds_lowcomm.config import ConfigError
from lowcomm_task.deepspeed_main import parser as ds_parser
from lowcomm_task.deepspeed_main import spec_from_args
from lowcomm_task.spec import DEFAULTS, TrainSpec


def test_json_round_trip():
    spec = TrainSpec(lowcomm={"method": "mtdao", "momentum_betas": [0.9, 0.99], "momentum_weights": [0.5, 0.3]},
                     model={"n_layer": 1, "n_embd": 32, "n_head": 2}, betas=[0.9, 0.99], steps=7, save_dir="ckpt",
                     save_at=3, stop_at_val_loss=2.5, label="x", verbose=False)
    back = TrainSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert back == spec
    assert back.model.n_head == 2 and back.betas == (0.9, 0.99) and back.eval_interval == 1
    assert back.lowcomm_config.method == "mtdao"
    assert TrainSpec.from_dict({"steps": 50}).eval_interval == 5  # missing fields take their defaults


def test_command_lines_defaults_are_the_specs():
    assert TrainSpec.from_args(_parser().parse_args(["compare"])) == DEFAULTS
    ds = spec_from_args(ds_parser().parse_args(["--deepspeed_config", "c.json", "--save-dir", "d", "--resume"]))
    assert ds == dataclasses.replace(DEFAULTS, deepspeed_config="c.json", save_dir="d", resume_from="d")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", "0"], "--steps must be >= 1; got 0"),
        (["--eval-every", "-1"], "--eval-every must be >= 1; got -1"),
        (["--n-embd", "30"], "--n-embd must be a multiple of --n-head; got 30 and 4"),
        (["--save-at", "3"], "--save-at needs --save-dir"),
        (["--resume"], "--resume needs --save-dir"),
    ],
)
def test_errors_name_the_flag(argv, message):
    with pytest.raises(ConfigError, match=message):
        spec_from_args(ds_parser().parse_args(["--deepspeed_config", "c.json", *argv]))


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"lr": 0}, "lr must be a number > 0; got 0"),
        ({"dtype": "fp8"}, "dtype must be one of fp32, bf16, fp16; got 'fp8'"),
        ({"lowcomm": {"method": "powersgd"}}, "lowcomm.method must be one of"),
        ({"model": {"width": 8}}, "model: unknown field"),
        ({"data_limits": {}}, "spec: unknown field"),
        ({"clip_grad": -1.0}, r"clip_grad must be a number >= 0 \(0: no clipping\); got -1.0"),
        ({"clip_grad": 1.0, "deepspeed_config": "c.json"}, "clip_grad: with deepspeed_config the config's gradient_clipping"),
        ({"lr_decay": "linear"}, "lr_decay must be one of cosine, none; got 'linear'"),
        ({"data_shards": "random"}, "data_shards must be one of contiguous, interleaved; got 'random'"),
        ({"lowcomm": {"method": "mtdao", "switch_step": 10, "fault_tolerance": {"lighthouse": "127.0.0.1:1",
                                                                             "replica_id": "0", "num_replica_groups": 2}}},
         "lowcomm.switch_step must be 0 with lowcomm.fault_tolerance"),
    ],
)
def test_field_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainSpec.from_dict(fields)


def test_interleaved_shards_deal_every_block_once_across_the_corpus(tmp_path):
    """data_shards "interleaved": the training bytes in SHARD_BLOCK blocks, block b on rank b mod W,
    so the shards are disjoint, together the corpus (whole blocks), and each one spans all of it
    (where "contiguous" gives rank 0 the first part alone)."""
    import torch

    from lowcomm_task.data import SHARD_BLOCK, ByteCorpus

    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_bytes(bytes(range(256)) * 200)  # 51,200 bytes: 95% train
    corpus = ByteCorpus(corpus_file)
    world = 3
    blocks = corpus.train.numel() // (SHARD_BLOCK * world) * world
    shards = [corpus.shard(r, world, "interleaved") for r in range(world)]
    for r, shard in enumerate(shards):
        expected = [corpus.train[b * SHARD_BLOCK:(b + 1) * SHARD_BLOCK] for b in range(r, blocks, world)]
        assert torch.equal(shard, torch.cat(expected))
    assert sum(s.numel() for s in shards) == blocks * SHARD_BLOCK
    contiguous = corpus.shard(0, world)
    assert torch.equal(contiguous, corpus.train[:contiguous.numel()])
    with pytest.raises(ValueError, match="data_shards must be one of contiguous, interleaved"):
        corpus.shard(0, world, "random")
