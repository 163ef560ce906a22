"""The reference task and the one training loop: ``spec`` (TrainSpec, what a run is), ``train``
(the loop, train_worker), ``steps`` (what trains a step: a torch optimizer or a DeepSpeed engine),
``reference`` (the byte corpus and GPT as the loop's task: ``data``, ``model``), ``deepspeed_main``
(the body of launch/train.py)."""
