"""The GGUF codec: a file's quantised tensors decoded into codes, scales and zeros (and Q4_0 / Q4_1 / Q8_0 back into
bytes). Which kernel runs them is the `gguf` weight format's choice (`formats.GGUFFormats`, `linear`'s classes).

GGUF blocks (ggml's layout, along the input dimension), each decoded into codes, a scale and an additive
term per group (`GGUFTensor`):
- Q4_0: 32 weights: fp16 d, 16 bytes of nibbles; w = (q - 8) * d.
- Q4_1: 32 weights: fp16 d, fp16 m, 16 bytes of nibbles; w = q * d + m.
- Q5_0: 32 weights: fp16 d, 4 bytes of fifth bits, 16 bytes of nibbles; w = (q - 16) * d.
- Q8_0: 32 weights: fp16 d, 32 int8; w = q * d.
- Q4_K: 256 weights in 8 groups of 32: fp16 d and dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles;
  w = (d * sc) * q - (dmin * m).
- Q6_K: 256 weights in 16 groups of 16: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d;
  w = (d * sc) * (q - 32).
Nibble j of a 32-weight block's byte i is weight i (low) or i + 16 (high); the K-quants interleave as `_decode_k`
spells out. Decoding keeps the codes exactly, and each group's scale and additive term are computed in float32 from
the file's fp16 and 6/8-bit fields as ggml does (exact products), so `dequantized()` equals gguf's reference
dequantisation value for value (tests/test_kquants.py checks each format block by block).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from draftwise.errors import DraftwiseError

GROUP = 32
QK_K = 256
QUANTISED = ("q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q6_k")
_OFFSET = {"q4_0": 8, "q4_1": 8, "q5_0": 16, "q8_0": 0, "q4_k": 0, "q6_k": 32}  # w = (code - offset) * scale + zero
_GROUP = {"q6_k": 16}  # weights per scale (32 elsewhere)
_FOUR_BIT = ("q4_0", "q4_1", "q4_k")  # run as int4 groups of 32


@dataclass
class GGUFTensor:
    kind: str  # one of QUANTISED
    codes: torch.Tensor  # [out, in]: uint8 0 .. 2^bits - 1, or int8 (q8_0)
    scales: torch.Tensor  # [out, in / group] float32
    zeros: torch.Tensor | None  # [out, in / group] float32, the additive term (None: 0); q4_0 / q4_1: Int4Linear's

    @property
    def group(self) -> int:
        return _GROUP.get(self.kind, GROUP)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights the block format encodes, value for value as gguf's reference dequantisation."""
        codes = self.codes.float()
        scales = self.scales.repeat_interleave(self.group, dim=1)
        if self.kind in ("q4_0", "q4_1"):  # Int4Linear's convention
            return (codes - 8) * scales + self.zeros.repeat_interleave(self.group, dim=1)
        offset = _OFFSET[self.kind]
        out = scales * (codes - offset if offset else codes)
        return out + self.zeros.repeat_interleave(self.group, dim=1) if self.zeros is not None else out

    def int4(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes, scales, zeros) in Int4Linear's convention w = (q - 8) * scale + zero (4-bit kinds only)."""
        if self.kind in ("q4_0", "q4_1"):
            return self.codes, self.scales, self.zeros
        assert self.kind == "q4_k", self.kind
        return self.codes, self.scales, self.zeros + 8 * self.scales

    def rows(self, index: torch.Tensor) -> "GGUFTensor":
        pick = (lambda t: None if t is None else t[index])
        return GGUFTensor(self.kind, self.codes[index], self.scales[index], pick(self.zeros))


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [...] float32 (little-endian fp16)."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _decode(kind: str, raw: np.ndarray) -> GGUFTensor:
    """raw: [out, blocks * block_bytes] uint8 as stored -> codes, scales and zeros."""
    out = raw.shape[0]
    if kind in ("q4_k", "q6_k"):
        return _decode_k(kind, raw)
    if kind == "q8_0":
        blocks = raw.reshape(out, -1, 34)
        d = _f16(blocks[..., :2])
        codes = blocks[..., 2:].copy().view(np.int8).reshape(out, -1)
        return GGUFTensor(kind, torch.from_numpy(codes), torch.from_numpy(d), None)
    if kind == "q5_0":
        blocks = raw.reshape(out, -1, 22)
        d = _f16(blocks[..., :2])
        high = np.ascontiguousarray(blocks[..., 2:6]).view(np.uint32)  # [out, blocks, 1]: bit j is weight j's
        fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)  # [out, blocks, 32]
        nibbles = blocks[..., 6:]
        low = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)  # weights 0..15, then 16..31
        codes = (low | (fifth << 4)).reshape(out, -1)
        return GGUFTensor(kind, torch.from_numpy(codes), torch.from_numpy(d), None)
    size = 18 if kind == "q4_0" else 20
    blocks = raw.reshape(out, -1, size)
    d = _f16(blocks[..., :2])
    if kind == "q4_1":
        m = _f16(blocks[..., 2:4])
        nibbles = blocks[..., 4:]
        zeros = m + 8 * d
    else:
        nibbles = blocks[..., 2:]
        zeros = np.zeros_like(d)
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(out, -1)  # weights 0..15, then 16..31
    return GGUFTensor(kind, torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(d), torch.from_numpy(zeros))


