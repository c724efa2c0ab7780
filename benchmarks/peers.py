"""draftwise against llama.cpp (llama-cpp-python) and vLLM's CPU build: same model, same prompts, one run.

What it measures and how: draftwise/bench/peers/driver.py (`--pair`: pair.py). Opt-in (`make bench-peers`).

    .venv/bin/python benchmarks/peers.py --json benchmarks/results/peers.json
    # tiny smoke run of one engine:
    .venv/bin/python benchmarks/peers.py --skip llama.cpp,vllm --num-prompts 2 --max-new-tokens 16 \\
        --batch-size 4 --repeats 1 --json /tmp/peers-smoke.json
"""

from __future__ import annotations

import argparse
import os
import sys

from draftwise.bench.peers.driver import SPEC_FORMATS
from draftwise.bench.peers.pair import PAIR_DRAFT, PAIR_TARGET


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
    parser.add_argument("--pair", action="store_true",
                        help=f"the real pair ({PAIR_TARGET}, {PAIR_DRAFT} as draft) against llama.cpp's own tools")
    parser.add_argument("--pair-methods", default="ar,sd,suffix,hybrid",
                        help="--pair: draftwise's methods (bench labels: sd/gamma=2, sd/tree_nodes=8)")
    parser.add_argument("--pair-draft", default=PAIR_DRAFT,
                        help="--pair: draftwise's draft (a registry name or a trained head's folder); llama.cpp's is "
                             f"always {PAIR_DRAFT}")
    parser.add_argument("--llama-draft-max", default="3,8", help="--pair: llama.cpp's draft lengths")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.pair:
        if min(args.num_prompts, args.max_new_tokens, args.repeats, args.threads, args.gamma) < 1:
            parser.error("--num-prompts, --max-new-tokens, --repeats, --threads and --gamma must be >= 1")
        from draftwise.bench.peers.pair import run_pair
        from draftwise.errors import DraftwiseError

        try:
            return run_pair(args)
        except DraftwiseError as error:  # a bad --pair-methods label, or a --pair-draft that is no model or head
            print(f"peers.py: {error}", file=sys.stderr)
            return 2
    unknown = set(args.spec_format.split(",")) - set(SPEC_FORMATS)
    if unknown:
        parser.error(f"--spec-format: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SPEC_FORMATS)}")
    if min(args.num_prompts, args.batch_size, args.max_new_tokens, args.repeats, args.threads, args.gamma) < 1:
        parser.error("--num-prompts, --batch-size, --max-new-tokens, --repeats, --threads and --gamma must be >= 1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if args.batch_dtype == "auto":
        from draftwise.models.loading import cpu_has_native_bf16

        args.batch_dtype = "bf16" if cpu_has_native_bf16() else "fp32"
    from draftwise.bench.peers.driver import run

    return run(args)


if __name__ == "__main__":  # vLLM's engine starts processes: nothing runs at import
    sys.exit(main())
