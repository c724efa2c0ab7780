"""A feature-level draft head (EAGLE, Li et al. 2024) and its drafter.

The head predicts the target's next last-layer feature from the target's own
feature at position t and the embedding of token t+1 (fc over the concatenation,
one Llama decoder layer with its own KV cache). The target's frozen LM head,
restricted to a frequency-ranked draft vocabulary, turns predicted features into
draft distributions: zero outside that vocabulary, so speculative sampling stays
exact. The target's embedding and LM head are shared, not stored: a head file
holds only its own layers and the draft vocabulary (a few MB).

Alignment: head position i reads (feature_i, token_{i+1}) and predicts
feature_{i+1}, whose LM-head logits score token_{i+2}.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaModel

from draftwise.errors import DraftwiseError
from draftwise.models.head_files import EAGLE_CONFIG as CONFIG_FILE
from draftwise.models.linear import FloatLinear, float32_product, out_rows, weight_rows

WEIGHTS_FILE = "eagle.safetensors"


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    target_vocab_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    target: str = ""  # the target it was trained for (registry name or path), for error messages


class DraftHead(nn.Module):
    """A feature-level draft head: EAGLE-1 (`EagleHead`) or EAGLE-3 (`eagle3.Eagle3Head`).

    What the drafters use: `feature_layers` (target layers whose inputs the head reads; empty:
    the target's final normed state), `feature_size`, `take_features(runner_hidden)`,
    `step_input(x, tokens)` (the body's input from target features or the previous step's
    output), `body` (run like a base model), `logits(states)` and `vocab_ids`."""

    feature_layers: tuple[int, ...] = ()


class EagleHead(DraftHead):
    def __init__(self, config: EagleConfig, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=True)
        body = LlamaConfig(
            vocab_size=1, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
            num_hidden_layers=1, num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
            rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
            rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
            bos_token_id=None, eos_token_id=None, pad_token_id=None,
        )
        self.body = LlamaModel(body)
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=True)  # [draft_vocab] target token ids
        # The target's embedding and LM-head rows: shared and frozen, so kept out of
        # this module's parameters and state dict (a plain dict is not registered).
        self._shared: dict[str, object] = {}

    @property
    def draft_vocab_size(self) -> int:
        return int(self.vocab_ids.shape[0])

    @property
    def feature_size(self) -> int:
        return self.config.hidden_size

    def take_features(self, runner_hidden: torch.Tensor) -> torch.Tensor:
        return runner_hidden

    def step_input(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[..., H] target features or predicted ones, [...] the next tokens -> fused body inputs [..., H]."""
        embedded = self._shared["embed"](tokens).to(self.fc.weight.dtype)
        return self.fc(torch.cat([x.to(self.fc.weight.dtype), embedded], dim=-1))

    def attach(self, target_model) -> "EagleHead":
        """Share the target's embedding and LM head (restricted to the draft vocabulary)."""
        if self._shared.get("target") is target_model:
            return self
        hidden = target_model.config.hidden_size
        vocab = out_rows(target_model.get_output_embeddings())
        if hidden != self.config.hidden_size or vocab != self.config.target_vocab_size:
            raise DraftwiseError(
                f"this EAGLE head was trained for a target with hidden size {self.config.hidden_size} and vocabulary "
                f"{self.config.target_vocab_size} ({self.config.target or 'unknown'}); the target has {hidden} and {vocab}"
            )
        self._shared["target"] = target_model
        self._shared["embed"] = target_model.get_input_embeddings()
        head = target_model.get_output_embeddings()
        self._shared["head_weight"] = weight_rows(head, self.vocab_ids.to(self.fc.weight.device)).to(self.fc.weight.dtype)
        self._shared["head_product"] = FloatLinear(self._shared["head_weight"])
        return self

    @property
    def head_weight(self) -> torch.Tensor:  # [draft_vocab, hidden]
        if "head_weight" not in self._shared:
            raise DraftwiseError("EAGLE head used before attach(target_model)")
        return self._shared["head_weight"]

    def to(self, *args, **kwargs):  # keep the shared head rows on the same device/dtype
        moved = super().to(*args, **kwargs)
        if "head_weight" in self._shared:
            self._shared["head_weight"] = self._shared["head_weight"].to(self.fc.weight.device, self.fc.weight.dtype)
            self._shared["head_product"] = FloatLinear(self._shared["head_weight"])
        return moved

    def forward(
        self, features: torch.Tensor, next_tokens: torch.Tensor, *, cache: DynamicCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """features: [B, T, H] target features; next_tokens: [B, T] the token after each. Returns predicted [B, T, H]."""
        assert features.ndim == 3 and next_tokens.ndim == 2
        fused = self.step_input(features, next_tokens)  # [B, T, H]
        out = self.body(inputs_embeds=fused, past_key_values=cache, use_cache=cache is not None,
                        attention_mask=attention_mask)
        return out.last_hidden_state

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., draft_vocab] float32, whatever the head's type (never rounded to bf16): drafting runs the
        shared rows through `FloatLinear` (draftwise's kernel, its float32 sums as they are), training (autograd on)
        through `float32_product`."""
        if torch.is_grad_enabled():
            return float32_product(predicted, self.head_weight)
        product = self._shared.get("head_product")
        if product is None:
            raise DraftwiseError("EAGLE head used before attach(target_model)")
        return product(predicted, logits=True)

    def save(self, directory: str | Path, *, dtype: torch.dtype = torch.float16) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.state_dict().items()}
        save_file({k: v.contiguous() for k, v in state.items()}, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> "EagleHead":
        directory = Path(directory)
        config = EagleConfig(**json.loads((directory / CONFIG_FILE).read_text()))
        state = load_file(str(directory / WEIGHTS_FILE))
        head = cls(config, state["vocab_ids"])
        head.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        return head.eval()
