"""The fast forward (`models.fast`) and the weight formats it runs (`models.quant`).

What is proven here:
- on tiny random Llama (grouped-query attention), Qwen2 (q/k/v biases) and Mistral (a sliding window
  shorter than the sequences) models, the fast path gives the same logits and layer states as the
  transformers path (`DRAFTWISE_FAST=0`) and as an uncached full forward, through ragged prefills and
  feeds, per-row rollbacks, `move_row`, `copy_rows`, feeds to a block of rows and single-row feeds;
  `forward_states` (the last layer's states, feature_layers or not) and `logits_at` agree too;
- that comparison is not vacuous: one perturbed weight, swapped rotary tables or a dropped window fail it;
- `Int8Linear` and `Int4Linear` compute x @ dequantized().T (int4 exactly where fp32 arithmetic is exact),
  and a model loaded with `dtype="int8"` runs the per-channel int8 weights;
- GGUF Q4_0 / Q4_1 / Q8_0 blocks decode to the codes, scales and zeros they were encoded from, and to the
  same float weights as the `gguf` package's own dequantisation, from bytes and from a GGUF file;
  `GGUFFormats` runs an LM head of any row count;
- what the fast path cannot run (GPT-2, LongRoPE) is refused by `supports` and runs on the generic path.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

from conftest import tiny_gpt2, tiny_llama
from draftwise.errors import DraftwiseError
from draftwise.models import ModelRunner
from draftwise.models import loading
from draftwise.models.fast import FastModel, supports
from draftwise.models.formats import GGUFFormats
from draftwise.models.linear import CodesLinear, FloatLinear, Int4Linear, Int8Linear
from draftwise.models.quant import GROUP, GGUFTensor, _decode, encode, read_gguf_weights

VOCAB = 64
ROWS = 3
# fp32 agreement: the fast path and transformers add the same numbers in a different order (fused products,
# packed tokens, another attention kernel), so they agree to a few fp32 ulps of the largest value.
RTOL = 1e-4


# ------------------------------------------------------------------ tiny models of each fast family

def tiny_qwen2(seed: int) -> Qwen2ForCausalLM:
    """A random Qwen2 with GQA and random nonzero q/k/v biases (transformers initialises them to zero)."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    return model


def tiny_mistral(seed: int, window: int = 8) -> MistralForCausalLM:
    """A random Mistral whose sliding window (8) is shorter than the sequences the tests feed."""
    torch.manual_seed(seed)
    config = MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, sliding_window=window,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return MistralForCausalLM(config).eval()


FAMILIES = {
    "llama": lambda: tiny_llama(11),
    "qwen2": lambda: tiny_qwen2(12),
    "mistral": lambda: tiny_mistral(13),
}
SEEDS = {"llama": 1, "qwen2": 2, "mistral": 3}  # each family's script


def _runner(model, monkeypatch, *, fast: bool, rows: int = ROWS) -> ModelRunner:
    """A runner on `model`, with the fast path on or off (read when the runner is built)."""
    monkeypatch.setenv("DRAFTWISE_FAST", "1" if fast else "0")
    runner = ModelRunner(model, rows=rows)
    assert (runner.fast is not None) == fast
    return runner


# ------------------------------------------------------------------ one script of cache operations

