"""ModelRunner: the KV cache it owns survives trim-and-replay (row 0, fed through `forward_rows`), batched and single-token
forwards agree, counters count, and `trim` refuses lengths it cannot honour."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_gpt2, tiny_llama
from draftwise.models import ModelRunner


class Row0:
    """Row 0 of a runner fed through `forward_rows` (the only forward the package has), spelt one request at a time."""

    def __init__(self, model, **kwargs) -> None:
        self.runner = ModelRunner(model, **kwargs)

    @property
    def length(self) -> int:
        return self.runner.lengths[0]

    @property
    def calls(self) -> int:
        return self.runner.calls

    @property
    def tokens_processed(self) -> int:
        return self.runner.tokens_processed

    def reset(self) -> None:
        self.runner.reset()

    def forward(self, tokens, *, num_logits=None, hidden=False):
        ids = torch.as_tensor(tokens, dtype=torch.long).reshape(1, -1)
        n = ids.shape[1]
        if n == 0:
            raise ValueError("at least one token")
        num_logits = n if num_logits is None else num_logits
        at = torch.arange(n - num_logits, n)[None]
        out = self.runner.forward_rows(ids, [n], logits_at=at, hidden=hidden)
        return SimpleNamespace(logits=out.logits[0], hidden=out.hidden[0, n - num_logits:] if hidden else None)

    def prefill(self, tokens, *, hidden=False):
        return self.forward(tokens, num_logits=1, hidden=hidden)

    def trim(self, keep: int) -> None:
        self.runner.trim_row(0, keep)


PROMPT = [3, 17, 42, 8, 25, 11, 60]
STEPS = 12

MODELS = {
    "llama": lambda: tiny_llama(0),
    "gpt2": lambda: tiny_gpt2(0),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    return MODELS[request.param]()


def _greedy_steps(runner: Row0, first_logits: torch.Tensor, steps: int):
    """Decode greedily one token at a time; return the tokens and the logits that chose each next one."""
    tokens, logits = [], [first_logits]
    current = first_logits
    for _ in range(steps):
        token = int(current.argmax())
        tokens.append(token)
        current = runner.forward([token]).logits[-1]
        logits.append(current)
    return tokens, torch.stack(logits)


def _full_logits(model, ids):
    """Reference: one uncached forward over the whole sequence, fp32 logits [len, vocab]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def test_trim_and_replay_reproduces_generation(model):
    """mlx-lm's test_trim_cache_with_generate: trim to the prompt, replay, same tokens and logits."""
    runner = Row0(model)
    first = runner.prefill(PROMPT).logits[-1]
    tokens, logits = _greedy_steps(runner, first, STEPS)
    assert runner.length == len(PROMPT) + STEPS

    runner.trim(len(PROMPT))
    assert runner.length == len(PROMPT)
    replayed = [first]
    for token in tokens:
        replayed.append(runner.forward([token]).logits[-1])
    replayed = torch.stack(replayed)
    assert replayed[:-1].argmax(-1).tolist() == tokens
    assert torch.allclose(replayed, logits, atol=1e-5)

    # Trim into the middle of the generated tokens and decode greedily again from there.
    keep = len(PROMPT) + STEPS // 2
    runner.trim(keep)
    assert runner.length == keep
    again, again_logits = _greedy_steps(runner, logits[STEPS // 2], STEPS - STEPS // 2)
    assert again == tokens[STEPS // 2 :]
    assert torch.allclose(again_logits, logits[STEPS // 2 :], atol=1e-5)

    # And everything agrees with an uncached forward over the whole sequence.
    full = _full_logits(model, PROMPT + tokens)[len(PROMPT) - 1 :]
    assert torch.allclose(full, logits, atol=1e-4)


def test_trim_after_rejected_tokens_then_continue(model):
    """Feed junk (as rejected drafts would be), trim it away, continue: same as never having fed it."""
    clean = Row0(model)
    expect = clean.forward(PROMPT + [5, 6]).logits

    runner = Row0(model)
    runner.forward(PROMPT)
    runner.forward([9, 9, 9, 9])  # four "rejected" tokens
    runner.trim(len(PROMPT))
    got = runner.forward([5, 6]).logits
    assert torch.allclose(got, expect[-2:], atol=1e-4)


def test_multi_token_forward_matches_single_token_forwards(model):
    continuation = [7, 30, 2, 55, 19]
    batched = Row0(model)
    batched.prefill(PROMPT)
    many = batched.forward(continuation).logits  # [k, vocab]
    assert many.shape == (len(continuation), model.config.vocab_size)

    single = Row0(model)
    single.prefill(PROMPT)
    one_by_one = torch.cat([single.forward([t]).logits for t in continuation])
    assert many.dtype == torch.float32
    # Different kernels (a [k]-row matmul vs k one-row ones): fp32 rounding only. Logits are ~10 in
    # magnitude, so 1e-4 absolute is ~1e-5 relative; the argmax must agree exactly.
    assert torch.allclose(many, one_by_one, atol=1e-4)
    assert many.argmax(-1).tolist() == one_by_one.argmax(-1).tolist()
    assert batched.length == single.length == len(PROMPT) + len(continuation)

    # num_logits keeps the last rows only.
    last2 = Row0(model)
    last2.prefill(PROMPT)
    tail = last2.forward(continuation, num_logits=2).logits
    assert tail.shape == (2, model.config.vocab_size)
    assert torch.allclose(tail, many[-2:], atol=1e-4)


def test_counts_calls_and_tokens(model):
    runner = Row0(model)
    assert (runner.calls, runner.tokens_processed, runner.length) == (0, 0, 0)
    out = runner.prefill(PROMPT)
    assert out.logits.shape == (1, model.config.vocab_size)
    assert (runner.calls, runner.tokens_processed, runner.length) == (1, len(PROMPT), len(PROMPT))
    runner.forward([1, 2, 3])
    runner.forward(torch.tensor([4]))
    assert (runner.calls, runner.tokens_processed, runner.length) == (3, len(PROMPT) + 4, len(PROMPT) + 4)
    runner.trim(2)  # trimming is not a forward pass and does not uncount processed tokens
    assert (runner.calls, runner.tokens_processed, runner.length) == (3, len(PROMPT) + 4, 2)
    runner.reset()
    assert (runner.calls, runner.tokens_processed, runner.length) == (0, 0, 0)


def test_trim_rejects_invalid_lengths(model):
    runner = Row0(model)
    runner.forward(PROMPT)
    for bad in (-1, len(PROMPT) + 1, 10**6):
        with pytest.raises(ValueError, match="cannot trim"):
            runner.trim(bad)
    assert runner.length == len(PROMPT)  # a refused trim changes nothing
    runner.trim(len(PROMPT))  # no-op
    assert runner.length == len(PROMPT)
    runner.trim(0)
    assert runner.length == 0
    with pytest.raises(ValueError):
        runner.trim(1)
    # an emptied cache decodes like a fresh one
    again = runner.forward(PROMPT).logits
    assert torch.allclose(again, Row0(model).forward(PROMPT).logits, atol=1e-5)


def test_forward_rejects_empty_input(model):
    runner = Row0(model)
    with pytest.raises(ValueError):
        runner.forward([])
    assert (runner.calls, runner.length) == (0, 0)


def test_hidden_states_are_last_layer(model):
    runner = Row0(model)
    out = runner.forward(PROMPT, num_logits=3, hidden=True)
    hidden_size = model.config.hidden_size
    assert out.hidden is not None
    assert out.hidden.shape == (3, hidden_size)
    assert out.logits.shape == (3, model.config.vocab_size)
    # the last hidden states are what the LM head reads: head(hidden) == logits
    with torch.no_grad():
        assert torch.allclose(model.lm_head(out.hidden.clone()), out.logits, atol=1e-5)
    assert runner.forward([1], hidden=False).hidden is None
    prefill = Row0(model).prefill(PROMPT, hidden=True)
    assert prefill.hidden.shape == (1, hidden_size)
    assert torch.allclose(prefill.hidden, out.hidden[-1:], atol=1e-5)


def test_vocab_size_cuts_padded_logits():
    padded = tiny_llama(0, vocab=72)
    runner = Row0(padded, vocab_size=64)
    logits = runner.forward(PROMPT, num_logits=2).logits
    assert logits.shape == (2, 64)
    full = Row0(padded).forward(PROMPT, num_logits=2).logits
    assert full.shape == (2, 72)
    assert torch.equal(logits, full[:, :64])


def _mistral_window(seed: int):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=6, initializer_range=0.5, tie_word_embeddings=False)
    return MistralForCausalLM(config).eval()


@pytest.mark.parametrize("make", [lambda: tiny_llama(0), lambda: _mistral_window(3)], ids=["llama", "mistral-window6"])
def test_packed_ragged_forward_equals_padded(make):
    """Ragged rows run packed (no compute for padding) and give the padded forward's logits, states and cache:
    five rounds of ragged feeds with rollbacks, compared position by position against a runner that never packs."""
    model = make()
    packed, padded = ModelRunner(model, rows=0), ModelRunner(model, rows=0)
    padded.packing = False
    assert packed.packing, "llama-style families pack"
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (4, 9), generator=gen)
    for runner in (packed, padded):
        runner.forward_rows(prompt, [9, 3, 5, 1], logits_at=torch.zeros(4, 1, dtype=torch.long))
    used = 0
    for step in range(5):
        counts = [1 + (step + i) % 5 for i in range(4)]
        feed = torch.randint(0, 64, (4, max(counts)), generator=gen)
        used += sum(counts) <= 0.75 * 4 * max(counts)
        a, b = packed.forward_rows(feed, counts, hidden=True), padded.forward_rows(feed, counts, hidden=True)
        for i, c in enumerate(counts):
            torch.testing.assert_close(a.logits[i, :c], b.logits[i, :c], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(a.hidden[i, :c], b.hidden[i, :c], atol=1e-5, rtol=1e-5)
        for runner in (packed, padded):  # keep all but the last token of each row (a rollback)
            for i, c in enumerate(counts):
                runner.trim_row(i, runner.lengths[i] - 1)
        assert packed.lengths == padded.lengths
    assert used >= 3, "the ragged feeds took the packed path"
    feed = torch.randint(0, 64, (4, 5), generator=gen)
    counts, at = [5, 1, 2, 1], torch.tensor([[0, 4], [0, 0], [1, 1], [0, 0]])
    a = packed.forward_rows(feed, counts, logits_at=at)
    b = padded.forward_rows(feed, counts, logits_at=at)
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ restricted output vocabulary

@pytest.mark.parametrize("packing", [False, True])
def test_restricted_output_vocabulary_keeps_those_logits_and_zeroes_the_rest(packing):
    from draftwise.models.runner import ModelRunner

    model = tiny_llama(3)
    ids = torch.tensor([0, 5, 9, 17, 40, 63])
    full, cut = ModelRunner(model, rows=0), ModelRunner(model, rows=0, output_ids=ids)
    for runner in (full, cut):
        runner.packing = packing  # [4, 1] of width 4 is packed when packing is on
    tokens = torch.tensor([[1, 2, 3, 4], [5, 0, 0, 0]])
    a = full.forward_rows(tokens, [4, 1]).logits
    b = cut.forward_rows(tokens, [4, 1]).logits
    assert b.shape == a.shape
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    for row, n in enumerate([4, 1]):
        torch.testing.assert_close(b[row, :n, ids], a[row, :n, ids])
        assert torch.isneginf(b[row, :n][:, outside]).all()
