"""Batch invariance: a row's logits at a position are the same bits whether the forward carries that token alone,
beside other tokens of its row (a verification, a chain fed in pieces), or beside other rows.

The operations of the fast forward that broke it were PyTorch's scaled_dot_product_attention (found by swapping it
alone for a per-query reference) and, for float weights, oneDNN's products; every feed now runs draftwise's attention
(csrc/attention.cpp) and float product (csrc/floats.cpp), checked here against float64 references, for their own
invariance, and through whole models per format. The control
swaps in a deliberately width-dependent reduction (the keys summed in reverse order when a forward carries more than
one token) and the same checks catch it."""

from __future__ import annotations

import os

import pytest
import torch

from draftwise.models import qkernel


@pytest.fixture(scope="module")
def kernel():
    module = qkernel.load()
    if module is None:
        pytest.skip(f"draftwise's kernel is not built here: {qkernel.problem()}")
    return module


PATHS = ["avx512", "avx2", "portable"]


@pytest.fixture(params=PATHS)
def attend(kernel, request):
    """The attention kernel on one of its paths: AVX-512 (where the CPU has it), AVX2 (forced even where AVX-512
    runs), the portable loops. Every check on a query's bits holds on each path."""
    path = request.param
    if path == "avx512" and not kernel.attention_avx512():
        pytest.skip("no AVX-512 here (or DRAFTWISE_AVX512=0)")
    return lambda q, keys, values, visible, counts, kv, scale: kernel.attend(
        q, keys, values, visible, counts, kv, scale, path == "portable", path == "avx512")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


def test_the_avx512_attention_runs_where_the_cpu_has_it(kernel):
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo")
    has = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"} <= flags
    assert kernel.attention_avx512() == (has and os.environ.get("DRAFTWISE_AVX512", "1") != "0")


