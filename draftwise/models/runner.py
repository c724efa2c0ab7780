"""The model runner: one causal LM and the position-indexed KV cache it owns.

Invariant: cache row `b` holds keys/values for the first `lengths[b]` tokens of the
sequence that row decodes. `forward_rows` appends a different number of tokens to
each row of a contiguous block; `trim_row` rolls one row back. The decoding loops
call the rollback from one place (their rewind phase); nothing else shortens a row.

Logits are computed only where they are asked for: the base model returns hidden
states, the runner gathers the positions each row needs and applies the LM head to
those alone (a prompt of 256 tokens pays for one LM-head row, not 256). Models whose
head does more than a matrix product (logit soft-capping or scaling) take the
generic path through the full model instead.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from draftwise.errors import DraftwiseError
from draftwise.models import formats
from draftwise.models.fast import FastModel, fast_disabled, paged_enabled, supports
from draftwise.models.linear import float32_product, head_logits
from draftwise.models.kvcache import PagedCache, PositionCache, check_supported, sliding_window

# Families whose decoder layer is exactly pre-norm attention + MLP with rotary q/k (Llama's): the runner can
# run their position-wise parts on packed tokens (see `_packed`).
_PACKABLE = {"llama", "mistral", "qwen2"}
PACK_MIN_SAVING = 0.25  # pack when at least this fraction of a padded [rows, width] feed would be padding

# Families whose causal-LM head is exactly `lm_head(last_hidden_state)`: the runner applies it itself.
_PLAIN_HEAD = {"llama", "mistral", "qwen2", "qwen3", "gpt2", "smollm3", "phi3", "olmo", "olmo2", "starcoder2", "gpt_neox"}


@contextlib.contextmanager
def _cpu_gqa(device: torch.device) -> Iterator[None]:
    """Grouped-query attention inside SDPA, on CPU only, for the duration of one forward.

    transformers only does so without a mask, but a verification pass has one; on CPU this makes verifying a
    few tokens cheaper. Outputs are unchanged. A value the user set (0 or 1) is left alone; on accelerators nothing is set.
    """
    if device.type != "cpu" or "TRANSFORMERS_SDPA_FORCE_GQA" in os.environ:
        yield
        return
    os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] = "1"
    try:
        yield
    finally:
        os.environ.pop("TRANSFORMERS_SDPA_FORCE_GQA", None)


@dataclass(frozen=True)
class TreeMask:
    """A forward whose fed tokens form token trees (tree drafting and its verification).

    Fed token j of row b sits at cache slot `lengths[b] + j` as usual, but its position id is `positions[b, j]`
    (the row's length plus its depth) and it sees the slots before `region_start[b]` (the committed prefix) and,
    of the slots `region_start[b] .. region_start[b] + R - 1`, those with `visible[b, j, slot - region_start[b]]`
    (its ancestors and itself); nothing after them."""

    positions: torch.Tensor  # [rows, width] int64 position ids
    region_start: Sequence[int]  # [rows] first slot of each row's tree region
    visible: torch.Tensor  # [rows, width, R] bool


@dataclass(frozen=True)
class RowsOutput:
    logits: torch.Tensor  # [rows, width, vocab]: position j of row i is its j-th fed token (padding: garbage)
    hidden: torch.Tensor | None  # [rows, width, hidden] last-layer states of the fed tokens, when asked


def full_vocabulary_logits(small: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[..., len(ids)] logits over a restricted vocabulary -> [..., vocab_size], -inf elsewhere (probability
    zero, which keeps speculative sampling exact)."""
    full = small.new_full((*small.shape[:-1], vocab_size), float("-inf"))
    full[..., ids] = small
    return full


def draft_runner(loaded, *, vocab_size: int | None, rows: int = 0) -> "ModelRunner":
    """The runner of a loaded draft (or companion), with its restricted output vocabulary when it has one."""
    return ModelRunner(loaded.model, vocab_size=vocab_size, rows=rows, output_ids=getattr(loaded, "output_ids", None))


class ModelRunner:
    def __init__(self, model: PreTrainedModel, *, vocab_size: int | None = None, rows: int = 1,
                 output_ids: torch.Tensor | None = None) -> None:
        check_supported(model.config)
        self.model = model
        self.device = next(model.parameters()).device
        self.vocab_size = vocab_size  # logits are cut to this many columns (padded vocabularies)
        self._window = sliding_window(model.config)
        config = model.config
        self._max_position = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        self._rows = rows
        self._additive = model.config._attn_implementation not in ("sdpa", "flex_attention")
        self._split = getattr(model.config, "model_type", "") in _PLAIN_HEAD and model.get_output_embeddings() is not None
        self.packing = (self._split and getattr(config, "model_type", "") in _PACKABLE
                        and os.environ.get("DRAFTWISE_NO_PACKING", "") in ("", "0"))
        self.fast = fast_model(model)  # None: the generic transformers path
        self.cache = self._new_cache()
        self.calls = 0  # forward passes
        self.tokens_processed = 0  # tokens fed through forward passes (padding excluded)
        # Multi-layer features (EAGLE-3 heads and their training data): with layers set, `hidden`
        # states are the inputs of those decoder layers followed by the final normed state, concatenated:
        # [..., (len(layers) + 1) * hidden]. Empty: the final normed state only.
        self.feature_layers: tuple[int, ...] = ()
        # A restricted output vocabulary (a draft's, `output-vocab.json`): the LM head runs over those rows only,
        # every other token gets logit -inf (probability zero, which keeps speculative sampling exact).
        # A head kept in its GGUF codes or blocks (CodesProjection) keeps those rows' codes, byte for byte.
        self._out_ids = self._out_weight = self._out_bias = self._out_linear = None
        if output_ids is not None:
            from draftwise.models.linear import BlockLinear, CodesLinear, CodesProjection

            head = model.get_output_embeddings()
            coded = isinstance(head, CodesProjection) and isinstance(head.linear, (BlockLinear, CodesLinear))
            if not self._split or not (isinstance(head, torch.nn.Linear) or coded):
                raise DraftwiseError(f"a restricted output vocabulary needs a plain LM head; "
                                     f"{getattr(config, 'model_type', '?')} models are not supported")
            self._out_ids = output_ids.to(device=self.device, dtype=torch.long)
            if coded:
                self._out_linear = head.linear.subset(self._out_ids)
            else:
                self._out_weight = head.weight.detach()[self._out_ids].contiguous()
                self._out_bias = None if head.bias is None else head.bias.detach()[self._out_ids]
            self._out_width = head.out_features

    def _logits(self, states: torch.Tensor) -> torch.Tensor:
        if self._out_ids is None:
            if self.fast is not None:
                return self.fast.logits(states)
            return head_logits(self.model.get_output_embeddings(), states)
        if self._out_linear is not None:
            small = self._out_linear(states, logits=True)
        else:
            small = float32_product(states, self._out_weight, self._out_bias)
        return full_vocabulary_logits(small, self._out_ids, self._out_width)

    def _new_cache(self) -> PositionCache:
        """A paged cache where every forward runs draftwise's attention kernel (the fast forward on the CPU), which
        reads pages in place; elsewhere one buffer a layer (`PositionCache`). DRAFTWISE_PAGED=0 keeps the buffers."""
        if self.fast is not None and self.fast.reads_pages and paged_enabled():
            return PagedCache(rows=self._rows, window=self._window)
        return PositionCache(rows=self._rows, window=self._window)

    def reset(self) -> None:
        self.cache = self._new_cache()
        self.calls = 0
        self.tokens_processed = 0

    # ---- rows ------------------------------------------------------------------

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    @torch.inference_mode()
    def forward_rows(
        self, tokens: torch.Tensor, counts: Sequence[int], *, begin: int = 0, logits_at: torch.Tensor | None = None,
        hidden: bool = False, prompt: bool | int = False, tree: TreeMask | None = None,
    ) -> RowsOutput:
        """Feed `counts[i]` tokens (row i of `tokens`, right-padded) to cache row `begin + i`.

        tokens: [rows, width] int64. logits_at: [rows, m] positions (within the fed tokens) whose
        logits are wanted, default all `width`. Returns logits [rows, m, vocab] and, with
        `hidden`, the last-layer states of every fed position [rows, width, hidden].
        prompt: the tokens are prompt tokens (a prefill), which a quantised fast forward may run with its
        wide-feed kernel (see `linear.Int4Linear`); every request's prompt is fed this way, alone or batched. An
        int n: the fed tokens after the first n (counted over rows, in order) are prompt tokens.
        tree: the fed tokens are token trees (`TreeMask`): their position ids and what each may see."""
        assert tokens.ndim == 2 and tokens.shape[0] == len(counts), (tokens.shape, len(counts))
        counts = [int(c) for c in counts]
        if min(counts) < 1:
            raise ValueError("ModelRunner.forward_rows needs at least one token per row")
        ids = tokens.to(device=self.device, dtype=torch.long)
        rows, width = ids.shape
        packed = self.packing and sum(counts) <= (1.0 - PACK_MIN_SAVING) * rows * width
        with self._writing(counts, begin, ids.shape[1], self.model.dtype, tree) as (positions, mask):
            if self.fast is not None:
                logits, states = self._fast(ids, None, counts, positions, mask, logits_at, hidden, prompt,
                                            tree=tree is not None)
            elif packed:
                logits, states = self._packed(ids, counts, positions, mask, logits_at, hidden)
            elif self._split:
                with self._capturing(hidden) as captured:
                    states = self.model.base_model(input_ids=ids, position_ids=positions, attention_mask=mask,
                                                   past_key_values=self.cache, use_cache=True).last_hidden_state
                picked = states if logits_at is None else _gather(states, logits_at)
                logits = self._logits(picked)
                if captured:
                    states = torch.cat([*captured, states], dim=-1)
            else:
                with self._capturing(hidden) as captured:
                    out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                                     past_key_values=self.cache, use_cache=True, output_hidden_states=hidden)
                states = out.hidden_states[-1] if hidden else None
                if captured:
                    states = torch.cat([*captured, states], dim=-1)
                logits = out.logits if logits_at is None else _gather(out.logits, logits_at)
        if self.vocab_size is not None and logits.shape[-1] != self.vocab_size:
            logits = logits[..., : self.vocab_size]
        return RowsOutput(logits=logits, hidden=states if hidden else None)

    def _packed(self, ids: torch.Tensor, counts: list[int], positions: torch.Tensor, mask: torch.Tensor | None,
                logits_at: torch.Tensor | None, hidden: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A ragged forward without the padding's compute (Kim et al. §6's input compaction).

        Embeddings, projections, norms and MLPs run on the packed real tokens [1, total, hidden];
        only attention unpacks them to [rows, width] (it reads each row's own cache), through the
        same cache update, mask and attention kernel as the model's own forward. Llama-style
        layers only (`_PACKABLE`); outputs equal the padded forward's at the real positions."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        base = self.model.base_model
        rows, width = ids.shape
        device = ids.device
        count_t = torch.tensor(counts, device=device)
        real = torch.arange(width, device=device)[None] < count_t[:, None]  # [rows, width]
        at_row, at_col = real.nonzero(as_tuple=True)  # [total], row-major: row 0's tokens first
        total = at_row.shape[0]
        h = base.embed_tokens(ids[at_row, at_col])[None]  # [1, total, hidden]
        cos, sin = base.rotary_emb(h, positions[at_row, at_col][None])
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.model.config._attn_implementation, None)
        captured: dict[int, torch.Tensor] = {}
        for index, layer in enumerate(base.layers):
            if hidden and index in self.feature_layers:
                captured[index] = h
            attn = layer.self_attn
            residual = h
            x = layer.input_layernorm(h)
            shape = (1, total, -1, attn.head_dim)
            q = attn.q_proj(x).view(shape).transpose(1, 2)  # [1, heads, total, head_dim]
            k = attn.k_proj(x).view(shape).transpose(1, 2)
            v = attn.v_proj(x).view(shape).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            q_rows, k_rows, v_rows = (_unpack(t[0].transpose(0, 1), at_row, at_col, rows, width) for t in (q, k, v))
            keys, values = self.cache.update(k_rows, v_rows, attn.layer_idx)
            out, _ = attend(attn, q_rows, keys, values, mask, dropout=0.0, scaling=attn.scaling)  # [rows, width, heads, d]
            h = residual + attn.o_proj(out[at_row, at_col].reshape(1, total, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = base.norm(h)[0]  # [total, hidden]
        offsets = count_t.cumsum(0) - count_t  # [rows] where each row's tokens start
        if logits_at is None:
            picked = h.new_zeros(rows, width, h.shape[-1])
            picked[at_row, at_col] = h
        else:
            at = torch.minimum(logits_at.to(device), count_t[:, None] - 1)  # padding positions read the last real
            picked = h[offsets[:, None] + at]  # [rows, m, hidden]
        logits = self._logits(picked)
        states = None
        if hidden:
            if captured:
                h = torch.cat([*(captured[i][0] for i in self.feature_layers), h], dim=-1)
            states = h.new_zeros(rows, width, h.shape[-1])
            states[at_row, at_col] = h
        return logits, states

    def _fast(self, ids: torch.Tensor | None, embeds: torch.Tensor | None, counts: list[int], positions: torch.Tensor,
              mask: torch.Tensor | None, logits_at: torch.Tensor | None, hidden: bool, prompt: bool | int = False,
              tree: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The fast forward (`models.fast`): logits where asked (None for `embeds` feeds) and, with `hidden`,
        the states of every fed position [rows, width, (features +) hidden]."""
        self.fast.ensure_cache(self.cache, self.cache.num_rows)
        features = self.feature_layers if hidden and ids is not None else ()  # forward_states: the last layer only
        final, captured, pack = self.fast.forward(self.cache, ids=ids, embeds=embeds, counts=counts, positions=positions,
                                                  mask=mask, features=features,
                                                  wide=prompt, tree=tree)
        logits = None
        if ids is not None:
            if logits_at is None:
                picked = pack.rows(final)
            else:
                at = torch.minimum(logits_at.to(final.device), pack.counts[:, None] - 1)  # padding reads the last real
                picked = final[pack.offsets()[:, None] + at]  # [rows, m, hidden]
            logits = self._logits(picked)
        states = None
        if hidden:
            states = pack.rows(torch.cat([*captured, final], dim=-1) if captured else final)
        return logits, states

    @contextlib.contextmanager
    def _capturing(self, hidden: bool) -> Iterator[list[torch.Tensor]]:
        """While a model forward runs, collect the inputs of `feature_layers` (in that order)."""
        captured: list[torch.Tensor] = []
        if not (hidden and self.feature_layers):
            yield captured
            return
        layers = self.model.base_model.layers
        found: dict[int, torch.Tensor] = {}

        def hook_for(index: int):
            def hook(module, args, kwargs):
                found[index] = args[0] if args else kwargs["hidden_states"]
            return hook

        handles = [layers[i].register_forward_pre_hook(hook_for(i), with_kwargs=True) for i in self.feature_layers]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()
        captured.extend(found[i] for i in self.feature_layers)

    @torch.inference_mode()
    def forward_states(self, embeds: torch.Tensor, counts: Sequence[int], *, begin: int = 0,
                       tree: TreeMask | None = None) -> torch.Tensor:
        """A base-model forward from input embeddings (feature-level draft heads): embeds [rows, width, hidden]
        -> last hidden states [rows, width, hidden], written to rows `begin ..` like `forward_rows`."""
        counts = [int(c) for c in counts]
        with self._writing(counts, begin, embeds.shape[1], embeds.dtype, tree) as (positions, mask):
            if self.fast is not None:
                return self._fast(None, embeds, counts, positions, mask, None, True, tree=tree is not None)[1]
            return self.model.base_model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask,
                                         past_key_values=self.cache, use_cache=True).last_hidden_state

    @contextlib.contextmanager
    def _writing(self, counts: list[int], begin: int, width: int, dtype: torch.dtype, tree: TreeMask | None = None
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward over rows `begin ..`: yields (position_ids, mask); commits the rows' new lengths
        when the forward succeeds, leaves them as they were when it raises."""
        if tree is not None and self._window is not None:
            raise DraftwiseError("token trees need full attention; this model attends within a sliding window")
        positions, _ = self.cache.begin_forward(counts, begin=begin, width=width, device=self.device)
        try:
            with _cpu_gqa(self.device):
                mask = self._mask(positions, dtype, tree)  # from the true positions
                # The model sees padded slots at their row's last real position (and never past the
                # window): a padded slot's output is discarded, but a position id past the model's
                # table would crash (learned positions) or rescale RoPE for the batch (dynamic RoPE).
                last = positions[:, :1] + torch.tensor(counts, device=self.device)[:, None] - 1  # [rows, 1]
                model_positions = torch.minimum(positions, last) if tree is None else tree.positions.to(self.device)
                if self._max_position:
                    model_positions = model_positions.clamp(max=self._max_position - 1)
                yield model_positions, mask
        except BaseException:
            self.cache.abort()
            raise
        self.cache.commit(counts)
        self.calls += 1
        self.tokens_processed += sum(counts)

    def _mask(self, positions: torch.Tensor, dtype: torch.dtype, tree: TreeMask | None = None) -> torch.Tensor | None:
        """The 4-D mask from the row lengths; None for one unpadded row, where transformers builds the same
        causal mask itself (and SDPA runs a single query with no mask at all)."""
        if tree is not None:
            visible = self.cache.tree_mask(positions, tree.region_start, tree.visible)
            if self.fast is not None or not self._additive:
                return visible
            return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
                ~visible, torch.finfo(dtype).min)
        if self.fast is not None:  # SDPA with a boolean mask; none for one query over a whole unwindowed row
            if self.cache.single_row() and positions.shape[1] == 1:
                return None
            return self.cache.attention_mask(positions, dtype, additive=False)
        if self.cache.single_row():
            return None
        return self.cache.attention_mask(positions, dtype, additive=self._additive)

    def trim_row(self, row: int, keep: int) -> None:
        """Drop row `row`'s cached tokens past its first `keep` (rollback of rejected tokens)."""
        self.cache.trim(row, keep)


_FAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> (its key, its FastModel)


def fast_model(model: PreTrainedModel) -> FastModel | None:
    """The model's fast forward (built once per model, dtype, device, attached weight format and DRAFTWISE_KV_DTYPE,
    and shared by its runners), or None where the generic path runs it: another family, or `DRAFTWISE_FAST=0`. Each
    load attaches a new format (`formats.ModelFormat`, compared by identity), so a model loaded again is built
    again."""
    if fast_disabled() or supports(model) is not None:
        return None
    attached = formats.of(model)
    key = (next(model.parameters()).dtype, next(model.parameters()).device, attached,
           os.environ.get("DRAFTWISE_KV_DTYPE", "auto"))
    built = _FAST.get(model)
    if built is None or built[0] != key:
        built = (key, FastModel(model, formats=attached.format if attached is not None else None))
        _FAST[model] = built
    return built[1]


def kv_bytes_per_token(model) -> int:
    """Bytes of keys and values one token takes in a model's cache (all layers)."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer")
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    fast = fast_model(model)  # the fast forward's cache type (models/fast.py cache_dtype), not the weights'
    dtype = fast.cache_dtype if fast is not None else next(model.parameters()).dtype
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _unpack(packed: torch.Tensor, at_row: torch.Tensor, at_col: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """[total, heads, d] packed tokens -> [rows, heads, width, d], zeros at padding."""
    out = packed.new_zeros(rows, width, packed.shape[1], packed.shape[2])
    out[at_row, at_col] = packed
    return out.transpose(1, 2)


def _gather(values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """values [rows, width, d], at [rows, m] -> [rows, m, d]."""
    at = at.to(values.device)
    return values.gather(1, at[:, :, None].expand(-1, -1, values.shape[-1]))
