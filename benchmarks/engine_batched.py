"""The batched engine against the batch-1 engine it replaced, transformers' generate, and itself
at larger batches. One process, one run: every ratio below is taken within it.

Measures (fp32, greedy, Spec-Bench evaluation prompts as chat, `--max-new-tokens` each):
1. batch 1, interleaved prompt by prompt after a warm-up, median over repeats of each method's
   tokens/s: transformers `generate` (DynamicCache), draftwise `ar` / `sd` (registry helper) /
   `prompt-lookup` on the batched engine, and, with `--old-package DIR`, the same methods on the
   batch-1 engine of an earlier draftwise copied to DIR/draftwise_old (so both run side by side);
2. batched throughput: `ar` at each of `--batch-sizes` over `--batch-prompts` prompts (all
   submitted at once, continuous batching), and `sd` / `prompt-lookup` at `--spec-batch`;
3. loop overhead: the share of wall time outside model forwards (target, draft, head), at batch
   1 and at `--spec-batch`;
4. where one decode step's time goes (torch.profiler on the target at batch 1): matrix products
   of the layers, attention, the LM head, and the rest (Python and small ops).

    .venv/bin/python benchmarks/engine_batched.py --old-package /tmp/oldpkg \
        --json benchmarks/results/engine-batched.json
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import torch

import draftwise
from draftwise.bench.datasets import load_prompts
from draftwise.bench.harness import encode_bench_prompt, machine_description
from draftwise.atomic import write_json
from draftwise.engine.core import Engine
from draftwise.models import registry
from draftwise.models import runner as runner_module


class ForwardClock:
    """Sums the wall time inside model forwards (ModelRunner.forward_rows / forward_states), and apart
    from it the time the engine spends admitting requests (their prefill)."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.admitting = 0.0
        for name in ("forward_rows", "forward_states"):
            setattr(runner_module.ModelRunner, name, self._timed(getattr(runner_module.ModelRunner, name), "spent"))
        Engine._admit = self._timed(Engine._admit, "admitting")

    def _timed(self, fn, field):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - start)
        wrapper.__wrapped__ = fn
        return wrapper


