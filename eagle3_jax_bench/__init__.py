"""Benchmarks of eagle3_jax on a GPU (tiny shapes on the CPU). A small core (core.py: the time budget,
result rows with their floors and JSON, timers, ceilings; profile.py; presets.py: the model shapes;
inputs.py: random weights and states; steps.py: the timed steps and their bytes) and one module per
benchmark built on it: dense, moe, sampling (with checks.py, the `eagle3-jax bench` command in bench.py),
exact, attention, training and pair. They import the library's public names; the library never imports
them (the CLI finds `bench` through an entry point)."""
