# The two set-up commands. Each creates .venv and installs the project on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The GPU image runs jax 0.11.2 (Python 3.12), which lowers Mosaic GPU kernels differently from the
# suite's jax 0.10.2. The Mosaic GPU kernel's tests (planning, refusals, lowering for CUDA) also run
# under it, in a second venv, when a Python 3.12 is found.
GPU_JAX_VENV := .venv-jax0.11
GPU_JAX_STAMP := $(GPU_JAX_VENV)/.installed
PY312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null && break; done)

.PHONY: demo test test-gpu-jax

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# SpecForge and speculators are the drafter's outside oracles; their own dependencies (CUDA builds,
	# training stacks) are not wanted.
	$(PY) -m pip install -q --no-deps specforge==0.2.0 speculators==0.9.0
	touch $@

demo: $(STAMP)
	JAX_PLATFORMS=cpu $(PY) -m eagle3_jax.demo

# ruff first (seconds), then the suite on two workers (one per core; each test file stays on one worker,
# so a module's fixtures are built once); pytest's last line gives its time, --durations the slowest tests.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests
	$(MAKE) --no-print-directory test-gpu-jax

$(GPU_JAX_STAMP): Makefile  # the venv's pins are here
	$(PY312) -m venv $(GPU_JAX_VENV)
	$(GPU_JAX_VENV)/bin/python -m pip install -q jax==0.11.2 safetensors pytest
	touch $@

ifeq ($(PY312),)
test-gpu-jax:
	@echo "SKIPPED: the jax 0.11.2 run of tests/test_prefill_mgpu.py needs a Python 3.12, and none was found"
else
test-gpu-jax: $(GPU_JAX_STAMP)
	PYTHONPATH=. $(GPU_JAX_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_prefill_mgpu.py
endif
