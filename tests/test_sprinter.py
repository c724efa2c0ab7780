"""SPRINTER (Zhong et al.): theory against simulation, the rule on the engine's sampler, verifier data
and training, and decoding through `draftwise.generate`.

Simulations use the engine's own `speculative_sample` with `SprinterRule` and a synthetic
verifier whose verdicts are Bernoulli(eta_TP) on acceptable tokens (q(x) <= p(x)) and
Bernoulli(eta_FP) on the others. Goodness of fit: Pearson chi-square at ALPHA = 1e-3 (the
helpers of test_exactness), with a negative control; means by z-tests at the same level.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import binomtest, norm

import draftwise
from draftwise import theory
from draftwise.engine.protocols import StepDistributions
from draftwise.errors import DraftwiseError
from draftwise.engine.sampling import make_generator, sample
from draftwise.heads.sprinter import Verifier
from draftwise.rules.sprinter import SprinterRule

from conftest import tiny_llama, speculative_sample
from test_exactness import ALPHA, pooled_chisquare

P = np.array([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
Q = np.array([0.30, 0.10, 0.25, 0.05, 0.20, 0.10])


def simulate_tokens(n: int, eta_tp: float, eta_fp: float, seed: int = 0) -> tuple[np.ndarray, int]:
    """Counts of the committed token and the number of drafted tokens kept (verifier or check)."""
    p, q = torch.tensor(P, dtype=torch.float32), torch.tensor(Q, dtype=torch.float32)
    generator = make_generator(seed)
    coins = np.random.default_rng(seed)
    counts, kept = np.zeros(len(P), dtype=np.int64), 0
    for _ in range(n):
        x = sample(q[None], generator)  # [1]
        acceptable = bool(q[x] <= p[x])
        verdict = coins.random() < (eta_tp if acceptable else eta_fp)
        step = StepDistributions(x, q[None], torch.stack([p, p]), torch.stack([p, p]).log(),
                                 verdicts=torch.tensor([verdict]))
        out = speculative_sample(x, q[None], SprinterRule()(step), p, generator)
        kept += out.num_accepted
        counts[int(x) if out.num_accepted else out.next_token] += 1
    return counts, kept


@pytest.mark.parametrize("eta_tp, eta_fp", [(0.9, 0.3), (0.6, 0.7), (1.0, 0.0)])
def test_theorem_3_1_distribution(eta_tp: float, eta_fp: float):
    counts, _ = simulate_tokens(6000, eta_tp, eta_fp)
    expected = theory.sprinter_distribution(P, Q, eta_fp)
    p_value = pooled_chisquare(counts, expected)
    assert p_value > ALPHA, p_value
    if eta_fp > 0:
        assert pooled_chisquare(counts, P) < ALPHA  # negative control: it is not the target's distribution
    else:
        assert pooled_chisquare(counts, Q) < ALPHA  # a perfect verifier gives p, not q
    assert theory.sprinter_tv(P, Q, eta_fp) == pytest.approx(eta_fp * theory.tv(P, Q))
    assert theory.tv(P, expected) == pytest.approx(eta_fp * theory.tv(P, Q))


def test_theorem_a4_acceptance_rate():
    n, eta_fp = 20_000, 0.4
    _, kept = simulate_tokens(n, 0.8, eta_fp, seed=3)
    expected = theory.acceptance_rate(eta_fp, theory.tv(P, Q))
    assert binomtest(kept, n, expected).pvalue > ALPHA
    assert binomtest(kept, n, 1 - theory.tv(P, Q)).pvalue < ALPHA  # SD's rate is not it (control)
    assert theory.acceptance_rate(0.0, 0.3) == pytest.approx(0.7)


def simulate_run_lengths(n: int, eta_tp: float, eta_fp: float, r: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.empty(n, dtype=np.int64)
    for k in range(n):
        i = 0
        while rng.random() < (eta_tp if i < r else eta_fp):
            i += 1
        out[k] = i
    return out


@pytest.mark.parametrize("eta_tp, eta_fp, r", [(0.8, 0.3, 5), (0.95, 0.5, 3), (0.5, 0.1, 4)])
def test_theorem_3_3_and_3_4_against_simulation(eta_tp: float, eta_fp: float, r: int):
    runs = simulate_run_lengths(20_000, eta_tp, eta_fp, r)
    top = 40
    observed = np.bincount(np.minimum(runs, top), minlength=top + 1)
    pmf = np.array([theory.run_length_pmf(i, eta_tp, eta_fp, r) for i in range(top)])
    expected = np.append(pmf, 1 - pmf.sum())
    assert pooled_chisquare(observed, expected) > ALPHA
    mean = theory.expected_run_length(eta_tp, eta_fp, r)
    z = (runs.mean() - mean) / (runs.std() / math.sqrt(len(runs)))
    assert 2 * norm.sf(abs(z)) > ALPHA, (runs.mean(), mean)
    # Theorem 3.4: T_stop = t_d (N + 1)
    t_d = 0.1
    assert theory.expected_stopping_time(eta_tp, eta_fp, r, t_d) == pytest.approx(t_d * (mean + 1))
    assert abs(t_d * (runs + 1).mean() - theory.expected_stopping_time(eta_tp, eta_fp, r, t_d)) < 4 * t_d * runs.std() / math.sqrt(len(runs))
    # the pmf sums to one
    assert sum(theory.run_length_pmf(i, eta_tp, eta_fp, r) for i in range(400)) == pytest.approx(1.0)


def test_theory_limits_and_flops():
    assert theory.expected_run_length(1.0, 0.0, 5) == pytest.approx(5.0)  # perfect verifier: exactly r
    assert theory.expected_stopping_time(1.0, 0.0, 5, 0.1) == pytest.approx(0.6)
    from transformers import LlamaConfig

    shape = theory.ModelShape.from_config(LlamaConfig(vocab_size=100, hidden_size=8, intermediate_size=16,
                                                      num_hidden_layers=2, num_attention_heads=2,
                                                      num_key_value_heads=1))
    # embed 2*100*8 + 2 layers * (qkv 2*8*(8+2*1*4) + attn 2*1*8*2 + 3*2*1 + out 2*8*8 + mlp 2*3*8*16) + logits 2*8*100
    expected = 1600 + 2 * (256 + 32 + 6 + 128 + 768) + 1600
    assert theory.forward_flops(shape, context=0) == expected
    assert theory.sd_flops(4, 1.0, 10.0) == 44.0 and theory.sprinter_flops(4, 1.0, 0.01, 10.0) == pytest.approx(14.04)


# ----------------------------------------------------------------------------- the verifier and decoding


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from draftwise.models.loading import load_model
    from draftwise.training.verifier import VerifierDataConfig, VerifierTrainConfig, collect, spec_base, train

    target, draft = load_model(tiny_llama(0, init=0.08)), load_model(tiny_llama(1, layers=1, init=0.08))
    config = VerifierDataConfig(continuation=12, per_kind=6)
    prompts = [[i, i + 1, i + 2, 5, 6, 7] for i in range(40)]
    data = collect(target, draft, prompts, config, vocab_size=64)
    verifier, report = train(data, VerifierTrainConfig(lam=1.2, features=("hidden", "stats")),
                             spec_base(draft, "tiny-draft", config))
    path = tmp_path_factory.mktemp("verifier") / "verifier.pt"
    verifier.save(path)
    return target, draft, data, report, path


def test_training_data_labels_and_kinds(trained):
    from draftwise.training.verifier import labels, split_by_prompt

    target, draft, data, report, _ = trained
    # labels recomputed independently: q(x) / p(x) <= lambda, with p(x) = 0 never acceptable
    ratio = data["q_x"] / data["p_x"]
    for lam in (1.0, 1.2, 1.5):
        independent = torch.where(data["p_x"] > 0, (ratio <= lam).double(), torch.zeros_like(ratio)).float()
        assert torch.equal(labels(data, lam), independent)
    counts = torch.bincount(data["kind"], minlength=4)
    assert (counts > 0).all() and counts.max() <= 2 * counts.min()  # the four kinds in (near) equal proportion
    splits = split_by_prompt(data["prompt"])
    sets = {k: set(data["prompt"][m].tolist()) for k, m in splits.items()}
    assert not (sets["train"] & sets["val"]) and not (sets["train"] & sets["test"]) and not (sets["val"] & sets["test"])
    assert sum(int(m.sum()) for m in splits.values()) == len(data["prompt"])
    assert 0.0 <= report["roc_auc_test"] <= 1.0 and report["examples"]["test"] > 0


def test_roc_auc_matches_mann_whitney():
    from draftwise.training.verifier import roc_auc

    g = torch.Generator().manual_seed(0)
    truth = (torch.rand(300, generator=g) < 0.4).float()
    scores = torch.round(truth * 0.3 + torch.rand(300, generator=g), decimals=1)  # with ties
    pos, neg = scores[truth == 1], scores[truth == 0]
    pairs = (pos[:, None] > neg[None, :]).double() + 0.5 * (pos[:, None] == neg[None, :]).double()
    assert roc_auc(scores, truth) == pytest.approx(float(pairs.mean()), abs=1e-12)


def test_verifier_file_refuses_another_draft_and_other_sampling(trained):
    from draftwise.engine.sampling import SamplingConfig

    target, draft, _, _, path = trained
    verifier = Verifier.load(path, draft.model)
    with pytest.raises(DraftwiseError, match="another draft model"):
        Verifier.load(path, tiny_llama(7, layers=1, init=0.08))
    with pytest.raises(DraftwiseError, match="temperature=1.0"):
        verifier.check_sampling(SamplingConfig(temperature=0.0))
    # a file written before fingerprints were rounded to bf16 still loads with its draft, and only with it
    from dataclasses import replace

    from draftwise.heads.sprinter import draft_fingerprint

    legacy = path.parent / "legacy.pt"
    Verifier(replace(verifier.spec, draft_fingerprint=draft_fingerprint(draft.model, legacy=True))).save(legacy)
    assert draft_fingerprint(draft.model, legacy=True) != draft_fingerprint(draft.model)
    Verifier.load(legacy, draft.model)
    with pytest.raises(DraftwiseError, match="another draft model"):
        Verifier.load(legacy, tiny_llama(7, layers=1, init=0.08))
    with pytest.raises(DraftwiseError, match="not a draftwise SPRINTER verifier"):
        bad = path.parent / "bad.pt"
        bad.write_bytes(b"garbage")
        Verifier.load(bad)
    with pytest.raises(DraftwiseError, match="needs verifier=PATH"):
        draftwise.generate(target=target.model, draft=draft.model, prompt=[1, 2], method="sprinter")
    with pytest.raises(DraftwiseError, match="temperature=1.0"):  # at the call, before the first piece
        draftwise.stream(target=target.model, draft=draft.model, prompt=[1, 2], method="sprinter",
                         verifier=str(path), temperature=0)


def test_sprinter_calls_the_target_only_on_rejections(trained):
    target, draft, _, _, path = trained
    for tau in (0.3, 0.5, 0.7):
        g = draftwise.generate(target=target.model, draft=draft.model, prompt=[1, 2, 3], method="sprinter",
                               verifier=str(path), tau=tau, max_run=8, max_new_tokens=40, seed=1, ignore_eos=True,
                               temperature=1.0)
        s = g.stats
        assert s["verifier_calls"] == s["drafted"] == s["draft_calls"]
        rejections = s["drafted"] - s["verifier_accepted"]
        assert s["target_calls"] == s["steps"]  # one target call per run, nothing else
        full_runs = s["drafted_per_position"][7]  # runs that reached max_run
        assert rejections + full_runs >= s["target_calls"] - 1  # each call ends a run (the last may hit the budget)
        assert s["accepted"] >= s["verifier_accepted"] and len(g.token_ids) == 40


def test_tau_one_is_sd_with_gamma_one_and_tau_zero_never_checks(trained):
    target, draft, _, _, path = trained
    for prompt in ([1, 2, 3], [9, 8, 7, 6]):
        common = dict(target=target.model, draft=draft.model, prompt=prompt, max_new_tokens=30, seed=4,
                      temperature=1.0, ignore_eos=True)
        # tau = 1: the verifier (a sigmoid) never reaches it, every run is one token checked by the target
        sprinter = draftwise.generate(method="sprinter", verifier=str(path), tau=1.0, **common)
        # SPRINTER's target check is rejection sampling: sd under the same coupling, keyed alike
        assert sprinter.token_ids == draftwise.generate(method="sd", gamma=1, coupling="rejection", **common).token_ids
        # tau = 0: every token passes; the target only runs every max_run tokens
        free = draftwise.generate(method="sprinter", verifier=str(path), tau=0.0, max_run=5, **common)
        assert free.stats["target_calls"] == math.ceil(30 / 6) and free.stats["verifier_accepted"] == free.stats["drafted"]


def test_cli_train_verifier_and_theory(tmp_path, capsys):
    from conftest import save_pair

    from draftwise.cli import main

    save_pair(tmp_path, window=4096, init=0.08)
    out = tmp_path / "v.pt"
    args = ["train-verifier", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
            "--num-prompts", "24", "--continuation", "8", "--per-kind", "4", "--features", "hidden,stats",
            "--out", str(out), "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "roc.png"),
            "--data", str(tmp_path / "data.pt"), "--dtype", "fp32"]
    assert main(args) == 0
    assert out.exists() and (tmp_path / "roc.png").stat().st_size > 5000 and (tmp_path / "data.pt").exists()
    printed = capsys.readouterr().out
    assert printed.count("ROC-AUC") == 3  # lambdas 1, 1.2, 1.5
    assert main(args) == 0  # the second run reuses the cached examples
    assert "collect" not in capsys.readouterr().err
    assert main(["theory", "sprinter", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                 "--verifier", str(out), "--tv", "0.4", "--gamma", "10"]) == 0
    printed = capsys.readouterr().out
    assert '"acceptance_rate": 0.72' in printed and '"sd_over_sprinter"' in printed
    assert main(["theory", "sprinter", "--eta-fp", "1.5"]) == 2


def test_adaedl_and_specdecpp_are_lossless_and_stop_early(trained, tmp_path):
    from draftwise.training.verifier import VerifierDataConfig, VerifierTrainConfig, collect, spec_base, train

    target, draft, data, _, _ = trained
    ar = draftwise.generate(target=target.model, prompt=[1, 2, 3], method="ar", temperature=0, max_new_tokens=30,
                            ignore_eos=True).token_ids
    common = dict(target=target.model, draft=draft.model, prompt=[1, 2, 3], temperature=0, max_new_tokens=30,
                  ignore_eos=True, gamma=6)
    # AdaEDL: exact at temperature 0; a bound that never passes drafts nothing, one that always passes drafts gamma
    for threshold, drafted in ((2.0, 0), (-1.0, None)):
        g = draftwise.generate(method="adaedl", scale=0.4, threshold=threshold, **common)
        assert g.token_ids == ar
        if drafted == 0:
            assert g.stats["drafted"] == 0 and g.stats["target_calls"] == 30
        else:
            assert max(i for i, n in enumerate(g.stats["drafted_per_position"]) if n) == 5
    # SpecDec++: a head trained on min(1, p/q) (greedy labels for temperature 0)
    config = VerifierDataConfig(continuation=8, per_kind=6, temperature=0.0)
    greedy = collect(target, draft, [[i, i + 1, i + 2, 5] for i in range(60)], config, vocab_size=64)
    head, report = train(greedy, VerifierTrainConfig(lam=1.0, objective="acceptance", features=("stats",)),
                         spec_base(draft, "tiny", config))
    assert report["objective"] == "acceptance"
    path = tmp_path / "head.pt"
    head.save(path)
    for threshold in (0.0, 0.5, 1.0):
        g = draftwise.generate(method="specdec++", head=str(path), threshold=threshold, **common)
        assert g.token_ids == ar  # lossless
        if threshold == 0.0:  # any rejection risk stops the draft after one token
            assert g.stats["drafted_per_position"][1] == 0
        if threshold == 1.0:  # never stops early
            assert g.stats["drafted_per_position"][5] > 0
