"""The Python API: stats, budgets, EOS, stop strings, streaming, bad input, model loading."""

from __future__ import annotations

import time

import pytest
import torch

import draftwise
from conftest import tiny_gpt2, tiny_llama, tiny_tokenizer
from draftwise import DraftwiseError, ModelNotAvailableError, generate, load_model, stream



PROMPT = [3, 17, 42, 8, 25]
REPETITIVE = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def target():
    return tiny_llama(0)


@pytest.fixture(scope="module")
def draft():
    return tiny_llama(1, layers=1)


@pytest.fixture(scope="module")
def text_target(tok):
    """A tiny Llama with the tiny tokenizer (end-of-sequence '</s>' = id 0)."""
    return load_model(tiny_llama(0), tokenizer=tok)


# ---------------------------------------------------------------- stats

STAT_KEYS = {
    "method", "new_tokens", "target_calls", "draft_calls", "target_tokens", "steps", "drafted", "accepted",
    "accepted_per_position", "drafted_per_position", "prompt_tokens", "finish_reason", "seed", "wall_time_s",
}


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("use_self_draft", [False, True])
def test_sd_stats_are_present_and_consistent(target, draft, gamma, use_self_draft):
    result = generate(
        target, PROMPT, draft=target if use_self_draft else draft, method="sd", gamma=gamma, temperature=1.0,
        seed=0, max_new_tokens=17,
    )
    s = result.stats
    assert STAT_KEYS <= set(s)
    assert s["method"] == "sd"
    assert s["finish_reason"] == "length"
    assert s["seed"] == 0
    assert s["prompt_tokens"] == len(PROMPT)
    assert s["new_tokens"] == len(result.token_ids) == 17
    assert len(s["accepted_per_position"]) == len(s["drafted_per_position"]) == gamma
    assert sum(s["accepted_per_position"]) == s["accepted"]
    assert sum(s["drafted_per_position"]) == s["drafted"]
    # accepted tokens are a prefix of the draft: per-position counts never increase
    assert all(a >= b for a, b in zip(s["accepted_per_position"], s["accepted_per_position"][1:]))
    assert all(a <= d for a, d in zip(s["accepted_per_position"], s["drafted_per_position"]))
    assert 0 <= s["accepted"] <= s["drafted"]
    # one target call per step; each step commits its accepted tokens + one recovered/bonus token
    assert s["target_calls"] == s["steps"]
    assert s["new_tokens"] == s["accepted"] + s["steps"]
    # the draft model runs once per drafted token
    assert s["draft_calls"] == s["drafted"]
    # the target reads the prompt once, then per step the newest token and the drafts
    assert s["target_tokens"] == len(PROMPT) + (s["steps"] - 1) + s["drafted"]
    assert isinstance(s["wall_time_s"], float) and s["wall_time_s"] > 0
    assert result.mean_accepted_length == pytest.approx(s["new_tokens"] / s["target_calls"])
    assert result.acceptance_rate == pytest.approx(s["accepted"] / s["drafted"])
    if use_self_draft:
        assert s["accepted"] == s["drafted"]
        assert result.mean_accepted_length > 1.0
    d = result.to_dict()
    assert set(d) == {"text", "token_ids", "stats", "rates"}
    assert d["rates"]["mean_accepted_length"] == result.mean_accepted_length


def test_ar_stats(target):
    result = generate(target, PROMPT, method="ar", temperature=0, max_new_tokens=9, gamma=6)
    s = result.stats
    assert STAT_KEYS <= set(s)
    assert s["new_tokens"] == s["target_calls"] == s["steps"] == 9
    assert s["draft_calls"] == s["drafted"] == s["accepted"] == 0
    assert s["accepted_per_position"] == [] and s["drafted_per_position"] == []  # ar ignores gamma
    assert result.mean_accepted_length == 1.0
    assert result.acceptance_rate == 0.0
    assert result.text == ""  # no tokenizer: token ids only


def test_prompt_lookup_stats(target):
    result = generate(target, REPETITIVE, method="prompt-lookup", temperature=0, max_new_tokens=12, gamma=3)
    s = result.stats
    assert s["draft_calls"] == 0  # no draft model
    assert s["drafted"] > 0
    assert len(s["accepted_per_position"]) == 3
    assert sum(s["accepted_per_position"]) == s["accepted"]
    assert s["target_calls"] == s["steps"]
    assert s["new_tokens"] == s["accepted"] + s["steps"] == len(result.token_ids)


