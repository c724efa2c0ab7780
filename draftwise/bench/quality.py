"""Quality of an output, measured the same way for every method (Narasimhan et al. §6, §F.1).

- ROUGE-2 F1 (x100) against the reference, for summarization prompts: the tokenisation of
  Google's `rouge-score` without stemming (lower-case, runs of [a-z0-9] are tokens), bigram
  counts clipped by the reference's.
- BLEU (sacreBLEU, corpus level, default 13a tokenisation), for translation prompts.
- The target's perplexity of the output: exp(mean negative log-likelihood of the output
  tokens under the target's unwarped distribution, given the prompt and the output so far).
- Agreement with the target's greedy choice: the fraction of output tokens that are the
  target's argmax given the output's own prefix (teacher-forced, so one early difference
  does not decide the whole output).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass

import torch

_TOKEN = re.compile(r"[a-z0-9]+")


def _rouge_tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def _f1(overlap: int, candidate: int, reference: int) -> float:
    if not overlap:
        return 0.0
    precision, recall = overlap / candidate, overlap / reference
    return 100.0 * 2 * precision * recall / (precision + recall)


def rouge_n(candidate: str, reference: str, n: int) -> float:
    """ROUGE-N F1 x 100 of one candidate against one reference (0 when either has no n-gram)."""
    def grams(text: str) -> Counter:
        tokens = _rouge_tokens(text)
        return Counter(zip(*(tokens[i:] for i in range(n))))

    cand, ref = grams(candidate), grams(reference)
    return _f1(sum((cand & ref).values()), sum(cand.values()), sum(ref.values()))


def rouge2(candidate: str, reference: str) -> float:
    return rouge_n(candidate, reference, 2)


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 x 100: longest common subsequence of the two token lists."""
    a, b = _rouge_tokens(candidate), _rouge_tokens(reference)
    if not a or not b:
        return 0.0
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return _f1(previous[-1], len(a), len(b))


def corpus_bleu(candidates: list[str], references: list[str]) -> float:
    import sacrebleu

    if not candidates:
        return 0.0
    return float(sacrebleu.corpus_bleu(candidates, [references]).score)


@dataclass(frozen=True)
class TargetScore:
    nll: float  # sum over output tokens of -log p(token | prefix), unwarped target
    tokens: int  # output tokens scored
    agree: int  # output tokens equal to the target's argmax at their position


@torch.inference_mode()
def target_score(model: torch.nn.Module, prompt_ids: list[int], output_ids: list[int], vocab_size: int) -> TargetScore:
    """One forward of the target over prompt + output (no cache)."""
    if not output_ids:
        return TargetScore(0.0, 0, 0)
    device = next(model.parameters()).device
    ids = torch.tensor([list(prompt_ids) + list(output_ids)], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1, :vocab_size].float()  # [n, vocab]
    out = torch.tensor(output_ids, device=device)
    log_probs = torch.log_softmax(logits, dim=-1)
    nll = -float(log_probs.gather(-1, out[:, None]).sum())
    agree = int((logits.argmax(-1) == out).sum())
    return TargetScore(nll, len(output_ids), agree)


def perplexity(nll: float, tokens: int) -> float | None:
    return math.exp(nll / tokens) if tokens else None
