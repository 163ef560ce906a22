"""An Accelerate script (DeepSpeed through `accelerate launch`) made a ds_lowcomm one by one line
(marked below) and a "lowcomm" section in its DeepSpeed config: transformers' LlamaForCausalLM on
the reference corpus (examples/hf_trainer.py's model and data), `accelerator.prepare`,
`accelerator.backward`, `save_state` / `load_state`.

    accelerate launch --num_processes 2 --use_deepspeed --deepspeed_config_file examples/accelerate_user.json \\
        examples/accelerate_user.py --out runs/accelerate
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lab"))  # the reference corpus (lowcomm_task)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ds_lowcomm.deepspeed  # noqa: E402

ds_lowcomm.deepspeed.install()  # the one line

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DummyOptim, InitProcessGroupKwargs  # noqa: E402

from lowcomm_task.data import ByteCorpus  # noqa: E402
from hf_trainer import Windows, _digest, end, llama  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-at", type=int, default=0, help="save_state after this step")
    ap.add_argument("--resume", action="store_true", help="load_state from --out/state and go on from there")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--backend", default=None, help="torch.distributed backend (Accelerate's default: nccl); gloo "
                    "on a machine without GPUs")
    args = ap.parse_args()

    # Accelerate's own knob for the process group's backend (without it, on a machine without GPUs
    # Accelerate sets no process group up and counts one process per rank)
    handlers = [InitProcessGroupKwargs(backend=args.backend)] if args.backend else []
    accelerator = Accelerator(kwargs_handlers=handlers)
    model = llama(32, 2)
    data = Windows(ByteCorpus(max_train_bytes=1 << 20).train, 128)
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False, drop_last=True)
    optimizer = DummyOptim(model.parameters(), lr=args.lr, weight_decay=0.0)  # the config's optimizer section
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state, start = os.path.join(args.out, "state"), 0
    if args.resume:
        accelerator.load_state(state)
        start = model.global_steps  # the engine's steps, restored
        loader = accelerator.skip_first_batches(loader, start)
    losses = []
    for step, batch in enumerate(loader, start=start):
        if step == args.steps:
            break
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if step + 1 == args.save_at:
            accelerator.save_state(state)
    everyone = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(everyone, _digest(accelerator.unwrap_model(model)))
    if accelerator.is_main_process:
        report = {"losses": losses, "start": start, "steps": model.global_steps, "digests": everyone,
                  "lowcomm": model.lowcomm.summary() if hasattr(model, "lowcomm") else None}
        with open(os.path.join(args.out, "report_resumed.json" if args.resume else "report.json"), "w") as f:
            json.dump(report, f, default=str)
    # the engine released (Accelerate's references; DeepSpeed's engine.destroy() drops DeepSpeed's
    # own, to the parameters): see end()
    accelerator.free_memory()


if __name__ == "__main__":
    main()
    end()  # the engine's and the process groups' end before the interpreter's (hf_trainer.end)
