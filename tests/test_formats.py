"""The weight-format registry (`models.formats`): a format is one class and one entry.

A toy format (the float weights rounded to multiples of 1/8) is added the way a real one is, in two edits (its
class and its registry entry); `load_model(..., dtype=<its name>)` then loads a tiny model in it, the fast forward
runs its projections (the logits equal, bit for bit, those of a float model holding the rounded weights, and differ
from the unrounded model's), the model describes it, and its state rides on the model (`formats.of`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import tiny_llama
from draftwise.errors import DraftwiseError
from draftwise.models import formats, loading
from draftwise.models.linear import FloatLinear
from draftwise.models.runner import ModelRunner, fast_model

IDS = torch.tensor([[3, 17, 5, 40, 9, 22, 61, 8]])


def _eighths(weight: torch.Tensor) -> torch.Tensor:
    return torch.round(weight * 8) / 8


class Eighths(formats.Format):  # edit 1: the format's class
    """Every projection (the LM head too) runs its float weights rounded to multiples of 1/8."""

    def linear(self, name, parts, weight, bias):
        return FloatLinear(_eighths(weight), bias)

    def describe(self) -> str:
        return "weights in eighths"


class GGUFOnly(formats.Format):
    @classmethod
    def refuse(cls, *, gguf: bool, device: torch.device) -> str | None:
        return None if gguf else "dtype 'gguf-only' needs a .gguf file"


@pytest.fixture
def eighths(monkeypatch):
    monkeypatch.setattr(loading, "cpu_has_native_bf16", lambda: False)  # fp32 activations on every CPU
    # edit 2: its entry (formats.register(...) in the package; here for this test only)
    monkeypatch.setitem(formats.FORMATS, "eighths", formats.WeightFormat("eighths", Eighths, "toy"))


def _logits(model) -> torch.Tensor:
    runner = ModelRunner(model)
    assert runner.fast is not None  # the fast forward, which runs the formats
    with torch.inference_mode():
        return runner.forward_rows(IDS, [IDS.shape[1]]).logits


def test_a_registered_format_loads_and_runs_a_model(eighths):
    model = tiny_llama(7)
    original = copy.deepcopy(model)
    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for module in rounded.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(_eighths(module.weight))
    loaded = loading.load_model(model, dtype="eighths")
    attached = formats.of(loaded.model)
    assert attached.name == "eighths" and isinstance(attached.format, Eighths) and not attached.codes
    assert loaded.weights == "weights in eighths with fp32 activations"
    ours = _logits(loaded.model)
    assert torch.equal(ours, _logits(rounded))  # the rounded weights' products, bit for bit
    assert float((ours - _logits(original)).abs().max()) > 1e-2  # control: not the unrounded weights
    assert formats.of(original) is None


def test_a_model_loaded_again_gets_a_new_format_and_fast_forward(eighths):
    loaded = loading.load_model(tiny_llama(7), dtype="eighths")
    first, forward = formats.of(loaded.model), fast_model(loaded.model)
    assert fast_model(loaded.model) is forward  # built once a load
    again = loading.load_model(loaded, dtype="eighths")
    assert formats.of(again.model) is not first and fast_model(again.model) is not forward


def test_a_registered_name_is_a_dtype_and_bad_ones_fail_in_one_line(eighths, monkeypatch):
    assert loading.resolve_dtype("eighths") == torch.float32
    with pytest.raises(DraftwiseError, match=r"unknown dtype 'eights'; choose one of auto, .*, eighths"):
        loading.resolve_dtype("eights")
    with pytest.raises(ValueError, match="lower case"):  # dtypes are matched in lower case
        formats.register(formats.WeightFormat("Eighths", Eighths))
    assert "Eighths" not in formats.FORMATS
    monkeypatch.setitem(formats.FORMATS, "gguf-only", formats.WeightFormat("gguf-only", GGUFOnly))
    with pytest.raises(DraftwiseError, match=r"^dtype 'gguf-only' needs a \.gguf file$"):
        loading.load_model(tiny_llama(7), dtype="gguf-only")


def test_the_built_in_formats_are_registry_entries():
    assert list(formats.FORMATS) == ["gguf", "int8", "dequantize"]
    assert all(name in loading.DTYPE_HELP for name in formats.FORMATS)
    assert formats.FORMATS["dequantize"].format is None  # float weights: nothing attached
    with pytest.raises(DraftwiseError, match="was not loaded from a .gguf file"):
        loading.load_model(tiny_llama(7), dtype="gguf")
