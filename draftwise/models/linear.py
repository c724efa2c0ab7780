"""The projections of the fast forward, one class a weight format: y = x W^T (+ b) from the weights as a format keeps
them, each with the same call (`linear(x, wide=False, *, logits=False)`) and `dequantized()`.

- `FloatLinear`: float weights, on draftwise's batch-invariant product (or oneDNN's where the kernel is not built);
- `Int8Linear`: int8 weight-only, one scale per output channel (PyTorch's `_weight_int8pack_mm`);
- `Int4Linear`: int4 groups of 32 (GGUF Q4_0 / Q4_1 kept in their codes) on PyTorch's CPU int4 kernel;
- `CodesLinear`: a GGUF file's codes, decoded and packed for draftwise's codes kernel (csrc/qmm.cpp);
- `BlockLinear`: a K-quant file's own blocks, byte for byte, on draftwise's block kernel (csrc/qblocks.cpp);
- `JoinedLinear`: projections of different code kinds side by side (a fused q|k|v whose parts differ).

`CodesProjection` and `CodesEmbedding` put a projection kept in its codes in place of a transformers model's Linear
and embedding. The kernels themselves are built and loaded by `models.qkernel`; the GGUF codec is `models.quant`;
which format a model runs is `models.formats`'.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch
import torch.nn.functional as F

from draftwise.models import qkernel
from draftwise.models.quant import _OFFSET, GGUFTensor, _decode, join


def onednn_packing(weight: torch.Tensor) -> bool:
    """Whether float products of this weight run through oneDNN with a prepacked weight (CPU, fp32 or bf16):
    prepacking beats F.linear at every width for these shapes (DRAFTWISE_ONEDNN=0 turns it off)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and os.environ.get("DRAFTWISE_ONEDNN", "1") != "0")


class FloatLinear:
    """y = x W^T (+ b) in the weights' own float dtype. On CPU through draftwise's batch-invariant product
    (`qkernel`'s fmm: a row's sums in one order whatever the number of rows, float32 inside, rounded to the
    activations' type) for every feed; bf16 weights and activations on a CPU with AVX512-BF16 through its `bmm16`
    (bf16 products summed in float32, about 3x fmm's speed there; the same for every feed too). Where the kernel is not
    built (or DRAFTWISE_INVARIANT=0), through oneDNN with a prepacked weight. `logits=True` (the LM head): float32
    out, the kernel's float32 sums as they are (`float32_product` where no kernel runs)."""

    format = "float"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight.contiguous()
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self._invariant = None
        if (self.weight.device.type == "cpu" and self.weight.dtype in (torch.float32, torch.bfloat16, torch.float16)
                and self.in_features % 8 == 0):
            self._invariant = qkernel.invariant_kernel("fmm")
        self._bf16 = None  # bmm16, for bf16 activations, where the weights are bf16 and the CPU has AVX512-BF16
        if self._invariant is not None and self.weight.dtype == torch.bfloat16 and self.in_features % 32 == 0:
            self._bf16 = qkernel.bf16_kernel()
        self._packed = None  # oneDNN's prepacked weight, built at the first product that needs it
        self._bias32 = None if bias is None else bias.float().contiguous()  # the invariant product's bias, converted once

    @property
    def packed(self):
        if self._packed is None and onednn_packing(self.weight):
            try:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 1)
            except RuntimeError:  # bf16 on a CPU without AVX512-BF16/AVX-NE-CONVERT (e.g. AMD Zen 3): plain F.linear
                self._packed = False
        return None if self._packed is None or self._packed is False else self._packed  # (a tensor has no bool)

    def __call__(self, x: torch.Tensor, wide: bool | int = False, *, logits: bool = False) -> torch.Tensor:
        shape = x.shape
        if self._invariant is not None:
            flat = x.reshape(-1, shape[-1])
            if self._bf16 is not None and x.dtype == torch.bfloat16:  # the bias added (and rounded) in the kernel
                y = self._bf16(flat.contiguous(), self.weight, self._bias32, not logits)
                return y.reshape(*shape[:-1], self.out_features)
            y = self._invariant(flat.float().contiguous(), self.weight, False)
            if self._bias32 is not None:
                y = y + self._bias32
            return (y if logits else y.to(x.dtype)).reshape(*shape[:-1], self.out_features)
        if logits and not (x.dtype == self.weight.dtype == torch.float32):
            return float32_product(x, self.weight, self.bias)
        packed = self.packed
        if packed is None:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), packed, self.bias, "none", [], "")
        return y.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return self.weight


