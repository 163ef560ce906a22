#!/usr/bin/env python
"""Train the reference task with DeepSpeed and a lowcomm method.

    deepspeed --num_gpus 2 launch/train.py --deepspeed_config configs/demo.json --steps 300 --metrics-out m.json
    torchrun --nproc_per_node 2 launch/train.py --deepspeed_config configs/diloco.json
    mpirun -np 2 python launch/train.py --deepspeed_config configs/dct_diloco.json
"""

from lowcomm_task.deepspeed_main import main

if __name__ == "__main__":
    main()
