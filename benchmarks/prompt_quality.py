"""How far a GGUF file's prompt paths move the next-token distribution from the exact weights in float32.

A Q4_K_M file runs from its own blocks with activations quantised to int8 per block; with bf16 activations on a
CPU with AVX512-BF16, prompts run the blocks' weights rounded to bf16 instead (`qkernel.prompt_bf16`). For each
Spec-Bench prompt this takes the last prompt token's logits three ways: the blocks (DRAFTWISE_PROMPT_BF16=0), the
bf16 weights (the default), and a reference, the same weights dequantised exactly (the converted Hugging Face
directory `make pair` writes for vLLM) with float32 activations. It writes KL(reference || each) and whether each
path's top token is the reference's:

    python benchmarks/prompt_quality.py --json benchmarks/results/prompt-quality-pair.json
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from draftwise.bench import scripts
from draftwise.bench.datasets import load_prompts
from draftwise.bench.harness import encode_bench_prompt
from draftwise.models import registry
from draftwise.models.loading import load_model
from draftwise.models.runner import ModelRunner


def last_logits(model, ids: list[int], prompt_bf16: str) -> torch.Tensor:
    os.environ["DRAFTWISE_PROMPT_BF16"] = prompt_bf16
    runner = ModelRunner(model.model)
    return runner.forward_rows(torch.tensor([ids]), [len(ids)], prompt=True).logits[0, -1].float()


def main() -> None:
    parser = scripts.parser(__doc__, threads=None, json=True)
    parser.add_argument("--target", default="qwen2.5-coder-1.5b", help="a registry name of a K-quant GGUF target")
    parser.add_argument("--reference", default=None,
                        help="its weights dequantised, as a Hugging Face directory (default: the one `make pair` "
                             "converts for vLLM, <cache>/models/<target>)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=512, help="prompts cut to this many tokens")
    args = scripts.parse(parser)
    if args.reference is None and registry.entry(args.target) is None:
        parser.error(f"{args.target}: not a registry name; pass --reference")
    reference_dir = Path(args.reference) if args.reference else registry.resolve(args.target)
    if not (reference_dir / "config.json").is_file():
        parser.error(f"{reference_dir}: no Hugging Face directory with the dequantised weights (run `make pair`)")
    torch.set_num_threads(os.cpu_count() or 1)
    target = load_model(args.target)
    reference = load_model(str(reference_dir), dtype="fp32")
    rows = []
    for prompt in load_prompts("spec-bench", num_prompts=args.num_prompts):
        ids = encode_bench_prompt(target, prompt)[: args.max_tokens]
        exact = F.log_softmax(last_logits(reference, ids, "1"), -1)
        row = {"question_id": prompt.question_id, "tokens": len(ids)}
        for name, flag in (("blocks", "0"), ("bf16", "1")):
            logits = last_logits(target, ids, flag)
            row[f"kl_{name}"] = float(F.kl_div(F.log_softmax(logits, -1), exact, log_target=True, reduction="sum"))
            row[f"top1_{name}"] = bool(logits.argmax() == exact.argmax())
        rows.append(row)
    summary = {name: {"kl_median": statistics.median(r[f"kl_{name}"] for r in rows),
                      "kl_max": max(r[f"kl_{name}"] for r in rows),
                      "top1_agree": sum(r[f"top1_{name}"] for r in rows)} for name in ("blocks", "bf16")}
    result = {"target": args.target, "weights": target.weights, "reference": str(reference_dir),
              "prompts": len(rows), "summary": summary, "rows": rows}
    scripts.finish(result, args.json)
    for name, s in summary.items():
        print(f"{name}: KL median {s['kl_median']:.2e}, max {s['kl_max']:.2e}, top-1 as the reference "
              f"{s['top1_agree']}/{len(rows)}")


if __name__ == "__main__":
    main()