class Int8Linear:
    """Weight-only int8, one scale per output channel: w = q * scale (`_weight_int8pack_mm`)."""

    format = "int8"

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype
                 ) -> None:
        self.qweight = qweight.contiguous()  # [out, in] int8
        self.scales = scales.to(dtype).contiguous()  # [out]
        self.bias = None if bias is None else bias.to(dtype)
        self.out_features, self.in_features = qweight.shape

    @classmethod
    def quantize(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> "Int8Linear":
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)
        return cls(q, scales, bias, weight.dtype)

    def __call__(self, x: torch.Tensor, wide: bool = False, *, logits: bool = False) -> torch.Tensor:
        """logits: the LM head's product, float32 activations and scales whatever the activations' type (the
        kernel's output type is theirs): float32 logits, not rounded to bf16."""
        shape = x.shape
        flat, scales, bias = x.reshape(-1, shape[-1]), self.scales, self.bias
        if logits:
            flat, scales = flat.float(), scales.float()
            bias = None if bias is None else bias.float()
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, scales)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return (self.qweight.float() * self.scales.float()[:, None]).to(self.scales.dtype)


class Int4Linear:
    """Weight-only int4 in groups along the input dimension: w = (q - 8) * scale + zero, q in 0..15.

    The layout of GGUF's Q4_0 and Q4_1 blocks (see `models.quant`), run by PyTorch's CPU int4 kernel
    (`_weight_int4pack_mm_for_cpu`); scales and zeros in the activations' dtype.

    The kernel wins at decode widths and loses to oneDNN's prepacked bf16 product on prompts. So a prompt feed (`wide`) runs the dequantised weights (rounded to the activation type, prepacked at the first prompt), and every decode and
    verification feed runs the int4 kernel, whatever the batch: a token's result never depends on its
    batch-mates, and every method computes a prompt's cache the same way."""

    format = "int4"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        out_features, in_features = codes.shape  # codes: [out, in] integers 0..15
        self.out_features, self.in_features, self.group = out_features, in_features, group
        self.dtype = dtype
        self.codes = codes.to(torch.uint8)  # kept for round trips and dequantisation (half a byte per weight x2)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        # [in / group, out, 2]: (scale, zero) per group and output channel
        self.scales_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        self.bias = None if bias is None else bias.to(dtype)
        self._wide: FloatLinear | None = None  # built at the first prompt feed
        self._scales_zeros32: torch.Tensor | None = None  # the LM head's (`logits`), widened at its first product

    def __call__(self, x: torch.Tensor, wide: bool | int = False, *, logits: bool = False) -> torch.Tensor:
        """wide: True for a prompt feed; an int n for a feed whose packed tokens from n on are prompt tokens (a
        verification forward that also carries prompt chunks): each part runs as it would alone. logits: the LM
        head's product, run in float32 (the same weights: scales and zeros as held, widened) so that the logits
        are float32 and not rounded to the activations' type; PyTorch's float32 int4 path is several times slower
        than its bf16 one, a cost paid only where draftwise's codes kernel is not built."""
        shape = x.shape
        if logits:
            if self._scales_zeros32 is None:
                self._scales_zeros32 = self.scales_zeros.float()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).float(), self.packed,
                                                            self.group, self._scales_zeros32)
            if self.bias is not None:
                y = y + self.bias.float()
            return y.reshape(*shape[:-1], self.out_features)
        mixed, wide = split_feed(self, x, wide)
        if mixed is not None:
            return mixed
        if wide:  # a prompt: the dequantised weights, prepacked once, run it faster
            if self._wide is None:
                self._wide = FloatLinear(self.dequantized(), self.bias)
            return self._wide(x, True)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]), self.packed, self.group,
                                                        self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        scales = self.scales_zeros[..., 0].t().float().repeat_interleave(self.group, dim=1)
        zeros = self.scales_zeros[..., 1].t().float().repeat_interleave(self.group, dim=1)
        return ((self.codes.float() - 8) * scales + zeros).to(self.dtype)


