"""Benchmarks of eagle3_jax on a GPU (tiny shapes on the CPU): `eagle3-jax bench` (bench.py), the attention
kernels (bench_attention.py) and their measuring helpers (measure.py). They import the library; the
library never imports them (the CLI finds `bench` through an entry point)."""