def _script(seed: int, *, steps: int = 7) -> list[tuple]:
    """A deterministic sequence of runner operations over ROWS rows, tracking the lengths it implies:
    a ragged right-padded prefill, then ragged feeds of 1..5 tokens with random per-row rollbacks, one
    `move_row`, one `copy_rows`, a feed to rows 1.. only (begin=1), one-row feeds of 1 and of 3 tokens."""
    rng = random.Random(seed)
    lengths = [0] * ROWS
    ops: list[tuple] = []

    def feed(counts: list[int], begin: int = 0) -> None:
        width = max(counts)
        tokens = [[rng.randrange(VOCAB) for _ in range(width)] for _ in counts]  # padding: random ids too
        ops.append(("feed", torch.tensor(tokens), counts, begin))
        for i, count in enumerate(counts):
            lengths[begin + i] += count

    feed([7, 3, 5])
    for step in range(steps):
        if step == 2:
            ops.append(("move", 2, 0))
            lengths[0] = lengths[2]
        if step == 4:
            order = [1, 1, 0]
            ops.append(("select", torch.tensor(order)))
            lengths[:] = [lengths[r] for r in order]
        if step == 3:
            feed([rng.randint(1, 5), rng.randint(1, 5)], begin=1)
        elif step == 5:
            feed([1], begin=2)
            feed([3], begin=0)
        else:
            feed([rng.randint(1, 5) for _ in range(ROWS)])
        for row in range(ROWS):  # rollback: reject some of the tokens just fed (or a little more)
            if rng.random() < 0.6:
                keep = max(1, lengths[row] - rng.randint(0, 4))
                ops.append(("trim", row, keep))
                lengths[row] = keep
    assert max(lengths) > 8  # past the Mistral window
    return ops


def _play(runner: ModelRunner, ops: list[tuple], *, hidden: bool = False) -> list[dict]:
    """Run the script; per feed, the logits and (with `hidden`) the states of each row's real tokens, and
    each row's whole token sequence after the feed (the cache rows' contents, tracked on the host)."""
    sequences: list[list[int]] = [[] for _ in range(ROWS)]
    results = []
    for op in ops:
        if op[0] == "feed":
            _, tokens, counts, begin = op
            out = runner.forward_rows(tokens, counts, begin=begin, hidden=hidden)
            for i, count in enumerate(counts):
                row = begin + i
                sequences[row].extend(tokens[i, :count].tolist())
                results.append({
                    "row": row, "count": count, "sequence": list(sequences[row]),
                    "logits": out.logits[i, :count].clone(),
                    "hidden": out.hidden[i, :count].clone() if hidden else None,
                })
        elif op[0] == "trim":
            _, row, keep = op
            runner.trim_row(row, keep)
            del sequences[row][keep:]
        elif op[0] == "move":
            _, src, dst = op
            runner.cache.move_row(src, dst)
            sequences[dst] = list(sequences[src])
        elif op[0] == "select":  # a beam reorder: row i becomes a copy of row op[1][i]
            runner.cache.copy_rows(op[1].tolist(), 0)
            sequences[: len(op[1])] = [list(sequences[r]) for r in op[1].tolist()]
        assert runner.lengths == [len(s) for s in sequences]
    return results


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6))


def _max_error(fast: list[dict], reference: list[dict], key: str) -> float:
    assert [r["row"] for r in fast] == [r["row"] for r in reference]
    return max(_error(f[key], r[key]) for f, r in zip(fast, reference))


def _full_forward(model, sequence: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence]), use_cache=False).logits[0]


