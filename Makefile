# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
VPIP := $(VPY) -m pip
VLLM_WHEEL_DIR := .cache/vllm-wheel

# CUDA kernels compile whenever nvcc and a CUDA torch exist (no GPU needed).
export CUDA_HOME ?= $(wildcard /usr/local/cuda)
export MAX_JOBS ?= 2

.PHONY: install test demo lint vllm-wheel clean

$(VENV)/.requirements: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(VPIP) install -q --upgrade pip
	$(VPIP) install -q -r requirements.txt
	touch $@

install: $(VENV)/.requirements
	$(VPIP) install -q --no-build-isolation --no-deps -e .

# vLLM 0.33's wheel, read (never imported) by the differential layouts test.
# Best effort: without it that test is skipped with a reason.
vllm-wheel:
	@ls $(VLLM_WHEEL_DIR)/vllm-0.33.0-*.whl >/dev/null 2>&1 || \
	  $(VPIP) download -q --no-deps vllm==0.33.0 -d $(VLLM_WHEEL_DIR) || \
	  echo "vllm==0.33.0 wheel not downloadable: the differential test will be skipped"

test: install vllm-wheel
	$(VPY) -m pytest --ignore=tests/vllm

# TP=4 writer processes store a prompt's KV, TP=2 readers load and verify it (CUDA if present).
demo: install
	$(VPY) -m canonical_ops demo $(DEMO_ARGS)

lint: $(VENV)/.requirements
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf build *.egg-info .pytest_cache
