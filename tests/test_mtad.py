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
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import draftwise
from draftwise.engine.protocols import StepDistributions
from draftwise.bench.energy import EnergyMeter, find_meter, rapl_meter
from draftwise.bench.labels import parse_label
from draftwise.bench.metrics import RunRecord, quality_fields, summarize
from draftwise.bench.quality import perplexity, target_score
from draftwise.bench.report import format_table
from draftwise.errors import DraftwiseError
from draftwise.models.runner import ModelRunner
from draftwise.drafters.mtad import BeamRowsDrafter, ModelBeams, beam_log_probs
from draftwise.rules.mtad import MTADRule, passing_prefixes
from draftwise.engine.sampling import SamplingConfig, make_generator

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
        out.append(beam_log_probs(logits[None], [sampling])[0])
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


def beam_rows(model, prompts: list[list[int]], beams: int, vocab: int = 64):
    """A BeamRowsDrafter over `model` with one admitted row per prompt, and those rows (as the engine keeps them)."""
    drafter = BeamRowsDrafter(ModelBeams(ModelRunner(model, rows=0), vocab), vocab, beams)
    rows = []
    for b, prompt in enumerate(prompts):
        drafter.admit(b, prompt)
        rows.append(SimpleNamespace(sequence=list(prompt), request=SimpleNamespace(sampling=GREEDY), grammar=None,
                                    generator=make_generator(b)))
    return drafter, rows


def sampled(rows, sampling: SamplingConfig, seed: int):
    for b, row in enumerate(rows):
        row.request = SimpleNamespace(sampling=sampling)
        row.generator = make_generator(seed + b)
    return rows


def test_exhaustive_beam_is_the_joint_argmax():
    vocab, length = 6, 3
    draft = tiny_llama(1, vocab=vocab, layers=1, init=0.5)
    drafter, rows = beam_rows(draft, [PROMPT], vocab ** (length - 1), vocab)
    beam = drafter.propose(rows, [length])
    greedy_drafter, greedy_rows = beam_rows(draft, [PROMPT], 1, vocab)
    greedy = greedy_drafter.propose(greedy_rows, [length])
    assert greedy.tokens[0].tolist() != beam.tokens[0].tolist()  # the joint argmax is not the greedy path here
    every = [list(seq) for seq in itertools.product(range(vocab), repeat=length)]
    with torch.inference_mode():
        logits = draft(torch.tensor([PROMPT + seq for seq in every])).logits[:, len(PROMPT) - 1 : -1]
    scores = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(every)[..., None]).sum((1, 2))
    assert beam.tokens[0].tolist() == every[int(scores.argmax())]
    assert beam.joint[0].tolist() == pytest.approx(joint_of(draft, PROMPT, beam.tokens[0].tolist(), vocab, GREEDY),
                                                   abs=1e-4)
    runner = drafter.base.runner
    assert runner.lengths == [len(PROMPT)]  # scratch rows dropped; the base row holds the sequence, no beam token


@pytest.mark.parametrize("beams", [1, 2, 3, 5])
def test_narrow_beams_match_a_cache_free_beam_search_on_every_row(beams: int):
    vocab = 64
    draft = tiny_llama(1, layers=1, init=0.5)
    prompts = [PROMPT, [7, 8], [60, 2, 9, 33, 1, 5, 5]]
    drafter, rows = beam_rows(draft, prompts, beams)
    out = drafter.propose(rows, [4, 2, 3])  # each row its own limit
    assert out.counts == [4, 2, 3]
    for b, prompt in enumerate(prompts):
        tokens = out.tokens[b, : out.counts[b]].tolist()
        assert tokens == reference_beam_search(draft, prompt, out.counts[b], beams, vocab), b
        assert out.joint[b, : out.counts[b]].tolist() == pytest.approx(joint_of(draft, prompt, tokens, vocab, GREEDY),
                                                                       abs=1e-4)


