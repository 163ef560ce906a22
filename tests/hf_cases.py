"""The Hugging Face Trainer cases of tests/test_hf.py, run in one launch of 2 ranks (each case a
fresh Trainer and engine in the same processes): examples/hf_trainer.py's run() with the DeepSpeed
configs below, and Lightning's DeepSpeedStrategy building its engine (its own code calling
deepspeed.initialize). Rank 0 writes every case's report to argv[1] as JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import hf_trainer  # noqa: E402  (its import installs ds_lowcomm's route: the one line)
import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import ds_lowcomm.deepspeed as dl  # noqa: E402
from lowcomm_task.data import ByteCorpus  # noqa: E402

STEPS = 6
RECIPE_OUTER = json.loads((ROOT / "configs" / "muloco_sign_zero2_bf16.json").read_text())["lowcomm"]


class StepCounter(TrainerCallback):
    """The optimizer steps this process ran (a resumed run: only those after the checkpoint)."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.steps += 1


class FirstStepMoves(TrainerCallback):
    """Per parameter, how far the training moved its elements: (largest, smallest nonzero)
    |change| (with the warmup's lr 0 at the first step, the second is the only one that moves: a
    sign step moves every element it moves by the same lr)."""

    def __init__(self):
        self.moves = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.before = {n: p.detach().float().clone() for n, p in model.named_parameters()}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        for n, p in model.named_parameters():
            d = (p.detach().float() - self.before[n]).abs()
            d = d[d > 0]
            self.moves[n] = (d.max().item(), d.min().item()) if d.numel() else (0.0, 0.0)


