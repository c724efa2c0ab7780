"""GGUF block formats kept in their codes (models/quant.py): every format decodes block by block to exactly what
gguf's reference dequantisation gives (bit for bit, random blocks with finite fp16 fields), the 4-bit K-quant runs
through the int4 kernel in its own codes, and the real pair's files decode like the reference (slow, opt-in)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from draftwise.models.quant import GGUFTensor, _decode

FORMATS = {  # kind -> (ggml type, weights per block, bytes per block, byte offsets of its fp16 fields)
    "q4_0": (GGMLQuantizationType.Q4_0, 32, 18, (0,)),
    "q4_1": (GGMLQuantizationType.Q4_1, 32, 20, (0, 2)),
    "q5_0": (GGMLQuantizationType.Q5_0, 32, 22, (0,)),
    "q8_0": (GGMLQuantizationType.Q8_0, 32, 34, (0,)),
    "q4_k": (GGMLQuantizationType.Q4_K, 256, 144, (0, 2)),
    "q6_k": (GGMLQuantizationType.Q6_K, 256, 210, (208,)),
}


def random_blocks(kind: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """[rows, blocks * block_bytes] random bytes with finite, varied fp16 scale fields."""
    _, _, size, halves = FORMATS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    for at in halves:
        values = (rng.standard_normal((rows, blocks)) * 0.05).astype(np.float16)
        raw[..., at: at + 2] = values[..., None].view(np.uint8).reshape(rows, blocks, 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_each_format_decodes_block_by_block_as_the_reference(kind):
    ggml_type, per_block, _, _ = FORMATS[kind]
    raw = random_blocks(kind, rows=6, blocks=3)
    ours = _decode(kind, raw)
    assert ours.codes.shape == (6, 3 * per_block)
    reference = quants.dequantize(raw, ggml_type).reshape(6, -1)
    mine = ours.dequantized().numpy()
    assert np.array_equal(mine, reference.astype(np.float32)), f"{kind}: {np.abs(mine - reference).max()}"
    # block by block: each block alone decodes as it does in the row (no state crosses blocks)
    for b in range(3):
        one = _decode(kind, raw[:, b * FORMATS[kind][2]: (b + 1) * FORMATS[kind][2]]).dequantized().numpy()
        assert np.array_equal(one, mine[:, b * per_block: (b + 1) * per_block])


@pytest.mark.parametrize("kind", ["q4_k", "q6_k", "q5_0"])
def test_a_corrupted_code_changes_exactly_its_weight(kind):
    """The negative control of the layout: flipping one code bit moves one weight (a mis-ordered decoder would
    still match a symmetric reference only by accident; this pins each code to its position)."""
    ggml_type, per_block, size, _ = FORMATS[kind]
    raw = random_blocks(kind, rows=1, blocks=1, seed=3)
    before = quants.dequantize(raw, ggml_type).reshape(-1)
    code_byte = {"q4_k": 16 + 5, "q6_k": 7, "q5_0": 6 + 2}[kind]
    raw2 = raw.copy()
    raw2[0, code_byte] ^= 0x01
    after = quants.dequantize(raw2, ggml_type).reshape(-1)
    moved = np.nonzero(before != after)[0]
    ours = _decode(kind, raw2).dequantized().numpy().reshape(-1)
    assert np.array_equal(ours, after) and len(moved) == 1
    assert not np.array_equal(_decode(kind, raw).dequantized().numpy().reshape(-1), after)


def test_q4_k_runs_through_the_int4_kernel_in_its_own_codes():
    from draftwise.models.linear import Int4Linear

    raw = random_blocks("q4_k", rows=32, blocks=2, seed=5)
    tensor = _decode("q4_k", raw)
    codes, scales, zeros = tensor.int4()
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    linear = Int4Linear(codes, scales, zeros, 32, None, torch.bfloat16)
    exact = tensor.dequantized()
    # the kernel holds scale and zero in bf16: the weights it multiplies are within that rounding of the file's
    assert torch.allclose(linear.dequantized().float(), exact, atol=float(exact.abs().max()) * 2 ** -7)
    x = torch.randn(3, 512)
    y = linear(x.bfloat16()).float()
    assert torch.allclose(y, x @ exact.T, rtol=0.05, atol=0.05 * float((x @ exact.T).abs().max()))


def test_q4_k_with_a_wrong_min_is_not_the_reference():
    """Control: the additive term's sign (w = d sc q - dmin m) is what the test sees."""
    raw = random_blocks("q4_k", rows=2, blocks=1, seed=9)
    tensor = _decode("q4_k", raw)
    flipped = GGUFTensor("q4_k", tensor.codes, tensor.scales, -tensor.zeros)
    reference = quants.dequantize(raw, GGMLQuantizationType.Q4_K).reshape(2, -1)
    assert not np.allclose(flipped.dequantized().numpy(), reference)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"])
def test_the_pairs_files_decode_as_the_reference(name):
    """Every quantised tensor of the real files, its first 16 rows, against gguf's dequantisation."""
    from gguf import GGUFReader

    from draftwise.models import registry

    reader = GGUFReader(str(registry.entry(name).gguf()))
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name.lower()
        if kind not in FORMATS:
            continue
        raw = np.asarray(tensor.data)[:16]
        reference = quants.dequantize(raw, tensor.tensor_type).reshape(raw.shape[0], -1)
        assert np.array_equal(_decode(kind, raw).dequantized().numpy(), reference), tensor.name
        seen.add(kind)
    assert seen >= ({"q4_k", "q6_k"} if "1.5b" in name else {"q5_0", "q8_0", "q4_k", "q6_k"})
