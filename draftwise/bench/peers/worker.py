"""The peers' worker: one process per engine group, run by path with that engine's own Python (draftwise: `.venv`;
llama.cpp: `.peers/llama`; vLLM: `.peers/vllm`), which need not have draftwise installed. So this module imports the
standard library only at module level; each runner imports its engine.

Protocol: `python worker.py ENGINE PLAN` (the plan a JSON file: threads, prompts, configs, ...); commands as JSON
lines on stdin (`{"cmd": "run", "repeat": r}`, `{"cmd": "quit"}`); events as JSON lines on the file descriptor
PEERS_RESULT_FD (`ready`, `result`, `error`, `done`, `fatal`); stdout and stderr are the worker's log. The driver
is `draftwise.bench.peers.driver`.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def one_line(error: BaseException | str) -> str:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return (lines[0] if lines else str(text))[:400]


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

        return BenchConfig(target=self.plan["target"], methods=(cfg["method"],),
                           max_new_tokens=self.plan["max_new_tokens"], temperature=0.0, gamma=self.plan["gamma"], dtype=cfg["dtype"], repeats=1,
                           threads=self.plan["threads"])

    def prepare(self, cfg: dict[str, Any]) -> dict[str, Any]:
        from draftwise.bench.harness import _load_bench_draft, plan_drafts
        from draftwise.models.loading import load_model

        dtype = cfg["dtype"]
        if dtype not in self.models:
            self.models[dtype] = load_model(self.plan["target"], dtype=dtype)
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
            kwargs.update(self.plan.get("llm_kwargs") or {})  # e.g. enforce_eager (benchmarks/vllm_pair_eagle.py)
            if cfg.get("speculative_config"):
                kwargs["speculative_config"] = cfg["speculative_config"]
                kwargs["per_request_spec_decode_metrics"] = "summary"
            self.llm = LLM(**kwargs)
        return {"speculative_config": cfg.get("speculative_config")}

    def _params(self, max_new_tokens: int) -> Any:
        from vllm import SamplingParams

        # EOS ignored unless the plan says otherwise (`ignore_eos: false`, `stop_token_ids`: draftwise bench's stops)
        return SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=self.plan.get("ignore_eos", True),
                              stop_token_ids=self.plan.get("stop_token_ids"))

    def spec_counters(self) -> dict[str, Any]:
        """vLLM's spec-decode counters so far (`LLM.get_metrics()`, summed over engines): counters as numbers,
        vectors (num_accepted_tokens_per_pos) as lists."""
        out: dict[str, Any] = {}
        for metric in self.llm.get_metrics():
            if not metric.name.startswith("vllm:spec_decode"):
                continue
            if hasattr(metric, "values"):
                old = out.get(metric.name) or [0] * len(metric.values)
                out[metric.name] = [a + b for a, b in zip(old, metric.values)]
            elif hasattr(metric, "value"):
                out[metric.name] = out.get(metric.name, 0) + metric.value
        return out

    def run_one(self, cfg: dict[str, Any], ids: list[int], max_new_tokens: int) -> dict[str, Any]:
        from vllm.inputs import TokensPrompt

        before = self.spec_counters() if self.plan.get("spec_counters") else None
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
        if before is not None:  # this request's share of the engine's counters (the warm-up's left out)
            after = self.spec_counters()
            record["spec_counters"] = {
                k: ([a - b for a, b in zip(v, before.get(k) or [0] * len(v))] if isinstance(v, list)
                    else v - before.get(k, 0)) for k, v in after.items()}
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


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1], sys.argv[2]))
