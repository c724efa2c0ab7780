"""draftwise's kernel for weights in their GGUF codes (models/qkernel.py, csrc/qmm.cpp) and the loader that keeps a
file in its codes (models/gguf_codes.py).

- The product equals the float product of the exactly dequantised weights (float64 reference, fp32 rounding), for
  every code kind, and a row's result is bitwise the same whatever the number of rows in the product (1..33).
- The portable loop and the AVX2 path agree within fp32 rounding.
- SmolLM2's shipped Q4_1 file loaded in its codes (Llama: q and k rows reordered from llama.cpp's layout) gives the
  dequantising loader's logits within fp32 rounding and its greedy tokens; with the row order left as stored (the
  negative control) it does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftwise.models import formats, linear as linears, qkernel
from draftwise.models.quant import _OFFSET, _decode

from test_kquants import random_blocks

KINDS = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q8_0": 32, "q4_k": 256, "q6_k": 256}


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if not qkernel.available():
        pytest.fail(f"the codes kernel is not built: {qkernel.problem()} (make install builds it)")


def _linear(kind: str, rows: int, inputs: int, seed: int = 0) -> tuple[linears.CodesLinear, torch.Tensor]:
    tensor = _decode(kind, random_blocks(kind, rows, inputs // KINDS[kind], seed=seed))
    linear = linears.CodesLinear(kind, tensor.codes, tensor.scales, tensor.zeros, tensor.group, _OFFSET[kind],
                                 None, torch.float32)
    return linear, tensor.dequantized()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_product_is_the_dequantised_product_and_rows_never_depend_on_their_batch(kind):
    linear, weights = _linear(kind, 36, 512)
    assert torch.equal(linear.dequantized(), weights)
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(1))
    full = linear(x)
    reference = x.double() @ weights.double().T
    assert float((full.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())
    for width in (1, 2, 5, 8, 16, 17):
        for start in (0, 33 - width):
            assert torch.equal(linear(x[start: start + width]), full[start: start + width]), (width, start)


def test_the_portable_loop_agrees_with_the_avx2_path():
    linear, _ = _linear("q4_k", 8, 256)
    x = torch.randn(3, 256)
    fast = qkernel.load().qmm(x, linear.codes, linear.bits, linear.scales, linear.zeros, linear.group, False)
    portable = qkernel.load().qmm(x, linear.codes, linear.bits, linear.scales, linear.zeros, linear.group, True)
    assert torch.allclose(fast, portable, rtol=1e-5, atol=1e-5 * float(portable.abs().max()))


def test_bad_shapes_are_refused_by_the_kernel():
    linear, _ = _linear("q8_0", 4, 64)
    with pytest.raises(RuntimeError, match="codes do not match K"):
        qkernel.load().qmm(torch.randn(2, 96), linear.codes, 8, linear.scales, None, 32, False)


def test_joined_parts_share_their_codes_and_equal_the_parts():
    a, wa = _linear("q4_k", 8, 256, seed=1)
    b, wb = _linear("q4_k", 4, 256, seed=2)
    c, wc = _linear("q6_k", 4, 256, seed=3)
    same = linears.joined([a, b])
    assert isinstance(same, linears.CodesLinear) and a.codes.data_ptr() == same.codes.data_ptr()  # views
    mixed = linears.joined([same, c])
    assert isinstance(mixed, linears.JoinedLinear)
    x = torch.randn(2, 256)
    assert torch.equal(mixed(x), torch.cat([a(x), b(x), c(x)], -1))
    assert torch.equal(mixed.dequantized(), torch.cat([wa, wb, wc]))


def test_an_embedding_in_codes_reads_its_rows():
    linear, weights = _linear("q4_k", 40, 256)
    embedding = linears.CodesEmbedding(linear, torch.float32)
    ids = torch.tensor([[3, 0, 39], [7, 7, 1]])
    assert torch.equal(embedding(ids), weights[ids])


# ----------------------------------------------------------------------------- a file's own blocks (int8 activations)

BLOCK_KINDS = ("q4_k", "q6_k", "q5_0", "q8_0")


def _blocks(kind: str, rows: int, inputs: int, seed: int = 0) -> tuple[linears.BlockLinear, torch.Tensor]:
    raw = random_blocks(kind, rows, inputs // KINDS[kind], seed=seed)
    return linears.BlockLinear(kind, torch.from_numpy(raw), inputs), _decode(kind, raw).dequantized()


def _reference(kind: str, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The exact product (float64) of the dequantised weights with the activations as the kernel quantises them."""
    quantised = qkernel.load().quantised_activations(x.contiguous(), linears.BLOCK_KINDS[kind][1])
    return quantised.double() @ weights.double().T


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_a_block_product_is_the_exact_product_with_int8_activations_and_rows_never_depend_on_their_batch(kind):
    linear, weights = _blocks(kind, 37, 512)
    assert torch.equal(linear.dequantized(), weights)  # rows() decodes as gguf's reference (test_kquants)
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(1))
    full = linear(x)
    reference = _reference(kind, x, weights)
    scale = float(reference.abs().max())
    assert float((full.double() - reference).abs().max()) <= 1e-5 * scale
    # control: the float activations' product is farther from it than the tolerance (the check sees quantisation)
    assert float((x.double() @ weights.double().T - reference).abs().max()) > 1e-4 * scale
    for width in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 25, 33):  # every tile split: 8, 4, 3, 2, 1 rows
        for start in (0, 33 - width):
            assert torch.equal(linear(x[start: start + width]), full[start: start + width]), (width, start)