WIDEN_ELEMENTS = 1 << 22  # `float32_product` widens this many weights at a time (16 MB of float32)


def float32_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) summed in float32 with a float32 result, whatever the float types of x and W: an LM head's logits
    where no kernel of draftwise's runs (the generic path, a draft's restricted vocabulary, EAGLE heads in training,
    GPUs). Float32 x and W: F.linear as it is; otherwise x and the weights widened to float32, the weights a slice
    of rows at a time (no full float32 copy of a large head), and the slices' results side by side. Autograd flows
    through it (to x and W)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.linear(x, weight, bias)
    x = x.float()
    bias = None if bias is None else bias.float()
    step = max(1, WIDEN_ELEMENTS // max(1, weight.shape[1]))
    if weight.shape[0] <= step:
        return F.linear(x, weight.float(), bias)
    return torch.cat([F.linear(x, weight[i: i + step].float(), None if bias is None else bias[i: i + step])
                      for i in range(0, weight.shape[0], step)], dim=-1)


def head_logits(head, states: torch.Tensor) -> torch.Tensor:
    """A transformers model's LM head module (`get_output_embeddings()`) applied to `states`, float32 out: a head
    kept in its GGUF codes runs its kernel's float32 sums as they are, a float head `float32_product`."""
    if isinstance(head, CodesProjection):
        return head.linear(states, logits=True)
    return float32_product(states, head.weight, head.bias)


class _Product:
    """What a projection on draftwise's kernels shares: float activations of any shape in, `_product` (the kernel)
    on them flattened to float32 rows, the bias added, the activations' type and shape back (float32 for the LM
    head's `logits`: the kernel's float32 sums as they are, never rounded to bf16 activations' type)."""

    format = "codes"
    out_features: int
    bias: torch.Tensor | None

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, wide: bool | int = False, *, logits: bool = False) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():  # the fast forward's packed rows
            y = self._product(x)
            return y if self.bias is None else y.add_(self.bias)  # in place: y + bias's bits, no new tensor
        shape = x.shape
        y = self._product(x.reshape(-1, shape[-1]).float().contiguous())
        if self.bias is not None:
            y.add_(self.bias)
        return (y if logits else y.to(x.dtype)).reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights (every row), for checks and round trips."""
        return self.rows(torch.arange(self.out_features))


class CodesLinear(_Product):
    """y = x W^T (+ b) with W in its GGUF codes (see the module docstring)."""

    def __init__(self, kind: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group: int, offset: int, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        out_features, in_features = codes.shape
        if in_features % 32:
            raise ValueError(f"{kind}: {in_features} inputs, not a multiple of 32")
        self.kind, self.group, self.dtype = kind, group, dtype
        self.out_features, self.in_features = out_features, in_features
        if kind in ("q4_0", "q4_1", "q4_k"):
            self.bits = 4
            q = codes.to(torch.uint8).reshape(out_features, -1, 2, 16)  # per 32: weights 0..15, then 16..31
            self.codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(out_features, -1).contiguous()
            zero = zeros if zeros is not None else torch.zeros_like(scales)
            if kind in ("q4_0", "q4_1"):  # Int4Linear's convention (q - 8) * scale + zero: fold the 8 in
                zero = zero - 8 * scales
            self.zeros = zero.float().contiguous()
        else:
            self.bits = 8
            signed = codes if codes.dtype == torch.int8 else codes.view(torch.int8)  # uint8 codes < 128 here
            self.codes = (signed - offset if offset else signed).view(torch.uint8).contiguous()
            self.zeros = None if zeros is None else zeros.float().contiguous()
        self.scales = scales.float().contiguous()
        self.bias = None if bias is None else bias.float()

    @classmethod
    def packed(cls, kind: str, bits: int, group: int, codes: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, bias: torch.Tensor | None, in_features: int) -> "CodesLinear":
        """From codes already packed for the kernel (a cache entry's tensors)."""
        out = cls.__new__(cls)
        out.kind, out.bits, out.group, out.dtype = kind, int(bits), int(group), torch.float32
        out.out_features, out.in_features = codes.shape[0], int(in_features)
        out.codes, out.scales, out.zeros, out.bias = codes, scales, zeros, bias
        if codes.shape[1] != (in_features // 2 if out.bits == 4 else in_features):
            raise ValueError(f"{kind}: codes of shape {tuple(codes.shape)} do not hold {in_features} inputs")
        return out

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        return qkernel.load().qmm(flat, self.codes, self.bits, self.scales, self.zeros, self.group, False)

    def subset(self, index: torch.Tensor) -> "CodesLinear":
        """Output rows `index` only, their codes as they are (a draft's restricted output vocabulary)."""
        index = index.reshape(-1).to(torch.long)
        return CodesLinear.packed(self.kind, self.bits, self.group, self.codes[index].contiguous(),
                                  self.scales[index].contiguous(),
                                  None if self.zeros is None else self.zeros[index].contiguous(),
                                  None if self.bias is None else self.bias[index], self.in_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros) if t is not None)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 weights of output rows `index` (an embedding lookup): [len(index), in_features]."""
        codes = self.codes[index]
        if self.bits == 4:
            packed = codes.reshape(len(index), -1, 16)
            q = torch.stack([packed & 15, packed >> 4], dim=2).reshape(len(index), -1).float()
        else:
            q = codes.view(torch.int8).float()
        w = q * self.scales[index].repeat_interleave(self.group, dim=1)
        return w + self.zeros[index].repeat_interleave(self.group, dim=1) if self.zeros is not None else w


def split_feed(linear, x: torch.Tensor, wide: bool | int) -> tuple[torch.Tensor | None, bool]:
    """For a projection whose prompt tokens take another product than the rest: `wide` is True for a prompt feed,
    False for decoding or verification, or an int n for a feed whose packed tokens (x [tokens, in]) from n on are
    prompt tokens. Returns (the mixed feed's result, each part run as it would be alone, or None; whether the feed,
    being of one kind, is a prompt)."""
    if isinstance(wide, bool):
        return None, wide
    if 0 < wide < x.shape[0]:
        return torch.cat([linear(x[:wide]), linear(x[wide:], True)]), True
    return None, wide == 0


BLOCK_KINDS = {"q4_k": (0, 256, 144), "q6_k": (1, 256, 210), "q5_0": (2, 32, 22), "q8_0": (3, 32, 34)}
"""The kinds `BlockLinear` runs from the file's own blocks: (the kernel's id, weights a block, bytes a block)."""


class BlockLinear(_Product):
    """y = x W^T (+ b) with W in a GGUF file's own blocks, byte for byte (csrc/qblocks.cpp): Q4_K 4.5 bits a weight,
    Q6_K 6.56, Q5_0 5.5, Q8_0 8.5. Each activation row is quantised to int8 per block of inputs first (256 for the
    K-quants, 32 for Q5_0 and Q8_0; a float32 scale each), as llama.cpp does, and every block's product is an exact
    integer sum scaled once: the result is the exact product of the dequantised weights with those quantised
    activations, up to float32 rounding of the per-block sums, and a row's result never depends on its
    batch-mates."""

    def __init__(self, kind: str, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None) -> None:
        if kind not in BLOCK_KINDS:
            raise ValueError(f"{kind}: the block kernel takes {', '.join(BLOCK_KINDS)}")
        self.kind_id, per, size = BLOCK_KINDS[kind]
        if in_features % per or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != in_features // per * size:
            raise ValueError(f"{kind}: blocks of shape {tuple(blocks.shape)} do not hold {in_features} inputs")
        self.kind, self._blocks, self.in_features = kind, blocks.contiguous(), int(in_features)
        self.out_features = blocks.shape[0]
        self.bias = None if bias is None else bias.float()
        self._wide = None  # the weights in bf16 for prompt feeds (`prompt_bf16`), built at the first one
        self._packed = None  # the rows packed 16 to a vector (`pack_blocks`), built at the first product
        self._source = None  # (fused owner, first row): a part of a fused projection reads its rows there

    @property
    def blocks(self) -> torch.Tensor:
        """The file's blocks [out, in / per * bytes], byte for byte. Once the rows are packed (the only copy then
        kept), rebuilt from the packed rows at each call: for load-time and occasional uses, not per token."""
        if self._blocks is not None:
            return self._blocks
        if self._source is not None and self._source[0]._blocks is not None:  # a view of the fused blocks
            owner, start = self._source
            return owner._blocks[start: start + self.out_features]
        return self._block_rows(torch.arange(self.out_features))

    @blocks.setter
    def blocks(self, value: torch.Tensor) -> None:
        self._blocks, self._source, self._packed = value, None, None

    def _unpacked(self, index: torch.Tensor) -> torch.Tensor:
        return qkernel.load().unpack_blocks(self._packed, self.kind_id, self.in_features, index.to(torch.long))

    def _block_rows(self, index: torch.Tensor) -> torch.Tensor:
        """The file's blocks of rows `index` (1-D), from wherever they are kept."""
        if self._source is not None:
            owner, start = self._source
            return owner._block_rows(index + start)
        if self._blocks is not None:
            return self._blocks[index]
        return self._unpacked(index)

    def __call__(self, x: torch.Tensor, wide: bool | int = False, *, logits: bool = False) -> torch.Tensor:
        """wide: True for a prompt feed; an int n for a feed whose packed tokens from n on are prompt tokens (a
        verification forward that also carries prompt chunks): each part runs as it would alone. logits: the LM
        head's product, float32 out whatever the activations (an LM head runs no prompt feed). With bf16
        activations on a CPU with AVX512-BF16, a prompt runs the weights rounded to bf16 through `bmm16` (a prompt's
        product is bound by arithmetic, which bf16 pairs do at about twice the int8 blocks' rate here); decoding and
        verification read the blocks (bound by reading weights). Which path a token takes depends only on whether it
        is a prompt token, never on its batch-mates."""
        if logits:
            return super().__call__(x, logits=True)
        mixed, wide = split_feed(self, x, wide)
        if mixed is not None:
            return mixed
        if wide and x.dtype == torch.bfloat16 and qkernel.prompt_bf16():
            if self._wide is None:
                self._wide = FloatLinear(qkernel.load().dequantised_blocks(self.blocks, self.kind_id, self.in_features),
                                         self.bias)  # the bias stays float32, added before rounding as here
            return self._wide(x, True)
        return super().__call__(x)

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        module = qkernel.load()
        if self.out_features % 16 == 0 and module.blocks_packed():
            # where AVX512-VNNI is: the rows regrouped 16 to a vector once (a row an int32 lane), a scale applied once
            # a group of weights (Q4_K 32, Q6_K 16, Q5_0 / Q8_0 a block of 32); the same bits as the portable loop
            # (csrc/qblocks.cpp). The packed rows replace the file's blocks, which are rebuilt from them, byte for
            # byte, where a row lookup, a subset or a prompt copy asks for them (`unpack_blocks`).
            if self._packed is None:
                self._packed = module.pack_blocks(self.blocks, self.kind_id, self.in_features)
                if self._source is None:
                    self._blocks = None
            return module.qmm_packed(flat, self._packed, self.kind_id, self.in_features)
        return module.qmm_blocks(flat, self.blocks, self.kind_id, self.in_features, False)

    def subset(self, index: torch.Tensor) -> "BlockLinear":
        """Output rows `index` only, their blocks byte for byte (a draft's restricted output vocabulary)."""
        index = index.reshape(-1).to(torch.long)
        return BlockLinear(self.kind, self._block_rows(index), self.in_features,
                           None if self.bias is None else self.bias[index])

    def nbytes(self) -> int:
        return self.out_features * (self.in_features // BLOCK_KINDS[self.kind][1]) * BLOCK_KINDS[self.kind][2]

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 weights of output rows `index`, as gguf's reference dequantises them."""
        return _decode(self.kind, self._block_rows(index.reshape(-1).to(torch.long)).numpy()).dequantized()


def q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """Float weights [out, in] (in a multiple of 32) as GGUF Q8_0 blocks [out, in / 32 * 34] uint8: per block of 32
    an fp16 scale d = max |w| / 127 and 32 int8 codes round(w / d), as llama.cpp's quantize writes them."""
    out, n = weight.shape
    if n % 32:
        raise ValueError(f"Q8_0 blocks need inputs in multiples of 32, got {n}")
    w = weight.detach().float().reshape(out, n // 32, 32)
    d = (w.abs().amax(-1) / 127.0).to(torch.float16)  # [out, blocks]
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(()))
    codes = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return torch.cat([d[..., None].contiguous().view(torch.uint8), codes.view(torch.uint8)], dim=-1).reshape(out, -1).contiguous()


def q8_0_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> "BlockLinear":
    """A float projection as Q8_0 blocks on the block kernel (`q8_0_blocks`)."""
    return BlockLinear("q8_0", q8_0_blocks(weight), weight.shape[1], bias)


class JoinedLinear:
    """Projections of different code kinds side by side (a fused q|k|v whose parts differ): outputs concatenated."""

    format = "codes"

    def __init__(self, parts: list[CodesLinear]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def __call__(self, x: torch.Tensor, wide: bool | int = False, *, logits: bool = False) -> torch.Tensor:
        return torch.cat([p(x, wide, logits=logits) for p in self.parts], dim=-1)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


def _layout(p) -> tuple:
    """What two projections must share to be stacked into one product."""
    if isinstance(p, BlockLinear):
        return ("blocks", p.kind)
    return ("codes", p.bits, p.group, p.zeros is None)


def joined(parts: list) -> "CodesLinear | BlockLinear | JoinedLinear":
    """Projections side by side: one product where they share a layout (their codes stacked), else one product per
    run of parts that share one (a Q4_K_M layer's q and k are Q4_K, its v Q6_K: two products)."""
    flat = [q for p in parts for q in (p.parts if isinstance(p, JoinedLinear) else [p])]
    runs: list[list] = []
    for p in flat:
        if runs and _layout(runs[-1][0]) == _layout(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    if len(runs) > 1:
        return JoinedLinear([joined(run) if len(run) > 1 else run[0] for run in runs])
    first = parts[0]
    if isinstance(first, BlockLinear):
        return _joined_blocks(flat)
    out = CodesLinear.__new__(CodesLinear)
    out.kind, out.group, out.dtype, out.bits = first.kind, first.group, first.dtype, first.bits
    out.in_features, out.out_features = first.in_features, sum(p.out_features for p in flat)
    out.codes = torch.cat([p.codes for p in flat])
    out.scales = torch.cat([p.scales for p in flat])
    out.zeros = None if first.zeros is None else torch.cat([p.zeros for p in flat])
    biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in flat]
    out.bias = None if all(p.bias is None for p in flat) else torch.cat(biases)
    start = 0
    for p in flat:  # the parts become views of the fused tensors: one copy of the codes
        end = start + p.out_features
        p.codes, p.scales = out.codes[start:end], out.scales[start:end]
        if out.zeros is not None:
            p.zeros = out.zeros[start:end]
        start = end
    return out


def _joined_blocks(parts: list[BlockLinear]) -> BlockLinear:
    biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
    bias = None if all(p.bias is None for p in parts) else torch.cat(biases)
    out = BlockLinear(parts[0].kind, torch.cat([p.blocks for p in parts]), parts[0].in_features, bias)
    start = 0
    for p in parts:  # the parts read their rows in the fused projection: one copy, packed or not
        p._blocks, p._source = None, (out, start)
        start += p.out_features
    return out


class CodesProjection(torch.nn.Module):
    """A model's Linear whose weights live only in their codes (the direct GGUF loader puts these in place of the
    decoder's projections and the LM head): transformers' own forward runs through the kernel too, and the fast
    forward takes `linear` as it is. `weight` dequantises on demand (float32; for tools that read it, not for
    decoding)."""

    def __init__(self, linear: "CodesLinear | BlockLinear | JoinedLinear") -> None:
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.dequantized()

    bias = None  # a projection's bias is inside `linear`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class CodesEmbedding(torch.nn.Module):
    """A token embedding kept in its codes: a lookup dequantises the rows it reads into the activations' type."""

    def __init__(self, linear: "CodesLinear | BlockLinear", dtype: torch.dtype) -> None:
        super().__init__()
        self.codes = linear
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features

    @property
    def weight(self) -> torch.Tensor:
        return self.codes.dequantized().to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.codes.rows(flat)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)


def out_rows(module) -> int:
    """Rows of a model's output or input embedding module (its vocabulary), without reading its weights."""
    for name in ("out_features", "num_embeddings"):
        if hasattr(module, name):
            return int(getattr(module, name))
    return int(module.weight.shape[0])


def weight_rows(module, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of an embedding's or a projection's weights: from the codes where it holds codes (no full
    dequantisation), else the float weights' rows."""
    if isinstance(module, CodesProjection) and isinstance(module.linear, (CodesLinear, BlockLinear)):
        return module.linear.rows(index)
    if isinstance(module, CodesEmbedding):
        return module.codes.rows(index).to(module.dtype)
    return module.weight.detach()[index]


def codes_of(tensor: GGUFTensor, bias: torch.Tensor | None = None) -> CodesLinear:
    """One decoded tensor as a projection on draftwise's kernel."""
    return CodesLinear(tensor.kind, tensor.codes, tensor.scales, tensor.zeros, tensor.group,
                       _OFFSET[tensor.kind], bias, torch.float32)


def codes_linear(tensors: list[GGUFTensor], bias: torch.Tensor | None):
    """A fused projection in its codes on draftwise's kernel: one product over parts of one kind, or one per run of
    parts of the same kind, outputs joined (Q4_K_M files mix Q4_K and Q6_K in one layer's q, k, v)."""
    runs: list[list[GGUFTensor]] = []
    for t in tensors:
        if runs and runs[-1][0].kind == t.kind:
            runs[-1].append(t)
        else:
            runs.append([t])
    pieces = []
    start = 0
    for run in runs:
        joined = join(run)
        rows = joined.codes.shape[0]
        pieces.append(codes_of(joined, None if bias is None else bias[start: start + rows]))
        start += rows
    return pieces[0] if len(pieces) == 1 else JoinedLinear(pieces)


class Linear(Protocol):
    """What the fast forward asks of a projection, in whatever format: y = x W^T (+ b) for activations x
    [..., in_features] (`wide`: a prompt feed, or the packed index from which the tokens are prompt tokens;
    `logits`: the LM head's product, float32 out), and the float weights it stands for."""

    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor, wide: bool | int = False, *, logits: bool = False) -> torch.Tensor: ...

    def dequantized(self) -> torch.Tensor: ...
