"""`draftwise serve` under load, and its overhead against calling the engine directly (`benchmarks/server_load.py`).

1. Starts `draftwise serve` as a subprocess on the target (default smollm2-135m; `sd` gets the
   registry's default draft, the other methods are asked for per request through the `draftwise`
   body field), on 127.0.0.1 and a free port.
2. Load: `draftwise loadtest` (draftwise.server.loadtest) at each concurrency for each method, levels
   interleaved method by method, streamed chat requests over Spec-Bench evaluation prompts,
   temperature 0: throughput, TTFT / ITL / TPOT percentiles, and throughput at concurrency C over 1.
3. Overhead at concurrency 1 (after the subprocess has stopped): the same prompts, max_tokens and
   temperature 0, one request at a time, interleaved prompt by prompt and repeated (median): a streamed
   HTTP request to the server (client clock, request to [DONE]; the server runs in this process, see
   `overhead`) against `draftwise.generate` and a reused batch-1 `Engine` (plan.make_plan / builder.build_engine,
   submit + run). Outputs are compared token for token.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

import draftwise
from draftwise import builder, prompts
from draftwise import plan as plan_module
from draftwise.bench.harness import machine_description
from draftwise.server import loadtest
from draftwise.heads.loading import load_draft
from draftwise.models.loading import load_model



def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "draftwise", "serve", "--target", args.target, "--method", "sd", "--port", "0",
               "--max-batch-size", str(args.max_batch_size), "--max-queue", "1024", "--log-level", "warning",
               "--no-access-log", "--served-model-name", "bench", "--gamma", str(args.gamma)]
    if args.draft:
        command += ["--draft", args.draft]
    if args.threads:
        command += ["--threads", str(args.threads)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "DRAFTWISE_API_KEY": ""})
    line = process.stderr.readline()
    match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
    if not match:
        process.kill()
        raise SystemExit(f"the server did not start: {line}{process.stderr.read()}")
    # keep reading its log, so a full pipe never blocks the server; echo warnings and errors
    threading.Thread(target=lambda: [sys.stderr.write("server: " + text) for text in process.stderr],
                     daemon=True).start()
    url = f"http://127.0.0.1:{match.group(1)}"
    client = loadtest.Client(url)
    deadline = time.monotonic() + 120
    while True:
        try:
            client.models()
            return process, url
        except Exception:  # noqa: BLE001 - not listening yet
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise SystemExit("the server did not answer within 120 s")
            time.sleep(0.2)


def stop_server(process: subprocess.Popen) -> int | None:
    process.send_signal(signal.SIGTERM)
    try:
        return process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait()


def direct_engine(plan: Any, prompt_ids: list[int]) -> tuple[float, list[int]]:
    """A batch-1 engine built once per method (as the server does), one request submitted and run."""
    engine = plan["engine"]
    request = plan_module.request_for(plan["plan"], prompt_ids)
    start = time.perf_counter()
    request_id = engine.submit(request)
    engine.run()
    wall = time.perf_counter() - start
    result = engine.finished.pop(request_id)
    return wall, result.token_ids


def run(args: argparse.Namespace, given: list[str] | None = None) -> dict[str, Any]:
    """The measurement the module describes, on the script's parsed arguments and its prompts (`given`; default:
    Spec-Bench evaluation prompts); writes `args.json`."""
    methods = [m for m in args.methods.split(",") if m]
    levels = [int(c) for c in args.concurrency.split(",")]
    skip = set(args.skip.split(","))
    prompts = given or loadtest.default_prompts(max(args.num_requests, args.overhead_prompts))

    started = time.perf_counter()
    report: dict[str, Any] = {
        "config": {key: value for key, value in vars(args).items() if key != "json"},
        "machine": machine_description(torch.device("cpu")),
        "load": {m: [] for m in methods},
        "overhead": {},
    }
    process, url = start_server(args)
    try:
        client = loadtest.Client(url)
        report["config"]["server"] = client.models()[0].get("draftwise", {})
        if "load" not in skip:
            deadline = time.perf_counter() + args.timeout
            for i, level in enumerate(levels):  # levels outside, methods inside: drift hits every method alike
                for method in methods:
                    remaining = deadline - time.perf_counter()
                    if remaining <= 0:
                        report["load"][method].append({"concurrency": level, "skipped": "timeout"})
                        continue
                    run = loadtest.run(url, concurrency=[level], num_requests=args.num_requests,
                                       max_tokens=args.max_tokens, temperature=0.0, chat=args.chat, prompts=prompts,
                                       override={"method": method}, timeout_s=remaining, warmup=2 if i == 0 else 0)
                    report["load"][method].extend(run["levels"])
                    lv = run["levels"][0]
                    print(f"{method:>14} c={level:<3} {lv.get('throughput_tok_s') or 0:7.1f} tok/s  "
                          f"ok {lv.get('requests_ok')} failed {lv.get('requests_failed')}", flush=True)
            for method in methods:
                base = next((lv for lv in report["load"][method] if lv.get("concurrency") == 1
                             and lv.get("throughput_tok_s")), None)
                for lv in report["load"][method]:
                    if base and lv.get("throughput_tok_s"):
                        lv["throughput_vs_c1"] = lv["throughput_tok_s"] / base["throughput_tok_s"]
    finally:
        report["server_exit_code"] = stop_server(process)
    if "overhead" not in skip:
        report["overhead"] = overhead(args, methods, prompts[: args.overhead_prompts])
    report["wall_s"] = time.perf_counter() - started
    report["summary"] = summary(report, levels)
    loadtest.write_json(args.json, report)
    print(render(report, levels))
    print(f"wrote {args.json} ({report['wall_s']:.0f} s)")
    return report


def overhead(args: argparse.Namespace, methods: list[str], prompts: list[Any]) -> dict[str, Any]:
    """Concurrency 1: the server (HTTP, streamed, client clock) against generate() and a reused Engine.

    The server here runs in this process (uvicorn in a thread, the same app, engine thread and HTTP path as
    `draftwise serve`) over the same loaded weights, so both sides share one process and one torch thread
    pool: on a 2-core machine a second process's threads would otherwise be timed as server overhead."""
    from draftwise.server import ServerConfig, Service, ThreadedServer, create_app

    target = load_model(args.target)
    sd_draft = args.draft or plan_module.default_draft(target, "sd")
    service = Service(ServerConfig(model_name="bench", method="sd", gamma=args.gamma), target,
                      load_draft(sd_draft, target) if sd_draft else None)
    server = ThreadedServer(create_app(service)).start()
    try:
        return _overhead(args, loadtest.Client(server.url), target, methods, prompts)
    finally:
        server.stop()