@pytest.mark.parametrize("kind", ("q5_0", "q8_0"))
def test_an_odd_number_of_32_weight_blocks_keeps_each_rows_bits(kind):
    """A Q5_0 / Q8_0 row's sum runs as two chains (even and odd blocks); 15 blocks leave the even chain one longer.
    Narrow passes (up to 4 rows) take the chains side by side, wider ones one after the other: the same bits."""
    linear, weights = _blocks(kind, 21, 480, seed=3)
    x = torch.randn(19, 480, generator=torch.Generator().manual_seed(4))
    full = linear(x)
    reference = _reference(kind, x, weights)
    assert float((full.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())
    for width in (1, 2, 3, 4, 5, 8, 9, 19):
        for start in (0, 19 - width):
            assert torch.equal(linear(x[start: start + width]), full[start: start + width]), (width, start)


@pytest.mark.parametrize("kind", ("q4_k", "q6_k"))
def test_wide_block_products_taken_in_row_groups_keep_each_rows_bits(kind):
    """4096 inputs: the kernel takes the rows in groups of 64 (their activations stay in L2), so 150 rows make
    three groups; every row keeps the bits it has alone or in a narrow product."""
    linear, weights = _blocks(kind, 24, 4096, seed=5)
    x = torch.randn(150, 4096, generator=torch.Generator().manual_seed(2))
    full = linear(x)
    for start, width in ((0, 1), (63, 2), (64, 8), (100, 50), (149, 1)):
        assert torch.equal(linear(x[start: start + width]), full[start: start + width]), (start, width)
    reference = _reference(kind, x, weights)
    assert float((full.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_the_block_kernels_portable_loop_agrees_with_the_avx2_path(kind):
    linear, weights = _blocks(kind, 16, 512, seed=4)
    x = torch.randn(5, 512)
    fast = qkernel.load().qmm_blocks(x, linear.blocks, linear.kind_id, 512, False)
    portable = qkernel.load().qmm_blocks(x, linear.blocks, linear.kind_id, 512, True)
    assert float((fast - portable).abs().max()) <= 1e-5 * float(portable.abs().max())
    assert float((portable.double() - _reference(kind, x, weights)).abs().max()) <= 1e-5 * float(portable.abs().max())


def _assert_fast_path_gives_the_avx2_paths_bits(module, kind: str) -> None:
    """qmm_blocks with its VNNI paths allowed against the plain AVX2 path: the same bits for every width and tile
    split (8-row, 4-row and single-row groups), rows of all-extreme activations (codes of +-127) and tiny rows too."""
    linear, _ = _blocks(kind, 40, 1024, seed=7)
    x = torch.randn(29, 1024, generator=torch.Generator().manual_seed(2))
    x[3] = torch.where(torch.arange(1024) % 3 == 0, -5.0, 5.0)  # every code +-127
    x[4] = 1e-30  # a tiny row
    for width in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 29):
        rows = x[:width].contiguous()
        fast = module.qmm_blocks(rows, linear.blocks, linear.kind_id, 1024, False, True)
        avx2 = module.qmm_blocks(rows, linear.blocks, linear.kind_id, 1024, False, False)
        assert torch.equal(fast, avx2), width


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_the_avx_vnni_path_gives_the_avx2_paths_bits(kind):
    """Where the CPU has AVX-VNNI (256-bit vpdpbusd / vpdpwssd), the AVX2 kernels run with those instructions: the
    same int32 lanes, so the same bits for every width and tile split, extreme codes included. Q4_K and Q6_K take
    it only without AVX512-VNNI (or with DRAFTWISE_AVX512=0); Q5_0 and Q8_0 wherever AVX-VNNI is."""
    module = qkernel.load()
    if not module.blocks_avxvnni():
        pytest.skip("no AVX-VNNI here (or DRAFTWISE_AVXVNNI=0)")
    if kind in ("q4_k", "q6_k") and module.blocks_vnni():
        pytest.skip("AVX512-VNNI takes the K-quants here (run with DRAFTWISE_AVX512=0 to test this path)")
    _assert_fast_path_gives_the_avx2_paths_bits(module, kind)


@pytest.mark.parametrize("kind", ("q4_k", "q6_k"))
def test_the_vnni_path_gives_the_avx2_paths_bits(kind):
    """Where the CPU has AVX512-VNNI, Q4_K and Q6_K blocks are summed four products an instruction: the integer
    lanes are the AVX2 path's exactly, so every row of every width (8-row, 4-row and single-row groups) is the
    same bits on both paths; rows of all-extreme activations (codes of +-127) too."""
    module = qkernel.load()
    if not module.blocks_vnni():
        pytest.skip("no AVX512-VNNI here (or DRAFTWISE_AVX512=0)")
    _assert_fast_path_gives_the_avx2_paths_bits(module, kind)


def test_the_vnni_path_runs_where_the_cpu_has_it():
    import os

    with open("/proc/cpuinfo") as info:
        flags = next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    has = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"} <= flags
    assert qkernel.load().blocks_vnni() == (has and os.environ.get("DRAFTWISE_AVX512", "1") != "0")


def test_the_avx_vnni_path_runs_where_the_cpu_has_it():
    import os

    with open("/proc/cpuinfo") as info:
        flags = next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    has = {"avx_vnni", "avx2", "fma", "f16c"} <= flags
    assert qkernel.load().blocks_avxvnni() == (has and os.environ.get("DRAFTWISE_AVXVNNI", "1") != "0")


def test_block_shapes_that_do_not_match_are_refused():
    linear, _ = _blocks("q4_k", 4, 512)
    with pytest.raises(RuntimeError, match="x has 256 inputs"):
        qkernel.load().qmm_blocks(torch.randn(2, 256), linear.blocks, 0, 512, False)
    with pytest.raises(ValueError, match="do not hold 256 inputs"):
        linears.BlockLinear("q4_k", linear.blocks, 256)
    with pytest.raises(ValueError, match="the block kernel takes"):
        linears.BlockLinear("q4_1", linear.blocks, 512)


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_dequantised_blocks_are_the_reference_weights_rounded_to_bf16(kind):
    linear, weights = _blocks(kind, 9, 512, seed=5)
    got = qkernel.load().dequantised_blocks(linear.blocks, linear.kind_id, 512)
    assert got.dtype == torch.bfloat16 and torch.equal(got, weights.to(torch.bfloat16))


@pytest.mark.parametrize("kind", ["q4_k", "q6_k"])
def test_bf16_prompt_feeds_run_the_blocks_weights_in_bf16_and_every_other_feed_the_blocks(kind, monkeypatch):
    """A prompt feed of bf16 activations (wide) runs bmm16 on the weights rounded to bf16; decoding and verification
    feeds run the blocks; a mixed feed (wide = n) gives each part the bits it has alone, where DRAFTWISE_PROMPT_BF16=1
    asks for it; by default (and with float32 activations) prompts keep the blocks."""
    kernel = qkernel.load()
    if not kernel.bf16_native():
        pytest.skip("bmm16 runs on CPUs with AVX512-BF16 only; this one has none")
    monkeypatch.setenv("DRAFTWISE_PROMPT_BF16", "1")
    linear, weights = _blocks(kind, 40, 512, seed=6)
    linear.bias = torch.randn(40, generator=torch.Generator().manual_seed(2))
    x = torch.randn(12, 512, generator=torch.Generator().manual_seed(3)).bfloat16()
    blocks = (kernel.qmm_blocks(x.float(), linear.blocks, linear.kind_id, 512, False) + linear.bias).bfloat16()
    prompt = (kernel.bmm16(x, weights.bfloat16()) + linear.bias).bfloat16()
    assert not torch.equal(blocks, prompt)  # the two paths give different bits: the checks below see which ran
    assert torch.equal(linear(x), blocks)
    assert torch.equal(linear(x, True), prompt)
    mixed = linear(x, 5)  # packed tokens 5 on are prompt tokens
    assert torch.equal(mixed[:5], blocks[:5]) and torch.equal(mixed[5:], prompt[5:])
    assert torch.equal(linear(x, 0), prompt) and torch.equal(linear(x, 12), blocks)
    for i in (0, 6, 11):  # a prompt token's bits do not depend on its batch-mates
        assert torch.equal(linear(x[i: i + 1], True), prompt[i: i + 1])
    assert torch.equal(linear(x.float(), True),
                       kernel.qmm_blocks(x.float(), linear.blocks, linear.kind_id, 512, False) + linear.bias)
    fused = linears.joined([linear, _blocks("q6_k" if kind == "q4_k" else "q4_k", 8, 512, seed=7)[0]])
    assert torch.equal(fused(x, True)[:, :40], prompt)  # a joined projection passes the feed's kind to its parts
    monkeypatch.delenv("DRAFTWISE_PROMPT_BF16")  # the default: no bf16 copy, prompts run the blocks
    assert torch.equal(linear(x, True), blocks)


@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q8_0", "q4_1"])
def test_a_heads_output_rows_cut_to_a_draft_vocabulary_keep_their_bits(kind):
    """`subset(ids)` (a draft's restricted output vocabulary on a head in its codes or blocks) keeps those rows' codes
    byte for byte: its product is the full product's columns ids (bit for bit on the blocks), with the bias; a
    control with the ids shifted is caught."""
    if kind in BLOCK_KINDS:
        linear, _ = _blocks(kind, 40, 512, seed=8)
    else:
        linear, _ = _linear(kind, 40, 512, seed=8)
    linear.bias = torch.randn(40, generator=torch.Generator().manual_seed(4))
    ids = torch.tensor([0, 3, 4, 17, 21, 38])
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(5))
    cut = linear.subset(ids)
    assert cut.out_features == len(ids) and cut.in_features == 512
    if kind in BLOCK_KINDS:  # every output row of the block kernel is its own sum: the same bits
        assert torch.equal(cut(x), linear(x)[:, ids])
    else:  # the codes kernel takes output rows in tiles: the same product up to float32 rounding
        torch.testing.assert_close(cut(x), linear(x)[:, ids], rtol=1e-6, atol=1e-5)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(linear.subset(ids + 1)(x), linear(x)[:, ids], rtol=1e-6, atol=1e-5)


def test_joined_blocks_fuse_runs_of_one_kind():
    """A Q4_K_M layer's q and k (Q4_K) share one product, its v (Q6_K) has its own; the result is the parts'."""
    q, _ = _blocks("q4_k", 8, 256, seed=1)
    k, _ = _blocks("q4_k", 4, 256, seed=2)
    v, _ = _blocks("q6_k", 4, 256, seed=3)
    x = torch.randn(3, 256)
    expected = torch.cat([q(x), k(x), v(x)], -1)
    fused = linears.joined([q, k, v])
    assert isinstance(fused, linears.JoinedLinear) and [p.out_features for p in fused.parts] == [12, 4]
    assert q.blocks.data_ptr() == fused.parts[0].blocks.data_ptr()  # a view: one copy of the bytes
    assert torch.equal(fused(x), expected)


def test_the_tensor_table_reader_sees_what_ggufs_reader_sees():
    """gguf_codes._File (which steps over the metadata) against gguf.GGUFReader on the shipped SmolLM2 file:
    every tensor's kind, shape and bytes."""
    from gguf import GGUFReader

    from draftwise.models import registry
    from draftwise.models.gguf_codes import _File

    path = registry.entry("smollm2-135m").gguf()
    ours = _File(path)
    theirs = GGUFReader(str(path))
    assert len(ours.by_name) == len(theirs.tensors)
    for t in theirs.tensors:
        kind, data, shape = ours[t.name]
        assert kind == t.tensor_type.name.lower() and shape == tuple(int(d) for d in t.shape), t.name
        assert np.array_equal(data, np.asarray(t.data)), t.name


# ----------------------------------------------------------------------------- a real file in its codes

@pytest.fixture(scope="module")
def smollm2_both():
    from draftwise.models import loading

    # fp32 activations for the codes too, on every CPU: 'gguf' runs bf16 activations where the CPU has native bf16
    # (AVX512-BF16, AMX), and the comparison with the fp32 dequantised model is of the weights, not of bf16 rounding
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "cpu_has_native_bf16", lambda: False)
        return loading.load_model("smollm2-135m", dtype="gguf"), loading.load_model("smollm2-135m", dtype="fp32")


