# The two set-up commands. Each creates .venv and installs the project on first use.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	# SpecForge and speculators are the drafter's outside oracles; their own dependencies (CUDA builds,
	# training stacks) are not wanted.
	$(PY) -m pip install -q --no-deps specforge==0.2.0 speculators==0.9.0
	touch $@

demo: $(STAMP)
	$(PY) -m eagle3_jax.demo

test: $(STAMP)
	$(PY) -m pytest -q tests
