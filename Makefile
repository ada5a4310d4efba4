# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
VPIP := $(VPY) -m pip
VLLM_WHEEL_DIR := .cache/vllm-wheel
# vLLM 0.33 in a venv of its own (test-vllm, bench-vllm); set before any rule names it.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(abspath $(VLLM_VENV))/bin/python

# CUDA kernels compile whenever nvcc and a CUDA torch exist (no GPU needed).
export CUDA_HOME ?= $(wildcard /usr/local/cuda)
export MAX_JOBS ?= 2

.PHONY: install test demo bench bench-vllm lint vllm-wheel redis-server clean test-vllm

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

# The Redis tier's tests start real redis-server processes (a single server and a 3-node
# cluster) on loopback ports. On a fresh Debian machine running as root this installs
# Debian's redis-server package (7.0 on bookworm); elsewhere it says what to install.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing redis-server (apt-get) for the Redis tier's tests"; \
	    apt-get update -q >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server >/dev/null; \
	  else \
	    echo "redis-server not found: install it (Debian/Ubuntu: apt-get install redis-server)"; exit 1; \
	  fi; }

# Every test; tests/vllm_plugin is reported skipped here (no vLLM in this venv: `make test-vllm`).
test: install vllm-wheel redis-server
	$(VPY) -m pytest

# TP=4 writer processes store a prompt's KV, TP=2 readers load and verify it (CUDA if present);
# then a restart through the file store: a TP=4 engine persists a prompt and exits, a new
# TP=2 x PP=2 engine (empty regions) reads every page back from the files and verifies it;
# fp8 KV (per-tensor scales) persisted at TP=4 and read at TP=2 the same way;
# a hybrid model (Qwen3-Next-like) persists its attention pages and its GDN state at TP=4 and
# a TP=2 engine reads both back, every byte checked;
# then two nodes sharing through one Redis server (a throwaway redis-server on a unix socket,
# installed as `make test` does where it can, else this part is skipped): a TP=8 engine
# persists, a TP=2 engine with its own directory reads every page from the server and keeps a
# copy in its files.
# DEMO_STORE: the store directory (default: a fresh temporary one, removed afterwards; a
# directory you name is kept, and created private to you when missing). DEMO_STORE_ARGS:
# flags every persistent phase shares.
DEMO_STORE ?=
DEMO_STORE_ARGS ?=
demo: install
	$(VPY) -m canonical_ops demo $(DEMO_ARGS)
	@set -e; store="$(DEMO_STORE)"; \
	if [ -z "$$store" ]; then \
	  store=$$(mktemp -d "$${TMPDIR:-/tmp}/canonical-kv-store.XXXXXX"); \
	  trap 'rm -rf "$$store"' EXIT; fi; \
	echo; echo "== restart through the file store $$store"; \
	echo "== a TP=4 engine persists the prompt and exits:"; \
	$(VPY) -m canonical_ops demo --store "$$store" --phase write --writer-tp 4 $(DEMO_STORE_ARGS); \
	echo; echo "== a new TP=2 x PP=2 engine, empty regions, reads it from the files:"; \
	$(VPY) -m canonical_ops demo --store "$$store" --phase read --reader-tp 2 --reader-pp 2 $(DEMO_STORE_ARGS); \
	echo; echo "== fp8 KV (float8_e4m3fn, per-tensor scales in the namespace): TP=4 persists, TP=2 reads:"; \
	$(VPY) -m canonical_ops demo --preset llama3-8b-fp8 --store "$$store" --phase write --writer-tp 4 $(DEMO_STORE_ARGS); \
	$(VPY) -m canonical_ops demo --preset llama3-8b-fp8 --store "$$store" --phase read --reader-tp 2 $(DEMO_STORE_ARGS); \
	echo; echo "== a hybrid model (Qwen3-Next-like: GDN state + attention): TP=4 persists KV and state, TP=2 reads both:"; \
	$(VPY) -m canonical_ops demo --preset qwen3-next-like --store "$$store" --phase write --writer-tp 4; \
	$(VPY) -m canonical_ops demo --preset qwen3-next-like --store "$$store" --phase read --reader-tp 2
	@$(MAKE) -s redis-server >/dev/null 2>&1 || true  # installs it where it can (root + apt-get)
	@set -e; if ! command -v redis-server >/dev/null 2>&1; then \
	  echo; echo "== Redis part skipped: redis-server is not installed (make redis-server)"; exit 0; fi; \
	$(start_redis); \
	echo; echo "== two nodes share through one Redis server (unix://$$work/redis.sock)"; \
	echo "== node A, a TP=8 engine, persists the prompt to the server and exits:"; \
	$(VPY) -m canonical_ops demo --store "unix://$$work/redis.sock" --phase write --writer-tp 8 $(DEMO_STORE_ARGS); \
	echo; echo "== node B, a TP=2 engine with its own directory: region -> files -> Redis:"; \
	$(VPY) -m canonical_ops demo --store "$$work/node-b" --store "unix://$$work/redis.sock" \
	  --phase read --reader-tp 2 $(DEMO_STORE_ARGS)
	@$(MAKE) --no-print-directory demo-engines

