"""The reference task and the one training loop (the laboratory, beside the ds_lowcomm library):
``spec`` (TrainSpec, what a run is), ``train`` (the loop, train_worker), ``steps`` (what trains a
step: a torch optimizer or a DeepSpeed engine), ``reference`` (the byte corpus and GPT as the loop's
task: ``data``, ``model``), ``deepspeed_main`` (the body of launch/train.py), ``compare``
(``ds-lowcomm compare``), ``workers`` (N local worker processes, for compare and the tests)."""