def _decode_k(kind: str, raw: np.ndarray) -> GGUFTensor:
    """The K-quants' 256-weight super-blocks."""
    out = raw.shape[0]
    if kind == "q4_k":
        blocks = raw.reshape(out, -1, 144)
        d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]  # [out, blocks, 1]
        packed = blocks[..., 4:16].reshape(out, -1, 3, 4)  # bytes 0-3, 4-7, 8-11 of the 6-bit fields
        first, second, third = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
        # groups 0-3: the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); groups 4-7: a nibble of bytes 8-11
        # below the top 2 bits of bytes 0-3 (scales) and 4-7 (mins)
        sc = np.concatenate([first & 0x3F, (third & 0x0F) | ((first >> 2) & 0x30)], axis=-1)  # [out, blocks, 8]
        mn = np.concatenate([second & 0x3F, (third >> 4) | ((second >> 2) & 0x30)], axis=-1)
        nibbles = blocks[..., 16:].reshape(out, -1, 4, 1, 32)  # 4 runs of 32 bytes: groups 2j (low), 2j + 1 (high)
        codes = ((nibbles >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F).reshape(out, -1)
        scales = (d * sc.astype(np.float32)).reshape(out, -1)
        zeros = -(dmin * mn.astype(np.float32)).reshape(out, -1)
        return GGUFTensor(kind, torch.from_numpy(codes), torch.from_numpy(scales), torch.from_numpy(zeros))
    blocks = raw.reshape(out, -1, 210)
    low = blocks[..., :128].reshape(out, -1, 2, 1, 64)  # two halves of 128 weights
    low = ((low >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F).reshape(out, -1, 2, 4, 32)
    high = blocks[..., 128:192].reshape(out, -1, 2, 1, 32)
    high = ((high >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03)  # [out, blocks, 2, 4, 32]
    codes = (low | (high << 4)).reshape(out, -1)
    sc = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [out, blocks, 16]
    d = _f16(blocks[..., 208:210])[..., None]
    scales = (d * sc).reshape(out, -1)
    return GGUFTensor(kind, torch.from_numpy(codes), torch.from_numpy(scales), None)


def encode(tensor: GGUFTensor) -> np.ndarray:
    """The GGUF bytes of a Q4_0, Q4_1 or Q8_0 tensor ([out, blocks * block_bytes] uint8): the inverse of `_decode`
    (tests use it to write files and to check round trips)."""
    out = tensor.codes.shape[0]
    if tensor.kind not in ("q4_0", "q4_1", "q8_0"):
        raise ValueError(f"encode writes q4_0, q4_1 and q8_0 blocks, not {tensor.kind}")
    d = tensor.scales.numpy().astype(np.float16)[..., None].view(np.uint8)  # [out, blocks, 2]
    if tensor.kind == "q8_0":
        codes = tensor.codes.numpy().astype(np.int8).reshape(out, -1, GROUP).view(np.uint8)
        return np.concatenate([d, codes], axis=-1).reshape(out, -1)
    codes = tensor.codes.numpy().astype(np.uint8).reshape(out, -1, GROUP)
    nibbles = codes[..., :16] | (codes[..., 16:] << 4)
    if tensor.kind == "q4_1":
        m = (tensor.zeros - 8 * tensor.scales).numpy().astype(np.float16)[..., None].view(np.uint8)
        return np.concatenate([d, m, nibbles], axis=-1).reshape(out, -1)
    return np.concatenate([d, nibbles], axis=-1).reshape(out, -1)


def read_gguf_weights(path: Path) -> dict[str, GGUFTensor]:
    """The quantised tensors of a GGUF file (the kinds in QUANTISED) by GGUF name (float tensors are left to
    transformers)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as error:  # noqa: BLE001 - a damaged file is bad input
        raise DraftwiseError(f"{path}: cannot read the GGUF file ({type(error).__name__}: {error})") from None
    found = {}
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name.lower()
        if kind in QUANTISED:
            found[tensor.name] = _decode(kind, np.asarray(tensor.data))
    return found


_GGUF_NAMES = {  # transformers parameter (inside a decoder layer) -> GGUF tensor
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(part: str, tied: bool) -> str:
    """'layers.3.self_attn.q_proj' -> 'blk.3.attn_q.weight'; 'lm_head' -> 'output.weight' (or the embedding's
    tensor when the head is tied to it)."""
    if part == "lm_head":
        return "token_embd.weight" if tied else "output.weight"
    _, index, module = part.split(".", 2)
    return f"blk.{index}.{_GGUF_NAMES[module]}.weight"


def _match_rows(tensor: GGUFTensor, weight: torch.Tensor, name: str, heads: tuple[int, ...]) -> GGUFTensor:
    """The GGUF tensor with its output rows in transformers' order. llama.cpp's converter permutes the rows of
    the q and k projections (rotary halves interleaved); the loader that wrote `weight` reversed that. The
    order is found by comparing with the dequantised weights, never assumed."""
    reference = weight.float()
    out = weight.shape[0]
    candidates = [torch.arange(out)]
    for count in heads:  # the model's head counts (q) and key/value head counts (k) dividing the rows
        if out % count == 0 and (out // count) % 2 == 0:
            candidates.append(torch.arange(out).reshape(count, out // count // 2, 2).transpose(1, 2).reshape(out))
    tolerance = 1e-2 * float(reference.abs().max()) + 1e-6
    for order in candidates:
        rows = tensor.rows(order)
        if float((rows.dequantized() - reference).abs().max()) <= tolerance:
            return rows
    raise DraftwiseError(f"GGUF tensor {name} does not match the model's weights (another file?)")


def join(tensors: list[GGUFTensor]) -> GGUFTensor:
    """Tensors of one kind stacked along the output rows (a fused projection)."""
    if len(tensors) == 1:
        return tensors[0]
    zeros = None if tensors[0].zeros is None else torch.cat([t.zeros for t in tensors])
    return GGUFTensor(tensors[0].kind, torch.cat([t.codes for t in tensors]), torch.cat([t.scales for t in tensors]),
                      zeros)