# A throwaway redis-server on a unix socket in a fresh $$work directory, stopped and removed
# when the recipe's shell exits (one shell line: chain what follows with `;`).
define start_redis
work=$$(mktemp -d "$${TMPDIR:-/tmp}/canonical-kv-redis.XXXXXX"); \
	redis-server --port 0 --unixsocket "$$work/redis.sock" --save '' --appendonly no \
	  --dir "$$work" --logfile "$$work/redis.log" & server=$$!; \
	trap 'kill $$server 2>/dev/null; wait $$server 2>/dev/null; rm -rf "$$work"' EXIT; \
	for i in $$(seq 100); do [ -S "$$work/redis.sock" ] && break; sleep 0.1; done
endef

# One prefix, every engine (`make demo` ends with it): each engine its own process in its own
# venv, one store: vLLM 0.33 (TP=4, canonical_fs / canonical_redis with shared_prefix) computes
# and stores the first 4 units of a prompt; SGLang 0.5.23 (TP=2, its HiCache backend) loads them
# bit-exact and stores the next 4; the standalone engine (TP=1) loads all 8 bit-exact; a new vLLM
# engine at TP=2 loads all 8 back. First through files, then through a throwaway Redis server.
# One line per engine (each one's log shown when it fails). Builds .venv-vllm and .venv-sglang
# when missing (several minutes, once). FLEET_ARGS: model flags for every engine (--preset,
# --layers, --seed, --model-name; default llama3-8b shape with 8 layers).
FLEET_ARGS ?=
FLEET = -m canonical_ops.demo.fleet $(FLEET_ARGS)
.PHONY: demo-engines
demo-engines: install
	@log="$${TMPDIR:-/tmp}/canonical-kv-engines-build.log"; \
	if ! $(MAKE) --no-print-directory -q $(VLLM_STAGE)/.installed $(SGLANG_STAGE)/.installed 2>/dev/null; then \
	  echo; echo "== building .venv-vllm and .venv-sglang for the engines phase (first time, or kernels/ or setup.py changed: minutes; log: $$log)"; \
	  $(MAKE) --no-print-directory $(VLLM_STAGE)/.installed $(SGLANG_STAGE)/.installed >"$$log" 2>&1 || { \
	    echo "== one prefix, every engine: NOT RUN: building vLLM's or SGLang's venv failed (see $$log)"; exit 1; }; fi
	@$(vllm_stage_sources)
	@$(sglang_stage_sources)
	@set -e; \
	if command -v redis-server >/dev/null 2>&1; then $(start_redis); redis="unix://$$work/redis.sock"; \
	else work=$$(mktemp -d "$${TMPDIR:-/tmp}/canonical-kv-engines.XXXXXX"); redis=; \
	  trap 'rm -rf "$$work"' EXIT; fi; \
	fleet() { dir=$$1; py=$$2; name=$$3; shift 3; \
	  (cd "$$dir" && "$$py" $(FLEET) "$$@" --work-dir "$$work/$$n-$$name" 2>"$$work/$$n-$$name.log") || { \
	    echo "-- $$name's log (last lines):"; tail -n 25 "$$work/$$n-$$name.log"; exit 1; }; }; \
	n=0; for store in "$$work/store" $$redis; do n=$$((n + 1)); \
	  echo; echo "== one prefix, every engine, one store: $$store"; \
	  fleet $(VLLM_STAGE) $(VLLM_PY) vllm-tp4 vllm --store "$$store" --tp 4 --write 0:4; \
	  fleet $(SGLANG_STAGE) $(SGLANG_PY) sglang-tp2 sglang --store "$$store" --tp 2 --load 4 --write 4:8; \
	  fleet . $(abspath $(VPY)) standalone-tp1 standalone --store "$$store" --tp 1 --load 8; \
	  fleet $(VLLM_STAGE) $(VLLM_PY) vllm-tp2 vllm --store "$$store" --tp 2 --load 8; \
	done; \
	[ -n "$$redis" ] || { echo; echo "== one prefix through Redis skipped: redis-server is not installed (make redis-server)"; }

