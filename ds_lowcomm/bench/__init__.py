"""Benchmarks: real processes, real TCP through shaped links where it matters (see docs/benchmarks.md)."""