class MuonTags(TrainerCallback):
    """Each parameter's ``use_muon`` tag as training ran (None: untagged)."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.tags = {n: getattr(p, "use_muon", None) for n, p in model.named_parameters()}


def config(lowcomm=None):
    base = json.loads((ROOT / "examples" / "hf_trainer.json").read_text())
    base["optimizer"]["params"]["torch_adam"] = True  # torch's AdamW in plain DeepSpeed too (no op to build)
    base.pop("lowcomm")
    return {**base, **({"lowcomm": lowcomm} if lowcomm else {})}


def lightning_case(optimizer: str) -> dict:
    """Lightning's DeepSpeedStrategy, as far as this CPU machine lets it run: the strategy's own
    ``_setup_model_and_optimizer`` (what its ``setup`` calls once its CUDA-only check has passed,
    on a GPU), handed the module and the optimizer its ``configure_optimizers`` built, with a
    lowcomm section in the strategy's config; then 4 steps of the engine it returns. What came
    back and what it did, or the error it raised."""
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DeepSpeedStrategy

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            if optimizer == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.02)
            return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.0)

    torch.manual_seed(0)
    module = Regression()
    strategy = DeepSpeedStrategy(config={"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0},
                                         "lowcomm": {"method": "demo", "topk": 2, "chunk": 4}})
    # the device the strategy's root_device would be on a GPU (cuda:LOCAL_RANK), on this CPU: DeepSpeed
    # reads its index (Lightning passes args.device_rank = root_device.index)
    strategy.parallel_devices = [torch.device("cpu", int(os.environ["LOCAL_RANK"]))]
    try:
        engine, opt = strategy._setup_model_and_optimizer(module, module.configure_optimizers())
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"}
    rank = torch.distributed.get_rank()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))  # each replica its own batch
    y = x @ torch.randn(8, 1, generator=torch.Generator().manual_seed(9))
    losses = []
    for _ in range(6):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    digest = hf_trainer._digest(module)
    digests = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(digests, digest)
    return {"engine": type(engine).__module__ + "." + type(engine).__name__,
            "lowcomm": engine.lowcomm.summary() if hasattr(engine, "lowcomm") else None,
            "lr": [group["lr"] for group in opt.param_groups], "losses": losses, "digests": digests,
            "routed": hasattr(__import__("deepspeed").initialize, "_ds_lowcomm_plain")}


def main() -> None:
    out, work = Path(sys.argv[1]), Path(sys.argv[2])
    corpus = ByteCorpus(max_train_bytes=1 << 20)
    kw = dict(steps=STEPS, corpus=corpus, width=32)
    demo = {"method": "demo", "topk": 16, "chunk": 64}
    reports = {}
    # plain DeepSpeed first (DeepSpeed keeps a ds_lowcomm engine's mpu for every later engine: refused)
    dl.uninstall()  # DeepSpeed's own deepspeed.initialize, untouched
    reports["plain"] = hf_trainer.run(config(), str(work / "plain2"), **kw)
    dl.install()
    reports["plain_installed"] = hf_trainer.run(config(), str(work / "plain1"), **kw)
    reports["demo"] = hf_trainer.run(config(demo), str(work / "demo"), save_steps=3, **kw)
    counted = StepCounter()
    reports["demo_resumed"] = hf_trainer.run(config(demo), str(work / "demo"), resume="checkpoint-3",
                                             callbacks=[counted], **kw)
    reports["demo_resumed"]["steps_run"] = counted.steps
    own = config(demo)  # no optimizer section: the Trainer builds torch's AdamW (2 groups), ds_lowcomm takes it over
    del own["optimizer"]
    reports["demo_trainer_optimizer"] = hf_trainer.run(own, str(work / "demo_own"), **kw)
    # update muon with the Trainer's own AdamW groups and an untied head: the one decision of
    # which parameters take Muon's step holds there too (the embedding and the head by sign)
    moves = FirstStepMoves()
    hf_trainer.run(own | {"lowcomm": {**demo, "update": "muon"}}, str(work / "demo_muon_own"), tied=False,
                   callbacks=[moves], **{**kw, "steps": 2})
    reports["demo_muon_untied_moves"] = moves.moves
    # an outer loop with a Muon inner optimizer (MuLoCo) with the Trainer's own groups: the same
    # decision, as tags (ZeRO 0 fp32, where it runs under DeepSpeed)
    tags = MuonTags()
    report = hf_trainer.run(own | {"lowcomm": {"method": "diloco", "sync_every": 3, "replica_size": 1,
                                               "inner_optimizer": "muon"}, "zero_optimization": {"stage": 0}},
                            str(work / "diloco_muon_own"), tied=False, callbacks=[tags], **{**kw, "steps": 3})
    reports["diloco_muon_own"] = {"tags": tags.tags, "digests": report["digests"],
                                  "method": report["lowcomm"]["method"]}
    reports["diloco"] = hf_trainer.run(config({"method": "diloco", "sync_every": 3, "replica_size": 1}),
                                       str(work / "diloco"), **kw)
    # the one-bit recipe (issue 54): ds_lowcomm's own Muon at ZeRO 1 in bf16 (the Trainer's AdamW
    # section for the rest), and the shipped Trainer config (DeepSpeed's Muon section at the
    # Trainer's lr, ZeRO 2, bf16); H 3, so that the 6 steps end on a sync
    sign = {**RECIPE_OUTER, "sync_every": 3, "replica_size": 1}
    recipe = config({**sign, "inner_optimizer": "muon", "inner_muon_lr": 0.02}) | {
        "zero_optimization": {"stage": 1}, "bf16": {"enabled": "auto"}}
    reports["recipe_own_muon_zero1_bf16"] = hf_trainer.run(recipe, str(work / "recipe1"), bf16=True, **kw)
    shipped = json.loads((ROOT / "examples" / "hf_trainer_muloco_sign.json").read_text())
    reports["recipe_shipped_zero2_bf16"] = hf_trainer.run(shipped | {"lowcomm": {**shipped["lowcomm"], **sign}},
                                                          str(work / "recipe2"), bf16=True, **kw)
    reports["recipe_shipped_outer"] = shipped["lowcomm"]
    # the README's command, as written there (its script's main() with its arguments: 20 steps, 64 wide)
    sys.argv = ["hf_trainer.py", "--deepspeed", str(ROOT / "examples" / "hf_trainer.json"), "--out", str(work / "readme")]
    hf_trainer.main()
    if torch.distributed.get_rank() == 0:
        reports["readme"] = json.loads((work / "readme" / "report.json").read_text())
    reports["lightning"] = lightning_case("adamw")
    reports["lightning_sgd"] = lightning_case("sgd")
    try:
        hf_trainer.run(config(), str(work / "plain3"), **kw)
    except Exception as err:  # noqa: BLE001
        reports["plain_after_lowcomm"] = f"{type(err).__name__}: {err}"
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(reports, default=str))


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
    hf_trainer.end()  # the process groups gone before interpreter shutdown (pytorch/pytorch#190489)