# ------------------------------------------------------------------ 1. fast path == transformers path

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_matches_transformers_through_ragged_feeds_and_rollbacks(family, monkeypatch):
    """Same script on both paths: every real position's logits agree within RTOL of their scale and every
    greedy choice is the same; the fast logits also match an uncached full forward of each row's sequence
    (so the rows' caches hold exactly their sequences after trims, moves and selections)."""
    model = FAMILIES[family]()
    assert supports(model) is None
    ops = _script(seed=SEEDS[family])
    fast = _play(_runner(model, monkeypatch, fast=True), ops)
    reference = _play(_runner(model, monkeypatch, fast=False), ops)

    assert _max_error(fast, reference, "logits") < RTOL
    for f, r in zip(fast, reference):
        assert torch.equal(f["logits"].argmax(-1), r["logits"].argmax(-1))
    for f in fast:
        full = _full_forward(model, f["sequence"])[-f["count"]:]
        assert _error(f["logits"], full) < RTOL
        assert torch.equal(f["logits"].argmax(-1), full.argmax(-1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_activations_keep_a_bf16_cache_that_changes_no_bit(family, monkeypatch):
    """With bf16 activations the keys and values are bf16 numbers, so the cache keeps them in bf16 (half the bytes
    a step reads): the same script gives the same logits, bit for bit, as with a float32 cache
    (DRAFTWISE_KV_DTYPE=float32). The control: rounding an fp32 model's keys and values to bf16 does move them."""
    from draftwise.models import qkernel

    if not qkernel.available():
        pytest.skip(f"draftwise's kernel is not built here: {qkernel.problem()}")
    ops = _script(seed=SEEDS[family])
    model = FAMILIES[family]().to(torch.bfloat16)
    half = _runner(model, monkeypatch, fast=True)
    assert half.fast.cache_dtype == torch.bfloat16
    played = _play(half, ops)
    assert half.cache.keys[0].dtype == torch.bfloat16
    monkeypatch.setenv("DRAFTWISE_KV_DTYPE", "float32")
    wide = _runner(copy.deepcopy(model), monkeypatch, fast=True)  # a model's fast forward is built once
    assert wide.fast.cache_dtype == torch.float32
    for a, b in zip(played, _play(wide, ops)):
        assert torch.equal(a["logits"], b["logits"]), a["row"]
    model = FAMILIES[family]()
    monkeypatch.setenv("DRAFTWISE_KV_DTYPE", "bfloat16")
    rounded = _play(_runner(copy.deepcopy(model), monkeypatch, fast=True), ops)
    monkeypatch.delenv("DRAFTWISE_KV_DTYPE")
    exact = _play(_runner(copy.deepcopy(model), monkeypatch, fast=True), ops)
    assert not all(torch.equal(a["logits"], b["logits"]) for a, b in zip(rounded, exact))
    monkeypatch.setenv("DRAFTWISE_KV_DTYPE", "fp8")
    with pytest.raises(DraftwiseError, match="DRAFTWISE_KV_DTYPE"):
        _runner(copy.deepcopy(model), monkeypatch, fast=True)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "buffers"])
def test_a_cache_the_kernel_alone_reads_grows_without_zeroing(monkeypatch, paged):
    """On the CPU every feed runs draftwise's attention kernel, which reads only visible keys, so the cache's buffers
    (or a paged cache's pools) grow without being zeroed. Poisoned with NaN instead of left as they come, they give
    the same logits bit for bit as zeroed ones through the whole script (reallocations included); the generic path
    (PyTorch's attention, where a masked slot's NaN would spread) clears the poison before it reads the cache."""
    from draftwise.models import kvcache, qkernel

    if not qkernel.available():
        pytest.skip(f"draftwise's kernel is not built here: {qkernel.problem()}")
    monkeypatch.setenv("DRAFTWISE_PAGED", "1" if paged else "0")
    model = FAMILIES["llama"]()
    ops = _script(seed=SEEDS["llama"])

    def play(poison: bool):
        runner = _runner(copy.deepcopy(model), monkeypatch, fast=True)
        assert isinstance(runner.cache, kvcache.PagedCache) == paged
        if paged:
            runner.cache._initial_pages = 1  # the pool grows (reallocates) as rows share and copy pages
        else:
            runner.cache.capacity = runner.cache._initial_capacity = 4  # grows (reallocates) several times
        monkeypatch.setattr(kvcache.PositionCache, "new_buffer", lambda self, shape, dtype, device: torch.full(
            shape, float("nan") if poison and not self.zero_fill else 0.0, dtype=dtype, device=device))
        return runner, _play(runner, ops)

    runner, poisoned = play(True)
    cache = runner.cache
    assert not cache.zero_fill and (cache.pages_allocated > 1 if paged else cache.capacity > 4)
    assert any(bool(buf.isnan().any()) for buf in cache.keys)  # the poison is there, never read
    for a, b in zip(poisoned, play(False)[1]):
        assert torch.equal(a["logits"], b["logits"]), a["row"]
    kv_heads, d = cache.keys[0].shape[1], cache.keys[0].shape[3]
    with torch.inference_mode():  # as every forward runs
        cache.begin_forward([1])
        cache.update(torch.zeros(1, kv_heads, 1, d), torch.zeros(1, kv_heads, 1, d), 0)
    assert cache.zero_fill and not any(bool(buf.isnan().any()) for buf in (*cache.keys, *cache.values))


