# The two set-up commands. Each creates .venv (Python 3.12, the current jax) and installs the project on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# A Python 3.12: on PATH, else pyenv's. The project needs 3.12 (the GPU image's Python).
PY312 := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12); print(sys.executable)' 2>/dev/null && break; done)

.PHONY: demo test

$(STAMP): pyproject.toml
	@test -n "$(PY312)" || { echo "make: the project needs a Python 3.12 (python3.12 on PATH, or pyenv's)" >&2; exit 1; }
	$(PY312) -m venv $(VENV)
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
