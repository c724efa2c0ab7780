"""fp32 logits everywhere (issue 51, item 3): the LM head writes float32 whatever the activations.

bf16 logits are a coarser model than the one loaded: their steps are 2^-8 of the value (6-13% in probability at
the logits' usual sizes) and they tie exactly where the model does not (SmolLM2 tied "L" and "The" for its first
answer token and answered "L'Étoile"). What is proven here:

- every projection class the fast forward runs as an LM head (float weights through draftwise's kernel or
  without it, int8, int4, GGUF codes, a file's own blocks, joined parts), called as a head (`logits=True`) on bf16
  activations, returns float32 equal to the float64 product of the weights it holds, within float32 rounding; as a
  decoder projection it still returns the activations' type;
- a runner's logits are float32 for every format and activation type the fast forward takes, on the generic path
  (Llama with the fast path off; GPT-2) and through a draft's restricted output vocabulary (float rows, or rows of a
  head in its codes: the full head's columns);
- on SmolLM2 loaded as a CPU with native bf16 loads it by default (its GGUF codes, bf16 activations), fast path and
  generic path, the logits show no exact tie among any position's top 8 that a float64 reference from the same
  final states and the head's own weights lacks; the same logits rounded to bf16 (the negative control) are caught
  by the same check. `slow`: the same on Qwen2.5-Coder-1.5B (its blocks, int8 activations in the head's product).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import tiny_gpt2, tiny_llama
from draftwise.models import linear as linears, loading, qkernel
from draftwise.models.linear import FloatLinear, Int4Linear, Int8Linear, float32_product
from draftwise.models.quant import GROUP, _OFFSET, _decode
from draftwise.models.runner import ModelRunner

from test_kquants import random_blocks

TOP = 8  # ties are counted among each position's TOP largest logits
FP32 = 1e-5  # float32 rounding of a sum of a few hundred products, relative to its largest magnitude


def _error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


# ------------------------------------------------------------------ each projection class as an LM head

def _x(inputs: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, inputs, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _check_head(linear, weights: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                activations: torch.Tensor | None = None) -> None:
    """`linear` as a head: float32, the float64 product of `weights` (and `bias`) with `activations` (x unless the
    kernel quantises them) within float32 rounding; as a projection: x's type."""
    y = linear(x, logits=True)
    assert y.dtype == torch.float32 and y.shape == (*x.shape[:-1], weights.shape[0])
    a = (x if activations is None else activations).double()
    reference = a @ weights.double().T + (0 if bias is None else bias.double())
    assert _error(y, reference) < FP32
    assert linear(x).dtype == x.dtype


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("invariant", ["1", "0"])
def test_a_float_head_writes_float32(weight_dtype, invariant, monkeypatch):
    """FloatLinear through draftwise's kernel (fmm) and without it (DRAFTWISE_INVARIANT=0: `float32_product`)."""
    monkeypatch.setenv("DRAFTWISE_INVARIANT", invariant)
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(40, 64, generator=gen).to(weight_dtype)
    bias = torch.randn(40, generator=gen).to(weight_dtype)
    linear = FloatLinear(weights, bias)
    assert (linear._invariant is not None) == (invariant == "1" and qkernel.available())
    _check_head(linear, weights, bias, _x(64).to(weight_dtype))  # activations in the weights' type, as in a model


def test_float32_product_widens_a_large_head_a_slice_at_a_time(monkeypatch):
    """More rows than one slice: the slices' products side by side are the whole product; gradients reach x."""
    from draftwise.models import linear

    monkeypatch.setattr(linear, "WIDEN_ELEMENTS", 64 * 7)  # slices of 7 rows
    gen = torch.Generator().manual_seed(2)
    weights = torch.randn(30, 64, generator=gen).to(torch.bfloat16)
    bias = torch.randn(30, generator=gen).to(torch.bfloat16)
    x = _x(64).requires_grad_()
    y = float32_product(x, weights, bias)
    assert y.dtype == torch.float32
    assert _error(y, x.double() @ weights.double().T + bias.double()) < FP32
    y.sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_an_int8_head_writes_float32():
    gen = torch.Generator().manual_seed(3)
    linear = Int8Linear.quantize(torch.randn(40, 64, generator=gen).to(torch.bfloat16),
                                 torch.randn(40, generator=gen).to(torch.bfloat16))
    weights = linear.qweight.double() * linear.scales.double()[:, None]
    _check_head(linear, weights, linear.bias, _x(64))


