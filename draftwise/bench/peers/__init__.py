"""draftwise against its peers: llama.cpp (llama-cpp-python and llama.cpp's own tools), vLLM's CPU build, guidellm.

Opt-in (`make bench-peers`); nothing here runs in `make test`. The peers install into `.peers/` of the checkout
(`install`), each in its own Python; `driver` runs every engine group in a worker process of its own Python
(`worker`, standard library only at module level); `pair` measures the real pair against llama.cpp's tools
(`llama_tools`); `serving` drives `draftwise serve` and `vllm serve` with guidellm. The scripts are
benchmarks/peers.py, llama_bench.py, serve_compare.py and vllm_plugin.py.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the checkout: draftwise is installed editable (`make install`)
PEERS = ROOT / ".peers"
VENV_PY = ROOT / ".venv" / "bin" / "python"