def hf_generate(target, ids, max_new_tokens):
    with torch.inference_mode():
        out = target.model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=target.tokenizer.eos_token_id)
    return out.shape[1] - len(ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=8, help="batch-1 prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,4,16,32")
    parser.add_argument("--batch-prompts", type=int, default=32)
    parser.add_argument("--spec-batch", type=int, default=16)
    parser.add_argument("--old-package", default=None, help="directory holding draftwise_old (an earlier engine)")
    parser.add_argument("--step-context", type=int, default=256, help="context of the equal-length decode steps")
    parser.add_argument("--skip", default="", help="comma list of parts to skip: batch1,batched,steps,profile")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    torch.set_num_threads(torch.get_num_threads())

    target = draftwise.load_model(args.target, dtype="fp32")
    eagle = registry.default_draft_for(args.target, eagle_ok=True)  # the registry's EAGLE head for sd
    prompts = [encode_bench_prompt(target, p) for p in load_prompts(num_prompts=max(args.num_prompts, args.batch_prompts))]
    common = dict(temperature=0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
    clock = ForwardClock()
    out: dict = {"config": vars(args) | {"sd_draft": eagle}, "machine": machine_description(torch.device("cpu"))}

    # ---------------------------------------------------------------- 1. batch 1
    if "batch1" not in skip:
        methods = {
            "hf-generate": lambda ids: hf_generate(target, ids, args.max_new_tokens),
            "ar": lambda ids: draftwise.generate(target, ids, method="ar", **common).stats["new_tokens"],
            "sd": lambda ids: draftwise.generate(target, ids, method="sd", draft=eagle, **common).stats["new_tokens"],
            "prompt-lookup": lambda ids: draftwise.generate(target, ids, method="prompt-lookup",
                                                            **common).stats["new_tokens"],
        }
        if args.old_package:
            sys.path.insert(0, args.old_package)
            old = importlib.import_module("draftwise_old")
            old_target = old.load_model(target.model, tokenizer=target.tokenizer)
            old_eagle = old.api._load_draft(eagle, old_target) if hasattr(old.api, "_load_draft") else eagle
            for name, kwargs in (("ar", {}), ("sd", {"draft": old_eagle}), ("prompt-lookup", {})):
                methods[f"old-{name}"] = (lambda n, kw: lambda ids: old.generate(
                    old_target, ids, method=n, **kw, **common).stats["new_tokens"])(name, kwargs)
        for fn in methods.values():  # warm-up
            fn(prompts[0][:64])
        rates: dict[str, list[float]] = {name: [] for name in methods}
        overhead: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.repeats):
            totals = {name: [0, 0.0, 0.0] for name in methods}
            for ids in prompts[: args.num_prompts]:
                for name, fn in methods.items():  # interleaved prompt by prompt
                    clock.spent = 0.0
                    start = time.perf_counter()
                    tokens = fn(ids)
                    wall = time.perf_counter() - start
                    totals[name][0] += tokens
                    totals[name][1] += wall
                    totals[name][2] += clock.spent
            for name, (tokens, wall, forward) in totals.items():
                rates[name].append(tokens / wall)
                overhead[name].append(1 - forward / wall)
        out["batch1"] = {
            name: {"tokens_per_s": statistics.median(r), "runs": r,
                   "loop_overhead": statistics.median(overhead[name]) if not name.startswith(("hf", "old")) else None}
            for name, r in rates.items()}
        base = out["batch1"]["ar"]["tokens_per_s"]
        for name, row in out["batch1"].items():
            row["vs_ar"] = row["tokens_per_s"] / base
            print(f"batch 1  {name:<18} {row['tokens_per_s']:7.2f} tok/s  {row['vs_ar']:.3f}x ar"
                  + (f"  loop overhead {100 * row['loop_overhead']:.1f}%" if row["loop_overhead"] is not None else ""),
                  flush=True)

    # ---------------------------------------------------------------- 2. batched throughput
    if "batched" not in skip:
        batch_prompts = prompts[: args.batch_prompts]
        runs = [("ar", int(b), {}) for b in args.batch_sizes.split(",")]
        runs += [("sd", args.spec_batch, {"draft": eagle}), ("prompt-lookup", args.spec_batch, {}),
                 ("ar", args.spec_batch, {})]
        draftwise.generate(target, batch_prompts[:4], method="ar", max_batch_size=4, temperature=0, max_new_tokens=8)
        batched = []
        for method, size, kwargs in runs:
            clock.spent = clock.admitting = 0.0
            start = time.perf_counter()
            gens = draftwise.generate(target, batch_prompts, method=method, max_batch_size=size, **kwargs, **common)
            wall = time.perf_counter() - start
            tokens = sum(g.stats["new_tokens"] for g in gens)
            calls = sum(g.stats["target_calls"] for g in gens)
            fed = sum(g.stats["target_tokens"] - (g.stats["prompt_tokens"] - 1) for g in gens)
            decode = wall - clock.admitting
            row = {"method": method, "batch_size": size, "tokens": tokens, "wall_s": wall,
                   "prefill_s": clock.admitting, "decode_s": decode, "decode_tokens_per_s": tokens / decode,
                   "tokens_per_s": tokens / wall, "mean_accepted_length": tokens / calls,
                   "verified_per_committed": fed / tokens, "loop_overhead": 1 - clock.spent / wall}
            batched.append(row)
            print(f"batch {size:<3} {method:<14} {row['tokens_per_s']:7.2f} tok/s (decode phase "
                  f"{row['decode_tokens_per_s']:7.2f}, prefill {clock.admitting:5.1f} s)  MAL {row['mean_accepted_length']:.2f}"
                  f"  verified/committed {row['verified_per_committed']:.2f}  loop overhead "
                  f"{100 * row['loop_overhead']:.1f}%", flush=True)
        first = next(r for r in batched if r["method"] == "ar" and r["batch_size"] == 1)
        for row in batched:
            row["vs_ar_batch1"] = row["tokens_per_s"] / first["tokens_per_s"]
            row["decode_vs_ar_batch1"] = row["decode_tokens_per_s"] / first["decode_tokens_per_s"]
            same = [r for r in batched if r["method"] == "ar" and r["batch_size"] == row["batch_size"]]
            row["vs_ar_same_batch"] = row["tokens_per_s"] / same[-1]["tokens_per_s"] if same else None
        out["batched"] = batched

    # ---------------------------------------------------------------- 3b. decode steps at equal context
    if "steps" not in skip:
        from transformers import DynamicCache

        def median_ms(fn, n=8):
            fn()
            times = []
            for _ in range(n):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            return sorted(times)[n // 2] * 1e3

        steps = []
        context = args.step_context
        for size in [int(b) for b in args.batch_sizes.split(",")]:
            runner = runner_module.ModelRunner(target.model, rows=0)
            prompt = torch.randint(100, 1000, (size, context))
            runner.forward_rows(prompt, [context] * size, logits_at=torch.zeros(size, 1, dtype=torch.long))
            token = torch.randint(100, 1000, (size, 1))

            def ours():
                runner.forward_rows(token, [1] * size)
                for b in range(size):
                    runner.trim_row(b, context)

            with torch.inference_mode():
                cache = DynamicCache(config=target.model.config)
                target.model(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)

                def dynamic():
                    target.model(input_ids=token, past_key_values=cache, use_cache=True, logits_to_keep=1)
                    cache.crop(-1)

                row = {"batch_size": size, "context": context, "ours_ms": median_ms(ours),
                       "dynamic_cache_ms": median_ms(dynamic)}
            steps.append(row)
        for row in steps:
            row["tokens_per_s_vs_batch1"] = row["batch_size"] * steps[0]["ours_ms"] / row["ours_ms"]
            print(f"decode step, batch {row['batch_size']:<3} context {context}: {row['ours_ms']:6.1f} ms "
                  f"(transformers DynamicCache {row['dynamic_cache_ms']:6.1f} ms), tokens/s "
                  f"{row['tokens_per_s_vs_batch1']:.2f}x batch 1", flush=True)
        out["decode_steps"] = steps

    # ---------------------------------------------------------------- 4. one decode step, by op
    if "profile" not in skip:
        from torch.profiler import ProfilerActivity, profile

        runner = runner_module.ModelRunner(target.model)
        runner.forward_rows(torch.tensor([prompts[0][:255]]), [255], prompt=True)
        token = torch.tensor([[5]])
        for _ in range(3):
            runner.forward_rows(token, [1])
        steps = 20
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                runner.forward_rows(token, [1])
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) / steps / 1e3
        vocab = target.model.get_output_embeddings().weight.shape[0]
        # the LM head is one [1, hidden] x [hidden, vocab] product: time it alone
        head = target.model.get_output_embeddings()
        hidden = torch.randn(1, 1, target.model.config.hidden_size)
        with torch.inference_mode():
            for _ in range(3):
                head(hidden)
            start = time.perf_counter()
            for _ in range(50):
                head(hidden)
            lm_head_ms = (time.perf_counter() - start) / 50 * 1e3
        by_op = {e.key: e.self_cpu_time_total / steps / 1e3 for e in events}
        matmul = sum(v for k, v in by_op.items() if k in ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear",
                                                          "aten::matmul"))
        attention = sum(v for k, v in by_op.items() if "attention" in k or "sdpa" in k or "flash" in k)
        wall_start = time.perf_counter()
        for _ in range(steps):
            runner.forward_rows(token, [1])
        step_ms = (time.perf_counter() - wall_start) / steps * 1e3
        out["step_profile"] = {
            "step_ms": step_ms, "profiled_op_ms": total, "matmul_ms_incl_lm_head": matmul,
            "lm_head_ms": lm_head_ms, "attention_ms": attention, "vocab": vocab,
            "other_ms": step_ms - matmul - attention,
            "top_ops": sorted(by_op.items(), key=lambda kv: -kv[1])[:12],
        }
        print(f"decode step {step_ms:.1f} ms: matmuls {matmul:.1f} (LM head alone {lm_head_ms:.1f}), attention "
              f"{attention:.1f}, other ops + Python {step_ms - matmul - attention:.1f}", flush=True)
    if args.json:
        write_json(out, args.json)


if __name__ == "__main__":
    main()
