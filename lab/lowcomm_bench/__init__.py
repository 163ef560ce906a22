"""The benchmarks, ``python -m lowcomm_bench <name>`` (the laboratory, beside the ds_lowcomm library):
real processes, real TCP through shaped links where it matters (see docs/results/, the test hosts in lab/notes/test-hosts.md)."""
