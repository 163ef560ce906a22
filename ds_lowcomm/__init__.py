"""ds_lowcomm: low-communication data parallelism (DeMo, DiLoCo, DCT-compressed outer momentum)."""

# torch's dynamo, imported after the process group is made (torch.optim imports it with the first
# optimizer), keeps references to the default group that outlive destroy_process_group(): the
# group's gloo worker threads then run into interpreter shutdown, where one dropping its last
# operation's tensors aborts the process ("terminate called without an active exception",
# pytorch/pytorch#190489). Imported here, before a script makes its group, it holds none, and the
# group and its threads go at destroy_process_group(). Every training script imports it anyway.
import torch._dynamo  # noqa: E402,F401

__version__ = "0.1.0"
