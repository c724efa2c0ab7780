"""Weight formats: what a loaded model's fast forward runs each projection in.

A format is chosen at load time (`load_model(dtype=...)`) and attached to the transformers model; the runner's
`FastModel` asks it for each projection (`linear(name, parts, weight, bias)`, returning one of `models.linear`'s
classes) and the model's description asks it to `describe()` itself.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftwise.errors import DraftwiseError
from draftwise.models import qkernel
from draftwise.models.linear import BlockLinear, FloatLinear, Int4Linear, Int8Linear, codes_linear
from draftwise.models.quant import _FOUR_BIT, GROUP, QUANTISED, _match_rows, gguf_name, join, read_gguf_weights


class NoQuantisedTensors(DraftwiseError):
    pass


class GGUFFormats:
    """`linear` for FastModel: each projection in the GGUF file's own quantisation where it has one."""

    def __init__(self, path: Path, model, activation_dtype: torch.dtype) -> None:
        self.path = Path(path)
        self.tensors = read_gguf_weights(self.path)
        if not self.tensors:
            raise NoQuantisedTensors(f"{path}: no quantised tensors ({', '.join(QUANTISED)}) to keep; load it "
                                    "with a float dtype")
        self.dtype = activation_dtype
        self.codes = qkernel.available()  # draftwise's kernel runs every kind in its codes
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.kinds: dict[str, int] = {}
        config = model.config
        self.heads = tuple({config.num_attention_heads,
                            getattr(config, "num_key_value_heads", None) or config.num_attention_heads})

    def linear(self, name: str, parts: list[tuple[str, torch.Tensor]], weight: torch.Tensor,
               bias: torch.Tensor | None):
        found = [self.tensors.get(gguf_name(part, self.tied)) for part, _ in parts]
        kinds = {t.kind if t is not None else "float" for t in found}
        if "float" in kinds or (len(kinds) != 1 and not self.codes):  # float parts: the dequantised weights
            self.kinds["float"] = self.kinds.get("float", 0) + 1
            return FloatLinear(weight, bias)
        matched = [_match_rows(t, w, gguf_name(p, self.tied), self.heads) for t, (p, w) in zip(found, parts)]
        if self.codes:  # draftwise's kernel: every kind in its codes, one product per part where kinds differ
            for t in matched:
                self.kinds[t.kind] = self.kinds.get(t.kind, 0) + 1
            return codes_linear(matched, bias)
        kind = kinds.pop()
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        joined = join(matched)
        # 5-, 6- and 8-bit codes (see the module docstring), or a row count PyTorch's int4 kernel cannot pack (it
        # needs a multiple of 16): float from the exactly dequantised blocks
        if kind not in _FOUR_BIT or joined.codes.shape[0] % 16:
            return FloatLinear(joined.dequantized().to(self.dtype), bias)
        codes, scales, zeros = joined.int4()
        return Int4Linear(codes, scales, zeros, GROUP, bias, self.dtype)

    def describe(self) -> str:
        kernel = "draftwise's codes kernel" if self.codes else "PyTorch's kernels"
        kinds = self.kinds
        if not kinds:  # before the first forward builds the projections: the file's quantised projection tensors
            kinds = {}
            for name, tensor in self.tensors.items():
                if name != "token_embd.weight" or self.tied:
                    kinds[tensor.kind] = kinds.get(tensor.kind, 0) + 1
        return "gguf (" + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) + f" projections; {kernel})"


class Int8Formats:
    """Every projection int8 weight-only, one scale per output channel, quantised from the float weights."""

    def describe(self) -> str:
        return "int8 weight-only"

    def linear(self, name: str, parts, weight: torch.Tensor, bias: torch.Tensor | None):
        return Int8Linear.quantize(weight, bias)


class CodesFormats:
    """The `draftwise_formats` of a model loaded in its codes (its projections are already in place)."""

    def __init__(self, model) -> None:
        self.kinds: dict[str, int] = {}
        self.blocks = False
        for module in model.modules():
            linear = getattr(module, "linear", None)
            for part in getattr(linear, "parts", [linear] if linear is not None else []):
                self.kinds[part.kind] = self.kinds.get(part.kind, 0) + 1
                self.blocks = self.blocks or isinstance(part, BlockLinear)

    def linear(self, name, parts, weight, bias):
        raise AssertionError("a model loaded in its codes builds no projection from float weights")

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.kinds.items()))
        if self.blocks:
            return f"gguf blocks ({kinds} projections; draftwise's kernel, activations quantised to int8 per block)"
        return f"gguf codes ({kinds} projections; draftwise's kernel)"
