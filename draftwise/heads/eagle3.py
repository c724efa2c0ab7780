"""An EAGLE-3-style draft head (Li et al. 2025), laid out as vLLM's and SGLang's `llama_eagle3` load it.

Inputs: the target's hidden states entering a low, a middle and a high decoder layer
(`feature_layers`, by default (2, L // 2, L - 3) as vLLM and SGLang pick them), fused
by `fc` (3H -> H, no bias). One decoder layer (`midlayer`) reads the concatenation of
its normed token embedding and its normed hidden input (2H wide into q, k and v); its
residual stream carries the hidden input. The layer's pre-norm output is both the next
drafting step's hidden input and, through `norm` and `lm_head` over a reduced draft
vocabulary, the next token's distribution (with `shared_lm_head`, lm_head holds the target's
own LM-head rows for that vocabulary, frozen and not stored: a head file of a few MB):

    step 0 at position i:  x = fc([f_low, f_mid, f_high](i)),  token t_{i+1}  ->  scores t_{i+2}
    step k at position i:  x = pre-norm output of step k - 1,  token t_{i+1+k} -> scores t_{i+2+k}

The token embedding is the target's (shared, never stored). Tokens outside the draft
vocabulary get probability zero, so speculative sampling with the head stays exact.

The head plugs into the same drafters as the EAGLE-1 head (`eagle.EagleDrafter`,
`drafters.eagle.EagleRowsDrafter`) through four members: `feature_layers`, `feature_size`,
`step_input(x, tokens)` and `body` (a module the drafters run like a base model, with
the engine's position-indexed KV cache or a transformers DynamicCache).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from draftwise.heads.eagle import DraftHead
from draftwise.errors import DraftwiseError
from draftwise.models.head_files import EAGLE3_CONFIG as CONFIG_FILE
from draftwise.models.linear import float32_product, out_rows, weight_rows

WEIGHTS_FILE = "eagle3.safetensors"


def eagle3_layers(num_layers: int) -> tuple[int, int, int]:
    """The low, middle and high layers whose inputs EAGLE-3 fuses (vLLM's and SGLang's default choice)."""
    if num_layers < 4:
        raise DraftwiseError(f"an EAGLE-3 head needs a target with at least 4 layers, this one has {num_layers}")
    return (2, num_layers // 2, num_layers - 3)

@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    target_vocab_size: int
    feature_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    target: str = ""  # registry name or path of the target it was trained for
    dynamic: dict = field(default_factory=dict)  # tuned dynamic draft length: {"confidence": top-probability floor}
    shared_lm_head: bool = False  # lm_head = the target's rows of the draft vocabulary (frozen, not stored)

    def __post_init__(self) -> None:
        object.__setattr__(self, "feature_layers", tuple(int(i) for i in self.feature_layers))


class _Folded:
    """A stand-in with a `weight` (a packing source): fc's folded weight, or the scale whose version stamps it."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class _Attention(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        self.input_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _MLP(c)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (Llama's): x [B, heads, T, d], positions [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))  # [d/2]
    angles = positions.to(torch.float32)[..., None] * inv  # [B, T, d/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]  # [B, 1, T, d]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Eagle3Body(nn.Module):
    """The decoder layer, runnable by `ModelRunner.forward_states` (engine rows) or with a DynamicCache.

    Its "embeds" are [B, T, 2H]: the token embedding then the hidden input. Returns the
    layer's pre-norm output as `last_hidden_state` [B, T, H]."""

    def __init__(self, c: Eagle3Config) -> None:
        super().__init__()
        from transformers import LlamaConfig

        self.c = c
        self.midlayer = _MidLayer(c)
        # what ModelRunner reads from a model's config (a Llama layer with one KV layer)
        self.config = LlamaConfig(
            vocab_size=1, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=1,
            num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
            max_position_embeddings=c.max_position_embeddings, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        self.config._attn_implementation = "sdpa"

    @property
    def base_model(self) -> "Eagle3Body":
        return self

    def get_output_embeddings(self) -> None:
        return None

    def qkv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, 2H] (embedding, hidden) -> q [B, heads, T, d], k and v [B, kv_heads, T, d], RoPE applied."""
        c, layer = self.c, self.midlayer
        h = c.hidden_size
        x = torch.cat([layer.input_layernorm(x[..., :h]), layer.hidden_norm(x[..., h:])], dim=-1)
        B, T, _ = x.shape
        attn = layer.self_attn
        packed = self.packed()
        if packed is not None:  # one prepacked product for q, k and v
            q, k, v = packed["qkv"](x).split([c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2, -1)
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q.reshape(B, T, c.num_heads, c.head_dim).transpose(1, 2)
        k = k.reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = v.reshape(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v

    def finish(self, hidden_in: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """hidden_in [B, T, H], attended [B, heads, T, d] -> the layer's pre-norm output [B, T, H]."""
        B, _, T, _ = attended.shape
        layer = self.midlayer
        packed = self.packed()
        if packed is None:
            r = hidden_in + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(B, T, -1))
            return r + layer.mlp(layer.post_attention_layernorm(r))
        r = hidden_in + packed["o"](attended.transpose(1, 2).reshape(B, T, -1))
        gate, up = packed["gate_up"](layer.post_attention_layernorm(r)).chunk(2, dim=-1)
        return r + packed["down"](F.silu(gate) * up)

    def packed(self) -> dict | None:
        """The head's prepacked products (`Eagle3Head.pack_for_inference`), when they apply: eval mode, no autograd."""
        packed = self.__dict__.get("_packed")
        return packed if packed is not None and not self.training and not torch.is_grad_enabled() else None

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, past_key_values=None, use_cache: bool = True,
                **_: object) -> SimpleNamespace:
        B, T, _ = inputs_embeds.shape
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=inputs_embeds.device)[None].expand(B, -1)
        q, k, v = self.qkv(inputs_embeds, position_ids)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, 0)
        if attention_mask is None:
            if hasattr(past_key_values, "attention_mask"):  # draftwise's PositionCache: masks by true positions
                attention_mask = past_key_values.attention_mask(position_ids, q.dtype, additive=False)
            else:
                keys = torch.arange(k.shape[2], device=q.device)
                attention_mask = (keys[None, :] <= position_ids[0, :, None])[None, None]  # [1, 1, T, S]
        groups = self.c.num_heads // self.c.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        hidden_in = inputs_embeds[..., self.c.hidden_size:]
        return SimpleNamespace(last_hidden_state=self.finish(hidden_in, attended))


