"""draftwise's own product for weights kept in a GGUF file's codes (csrc/qmm.cpp), built as a torch extension.

`make install` builds it once (`python -m draftwise.models.qkernel`) into `<cache>/kernels/qmm-<hash>/`, keyed by
the source, torch's version and the compiler; a later import loads the built library without compiling. Where it
cannot be built (no compiler), `available()` says why in one line and the GGUF formats fall back to PyTorch's
kernels (`models.quant`). The AVX2 path runs where the CPU has AVX2 and FMA; elsewhere the portable loop (same
decode, scalar sums) runs.

`CodesLinear` is one projection in its codes: 4-bit codes packed two to a byte (Q4_0, Q4_1, Q4_K: 0.5 byte a weight
plus a float32 scale and zero per 32), 5-, 6- and 8-bit codes one signed byte a weight (Q5_0, Q6_K, Q8_0, less their
offsets; a float32 scale per 16 or 32). It keeps nothing else: no float copy. Every width (one decoding token, a
verification of 16, a prompt chunk) runs the same kernel, whose per-row sums are taken in one order whatever the
width: a token's result never depends on its batch-mates."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import torch

from .cache import cache_root

SOURCE = Path(__file__).resolve().parent / "csrc" / "qmm.cpp"
_module = None
_problem: str | None = None


def _build_dir() -> Path:
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + sys.version.encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"qmm-{key}"


def load(verbose: bool = False):
    """The compiled module (building it on first use), or None with `problem()` saying why."""
    global _module, _problem
    if _module is not None or _problem is not None:
        return _module
    if os.environ.get("DRAFTWISE_QKERNEL", "1") == "0":
        _problem = "turned off (DRAFTWISE_QKERNEL=0)"
        return None
    try:
        from torch.utils.cpp_extension import load as build

        directory = _build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        scripts = str(Path(sys.executable).parent)  # the venv's own ninja (a dependency), venv activated or not
        if scripts not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        _module = build(name="draftwise_qmm", sources=[str(SOURCE)], build_directory=str(directory),
                        extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=verbose)
    except Exception as error:  # noqa: BLE001 - no compiler, no ninja: fall back, say why
        _problem = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        _module = None
    return _module


def available() -> bool:
    return load() is not None


def problem() -> str | None:
    load()
    return _problem


class CodesLinear:
    """y = x W^T (+ b) with W in its GGUF codes (see the module docstring)."""

    format = "codes"

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

    def __call__(self, x: torch.Tensor, wide: bool | int = False) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).float().contiguous()
        y = load().qmm(flat, self.codes, self.bits, self.scales, self.zeros, self.group, False)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float weights the codes encode (float32), for checks and round trips."""
        return self.rows(torch.arange(self.out_features))

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


class JoinedLinear:
    """Projections of different code kinds side by side (a fused q|k|v whose parts differ): outputs concatenated."""

    format = "codes"

    def __init__(self, parts: list[CodesLinear]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def __call__(self, x: torch.Tensor, wide: bool | int = False) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


def joined(parts: list) -> "CodesLinear | JoinedLinear":
    """Projections side by side: one product where they share a kind and a group (their codes stacked), else one
    per part."""
    first = parts[0]
    same = all(isinstance(p, CodesLinear) and p.bits == first.bits and p.group == first.group
               and (p.zeros is None) == (first.zeros is None) for p in parts)
    if not same:
        flat = [q for p in parts for q in (p.parts if isinstance(p, JoinedLinear) else [p])]
        return JoinedLinear(flat)
    out = CodesLinear.__new__(CodesLinear)
    out.kind, out.group, out.dtype, out.bits = first.kind, first.group, first.dtype, first.bits
    out.in_features, out.out_features = first.in_features, sum(p.out_features for p in parts)
    out.codes = torch.cat([p.codes for p in parts])
    out.scales = torch.cat([p.scales for p in parts])
    out.zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
    biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
    out.bias = None if all(p.bias is None for p in parts) else torch.cat(biases)
    start = 0
    for p in parts:  # the parts become views of the fused tensors: one copy of the codes
        end = start + p.out_features
        p.codes, p.scales = out.codes[start:end], out.scales[start:end]
        if out.zeros is not None:
            p.zeros = out.zeros[start:end]
        start = end
    return out


class CodesProjection(torch.nn.Module):
    """A model's Linear whose weights live only in their codes (the direct GGUF loader puts these in place of the
    decoder's projections and the LM head): transformers' own forward runs through the kernel too, and the fast
    forward takes `linear` as it is. `weight` dequantises on demand (float32; for tools that read it, not for
    decoding)."""

    def __init__(self, linear: CodesLinear | JoinedLinear) -> None:
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

    def __init__(self, linear: CodesLinear, dtype: torch.dtype) -> None:
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
    if isinstance(module, CodesProjection) and isinstance(module.linear, CodesLinear):
        return module.linear.rows(index)
    if isinstance(module, CodesEmbedding):
        return module.codes.rows(index).to(module.dtype)
    return module.weight.detach()[index]


def main() -> int:
    """`python -m draftwise.models.qkernel`: build the kernel now (make install does), say where or why not."""
    module = load(verbose="-v" in sys.argv)
    if module is None:
        print(f"draftwise: the GGUF-codes kernel was not built ({_problem}); PyTorch's kernels will run instead",
              file=sys.stderr)
        return 0
    print(f"draftwise: GGUF-codes kernel ready in {_build_dir()} "
          f"({'AVX2' if module.accelerated() else 'portable'} path on this CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
