# Quick start: `make bench` and `make test` do all the set-up themselves on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/fastload/synthetic-imagenet
BENCH_ARGS ?= --quick

.PHONY: bench test venv clean-data

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# One stamp per extra set, re-made when pyproject.toml or the C extension changes.
# The test environment includes the optional extras (DALI, matplotlib), so their tests run too.
$(VENV)/.installed-test: pyproject.toml setup.py fastload/_jpeg.c | $(PY)
	$(PY) -m pip install --quiet -e '.[test,bench,dali]'
	touch $@

$(VENV)/.installed-bench: pyproject.toml setup.py fastload/_jpeg.c | $(PY)
	$(PY) -m pip install --quiet -e '.[bench,dali]'
	touch $@

$(DATA)/.complete: | $(VENV)/.installed-bench
	$(PY) -m fastload synth $(DATA) --classes 10 --per-class 100 --val-per-class 30 --seed 0
	touch $@

bench: $(VENV)/.installed-bench $(DATA)/.complete
	$(PY) bench/throughput.py --data $(DATA) $(BENCH_ARGS)

test: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PY) -m pytest

venv: $(VENV)/.installed-test $(VENV)/.installed-bench

clean-data:
	rm -rf $(DATA)
