# Quick start: `make bench` and `make test` do all the set-up themselves on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The synthetic set grows with the CPUs, so that every split holds more batches than the
# benchmark's workers decode ahead (a split smaller than that is not measured, and says so): up to
# 4 CPUs 10 x 100 train and 10 x 30 val images; above, 64 and 20 per class per CPU (16 CPUs: 10,240
# train images, 40 batches of 256 for the GPU model run).
CPUS := $(shell nproc 2>/dev/null || echo 2)
PER_CLASS ?= $(shell [ $(CPUS) -le 4 ] && echo 100 || echo $$(( $(CPUS) * 64 )))
VAL_PER_CLASS ?= $(shell [ $(CPUS) -le 4 ] && echo 30 || echo $$(( $(CPUS) * 20 )))
DATA ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/fastload/synthetic-imagenet$(if $(filter 100,$(PER_CLASS)),,-$(PER_CLASS))
BENCH_ARGS ?= --quick
# On a GPU machine `make bench` then asks the GPU user's question: does the GPU wait for data?
# A ResNet-50 training step fed by each loader, against the same step on data already on the GPU.
MODEL_ARGS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),--model resnet50,)

# NVIDIA DALI (GPU JPEG decoding; the benchmark's `dali` row; a 0.8 GB wheel) is installed where
# nvidia-smi finds an NVIDIA driver, or with WITH_DALI=1 (then the DALI tests fail instead of
# skipping if DALI cannot be imported); WITH_DALI=0: never. `make test-dali` (which CI runs after
# `make test`) installs it and runs the tests that need it.
WITH_DALI ?= $(if $(shell command -v nvidia-smi 2>/dev/null),1,0)
ifeq ($(WITH_DALI),1)
DALI_EXTRA := ,dali
DALI_STAMP := -dali
DALI_NOTE := , NVIDIA DALI
TEST_ENV := FASTLOAD_REQUIRE_DALI=1
endif
# CPU-only torch (TORCH=cpu): torch's CPU build instead of PyPI's default CUDA build (a 1.4 GB
# venv instead of 5.7 GB, see docs/getting-started.md). Installed first, so that fastload's
# own install finds torch already there. TORCH_CPU_ARGS says where pip takes it from.
TORCH ?= default
TORCH_CPU_ARGS ?= --index-url https://download.pytorch.org/whl/cpu torch torchvision
ifeq ($(TORCH),cpu)
TORCH_FIRST = $(PY) -m pip install $(TORCH_CPU_ARGS)
else
TORCH_FIRST = true
endif
# Said where no NVIDIA driver is found and the default (CUDA) build of torch is installed.
TORCH_NOTE := $(if $(filter default,$(TORCH)),$(if $(shell command -v nvidia-smi 2>/dev/null),,; no NVIDIA driver here: TORCH=cpu installs torch's CPU build instead (1.4 GB of venv instead of 5.7 GB)))
# pytest's processes (pytest-xdist): most tests wait on the worker processes they start, so two
# share 2 cores well (about 10 minutes instead of 15 on this project's 2 cores); at most 8.
# TEST_JOBS=0: one process, no xdist.
TEST_JOBS ?= $(shell n=$(CPUS); [ $$n -gt 8 ] && n=8; echo $$n)
# The one-line set-up summary both targets end with: versions, C extension built or not, DALI.
SUMMARY = echo "==> set-up: $$($(PY) -m fastload info)"

.PHONY: bench test test-dali docs venv clean-data

$(PY):
	@echo "==> set-up: creating the virtual environment $(VENV) with $$($(PYTHON) --version)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

# One stamp per extra set, re-made when pyproject.toml or the C extension changes (or WITH_DALI).
# pip prints its own progress: the first install downloads torch (about 2.6 GB with its CUDA
# packages; TORCH=cpu: about 200 MB) and takes minutes.
$(VENV)/.installed-test$(DALI_STAMP): pyproject.toml setup.py fastload/_jpeg.c fastload/_nvimgcodec.c fastload/_resample.c | $(PY)
	@echo "==> set-up: installing fastload, torch, torchvision, the test tools$(DALI_NOTE) into $(VENV)$(TORCH_NOTE)"
	$(TORCH_FIRST)
	$(PY) -m pip install -e '.[test,bench$(DALI_EXTRA)]'
	touch $@

$(VENV)/.installed-bench$(DALI_STAMP): pyproject.toml setup.py fastload/_jpeg.c fastload/_nvimgcodec.c fastload/_resample.c | $(PY)
	@echo "==> set-up: installing fastload, torch, torchvision, matplotlib$(DALI_NOTE) into $(VENV)$(TORCH_NOTE)"
	$(TORCH_FIRST)
	$(PY) -m pip install -e '.[bench$(DALI_EXTRA)]'
	touch $@

$(DATA)/.complete: | $(VENV)/.installed-bench$(DALI_STAMP)
	@echo "==> set-up: writing the synthetic dataset (10 classes x $(PER_CLASS) + $(VAL_PER_CLASS) JPEGs, once) to $(DATA)"
	$(PY) -m fastload synth $(DATA) --classes 10 --per-class $(PER_CLASS) --val-per-class $(VAL_PER_CLASS) --seed 0
	touch $@

# The set-up summary first (so it is there even when the benchmark fails); the verdict is last.
bench: $(VENV)/.installed-bench$(DALI_STAMP) $(DATA)/.complete
	@$(SUMMARY)
	@echo "==> benchmark: $(PY) bench/throughput.py --data $(DATA) $(BENCH_ARGS)"
	@$(PY) bench/throughput.py --data $(DATA) $(BENCH_ARGS)
	@$(if $(MODEL_ARGS),echo "==> does the GPU wait? $(PY) bench/throughput.py --data $(DATA) $(MODEL_ARGS)")
	@$(if $(MODEL_ARGS),$(PY) bench/throughput.py --data $(DATA) $(MODEL_ARGS))

# The summary is printed even when a step fails (it says, e.g., whether the C extension was built).
test: $(VENV)/.installed-test$(DALI_STAMP)
	@echo "==> checks: ruff check, ruff format --check, mypy"
	@$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/mypy \
		|| { status=$$?; $(SUMMARY); exit $$status; }
	@echo "==> docs: sphinx-build -W (warnings are errors) docs -> docs/_build/html"
	@$(PY) -m sphinx -b html -W --keep-going -q docs docs/_build/html || { status=$$?; $(SUMMARY); exit $$status; }
	@echo "==> tests: $(TEST_ENV) pytest -n $(TEST_JOBS) (pytest-xdist processes)"
	@$(TEST_ENV) $(PY) -m pytest -n $(TEST_JOBS) --dist worksteal; status=$$?; $(SUMMARY); exit $$status

# The tests that need NVIDIA DALI (marked `dali`), with DALI installed and required: they fail
# instead of skipping if it cannot be imported. CI runs it after `make test` (see .ci/run).
test-dali:
	@$(MAKE) --no-print-directory _test-dali WITH_DALI=1

_test-dali: $(VENV)/.installed-test$(DALI_STAMP)
	@echo "==> tests that need DALI: FASTLOAD_REQUIRE_DALI=1 pytest -m dali"
	@FASTLOAD_REQUIRE_DALI=1 $(PY) -m pytest -m dali; status=$$?; $(SUMMARY); exit $$status

# The documentation site: open docs/_build/html/index.html
docs: $(VENV)/.installed-test$(DALI_STAMP)
	$(PY) -m sphinx -b html -W --keep-going -q docs docs/_build/html
	@echo "==> docs: file://$(CURDIR)/docs/_build/html/index.html"

venv: $(VENV)/.installed-test$(DALI_STAMP) $(VENV)/.installed-bench$(DALI_STAMP)

clean-data:
	rm -rf $(DATA)
