# Every target bootstraps what it needs: `make test` and `make train` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,data,parity,notebooks
export XLA_FLAGS ?= --xla_force_host_platform_device_count=8

.PHONY: setup test lint train example bench clean

$(VENV)/.installed: setup.py constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[$(EXTRAS)]'
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(VENV)/bin/ruff check .

test: setup lint
	$(PY) -m pytest -q -n 2 tests

# The main job (until the training loop lands: a worked Gagar example).
train: setup
	$(PY) scripts/gagar_example.py

example: setup
	$(PY) scripts/gagar_example.py

bench: setup
	XLA_FLAGS= $(PY) benchmarks/advantages.py
	$(PY) benchmarks/grading.py --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