# Transfer benchmark (CUDA when a GPU is present, else CPU): JSON, markdown table, PNG plots;
# then the file tier vs plain file I/O of the same bytes (BENCH_STORE_ARGS, e.g. --dir /mnt/nvme);
# then the Redis tier vs redis-py's own pipelined SET/GET against one throwaway redis-server;
# then fp8 KV vs bf16 per byte through the ops;
# last, one screen of every goal with its measured ratio and met / not met (bench/summary.py).
BENCH_OUT ?= bench/results
bench: install redis-server
	$(VPY) bench/bench_transfer.py --quick --out $(BENCH_OUT) $(BENCH_ARGS)
	$(VPY) bench/bench_layouts.py
	$(VPY) bench/bench_store.py --quick --out $(BENCH_OUT) $(BENCH_STORE_ARGS)
	$(VPY) bench/bench_redis.py --quick --out $(BENCH_OUT) $(BENCH_REDIS_ARGS)
	$(VPY) bench/bench_fp8.py --quick --out $(BENCH_OUT)
	@$(MAKE) -s bench-vllm || echo "bench-vllm failed: its summary rows read NOT RUN"
	@echo; $(VPY) bench/summary.py $(BENCH_OUT)

# vLLM's `fs` secondary tier (its C batch path, O_DIRECT and buffered) vs `canonical_fs` on the
# same chunks, jobs and file system (BENCH_VLLM_ARGS, e.g. --dir /mnt/nvme). In .venv-vllm.
bench-vllm: install $(VLLM_VENV)/.requirements
	$(VLLM_PY) bench/bench_vllm_tiers.py --quick --out $(BENCH_OUT) $(BENCH_VLLM_ARGS)

lint: $(VENV)/.requirements
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $$(git ls-files 'kernels/*.cpp' 'kernels/*.h' 'kernels/*.cu' 'kernels/*.cuh' \
	  'bench/*.c' 'bench/*.cpp' 'bench/*.cu' ':!kernels/third_party')

clean:
	rm -rf build *.egg-info .pytest_cache

# tests/vllm_plugin against real vLLM: its own venv with vllm==0.33.0 from PyPI (which pins torch
# 2.14.0). canonical-kv is built against that torch in a private copy of the sources
# ($(VLLM_STAGE)), so the in-tree canonical_ops/_C*.so that .venv uses is never replaced.
VLLM_STAGE := .cache/vllm-stage
VLLM_BUILD_INPUTS := setup.py pyproject.toml $(shell find kernels -type f)