def test_mistral_script_exercises_the_window(monkeypatch):
    """The Mistral comparison sees its window: the same model with the window opened up (full attention)
    gives other logits on the same script, far beyond RTOL."""
    model = FAMILIES["mistral"]()
    ops = _script(seed=SEEDS["mistral"])
    windowed = _play(_runner(model, monkeypatch, fast=True), ops)
    runner = _runner(model, monkeypatch, fast=True)
    runner.cache.window = None
    unwindowed = _play(runner, ops)
    assert _max_error(unwindowed, windowed, "logits") > 100 * RTOL


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_feature_layers_match_transformers(family, monkeypatch):
    """With feature_layers (0, 1) and hidden=True, the states (inputs of layers 0 and 1, then the final normed
    state, concatenated) agree at every real position through the same script."""
    model = FAMILIES[family]()
    ops = _script(seed=7)
    played = []
    for fast in (True, False):
        runner = _runner(model, monkeypatch, fast=fast)
        runner.feature_layers = (0, 1)
        played.append(_play(runner, ops, hidden=True))
    fast, reference = played
    width = model.config.hidden_size
    assert fast[0]["hidden"].shape[-1] == 3 * width
    assert _max_error(fast, reference, "hidden") < RTOL
    assert _max_error(fast, reference, "logits") < RTOL


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_forward_states_matches_transformers(family, monkeypatch):
    """`forward_states` (input embeddings, as feature-level draft heads feed them) agrees on both paths,
    over a ragged feed and then a one-token-per-row feed, and returns the last layer's states only even on
    a runner with feature_layers set (its documented shape, and the generic path's)."""
    model = FAMILIES[family]()
    torch.manual_seed(3)
    width = model.config.hidden_size
    first = torch.randn(ROWS, 5, width)
    second = torch.randn(ROWS, 1, width)
    outs = []
    for fast in (True, False):
        runner = _runner(model, monkeypatch, fast=fast)
        runner.feature_layers = (0, 1)
        a = runner.forward_states(first, [5, 2, 4])
        assert a.shape == (ROWS, 5, width)
        b = runner.forward_states(second, [1, 1, 1])
        outs.append((a, b))
    (fa, fb), (ra, rb) = outs
    for row, count in enumerate([5, 2, 4]):
        assert _error(fa[row, :count], ra[row, :count]) < RTOL
    assert _error(fb, rb) < RTOL


def test_fast_logits_at_matches_transformers(monkeypatch):
    """logits_at (the engine asks for a few positions per row): the fast path's picked logits equal the
    transformers path's at every real position asked for."""
    model = FAMILIES["qwen2"]()
    tokens = torch.randint(0, VOCAB, (ROWS, 6), generator=torch.Generator().manual_seed(4))
    counts = [6, 2, 4]
    at = torch.tensor([[0, 5], [0, 1], [1, 3]])
    outs = [_runner(model, monkeypatch, fast=fast).forward_rows(tokens, counts, logits_at=at).logits
            for fast in (True, False)]
    assert outs[0].shape == (ROWS, 2, VOCAB)
    assert _error(outs[0], outs[1]) < RTOL


# ------------------------------------------------------------------ 2. the comparison catches bugs

def _perturb_qkv(fast: FastModel, monkeypatch) -> None:
    """One element of layer 1's fused k projection moves by a tenth of the weights' largest magnitude."""
    layer = fast.layers[1]
    weight = layer.qkv.dequantized().clone()
    weight[fast.num_heads * fast.head_dim + 3, 5] += 0.1 * weight.abs().max()
    monkeypatch.setattr(layer, "qkv", FloatLinear(weight, layer.qkv.bias))