def _logits(loaded, ids):
    with torch.inference_mode():
        return loaded.model(torch.tensor([ids])).logits[0].double()


def test_a_warm_load_reads_the_codes_cache_and_equals_the_first(smollm2_both, monkeypatch, tmp_path):
    """The first load decodes the file into a cache entry; the second reads it, decodes nothing, and gives the
    same logits bit for bit."""
    from draftwise.models import gguf_codes
    from draftwise.models.loading import load_model

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    first = load_model("smollm2-135m", dtype="gguf")
    monkeypatch.setattr(gguf_codes, "_decode", lambda *a: pytest.fail("a warm load decoded the file"))
    second = load_model("smollm2-135m", dtype="gguf")
    ids = first.tokenizer("x = [1, 2, 3]")["input_ids"]
    assert torch.equal(_logits(first, ids), _logits(second, ids))
    assert len(list((tmp_path / "models").glob("smollm2-135m-codes-*/codes.safetensors"))) == 1


def test_the_shipped_file_in_its_codes_is_the_dequantised_model(smollm2_both):
    import draftwise

    codes, dequantized = smollm2_both
    assert formats.of(codes.model).codes and "gguf codes" in codes.weights
    assert not any(isinstance(m, torch.nn.Linear) for m in codes.model.modules())  # no float projection kept
    ids = codes.tokenizer("def add(a, b):\n    return")["input_ids"]
    a, b = _logits(codes, ids), _logits(dequantized, ids)
    assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max())
    kwargs = dict(method="ar", temperature=0, max_new_tokens=16, ignore_eos=True)
    assert draftwise.generate(codes, ids, **kwargs).token_ids == draftwise.generate(dequantized, ids, **kwargs).token_ids