def _reference(q, keys, values, visible, counts, kv, scale):
    """float64, one query at a time over its visible keys: [R, W, H, D]."""
    R, W, H, D = q.shape
    G = H // keys.shape[1]
    out = torch.zeros(R, W, H, D, dtype=torch.float64)
    for r in range(R):
        for w in range(counts[r]):
            seen = torch.ones(kv, dtype=torch.bool) if visible is None else visible[r, w, :kv]
            for h in range(H):
                k = keys[r, h // G, :kv][seen].double()
                v = values[r, h // G, :kv][seen].double()
                p = torch.softmax((k @ q[r, w, h].double()) * scale, -1)
                out[r, w, h] = p @ v
    return out


def _case(seed: int, R=3, W=5, H=6, KVH=2, D=64, C=40):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, W, H, D, generator=g)
    keys, values = torch.randn(R, KVH, C, D, generator=g), torch.randn(R, KVH, C, D, generator=g)
    counts = [W, 1, 3][:R]
    lengths = [20, 33, 9][:R]
    kv = max(n + c for n, c in zip(lengths, counts))
    visible = torch.zeros(R, W, kv, dtype=torch.bool)
    for r in range(R):
        for w in range(counts[r]):
            visible[r, w, : lengths[r] + w + 1] = True  # causal
    visible[0, 3, 21] = False  # a token tree: query 3 does not see query 1's slot
    return q, keys, values, visible, counts, kv


@pytest.mark.parametrize("shape", [dict(H=6, KVH=2, D=64), dict(H=4, KVH=4, D=128), dict(H=3, KVH=1, D=24),
                                   dict(H=4, KVH=1, D=96), dict(H=8, KVH=4, D=32), dict(H=10, KVH=2, D=48)])
def test_the_attention_kernel_is_attention(attend, shape):
    """Heads a kv head: 3, 1, 3, 4 (a group of 3 and one), 2, 5; head dimensions: multiples of 32 (the AVX-512
    path, with a tail of one chunk at 96) and not (24, 48: AVX2)."""
    q, keys, values, visible, counts, kv = _case(0, **shape)
    out = attend(q, keys, values, visible, counts, kv, 0.125)
    expected = _reference(q, keys, values, visible, counts, kv, 0.125)
    assert float((out.double() - expected).abs().max()) < 2e-5
    for r, c in enumerate(counts):
        assert not out[r, c:].any()  # padded queries stay zero
    # one query over every key, no mask
    single = attend(q[:1, :1].contiguous(), keys[:1], values[:1], None, [1], 30, 0.125)
    assert float((single.double() - _reference(q[:1, :1], keys[:1], values[:1], None, [1], 30, 0.125)).abs().max()) < 2e-5


def test_a_query_is_the_same_bits_alone_or_among_others(attend):
    q, keys, values, visible, counts, kv = _case(1)
    full = attend(q, keys, values, visible, counts, kv, 0.125)
    for r, c in enumerate(counts):
        for w in range(c):
            n = int(visible[r, w].nonzero().max()) + 1
            alone = attend(q[r: r + 1, w: w + 1].contiguous(), keys[r: r + 1], values[r: r + 1],
                                  visible[r: r + 1, w: w + 1, :n].contiguous(), [1], n, 0.125)
            assert torch.equal(alone[0, 0], full[r, w]), (r, w)
    # the tree query sees the same keys as one whose hidden slot is gone (moved away): the same bits
    kept = [j for j in range(kv) if visible[0, 3, j]]
    moved_keys, moved_values = keys[:1, :, kept].contiguous(), values[:1, :, kept].contiguous()
    moved = attend(q[:1, 3:4].contiguous(), moved_keys, moved_values, None, [1], len(kept), 0.125)
    assert torch.equal(moved[0, 0], full[0, 3])


def test_a_wide_feed_is_tiled_and_each_query_keeps_its_bits(attend):
    """A prompt chunk (16 or more queries a row) runs in tiles of queries that share their key loads: each query
    is still attention (against float64), its bits are those it has alone and those of a narrow feed, padded
    queries stay zero, and a query that sees no key past others' (a hole in its mask) is unaffected."""
    g = torch.Generator().manual_seed(7)
    R, W, H, KVH, D, C = 2, 37, 6, 2, 64, 120
    q = torch.randn(R, W, H, D, generator=g)
    keys, values = torch.randn(R, KVH, C, D, generator=g), torch.randn(R, KVH, C, D, generator=g)
    counts, lengths = [37, 19], [50, 3]
    kv = max(n + c for n, c in zip(lengths, counts))
    visible = torch.zeros(R, W, kv, dtype=torch.bool)
    for r in range(R):
        for w in range(counts[r]):
            visible[r, w, : lengths[r] + w + 1] = True
    visible[0, 20, 55:60] = False  # holes, as a token tree's
    visible[1, 4, 0] = False
    wide = attend(q, keys, values, visible, counts, kv, 0.125)
    assert float((wide.double() - _reference(q, keys, values, visible, counts, kv, 0.125)).abs().max()) < 2e-5
    assert not wide[1, 19:].any()
    narrow = torch.cat([attend(q[:, w: w + 5].contiguous(), keys, values,
                                      visible[:, w: w + 5].contiguous(), [max(0, min(5, c - w)) for c in counts],
                                      kv, 0.125) for w in range(0, W, 5)], 1)[:, :W]
    assert torch.equal(wide, narrow)  # one query a task (narrow feeds) and tiles: the same bits
    long_kv = 1100  # a narrow feed over a long context is tiled too
    lk, lv = torch.randn(1, KVH, long_kv, D, generator=g), torch.randn(1, KVH, long_kv, D, generator=g)
    few = attend(q[:1, :5].contiguous(), lk, lv, None, [5], long_kv, 0.125)
    one = torch.cat([attend(q[:1, w: w + 1].contiguous(), lk, lv, None, [1], long_kv, 0.125)
                     for w in range(5)], 1)
    assert torch.equal(few, one)
    assert float((few.double() - _reference(q[:1, :5], lk, lv, None, [5], long_kv, 0.125)).abs().max()) < 2e-5
    for r, w in ((0, 0), (0, 20), (0, 36), (1, 4), (1, 18)):
        n = int(visible[r, w].nonzero().max()) + 1
        alone = attend(q[r: r + 1, w: w + 1].contiguous(), keys[r: r + 1], values[r: r + 1],
                              visible[r: r + 1, w: w + 1, :n].contiguous(), [1], n, 0.125)
        assert torch.equal(alone[0, 0], wide[r, w]), (r, w)


def test_a_bfloat16_cache_is_read_as_its_float32_widening(kernel, attend):
    """Keys and values kept in bfloat16 give the bits of the same (rounded) keys and values in float32, on every
    path: wide feeds in tiles, narrow ones, a long context, holes in the mask; and each query is still attention."""
    g = torch.Generator().manual_seed(11)
    R, W, H, KVH, D, C = 2, 20, 6, 2, 64, 1200
    q = torch.randn(R, W, H, D, generator=g)
    keys = torch.randn(R, KVH, C, D, generator=g).bfloat16()
    values = torch.randn(R, KVH, C, D, generator=g).bfloat16()
    for counts, lengths in (([20, 7], [1100, 30]), ([1, 1], [5, 900]), ([3, 0], [40, 0])):
        kv = max(n + c for n, c in zip(lengths, counts))
        visible = torch.zeros(R, W, kv, dtype=torch.bool)
        for r in range(R):
            for w in range(counts[r]):
                visible[r, w, : lengths[r] + w + 1] = True
        visible[0, 0, 3:9] = False
        half = attend(q, keys, values, visible, counts, kv, 0.125)
        widened = attend(q, keys.float(), values.float(), visible, counts, kv, 0.125)
        assert torch.equal(half, widened), (counts, lengths)
        expected = _reference(q, keys.float(), values.float(), visible, counts, kv, 0.125)
        assert float((half.double() - expected).abs().max()) < 2e-5
    with pytest.raises(RuntimeError, match="both the same"):
        attend(q, keys, values.float(), None, [W, W], 10, 0.1)


def _paged(flat: torch.Tensor, page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One buffer's rows [R, KVH, C, D] scattered over a pool of shuffled pages: (pool, table [R, C / page])."""
    R, KVH, C, D = flat.shape
    n = C // page
    order = torch.randperm(R * n + 3, generator=torch.Generator().manual_seed(seed))  # 3 pages no row holds
    pool = torch.randn(R * n + 3, KVH, page, D).to(flat.dtype)
    table = order[: R * n].view(R, n).to(torch.int32)
    for r in range(R):
        for p in range(n):
            pool[table[r, p]] = flat[r, :, p * page: (p + 1) * page]
    return pool, table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", PATHS)
def test_keys_read_from_pages_give_the_bits_of_one_buffer(kernel, dtype, path):
    """A paged cache's rows: each row's positions in pages of 64 (or 128) scattered over a pool in shuffled order.
    Decoding queries, a verification and a wide chunk over several pages give the bits of the same keys in one
    buffer, on every path."""
    if path == "avx512" and not kernel.attention_avx512():
        pytest.skip("no AVX-512 here (or DRAFTWISE_AVX512=0)")
    g = torch.Generator().manual_seed(4)
    R, W, H, KVH, D, C = 3, 20, 6, 2, 64, 384
    q = torch.randn(R, W, H, D, generator=g)
    keys, values = (torch.randn(R, KVH, C, D, generator=g).to(dtype) for _ in range(2))
    counts, lengths = [W, 1, 5], [150, 300, 63]
    kv = max(n + c for n, c in zip(lengths, counts))
    visible = torch.zeros(R, W, kv, dtype=torch.bool)
    for r in range(R):
        for w in range(counts[r]):
            visible[r, w, : lengths[r] + w + 1] = True
    visible[2, 4, 64] = False  # a tree query's hidden slot, the first of a page
    flat = kernel.attend(q, keys, values, visible, counts, kv, 0.125, path == "portable", path == "avx512")
    for page in (64, 128):
        pool_k, table = _paged(keys, page, seed=page)
        pool_v, _ = _paged(values, page, seed=page)
        out = kernel.attend(q, pool_k, pool_v, visible, counts, kv, 0.125, path == "portable", path == "avx512",
                            pages=table)
        assert torch.equal(out, flat), page


def test_bad_pages_are_refused(kernel):
    q, keys, values, visible, counts, kv = _case(2)
    table = torch.zeros(3, 1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernel.attend(q, keys, values, visible, counts, kv, 0.1, False, pages=table)  # 40 positions a page
    pool = torch.randn(2, 2, 64, 64)
    with pytest.raises(RuntimeError, match="a page past the pool"):
        kernel.attend(q, pool, pool, visible, counts, kv, 0.1, False, pages=table + 2)
    with pytest.raises(RuntimeError, match="pages"):
        kernel.attend(q, pool, pool, visible, counts, 65, 0.1, False, pages=table)  # 65 keys in one page
    with pytest.raises(RuntimeError, match="pages"):
        kernel.attend(q, pool, pool, visible, counts, kv, 0.1, False, pages=table.long())


def test_bad_attention_inputs_are_refused(kernel):
    q, keys, values, visible, counts, kv = _case(2)
    with pytest.raises(RuntimeError, match="one count a row"):
        kernel.attend(q, keys, values, visible, counts[:2], kv, 0.1, False)
    with pytest.raises(RuntimeError, match="kv past the cache"):
        kernel.attend(q, keys, values, None, counts, 41, 0.1, False)
    with pytest.raises(RuntimeError, match="visible"):
        kernel.attend(q, keys, values, visible[:, :, :5].contiguous(), counts, kv, 0.1, False)


# ----------------------------------------------------------------------------- whole models, per format

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
CONTINUATION = "    if n < 2:\n        return n\n    return fibonacci(n - 1)"


def _logits(model, prompt, tokens, chunks, beside=None):
    """Logits of `tokens` fed after `prompt` in pieces of `chunks` tokens, alone or beside a second row."""
    from draftwise.models.runner import ModelRunner

    runner = ModelRunner(model, rows=1 if beside is None else 2)
    runner.forward_rows(torch.tensor([prompt]), [len(prompt)], prompt=True)
    if beside is not None:
        runner.forward_rows(torch.tensor([beside]), [len(beside)], begin=1, prompt=True)
    out, at = [], 0
    for c in chunks:
        piece = tokens[at: at + c]
        at += c
        if beside is None:
            out.append(runner.forward_rows(torch.tensor([piece]), [c]).logits[0, :c])
        else:  # the other row verifies 3 tokens in the same forward
            ids = torch.zeros(2, max(c, 3), dtype=torch.long)
            ids[0, :c], ids[1, :3] = torch.tensor(piece), torch.tensor([11, 12, 13])
            out.append(runner.forward_rows(ids, [c, 3]).logits[0, :c])
    return torch.cat(out)


def _width_dependent(monkeypatch, model):
    """The control: a forward of more than one token sums its keys in reverse order (still attention, to the
    last bits): a width-dependent reduction."""
    from draftwise.models.runner import fast_model

    fast = fast_model(model)
    real = fast._attend

    def attend(q, keys, values, visible, counts, kv, scale, portable, pages=None):
        out = real(q, keys, values, visible, counts, kv, scale, portable, pages=pages)
        if sum(counts) == 1:
            return out
        G = q.shape[2] // keys.shape[1]

        def row(pool, b):  # [KVH, positions, D] of row b
            if pages is None:
                return pool[b]
            return torch.cat(list(pool[pages[b].long()].unbind(0)), dim=1)

        for b, c in enumerate(counts):
            for w in range(c):
                seen = visible[b, w, :kv]
                k = row(keys, b)[:, :kv][:, seen].flip(1).repeat_interleave(G, 0).float()  # [H, L, D]
                v = row(values, b)[:, :kv][:, seen].flip(1).repeat_interleave(G, 0).float()
                p = torch.softmax(torch.einsum("hld,hd->hl", k, q[b, w]) * scale, -1)
                out[b, w] = torch.einsum("hl,hld->hd", p, v)
        return out

    monkeypatch.setattr(fast, "_attend", attend)


@pytest.fixture(scope="module", params=["gguf", "fp32", pytest.param("bf16", marks=pytest.mark.slow), pytest.param("int8", marks=pytest.mark.slow)])
def smollm2(request):
    from draftwise.models.loading import load_model

    return load_model("smollm2-135m", dtype=request.param)


def _check(loaded):
    tokenizer = loaded.tokenizer
    prompt = tokenizer(PROMPT)["input_ids"]
    tokens = tokenizer(CONTINUATION)["input_ids"][:8]
    one = _logits(loaded.model, prompt, tokens, [1] * 8)
    for chunks in ([8], [2, 3, 3]):
        assert torch.equal(_logits(loaded.model, prompt, tokens, chunks), one), chunks
    assert torch.equal(_logits(loaded.model, prompt, tokens, [1] * 8, beside=tokenizer("Hello there")["input_ids"]), one)
    assert torch.equal(_logits(loaded.model, prompt, tokens, [4, 4], beside=[7]), one)  # beside a one-token prompt


def test_a_rows_logits_do_not_depend_on_the_forward_that_carries_them(smollm2):
    _check(smollm2)


def test_a_prompt_cut_into_chunks_gives_the_same_cache_and_logits(smollm2):
    """A batch's prompts are fed in chunks whose sizes depend on the other rows (engine._prompt_plan): a prompt fed
    whole and one fed 1, 6 and the rest at a time, beside another row's prompt, give the same bits."""
    from draftwise.models.runner import ModelRunner

    tokenizer = smollm2.tokenizer
    prompt = tokenizer(PROMPT)["input_ids"]
    follow = tokenizer(CONTINUATION)["input_ids"][:4]
    whole = ModelRunner(smollm2.model)
    first = whole.forward_rows(torch.tensor([prompt]), [len(prompt)], prompt=True).logits[0, -1]
    after = [whole.forward_rows(torch.tensor([[t]]), [1]).logits[0, 0] for t in follow]
    cut = ModelRunner(smollm2.model, rows=2)
    other = tokenizer("Hello there, how are you today?")["input_ids"]
    at = 0
    for size in (1, 6, len(prompt) - 7):
        ids = torch.zeros(2, max(size, len(other)), dtype=torch.long)
        ids[0, :size], ids[1, :len(other)] = torch.tensor(prompt[at: at + size]), torch.tensor(other)
        out = cut.forward_rows(ids, [size, len(other)], prompt=True) if at == 0 else \
            cut.forward_rows(ids[:1, :size], [size], prompt=True)
        at += size
    assert torch.equal(out.logits[0, size - 1], first)
    for t, expected in zip(follow, after):
        assert torch.equal(cut.forward_rows(torch.tensor([[t]]), [1]).logits[0, 0], expected)


def test_control_a_width_dependent_reduction_is_caught(smollm2, monkeypatch):
    _width_dependent(monkeypatch, smollm2.model)
    with pytest.raises(AssertionError):
        _check(smollm2)


@pytest.mark.slow
def test_the_pairs_target_in_its_blocks_is_batch_invariant():
    from draftwise.models.loading import load_model

    _check(load_model("qwen2.5-coder-1.5b"))


# ----------------------------------------------------------------------------- float weights (fp32, bf16, fp16)

def _rows_keep_their_bits(product, x, w) -> bool:
    """Every slice of rows of x (widths 1 .. 17, at the start and the end, and across the kernel's row blocks) gives
    the bits the whole of x gives those rows."""
    full = product(x, w)
    return all(torch.equal(product(x[start: start + width].contiguous(), w), full[start: start + width])
               for width in (1, 2, 3, 4, 5, 8, 16, 17, 40) for start in (0, 7, x.shape[0] - width))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_float_product_is_the_product_and_rows_never_depend_on_their_batch(kernel, dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(37, 136, generator=g).to(dtype)
    x = torch.randn(33, 136, generator=g)
    full = kernel.fmm(x, w, False)
    expected = x.double() @ w.double().T
    assert float((full.double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    assert float((kernel.fmm(x, w, True).double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    assert _rows_keep_their_bits(lambda a, b: kernel.fmm(a, b, False), x, w)


# 1536: the kernel takes activation rows in blocks of 64 over panels of 128 weight rows; 3072 (150 weight rows):
# blocks of 32 rows over several panels a thread
@pytest.mark.parametrize("n, k", [(37, 64), (37, 1536), (150, 3072)])
def test_the_bf16_product_is_the_product_and_rows_never_depend_on_their_batch(kernel, n, k):
    if not kernel.bf16_native():
        pytest.skip("bmm16 runs on CPUs with AVX512-BF16 only; this one has none")
    g = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(75, k, generator=g).bfloat16()
    expected = x.double() @ w.double().T  # bf16 products are exact in float32: only the float32 sums round
    assert float((kernel.bmm16(x, w).double() - expected).abs().max()) <= 1e-5 * float(expected.abs().max())
    assert _rows_keep_their_bits(kernel.bmm16, x, w)
    # the control: a product whose single rows take another order of sums is caught by the same check
    assert not _rows_keep_their_bits(
        lambda a, b: kernel.bmm16(a, b) if a.shape[0] > 1 else (a.float() @ b.float().T), x, w)


@pytest.mark.parametrize("n", [37, 40])
def test_bmm16_rounds_to_bf16_in_the_kernel_as_pytorch_rounds_the_float32_product(kernel, n):
    """bf16_out (with and without a bias): the bits of (y + bias).to(bf16), for ordinary outputs, outputs near
    1e31, and NaN; any number of output rows (a tile's last rows masked)."""
    if not kernel.bf16_native():
        pytest.skip("bmm16 runs on CPUs with AVX512-BF16 only; this one has none")
    g = torch.Generator().manual_seed(8)
    w = torch.randn(n, 96, generator=g).bfloat16()
    x = torch.randn(9, 96, generator=g).bfloat16()
    x[3] = 1e30
    x[5, 0] = float("nan")
    bias = torch.randn(n, generator=g) * 1e-3
    y = kernel.bmm16(x, w)
    for b, expected in ((None, y.bfloat16()), (bias, (y + bias).bfloat16())):
        fused = kernel.bmm16(x, w, b, True)
        finite = ~expected.isnan()
        assert fused.dtype == torch.bfloat16 and torch.equal(fused[finite], expected[finite])
        assert torch.equal(fused.isnan(), expected.isnan()) and bool(expected.isnan().any())
    # the control: rounding toward zero (truncation) differs from it on these outputs
    assert not torch.equal((y + bias).view(torch.int32).bitwise_right_shift(16).to(torch.int16)[finite],
                           fused.view(torch.int16)[finite])
    torch.testing.assert_close(kernel.bmm16(x, w, bias, False), y + bias, rtol=0, atol=0, equal_nan=True)


def test_bf16_products_run_bmm16_for_every_feed_where_the_cpu_has_avx512_bf16(kernel, monkeypatch):
    from draftwise.models.linear import FloatLinear

    monkeypatch.setenv("DRAFTWISE_BMM16", "1")
    linear = FloatLinear(torch.randn(40, 64).bfloat16(), torch.randn(40).bfloat16())
    if not kernel.bf16_native():
        assert linear._bf16 is None
        return
    x = torch.randn(3, 5, 64).bfloat16()
    expected = (kernel.bmm16(x.reshape(15, 64), linear.weight) + linear.bias.float()).bfloat16().reshape(3, 5, 40)
    assert torch.equal(linear(x), expected) and torch.equal(linear(x[1:2, 2:3]), expected[1:2, 2:3])
    monkeypatch.setenv("DRAFTWISE_BMM16", "0")
    assert FloatLinear(linear.weight)._bf16 is None  # off: fmm runs the bf16 weights in float32
    assert FloatLinear(torch.randn(40, 48).bfloat16())._bf16 is None  # 48 inputs: not a multiple of 32


def test_bf16_shapes_that_do_not_match_are_refused(kernel):
    if not kernel.bf16_native():
        with pytest.raises(RuntimeError, match="needs AVX512-BF16"):
            kernel.bmm16(torch.zeros(2, 32, dtype=torch.bfloat16), torch.zeros(4, 32, dtype=torch.bfloat16))
        return
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel.bmm16(torch.zeros(2, 48, dtype=torch.bfloat16), torch.zeros(4, 48, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous bf16"):
        kernel.bmm16(torch.zeros(2, 32), torch.zeros(4, 32, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norm_kernel_is_rms_norm_and_rows_never_depend_on_their_batch(kernel, dtype):
    g = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(40, 576, generator=g)).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    xd = x.double()
    expected = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    out = kernel.rmsnorm(x, w, 1e-5, False)
    bound = 2e-6 if dtype == torch.float32 else 8e-3  # bf16: the one rounding of the output
    assert out.dtype == dtype and float(((out.double() - expected).abs() / expected.abs().clamp(min=1)).max()) <= bound
    assert torch.equal(kernel.rmsnorm(x, w, 1e-5, True), out)  # the portable path: the same arithmetic, the same bits
    assert _rows_keep_their_bits(lambda a, b: kernel.rmsnorm(a, b, 1e-5, False), x, w)
    odd = x[:, :100].contiguous()  # 100: not a multiple of 8, the portable loop runs
    assert torch.allclose(kernel.rmsnorm(odd, w[:100].contiguous(), 1e-5, False).double(),
                          (odd.double() / torch.sqrt(odd.double().pow(2).mean(-1, keepdim=True) + 1e-5)
                           * w[:100].double()), rtol=bound, atol=bound)
    with pytest.raises(RuntimeError, match="x's type"):
        kernel.rmsnorm(x, w.double(), 1e-5, False)


def test_float_shapes_that_do_not_match_are_refused(kernel):
    with pytest.raises(RuntimeError, match="K as x's"):
        kernel.fmm(torch.randn(2, 16), torch.randn(4, 8), False)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        kernel.fmm(torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), False)


def test_greedy_methods_write_ars_tokens_on_a_bf16_cache():
    """A bf16 target keeps a bf16 KV cache: greedy `sd` (a draft model and the target itself as draft),
    `prompt-lookup` and `suffix` write `ar`'s tokens, token for token, in a ragged batch (a one-token prompt
    among them) and each row alone."""
    import copy

    import draftwise
    from conftest import tiny_llama
    from draftwise.models.runner import fast_model

    if qkernel.load() is None:
        pytest.skip(f"draftwise's kernel is not built here: {qkernel.problem()}")
    target = tiny_llama(0, layers=3).to(torch.bfloat16)
    draft = tiny_llama(1, layers=1).to(torch.bfloat16)
    assert fast_model(target).cache_dtype == torch.bfloat16
    prompts = [[5], [3, 9, 3, 9, 3, 9, 12, 7], list(range(1, 30)), [7, 7, 7, 2]]
    kwargs = dict(temperature=0, max_new_tokens=24, ignore_eos=True)
    ar = [r.token_ids for r in draftwise.generate(target, prompts, method="ar", **kwargs)]
    alone = [draftwise.generate(target, p, method="ar", **kwargs).token_ids for p in prompts]
    assert ar == alone
    for method, extra in (("sd", dict(draft=draft)), ("sd", dict(draft=copy.deepcopy(target))),
                          ("prompt-lookup", {}), ("suffix", {})):
        got = [r.token_ids for r in draftwise.generate(target, prompts, method=method, **extra, **kwargs)]
        assert got == ar, method