def test_beams_under_forced_acceptance_patterns_match_a_cache_free_beam_search():
    """Draft, keep a forced prefix of each row's beam plus a forced token, rewind, draft again: every proposal equals
    the cache-free beam search of the row's sequence, and the base rows' caches equal a fresh forward."""
    vocab = 64
    draft = tiny_llama(1, layers=1, init=0.5)
    prompts = [PROMPT, [7, 8, 9], [60]]
    drafter, rows = beam_rows(draft, prompts, 3)
    patterns = [[0, 3, 1], [2, 0, 4], [4, 1, 0], [1, 2, 2], [3, 4, 3]]
    for step, keeps in enumerate(patterns):
        out = drafter.propose(rows, [4, 4, 4])
        for b, row in enumerate(rows):
            tokens = out.tokens[b, : out.counts[b]].tolist()
            assert tokens == reference_beam_search(draft, row.sequence, 4, 3, vocab), (step, b)
            row.sequence += tokens[: keeps[b]] + [(step * 7 + b) % vocab]  # accepted, then a recovered token
            drafter.rewind(b, len(row.sequence) - 1)
    logits, _, _ = drafter.base.begin(rows, [1, 1, 1])
    for b, row in enumerate(rows):
        with torch.inference_mode():
            fresh = draft(torch.tensor([row.sequence])).logits[0, -1]
        torch.testing.assert_close(logits[b], fresh, atol=1e-4, rtol=1e-4)


def test_sampled_beam_joint_probabilities_match_recomputation():
    draft = tiny_llama(1, layers=1)
    drafter, rows = beam_rows(draft, [PROMPT, [4, 4, 2]], 4)
    out = drafter.propose(sampled(rows, WARPED, 3), [4, 4])
    for b, row in enumerate(rows):
        expected = joint_of(draft, row.sequence, out.tokens[b].tolist(), 64, WARPED)
        assert all(math.isfinite(x) for x in expected)  # every beam token is inside the warped support
        assert out.joint[b].tolist() == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("config", [SamplingConfig(0.7, top_k=5), SamplingConfig(1.0, top_k=12, top_p=0.8),
                                    SamplingConfig(1.3, top_k=3, top_p=0.5), SamplingConfig(0.9, top_p=0.9)])
def test_beam_scores_of_a_warped_row_are_the_full_warps(config: SamplingConfig):
    """A top-k row is scored among its k tokens alone (beam_candidates): the same support and log-probabilities as
    the full vocabulary's warp, also where the k-th logit ties the next one (then the full warp's answer), and a
    temperature-0 row's candidates are its most likely tokens."""
    from draftwise.drafters.mtad import beam_candidates
    from draftwise.engine.sampler import warp_rows

    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)) * 3
    logits[3, :] = torch.arange(300.0) % 7  # ties everywhere: the k-th logit ties the next
    full = torch.log(warp_rows(logits, [config] * 5))
    ours = beam_log_probs(logits, [config] * 5)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(full))
    torch.testing.assert_close(ours[torch.isfinite(full)], full[torch.isfinite(full)], atol=1e-5, rtol=1e-5)
    untied = [0, 1, 2, 4]
    scores, ids = beam_candidates(logits[untied], [GREEDY, config, GREEDY, config], 4)
    for b in (0, 2):
        assert set(ids[b, :4].tolist()) == set(torch.topk(logits[untied[b]], 4).indices.tolist())
    if config.top_k:
        assert scores.shape[1] == max(4, config.top_k)  # the candidates, not the vocabulary
    for b in (1, 3):
        live = torch.isfinite(scores[b])
        torch.testing.assert_close(scores[b][live], full[untied[b], ids[b][live]], atol=1e-5, rtol=1e-5)


def test_fewer_candidates_than_beams_leaves_dead_beams_that_never_win():
    draft = tiny_llama(1, layers=1)
    drafter, rows = beam_rows(draft, [PROMPT], 8)
    out = drafter.propose(sampled(rows, SamplingConfig(1.0, top_k=1), 0), [3])
    greedy_drafter, greedy_rows = beam_rows(draft, [PROMPT], 1)
    assert out.tokens[0].tolist() == greedy_drafter.propose(greedy_rows, [3]).tokens[0].tolist()  # one live beam
    assert all(math.isfinite(x) for x in out.joint[0].tolist())


