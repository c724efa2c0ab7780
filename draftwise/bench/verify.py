"""What a verification costs: one forward of k tokens on rows that already hold `context` tokens, against one token,
timed round by round (`bench.timing.interleaved`) and rolled back after each call. `benchmarks/verify_cost.py` draws
the whole curve k = 1..8 with it; `draftwise bench` times the one its methods pay (k = gamma + 1 against k = 1, and
one draft token against one target token) to say why the fastest method won."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from draftwise.bench.timing import interleaved, medians
from draftwise.models.runner import ModelRunner


def filled_runner(model: Any, batch: int, context: int, generator: torch.Generator) -> ModelRunner:
    """A runner for `model` whose `batch` rows hold `context` random tokens (a draft keeps its restricted output
    vocabulary, as sd runs it)."""
    runner = ModelRunner(model.model, vocab_size=model.vocab_size, rows=batch,
                         output_ids=getattr(model, "output_ids", None))
    prompt = torch.randint(*_token_range(model.vocab_size), (batch, context), generator=generator).to(model.device)
    runner.forward_rows(prompt, [context] * batch, logits_at=torch.zeros(batch, 1, dtype=torch.long), prompt=True)
    return runner


def _token_range(vocab_size: int) -> tuple[int, int]:
    """Token ids drawn from [100, 40000), within the vocabulary of a small model."""
    return (100, 40000) if vocab_size >= 40000 else (0, vocab_size)


def time_forwards(cases: Mapping[str, tuple[Any, int]], *, batch: int = 1, context: int = 256, repeats: int = 5,
                  warmup: int = 2) -> dict[str, float]:
    """Median seconds of each case, `name -> (model, k)`: a forward of k tokens per row on `batch` rows that hold
    `context` tokens, the cases interleaved round by round, every row rolled back to `context` after each call.
    Cases naming the same model share one runner."""
    generator = torch.Generator().manual_seed(0)
    runners: dict[int, ModelRunner] = {}
    for model, _ in cases.values():
        if id(model) not in runners:
            runners[id(model)] = filled_runner(model, batch, context, generator)
    device = next(iter(cases.values()))[0].device
    low, high = _token_range(min(model.vocab_size for model, _ in cases.values()))
    feeds = {k: torch.randint(low, high, (batch, k), generator=generator).to(device)
             for k in sorted({k for _, k in cases.values()})}
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    calls = {name: (lambda r=runners[id(model)], f=feeds[k]: (r.forward_rows(f, [f.shape[1]] * batch), sync()))
             for name, (model, k) in cases.items()}

    def rollback(name: str) -> None:
        runner = runners[id(cases[name][0])]
        for row in range(batch):
            runner.trim_row(row, context)

    return medians(interleaved(calls, rounds=repeats, warmup=warmup, after=rollback))


def verify_costs(target: Any, draft: Any, k: int, *, context: int = 256, repeats: int = 5) -> dict[str, float]:
    """What `bench`'s advice quotes, timed in one set of rounds: the target's forward of one token and of `k`
    (ms), their ratio, and, with a draft model (not an EAGLE head), one draft token in target tokens."""
    cases: dict[str, tuple[Any, int]] = {"target k=1": (target, 1), f"target k={k}": (target, k)}
    if draft is not None:
        cases["draft k=1"] = (draft, 1)
    times = time_forwards(cases, context=context, repeats=repeats)
    one = times["target k=1"]
    out = {"k": k, "context": context, "rounds": repeats, "target_k1_ms": 1000 * one,
           "target_k_ms": 1000 * times[f"target k={k}"], "verify_vs_k1": times[f"target k={k}"] / one}
    if draft is not None:
        out["draft_k1_ms"] = 1000 * times["draft k=1"]
        out["draft_vs_target"] = times["draft k=1"] / one
    return out