def _swap_rope(fast: FastModel, monkeypatch) -> None:
    """cos and sin tables exchanged."""
    rope = fast._rope
    monkeypatch.setattr(fast, "_rope", lambda positions, bound: rope(positions, bound)[::-1])


def test_rope_tables_cover_the_bound_without_reading_the_positions(monkeypatch):
    """The rotary tables grow to the host bound a forward gives (the keys it reads), not to a maximum read back from
    the positions; the rows returned are the rotary embedding's at those positions (sin with rotate_half's sign)."""
    fast = _runner(tiny_llama(0), monkeypatch, fast=True).fast
    positions = torch.tensor([0, 300, 1029, 7])
    with monkeypatch.context() as patched:
        patched.setattr(torch.Tensor, "max", lambda *args, **kwargs: pytest.fail("the positions were read back"))
        cos, sin = fast._rope(positions, 1030)
    assert fast._rope_len >= 1030
    reference_cos, reference_sin = fast.rotary(torch.zeros(1, 1, fast.head_dim, dtype=fast.dtype), positions[None])
    half = fast.head_dim // 2
    assert torch.equal(cos, reference_cos[0])
    assert torch.equal(sin, torch.cat([-reference_sin[0, :, :half], reference_sin[0, :, half:]], -1))


@pytest.mark.parametrize("mutation", [_perturb_qkv, _swap_rope], ids=["qkv-weight", "rope-swap"])
def test_comparison_catches_a_broken_fast_path(mutation, monkeypatch):
    """Negative control: the same comparison as above fails (errors over 10 x RTOL; measured 1.2e-2 for the
    weight, 1.8 for the rope) once the fast path is broken, so its passing means something."""
    model = tiny_llama(21)  # its own model: the mutation lands on the FastModel cached on it
    ops = _script(seed=5)
    runner = _runner(model, monkeypatch, fast=True)
    mutation(runner.fast, monkeypatch)
    broken = _play(runner, ops)
    reference = _play(_runner(model, monkeypatch, fast=False), ops)
    assert _max_error(broken, reference, "logits") > 10 * RTOL


# ------------------------------------------------------------------ 3. int8 and int4 projections

