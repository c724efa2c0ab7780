"""`draftwise serve` against `vllm serve` (CPU build), measured by guidellm, on the same machine and model.

The configurations and what is reported: draftwise/bench/peers/serving.py. Writes JSON:

    .venv/bin/python benchmarks/serve_compare.py --json benchmarks/results/serve-compare.json
"""

from __future__ import annotations

import argparse

from draftwise.bench.peers import serving
from draftwise.bench.peers.install import TARGET
from draftwise.bench.peers.pair import PAIR_DRAFT, PAIR_TARGET


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="draftwise-ar,vllm-ar,draftwise-sd,vllm-eagle3,vllm-ngram")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--max-seconds", type=float, default=60.0, help="per concurrency level")
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                        help="both servers' float type: auto is bf16 on a CPU with native bf16, fp32 elsewhere "
                             "(bf16 without native support is several times slower in both)")
    parser.add_argument("--pair", action="store_true",
                        help=f"serve {PAIR_TARGET} (draftwise: its Q4_K_M file; vLLM: dequantised, --dtype) with "
                             f"{PAIR_DRAFT} as draft, not {TARGET}")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.dtype == "auto":
        from draftwise.models.loading import cpu_has_native_bf16

        args.dtype = "bf16" if cpu_has_native_bf16() else "fp32"
    chosen = args.configs.split(",")
    known = serving.configurations(args, None)
    unknown = [c for c in chosen if c not in known]
    if unknown:
        parser.error(f"unknown configs {unknown}; known: {', '.join(known)}")
    if "vllm-draft" in chosen and not args.pair:
        parser.error("vllm-draft drafts with the pair's 0.5B model: add --pair")
    serving.run(args, chosen)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
