"""ds_lowcomm: low-communication data parallelism (DeMo, DiLoCo, DCT-compressed outer momentum)."""

__version__ = "0.1.0"
