# The README's two commands: `make bench` (the depth sweep) and `make test`.
# Both build a local virtual environment first, so a fresh machine needs nothing
# installed by hand. TORCH is the exact version that CI's package index serves as
# its CPU build; PyPI serves the CUDA build for the same pin (several GB of CUDA
# packages), so elsewhere add TORCH_INDEX=https://download.pytorch.org/whl/cpu. On a
# CUDA machine run `make test TORCH=torch` for PyTorch's default CUDA build.
PYTHON ?= python3
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
# gpu-check keeps its own venv (.venv-gpu) and takes PyTorch's default (CUDA) build,
# where the machine has no CUDA torch already (see bench/gpu_check.py).
GPU_TORCH ?= torch
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test bench gpu-check clean

# One test worker per core of CI's machine (2 CPU cores; each worker runs torch on one
# thread, tests/conftest.py). --dist loadfile keeps a file's tests, and so its module
# fixtures, in one worker: they run once, not once a worker.
TEST_WORKERS ?= 2
test: $(VENV)/.installed
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

# The sweep writes bench/results/local/ (ignored by git): the clone stays clean.
# `make bench BENCH_ARGS=--record` updates the committed bench/results/ instead.
BENCH_ARGS ?=
bench: $(VENV)/.installed
	$(PY) bench/resnet_depth_sweep.py $(BENCH_ARGS)

# Everything that needs a GPU, in stages, 25 minutes at most including the install;
# exits at once on a machine without one.
gpu-check:
	TORCH="$(GPU_TORCH)" $(PYTHON) bench/gpu_check.py

# --no-cache-dir: a fresh machine reuses no wheel, and a cached copy of torch's would
# take as much disk again as the wheel itself.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-cache-dir --upgrade pip
	$(PY) -m pip install --quiet --no-cache-dir "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet --no-cache-dir -e ".[test,bench]"
	touch $@

clean:
	rm -rf $(VENV) .venv-gpu build *.egg-info .pytest_cache