# ---------------------------------------------------------------- token budget

@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 8])
@pytest.mark.parametrize("gamma", [1, 4, 7])
def test_max_new_tokens_is_never_overshot(target, draft, max_new_tokens, gamma):
    # self-drafting accepts everything: the case where a step could commit gamma + 1 > budget tokens
    for kwargs in (
        dict(draft=target, method="sd", temperature=1.0, seed=1),
        dict(draft=target, method="sd", temperature=0),
        dict(draft=draft, method="sd", temperature=1.0, seed=1),
        dict(method="prompt-lookup", temperature=0),
        dict(method="ar", temperature=1.0, seed=1),
    ):
        prompt = REPETITIVE if kwargs["method"] == "prompt-lookup" else PROMPT
        result = generate(target, prompt, max_new_tokens=max_new_tokens, gamma=gamma, **kwargs)
        assert len(result.token_ids) == max_new_tokens, kwargs
        assert result.stats["new_tokens"] == max_new_tokens
        assert result.stats["finish_reason"] == "length"


def test_budget_is_capped_by_the_context_window():
    """GPT-2 has learned positions (it crashes past n_positions): the budget must stop at the window."""
    model = tiny_gpt2(0, window=16)
    prompt = list(range(1, 14))  # 13 tokens, 3 positions left
    for kwargs in (dict(method="ar"), dict(method="sd", draft=model, gamma=4), dict(method="prompt-lookup")):
        result = generate(model, prompt, max_new_tokens=10, temperature=0, **kwargs)
        assert len(result.token_ids) == 3, kwargs
        assert result.stats["finish_reason"] == "context"  # the window, not max_new_tokens, ended it
    assert len(generate(model, list(range(1, 16)), method="ar", max_new_tokens=10).token_ids) == 1


# ---------------------------------------------------------------- end of sequence