# A stage's Python package emptied (its built extension kept): modules moved or removed
# since the last run must not linger there.
clear_stage_package = mkdir -p $(1)/canonical_ops && find $(1)/canonical_ops -mindepth 1 \
	-maxdepth 1 \( -type d -o -name '*.py' \) -exec rm -rf {} +

# Python sources into the stage (cheap; the editable install there picks them up).
define vllm_stage_sources
	mkdir -p $(VLLM_STAGE)
	rm -rf $(VLLM_STAGE)/layouts $(VLLM_STAGE)/tests
	$(call clear_stage_package,$(VLLM_STAGE))
	tar -cf - --exclude='*.so' --exclude=__pycache__ layouts canonical_ops tests/conftest.py \
	  tests/helpers tests/vllm_plugin pyproject.toml | tar -xf - -C $(VLLM_STAGE)
endef

$(VLLM_VENV)/.requirements: requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -r requirements-vllm.txt
	touch $@

# The extension is rebuilt (~1.5-3 min) only when setup.py, pyproject.toml or kernels/ change.
$(VLLM_STAGE)/.installed: $(VLLM_VENV)/.requirements $(VLLM_BUILD_INPUTS)
	$(vllm_stage_sources)
	rm -rf $(VLLM_STAGE)/kernels
	tar -cf - $(VLLM_BUILD_INPUTS) | tar -xf - -C $(VLLM_STAGE)
	cd $(VLLM_STAGE) && $(VLLM_PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

test-vllm: $(VLLM_STAGE)/.installed redis-server
	$(vllm_stage_sources)
	cd $(VLLM_STAGE) && $(VLLM_PY) -m pytest tests/vllm_plugin

# tests/sglang_plugin against real SGLang: its own venv (.venv-sglang) with the sglang wheel from
# PyPI installed --no-deps, plus the few packages that importing its HiCache storage interface,
# host KV pools and page hashing needs (requirements-sglang.txt; SGLang's full set pulls its CUDA
# kernels and flashinfer). canonical-kv is built (CPU kernels only: the tests run on CPU) in a
# private copy of the sources ($(SGLANG_STAGE)), as for test-vllm. SGLang compiles its native page
# hash with torch on first use (~30 s, cached under ~/.cache/torch_extensions).
.PHONY: test-sglang
SGLANG_VERSION ?= 0.5.23
SGLANG_VENV ?= .venv-sglang
SGLANG_PY := $(abspath $(SGLANG_VENV))/bin/python
SGLANG_STAGE := .cache/sglang-stage

define sglang_stage_sources
	mkdir -p $(SGLANG_STAGE)
	rm -rf $(SGLANG_STAGE)/layouts $(SGLANG_STAGE)/tests
	$(call clear_stage_package,$(SGLANG_STAGE))
	tar -cf - --exclude='*.so' --exclude=__pycache__ layouts canonical_ops tests/conftest.py \
	  tests/helpers tests/sglang_plugin pyproject.toml | tar -xf - -C $(SGLANG_STAGE)
endef

$(SGLANG_VENV)/.requirements: requirements-sglang.txt
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -m pip install -q -r requirements-sglang.txt
	$(SGLANG_PY) -m pip install -q --no-deps sglang==$(SGLANG_VERSION)
	touch $@

$(SGLANG_STAGE)/.installed: $(SGLANG_VENV)/.requirements $(VLLM_BUILD_INPUTS)
	$(sglang_stage_sources)
	rm -rf $(SGLANG_STAGE)/kernels
	tar -cf - $(VLLM_BUILD_INPUTS) | tar -xf - -C $(SGLANG_STAGE)
	cd $(SGLANG_STAGE) && CANONICAL_KV_BUILD_CUDA=0 $(SGLANG_PY) -m pip install -q \
	  --no-build-isolation --no-deps -e .
	touch $@

test-sglang: $(SGLANG_STAGE)/.installed
	$(sglang_stage_sources)
	cd $(SGLANG_STAGE) && $(SGLANG_PY) -m pytest tests/sglang_plugin
