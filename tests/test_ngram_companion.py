"""The n-gram companion of Speculative Verification (drafters/ngram_companion.py).

- Its distributions equal a from-scratch Witten-Bell reference (tokens counted by brute force over the row's
  tokens and the corpus) at every position the companion drafter asks for, over rounds of drafts and rewinds,
  with ragged rows, row moves and a corpus; every token keeps probability > 0.
- The distribution at a fed position does not read the tokens fed after it (SV's exactness needs it).
- SV with it stays lossless: the goodness-of-fit of tests/test_sv.py (8-token tiny Llamas, ragged batch of T=1,
  T=0.8 / top-k 5 and greedy rows, the select phase keeping and dropping tokens), with its negative control (the
  actual-A selection under the rejection coupling) rejected; at T=0 `sv` and `adaptive-verify` give `ar`'s
  tokens, batched and alone, with the companion named "ngram" through the API.
- `draftwise profile-sv --companion ngram` (SmolLM2) writes a profile; the registry's pair companion resolves to
  an n-gram companion over data/answers/qwen2.5-coder-1.5b without loading a model; a corpus leaves out the
  answers to a profile's own prompts.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import draftwise
from draftwise.drafters.base import ModelRowsDrafter
from draftwise.drafters.companion import CompanionRowsDrafter
from draftwise.drafters.ngram_companion import (NgramCompanion, NgramRunner, Corpus, companion_runner,
                                                load_companion)
from draftwise.engine.sampling import warp
from draftwise.errors import DraftwiseError
from draftwise.models import registry
from draftwise.models.runner import ModelRunner
from draftwise.selectors import sv
from draftwise.training.answers import Answer, write_chunk
import test_sv
from test_exactness import ALPHA
from test_sv import (GAMMA, GREEDY_COST, PLAIN, PROMPTS64, V, VERIFY_COST, WARPED, GREEDY, NotTargetDistribution,
                     Row, check_select_phase_worked, p_values, trio64)

ORDER = 4


def reference(history: list[int], corpus: list[list[int]], vocab: int, order: int = ORDER) -> np.ndarray:
    """Witten-Bell interpolation from scratch: P_n(w|h) = (c(h,w) + T(h) P_{n-1}(w|h')) / (c(h) + T(h)) over
    orders 1 .. order on a uniform floor, counts over the history and each corpus sequence."""
    sequences = [history] + corpus
    p = np.full(vocab, 1.0 / vocab)
    for n in range(order):  # n tokens of context
        if n > len(history):
            break
        context = tuple(history[len(history) - n:])
        seen = Counter(s[i] for s in sequences for i in range(n, len(s)) if tuple(s[i - n: i]) == context)
        if not seen:
            break
        total, types = sum(seen.values()), len(seen)
        p = p * types / (total + types)
        for token, count in seen.items():
            p[token] += count / (total + types)
    return p


def test_distributions_match_the_reference_over_drafts_rewinds_and_moves():
    _, draft, _ = trio64()
    vocab = 64
    rng = random.Random(4)
    corpus = [[rng.randrange(8) for _ in range(30)] for _ in range(3)]  # a small alphabet: contexts repeat
    settings = [PLAIN, WARPED, GREEDY]
    runner = NgramRunner(vocab, corpus=Corpus.build(corpus, ORDER, vocab), order=ORDER)
    drafter = CompanionRowsDrafter(ModelRowsDrafter(ModelRunner(draft.model, vocab_size=vocab, rows=0), vocab,
                                                    keep_raw=True), runner, vocab)
    rows = [Row(p, s, seed) for seed, (p, s) in enumerate(zip([[1], [2, 3, 4, 2, 3], [5, 6]], settings))]
    for b, row in enumerate(rows):
        drafter.admit(b, row.sequence)
    checked = tied = 0
    for step in range(10):
        limits = [0] * len(rows) if step in (3, 4) else [rng.randint(0, 4) for _ in rows]  # 2 steps draft nothing
        out = drafter.propose(rows, limits)
        if not out.width:  # nothing scored: the companion counts the skipped tokens in the next step that drafts
            assert out.companion_raw is None
        else:
            assert out.companion_raw.shape == (len(rows), out.width + 1, vocab)
        for b, row in enumerate(rows):
            for i in range(out.counts[b] + 1 if out.width else 0):
                expected = torch.tensor(reference(row.sequence + out.tokens[b, :i].tolist(), corpus, vocab),
                                        dtype=torch.float32)
                assert torch.allclose(out.companion_raw[b, i], expected, atol=1e-6), (step, b, i)
                assert float(out.companion_raw[b, i].min()) > 0
                sampling = row.request.sampling
                top = torch.sort(expected, descending=True).values
                if 0 < sampling.top_k < vocab and bool(top[sampling.top_k - 1] == top[sampling.top_k]):
                    tied += 1  # a tie at top-k's cut: which tied tokens stay depends on float rounding (the
                    continue   # prompt counted in an earlier call or in this one), within the 1e-6 above
                assert torch.allclose(out.companion_probs[b, i], warp(expected.log(), sampling), atol=1e-5)
                checked += 1
        for b, row in enumerate(rows):  # keep a random prefix and a "recovered" token from a small alphabet
            keep = rng.randint(0, out.counts[b])
            row.sequence += out.tokens[b, :keep].tolist() + [rng.randrange(8)]
            drafter.rewind(b, len(row.sequence) - 1)
        if step == 5:  # the last row moves to row 1 (the engine compacts rows when a request ends)
            drafter.move_row(2, 1)
            rows[1] = rows[2]
            del rows[2]
            drafter.release(2)
    assert checked > 40 and tied < checked // 4  # the tie skip is the exception


def test_a_position_does_not_read_the_tokens_fed_after_it():
    runner = NgramRunner(16, order=3)
    prefix = [1, 2, 3, 1, 2]
    outs = []
    for tail in ([3, 1], [7, 9]):
        runner.cache.reset_row(0)
        outs.append(runner.forward_rows(torch.tensor([prefix + tail]), [7],
                                        logits_at=torch.tensor([[3, 4, 5, 6]])).logits.clone())  # (its buffer)
    assert torch.equal(outs[0][0, :2], outs[1][0, :2])  # positions 3 and 4: the same prefix
    assert not torch.equal(outs[0][0, 2:], outs[1][0, 2:])  # positions after the tails differ
    # a padded position (past a row's fed tokens) is uniform
    runner.cache.drop_rows(0)
    out = runner.forward_rows(torch.tensor([[1, 2, 0], [4, 4, 4]]), [2, 3], logits_at=torch.tensor([[2], [2]]))
    assert torch.allclose(out.logits[0, 0].exp(), torch.full((16,), 1 / 16))
    with pytest.raises(DraftwiseError, match="hidden"):
        runner.forward_rows(torch.tensor([[1]]), [1], hidden=True)


# ---------------------------------------------------------------- SV with the n-gram companion stays exact


def ngram_profile(size: int, temperature: float, cost: float) -> sv.SVProfile:
    """A profile built by the real pipeline with the n-gram companion (the context only)."""
    return test_sv.built_profile(size, temperature, cost, "ngram")[0]


def run_rows_ngram(monkeypatch, kind: str, n: int, batch: int, coupling: str = "gumbel"):
    """test_sv's `run_rows` (its ragged rows, engine and counts) with the n-gram companion in place of the model
    companion, and the profile built with it."""
    profile = ngram_profile(V, 1.0, VERIFY_COST)
    monkeypatch.setattr(test_sv, "built_profile", lambda size, temperature: (profile, None))
    monkeypatch.setattr(test_sv, "CompanionRowsDrafter",
                        lambda inner, model_runner, vocab: CompanionRowsDrafter(inner, NgramRunner(vocab), vocab))
    return test_sv.run_rows(kind, n, batch, coupling=coupling)


def test_sv_with_the_ngram_companion_follows_the_target_distribution(monkeypatch):
    counts, totals, watch = run_rows_ngram(monkeypatch, "sv", 1000, 24)
    assert 0 < totals["accepted"] < totals["drafted"] < totals["proposed"], totals
    check_select_phase_worked(watch, 24)
    ps = p_values(counts)
    print(totals, ps)
    if min(ps) <= ALPHA:
        raise NotTargetDistribution(f"sv with the n-gram companion: p-values per row {ps}")


def test_control_the_actual_a_selection_with_the_ngram_companion_is_rejected(monkeypatch):
    counts, totals, _ = run_rows_ngram(monkeypatch, "actual-a", 600, 24, coupling="rejection")
    assert totals["proposed"] > totals["drafted"] > 0
    ps = p_values(counts)
    print(totals, ps)
    assert min(ps) < ALPHA, f"the actual-A selection was not detected with the n-gram companion: {ps}"


@pytest.mark.parametrize("method", ["sv", "adaptive-verify"])
def test_greedy_equals_ar_token_for_token_batched_and_alone(method, tmp_path):
    target, draft, _ = trio64()
    path = tmp_path / "greedy.json"
    ngram_profile(64, 0.0, GREEDY_COST).save(path)

    def run(prompts, m):
        options = {"companion": "ngram"} if m == "sv" else {}
        if m != "ar":
            options.update(draft=draft, profile=str(path))
        return draftwise.generate(target, prompts, method=m, max_new_tokens=20, gamma=4, ignore_eos=True, seed=3,
                                  temperature=0.0, **options)

    ar = [g.token_ids for g in run(PROMPTS64, "ar")]
    batched = run(PROMPTS64, method)
    assert [g.token_ids for g in batched] == ar
    assert [run(p, method).token_ids for p in PROMPTS64] == ar
    drafted = sum(g.stats["drafted"] for g in batched)
    assert drafted > 0 and sum(g.stats["accepted"] for g in batched) > 0
    assert sum(g.stats["proposed"] for g in batched) > drafted  # the select phase dropped drafted tokens


# ---------------------------------------------------------------- names, corpus, profile-sv


def _answers(tmp_path, sequences):
    answers = [Answer(f"u{i}", "spec-bench", "c", "greedy", prompt, answer)
               for i, (prompt, answer) in enumerate(sequences)]
    write_chunk(tmp_path / "answers-greedy-00000.npz", answers, {"tag": "greedy"})
    return tmp_path


def test_a_corpus_counts_the_answers_and_leaves_out_a_profiles_prompts(tmp_path):
    target = SimpleNamespace(tokenizer=None, vocab_size=32, device=torch.device("cpu"), eos_token_ids=frozenset())
    directory = _answers(tmp_path, [([1, 2], [5, 6, 7, 5, 6, 7]), ([3], [9, 9, 9])])
    companion = load_companion(f"ngram:{directory}", target)
    assert isinstance(companion, NgramCompanion) and companion.name == f"ngram:{directory}"

    def after(c, history):
        runner = companion_runner(c, vocab_size=32)
        runner.cache.reset_row(0)
        return runner.forward_rows(torch.tensor([history]), [len(history)],
                                   logits_at=torch.tensor([[len(history) - 1]])).logits[0, 0].exp()

    got = after(companion, [5, 6])
    assert torch.allclose(got, torch.tensor(reference([5, 6], [[5, 6, 7, 5, 6, 7], [9, 9, 9]], 32),
                                            dtype=torch.float32), atol=1e-6)
    assert int(got.argmax()) == 7  # the answers' "5 6 7"
    held = companion.without_answers_to([[1, 2]])
    assert torch.allclose(after(held, [5, 6]), torch.tensor(reference([5, 6], [[9, 9, 9]], 32),
                                                            dtype=torch.float32), atol=1e-6)
    with pytest.raises(DraftwiseError, match="not a directory"):
        load_companion(f"ngram:{tmp_path / 'nowhere'}", target)


def test_the_pairs_registry_companion_is_the_ngram_over_its_answers():
    name = registry.default_companion(registry.QWEN_TARGET)
    assert name == "qwen2.5-coder-1.5b-ngram" and registry.entry(name).role == "companion"
    target = SimpleNamespace(tokenizer=None, vocab_size=151936, device=torch.device("cpu"), eos_token_ids=frozenset())
    companion = load_companion(name, target)  # no model is loaded
    assert isinstance(companion, NgramCompanion) and companion.corpus_dir == registry.ANSWERS_DIR / registry.QWEN_TARGET
    runner = companion.runner(151665)
    assert runner.corpus.sequences > 0 and runner.vocab_size == 151665


def test_profile_sv_runs_with_the_ngram_companion(tmp_path, capsys):
    from draftwise.cli import main

    out = tmp_path / "profile.json"
    code = main(["profile-sv", "--target", "smollm2-135m", "--draft", "smollm2-135m-draft", "--companion", "ngram",
                 "--num-prompts", "2", "--max-new-tokens", "12", "--batch-size", "2", "--gamma", "3",
                 "--latency-rows", "1,2", "--context", "32", "--temperature", "1", "--out", str(out)])
    assert code == 0
    profile = sv.SVProfile.load(out)
    assert profile.setting["companion"] == "ngram" and profile.report["samples"] > 0
    assert len(profile.latency.companion) == 2 and all(ms > 0 for ms in profile.latency.companion)
    assert "wrote" in capsys.readouterr().out
    json.loads(out.read_text())