def _two_token_counts(n: int) -> np.ndarray:
    vocab = 16
    draft = tiny_llama(1, vocab=vocab, layers=1, init=0.15)
    drafter, rows = beam_rows(draft, [PROMPT], 1, vocab)
    sampled(rows, SamplingConfig(1.0), 11)
    counts = np.zeros((vocab, vocab))
    for _ in range(n):
        tokens = drafter.propose(rows, [2]).tokens[0].tolist()
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
    import draftwise.drafters.mtad as mtad

    monkeypatch.setattr(mtad, "select_candidates",
                        lambda scores, n, configs, generators, drawing=None:
                        torch.topk(scores, min(n, scores.shape[1]), -1).indices)
    counts = _two_token_counts(300)
    assert pooled_chisquare(counts, _two_token_joint()) < ALPHA


# ----------------------------------------------------------------------------- verification


def _step(target_rows: list[list[float]], draft_joint: list[float], tokens: list[int]) -> StepDistributions:
    """One row's verification step (a batch of one)."""
    probs = torch.tensor(target_rows)[None]  # [1, k + 1, vocab]
    k = len(tokens)
    one_hot = torch.zeros(1, k, probs.shape[-1]).scatter_(-1, torch.tensor([tokens])[..., None], 1.0)
    return StepDistributions(torch.tensor([tokens]), one_hot, probs, torch.log(probs),
                             draft_joint=torch.log(torch.tensor([draft_joint])), num_drafted=torch.tensor([k]))


def prefix(rule: MTADRule, step: StepDistributions) -> int:
    return rule.prefix(step, torch.tensor([False]))[0]


def test_longest_passing_prefix_even_after_a_failing_one():
    # p(x_1) = .2 vs q = .5 -> ratio .4 fails at tau .5; p(x_1:2) = .2 * .9 = .18 vs q = .25 -> .72 passes;
    # p(x_1:3) = .18 * .1 = .018 vs q = .2 -> .09 fails. Longest passing prefix: 2.
    rows = [[0.2, 0.8, 0.0], [0.05, 0.9, 0.05], [0.1, 0.0, 0.9], [1 / 3, 1 / 3, 1 / 3]]
    step = _step(rows, [0.5, 0.25, 0.2], [0, 1, 0])
    assert prefix(MTADRule(tau=0.5), step) == 2
    assert prefix(MTADRule(tau=0.8), step) == 0  # .4, .72, .09: none above .8
    assert prefix(MTADRule(tau=0.05), step) == 3
    assert prefix(MTADRule(tau=0.0), step) == 3


def test_tau_near_one_accepts_only_where_the_target_is_at_least_as_likely():
    rows = [[0.6, 0.4], [0.3, 0.7], [0.5, 0.5]]
    step = _step(rows, [0.61, 0.61 * 0.31], [0, 0])  # p/q just below 1 at both prefixes
    assert prefix(MTADRule(tau=0.999), step) == 0
    assert prefix(MTADRule(tau=1.0), step) == 0
    assert prefix(MTADRule(tau=0.9), step) == 2
    higher = _step(rows, [0.5, 0.5 * 0.3], [0, 0])  # p >= q: min(1, p/q) = 1 > 0.999
    assert prefix(MTADRule(tau=0.999), higher) == 2
    assert prefix(MTADRule(tau=1.0), higher) == 0  # min(1, .) > 1 never holds


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
    for _ in range(2):  # a step: the joint argmax over k tokens, then the target's argmax after them
        every = [list(x) for x in itertools.product(range(vocab), repeat=k)]
        with torch.inference_mode():
            logits = target(torch.tensor([seq + x for x in every])).logits[:, len(seq) - 1 : -1]
        scores = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(every)[..., None]).sum((1, 2))
        seq += every[int(scores.argmax())]
        with torch.inference_mode():
            seq.append(int(target(torch.tensor([seq])).logits[0, -1].argmax()))
    assert out.token_ids == seq[len(PROMPT) :]
    assert out.stats["target_calls"] == 2 == out.stats["steps"] and out.stats["accepted"] == 4


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