def test_int8_linear_is_its_dequantized_product():
    """Int8Linear: q = round(w / s) with s = max|w_row| / 127 (so |w - q s| <= s / 2), and the int8 product
    with fp32 activations equals x @ dequantized().T + b within 1e-5 of its scale."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 96, generator=gen)
    bias = torch.randn(48, generator=gen)
    linear = Int8Linear.quantize(weight, bias)
    assert linear.qweight.dtype == torch.int8
    scales = weight.abs().amax(dim=1) / 127
    assert torch.allclose(linear.scales, scales)
    assert ((linear.dequantized() - weight).abs() <= scales[:, None] / 2 + 1e-7).all()
    x = torch.randn(2, 5, 96, generator=gen)
    y = linear(x)
    reference = x @ linear.dequantized().T + bias
    assert y.shape == (2, 5, 48)
    assert _error(y, reference) < 1e-5


def _int4(gen: torch.Generator, out: int, inp: int, dtype: torch.dtype, *, exact: bool = False, bias: bool = True):
    codes = torch.randint(0, 16, (out, inp), generator=gen)
    if exact:  # power-of-two scales and zeros on a 1/16 grid: every product and sum below is exact in fp32
        scales = 2.0 ** -torch.randint(1, 5, (out, inp // GROUP), generator=gen).float()
        zeros = torch.randint(-8, 9, (out, inp // GROUP), generator=gen).float() / 16
    else:
        scales = torch.rand(out, inp // GROUP, generator=gen) * 0.05 + 0.01
        zeros = torch.randn(out, inp // GROUP, generator=gen) * 0.1
    b = torch.randn(out, generator=gen) if bias else None
    return Int4Linear(codes, scales, zeros, GROUP, b, dtype), codes, scales, zeros


def test_int4_linear_dequantizes_its_groups():
    """dequantized() is w = (q - 8) * scale + zero with one (scale, zero) per 32 inputs of a row."""
    gen = torch.Generator().manual_seed(1)
    linear, codes, scales, zeros = _int4(gen, 32, 96, torch.float32)
    expected = torch.empty(32, 96)
    for g in range(3):
        block = slice(g * GROUP, (g + 1) * GROUP)
        expected[:, block] = (codes[:, block].float() - 8) * scales[:, g:g + 1] + zeros[:, g:g + 1]
    assert torch.equal(linear.dequantized(), expected)


def test_int4_linear_fp32_is_exact_on_exact_values():
    """fp32 activations, small integer inputs, power-of-two scales: the int4 kernel's product equals
    x @ dequantized().T bit for bit (the kernel reads the groups, scales and zeros as dequantized() does)."""
    gen = torch.Generator().manual_seed(2)
    linear, *_ = _int4(gen, 32, 96, torch.float32, exact=True, bias=False)
    x = torch.randint(-4, 5, (4, 96), generator=gen).float()
    assert torch.equal(linear(x), x @ linear.dequantized().T)


def test_int4_linear_bf16_matches_within_bf16_rounding():
    """bf16 activations (the fast path): the product with its bias is within 1/64 of its scale of the fp32
    x @ dequantized().T + b (two bf16 roundings, the product's and the bias add's, are 2^-8 each)."""
    gen = torch.Generator().manual_seed(3)
    linear, *_ = _int4(gen, 48, 128, torch.bfloat16)
    x = torch.randn(2, 3, 128, generator=gen).to(torch.bfloat16)
    y = linear(x)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 48)
    reference = x.float() @ linear.dequantized().float().T + linear.bias.float()
    assert _error(y, reference) < 1 / 64


def _int8_dequantized_copy(model):
    """An independent reference: the model with every projection and the LM head replaced by its per-output-
    channel int8 dequantisation (round(w / s) * s, s = max|w_row| / 127); embeddings and norms stay float."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight
                s = (w.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
                w.copy_(torch.round(w / s).clamp(-128, 127) * s)
    return reference


def test_int8_model_matches_its_dequantized_float_reference(monkeypatch):
    """load_model(model, dtype="int8") (fp32 activations) runs Int8Linear projections, and through the whole
    script agrees with the transformers path on a float copy holding the dequantised int8 weights; the
    unquantised model differs from both far beyond RTOL (so the int8 weights are really the ones run)."""
    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: False)  # fp32 activations on every CPU
    model = tiny_llama(31)
    original = copy.deepcopy(model)
    reference = _int8_dequantized_copy(model)
    loaded = loading.load_model(model, dtype="int8")
    assert loaded.dtype == torch.float32
    runner = _runner(loaded.model, monkeypatch, fast=True)
    assert all(isinstance(lin, Int8Linear)
               for layer in runner.fast.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert isinstance(runner.fast.head, Int8Linear)
    ops = _script(seed=9)
    int8 = _play(runner, ops)
    expected = _play(_runner(reference, monkeypatch, fast=False), ops)
    assert _max_error(int8, expected, "logits") < RTOL
    for a, b in zip(int8, expected):
        assert torch.equal(a["logits"].argmax(-1), b["logits"].argmax(-1))
    unquantised = _play(_runner(original, monkeypatch, fast=False), ops)
    assert _max_error(unquantised, expected, "logits") > 100 * RTOL


# ------------------------------------------------------------------ 4. GGUF blocks

def _random_gguf(kind: str, out: int, inp: int, seed: int) -> GGUFTensor:
    """Random blocks as a GGUF file holds them: fp16 d (and m), 4-bit or int8 codes."""
    gen = torch.Generator().manual_seed(seed)
    blocks = (out, inp // GROUP)
    d = (torch.rand(blocks, generator=gen) * 0.05 + 0.001).half().float()
    if kind == "q8_0":
        codes = torch.randint(-128, 128, (out, inp), generator=gen).to(torch.int8)
        return GGUFTensor(kind, codes, d, None)
    codes = torch.randint(0, 16, (out, inp), generator=gen).to(torch.uint8)
    if kind == "q4_1":
        m = (-torch.rand(blocks, generator=gen) * 0.4).half().float()
        zeros = m + 8 * d  # Int4Linear's convention: w = q d + m = (q - 8) d + (m + 8 d)
    else:
        zeros = torch.zeros(blocks)
    return GGUFTensor(kind, codes, d, zeros)


def _gguf_dequantize(raw: np.ndarray, kind: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    return quants.dequantize(raw, GGMLQuantizationType[kind.upper()])


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
def test_gguf_blocks_round_trip(kind):
    """encode -> bytes of the right size -> _decode gives back identical codes, scales and zeros."""
    tensor = _random_gguf(kind, 16, 96, seed=4)
    raw = encode(tensor)
    block_bytes = {"q4_0": 18, "q4_1": 20, "q8_0": 34}[kind]
    assert raw.dtype == np.uint8 and raw.shape == (16, 3 * block_bytes)
    back = _decode(kind, raw)
    assert back.kind == kind
    assert torch.equal(back.codes, tensor.codes) and back.codes.dtype == tensor.codes.dtype
    assert torch.equal(back.scales, tensor.scales)
    if kind == "q8_0":
        assert back.zeros is None
    else:
        assert torch.equal(back.zeros, tensor.zeros)
    assert np.array_equal(encode(back), raw)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
def test_gguf_decode_matches_the_gguf_package(kind):
    """_decode(...).dequantized() equals gguf.quants.dequantize on the same bytes exactly, for our random
    blocks and for blocks written by the gguf package's own quantiser; an Int4Linear built from the decoded
    Q4 groups (fp32) dequantises to the same floats."""
    from gguf import GGMLQuantizationType, quants

    weights = np.random.default_rng(5).normal(size=(16, 128)).astype(np.float32)
    theirs = quants.quantize(weights, GGMLQuantizationType[kind.upper()])
    for raw in (encode(_random_gguf(kind, 16, 128, seed=6)), theirs):
        decoded = _decode(kind, raw)
        expected = _gguf_dequantize(raw, kind)
        assert expected.shape == (16, 128)
        assert np.array_equal(decoded.dequantized().numpy(), expected)
        if kind != "q8_0":
            linear = Int4Linear(decoded.codes, decoded.scales, decoded.zeros, GROUP, None, torch.float32)
            assert np.array_equal(linear.dequantized().numpy(), expected)


def _write_gguf(path, tensors: dict[str, tuple[np.ndarray, str | None]]) -> None:
    """A GGUF file holding `tensors`: name -> (GGUF bytes and their kind, or float32 values and None)."""
    from gguf import GGMLQuantizationType, GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    for name, (data, kind) in tensors.items():
        raw_dtype = None if kind is None else GGMLQuantizationType[kind.upper()]
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_read_gguf_weights_reads_a_written_q4_1_tensor(tmp_path):
    """A GGUF file written by gguf.GGUFWriter with one Q4_1 tensor (and one F32 tensor, left to transformers)
    reads back through read_gguf_weights as the same int4 groups."""
    tensor = _random_gguf("q4_1", 32, 64, seed=8)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, {"blk.0.attn_q.weight": (encode(tensor), "q4_1"),
                       "output_norm.weight": (np.ones(64, dtype=np.float32), None)})

    found = read_gguf_weights(path)
    assert set(found) == {"blk.0.attn_q.weight"}
    back = found["blk.0.attn_q.weight"]
    assert back.kind == "q4_1"
    assert torch.equal(back.codes, tensor.codes)
    assert torch.equal(back.scales, tensor.scales)
    assert torch.equal(back.zeros, tensor.zeros)


@pytest.mark.parametrize("codes", [False, True])
@pytest.mark.parametrize("vocab", [64, 72])
def test_gguf_formats_lm_head_runs_the_file_weights(vocab, codes, tmp_path):
    """With draftwise's codes kernel, GGUFFormats gives a Q4_0 LM head as a CodesLinear whatever its rows; without
    it, as an Int4Linear when PyTorch's int4 kernel can pack it (rows a multiple of 16: vocabulary 64) and as float
    weights otherwise (vocabulary 72; the kernel refuses it, which used to fail the runner's construction); either
    way it dequantises to exactly what the gguf package reads."""
    from draftwise.models import qkernel

    if codes and not qkernel.available():
        pytest.fail(f"the codes kernel is not built here: {qkernel.problem()}")
    from gguf import GGMLQuantizationType, quants

    model = tiny_llama(51, vocab=vocab)
    raw = quants.quantize(np.random.default_rng(7).normal(size=(vocab, 64)).astype(np.float32),
                          GGMLQuantizationType.Q4_0)
    path = tmp_path / "head.gguf"
    _write_gguf(path, {"output.weight": (raw, "q4_0")})
    formats = GGUFFormats(path, model, torch.float32)
    formats.codes = codes
    # before any projection is built (issue 39's probe read "gguf ( projections)"): the file's tensors
    assert formats.describe().startswith("gguf (1 q4_0 projections; ")
    weights = torch.from_numpy(_gguf_dequantize(raw, "q4_0"))
    linear = formats.linear("lm_head", [("lm_head", weights)], weights, None)
    assert isinstance(linear, CodesLinear if codes else Int4Linear if vocab % 16 == 0 else FloatLinear)
    assert torch.equal(linear.dequantized(), weights)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(8))
    assert _error(linear(x), x @ weights.T) < 1e-5


# ------------------------------------------------------------------ 5. other families: the generic path

def test_supports_refuses_gpt2_and_the_runner_falls_back(monkeypatch):
    """GPT-2 is not a fast family: supports() says why, the runner has no FastModel even with the fast path
    on, and its ragged forward still matches an uncached full forward."""
    model = tiny_gpt2(0)
    why = supports(model)
    assert why is not None and "gpt2" in why
    monkeypatch.setenv("DRAFTWISE_FAST", "1")
    runner = ModelRunner(model, rows=2)
    assert runner.fast is None
    tokens = torch.tensor([[3, 17, 42, 8], [25, 11, 0, 0]])
    out = runner.forward_rows(tokens, [4, 2])
    assert runner.lengths == [4, 2]
    for row, count in enumerate([4, 2]):
        full = _full_forward(model, tokens[row, :count].tolist())
        assert _error(out.logits[row, :count], full) < RTOL


def test_supports_refuses_longrope(monkeypatch):
    """LongRoPE switches its frequencies with the sequence length (short factors up to the original context,
    long ones past it), which the fast path's position table cannot follow: supports() refuses it, and the
    runner's logits then match an uncached full forward. (With longrope accepted, a 10-token sequence on this
    model, original context 32, came out wrong by about the logits' own scale: the fast path's table of 256
    positions took the long factors for every position.)"""
    torch.manual_seed(61)
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
            "long_factor": [float(i + 2) for i in range(8)], "original_max_position_embeddings": 32, "factor": 8.0}
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.5, tie_word_embeddings=False,
        rope_parameters=rope, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    monkeypatch.setenv("DRAFTWISE_FAST", "1")
    runner = ModelRunner(model, rows=1)
    sequence = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    logits = runner.forward_rows(sequence, [10]).logits[0]
    assert _error(logits, _full_forward(model, sequence[0].tolist())) < RTOL
    why = supports(model)
    assert why is not None and "longrope" in why
    assert runner.fast is None


def test_fast_disabled_by_environment(monkeypatch):
    """DRAFTWISE_FAST=0 gives a Llama runner the generic path; the default gives it the fast one."""
    model = tiny_llama(41)
    monkeypatch.setenv("DRAFTWISE_FAST", "0")
    assert ModelRunner(model).fast is None
    monkeypatch.delenv("DRAFTWISE_FAST")
    assert isinstance(ModelRunner(model).fast, FastModel)
