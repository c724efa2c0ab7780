"""MTAD and MTJD (the MTAD paper): beam drafts, the longest-passing-prefix verification, caches, energy.

- The beam drafter (deterministic) returns the exhaustive argmax of the joint draft likelihood
  when the beam is wide enough to be exhaustive, and the same beams as a cache-free beam search
  written here when it is not; its joint log-probabilities match a recomputation.
- Sampled beams: with one beam, beam sampling is ancestral sampling, so two drafted tokens
  follow q(x1) q(x2 | x1) (Pearson chi-square at ALPHA, small cells pooled); negative control:
  dropping the Gumbel noise (top-k of the scores) is rejected.
- The verification keeps the longest passing prefix even when an earlier one fails (hand-built);
  tau = 1 keeps nothing, so every step is one target-sampled token.
- MTAD at temperature 0 equals a cache-free MTAD written here, token for token; the caches stay
  consistent after beam drafting and rollback.
- MTJD at temperature 0 with an exhaustive beam equals exhaustive block decoding of the target.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import draftwise
from draftwise.acceptance import StepDistributions
from draftwise.bench.energy import EnergyMeter, find_meter, rapl_meter
from draftwise.bench.harness import parse_label
from draftwise.bench.metrics import RunRecord, quality_fields, summarize
from draftwise.bench.quality import perplexity, target_score
from draftwise.bench.report import format_table
from draftwise.errors import DraftwiseError
from draftwise.models.runner import ModelRunner
from draftwise.mtad import MTADRule, beam_search, passing_prefixes, step_log_probs
from draftwise.sampling import SamplingConfig, make_generator

from conftest import tiny_llama
from test_exactness import ALPHA, pooled_chisquare

GREEDY = SamplingConfig(temperature=0.0)
WARPED = SamplingConfig(temperature=0.8, top_k=6, top_p=0.95)
PROMPT = [3, 1, 4, 1, 5]


@torch.inference_mode()
def log_probs_after(model, prefixes: list[list[int]], vocab: int, sampling: SamplingConfig) -> torch.Tensor:
    """[len(prefixes), vocab] scoring log-probabilities of the next token, one full forward each (no cache)."""
    out = []
    for prefix in prefixes:
        logits = model(torch.tensor([prefix])).logits[0, -1, :vocab]
        out.append(step_log_probs(logits[None], sampling)[0])
    return torch.stack(out)


def joint_of(model, prompt: list[int], tokens: list[int], vocab: int, sampling: SamplingConfig) -> list[float]:
    """log q(x_{1:j}) for every j, recomputed from full forwards."""
    lp = log_probs_after(model, [prompt + tokens[:i] for i in range(len(tokens))], vocab, sampling)
    return torch.cumsum(lp[torch.arange(len(tokens)), torch.tensor(tokens)], 0).tolist()


def reference_beam_search(model, prompt: list[int], length: int, beams: int, vocab: int) -> list[int]:
    """Deterministic beam search without caches: top-`beams` joint scores at every step."""
    alive = [([], 0.0)]
    for _ in range(length):
        lp = log_probs_after(model, [prompt + seq for seq, _ in alive], vocab, GREEDY)
        joint = torch.tensor([score for _, score in alive])[:, None] + lp
        top = torch.topk(joint.flatten(), min(beams, joint.numel())).indices.tolist()
        alive = [(alive[i // vocab][0] + [i % vocab], float(joint.flatten()[i])) for i in top]
    return max(alive, key=lambda beam: beam[1])[0]


# ----------------------------------------------------------------------------- beam drafter


def test_exhaustive_beam_is_the_joint_argmax():
    vocab, length = 6, 3
    draft = tiny_llama(1, vocab=vocab, layers=1, init=0.5)
    runner = ModelRunner(draft)
    beam = beam_search(runner, PROMPT, length, vocab ** (length - 1), GREEDY, make_generator(0))
    greedy = beam_search(ModelRunner(draft), PROMPT, length, 1, GREEDY, make_generator(0))
    assert greedy.tokens.tolist() != beam.tokens.tolist()  # a case where the joint argmax is not the greedy path
    every = [list(seq) for seq in itertools.product(range(vocab), repeat=length)]
    with torch.inference_mode():
        logits = draft(torch.tensor([PROMPT + seq for seq in every])).logits[:, len(PROMPT) - 1 : -1]
    scores = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(every)[..., None]).sum((1, 2))
    assert beam.tokens.tolist() == every[int(scores.argmax())]
    assert beam.joint_log_probs.tolist() == pytest.approx(joint_of(draft, PROMPT, beam.tokens.tolist(), vocab, GREEDY),
                                                          abs=1e-4)
    assert runner.length == len(PROMPT) + length - 1 and runner.cache.num_rows == 1


@pytest.mark.parametrize("beams", [1, 2, 3, 5])
def test_narrow_beams_match_a_cache_free_beam_search(beams: int):
    vocab = 64
    draft = tiny_llama(1, layers=1, init=0.5)
    beam = beam_search(ModelRunner(draft), PROMPT, 4, beams, GREEDY, make_generator(0))
    assert beam.tokens.tolist() == reference_beam_search(draft, PROMPT, 4, beams, vocab)
    assert beam.joint_log_probs.tolist() == pytest.approx(joint_of(draft, PROMPT, beam.tokens.tolist(), vocab, GREEDY),
                                                          abs=1e-4)


def test_sampled_beam_joint_probabilities_match_recomputation():
    draft = tiny_llama(1, layers=1)
    runner = ModelRunner(draft)
    runner.forward(PROMPT[:3])  # part of the prompt cached already, as in decoding
    beam = beam_search(runner, PROMPT, 4, 4, WARPED, make_generator(3))
    expected = joint_of(draft, PROMPT, beam.tokens.tolist(), 64, WARPED)
    assert all(math.isfinite(x) for x in expected)  # every beam token is inside the warped support
    assert beam.joint_log_probs.tolist() == pytest.approx(expected, abs=1e-4)


def test_fewer_candidates_than_beams_keeps_fewer_beams():
    draft = tiny_llama(1, layers=1)
    beam = beam_search(ModelRunner(draft), PROMPT, 3, 8, SamplingConfig(1.0, top_k=2), make_generator(0))
    assert beam.beams <= 8 and len(beam.tokens) == 3
    one = beam_search(ModelRunner(draft), PROMPT, 2, 8, SamplingConfig(1.0, top_k=1), make_generator(0))
    assert one.beams == 1


def _two_token_counts(n: int, monkeypatch=None) -> np.ndarray:
    vocab = 16
    draft = tiny_llama(1, vocab=vocab, layers=1, init=0.15)
    sampling = SamplingConfig(1.0)
    generator = make_generator(11)
    counts = np.zeros((vocab, vocab))
    runner = ModelRunner(draft)
    runner.forward(PROMPT[:-1])
    for _ in range(n):
        tokens = beam_search(runner, PROMPT, 2, 1, sampling, generator).tokens.tolist()
        runner.trim(len(PROMPT) - 1)
        counts[tokens[0], tokens[1]] += 1
    return counts


def _two_token_joint() -> np.ndarray:
    vocab = 16
    draft = tiny_llama(1, vocab=vocab, layers=1, init=0.15)
    first = log_probs_after(draft, [PROMPT], vocab, SamplingConfig(1.0)).exp()[0]
    second = log_probs_after(draft, [PROMPT + [x] for x in range(vocab)], vocab, SamplingConfig(1.0)).exp()
    return (first[:, None] * second).numpy()


def test_one_beam_sampling_is_ancestral_sampling():
    counts = _two_token_counts(3000)
    assert pooled_chisquare(counts, _two_token_joint()) > ALPHA


def test_control_beam_sampling_without_noise_is_rejected(monkeypatch):
    import draftwise.mtad as mtad

    monkeypatch.setattr(mtad, "_select", lambda scores, n, sampling, generator: torch.topk(scores, n).indices)
    counts = _two_token_counts(300)
    assert pooled_chisquare(counts, _two_token_joint()) < ALPHA


# ----------------------------------------------------------------------------- verification


def _step(target_rows: list[list[float]], draft_joint: list[float], tokens: list[int]) -> StepDistributions:
    probs = torch.tensor(target_rows)  # [k + 1, vocab]
    k = len(tokens)
    one_hot = torch.zeros(k, probs.shape[1]).scatter_(1, torch.tensor(tokens)[:, None], 1.0)
    return StepDistributions(torch.tensor(tokens), one_hot, probs, torch.log(probs), draft_joint=torch.log(
        torch.tensor(draft_joint)))


def test_longest_passing_prefix_even_after_a_failing_one():
    # p(x_1) = .2 vs q = .5 -> ratio .4 fails at tau .5; p(x_1:2) = .2 * .9 = .18 vs q = .25 -> .72 passes;
    # p(x_1:3) = .18 * .1 = .018 vs q = .2 -> .09 fails. Longest passing prefix: 2.
    rows = [[0.2, 0.8, 0.0], [0.05, 0.9, 0.05], [0.1, 0.0, 0.9], [1 / 3, 1 / 3, 1 / 3]]
    step = _step(rows, [0.5, 0.25, 0.2], [0, 1, 0])
    assert MTADRule(tau=0.5).prefix(step) == 2
    assert MTADRule(tau=0.8).prefix(step) == 0  # .4, .72, .09: none above .8
    assert MTADRule(tau=0.05).prefix(step) == 3
    assert MTADRule(tau=0.0).prefix(step) == 3


def test_tau_near_one_accepts_only_where_the_target_is_at_least_as_likely():
    rows = [[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]]
    step = _step(rows, [0.61, 0.61 * 0.31], [0, 0])  # p/q just below 1 at both prefixes
    assert MTADRule(tau=0.999).prefix(step) == 0
    assert MTADRule(tau=1.0).prefix(step) == 0
    assert MTADRule(tau=0.9).prefix(step) == 2
    higher = _step(rows, [0.5, 0.5 * 0.3], [0, 0])  # p >= q: min(1, p/q) = 1 > 0.999
    assert MTADRule(tau=0.999).prefix(higher) == 2
    assert MTADRule(tau=1.0).prefix(higher) == 0  # min(1, .) > 1 never holds


def test_zero_target_probability_never_passes():
    joint = torch.tensor([-1.0, -math.inf])
    assert passing_prefixes(joint, torch.tensor([-2.0, -3.0]), 0.0).tolist() == [True, False]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tau_one_emits_one_target_token_per_step(llama_pair, temperature):
    target, draft = llama_pair
    out = draftwise.generate(target, PROMPT, draft=draft, method="mtad", tau=1.0, max_new_tokens=20, seed=5,
                             temperature=temperature, gamma=3, ignore_eos=True)
    s = out.stats
    assert s["accepted"] == 0 and s["new_tokens"] == s["target_calls"] == s["steps"] == 20
    assert s["drafted"] == 3 * 17 + 2 + 1  # near the end a step drafts at most budget - 1 tokens
    if temperature == 0:
        ar = draftwise.generate(target, PROMPT, method="ar", temperature=0, max_new_tokens=20, ignore_eos=True)
        assert out.token_ids == ar.token_ids


def cache_free_mtad(target, draft, prompt: list[int], n: int, gamma: int, beams: int, tau: float,
                    vocab: int = 64) -> list[int]:
    """MTAD at temperature 0 from full forwards only (Algorithm 1 with beam search drafts)."""
    seq = list(prompt)
    while len(seq) - len(prompt) < n:
        budget = n - (len(seq) - len(prompt))
        drafted = reference_beam_search(draft, seq, min(gamma, budget - 1), beams, vocab) if budget > 1 else []
        q_joint = joint_of(draft, seq, drafted, vocab, GREEDY) if drafted else []
        with torch.inference_mode():
            logits = target(torch.tensor([seq + drafted])).logits[0, len(seq) - 1 :, :vocab]
        p = torch.softmax(logits.float(), -1)
        keep, p_joint = 0, 0.0
        for j, token in enumerate(drafted):
            p_joint += math.log(float(p[j, token]))
            if min(1.0, math.exp(p_joint - q_joint[j])) > tau:
                keep = j + 1
        seq += drafted[:keep] + [int(p[keep].argmax())]
    return seq[len(prompt) :]


@pytest.mark.parametrize("tau,beams", [(0.0, 2), (0.1, 3), (0.5, 4)])
def test_greedy_mtad_matches_a_cache_free_implementation(llama_pair, tau: float, beams: int):
    target, draft = llama_pair
    out = draftwise.generate(target, PROMPT, draft=draft, method="mtad", tau=tau, num_beams=beams, gamma=3,
                             temperature=0, max_new_tokens=24, ignore_eos=True)
    assert out.token_ids == cache_free_mtad(target, draft, PROMPT, 24, 3, beams, tau)
    s = out.stats
    assert s["new_tokens"] == s["accepted"] + s["steps"] and s["target_calls"] == s["steps"]


def test_mtad_at_tau_zero_keeps_every_drafted_token(llama_pair):
    target, draft = llama_pair
    out = draftwise.generate(target, PROMPT, draft=draft, method="mtad", tau=0.0, gamma=3, temperature=0,
                             max_new_tokens=16, ignore_eos=True)
    assert out.stats["accepted"] == out.stats["drafted"]  # the unwarped target gives every token p > 0


def test_caches_stay_consistent_after_beam_drafting_and_rollback(llama_pair):
    _, draft = llama_pair
    runner = ModelRunner(draft)
    generator = make_generator(1)
    seq = list(PROMPT)
    for step in range(4):  # draft, keep part of it, draft again from the rolled-back cache
        beam = beam_search(runner, seq, 4, 3, WARPED, generator)
        seq += beam.tokens.tolist()[: step % 3 + 1]
        runner.trim(len(seq) - 1)
    logits = runner.forward(runner.pending(seq), num_logits=1).logits[0]
    with torch.inference_mode():
        fresh = draft(torch.tensor([seq])).logits[0, -1]
    torch.testing.assert_close(logits, fresh, atol=1e-4, rtol=1e-4)


def test_sampled_mtad_runs_and_its_stats_add_up(llama_pair):
    target, draft = llama_pair
    out = draftwise.generate(target, PROMPT, draft=draft, method="mtad", tau=0.2, num_beams=3, gamma=4, seed=2,
                             temperature=1.0, top_k=10, top_p=0.9, max_new_tokens=30, ignore_eos=True)
    s = out.stats
    assert s["new_tokens"] == 30 == s["accepted"] + s["steps"]
    assert sum(s["accepted_per_position"]) == s["accepted"]
    again = draftwise.generate(target, PROMPT, draft=draft, method="mtad", tau=0.2, num_beams=3, gamma=4, seed=2,
                               temperature=1.0, top_k=10, top_p=0.9, max_new_tokens=30, ignore_eos=True)
    assert again.token_ids == out.token_ids  # one seeded generator drives beams and target samples


# ----------------------------------------------------------------------------- MTJD


def test_greedy_mtjd_with_an_exhaustive_beam_is_exhaustive_block_decoding():
    vocab, k = 6, 2
    target = tiny_llama(0, vocab=vocab, init=0.3)
    out = draftwise.generate(target, PROMPT, method="mtjd", k=k, num_beams=vocab, temperature=0, max_new_tokens=6,
                             ignore_eos=True)
    seq = list(PROMPT)
    for _ in range(3):
        every = [list(x) for x in itertools.product(range(vocab), repeat=k)]
        with torch.inference_mode():
            logits = target(torch.tensor([seq + x for x in every])).logits[:, len(seq) - 1 : -1]
        scores = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(every)[..., None]).sum((1, 2))
        seq += every[int(scores.argmax())]
    assert out.token_ids == seq[len(PROMPT) :]
    assert out.stats["target_calls"] == 6 and out.stats["steps"] == 3


def test_mtjd_with_k_one_is_greedy_decoding(llama_pair):
    target, _ = llama_pair
    mtjd = draftwise.generate(target, PROMPT, method="mtjd", k=1, temperature=0, max_new_tokens=12, ignore_eos=True)
    ar = draftwise.generate(target, PROMPT, method="ar", temperature=0, max_new_tokens=12, ignore_eos=True)
    assert mtjd.token_ids == ar.token_ids


def test_mtjd_lowers_the_targets_perplexity_at_temperature_zero():
    target = tiny_llama(0, init=0.2)
    scores = {}
    for k in (1, 4):
        out = draftwise.generate(target, PROMPT, method="mtjd", k=k, num_beams=8, temperature=0, max_new_tokens=16,
                                 ignore_eos=True)
        s = target_score(target, PROMPT, out.token_ids, 64)
        scores[k] = perplexity(s.nll, s.tokens)
    assert scores[4] <= scores[1] + 1e-6  # Corollary 3.3 (per block; this prompt shows it)


# ----------------------------------------------------------------------------- options, metrics, energy


@pytest.mark.parametrize("options,match", [
    (dict(method="mtad", tau=1.5), "tau must be in"), (dict(method="mtad", num_beams=0), "num_beams"),
    (dict(method="mtjd", k=0), "k must be"), (dict(method="mtjd", num_beams=-1), "num_beams"),
])
def test_bad_options_fail_before_any_model_runs(options, match):
    with pytest.raises(DraftwiseError, match=match):
        draftwise.generate("no-such-model", [1, 2], draft="no-such-draft" if options["method"] == "mtad" else None,
                           **options)


def test_method_labels_carry_typed_options():
    assert parse_label("mtad/tau=0.3/num_beams=2") == ("mtad", {"tau": 0.3, "num_beams": 2})
    assert parse_label("cascade:opt@0.2") == ("cascade", {"rule": "opt", "alpha": 0.2})
    for bad, match in [("mtad/tau", "OPTION=VALUE"), ("mtad/beams=2", "no 'beams' option"),
                       ("mtad/tau=2", "tau must be in"), ("mtad/num_beams=x", "finite int"),
                       ("lossy@0.2/alpha=0.1", "alpha given twice"), ("mtad/tau=0.1/tau=0.2", "given twice")]:
        with pytest.raises(DraftwiseError, match=match):
            parse_label(bad)


class _FixedLM(torch.nn.Module):
    """Next-token distributions chosen by hand: position i predicts `rows[i]`."""

    def __init__(self, rows: list[list[float]]) -> None:
        super().__init__()
        self.rows = torch.log(torch.tensor(rows))
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids):
        class Out:
            logits = self.rows[None, : input_ids.shape[1]]
        return Out()


def test_perplexity_hand_computed():
    # prompt [0]; output [1, 2]: p(1 | 0) = .5, p(2 | 0 1) = .25 -> ppl = exp((ln 2 + ln 4) / 2) = sqrt(8)
    lm = _FixedLM([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]])
    score = target_score(lm, [0], [1, 2], 3)
    assert score.nll == pytest.approx(math.log(8)) and score.tokens == 2 and score.agree == 1
    assert perplexity(score.nll, score.tokens) == pytest.approx(math.sqrt(8))
    records = [RunRecord("m", 0, 1, "c", 2, 1.0, 2, nll=math.log(8), scored_tokens=2),
               RunRecord("m", 0, 2, "c", 1, 1.0, 1, nll=math.log(2), scored_tokens=1)]
    assert quality_fields(records)["perplexity"] == pytest.approx(16 ** (1 / 3))  # pooled: exp(ln 16 / 3)


def test_block_efficiency_and_energy_per_token():
    records = [RunRecord("m", rep, q, "c", 10, 1.0, 4, energy_j=e) for rep, q, e in
               [(0, 1, 5.0), (0, 2, 3.0), (1, 1, 2.0), (1, 2, 2.0), (2, 1, 9.0), (2, 2, 9.0)]]
    s = summarize(records)
    assert s["block_efficiency"] == s["mean_accepted_length"] == 2.5
    assert s["energy_j_per_token"] == pytest.approx(0.4)  # per repeat .4, .2, .9 -> median .4
    records[0].energy_j = None  # one run without a reading: no number at all
    assert summarize(records)["energy_j_per_token"] is None


def test_rapl_meter_reads_sums_and_unwraps(tmp_path):
    for package, value in [("intel-rapl:0", 1_000_000), ("intel-rapl:0:0", 5)]:
        (tmp_path / package).mkdir()
        (tmp_path / package / "energy_uj").write_text(f"{value}\n")
        (tmp_path / package / "max_energy_range_uj").write_text("10000000\n")
    meter, reason = rapl_meter(tmp_path)
    assert meter is not None and reason == "" and meter.source == "rapl"
    assert meter.read() == pytest.approx(1.0)  # the sub-domain is inside the package: not added
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("3500000\n")
    assert meter.read() == pytest.approx(3.5)
    assert meter.joules_between(9.5, 0.5) == pytest.approx(1.0)  # wrapped once at 10 J


def test_energy_unavailable_is_reported_with_the_reason(tmp_path):
    meter, reason = find_meter(torch.device("cpu"), powercap=tmp_path / "absent")
    assert meter is None and "does not exist" in reason
    (tmp_path / "intel-rapl:0").mkdir()
    meter, reason = rapl_meter(tmp_path)
    assert meter is None and "cannot be read" in reason
    results = {"methods": {"ar": summarize([RunRecord("ar", 0, 1, "c", 4, 1.0, 4)]) | {"speedup_vs_ar": 1.0}},
               "energy": {"available": False, "reason": reason}}
    table = format_table(results)
    assert "energy: unavailable" in table and "J/tok" not in table
    assert EnergyMeter("x", lambda: 0.0).joules_between(2.0, 1.0) == 0.0  # no range known: never negative