def _first_new_token_at(tokens: list[int], min_index: int = 2) -> int:
    """Index of the first token that does not occur earlier in `tokens`, at or after `min_index`."""
    for i in range(min_index, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError(f"no fresh token in {tokens}")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_ends_generation_exactly(temperature):
    plain = tiny_llama(0)
    n = 14
    for method, draft_of in (("ar", None), ("sd", "self"), ("sd", "other"), ("prompt-lookup", None)):
        def kwargs(model):
            draft = {None: None, "self": model, "other": tiny_llama(1, layers=1)}[draft_of]
            return dict(draft=draft, method=method, temperature=temperature, seed=3, gamma=4, max_new_tokens=n)

        prompt = REPETITIVE if method == "prompt-lookup" else PROMPT
        full = generate(plain, prompt, **kwargs(plain)).token_ids
        assert len(full) == n
        j = _first_new_token_at(full)
        eos = full[j]

        with_eos = tiny_llama(0, eos=eos)  # same seed, same weights; only the config's eos differs
        assert torch.equal(with_eos.lm_head.weight, plain.lm_head.weight)
        result = generate(with_eos, prompt, **kwargs(with_eos))
        assert result.token_ids == full[: j + 1], (method, draft_of)
        assert result.token_ids[-1] == eos
        assert result.stats["finish_reason"] == "eos"
        assert result.stats["new_tokens"] == j + 1

        ignored = generate(with_eos, prompt, ignore_eos=True, **kwargs(with_eos))
        assert ignored.token_ids == full, (method, draft_of)
        assert ignored.stats["finish_reason"] == "length"


def test_loaded_model_eos_token_ids_are_respected():
    """`LoadedModel.eos_token_ids` is a public field, but `load_model` (called by `generate` on every
    spec) overwrites it with ids read from the config/tokenizer, so ids set by the caller are dropped."""
    model = tiny_llama(0)
    full = generate(model, PROMPT, method="ar", temperature=0, max_new_tokens=10).token_ids
    j = _first_new_token_at(full)
    loaded = draftwise.LoadedModel(model=model, eos_token_ids=frozenset({full[j]}))
    result = generate(loaded, PROMPT, method="ar", temperature=0, max_new_tokens=10)
    assert loaded.eos_token_ids == frozenset({full[j]}), "generate() rewrote the caller's eos_token_ids"
    assert result.token_ids == full[: j + 1]
    assert result.stats["finish_reason"] == "eos"


def test_eos_from_tokenizer_is_dropped_from_text(tok):
    """The tokenizer's '</s>' (id 0) ends generation; the text skips it."""
    model = load_model(tiny_llama(0), tokenizer=tok)
    assert 0 in model.eos_token_ids
    for seed in range(20):
        full = generate(model, "the cat", method="ar", temperature=1.0, seed=seed, max_new_tokens=24, ignore_eos=True)
        if 0 in full.token_ids[1:]:
            break
    else:
        pytest.skip("no end-of-sequence token sampled in 20 tries")
    cut = full.token_ids.index(0)
    result = generate(model, "the cat", method="ar", temperature=1.0, seed=seed, max_new_tokens=24)
    assert result.token_ids == full.token_ids[: cut + 1]
    assert result.stats["finish_reason"] == "eos"
    assert "</s>" not in result.text
    assert result.text == tok.decode(full.token_ids[:cut], skip_special_tokens=True)


# ---------------------------------------------------------------- stop strings

def _pick_stop(text: str, length: int = 2, min_index: int = 2) -> str | None:
    """A substring whose first occurrence is at or after `min_index`, without partial-character bytes."""
    for i in range(min_index, len(text) - length + 1):
        s = text[i : i + length]
        if "\ufffd" not in s and s.strip() == s and text.find(s) == i:
            return s
    return None


def _stops_for(model, kwargs):
    """A prompt, its full text and two stop strings, the second first occurring after the first.

    The tiny model's text depends on the CPU's arithmetic, so the test looks for a prompt whose text has two
    usable stop strings rather than trusting one prompt.
    """
    for prompt in ["the cat", "the mat", "a dog", "on the", "sat cat", "the dog sat", "a mat", "cat on"]:
        full = generate(model, prompt, **kwargs)
        stop = _pick_stop(full.text)
        if stop is None:
            continue
        later = _pick_stop(full.text, min_index=full.text.find(stop) + 3)
        if later is not None:
            return prompt, full, stop, later
    raise AssertionError("no prompt gave a text with two usable stop strings")


@pytest.mark.parametrize("method", ["ar", "sd"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_string_cuts_text_before_it(text_target, draft, method, temperature):
    kwargs = dict(
        method=method, draft=draft if method == "sd" else None, temperature=temperature, seed=11, gamma=3,
        max_new_tokens=24, ignore_eos=True,
    )
    prompt, full, stop, later = _stops_for(text_target, kwargs)
    assert full.stats["finish_reason"] == "length"
    result = generate(text_target, prompt, stop=stop, **kwargs)
    assert result.text == full.text[: full.text.find(stop)]
    assert stop not in result.text
    assert result.stats["finish_reason"] == "stop"
    # generation stopped at the token that completed the stop string
    assert result.token_ids == full.token_ids[: len(result.token_ids)]
    assert len(result.token_ids) < len(full.token_ids)
    assert stop in text_target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    assert stop not in text_target.tokenizer.decode(result.token_ids[:-1], skip_special_tokens=True)

    # several stop strings: the earliest match wins; a never-matching one changes nothing
    several = generate(text_target, prompt, stop=[later, "zzzz", stop], **kwargs)
    assert several.text == result.text
    assert generate(text_target, prompt, stop="zzzz", **kwargs).text == full.text

    # streaming with a stop string yields exactly the cut text
    assert "".join(stream(text_target, prompt, stop=stop, **kwargs)) == result.text


# ---------------------------------------------------------------- streaming

@pytest.mark.parametrize("method", ["ar", "sd", "prompt-lookup"])
def test_stream_joins_to_generate_text(text_target, draft, method):
    kwargs = dict(
        method=method, draft=draft if method == "sd" else None, temperature=1.0, seed=5, max_new_tokens=20,
        ignore_eos=True,
    )
    pieces = list(stream(text_target, "the cat sat on the mat", **kwargs))
    result = generate(text_target, "the cat sat on the mat", **kwargs)
    assert len(pieces) > 1  # it really streams
    assert all(pieces)
    assert "".join(pieces) == result.text
    assert result.text  # non-trivial


def test_stream_can_be_abandoned(text_target):
    it = stream(text_target, "the cat", method="ar", temperature=1.0, seed=5, max_new_tokens=50, ignore_eos=True)
    first = next(it)
    assert isinstance(first, str)
    it.close()  # no error; the next request is unaffected
    again = generate(text_target, "the cat", method="ar", temperature=1.0, seed=5, max_new_tokens=50, ignore_eos=True)
    assert again.text.startswith(first)


# ---------------------------------------------------------------- bad input, caught before any model runs

class ModelRan(AssertionError):
    pass


def _exploding(model):
    def boom(*args, **kwargs):
        raise ModelRan("a model ran before the input was validated")

    model.forward = boom  # nn.Module.__call__ looks the attribute up on the instance
    model.base_model.forward = boom  # the runner calls the base model and applies the LM head itself
    model.config.hidden_act = "exploding"  # the fast forward refuses an unknown activation: the generic path runs
    return model


@pytest.fixture(scope="module")
def bomb(tok):
    """Exploding target (vocab 64, window 32) with a tokenizer, plus exploding drafts."""
    target = load_model(_exploding(tiny_llama(0, window=32)), tokenizer=tok)
    return {
        "target": target,
        "bare_target": _exploding(tiny_llama(0, window=32)),
        "draft": _exploding(tiny_llama(1, layers=1)),
        "draft80": _exploding(tiny_llama(2, layers=1, vocab=80)),
        "draft48": _exploding(tiny_llama(2, layers=1, vocab=48)),
        "short_draft": _exploding(tiny_llama(3, layers=1, window=8)),
    }


def test_exploding_model_really_explodes(bomb):
    with pytest.raises(ModelRan):
        generate(bomb["target"], "the cat", method="ar", max_new_tokens=2)


BAD_INPUTS = [
    # (id, target key, prompt, kwargs, message pattern)
    ("unknown-method", "target", "the cat", dict(method="nope"), r"unknown method 'nope'.*sd"),
    ("unknown-option", "target", "the cat", dict(method="ar", alpha=0.1), r"'ar' has no option 'alpha'"),
    ("unknown-option-sd", "target", "the cat", dict(method="sd", draft="draft", max_ngram=2), r"no option 'max_ngram'"),
    ("option-type", "target", "the cat", dict(method="lossy", draft="draft", alpha="lots"), r"'alpha'.*float"),
    ("temperature<0", "target", "the cat", dict(method="ar", temperature=-0.5), r"temperature must be >= 0"),
    ("top_p=0", "target", "the cat", dict(method="ar", top_p=0.0), r"top_p must be in \(0, 1\]"),
    ("top_p=1.5", "target", "the cat", dict(method="ar", top_p=1.5), r"top_p must be in \(0, 1\]"),
    ("top_k<0", "target", "the cat", dict(method="ar", top_k=-1), r"top_k"),
    ("gamma=0", "target", "the cat", dict(method="sd", draft="draft", gamma=0), r"gamma .* \[1, 32\], got 0"),
    ("gamma-float", "target", "the cat", dict(method="sd", draft="draft", gamma=2.5), r"gamma"),
    ("max_new_tokens=0", "target", "the cat", dict(method="ar", max_new_tokens=0), r"max_new_tokens"),
    ("seed<0", "target", "the cat", dict(method="ar", seed=-1), r"seed"),
    ("empty-stop", "target", "the cat", dict(method="ar", stop=""), r"stop"),
    ("empty-prompt-str", "target", "", dict(method="ar"), r"prompt is empty"),
    ("empty-prompt-list", "target", [], dict(method="ar"), r"prompt is empty"),
    ("empty-prompt-tensor", "bare_target", torch.tensor([], dtype=torch.long), dict(method="ar"), r"prompt is empty"),
    ("prompt-too-long", "bare_target", list(range(1, 33)), dict(method="ar"), r"32 tokens .* context window is 32"),
    ("prompt-too-long-text", "target", "the cat sat on the mat " * 4, dict(method="ar"), r"context window is 32"),
    ("prompt-too-long-for-draft", "bare_target", list(range(1, 9)), dict(method="sd", draft="short_draft"),
     r"context window is 8"),
    ("prompt-id-out-of-range", "bare_target", [1, 64], dict(method="ar"), r"\[0, 64\).*64"),
    ("prompt-id-negative", "bare_target", [-1, 2], dict(method="ar"), r"\[0, 64\)"),
    ("text-without-tokenizer", "bare_target", "the cat", dict(method="ar"), r"needs a tokenizer"),
    ("stop-without-tokenizer", "bare_target", [1, 2], dict(method="ar", stop="x"), r"stop strings need a tokenizer"),
    ("draft-vocab", "bare_target", [1, 2], dict(method="sd", draft="draft80"), r"80.*64"),
    ("draft-vocab-below-tokenizer", "target", "the cat", dict(method="sd", draft="draft48"), r"48.*64"),
    ("sd-without-draft", "target", "the cat", dict(method="sd"), r"'sd' needs a draft model"),
    ("lossy-without-draft", "target", "the cat", dict(method="lossy"), r"needs a draft model"),
    ("lossy-greedy-t1", "target", "the cat", dict(method="lossy-greedy", draft="draft", temperature=1.0),
     r"greedy decoding only.*temperature=0"),
    ("lossy-alpha=1", "target", "the cat", dict(method="lossy", draft="draft", alpha=1.0), r"alpha must be in \[0, 1\)"),
    ("lossy-alpha=1.5", "target", "the cat", dict(method="lossy", draft="draft", alpha=1.5), r"alpha"),
    ("lossy-alpha<0", "target", "the cat", dict(method="lossy", draft="draft", alpha=-0.1), r"alpha"),
    ("lossy-beta", "target", "the cat", dict(method="lossy", draft="draft", alpha=0.2, beta=0.5), r"beta"),
    ("lossy-greedy-alpha", "target", "the cat",
     dict(method="lossy-greedy", draft="draft", temperature=0, alpha=1.5), r"alpha"),
    ("min_ngram=0", "target", "the cat", dict(method="prompt-lookup", min_ngram=0), r"min_ngram"),
    ("max<min_ngram", "target", "the cat", dict(method="prompt-lookup", max_ngram=1, min_ngram=2), r"max_ngram"),
]


@pytest.mark.parametrize("api", ["generate", "stream"])
@pytest.mark.parametrize(
    "target_key, prompt, kwargs, pattern", [case[1:] for case in BAD_INPUTS], ids=[case[0] for case in BAD_INPUTS]
)
def test_bad_input_fails_before_any_model_runs(bomb, api, target_key, prompt, kwargs, pattern):
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("draft"), str):
        kwargs["draft"] = bomb[kwargs["draft"]]
    with pytest.raises(DraftwiseError, match=pattern):
        if api == "generate":
            generate(bomb[target_key], prompt, **kwargs)
        else:
            list(stream(bomb[target_key], prompt, **kwargs))


# Values of the right type that the checks let through; each then crashes (or silently
# misbehaves) only after a model has run, with a RuntimeError/ValueError, not DraftwiseError.
UNCHECKED_VALUES = [
    ("temperature-nan", dict(method="ar", temperature=float("nan")), r"temperature"),
    ("lossy-beta-nan", dict(method="lossy", draft="draft", beta=float("nan")), r"beta"),
    ("seed-too-large", dict(method="ar", seed=2**64), r"seed"),
]


@pytest.mark.parametrize(
    "kwargs, pattern", [case[1:] for case in UNCHECKED_VALUES], ids=[case[0] for case in UNCHECKED_VALUES]
)
def test_non_finite_and_out_of_range_values_fail_before_any_model_runs(bomb, kwargs, pattern):
    kwargs = dict(kwargs)
    if isinstance(kwargs.get("draft"), str):
        kwargs["draft"] = bomb[kwargs["draft"]]
    with pytest.raises(DraftwiseError, match=pattern):
        generate(bomb["target"], "the cat", **kwargs)


def test_bad_model_spec_fails_clearly():
    with pytest.raises(DraftwiseError, match="cannot load a model from int"):
        generate(42, [1, 2], method="ar")
    with pytest.raises(DraftwiseError, match="unknown dtype"):
        load_model(tiny_llama(0), dtype="fp8-please")
    if not torch.cuda.is_available():
        with pytest.raises(DraftwiseError, match="CUDA is not available"):
            load_model(tiny_llama(0), device="cuda")


# ---------------------------------------------------------------- padded vocabularies

def test_padded_draft_vocabulary_is_tolerated(text_target, tok):
    assert len(tok) == 64 and text_target.vocab_size == 64
    padded_draft = tiny_llama(1, layers=1, vocab=72)
    for temperature in (0.0, 1.0):
        result = generate(
            text_target, "the cat", draft=padded_draft, method="sd", temperature=temperature, seed=2,
            max_new_tokens=16, ignore_eos=True,
        )
        assert len(result.token_ids) == 16
        assert all(0 <= t < 64 for t in result.token_ids)
    greedy = generate(text_target, "the cat", method="ar", temperature=0, max_new_tokens=16, ignore_eos=True)
    result = generate(
        text_target, "the cat", draft=padded_draft, method="sd", temperature=0, max_new_tokens=16, ignore_eos=True,
    )
    assert result.token_ids == greedy.token_ids  # still exact


def test_padded_target_vocabulary_is_tolerated(tok):
    padded_target = load_model(tiny_llama(0, vocab=72), tokenizer=tok)
    result = generate(
        padded_target, "the cat", draft=tiny_llama(1, layers=1), method="sd", temperature=1.0, seed=2,
        max_new_tokens=16, ignore_eos=True,
    )
    assert len(result.token_ids) == 16
    assert all(0 <= t < 64 for t in result.token_ids)


def test_padded_target_lossless_methods_agree_with_ar(tok):
    """A padded target (72 rows, 64-token tokenizer): `sd` cuts the target's logits to 64 columns
    (`_shared_vocab`), `ar` and `prompt-lookup` do not, so at temperature 0 the "lossless" sd
    output differs from ar's on the same target, and ar emits ids the tokenizer does not have."""
    padded_target = load_model(tiny_llama(0, vocab=72), tokenizer=tok)
    kwargs = dict(temperature=0, max_new_tokens=16, ignore_eos=True)
    ar = generate(padded_target, "the cat", method="ar", **kwargs)
    lookup = generate(padded_target, "the cat", method="prompt-lookup", **kwargs)
    sd = generate(padded_target, "the cat", method="sd", draft=tiny_llama(1, layers=1), **kwargs)
    assert all(t < len(tok) for t in ar.token_ids), f"ar emitted padding ids: {ar.token_ids}"
    assert sd.token_ids == ar.token_ids == lookup.token_ids


# ---------------------------------------------------------------- load_model

def test_hub_id_offline_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache: nothing to find locally
    monkeypatch.chdir(tmp_path)  # 'someorg/somemodel' is not a local path here
    start = time.perf_counter()
    with pytest.raises(ModelNotAvailableError) as info:
        load_model("someorg/somemodel")
    assert time.perf_counter() - start < 5.0
    message = str(info.value)
    assert "someorg/somemodel" in message
    assert "Offline alternatives" in message
    assert "local Hugging Face directory" in message and ".gguf" in message
    assert isinstance(info.value, DraftwiseError)
    # the API raises the same, before any model runs
    with pytest.raises(ModelNotAvailableError):
        generate("someorg/somemodel", "hello", method="ar")


def test_load_missing_path_fails_clearly(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(DraftwiseError, match="no-such-model.*not a local directory"):
        load_model(str(missing))
    with pytest.raises(DraftwiseError, match="not a local directory"):
        load_model("./relative/no-such-model")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DraftwiseError, match="no config.json"):
        load_model(empty)
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\0" * 16)
    with pytest.raises(DraftwiseError, match=r"\.gguf"):
        load_model(not_gguf)


def test_load_model_round_trip_from_directory(tmp_path, tok):
    model = tiny_llama(0, eos=0)
    path = tmp_path / "tiny"
    model.save_pretrained(path)
    tok.save_pretrained(path)

    loaded = load_model(str(path), dtype="fp32")
    assert load_model(str(path)).dtype == draftwise.models.loading.resolve_dtype("auto")  # the default: auto
    assert loaded.tokenizer is not None and len(loaded.tokenizer) == 64
    assert loaded.dtype == torch.float32
    assert loaded.device == torch.device("cpu")
    assert loaded.vocab_size == 64 and loaded.context_window == 256
    assert 0 in loaded.eos_token_ids
    assert not loaded.model.training
    for name, param in model.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], param), name

    kwargs = dict(method="ar", temperature=0, max_new_tokens=10, ignore_eos=True)
    original = generate(load_model(model, tokenizer=tok), "the cat", **kwargs)
    again = generate(loaded, "the cat", **kwargs)  # fp32, as the model was built
    assert again.token_ids == original.token_ids
    assert again.text == original.text
    by_path = generate(path, "the cat", **kwargs)  # a Path works as a spec too (dtype auto, as a name would)
    assert by_path.token_ids == generate(str(path), "the cat", **kwargs).token_ids

    bf16 = load_model(str(path), dtype="bf16")
    assert bf16.dtype == torch.bfloat16