def test_control_the_files_row_order_left_as_stored_is_caught(smollm2_both, monkeypatch, tmp_path):
    from draftwise.models import gguf_codes
    from draftwise.models.loading import load_model

    _, dequantized = smollm2_both
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))  # a cache of its own: the codes are decoded again
    monkeypatch.setattr(gguf_codes, "_llama_order", lambda rows, heads: torch.arange(rows))
    wrong = load_model("smollm2-135m", dtype="gguf")
    ids = wrong.tokenizer("def add(a, b):\n    return")["input_ids"]
    a, b = _logits(wrong, ids), _logits(dequantized, ids)
    assert float((a - b).abs().max()) > 1e-2 * float(b.abs().max())


def test_a_gguf_draft_of_a_target_in_codes_loads_in_codes_without_a_float_copy(smollm2_both, monkeypatch, tmp_path):
    """In a cache where no float copy exists, the draft is resolved and loaded without making one."""
    from draftwise.models import registry
    from draftwise.models import loading
    from draftwise.heads.loading import load_draft

    codes, _ = smollm2_both
    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: False)  # the activations the fixture's target has
    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path))
    monkeypatch.setattr(registry, "convert_gguf", lambda *a, **k: pytest.fail("a float copy was made"))
    draft = load_draft("smollm2-135m", codes)
    assert formats.of(draft.model).codes and draft.dtype == codes.dtype


