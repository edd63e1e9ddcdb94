"""Benchmarks: `python -m bench [all|skip|store|overhead|resume|peer]` (make bench BENCH=...)."""