def _overhead(args, client, target, methods, prompts) -> dict[str, Any]:
    out: dict[str, Any] = {}
    plans = {}
    for method in methods:
        spec = draftwise.METHODS[method]
        draft_spec = (args.draft or plan_module.default_draft(target, method)) if spec.needs_draft else None
        draft = load_draft(draft_spec, target) if draft_spec else None
        plan = plan_module.make_plan(target=target, prompt=prompts[0] if not args.chat else None,
                         messages=[{"role": "user", "content": prompts[0]}] if args.chat else None, draft=draft,
                         method=method, max_new_tokens=args.max_tokens, temperature=0.0, top_k=0, top_p=1.0,
                         seed=None, gamma=args.gamma, stop=None, ignore_eos=False, method_options={})
        plans[method] = {"plan": plan, "engine": builder.build_engine(plan, 1, stream_text=True), "draft": draft}
    times: dict[str, dict[str, list[list[float]]]] = {
        m: {k: [[] for _ in prompts] for k in ("server", "generate", "engine")} for m in methods}
    same: dict[str, list[bool]] = {m: [] for m in methods}
    for method in methods:  # warm-up: one of each
        _one_round(args, client, plans[method], method, prompts[0], {k: [[]] for k in ("server", "generate", "engine")},
                   0, [])
    for _ in range(args.repeats):
        for p, prompt in enumerate(prompts):
            for method in methods:
                _one_round(args, client, plans[method], method, prompt, times[method], p, same[method])
    for method in methods:
        medians = {k: [statistics.median(v) for v in times[method][k]] for k in times[method]}
        totals = {k: sum(v) for k, v in medians.items()}
        out[method] = {
            "server_s": totals["server"], "generate_s": totals["generate"], "engine_s": totals["engine"],
            "overhead_vs_engine": totals["server"] / totals["engine"] - 1,
            "overhead_vs_generate": totals["server"] / totals["generate"] - 1,
            "per_prompt_s": medians, "identical_tokens": sum(same[method]) / max(len(same[method]), 1),
            "prompts": len(prompts), "repeats": args.repeats,
        }
    return out


def _one_round(args, client, plan, method, prompt, times, p, same) -> None:
    path, body = loadtest.request_body(prompt, model="bench", chat=args.chat, max_tokens=args.max_tokens,
                                       temperature=0.0, override={"method": method})
    record = client.stream(path, body, time.perf_counter() + 600)
    if not record["ok"]:
        raise SystemExit(f"server request failed: {record.get('error') or record.get('status')}")
    times["server"][p].append(record["e2e_s"])
    chat = [{"role": "user", "content": prompt}] if args.chat else None
    start = time.perf_counter()
    generation = draftwise.generate(plan["plan"].target, prompt if chat is None else None, messages=chat,
                                    draft=plan["draft"], method=method, temperature=0.0, max_new_tokens=args.max_tokens,
                                    gamma=args.gamma)
    times["generate"][p].append(time.perf_counter() - start)
    ids = prompts.encode_prompt(chat or prompt, plan["plan"].target, plan["plan"].vocab_size)
    wall, tokens = direct_engine(plan, ids)
    times["engine"][p].append(wall)
    same.append(tokens == generation.token_ids and record["completion_tokens"] == len(tokens)
                and record["text"] == generation.text)


def summary(report: dict[str, Any], levels: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    top = max(levels)
    for method, runs in report["load"].items():
        by = {lv["concurrency"]: lv for lv in runs if lv.get("throughput_tok_s")}
        if 1 in by and top in by:
            out[f"{method}_throughput_c{top}_vs_c1"] = by[top]["throughput_tok_s"] / by[1]["throughput_tok_s"]
    for method, o in report.get("overhead", {}).items():
        out[f"{method}_server_overhead_vs_engine"] = o["overhead_vs_engine"]
    return out


def render(report: dict[str, Any], levels: list[int]) -> str:
    lines = []
    for method, runs in report["load"].items():
        lines.append(f"== {method}")
        lines.append(loadtest.table(runs))
    for method, o in report.get("overhead", {}).items():
        lines.append(f"overhead {method:>14}: server {o['server_s']:.2f} s, engine {o['engine_s']:.2f} s "
                     f"({o['overhead_vs_engine'] * 100:+.1f}%), generate {o['generate_s']:.2f} s "
                     f"({o['overhead_vs_generate'] * 100:+.1f}%), identical tokens {o['identical_tokens']:.2f}")
    return "\n".join(lines)
