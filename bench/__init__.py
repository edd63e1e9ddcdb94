"""Benchmarks of what never losing work costs: `python -m bench [all|skip|store|overhead|resume|peer]`
(`make bench BENCH=...`). See bench/README.md."""
