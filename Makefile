# The README's two commands. Each bootstraps .venv idempotently: torch==2.13.0 first (the local CPU
# wheel on these machines, so pip never pulls a CUDA build), then this package in editable mode.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.workbench-installed
LAB_IP ?= 127.0.0.1
LAB_PORT ?= 8888
PYTEST_ARGS ?=
# JupyterLab refuses root unless told; containers and CI machines often run as root.
LAB_ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: lab test test-all test-exhaustive test-gpu gpu-bundle gpu-check install browser clean extension

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	@# An editable install skips pyproject's data-files: enable the jupyter_server extension by hand.
	install -D -m644 workbench/jupyter/jupyter_server_config.d/parallel_workbench.json \
	  $(VENV)/etc/jupyter/jupyter_server_config.d/parallel_workbench.json
	@touch $(STAMP)

install: $(STAMP)

# Debian's Chromium for the real-browser UI tests (skipped where it cannot be installed).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	      || echo "warning: could not install chromium; browser tests will be skipped"; \
	  else echo "note: chromium not found and apt-get unavailable; browser tests will be skipped"; fi; }

# The JupyterLab extension (extensions/ -> workbench/labextension/, linked into the venv): rebuilt only when
# its sources' hash changed; without Node the committed prebuilt one is used.
extension: $(STAMP)
	@VENV=$(abspath $(VENV)) extensions/build.sh

lab: $(STAMP) extension
	@echo "Starting JupyterLab on notebooks/ -- open the http://$(LAB_IP):$(LAB_PORT)/lab?token=... URL printed below"
	$(VENV)/bin/jupyter lab --no-browser --ip=$(LAB_IP) --port=$(LAB_PORT) --ServerApp.root_dir=notebooks $(LAB_ROOT_FLAG)

# The suite a newcomer waits for (at most 12 minutes on 2 quiet cores): every test but those listed in
# tests/slow.txt (each with its measured time).
test: $(STAMP) browser extension
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Every test, as CI runs it (.ci/run): `make test` and the tests of tests/slow.txt.
test-all: $(STAMP) browser extension
	$(PY) -m pytest $(PYTEST_ARGS)

# `make test-all` with the exhaustive variants, too long for CI's 90 minutes: every tutorial's dashboard and
# plots driven in Chromium (Run All twice, and a page reload), not only the first ones; and every OpInfo
# sample of our SPMD rule ops under both rule sets on both meshes (tests/clients/test_spmd_opinfo.py).
test-exhaustive: $(STAMP) browser extension
	WORKBENCH_BROWSER_TUTORIALS=all WORKBENCH_BROWSER_PLOTS=all WORKBENCH_SPMD_OPINFO=all $(PY) -m pytest $(PYTEST_ARGS)

# The tests marked `gpu` (NCCL training, pinned async checkpoints and bitwise resume on CUDA, CUDA memory
# events, the Triton kernels on the GPU, the GPU benchmarks' smoke runs), on a machine with a GPU. It
# uses the CUDA torch already installed for GPU_PYTHON (never the CPU wheel): .venv-gpu sees that
# interpreter's packages through a .pth file, and only what is missing is installed. Without a GPU
# every test is skipped with the reason.
GPU_PYTHON ?= python3
GPU_VENV := .venv-gpu
GPU_STAMP := $(GPU_VENV)/.workbench-installed

$(GPU_STAMP): pyproject.toml
	@$(GPU_PYTHON) -c "import torch" 2>/dev/null || { echo "error: $(GPU_PYTHON) has no torch; set GPU_PYTHON to the python of your CUDA torch (e.g. make test-gpu GPU_PYTHON=/opt/torch/bin/python3)"; exit 2; }
	@test -x $(GPU_VENV)/bin/python || $(GPU_PYTHON) -m venv $(GPU_VENV)
	@site=$$($(GPU_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])"); \
	  $(GPU_PYTHON) -c "import sys, torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))" > $$site/gpu-torch.pth
	$(GPU_VENV)/bin/python -m pip install --quiet --no-build-isolation -e '.[dev]' 2>/dev/null \
	  || $(GPU_VENV)/bin/python -m pip install --quiet -e '.[dev]'
	@touch $(GPU_STAMP)

test-gpu: $(GPU_STAMP)
	$(GPU_VENV)/bin/python -c "import torch; print('torch', torch.__version__, '| CUDA', torch.version.cuda, '| GPUs', torch.cuda.device_count())"
	$(GPU_VENV)/bin/python -m pytest -m gpu -v $(PYTEST_ARGS)

# The GPU check (README: "Checking a GPU machine"). `make gpu-bundle`, on a machine with a registry, downloads
# the wheels pinned in gpu/bundle.toml (CPython 3.12, manylinux x86_64; never torch) into $(GPU_BUNDLE).
# `make gpu-check`, on the GPU machine, needs no registry and no .venv: with GPU_PYTHON's own torch it
# installs those wheels offline into $(GPU_CHECK_WORK)/site and runs every part within 8 minutes
# (GPU_CHECK_ARGS=--quick: a subset within 3), writing summary.json and the logs into $(GPU_CHECK_OUT).
# Without a GPU the GPU parts are skipped with the reason and the rest runs (tests/test_gpu_check.py).
GPU_BUNDLE ?= .gpu-bundle
GPU_CHECK_OUT ?= gpu-check-out
GPU_CHECK_WORK ?= .gpu-check
GPU_CHECK_ARGS ?=

gpu-bundle:
	$(PYTHON) gpu/bundle.py download --dest $(GPU_BUNDLE)

gpu-check:
	$(GPU_PYTHON) gpu/check.py --bundle $(GPU_BUNDLE) --out $(GPU_CHECK_OUT) --work $(GPU_CHECK_WORK) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) build dist *.egg-info .pytest_cache