def test_an_int4_head_writes_float32():
    """PyTorch's int4 kernel (where draftwise's is not built): the codes with the scales and zeros as held."""
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (48, 128), generator=gen)
    scales = torch.rand(48, 128 // GROUP, generator=gen) * 0.05 + 0.01
    zeros = torch.randn(48, 128 // GROUP, generator=gen) * 0.1
    linear = Int4Linear(codes, scales, zeros, GROUP, torch.randn(48, generator=gen), torch.bfloat16)
    held = linear.scales_zeros.double()  # [in / group, out, 2] as the kernel holds them (bf16 here)
    weights = (codes.double() - 8) * held[..., 0].T.repeat_interleave(GROUP, 1) \
        + held[..., 1].T.repeat_interleave(GROUP, 1)
    _check_head(linear, weights, linear.bias, _x(128))


@pytest.fixture(scope="module")
def kernel():
    if not qkernel.available():
        pytest.fail(f"the codes kernel is not built: {qkernel.problem()} (make install builds it)")


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "q6_k"])
def test_a_head_in_codes_writes_float32(kind, kernel):
    per = 256 if kind.endswith("_k") else 32
    tensor = _decode(kind, random_blocks(kind, 40, 512 // per, seed=5))
    bias = torch.randn(40, generator=torch.Generator().manual_seed(5))
    linear = linears.CodesLinear(kind, tensor.codes, tensor.scales, tensor.zeros, tensor.group, _OFFSET[kind],
                                 bias, torch.float32)
    _check_head(linear, tensor.dequantized(), bias, _x(512))


@pytest.mark.parametrize("kind", sorted(linears.BLOCK_KINDS))
def test_a_head_in_a_files_blocks_writes_float32(kind, kernel):
    """The blocks' product: the exact product with the activations quantised to int8 per block, in float32."""
    per = linears.BLOCK_KINDS[kind][1]
    raw = random_blocks(kind, 40, 512 // per, seed=6)
    linear = linears.BlockLinear(kind, torch.from_numpy(raw), 512)
    x = _x(512)
    quantised = qkernel.load().quantised_activations(x.reshape(-1, 512).float().contiguous(), per).reshape(x.shape)
    _check_head(linear, _decode(kind, raw).dequantized(), None, x, quantised)


def test_a_head_of_joined_parts_writes_float32(kernel):
    parts, weights = [], []
    for seed, kind in enumerate(["q4_1", "q8_0"]):
        tensor = _decode(kind, random_blocks(kind, 24, 512 // 32, seed=seed))
        parts.append(linears.CodesLinear(kind, tensor.codes, tensor.scales, tensor.zeros, tensor.group,
                                         _OFFSET[kind], None, torch.float32))
        weights.append(tensor.dequantized())
    _check_head(linears.JoinedLinear(parts), torch.cat(weights), None, _x(512))


# ------------------------------------------------------------------ a runner's logits, every format and type

def _runner_logits(model, *, rows: int = 2, **kwargs):
    """(the runner, its output with the final states) for a ragged feed of two rows."""
    runner = ModelRunner(model, rows=rows, **kwargs)
    tokens = torch.tensor([[3, 17, 42, 8], [25, 11, 0, 0]])
    return runner, runner.forward_rows(tokens, [4, 2], hidden=True)


@pytest.mark.parametrize("dtype,fast", [(dtype, True) for dtype in ("fp32", "bf16", "fp16", "int8")]
                         + [(dtype, False) for dtype in ("fp32", "bf16", "fp16")])  # int8 runs on the fast forward
def test_a_runners_logits_are_float32_for_every_format_and_type(dtype, fast, monkeypatch):
    """Llama through the fast forward in every float type and int8 (fp32 activations, then bf16), and through the
    generic path: float32 logits, the float64 product of the final states with the head's weights."""
    monkeypatch.setenv("DRAFTWISE_FAST", "1" if fast else "0")
    for bf16 in ([False, True] if dtype == "int8" else [False]):
        monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: bf16)
        loaded = loading.load_model(tiny_llama(7), dtype=dtype)
        runner, out = _runner_logits(loaded.model)
        assert (runner.fast is not None) == fast
        assert out.logits.dtype == torch.float32 and out.hidden.dtype == loaded.dtype
        head = runner.fast.head if fast else loaded.model.get_output_embeddings()
        if isinstance(head, Int8Linear):  # the int8 codes times their scales as held (dequantized() rounds to bf16)
            weights = head.qweight.double() * head.scales.double()[:, None]
        else:
            weights = head.dequantized() if fast else head.weight
        reference = out.hidden[0].double() @ weights.double().T
        assert _error(out.logits[0], reference) < FP32


def test_the_generic_path_of_another_family_writes_float32():
    """GPT-2 (not a fast family; a plain head the runner applies itself) in bf16."""
    runner, out = _runner_logits(tiny_gpt2(3).to(torch.bfloat16))
    assert runner.fast is None and out.logits.dtype == torch.float32


@pytest.mark.parametrize("fast", [True, False])
def test_a_drafts_restricted_vocabulary_writes_float32(fast, monkeypatch):
    """A draft's output vocabulary (its head's rows cut): float32, -inf outside it."""
    monkeypatch.setenv("DRAFTWISE_FAST", "1" if fast else "0")
    model = tiny_llama(8).to(torch.bfloat16)
    ids = torch.tensor([1, 5, 9, 30, 63])
    _, out = _runner_logits(model, output_ids=ids)
    assert out.logits.dtype == torch.float32
    kept = out.logits[..., ids]
    assert torch.isfinite(kept).all() and out.logits.isinf().sum() == out.logits[..., :1].numel() * (64 - 5)


# ------------------------------------------------------------------ ties, against a float64 reference

def ties(logits: torch.Tensor, k: int = TOP) -> set[tuple[int, int, int]]:
    """(position, token, token) for every two of a position's k largest logits that are exactly equal."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    values, tokens = flat.topk(k, dim=-1)
    found = set()
    for position in range(flat.shape[0]):
        for i, j in itertools.combinations(range(k), 2):
            if values[position, i] == values[position, j]:
                a, b = sorted((int(tokens[position, i]), int(tokens[position, j])))
                found.add((position, a, b))
    return found


def unexplained_ties(logits: torch.Tensor, reference: torch.Tensor) -> set[tuple[int, int, int]]:
    """Ties among `logits`' top TOP that the reference does not have: at the same position, the same two tokens
    are exactly equal in the reference rounded to float32 too."""
    reference = reference.reshape(-1, reference.shape[-1]).float()
    return {(p, a, b) for p, a, b in ties(logits) if reference[p, a] != reference[p, b]}


def reference_logits(head, states: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """The head's logits in float64 from `states` (float32 values of the final normed states) and the weights the
    head holds, dequantised exactly, a chunk of rows at a time (a large head's float64 copy would be GBs). A head
    in a file's blocks multiplies the activations quantised to int8 per block: the reference takes them so too."""
    x = states.reshape(-1, states.shape[-1]).float().contiguous()
    if isinstance(head, linears.BlockLinear):
        x = qkernel.load().quantised_activations(x, linears.BLOCK_KINDS[head.kind][1])
    x = x.double()
    parts = []
    for start in range(0, head.out_features, chunk):
        rows = head.rows(torch.arange(start, min(start + chunk, head.out_features)))
        parts.append(x @ rows.double().T)
    out = torch.cat(parts, dim=-1)
    return out if head.bias is None else out + head.bias.double()


def check_against_reference(loaded, text: str, *, fast: bool, monkeypatch, min_control: int) -> None:
    """The runner's logits over `text` (chat template) against the float64 reference from the same final states:
    float32, close, no tie the reference lacks; the same logits rounded to bf16 show at least `min_control` such
    ties (the check catches bf16 logits)."""
    monkeypatch.setenv("DRAFTWISE_FAST", "1" if fast else "0")
    tokenizer = loaded.tokenizer
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    runner = ModelRunner(loaded.model)
    assert (runner.fast is not None) == fast
    out = runner.forward_rows(torch.tensor([ids]), [len(ids)], hidden=True, prompt=True)
    logits, states = out.logits[0], out.hidden[0]
    assert states.dtype == torch.bfloat16 and logits.dtype == torch.float32
    head = loaded.model.get_output_embeddings().linear  # in its codes or blocks
    reference = reference_logits(head, states)
    assert _error(logits, reference) < FP32
    assert unexplained_ties(logits, reference) == set()
    control = logits.to(torch.bfloat16).float()  # what the head wrote before: bf16 logits
    assert len(unexplained_ties(control, reference)) >= min_control


@pytest.fixture(scope="module")
def smollm2_default_bf16():
    """SmolLM2 as `load_model`'s defaults load it on a CPU with native bf16 (AVX512-BF16 or AMX): its GGUF codes,
    bf16 activations. (This CPU may lack native bf16; the load is told it has it. The kernel runs either way.)"""
    if not qkernel.available():
        pytest.fail(f"the codes kernel is not built: {qkernel.problem()} (make install builds it)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "cpu_has_native_bf16", lambda: True)
        loaded = loading.load_model("smollm2-135m")
    assert loaded.dtype == torch.bfloat16 and loaded.weights.startswith("gguf codes")
    return loaded


@pytest.mark.parametrize("fast", [True, False])
def test_smollm2_default_logits_show_no_tie_the_reference_lacks(smollm2_default_bf16, fast, monkeypatch):
    """The issue's prompt: its first answer token's "L" and "The" tied at -1.884 in bf16 logits."""
    check_against_reference(smollm2_default_bf16, "What is the capital of France?", fast=fast,
                            monkeypatch=monkeypatch, min_control=5)


def test_a_restricted_vocabulary_on_a_head_in_codes_writes_its_rows_float32_logits(smollm2_default_bf16,
                                                                                     monkeypatch):
    """A draft's output vocabulary cut from a head in its codes: float32, the full head's columns (within float32
    rounding: the kernel may group output rows differently)."""
    monkeypatch.setenv("DRAFTWISE_FAST", "1")
    ids = torch.arange(0, smollm2_default_bf16.vocab_size, 7)
    tokens = torch.tensor([[1, 504, 3458, 314, 260]])
    full = ModelRunner(smollm2_default_bf16.model).forward_rows(tokens, [5]).logits
    cut = ModelRunner(smollm2_default_bf16.model, output_ids=ids).forward_rows(tokens, [5]).logits
    assert full.dtype == cut.dtype == torch.float32
    assert _error(cut[..., ids], full[..., ids]) < FP32


@pytest.mark.slow
def test_qwen_1_5b_default_logits_show_no_tie_the_reference_lacks(monkeypatch):
    """Qwen2.5-Coder-1.5B in its blocks with bf16 activations (its Q6_K head multiplies int8 activations)."""
    if not qkernel.available():
        pytest.fail(f"the codes kernel is not built: {qkernel.problem()} (make install builds it)")
    with monkeypatch.context() as patch:
        patch.setattr(loading, "cpu_has_native_bf16", lambda: True)
        loaded = loading.load_model("qwen2.5-coder-1.5b")
    assert loaded.dtype == torch.bfloat16 and loaded.weights.startswith("gguf blocks")
    check_against_reference(loaded, "Write a Python function that reverses a linked list.", fast=True,
                            monkeypatch=monkeypatch, min_control=5)
