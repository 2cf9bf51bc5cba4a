"""Benchmarks that compare lmfs implementations with reference libraries (run with ``python -m``)."""