@pytest.mark.slow
def test_the_pair_runs_from_its_blocks_with_no_cache_entry_and_sd_writes_ars_tokens():
    """The Q4_K_M pair loads in its blocks straight from the files (no codes cache entry written), and at T=0 `sd`
    with the 0.5B, alone and beside a one-token prompt, writes `ar`'s tokens."""
    import draftwise
    from draftwise.models.cache import cache_root
    from draftwise.heads.loading import load_draft
    from draftwise.models.loading import load_model

    entries = lambda: sorted((cache_root() / "models").glob("qwen2.5-coder-*-codes-*"))  # noqa: E731
    before = entries()
    target = load_model("qwen2.5-coder-1.5b")
    assert target.weights.startswith("gguf blocks (") and "q6_k" in target.weights
    assert entries() == before
    draft = load_draft("qwen2.5-coder-0.5b", target)
    assert "gguf blocks" in draft.weights
    ids = target.tokenizer("def quicksort(items):\n")["input_ids"]
    kwargs = dict(temperature=0, max_new_tokens=24, ignore_eos=True)
    ar = draftwise.generate(target, ids, method="ar", **kwargs).token_ids
    assert draftwise.generate(target, ids, method="sd", draft=draft, **kwargs).token_ids == ar
    batch = draftwise.generate(target, [ids, ids[:1]], method="sd", draft=draft, **kwargs)
    assert batch[0].token_ids == ar


