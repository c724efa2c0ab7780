"""Weight formats: what a loaded model's fast forward runs each projection in, one class and one entry a format.

A format is a `Format` subclass: `linear(name, parts, weight, bias)` gives the fast forward (`fast.FastModel`) one
projection in the format (one of `models.linear`'s classes, or any object with their call), `describe()` says what the
model runs, and the class methods `refuse` (why the format cannot serve a model, in one line) and `build` (the
format's state for one model) have defaults. Its entry, `register(WeightFormat(name, cls, help))`, makes the name a
`dtype` of `load_model` and of every command's `--dtype`: `load_model(spec, dtype=name)` builds the format for the
model and attaches it (`attach`); the runner's fast forward then runs it, and `LoadedModel.weights` describes it.

The transformers model itself keeps float weights (its dequantised copy, for the generic path and the tests'
reference); decoding and verification both run the format, so a lossless method is exact towards the target as it
runs. A model loaded straight into a GGUF file's codes (`gguf_codes`) has its projections in the format already:
its state is a `CodesFormats`, with `codes` set.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from draftwise.errors import DraftwiseError
from draftwise.models import qkernel
from draftwise.models.linear import BlockLinear, FloatLinear, Int4Linear, Int8Linear, Linear, codes_linear
from draftwise.models.quant import _FOUR_BIT, GROUP, QUANTISED, _match_rows, gguf_name, join, read_gguf_weights


class NotApplicable(DraftwiseError):
    """The format has nothing to run in this model (a GGUF file without quantised tensors): an explicit request says
    so in one line; 'auto' runs the float weights."""


class Format:
    """One weight format's state for one model (see the module docstring)."""

    @classmethod
    def refuse(cls, *, gguf: bool, device: torch.device) -> str | None:
        """Why the format cannot serve a model loaded from a GGUF file (`gguf`) or not, on `device`; None: it can."""
        return None

    @classmethod
    def build(cls, model, *, gguf: Path | None, dtype: torch.dtype) -> "Format":
        """The format's state for `model` (loaded from the GGUF file `gguf`, if any; activations in `dtype`)."""
        return cls()

    def linear(self, name: str, parts: list[tuple[str, torch.Tensor]], weight: torch.Tensor,
               bias: torch.Tensor | None) -> Linear:
        """Projection `name` ('layers.3.qkv', 'lm_head', ...): the float `weight` [out, in] (its `parts`, each a
        transformers parameter name and its rows, side by side) and `bias`, in this format."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class WeightFormat:
    """A registry entry: the `dtype` name, the format's class (None: float weights, e.g. 'dequantize') and the words
    `--dtype`'s help gives it."""

    name: str
    format: type[Format] | None
    help: str = ""


FORMATS: dict[str, WeightFormat] = {}


def register(new: WeightFormat) -> WeightFormat:
    """Make `new.name` (lower case: dtypes are matched in lower case) a weight format."""
    if new.name != new.name.lower():
        raise ValueError(f"weight format names are lower case, not {new.name!r}")
    FORMATS[new.name] = new
    return new


def entry(name: object) -> WeightFormat | None:
    """The registered format `name` names (a string, any case), or None."""
    return FORMATS.get(name.lower()) if isinstance(name, str) else None


@dataclass(eq=False)
class ModelFormat:
    """The weight format a loaded transformers model runs, attached to it (`attach`, read back with `of`): the
    registry's name and the format's state. codes: the model was loaded straight into its GGUF codes (its
    projections are already the format's). Compared by identity: each load attaches a new one, and the runner
    builds its fast forward again for it."""

    name: str
    format: Format
    codes: bool = False


_ATTRIBUTE = "draftwise_format"


def of(model) -> ModelFormat | None:
    return getattr(model, _ATTRIBUTE, None)


def attach(model, attached: ModelFormat | None) -> None:
    setattr(model, _ATTRIBUTE, attached)


class GGUFFormats(Format):
    """Each projection in the GGUF file's own quantisation where it has one.

    How each runs (`linear`): with draftwise's codes kernel, every kind in its codes (`linear.CodesLinear`, one
    product per run of parts of one kind). Without it, 4-bit codes (Q4_0, Q4_1, Q4_K) run as int4 groups of 32
    (`linear.Int4Linear`: w = (q - 8) * scale + zero) with bf16 activations, so the kernel holds scale and zero in
    bf16: they are rounded by up to 2^-9 of their value (the 4-bit codes are kept exactly). PyTorch's int4 CPU kernel
    has no fast fp32 path. Prompt feeds run the dequantised weights (see `linear.Int4Linear`). Q5_0, Q6_K and Q8_0
    blocks are dequantised exactly (in fp32) and run as float in the activations' type: no PyTorch CPU kernel takes
    5-, 6- or 8-bit codes with a scale per group of 16 or 32, and the alternatives (per-group `_weight_int8pack_mm`
    calls) are slower than oneDNN's prepacked bf16 product. Other GGUF types (F32, F16, BF16) run as float."""

    def __init__(self, path: Path, model, activation_dtype: torch.dtype) -> None:
        self.path = Path(path)
        self.tensors = read_gguf_weights(self.path)
        if not self.tensors:
            raise NotApplicable(f"{path}: no quantised tensors ({', '.join(QUANTISED)}) to keep; load it with a "
                                "float dtype")
        self.dtype = activation_dtype
        self.codes = qkernel.available()  # draftwise's kernel runs every kind in its codes
        self.tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.kinds: dict[str, int] = {}
        config = model.config
        self.heads = tuple({config.num_attention_heads,
                            getattr(config, "num_key_value_heads", None) or config.num_attention_heads})

    @classmethod
    def refuse(cls, *, gguf: bool, device: torch.device) -> str | None:
        if not gguf:
            return ("dtype 'gguf' keeps a GGUF file's quantisation, but this model was not loaded from a .gguf file; "
                    "choose auto, bf16, fp16, fp32 or int8")
        if device.type != "cpu":
            return "dtype 'gguf' runs PyTorch's int4 CPU kernel; on a GPU choose auto, bf16, fp16 or int8"
        return None

    @classmethod
    def build(cls, model, *, gguf: Path | None, dtype: torch.dtype) -> "GGUFFormats":
        return cls(gguf, model, dtype)

    def linear(self, name: str, parts: list[tuple[str, torch.Tensor]], weight: torch.Tensor,
               bias: torch.Tensor | None) -> Linear:
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


class Int8Formats(Format):
    """Every projection int8 weight-only, one scale per output channel, quantised from the float weights."""

    def describe(self) -> str:
        return "int8 weight-only"

    def linear(self, name: str, parts, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
        return Int8Linear.quantize(weight, bias)


class CodesFormats(Format):
    """The format of a model loaded in its GGUF codes (its projections are already in place)."""

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


# The registry. A new format: its class above (or anywhere) and one line here.
register(WeightFormat("gguf", GGUFFormats, "the file's quantisation"))
register(WeightFormat("int8", Int8Formats, "weight-only"))
register(WeightFormat("dequantize", None))
