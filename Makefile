# One command sets up and runs the main job, one sets up and runs the tests (see README.md).
# Every cache stays inside the build tree (.cache/), never in the home directory.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: torch 2.13.0, the lock's. PyPI's wheel is a CUDA build (GBs); to get the CPU wheel,
# `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu` where that index is reachable.
# On a GPU node, install your CUDA build of torch first and run `make TORCH_SPEC=torch ...`, or use an
# existing venv.
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
EXTRAS ?= hf,data,hub,eval,course,dev,megatron,float8,diloco
# The versions CI tests: every package of the extras above and torch's own, pinned (`make lock`).
# `make setup` installs under them as constraints, except the torch line: torch comes from TORCH_SPEC,
# so a GPU node keeps its CUDA build. The lock holds no CUDA package (nvidia-*, triton), only what a
# CPU torch needs, so it does not clash with the one a CUDA build brings.
LOCK := requirements.lock
# Triton for the fused update's kernel tests (tests/test_adamw_kernel.py run train/adamw_kernel.py in
# Triton's interpreter on a CPU): torch's CPU build comes without it, a CUDA build brings its own, which
# stays. The version torch 2.11's CUDA build brings (the GPU nodes' image).
TRITON_SPEC ?= triton==3.6.0

CACHE := $(CURDIR)/.cache
export HF_HOME := $(CACHE)/hf
export HF_DATASETS_OFFLINE ?= 1
export HF_HUB_OFFLINE ?= 1
export XDG_CACHE_HOME := $(CACHE)/xdg
export TORCHINDUCTOR_CACHE_DIR := $(CACHE)/inductor
export TRITON_CACHE_DIR := $(CACHE)/triton
export MPLCONFIGDIR := $(CACHE)/matplotlib
export IPYTHONDIR := $(CACHE)/ipython
export JUPYTER_CONFIG_DIR := $(CACHE)/jupyter/config
export JUPYTER_DATA_DIR := $(CACHE)/jupyter/data
export JUPYTER_RUNTIME_DIR := $(CACHE)/jupyter/runtime
export ONENODE_CACHE := $(CACHE)/onenode
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup lock demo test test-fast node-check mamba-ssm mamba-ssm-wheel bubblewrap system-deps browser clean

$(VENV)/.installed: pyproject.toml $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	grep -v '^torch==' $(LOCK) > $(VENV)/constraints.txt
	$(PY) -m pip install -q -c $(VENV)/constraints.txt $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) "$(TORCH_SPEC)"
	$(PY) -m pip install -q -c $(VENV)/constraints.txt -e ".[$(EXTRAS)]"
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q "$(TRITON_SPEC)"
# NeMo Automodel's NemotronV3 and its state-dict adapter (tests/test_automodel_adapter.py), without
# its dependencies: they pin another transformers and GPU-only kernels; its model code imports without them
	$(PY) -m pip install -q --no-deps "nemo-automodel==0.7.0"
	touch $@

setup: $(VENV)/.installed

## The lock, regenerated from pyproject.toml's extras and TORCH_SPEC for CI's platform (Linux x86_64)
## and the oldest Python pyproject.toml allows; the pins already in it are kept unless
## LOCK_ARGS=--upgrade (or --upgrade-package NAME). uv rather than pip-tools: it resolves for a named
## Python and platform, not the one running it, and picks torch's CPU wheel (--torch-backend cpu)
## by itself; pip-compile resolves for the interpreter it runs in and breaks with new pips. Where
## PyTorch's index is out of reach: LOCK_TORCH="--find-links DIR", DIR holding the CPU wheel.
## The lock keeps the version of torch, not the build (`+cpu` dropped): PyPI's wheel, the CPU wheel
## and a CUDA build of that version all satisfy it.
UV_SPEC ?= uv==0.13.9
UV := $(CACHE)/uv/bin/uv
LOCK_TORCH ?= --torch-backend cpu
LOCK_ARGS ?=
comma := ,
lock:
	test -x $(UV) || ($(PYTHON) -m venv $(CACHE)/uv && $(CACHE)/uv/bin/pip install -q "$(UV_SPEC)")
	echo "$(TORCH_SPEC)" | $(UV) pip compile -q pyproject.toml - $(addprefix --extra ,$(subst $(comma), ,$(EXTRAS))) \
	  --python-version 3.11 --python-platform x86_64-manylinux_2_28 $(LOCK_TORCH) --upgrade-package torch \
	  --custom-compile-command "make lock" $(LOCK_ARGS) -o $(LOCK)
	sed -i 's/^torch==\([^+ ]*\)+cpu$$/torch==\1/' $(LOCK)
	@! grep -E '^(nvidia-|triton|cuda-)' $(LOCK) || (echo "make lock: $(LOCK) has CUDA packages, torch came from" \
	  "PyPI's CUDA build: give uv the CPU wheel (LOCK_TORCH=...)" >&2; exit 1)

## Main job: grade the example A1 cohort on CPU at tiny scale and print the table.
demo: setup bubblewrap
	$(VENV)/bin/onenode-grade demo --out out/demo

## Tests: the whole suite (CI runs this; under 20 minutes on 2 cores).
test: setup bubblewrap
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q --durations=20 -n auto --dist loadfile

## Quick loop while developing: skip the tests marked slow.
test-fast: setup bubblewrap
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q -m "not slow" -n auto --dist loadfile

## TAs, on a fresh node before grading: GPUs and NCCL, bubblewrap, the starter's and the solution's
## bench, one A1 grade of the reference and a short A2 run replayed; PASS or FAIL (with the fix) per
## item (cluster/node_check.py; PROFILE=... forces the profile). CPU-only: the CPU items, on cpu-tiny.
node-check: setup
	$(PY) cluster/node_check.py

## mamba-ssm's Triton SSD, for `--mamba-kernel mamba_ssm` (GPU only). Its CUDA extensions are not
## built (MAMBA_SKIP_CUDA_BUILD): the kit uses only the Triton kernels, which need none, and the
## install takes seconds instead of a long nvcc build (onenode/model/mamba_ssm_scan.py loads them).
## A node without internet: `make mamba-ssm-wheel` where there is one, copy dist/ over, then
## `make mamba-ssm` there installs from dist/.
MAMBA_SSM ?= mamba-ssm==2.3.2.post1
MAMBA_BUILD := MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE
mamba-ssm: setup
	$(MAMBA_BUILD) $(PY) -m pip install -q --no-build-isolation --no-deps \
	  $(if $(wildcard dist/mamba_ssm-*.whl),--no-index --find-links dist) "$(MAMBA_SSM)" einops

mamba-ssm-wheel: setup
	$(MAMBA_BUILD) $(PY) -m pip wheel -q --no-build-isolation --no-deps -w dist "$(MAMBA_SSM)" einops

## System packages (Debian/Ubuntu, as root). bubblewrap: the grader's sandbox, without which it
## refuses to run submissions (docs/SECURITY.md), so failing to install it stops here. chromium:
## the leaderboard's browser test, skipped without it.
## The grader runs every submission under bubblewrap, and refuses to run one without it.
bubblewrap:
	@command -v bwrap >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) || \
	  (echo "make: could not apt-get install bubblewrap (needs root on Debian/Ubuntu): install it, the grader does not run submissions without it" >&2; exit 1)

system-deps: bubblewrap
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null) || \
	  (echo "make system-deps: could not apt-get install chromium (needs root on Debian/Ubuntu); the browser test will be skipped" >&2)

## The former name of system-deps.
browser: system-deps

clean:
	rm -rf $(VENV) $(CACHE) out build *.egg-info
