"""SPRINTER's data collection resumes (training/verifier.py `collect(parts=...)`): a run cut off after some prompts,
run again, gives the same examples as an uninterrupted run, tensor for tensor, collecting only the prompts it had
not finished; parts of another setting or prompt are refused with one line; `train-verifier --data` keeps them.
Its two speed-ups keep the examples: prompts decoded together, and the labelling forwards reading the prompt once."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import draftwise

from conftest import tiny_llama
from draftwise.engine.sampling import make_generator
from draftwise.errors import DraftwiseError
from draftwise.models.loading import load_model
from draftwise.training import verifier
from draftwise.training.verifier import VerifierDataConfig, collect

PROMPTS = [[i, i + 1, i + 2, 5, 6, 7] for i in range(5)]
META = {"target": "tiny-0", "draft": "tiny-1"}


class Cut(Exception):
    pass


@pytest.fixture(scope="module")
def pair():
    target = load_model(tiny_llama(0, init=0.08))
    draft = dataclasses.replace(load_model(tiny_llama(1, layers=1, init=0.08)), output_ids=torch.arange(48))
    return target, draft


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_run_cut_off_and_resumed_gives_the_uninterrupted_data(pair, tmp_path, monkeypatch, temperature):
    target, draft = pair
    config = VerifierDataConfig(continuation=8, per_kind=3, temperature=temperature)
    whole = collect(target, draft, PROMPTS, config, vocab_size=64)
    parts = tmp_path / "data.pt.parts"
    done = []

    def cut_after_two(n):
        done.append(n)
        if len(done) == 2:
            raise Cut

    with pytest.raises(Cut):
        collect(target, draft, PROMPTS, config, vocab_size=64, parts=parts, meta=META, progress=cut_after_two)
    assert sorted(p.name for p in parts.glob("*.pt")) == ["00000.pt", "00001.pt"]
    collected = []
    real = verifier._prompt_examples

    def counting(target, draft, index, *args):
        collected.append(index)
        return real(target, draft, index, *args)

    monkeypatch.setattr(verifier, "_prompt_examples", counting)
    timings: dict[str, float] = {}
    resumed = collect(target, draft, PROMPTS, config, vocab_size=64, parts=parts, meta=META, timings=timings)
    assert collected == [2, 3, 4]  # the two finished prompts were loaded, not collected again
    assert sorted(resumed) == sorted(whole)
    for key in whole:
        assert torch.equal(resumed[key], whole[key]), key
    assert timings["decode"] > 0 and timings["label"] > 0
    # a longer run over the same first prompts reuses every part; a run with every part done collects nothing
    collected.clear()
    again = collect(target, draft, PROMPTS[:3], config, vocab_size=64, parts=parts, meta=META)
    assert collected == [] and torch.equal(again["q_x"], whole["q_x"][whole["prompt"] < 3])


def test_control_restarting_without_the_generator_state_changes_the_data(pair, tmp_path, monkeypatch):
    """The parts keep the random generator's state after each prompt: a resume that skipped prompts without it
    would draw different prefixes and tokens for the later ones (so the test above can tell)."""
    target, draft = pair
    config = VerifierDataConfig(continuation=8, per_kind=3)
    whole = collect(target, draft, PROMPTS, config, vocab_size=64)
    parts = tmp_path / "p"
    collect(target, draft, PROMPTS[:2], config, vocab_size=64, parts=parts, meta=META)
    real = verifier._load_part
    fresh = make_generator(config.seed).get_state()  # the state a resume starts from when it does not restore one
    monkeypatch.setattr(verifier, "_load_part", lambda *a: (lambda part: part and {**part, "generator": fresh})(real(*a)))
    resumed = collect(target, draft, PROMPTS, config, vocab_size=64, parts=parts, meta=META)
    assert not torch.equal(resumed["q_x"], whole["q_x"])


def test_parts_of_another_setting_or_prompt_are_refused(pair, tmp_path):
    target, draft = pair
    config = VerifierDataConfig(continuation=8, per_kind=3)
    parts = tmp_path / "p"
    collect(target, draft, PROMPTS[:2], config, vocab_size=64, parts=parts, meta=META)
    with pytest.raises(DraftwiseError, match="other settings") as info:
        collect(target, draft, PROMPTS, dataclasses.replace(config, per_kind=4), vocab_size=64, parts=parts, meta=META)
    assert "\n" not in str(info.value)
    with pytest.raises(DraftwiseError, match="another prompt"):
        collect(target, draft, [[9, 9, 9, 9]] + PROMPTS, config, vocab_size=64, parts=parts, meta=META)
    (parts / "00001.pt").write_bytes(b"garbage")
    with pytest.raises(DraftwiseError, match="not a readable"):
        collect(target, draft, PROMPTS, config, vocab_size=64, parts=parts, meta=META)


def test_train_verifier_keeps_parts_and_a_rerun_collects_nothing(tmp_path, capsys, monkeypatch):
    from conftest import save_pair

    from draftwise.cli import main

    save_pair(tmp_path, window=4096, init=0.08)
    data = tmp_path / "data.pt"
    args = ["train-verifier", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
            "--num-prompts", "12", "--continuation", "8", "--per-kind", "4", "--out", str(tmp_path / "v.pt"),
            "--data", str(data), "--dtype", "fp32", "--lambdas", "1.2"]
    assert main(args) == 0
    assert "s decoding" in capsys.readouterr().err and len(list((tmp_path / "data.pt.parts").glob("*.pt"))) == 12
    first = torch.load(data, weights_only=True)
    data.unlink()  # as if the run was killed before it wrote the data file

    def refuse(*args):
        raise AssertionError("a finished prompt was collected again")

    monkeypatch.setattr(verifier, "_prompt_examples", refuse)
    assert main(args) == 0
    second = torch.load(data, weights_only=True)
    assert second["meta"] == first["meta"] and all(torch.equal(second["data"][k], first["data"][k])
                                                   for k in first["data"])


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_sharing_the_prompt_in_the_labelling_forwards_keeps_the_examples(pair, monkeypatch, temperature):
    """The labelling forwards feed the prompt once and each completion after a copy of its cache: the same
    prefixes and tokens (the embedding feature is the drafted token's, exactly equal) and the same features and
    probabilities up to float rounding, against one transformers forward per whole sequence."""
    target, draft = pair
    config = VerifierDataConfig(continuation=8, per_kind=3, temperature=temperature)
    shared = collect(target, draft, PROMPTS, config, vocab_size=64)
    monkeypatch.setattr(verifier, "SHARED_PREFIX", False)
    whole = collect(target, draft, PROMPTS, config, vocab_size=64)
    assert sorted(shared) == sorted(whole) and len(whole["q_x"]) == 3 * 4 * len(PROMPTS)
    for key in ("prompt", "kind", "embedding"):
        assert torch.equal(shared[key], whole[key]), key
    for key in ("hidden", "stats", "q_x", "p_x"):
        assert torch.allclose(shared[key].double(), whole[key].double(), atol=1e-4, rtol=1e-4), key
    assert not torch.equal(shared["hidden"], whole["hidden"])  # two computations, not one path run twice


def one_by_one(target, draft, prompts, indices, config, timings):
    """The completions as collect made them before prompts were decoded together: `generate` per prompt, with
    the seed of its index."""
    common = dict(max_new_tokens=config.continuation, temperature=config.temperature, top_k=config.top_k,
                  top_p=config.top_p, ignore_eos=True)
    out = []
    for ids, index in zip(prompts, indices):
        seed = config.seed * 100_003 + index
        out.append({"target": draftwise.generate(target, ids, method="ar", seed=seed, **common).token_ids,
                    "mixed": draftwise.generate(target, ids, draft=draft, method="sd", gamma=config.gamma, seed=seed,
                                                **common).token_ids,
                    "draft": draftwise.generate(draft, ids, method="ar", seed=seed, **common).token_ids})
    return out


def test_decoding_prompts_together_keeps_the_examples(pair, monkeypatch):
    """Prompts are decoded DECODE_BATCH at a time, each with its own seed: the examples equal those of prompts
    decoded one by one (`generate` alone per prompt), tensor for tensor, at T=1 and T=0."""
    target, draft = pair
    for temperature in (1.0, 0.0):
        config = VerifierDataConfig(continuation=8, per_kind=3, temperature=temperature)
        together = collect(target, draft, PROMPTS, config, vocab_size=64)
        monkeypatch.setattr(verifier, "_completions", one_by_one)
        alone = collect(target, draft, PROMPTS, config, vocab_size=64)
        monkeypatch.undo()
        for key in alone:
            assert torch.equal(together[key], alone[key]), (temperature, key)