def test_a_gguf_the_codes_path_cannot_serve_falls_back_to_the_dequantising_loader(smollm2_both, monkeypatch):
    """The codes loader's Unsupported (here: the kernel not built) means "use the other loader", not a damaged
    file: dtype="gguf" still loads, from the dequantised copy, and gives its logits."""
    from draftwise.models import gguf_codes, loading

    def unsupported(*args, **kwargs):
        raise gguf_codes.Unsupported("the codes kernel is not built (test)")

    monkeypatch.setattr(gguf_codes, "load", unsupported)
    loaded = loading.load_model("smollm2-135m", dtype="gguf")
    assert not formats.of(loaded.model).codes
    ids = loaded.tokenizer("x = 1")["input_ids"]
    assert _logits(loaded, ids).shape[-1] == _logits(smollm2_both[1], ids).shape[-1]


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_packed_rows_give_the_portable_loops_bits_for_every_width(kind):
    """Where AVX512-VNNI is, a file's rows are regrouped 16 to a vector at the first product (`pack_blocks`; Q5_0 and
    Q8_0 codes made unsigned, their offset taken back with the activations' block sums): each block's integer sums are
    the same exact integers and are taken to float by the portable loop's steps in its order, so every row of every
    width (tiles of 8 and the rest), extreme and tiny rows too, is the portable loop's bits. A BlockLinear whose rows
    are a multiple of 16 takes this path; 40 rows keep the file's blocks."""
    module = qkernel.load()
    if not module.blocks_packed():
        pytest.skip("no AVX512-VNNI here (or DRAFTWISE_PACKED=0 / DRAFTWISE_AVX512=0)")
    linear, weights = _blocks(kind, 48, 1024, seed=7)
    x = torch.randn(29, 1024, generator=torch.Generator().manual_seed(2))
    x[3] = torch.where(torch.arange(1024) % 3 == 0, -5.0, 5.0)  # every code +-127
    x[4] = 1e-30  # a tiny row
    packed = module.pack_blocks(linear.blocks, linear.kind_id, 1024)
    per, size = {"q4_k": (256, 2368), "q6_k": (256, 3616), "q5_0": (32, 352), "q8_0": (32, 544)}[kind]
    assert packed.shape == (3, 1024 // per, size)
    for width in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 17, 29):
        rows = x[:width].contiguous()
        portable = module.qmm_blocks(rows, linear.blocks, linear.kind_id, 1024, True)
        assert torch.equal(module.qmm_packed(rows, packed, linear.kind_id, 1024), portable), width
        assert torch.equal(linear(rows), portable), width
    assert linear._packed is not None  # the linear took the packed path
    reference = _reference(kind, x, weights)
    assert float((linear(x).double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())
    # control: one scale byte changed in the packing is seen
    scale = {"q4_k": 2048 + 16 * 3 + 10, "q6_k": 3072 + 16 * 3 + 10, "q5_0": 320 + 11, "q8_0": 512 + 11}[kind]
    packed[1, 2, scale] ^= 1  # Q4_K / Q6_K: a 6-bit / 8-bit scale; Q5_0 / Q8_0: d's low byte
    assert not torch.equal(module.qmm_packed(x, packed, linear.kind_id, 1024), linear(x))
    odd, _ = _blocks(kind, 40, 1024, seed=7)
    odd(x[:2])
    assert odd._packed is None


def test_packed_rows_refuse_what_they_cannot_take():
    module = qkernel.load()
    linear, _ = _blocks("q4_k", 40, 512)
    with pytest.raises(RuntimeError, match="groups of 16"):
        module.pack_blocks(linear.blocks, 0, 512)
    with pytest.raises(RuntimeError, match="not kind 4"):
        module.pack_blocks(linear.blocks[:32].contiguous(), 4, 512)
    if module.blocks_packed():
        packed = module.pack_blocks(linear.blocks[:32].contiguous(), 0, 512)
        with pytest.raises(RuntimeError, match="x has 256 inputs"):
            module.qmm_packed(torch.randn(2, 256), packed, 0, 512)


def test_kernel_rates_time_the_path_a_model_takes_beside_the_file_blocks():
    from draftwise.bench import kernel_rates as rates

    module = qkernel.load()
    lines = []
    rows = rates.kernel_rates(module, ["q8_0"], [1, 3], 1, 100.0, progress=lines.append)
    paths = {row["path"] for row in rows}
    assert paths == ({"blocks", "packed"} if module.blocks_packed() else {"blocks"})
    assert len(rows) == 2 * len(paths) and all(row["ms"] > 0 and row["gmacs"] > 0 for row in rows)
    assert len(lines) == 1 and lines[0].startswith("q8_0")


@pytest.mark.parametrize("kind", BLOCK_KINDS)
def test_packed_rows_unpack_to_the_files_bytes_and_replace_them(kind):
    """`unpack_blocks` is `pack_blocks`'s inverse, byte for byte, for any row subset. Once a BlockLinear has packed
    its rows it keeps only them: row lookups (an embedding tied to the LM head), subsets (a draft vocabulary) and the
    blocks themselves are rebuilt from them, the same as before; a fused projection's parts read the fused rows."""
    module = qkernel.load()
    linear, _ = _blocks(kind, 48, 512, seed=11)
    raw = linear.blocks.clone()
    packed = module.pack_blocks(raw, linear.kind_id, 512)
    index = torch.tensor([47, 0, 16, 5, 5, 31])
    assert torch.equal(module.unpack_blocks(packed, linear.kind_id, 512, torch.arange(48)), raw)
    assert torch.equal(module.unpack_blocks(packed, linear.kind_id, 512, index), raw[index])
    with pytest.raises(RuntimeError, match="row 48 is not one of 48"):
        module.unpack_blocks(packed, linear.kind_id, 512, torch.tensor([48]))
    before_rows, x = linear.rows(index), torch.randn(3, 512)
    before = linear(x)
    if not module.blocks_packed():
        return
    assert linear._blocks is None and linear._packed is not None  # the packed rows are the only copy now
    assert torch.equal(linear.blocks, raw) and torch.equal(linear.rows(index), before_rows)
    sub = linear.subset(index)
    assert torch.equal(sub.blocks, raw[index])
    # a fused projection: the parts hold no copy, and read the fused rows, packed or not
    a, _ = _blocks(kind, 32, 512, seed=12)
    b, _ = _blocks(kind, 16, 512, seed=13)
    first, second = a.blocks.clone(), b.blocks.clone()
    fused = linears.joined([a, b])
    assert a._blocks is None and torch.equal(b.blocks, second)
    fused(x)
    assert fused._blocks is None
    assert torch.equal(a.blocks, first) and torch.equal(b.blocks, second)
    assert torch.equal(b.rows(torch.tensor([3])), linears.BlockLinear(kind, second, 512).rows(torch.tensor([3])))
    assert torch.equal(linear(x), before)
