# Quick start: `make bench` and `make test` do all the set-up themselves on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DATA ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/fastload/synthetic-imagenet
BENCH_ARGS ?= --quick

# NVIDIA DALI (GPU JPEG decoding; the benchmark's `dali` row; a 0.8 GB wheel) is installed where
# nvidia-smi finds an NVIDIA driver, or with WITH_DALI=1 (CI sets it in .ci/run, and then the DALI
# tests fail instead of skipping if DALI cannot be imported); WITH_DALI=0: never.
WITH_DALI ?= $(if $(shell command -v nvidia-smi 2>/dev/null),1,0)
ifeq ($(WITH_DALI),1)
DALI_EXTRA := ,dali
DALI_STAMP := -dali
DALI_NOTE := , NVIDIA DALI
TEST_ENV := FASTLOAD_REQUIRE_DALI=1
endif
# The one-line set-up summary both targets end with: versions, C extension built or not, DALI.
SUMMARY = echo "==> set-up: $$($(PY) -m fastload info)"

.PHONY: bench test venv clean-data

$(PY):
	@echo "==> set-up: creating the virtual environment $(VENV) with $$($(PYTHON) --version)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# One stamp per extra set, re-made when pyproject.toml or the C extension changes (or WITH_DALI).
# pip prints its own progress: the first install downloads about 1 GB (torch) and takes minutes.
$(VENV)/.installed-test$(DALI_STAMP): pyproject.toml setup.py fastload/_jpeg.c | $(PY)
	@echo "==> set-up: installing fastload, torch, torchvision, the test tools$(DALI_NOTE) into $(VENV)"
	$(PY) -m pip install -e '.[test,bench$(DALI_EXTRA)]'
	touch $@

$(VENV)/.installed-bench$(DALI_STAMP): pyproject.toml setup.py fastload/_jpeg.c | $(PY)
	@echo "==> set-up: installing fastload, torch, torchvision, matplotlib$(DALI_NOTE) into $(VENV)"
	$(PY) -m pip install -e '.[bench$(DALI_EXTRA)]'
	touch $@

$(DATA)/.complete: | $(VENV)/.installed-bench$(DALI_STAMP)
	@echo "==> set-up: writing the synthetic dataset (1,300 JPEGs, once) to $(DATA)"
	$(PY) -m fastload synth $(DATA) --classes 10 --per-class 100 --val-per-class 30 --seed 0
	touch $@

# The summary is printed even when the benchmark fails (e.g. on a bad BENCH_ARGS value).
bench: $(VENV)/.installed-bench$(DALI_STAMP) $(DATA)/.complete
	@echo "==> benchmark: $(PY) bench/throughput.py --data $(DATA) $(BENCH_ARGS)"
	@$(PY) bench/throughput.py --data $(DATA) $(BENCH_ARGS); status=$$?; $(SUMMARY); exit $$status

# The summary is printed even when a step fails (it says, e.g., whether the C extension was built).
test: $(VENV)/.installed-test$(DALI_STAMP)
	@echo "==> checks: ruff check, ruff format --check, mypy"
	@$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy \
		|| { status=$$?; $(SUMMARY); exit $$status; }
	@echo "==> tests: $(TEST_ENV) pytest"
	@$(TEST_ENV) $(PY) -m pytest; status=$$?; $(SUMMARY); exit $$status

venv: $(VENV)/.installed-test$(DALI_STAMP) $(VENV)/.installed-bench$(DALI_STAMP)

clean-data:
	rm -rf $(DATA)
