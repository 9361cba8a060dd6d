"""Helpers the tests and the benchmarks share: model shapes and random checkpoints, servers in subprocesses."""
