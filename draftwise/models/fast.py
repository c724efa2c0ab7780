"""The fast forward: Llama-family decoder layers run by draftwise itself, on the runner's own cache.

transformers' modules stay the reference (and the path for every other family); for the families
whose decoder layer is exactly pre-norm rotary attention + gated MLP (`FAST_FAMILIES`: Llama, Mistral,
Qwen2), `FastModel` runs the same arithmetic with far less around it:

- the q/k/v projections are one matrix product and the gate/up projections another (fused weights);
- position-wise work (norms, projections, MLP) runs on the real tokens only, packed `[tokens, hidden]`;
  attention alone sees `[rows, width]`, through the cache's own position-indexed buffers;
- rotary tables are computed once per length, not per forward; no transformers mask machinery, no
  Python dispatch through module hooks;
- each projection is a `Linear` in the weight format the model was loaded in: float (fp32, bf16,
  fp16), int8 weight-only per output channel, or int4 in groups of 32 (GGUF Q4_0 / Q4_1 kept in
  their quantised form) through PyTorch's CPU kernels.

The fast path reads and writes the same `PositionCache` buffers as the generic path, so rollback
(`trim_row`), `move_row`, `copy_rows` and the engine's budget work unchanged, and a runner may mix
both paths on one cache (the tests do).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
import torch
import torch.nn.functional as F

from draftwise.errors import DraftwiseError
from draftwise.models import qkernel
from draftwise.models.linear import CodesProjection, FloatLinear, Linear, joined

FAST_FAMILIES = {"llama", "mistral", "qwen2"}
PER_ROW_MAX_FILL = 0.75  # attention runs row by row when live keys or real queries fill at most this share
PACKED_ROWS_WIDTH = 8  # up to this many tokens per row, row-by-row attention reads padded queries (one cache write)
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}  # inv_freq independent of the sequence length


# ------------------------------------------------------------------ the model

@dataclass
class FastLayer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


def supports(model) -> str | None:
    """None when `FastModel` can run `model` exactly; else why not (the runner then takes the generic path)."""
    config = model.config
    family = getattr(config, "model_type", "")
    if family not in FAST_FAMILIES:
        return f"{family or 'this'} models use the generic path"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if getattr(config, "mlp_bias", False):
        return "MLP biases"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if (rope.get("rope_type") or rope.get("type") or "default") not in _STATIC_ROPE:
        return f"rope type {rope.get('rope_type') or rope.get('type')!r}"
    if getattr(config, "pretraining_tp", 1) not in (1, None):
        return "tensor-parallel pretraining layout"
    head = model.get_output_embeddings()
    if head is None or not isinstance(head, (torch.nn.Linear, CodesProjection)):
        return "no plain LM head"
    return None


class FastModel:
    """Decoder layers of a Llama-family model as fused projections over the runner's `PositionCache`."""

    def __init__(self, model, *, formats=None) -> None:
        config = model.config
        base = model.base_model
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.eps = float(config.rms_norm_eps)
        self.norm = base.norm.weight.detach()
        embedding = base.embed_tokens
        # a model loaded straight from a GGUF file keeps its embedding and projections in their codes
        # (linear.CodesEmbedding / CodesProjection): the lookup and the products run from the codes
        self.embed = None if getattr(embedding, "codes", None) is not None else embedding.weight.detach()
        self._lookup = embedding if self.embed is None else None
        self.dtype = self.embed.dtype if self.embed is not None else embedding.dtype
        self.device = self.norm.device
        self.rotary = base.rotary_emb
        self.scaling = self.head_dim ** -0.5
        self._attend = qkernel.invariant_kernel("attend")
        # one call a norm on CPU (PyTorch's rms_norm runs several on bf16), for the float types the kernel takes
        self._norm = qkernel.invariant_kernel("rmsnorm") if self.device.type == "cpu" and self.dtype in (
            torch.float32, torch.bfloat16) else None
        self.cache_dtype = cache_dtype(self.dtype, self.device, kernel=self._attend is not None)
        # on the CPU every feed runs the attention kernel, which reads only visible keys: its cache needs no zeroing
        self._zero_fill = self._attend is None or self.device.type != "cpu"
        make_linear = formats.linear if formats is not None else _float_linear
        layers = []
        for index, layer in enumerate(base.layers):
            attn, mlp = layer.self_attn, layer.mlp
            if isinstance(attn.q_proj, CodesProjection):  # loaded straight from a GGUF file: the codes as they are
                layers.append(FastLayer(
                    input_norm=layer.input_layernorm.weight.detach(),
                    post_norm=layer.post_attention_layernorm.weight.detach(),
                    qkv=joined([attn.q_proj.linear, attn.k_proj.linear, attn.v_proj.linear]),
                    o=attn.o_proj.linear, gate_up=joined([mlp.gate_proj.linear, mlp.up_proj.linear]),
                    down=mlp.down_proj.linear))
                continue
            qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach()
            qkv_b = None
            if attn.q_proj.bias is not None:
                qkv_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach()
            gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
            at = f"layers.{index}."
            parts = {name: getattr(getattr(layer, name.split(".")[0]), name.split(".")[1]).weight.detach()
                     for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
            pick = lambda *names: [(at + n, parts[n]) for n in names]  # noqa: E731
            layers.append(FastLayer(
                input_norm=layer.input_layernorm.weight.detach(),
                post_norm=layer.post_attention_layernorm.weight.detach(),
                qkv=make_linear(at + "qkv", pick("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                                qkv_w, qkv_b),
                o=make_linear(at + "o", pick("self_attn.o_proj"), parts["self_attn.o_proj"], _bias(attn.o_proj)),
                gate_up=make_linear(at + "gate_up", pick("mlp.gate_proj", "mlp.up_proj"), gate_up_w, None),
                down=make_linear(at + "down", pick("mlp.down_proj"), parts["mlp.down_proj"], None),
            ))
        self.layers = layers
        head = model.get_output_embeddings()
        if isinstance(head, CodesProjection):
            self.head = head.linear
        else:
            self.head = make_linear("lm_head", [("lm_head", head.weight.detach())], head.weight.detach(), _bias(head))
        self._cos = self._sin = None
        self._rope_len = 0

    # ---- pieces -------------------------------------------------------------

    def _rope(self, positions: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [tokens, head_dim] for flat positions, from tables grown by doubling. `bound` (a host int) is
        above every position: the tables cover it without the positions being read back from the device."""
        if bound > self._rope_len:
            length = max(256, self._rope_len)
            while length < bound:
                length *= 2
            x = torch.zeros(1, 1, self.head_dim, dtype=self.dtype, device=self.device)
            cos, sin = self.rotary(x, torch.arange(length, device=self.device)[None])
            half = self.head_dim // 2
            sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(sin)  # rotate_half(x) = swap halves, negate 1st
            self._cos, self._sin, self._rope_len = cos[0].to(self.dtype), (sin[0] * sign).to(self.dtype), length
        return self._cos[positions], self._sin[positions]

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # one fused kernel (fp32 inside); transformers rounds to the activation type before the weight
        # product, this after it: equal in fp32, one rounding apart in bf16
        if self._norm is not None and x.dtype == weight.dtype:
            return self._norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, self.eps, False).reshape(x.shape)
        return F.rms_norm(x, (x.shape[-1],), weight, self.eps)

    # ---- forward ------------------------------------------------------------

    def forward(self, cache, *, ids: torch.Tensor | None, embeds: torch.Tensor | None, counts: list[int],
                positions: torch.Tensor, mask: torch.Tensor | None, features: tuple[int, ...] = (),
                wide: bool | int = False, tree: bool = False) -> tuple[torch.Tensor, list[torch.Tensor], "Packing"]:
        """Run the decoder over rows (cache.begin_forward already called). Returns the final normed states of
        the real tokens, packed [tokens, hidden], the packed inputs of the `features` layers, and the packing.
        wide: a prompt feed; quantised projections may use their wide-feed kernel (`Int4Linear`); an int n: the
        packed tokens from n on are prompt tokens. tree: the mask is a token tree's (`runner.TreeMask`): even a
        single query reads it, since not every key before it is its ancestor."""
        source = ids if ids is not None else embeds
        rows, width = source.shape[:2]
        pack = Packing.of(counts, width, source.device)
        step = cache._step
        flat_pos = pack.flat(positions)
        if ids is not None:
            h = F.embedding(pack.flat(ids), self.embed) if self.embed is not None else self._lookup(pack.flat(ids))
        else:
            h = pack.flat(embeds).to(self.dtype)
        # a position id never passes its slot in the cache (padding repeats its row's last real position, a tree node
        # sits at its row's length plus its depth), and every slot is below the keys the forward reads
        cos, sin = self._rope(flat_pos, step.kv_length)
        cos, sin = cos[:, None], sin[:, None]  # [tokens, 1, d]; sin carries rotate_half's sign
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        k_end = (heads + kv_heads) * d  # q is qkv[:, :heads * d]
        captured: dict[int, torch.Tensor] = {}
        write = _Writer(step, pack, rows, width, cache)
        kv = step.kv_length
        cache_dtype = self.cache_dtype
        # draftwise's attention (csrc/attention.cpp) on the CPU, for every feed (prompt chunks, decoding, verification,
        # trees): each query over its visible keys in order, so a token's result depends neither on its batch-mates
        # nor on how its prompt was cut into chunks (the forward is batch invariant).
        kernel = self._attend if source.device.type == "cpu" else None
        pages = cache.page_table()  # a paged cache: the rows' pages, which only the kernel reads in place
        if pages is not None and kernel is None:
            raise DraftwiseError("a paged KV cache needs draftwise's attention kernel (on the CPU)")
        visible = None if mask is None or kernel is None else mask[:, 0].contiguous()  # [rows, width, kv] bool
        # Without the kernel: rows of uneven length (decode steps over ragged contexts, a burst's prefill): attention
        # row by row on the packed tokens, each row reading its own live keys only, where padding would be over a
        # quarter of the keys or of the queries. On the CPU only: on a GPU each row's attention would be its own
        # kernel launches per layer, where the padded batch is one
        per_row = None
        if kernel is None and rows > 1 and source.device.type == "cpu":
            row_kv = [cache.lengths[step.begin + b] + c for b, c in enumerate(counts)]
            if sum(row_kv) <= PER_ROW_MAX_FILL * rows * kv or sum(counts) <= PER_ROW_MAX_FILL * rows * width:
                starts = [n - c for n, c in zip(row_kv, counts)]
                offsets = [0]
                for c in counts[:-1]:
                    offsets.append(offsets[-1] + c)
                masks = [None if (c == 1 and cache.window is None and not tree) else mask[b: b + 1, :, :c, :n]
                         for b, (c, n) in enumerate(zip(counts, row_kv))]
                per_row = list(zip(offsets, counts, starts, row_kv, masks))
        for index, layer in enumerate(self.layers):
            if index in features:
                captured[index] = h
            x = self._rms(h, layer.input_norm)
            qkv = layer.qkv(x, wide)  # [tokens, (heads + 2 kv_heads) d]
            qk = qkv[:, :k_end].view(-1, heads + kv_heads, d)  # rotary on q and k at once
            qk = qk * cos + torch.cat((qk[..., d // 2:], qk[..., : d // 2]), dim=-1) * sin
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, k_end:].view(-1, kv_heads, d)
            keys, values = cache.layer_buffers(index)  # the block's rows, or a paged cache's pools
            if kernel is not None:
                write(keys, k.to(cache_dtype))
                write(values, v.to(cache_dtype))
                out = kernel(pack.rows(q.float()).contiguous(), keys, values, visible, counts, kv, self.scaling,
                             False, pages=pages)  # [rows, width, heads, d] float32
                out = pack.flat(out).reshape(-1, heads * d).to(h.dtype)
            elif per_row is not None and width <= PACKED_ROWS_WIDTH:  # decode / verify: one write, padded queries
                write(keys, k.to(cache_dtype))
                write(values, v.to(cache_dtype))
                q_rows = pack.rows(q.to(cache_dtype)).transpose(1, 2)  # [rows, heads, width, d]
                out = torch.cat([F.scaled_dot_product_attention(
                    q_rows[b: b + 1], keys[b: b + 1, :, :n], values[b: b + 1, :, :n],
                    attn_mask=None if row_mask is None else mask[b: b + 1, :, :, :n], scale=self.scaling,
                    enable_gqa=kv_heads != heads) for b, (_, _, _, n, row_mask) in enumerate(per_row)])
                out = pack.flat(out.transpose(1, 2).reshape(rows, width, heads * d)).to(h.dtype)
            elif per_row is not None:  # prompts: packed tokens straight into each row's slots, each row's attention
                k_t = k.to(cache_dtype).transpose(0, 1)  # [kv_heads, tokens, d]
                v_t = v.to(cache_dtype).transpose(0, 1)
                q_t = q.to(cache_dtype).transpose(0, 1)  # [heads, tokens, d]
                outs = []
                for b, (o, c, start, n, row_mask) in enumerate(per_row):
                    keys[b, :, start: start + c] = k_t[:, o: o + c]
                    values[b, :, start: start + c] = v_t[:, o: o + c]
                    outs.append(F.scaled_dot_product_attention(
                        q_t[None, :, o: o + c], keys[b: b + 1, :, :n], values[b: b + 1, :, :n], attn_mask=row_mask,
                        scale=self.scaling, enable_gqa=kv_heads != heads)[0])  # [heads, c, d]
                out = torch.cat(outs, dim=1).transpose(0, 1).reshape(-1, heads * d).to(h.dtype)
            else:
                write(keys, k.to(cache_dtype))
                write(values, v.to(cache_dtype))
                q_rows = pack.rows(q.to(cache_dtype)).transpose(1, 2)  # [rows, heads, width, d]
                out = F.scaled_dot_product_attention(q_rows, keys[:, :, :kv], values[:, :, :kv], attn_mask=mask,
                                                     scale=self.scaling, enable_gqa=kv_heads != heads)
                out = out.transpose(1, 2).to(h.dtype)  # [rows, width, heads, d]
                out = pack.flat(out.reshape(rows, width, heads * d))
            h = h + layer.o(out, wide)
            x = self._rms(h, layer.post_norm)
            gate_up = layer.gate_up(x, wide)
            half = gate_up.shape[-1] // 2
            h = h + layer.down(F.silu(gate_up[:, :half]) * gate_up[:, half:], wide)
        return self._rms(h, self.norm), [captured[i] for i in features], pack

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """The LM head's logits, float32 whatever the activations (never rounded to bf16)."""
        return self.head(states, logits=True)

    @property
    def reads_pages(self) -> bool:
        """Every forward runs the attention kernel (on the CPU with the kernel built), so a paged cache serves."""
        return self._attend is not None and self.device.type == "cpu"

    def ensure_cache(self, cache, rows: int) -> None:
        """Allocate the cache's per-layer buffers (the generic path allocates them lazily on first update)."""
        cache.zero_fill = self._zero_fill  # also for buffers a prefix restore allocated first
        if cache.keys:
            return
        cache.allocate(len(self.layers), cache.buffer_shape(rows, self.num_kv_heads, self.head_dim), self.cache_dtype,
                       self.device)


class _Writer:
    """Writes one layer's new keys or values [tokens, kv_heads, d] into the cache rows at their positions: the real
    tokens only, by (row, position) index (`index_put_`; PyTorch's CPU `scatter_` on bf16 took ~4 ms to write one
    token of each of 32 rows, 2,000 times longer than this)."""

    def __init__(self, step, pack: "Packing", rows: int, width: int, cache) -> None:
        self.pack = pack
        self.start = None
        paged = cache.page_table() is not None
        if rows == 1 and not paged:  # one row: a contiguous slice
            self.start = int(step.write_index[0, 0])
            self.stop = self.start + width
            return
        if pack.at_row is None:  # no padding: every slot is a token
            at_row, at_pos = step.slots()
        else:
            at_row, at_pos = pack.at_row, step.write_index[pack.at_row, pack.at_col]
        self.at_row, self.at_pos = cache.slot_index(at_row, at_pos)  # a paged cache's (page, offset)

    def __call__(self, buffer: torch.Tensor, new: torch.Tensor) -> None:
        if self.start is not None:
            buffer[:, :, self.start: self.stop] = self.pack.rows(new).transpose(1, 2)  # [1, kv_heads, width, d]
        else:
            buffer[self.at_row, :, self.at_pos] = new  # [tokens, kv_heads, d] at (row, :, position)


@dataclass
class Packing:
    """Where the real tokens of a right-padded [rows, width] feed sit; identity when nothing is padded."""

    rows_n: int
    width: int
    at_row: torch.Tensor | None  # [tokens] (None: every slot is real)
    at_col: torch.Tensor | None
    counts: torch.Tensor  # [rows]

    @classmethod
    def of(cls, counts: list[int], width: int, device: torch.device) -> "Packing":
        count_t = torch.tensor(counts, device=device)
        if all(c == width for c in counts):
            return cls(len(counts), width, None, None, count_t)
        real = torch.arange(width, device=device)[None] < count_t[:, None]
        at_row, at_col = real.nonzero(as_tuple=True)
        return cls(len(counts), width, at_row, at_col, count_t)

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, width, ...] -> [tokens, ...] (real tokens, row-major)."""
        if self.at_row is None:
            return t.reshape(self.rows_n * self.width, *t.shape[2:])
        return t[self.at_row, self.at_col]

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] -> [rows, width, ...], zeros at padding."""
        if self.at_row is None:
            return t.reshape(self.rows_n, self.width, *t.shape[1:])
        out = t.new_zeros(self.rows_n, self.width, *t.shape[1:])
        out[self.at_row, self.at_col] = t
        return out

    def offsets(self) -> torch.Tensor:
        return self.counts.cumsum(0) - self.counts


KV_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def cache_dtype(dtype: torch.dtype, device: torch.device, *, kernel: bool) -> torch.dtype:
    """The type of the keys and values a forward keeps.

    On CPU with draftwise's attention kernel, the activations' own type where the kernel reads it: bf16 activations
    give bf16 keys and values, which the cache then holds exactly, at half the bytes a decoding step streams from
    memory (the kernel widens them to fp32); fp32 activations keep fp32. DRAFTWISE_KV_DTYPE=bfloat16 rounds them to
    bf16 anyway (half the memory, no longer equal to a cache-free forward), =float32 widens bf16 ones. On CPU
    without the kernel: fp32 (PyTorch's CPU attention in bf16 is several times slower). Elsewhere the model's type."""
    if device.type != "cpu":
        return dtype
    if not kernel:
        return torch.float32
    name = os.environ.get("DRAFTWISE_KV_DTYPE", "auto").strip().lower()
    if name == "auto":
        return torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    if name not in KV_DTYPES:
        raise DraftwiseError(f"DRAFTWISE_KV_DTYPE={name!r}: expected auto, bfloat16 or float32")
    return KV_DTYPES[name]


def _bias(linear: torch.nn.Linear) -> torch.Tensor | None:
    return None if linear.bias is None else linear.bias.detach()


def _float_linear(name: str, parts, weight: torch.Tensor, bias: torch.Tensor | None) -> Linear:
    return FloatLinear(weight, bias)


def paged_enabled() -> bool:
    return os.environ.get("DRAFTWISE_PAGED", "1") not in ("0", "false", "no")


def fast_disabled() -> bool:
    return os.environ.get("DRAFTWISE_FAST", "1") in ("0", "false", "no")
