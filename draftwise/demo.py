"""`make demo`: prepare the default models offline, then show a real model decoding faster.

Runs `ar` (target only) and the fastest methods available for the default target on a
few Spec-Bench evaluation prompts at temperature 0, prints the benchmark table
(speedup from the same run) and a short sample.
"""

from __future__ import annotations

import sys
import time

import torch

from draftwise.bench.harness import BenchConfig, run_bench
from draftwise.bench.report import format_table
from draftwise.models import registry
from draftwise.models.loading import load_model

TARGET = "smollm2-135m"
# The sample is a chat, as users meet an instruct model: OpenAI-style messages through the chat template.
SAMPLE_CHAT = [{"role": "user", "content": "What is the capital of Germany?"}]
SAMPLE_METHOD = "prompt-lookup"  # exact, needs no draft, and the fastest method on this CPU (see the table)


def main() -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    start = time.perf_counter()
    print(f"draftwise demo: preparing {TARGET} (offline; prepared once, then cached)", flush=True)
    target = load_model(TARGET)
    print(f"  ready in {time.perf_counter() - start:.1f} s", flush=True)
    drafts = registry.default_draft(TARGET)
    methods = ("ar", "suffix", "prompt-lookup") + (("sd", "hybrid") if drafts else ())
    config = BenchConfig(
        target=TARGET, draft=drafts, methods=methods, num_prompts=6, max_new_tokens=96, temperature=0.0,
        gamma=4, repeats=1, warmup=1, dtype="auto", threads=torch.get_num_threads(),
    )
    print(f"benchmark: {', '.join(methods)} on {config.num_prompts} Spec-Bench evaluation prompts, "
          f"{config.max_new_tokens} new tokens, greedy, {config.dtype}", flush=True)
    results = run_bench(config)
    print(format_table(results))
    _batched_section()
    from draftwise.api import generate

    sample = generate(target, SAMPLE_CHAT, method=SAMPLE_METHOD, temperature=0, max_new_tokens=48)
    print(f"\nsample chat ({SAMPLE_METHOD}, {sample.stats['new_tokens']} tokens, "
          f"{sample.mean_accepted_length:.2f} tokens per target call):")
    print(f"  user: {SAMPLE_CHAT[-1]['content']}\n  assistant: {sample.text.strip()}")
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s")
    return 0


def _batched_section() -> None:
    """`ar` through the batched engine at batch 1 and batch 8 on the same prompts (`bench --batch-sizes`)."""
    sizes, n, tokens = (1, 8), 8, 32
    config = BenchConfig(target=TARGET, methods=("ar",), num_prompts=n, max_new_tokens=tokens, temperature=0.0,
                         repeats=1, warmup=1, dtype="auto", threads=torch.get_num_threads(), batch_sizes=sizes)
    print(f"\nbatched decoding: generate(target, {n} prompts, max_batch_size=B), ar, {tokens} new tokens each, greedy",
          flush=True)
    by_b = run_bench(config)["batched"]["methods"]["ar"]
    for b in sizes:
        m = by_b[str(b)]
        print(f"  batch {b}: {m['throughput_tok_s']:6.1f} tokens/s  ({m['speedup_vs_ar_b1']:.2f}x batch 1; "
              f"median request latency {m['latency_p50_s']:.1f} s)")


if __name__ == "__main__":
    sys.exit(main())