class Eagle3Head(DraftHead):
    def __init__(self, config: Eagle3Config, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        if len(config.feature_layers) != 3:
            raise DraftwiseError(f"an EAGLE-3 head fuses 3 target layers, got {config.feature_layers}")
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.body = Eagle3Body(config)
        self.norm = _RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, int(vocab_ids.shape[0]), bias=False)
        if config.shared_lm_head:
            self.lm_head.weight.requires_grad_(False)
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=True)  # [draft_vocab] target token ids
        # fc reads the fused features divided by this, dimension by dimension (`fuse`): the target's massive
        # activations (Qwen2.5: a few dimensions near 4,000 where the rest are near 1) brought to the scale of the
        # rest, so the optimiser sees inputs of one size. A fixed diagonal: exports fold it into fc's weight.
        self.register_buffer("feature_scale", torch.ones(3 * h), persistent=True)
        self._shared: dict[str, object] = {}  # the target's embedding: shared, kept out of the state dict

    # ---- prepacked products for decoding ----

    def pack_for_inference(self, blocks: bool | None = None) -> None:
        """Decoding's products, prepacked: q|k|v and gate|up fused, o, down, fc and the LM head. At batch 1 a draft
        step is a dozen small products, where F.linear's per-call weight handling costs as much as the arithmetic,
        and a draft step reads every weight once, so its cost is the bytes it reads.
        blocks=False: the float weights through `linear.FloatLinear` (CPU, fp32 or bf16; elsewhere plain F.linear).
        blocks=True: the weights in Q8_0 blocks through the block kernel (`linear.BlockLinear`, 8.5 bits a weight
        against fp32's 32), and the LM head the target's own rows in its own blocks when the target is in a GGUF's
        blocks (`BlockLinear.subset`, byte for byte). None (default): blocks where the block kernel runs (CPU) and
        the target is in blocks too. Used in eval mode without autograd only; moving the head, training it or
        loading weights drops them."""
        from draftwise.models.linear import FloatLinear, q8_0_linear
        from draftwise.models import qkernel

        layer = self.body.midlayer
        sources = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj, self.fc, self.lm_head,
                   _Folded(self.feature_scale))
        target_head = self._target_blocks()
        # the weights as they stand: a head packed for them already is not packed again (a drafter per request,
        # which asks for the default: a packing chosen by name stays); an in-place change of any weight (its
        # version counter moves) packs afresh
        stamp = tuple((id(m.weight), m.weight._version) for m in sources)
        if self.__dict__.get("_packed") is not None and self.__dict__.get("_packed_stamp") == stamp and (
                blocks is None or blocks == self.__dict__.get("_packed_blocks")):
            return
        if blocks is None:
            blocks = target_head is not None and self.fc.weight.device.type == "cpu" and qkernel.available()

        def linear(*modules: nn.Linear):
            weight = torch.cat([m.weight.detach() for m in modules])
            # Q8_0 blocks hold 32 inputs: a product whose inputs are not a multiple of 32 stays in floats
            return q8_0_linear(weight) if blocks and weight.shape[1] % 32 == 0 else FloatLinear(weight)

        attn, mlp = layer.self_attn, layer.mlp
        packed = {"qkv": linear(attn.q_proj, attn.k_proj, attn.v_proj), "o": linear(attn.o_proj),
                  "gate_up": linear(mlp.gate_proj, mlp.up_proj), "down": linear(mlp.down_proj),
                  "fc": linear(_Folded(self.fc_weight()))}
        if blocks and target_head is not None and self.config.shared_lm_head:
            packed["lm_head"] = target_head.subset(self.vocab_ids)  # the target's rows, byte for byte
        else:
            packed["lm_head"] = linear(self.lm_head)
        self.__dict__["_packed"] = self.body.__dict__["_packed"] = packed
        self.__dict__["_packed_stamp"] = stamp
        self.__dict__["_packed_blocks"] = bool(blocks)

    def _target_blocks(self):
        """The attached target's LM head when it runs from a GGUF's blocks (`linear.BlockLinear`), else None."""
        from draftwise.models.linear import BlockLinear

        target = self._shared.get("target")
        module = target.get_output_embeddings() if target is not None else None
        linear = getattr(module, "linear", None)
        return linear if isinstance(linear, BlockLinear) else None

    def inference_bytes(self) -> int:
        """The bytes of weights one draft step reads through the packed products (the embedding row aside)."""
        packed = self.__dict__.get("_packed")
        if packed is None:
            return sum(p.numel() * p.element_size() for p in self.parameters())
        total = 0
        for linear in packed.values():
            total += linear.nbytes() if hasattr(linear, "nbytes") else linear.weight.numel() * linear.weight.element_size()
        return total

    def unpack(self) -> None:
        self.__dict__["_packed"] = self.body.__dict__["_packed"] = None

    def _apply(self, fn, *args, **kwargs):  # .to(), .float(), .cuda(): the packed copies would be stale
        self.unpack()
        return super()._apply(fn, *args, **kwargs)

    def train(self, mode: bool = True) -> "Eagle3Head":
        if mode:
            self.unpack()
        return super().train(mode)

    def load_state_dict(self, state_dict, *args, **kwargs):
        self.unpack()
        if "feature_scale" not in state_dict:  # written before the scale existed: it read its features unscaled
            state_dict = {**state_dict, "feature_scale": torch.ones_like(self.feature_scale)}
        return super().load_state_dict(state_dict, *args, **kwargs)

    # ---- the drafters' interface (shared with eagle.EagleHead) ----

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.config.feature_layers

    @property
    def feature_size(self) -> int:
        return 3 * self.config.hidden_size

    @property
    def draft_vocab_size(self) -> int:
        return int(self.vocab_ids.shape[0])

    def take_features(self, runner_hidden: torch.Tensor) -> torch.Tensor:
        """The runner's states with `feature_layers` set ([..., 4H]) -> the fused layers' part [..., 3H]."""
        return runner_hidden[..., : self.feature_size]

    def attach(self, target_model) -> "Eagle3Head":
        if self._shared.get("target") is target_model:
            return self
        hidden = target_model.config.hidden_size
        vocab = out_rows(target_model.get_output_embeddings())
        layers = target_model.config.num_hidden_layers
        if hidden != self.config.hidden_size or vocab != self.config.target_vocab_size or \
                max(self.config.feature_layers) >= layers:
            raise DraftwiseError(
                f"this EAGLE-3 head was trained for a target with hidden size {self.config.hidden_size}, vocabulary "
                f"{self.config.target_vocab_size} and layers {list(self.config.feature_layers)} "
                f"({self.config.target or 'unknown'}); the target has {hidden}, {vocab} and {layers} layers")
        self.unpack()  # the LM-head rows may change below
        self._shared["target"] = target_model
        self._shared["embed"] = target_model.get_input_embeddings()
        if self.config.shared_lm_head:
            with torch.no_grad():
                rows = weight_rows(target_model.get_output_embeddings(), self.vocab_ids.to(self.fc.weight.device))
                self.lm_head.weight.copy_(rows.to(self.lm_head.weight.dtype))
        return self

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The fused target features [..., 3H] -> fc's output [..., H] (each dimension divided by its scale)."""
        return self.fc(features.to(self.fc.weight.dtype) / self.feature_scale.to(self.fc.weight.dtype))

    def fc_weight(self) -> torch.Tensor:
        """fc's weight with the feature scale folded in: fc_weight() @ features == fuse(features) (up to rounding),
        what packed products and exported checkpoints carry."""
        return (self.fc.weight / self.feature_scale.to(self.fc.weight.dtype)).detach()

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if "embed" not in self._shared:
            raise DraftwiseError("EAGLE-3 head used before attach(target_model)")
        embedding = self._shared["embed"]  # the target's: frozen, no gradient
        if not isinstance(embedding, nn.Embedding):  # a target in its GGUF codes: the rows read, dequantised
            return embedding(tokens).to(self.fc.weight.dtype)
        return F.embedding(tokens, embedding.weight.detach()).to(self.fc.weight.dtype)

    def step_input(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """x: target features [..., 3H] (fused by fc) or the previous step's output [..., H]; tokens [...]
        -> the body's input [..., 2H]."""
        x = x.to(self.fc.weight.dtype)
        packed = self.body.packed()
        hidden = (packed["fc"](x) if packed is not None else self.fuse(x)) if x.shape[-1] == self.feature_size else x
        return torch.cat([self.embed(tokens), hidden], dim=-1)

    def forward(self, x: torch.Tensor, next_tokens: torch.Tensor, *, cache=None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T, 3H or H], [B, T] -> pre-norm outputs [B, T, H] (the next step's input)."""
        return self.body(self.step_input(x, next_tokens), past_key_values=cache,
                         attention_mask=attention_mask).last_hidden_state

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """[..., H] pre-norm outputs -> [..., draft_vocab] float32, whatever the head's type (never rounded to bf16):
        the packed head's kernel sums as they are, or `float32_product` (autograd flows through it)."""
        packed = self.body.packed()
        if packed is not None:
            return packed["lm_head"](self.norm(predicted), logits=True)
        return float32_product(self.norm(predicted), self.lm_head.weight, self.lm_head.bias)

    # ---- files ----

    def save(self, directory: str | Path, *, dtype: torch.dtype | str = torch.float16) -> None:
        """Write the head (its config and weights; a shared LM head is the target's and is not stored).
        dtype="q8_0": the matrices whose inputs are multiples of 32 in GGUF Q8_0 blocks (`<name>.q8_0`, uint8;
        8.5 bits a weight), the rest in fp16: the size a registry head ships at, and exactly what
        `pack_for_inference(blocks=True)` runs (quantising the loaded weights again gives the same blocks)."""
        from draftwise.models.linear import q8_0_blocks

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {}
        for k, v in self.state_dict().items():
            if self.config.shared_lm_head and k == "lm_head.weight":  # the target's rows: not stored
                continue
            if k == "feature_scale":  # kept exact: fc's inputs are divided by it
                state[k] = v.float().contiguous()
            elif dtype == "q8_0" and v.is_floating_point() and v.dim() == 2 and v.shape[1] % 32 == 0:
                state[k + Q8_0_SUFFIX] = q8_0_blocks(v)
            elif v.is_floating_point():
                state[k] = v.to(torch.float16 if dtype == "q8_0" else dtype).contiguous()
            else:
                state[k] = v.contiguous()
        tmp = directory / (WEIGHTS_FILE + ".tmp")
        save_file(state, str(tmp))
        tmp.replace(directory / WEIGHTS_FILE)
        tmp = directory / (CONFIG_FILE + ".tmp")
        tmp.write_text(json.dumps(asdict(self.config), indent=2))
        tmp.replace(directory / CONFIG_FILE)

    @classmethod
    def load(cls, directory: str | Path) -> "Eagle3Head":
        directory = Path(directory)
        try:
            config = Eagle3Config(**json.loads((directory / CONFIG_FILE).read_text()))
            state = load_file(str(directory / WEIGHTS_FILE))
        except (OSError, ValueError, TypeError) as e:
            raise DraftwiseError(f"{directory}: not a readable EAGLE-3 head ({type(e).__name__}: {e})") from None
        weights = {}
        for k, v in state.items():
            if k.endswith(Q8_0_SUFFIX):  # Q8_0 blocks (`save(dtype="q8_0")`): the float32 weights they encode
                from draftwise.models.quant import _decode

                k = k[: -len(Q8_0_SUFFIX)]
                v = _decode("q8_0", v.numpy()).dequantized()
            weights[k] = v.float() if v.is_floating_point() else v
        head = cls(config, state["vocab_ids"])
        missing, unexpected = head.load_state_dict(weights, strict=False)
        # heads written before the feature scale existed read their features unscaled (its default of ones)
        if unexpected or set(missing) - ({"lm_head.weight"} if config.shared_lm_head else set()) - {"feature_scale"}:
            raise DraftwiseError(f"{directory}: the head's tensors do not match its config (missing {missing}, "
                                 f"unexpected {unexpected})")
        return head.eval()

    @classmethod
    def new(cls, target_model, *, vocab_ids: torch.Tensor, intermediate_size: int, target_name: str = "",
            feature_layers: tuple[int, ...] | None = None, shared_lm_head: bool = False) -> "Eagle3Head":
        """A fresh head for `target_model`, its lm_head initialised from the target's rows of the draft vocabulary."""

        tc = target_model.config
        heads = tc.num_attention_heads
        config = Eagle3Config(
            hidden_size=tc.hidden_size, num_heads=heads, num_kv_heads=getattr(tc, "num_key_value_heads", heads),
            head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads, intermediate_size=intermediate_size,
            target_vocab_size=out_rows(target_model.get_output_embeddings()),
            feature_layers=tuple(feature_layers or eagle3_layers(tc.num_hidden_layers)),
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-5)),
            rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", None)
                             or getattr(tc, "rope_theta", 10000.0)),
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 8192)), target=target_name,
            shared_lm_head=shared_lm_head)
        head = cls(config, vocab_ids)
        with torch.no_grad():
            head.lm_head.weight.copy_(weight_rows(target_model.get_output_embeddings(), vocab_ids).float())
            norm = getattr(target_model.base_model, "norm", None)
            if norm is not None and getattr(norm, "weight", None) is not None:
                head.norm.weight.copy_(norm.weight.detach().float())
        return head.attach(target_model)


Q8_0_SUFFIX = ".q8_0"  # a stored weight in GGUF Q8_0 blocks
