"""A KV cache draftwise owns: written by position, with one length per row.

Layout: per layer, keys and values are `[rows, kv_heads, capacity, head_dim]` buffers.
Row `b` holds valid entries at positions `0 .. lengths[b] - 1`. A forward over `n`
tokens of row `b` writes them at `lengths[b] + arange(n)`; rolling row `b` back is
`lengths[b] = keep`: no copy, no concatenation, and rows roll back by different
amounts. Stale entries past a row's length are never read: the 4-D mask built by
`attention_mask` lets a query at position `t` see keys `0 .. t` only, and every
query of a live token sits below its row's new length.

A forward runs over a contiguous block of rows (`begin`: row offset, `rows` many),
so the buffers are sliced (views), never gathered. The engine keeps its live rows
contiguous by moving the last live row into a freed slot (`move_row`).

The buffers grow when a row outgrows them: capacity doubles (rounded up to
`BLOCK` positions); the row dimension doubles too. Attention reads only up to the
longest row touched by the forward (`kv_length`), not the whole buffer. They are
cut when a request's row ends and those left use at most 1/SHRINK of them
(`fit`): a long request's memory goes back when it ends, not when the cache next
goes idle. Every row holds the longest row's capacity meanwhile; `PagedCache` (at
the end of this module, taken where draftwise's attention kernel reads every
forward) holds each row's positions in pages of its own instead.

It plugs into transformers' causal LMs through the `Cache` interface: the model
calls `update(keys, values, layer_idx)` once per layer; everything else (where
to write, what each query may see, the positions) is set by `begin_forward`
before the model runs. Sliding-window attention is applied in the mask, so models
whose every layer uses the same window (Mistral, Qwen2 with a window) work;
models that mix full and windowed layers are refused by `check_supported`.
"""

from __future__ import annotations

import functools
import heapq
from typing import Sequence

from dataclasses import dataclass

import torch
from transformers import Cache

from draftwise.errors import DraftwiseError

BLOCK = 256  # capacity grows in multiples of this many positions
SHRINK = 4  # the buffers are cut when the rows held use at most 1/SHRINK of their positions or of their rows


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's malloc_trim from the symbols already in this process (no `ctypes.util.find_library`: it runs
    `ldconfig -p` in a subprocess, a fork of a process that may hold gigabytes), looked up once; None elsewhere."""
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None


def _doubling(size: int, need: int) -> int:
    """`size` doubled until it is at least `need`."""
    while size < need:
        size *= 2
    return size


def _doubled(capacity: int, need: int) -> int:
    """`capacity` doubled until it holds `need` positions, rounded up to a multiple of BLOCK."""
    return -(-_doubling(capacity, need) // BLOCK) * BLOCK


TRIM_AFTER_BYTES = 32 << 20  # an idle engine hands the heap back when its cache had grown to this (malloc_trim
# walks the whole heap: about 9 ms on Zen 3, more than a short request's own loop costs)


def release_heap() -> None:
    """Hand freed heap memory back to the system (glibc's malloc_trim; nothing elsewhere). An idle engine calls
    it after freeing its buffers, so a long prompt's memory does not stay in the allocator's free lists."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def sliding_window(config) -> int | None:
    """The attention window every layer shares, or None for full attention.

    Raises DraftwiseError for models mixing full and windowed layers (one 4-D mask serves all layers)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        window = None
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        kinds = set(layer_types)
        if kinds == {"full_attention"}:
            return None
        if kinds == {"sliding_attention"} and window:
            return int(window)
        raise DraftwiseError(
            f"{getattr(config, 'model_type', 'this model')} mixes attention layer types {sorted(kinds)}; draftwise's "
            "KV cache applies one mask to every layer, so this architecture is not supported"
        )
    return int(window) if window else None


def check_supported(config) -> None:
    """Refuse, before any weights load, a config the position-indexed cache cannot serve."""
    if getattr(config, "is_encoder_decoder", False):
        raise DraftwiseError(f"{config.model_type} is an encoder-decoder model; draftwise decodes causal LMs only")
    sliding_window(config)


@dataclass
class _Step:
    """What the forward in flight writes and reads (set by `begin_forward`)."""

    begin: int  # first row of the block
    rows: int  # rows in the block
    write_index: torch.Tensor  # [rows, n] positions the n fed tokens are written at
    kv_length: int  # keys read: up to the longest row after the write
    _slots: tuple[torch.Tensor, torch.Tensor] | None = None  # `slots()`, once built
    counts: list[int] | None = None  # real tokens a row (a paged cache writes those only)
    _real: tuple[torch.Tensor, torch.Tensor] | None = None  # `real_slots()`, once built

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row within the block, position) of every slot of the forward, row-major [rows * n] each: the index a
        layer's keys and values are written by (PyTorch's CPU scatter_ is thousands of times slower on bf16).
        Built once a forward, at the first layer that asks."""
        if self._slots is None:
            width = self.write_index.shape[1]
            rows = torch.arange(self.rows, device=self.write_index.device).repeat_interleave(width)
            self._slots = (rows, self.write_index.reshape(-1))
        return self._slots

    def real_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row within the block, column) of the real tokens (`counts`), row-major; built once a forward."""
        if self._real is None:
            device = self.write_index.device
            real = torch.arange(self.write_index.shape[1], device=device)[None] < torch.tensor(
                self.counts, device=device)[:, None]
            self._real = real.nonzero(as_tuple=True)
        return self._real


class PositionCache(Cache):
    def __init__(self, *, rows: int = 1, capacity: int = BLOCK, window: int | None = None) -> None:
        super().__init__(layers=[])
        self.lengths = [0] * rows  # host-side lengths: building masks never waits on a device
        self.capacity = self._initial_capacity = capacity
        self.window = window
        self.keys: list[torch.Tensor] = []  # per layer [rows, kv_heads, capacity, head_dim]
        self.values: list[torch.Tensor] = []
        self._step: _Step | None = None
        # Slots past a row's length must hold finite numbers where PyTorch's attention reads the buffers (a masked
        # slot's weight is 0, and 0 x NaN is NaN), so new buffers are zeroed. draftwise's attention kernel reads only
        # each query's visible keys: a cache it alone reads (`FastModel.ensure_cache` says so) grows without zeroing.
        self.zero_fill = True

    def new_buffer(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A keys or values buffer: zeroed unless `zero_fill` is off."""
        return (torch.zeros if self.zero_fill else torch.empty)(shape, dtype=dtype, device=device)

    def allocate(self, layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        """The first buffers: a keys and a values buffer of `shape` a layer."""
        for _ in range(layers):
            self.keys.append(self.new_buffer(shape, dtype, device))
            self.values.append(self.new_buffer(shape, dtype, device))

    def buffer_shape(self, rows: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """The shape of a layer's keys or values buffer, first allocated for `rows` rows."""
        return (max(self.num_rows, rows, 1), kv_heads, self.capacity, head_dim)

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's keys and values as the forward in flight writes and reads them: its block of rows (views)."""
        step = self._step
        assert step is not None
        return (self.keys[layer][step.begin: step.begin + step.rows],
                self.values[layer][step.begin: step.begin + step.rows])

    def slot_index(self, at_row: torch.Tensor, at_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Where in `layer_buffers` (first and third index) the forward's slots (row within the block, position) are."""
        return at_row, at_pos

    def page_table(self) -> torch.Tensor | None:
        """The forward's rows' pages (a `PagedCache`); None: the buffers hold each row's positions in order."""
        return None

    def slots_for(self, lengths: Sequence[int]) -> int:
        """Token slots per layer the buffers would hold with rows of these lengths."""
        return self.slots_after(len(lengths), max(lengths, default=0))

    # ---- the draftwise side -------------------------------------------------

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def begin_forward(self, counts: list[int], *, begin: int = 0, width: int | None = None,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
        """Prepare a forward feeding `counts[i]` tokens to row `begin + i` (right-padded to `width`).

        Returns (position_ids [rows, width], kv_length). Padded slots are written past their row's
        new length, where nothing reads them; `commit` then advances each row by its count."""
        rows = len(counts)
        width = max(counts) if width is None else width
        if begin + rows > self.num_rows:
            self.add_rows(begin + rows - self.num_rows)
        starts = self.lengths[begin : begin + rows]
        need = max(s + width for s in starts)
        if need > self.capacity:
            self._grow(need)
        base = torch.tensor(starts, dtype=torch.long, device=device)
        positions = base[:, None] + torch.arange(width, device=device)  # [rows, width]
        kv_length = max(s + c for s, c in zip(starts, counts))
        # padded slots of a short row may reach past kv_length: the buffer has room (need), and
        # the slice read below ends at the longest padded write so every write lands in it.
        self._step = _Step(begin, rows, positions, max(kv_length, need))
        return positions, kv_length

    def attention_mask(self, positions: torch.Tensor, dtype: torch.dtype, *, additive: bool) -> torch.Tensor:
        """[rows, 1, width, kv] mask: query at position t sees keys 0..t (and t - window < key)."""
        assert self._step is not None
        keys = torch.arange(self._step.kv_length, device=positions.device)  # [kv]
        visible = keys[None, None, :] <= positions[:, :, None]  # [rows, width, kv]
        if self.window is not None:
            visible &= keys[None, None, :] > positions[:, :, None] - self.window
        visible = visible[:, None]  # [rows, 1, width, kv]
        if not additive:
            return visible
        return torch.zeros(visible.shape, dtype=dtype, device=positions.device).masked_fill_(
            ~visible, torch.finfo(dtype).min)

    def tree_mask(self, positions: torch.Tensor, region_start, visible: torch.Tensor) -> torch.Tensor:
        """[rows, 1, width, kv] bool: the causal mask (`attention_mask`) with each row's tree region
        `region_start[b] ..` replaced by `visible` [rows, width, R] (a query sees its ancestors there, and
        nothing of the region past R)."""
        causal = self.attention_mask(positions, torch.bool, additive=False)[:, 0]  # [rows, width, kv]
        rows, width, kv = causal.shape
        span = visible.shape[-1]
        start = torch.as_tensor(list(region_start), dtype=torch.long, device=positions.device)
        rel = torch.arange(kv, device=positions.device)[None] - start[:, None]  # [rows, kv]
        picked = visible.to(positions.device).gather(2, rel.clamp(0, max(span - 1, 0))[:, None].expand(rows, width, kv))
        picked &= (rel < span)[:, None]
        return torch.where((rel >= 0)[:, None], picked, causal)[:, None]

    @torch.inference_mode()
    def compact(self, row: int, dest: int, sources: Sequence[int]) -> None:
        """One row's `compact_rows`."""
        self.compact_rows([(row, dest, sources)])

    def compact_rows(self, moves: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """For each (row, dest, sources): the row's positions `sources` (ascending, each >= dest + its index) move to
        `dest ..` in order (a tree's accepted path becomes contiguous); nothing else moves. One gather and one
        scatter per layer's keys and values for every row together. The rows' lengths are left to `trim`."""
        rows, dests, srcs = [], [], []
        for row, dest, sources in moves:
            if sources and list(sources) != list(range(dest, dest + len(sources))):
                rows += [row] * len(sources)
                dests += range(dest, dest + len(sources))
                srcs += sources
        if not rows:
            return
        index = torch.tensor([rows, dests, srcs], dtype=torch.long)
        for store in (self.keys, self.values):
            for buf in store:
                if index.device != buf.device:
                    index = index.to(buf.device)
                buf[index[0], :, index[1]] = buf[index[0], :, index[2]]  # the gather is read whole before the scatter

    def commit(self, counts: list[int]) -> None:
        """Advance the rows of the finished forward by the tokens they really fed."""
        assert self._step is not None
        begin = self._step.begin
        for i, count in enumerate(counts):
            self.lengths[begin + i] += count
        self._step = None

    def abort(self) -> None:
        self._step = None

    def trim(self, row: int, keep: int) -> None:
        """Roll row `row` back to its first `keep` positions (the rewind phase's only operation)."""
        if not 0 <= keep <= self.lengths[row]:
            raise ValueError(f"cannot trim row {row} of {self.lengths[row]} tokens to {keep}")
        self.lengths[row] = keep

    def reset_row(self, row: int) -> None:
        """Row `row` starts empty (a new request takes it); rows are added up to it when needed."""
        if row >= self.num_rows:
            self.add_rows(row + 1 - self.num_rows)
        self.lengths[row] = 0

    def slots_after(self, rows: int, length: int) -> int:
        """Token slots per layer the buffers would hold after growing to `rows` rows of `length` positions
        (the same doubling as `add_rows` and `_grow`; before any cut `fit` may make)."""
        allocated = self.keys[0].shape[0] if self.keys else 0
        new_rows = allocated if rows <= allocated else max(rows, 2 * allocated)
        return new_rows * _doubled(self.capacity, length)

    @torch.inference_mode()
    def add_rows(self, count: int) -> None:
        """Append `count` empty rows (buffers grow by doubling when they run out)."""
        self.lengths.extend([0] * count)
        allocated = self.keys[0].shape[0] if self.keys else 0
        if self.keys and self.num_rows > allocated:
            target = max(self.num_rows, 2 * allocated)
            for store in (self.keys, self.values):
                for i, buf in enumerate(store):
                    grown = self.new_buffer((target, *buf.shape[1:]), buf.dtype, buf.device)
                    grown[:allocated] = buf
                    store[i] = grown

    @torch.inference_mode()
    def move_row(self, src: int, dst: int) -> None:
        """Make row `dst` a copy of row `src` (its valid positions only)."""
        n = self.lengths[src]
        if src != dst and n:
            for store in (self.keys, self.values):
                for buf in store:
                    buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst] = n

    @torch.inference_mode()
    def swap_rows(self, a: int, b: int) -> None:
        """Rows `a` and `b` trade places (their valid positions only)."""
        n = max(self.lengths[a], self.lengths[b])
        if a != b and n:
            for store in (self.keys, self.values):
                for buf in store:
                    buf[[a, b], :, :n] = buf[[b, a], :, :n]
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]

    @torch.inference_mode()
    def read_row(self, row: int, start: int, end: int) -> torch.Tensor:
        """Positions start .. end - 1 of a row, every layer: [layers, 2, kv_heads, end - start, head_dim]."""
        if not 0 <= start <= end <= self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} positions, not {start} .. {end}")
        return torch.stack([torch.stack([k[row, :, start:end], v[row, :, start:end]])
                            for k, v in zip(self.keys, self.values)])

    @torch.inference_mode()
    def restore_row(self, row: int, kv: torch.Tensor) -> None:
        """Fill an empty row's first positions with stored keys and values [layers, 2, kv_heads, n, head_dim]
        (allocating the buffers, in the stored dtype, when no forward has yet)."""
        if self.lengths[row]:
            raise ValueError(f"restore_row needs an empty row; row {row} holds {self.lengths[row]} positions")
        n = kv.shape[3]
        if not self.keys:
            shape = (max(self.num_rows, 1), kv.shape[2], self.capacity, kv.shape[4])
            for _ in range(kv.shape[0]):
                self.keys.append(kv.new_zeros(shape))
                self.values.append(kv.new_zeros(shape))
        if len(self.keys) != kv.shape[0] or self.keys[0].shape[1] != kv.shape[2]:
            raise ValueError("stored keys and values do not match this cache's layers or heads")
        if n + 1 > self.capacity:
            self._grow(n + 1)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k[row, :, :n] = kv[layer, 0].to(k.dtype)
            v[row, :, :n] = kv[layer, 1].to(v.dtype)
        self.lengths[row] = n

    @property
    def allocated_bytes(self) -> int:
        """Bytes of the key and value buffers allocated now."""
        return sum(buf.numel() * buf.element_size() for store in (self.keys, self.values) for buf in store)

    def shrink(self) -> None:
        """Free the buffers (no row holds anything): the next forward allocates them at the size it needs."""
        if any(self.lengths):
            raise ValueError("shrink() with rows still holding tokens")
        self.keys, self.values = [], []
        self.capacity = self._initial_capacity
        self.lengths = []

    @torch.inference_mode()
    def copy_rows(self, sources: list[int], begin: int) -> None:
        """Row `begin + i` becomes a copy of row `sources[i]` (beam search: broadcast a prefix, reorder beams).
        Sources may overlap the destination: they are read before anything is written."""
        end = begin + len(sources)
        if end > self.num_rows:
            self.add_rows(end - self.num_rows)
        lengths = [self.lengths[s] for s in sources]
        n = max(lengths, default=0)
        if n and self.keys:
            index = torch.tensor(sources, dtype=torch.long)
            for store in (self.keys, self.values):
                for buf in store:
                    buf[begin:end, :, :n] = buf[:, :, :n].index_select(0, index.to(buf.device))
        self.lengths[begin:end] = lengths

    def drop_rows(self, keep: int) -> None:
        """Forget rows past the first `keep` (their buffers stay allocated for reuse: scratch rows come and go
        every step in beam search; `fit` cuts the buffers when a request's row ended)."""
        del self.lengths[keep:]

    @torch.inference_mode()
    def fit(self) -> None:
        """Cut the buffers to what the rows held need when they use at most 1/SHRINK of them: capacity to the
        longest row's (by the doubling `_grow` uses), rows to those held. Copies the valid positions only, once;
        the hysteresis keeps a row growing back from copying again soon. Called when a request's row ends."""
        if not self.keys or self._step is not None:
            return
        allocated, held = self.keys[0].shape[0], max(self.num_rows, 1)
        longest = max(self.lengths, default=0)
        capacity = _doubled(self._initial_capacity, longest + 1)
        capacity = capacity if capacity * SHRINK <= self.capacity else self.capacity
        rows = held if held * SHRINK <= allocated else allocated
        if (rows, capacity) == (allocated, self.capacity):
            return
        self._reallocate(rows, capacity, min(self.num_rows, rows), longest)

    def _grow(self, need: int) -> None:
        self._reallocate(self.keys[0].shape[0] if self.keys else 0, _doubled(self.capacity, need))

    @torch.inference_mode()
    def _reallocate(self, rows: int, capacity: int, kept_rows: int | None = None, kept: int | None = None) -> None:
        """Buffers of `rows` rows and `capacity` positions, holding the first `kept_rows` rows' first `kept`
        positions of the old ones (default: all that fits)."""
        for store in (self.keys, self.values):
            for i, buf in enumerate(store):
                n_rows = min(buf.shape[0], rows) if kept_rows is None else kept_rows
                n = min(self.capacity, capacity) if kept is None else kept
                new = self.new_buffer((rows, buf.shape[1], capacity, buf.shape[3]), buf.dtype, buf.device)
                new[:n_rows, :, :n] = buf[:n_rows, :, :n]
                store[i] = new
        self.capacity = capacity

    # ---- the transformers side ----------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this layer's new keys/values by position; return the block's keys/values up to kv_length.

        key_states, value_states: [rows, kv_heads, width, head_dim]."""
        step = self._ready(key_states, value_states, layer_idx)
        keys = self.keys[layer_idx][step.begin : step.begin + step.rows]  # views: no gather
        values = self.values[layer_idx][step.begin : step.begin + step.rows]
        at_row, at_pos = step.slots()  # every slot, padding included (past its row's length: never read)
        keys[at_row, :, at_pos] = key_states.transpose(1, 2).flatten(0, 1)  # [rows * width, kv_heads, d]
        values[at_row, :, at_pos] = value_states.transpose(1, 2).flatten(0, 1)
        return keys[:, :, : step.kv_length], values[:, :, : step.kv_length]

    def _ready(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> _Step:
        """`update`'s first steps: the forward in flight; no NaN in any slot (PyTorch's attention reads a cache the
        kernel alone read so far); the layer's buffers, allocated lazily (shapes and dtype from the first forward)."""
        step = self._step
        if step is None:
            raise RuntimeError(f"{type(self).__name__}.update outside begin_forward/commit (use ModelRunner)")
        if not self.zero_fill:
            for buf in (*self.keys, *self.values):
                buf.nan_to_num_(0.0, 0.0, 0.0)
            self.zero_fill = True
        if layer_idx == len(self.keys):
            shape = self.buffer_shape(1, key_states.shape[1], key_states.shape[3])
            self.keys.append(key_states.new_zeros(shape))
            self.values.append(value_states.new_zeros((*shape[:-1], value_states.shape[3])))
        return step

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return (self._step.kv_length if self._step else self.get_seq_length() + query_length), 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Where the queries start: used by transformers' own causal mask on a one-row forward (see
        `single_row`), where it is exact and lets SDPA skip the mask for one query."""
        if self._step is not None and self._step.rows == 1:
            return self.lengths[self._step.begin]
        return self.get_seq_length()

    def single_row(self) -> bool:
        """The forward in flight is one row with no padding and no window: transformers' causal mask
        (query offset = the row's length, keys up to kv_length) is then the row's exact mask."""
        step = self._step
        return (step is not None and step.rows == 1 and self.window is None
                and step.kv_length == self.lengths[step.begin] + step.write_index.shape[1])

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * max(len(self.keys), 1)

    def reset(self) -> None:
        self.lengths = [0] * self.num_rows


PAGE = 64  # positions a page of a PagedCache holds (a multiple of the attention kernel's 64-position blocks)


class PagedCache(PositionCache):
    """A PositionCache whose keys and values live in pages of `page` positions, drawn from one pool a layer.

    Layout: per layer, keys and values are pools `[pages, kv_heads, page, head_dim]`; row `b`'s positions
    `p * page .. p * page + page - 1` sit in page `tables[b][p]`. A row holds the pages its length needs, not the
    longest row's capacity, and gives them back when it is trimmed, reset or dropped (a long request's memory is
    free for the next ones as soon as it ends). Rows share pages where they hold the same prefix: moving a row
    (`move_row`), swapping two (`swap_rows`) and copying rows (`copy_rows`, beam search) change tables only; a page
    that two rows hold is copied before either writes into it (`refs` counts the rows holding each page). The pool
    grows by doubling and `fit` compacts it when its pages in use fall to 1/SHRINK of it.

    Only draftwise's attention kernel reads pages in place (`attend(..., pages=...)`); the runner takes a paged
    cache where its forward runs that kernel. The generic path (`update`) works on it too, on a gathered copy of
    the forward's rows: correct, and slower."""

    def __init__(self, *, rows: int = 1, window: int | None = None, page: int = PAGE, pages: int = 4) -> None:
        if page <= 0 or page % 64:
            raise ValueError(f"pages of {page} positions: a page holds a positive multiple of 64")
        super().__init__(rows=rows, capacity=page, window=window)
        self.page = page
        self._initial_pages = pages
        self.tables: list[list[int]] = [[] for _ in range(rows)]
        self.refs: list[int] = []  # rows holding each page of the pool (0: free)
        self._free: list[int] = []  # a heap of the free pages: the lowest first, which keeps the used ones together
        self._table: torch.Tensor | None = None  # the forward's rows' pages, int32 (`page_table`), built once

    # ---- pages ---------------------------------------------------------------

    @property
    def pages_allocated(self) -> int:
        return len(self.refs)

    @property
    def pages_used(self) -> int:
        return len(self.refs) - len(self._free)

    def _pages(self, positions: int) -> int:
        return -(-positions // self.page)

    def _pool_size(self, used: int) -> int:
        """Pages of a pool holding `used` pages: the allocated count (at least the initial one) doubled as needed."""
        return _doubling(max(len(self.refs), self._initial_pages), used)

    def _take(self, count: int) -> list[int]:
        if len(self._free) < count:
            self._grow_pool(self._pool_size(self.pages_used + count))
        taken = [heapq.heappop(self._free) for _ in range(count)]
        for page in taken:
            self.refs[page] = 1
        return taken

    def _release(self, pages: Sequence[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                heapq.heappush(self._free, page)

    def allocate(self, layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        """Every layer's keys and values pools are views of one allocation [2, layers, *shape]: one large block the
        allocator maps and unmaps whole (60 pools of a few MB each stayed in the heap's free lists instead)."""
        block = self.new_buffer((2, layers, *shape), dtype, device)
        self.keys, self.values = list(block[0].unbind(0)), list(block[1].unbind(0))

    @torch.inference_mode()
    def _repool(self, size: int, index: torch.Tensor | None = None) -> None:
        """New pools of `size` pages holding the old pools' pages `index` (default: all) at their front."""
        if not self.keys:
            return
        old_keys, old_values = self.keys, self.values
        first = old_keys[0]
        self.allocate(len(old_keys), (size, *first.shape[1:]), first.dtype, first.device)
        for new_store, old_store in ((self.keys, old_keys), (self.values, old_values)):
            for new, pool in zip(new_store, old_store):
                if index is None:
                    new[: pool.shape[0]] = pool
                else:
                    new[: index.shape[0]] = pool[index]

    def _grow_pool(self, size: int) -> None:
        old = len(self.refs)
        self.refs.extend([0] * (size - old))
        for page in range(old, size):
            heapq.heappush(self._free, page)
        self._repool(size)

    def _own(self, row: int, start: int, end: int, copies: list[tuple[int, int]]) -> None:
        """Row `row` holds pages of its own for positions start .. end - 1 (taken where it has none; a page another
        row also holds is swapped for a copy, (copy, original) appended to `copies` for `_copy_pages`)."""
        if end <= start:
            return
        table = self.tables[row]
        first, last = start // self.page, (end - 1) // self.page
        for index in range(first, min(last + 1, len(table))):
            page = table[index]
            if self.refs[page] > 1:
                (fresh,) = self._take(1)
                copies.append((fresh, page))
                self._release([page])
                table[index] = fresh
        if last >= len(table):
            table.extend(self._take(last + 1 - len(table)))
        self._table = None

    @torch.inference_mode()
    def _copy_pages(self, copies: list[tuple[int, int]]) -> None:
        if not copies or not self.keys:
            return
        dst = torch.tensor([c for c, _ in copies], dtype=torch.long, device=self.keys[0].device)
        src = torch.tensor([o for _, o in copies], dtype=torch.long, device=self.keys[0].device)
        for store in (self.keys, self.values):
            for pool in store:
                pool[dst] = pool[src]

    def _keep_pages(self, row: int) -> None:
        """Give back row `row`'s pages past its length."""
        table = self.tables[row]
        keep = self._pages(self.lengths[row])
        if len(table) > keep:
            self._release(table[keep:])
            del table[keep:]
            self._table = None

    def page_table(self) -> torch.Tensor:
        """The pages of the forward's rows, [rows, n] int32 (entries past a row's pages: page 0, never read)."""
        step = self._step
        assert step is not None
        if self._table is None:
            tables = self.tables[step.begin: step.begin + step.rows]
            width = max(1, self._pages(step.kv_length), *(len(t) for t in tables))
            self._table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        return self._table

    def slot_index(self, at_row: torch.Tensor, at_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of the forward's slots (row within the block, position): where `layer_buffers` are written."""
        table = self.page_table().to(device=at_pos.device, dtype=torch.long)
        return table[at_row, at_pos // self.page], at_pos % self.page

    def layer_buffers(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer], self.values[layer]

    def buffer_shape(self, rows: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (max(len(self.refs), 1), kv_heads, self.page, head_dim)

    def _positions(self, row: int, positions: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        table = self.tables[row]
        device = self.keys[0].device if self.keys else "cpu"
        pages = torch.tensor([table[p // self.page] for p in positions], dtype=torch.long, device=device)
        offsets = torch.tensor([p % self.page for p in positions], dtype=torch.long, device=device)
        return pages, offsets

    # ---- the draftwise side -------------------------------------------------

    def begin_forward(self, counts: list[int], *, begin: int = 0, width: int | None = None,
                      device: torch.device | str = "cpu") -> tuple[torch.Tensor, int]:
        rows = len(counts)
        width = max(counts) if width is None else width
        if begin + rows > self.num_rows:
            self.add_rows(begin + rows - self.num_rows)
        starts = self.lengths[begin: begin + rows]
        copies: list[tuple[int, int]] = []
        for i, (start, count) in enumerate(zip(starts, counts)):  # the real tokens' slots (padding is not written)
            self._own(begin + i, start, start + count, copies)
        self._copy_pages(copies)
        base = torch.tensor(starts, dtype=torch.long, device=device)
        positions = base[:, None] + torch.arange(width, device=device)
        kv_length = max(s + c for s, c in zip(starts, counts))
        self._step = _Step(begin, rows, positions, kv_length, counts=list(counts))
        self._table = None
        return positions, kv_length

    def compact_rows(self, moves: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        picked = [(row, dest, list(sources)) for row, dest, sources in moves
                  if sources and list(sources) != list(range(dest, dest + len(sources)))]
        if not picked:
            return
        copies: list[tuple[int, int]] = []
        for row, dest, sources in picked:
            self._own(row, dest, dest + len(sources), copies)
        self._copy_pages(copies)
        parts = [(self._positions(row, range(dest, dest + len(sources))), self._positions(row, sources))
                 for row, dest, sources in picked]
        to_page = torch.cat([d[0] for d, _ in parts])
        to_at = torch.cat([d[1] for d, _ in parts])
        from_page = torch.cat([s[0] for _, s in parts])
        from_at = torch.cat([s[1] for _, s in parts])
        with torch.inference_mode():
            for store in (self.keys, self.values):
                for pool in store:
                    pool[to_page, :, to_at] = pool[from_page, :, from_at]  # the gather is read whole first

    def trim(self, row: int, keep: int) -> None:
        super().trim(row, keep)
        self._keep_pages(row)

    def reset_row(self, row: int) -> None:
        super().reset_row(row)
        self._release(self.tables[row])
        self.tables[row] = []
        self._table = None

    def reset(self) -> None:
        for row in range(self.num_rows):
            self.reset_row(row)

    def slots_for(self, lengths: Sequence[int]) -> int:
        """Token slots per layer the pool would hold with rows of these lengths (pages taken, pool doubled)."""
        return self._pool_size(sum(self._pages(n) for n in lengths)) * self.page

    def slots_after(self, rows: int, length: int) -> int:
        return self.slots_for([length] * rows)

    def _grow(self, need: int) -> None:
        """Room for every row to reach `need` positions without the pool growing."""
        more = sum(max(0, self._pages(need) - len(t)) for t in self.tables)
        if more > len(self._free):
            self._grow_pool(self._pool_size(self.pages_used + more))

    def add_rows(self, count: int) -> None:
        self.lengths.extend([0] * count)
        self.tables.extend([] for _ in range(count))

    def move_row(self, src: int, dst: int) -> None:
        if src == dst:
            return
        shared = self.tables[src][: self._pages(self.lengths[src])]
        for page in shared:
            self.refs[page] += 1
        self._release(self.tables[dst])
        self.tables[dst] = list(shared)
        self.lengths[dst] = self.lengths[src]
        self._table = None

    def swap_rows(self, a: int, b: int) -> None:
        self.tables[a], self.tables[b] = self.tables[b], self.tables[a]
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]
        self._table = None

    @torch.inference_mode()
    def read_row(self, row: int, start: int, end: int) -> torch.Tensor:
        if not 0 <= start <= end <= self.lengths[row]:
            raise ValueError(f"row {row} holds {self.lengths[row]} positions, not {start} .. {end}")
        pages, at = self._positions(row, range(start, end))
        return torch.stack([torch.stack([k[pages, :, at].transpose(0, 1), v[pages, :, at].transpose(0, 1)])
                            for k, v in zip(self.keys, self.values)])

    @torch.inference_mode()
    def restore_row(self, row: int, kv: torch.Tensor) -> None:
        if self.lengths[row]:
            raise ValueError(f"restore_row needs an empty row; row {row} holds {self.lengths[row]} positions")
        if self.keys and (len(self.keys) != kv.shape[0] or self.keys[0].shape[1] != kv.shape[2]):
            raise ValueError("stored keys and values do not match this cache's layers or heads")
        n = kv.shape[3]
        self._release(self.tables[row])
        self.tables[row] = self._take(self._pages(n))
        if not self.keys:
            self.allocate(kv.shape[0], self.buffer_shape(self.num_rows, kv.shape[2], kv.shape[4]), kv.dtype, kv.device)
        pages, at = self._positions(row, range(n))
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            k[pages, :, at] = kv[layer, 0].transpose(0, 1).to(k.dtype)
            v[pages, :, at] = kv[layer, 1].transpose(0, 1).to(v.dtype)
        self.lengths[row] = n
        self._table = None

    def shrink(self) -> None:
        super().shrink()
        self.tables, self.refs, self._free, self._table = [], [], [], None

    def copy_rows(self, sources: list[int], begin: int) -> None:
        end = begin + len(sources)
        if end > self.num_rows:
            self.add_rows(end - self.num_rows)
        lengths = [self.lengths[s] for s in sources]
        tables = [self.tables[s][: self._pages(n)] for s, n in zip(sources, lengths)]
        for table in tables:  # held by their new rows before the old tables are given back
            for page in table:
                self.refs[page] += 1
        for row, table in zip(range(begin, end), tables):
            self._release(self.tables[row])
            self.tables[row] = list(table)
        self.lengths[begin:end] = lengths
        self._table = None

    def drop_rows(self, keep: int) -> None:
        for table in self.tables[keep:]:
            self._release(table)
        del self.tables[keep:]
        del self.lengths[keep:]
        self._table = None

    @torch.inference_mode()
    def fit(self) -> None:
        """Compact the pool when its pages in use are at most 1/SHRINK of it: the used pages move to the front (in
        order), the tables follow, and the pool is cut to the doubling of the initial size that holds them."""
        if self._step is not None or not self.refs:
            return
        used = [page for page, n in enumerate(self.refs) if n]
        size = _doubling(self._initial_pages, len(used))
        if size * SHRINK > len(self.refs):
            return
        renumber = {page: new for new, page in enumerate(used)}
        self.tables = [[renumber[page] for page in table] for table in self.tables]
        self.refs = [self.refs[page] for page in used] + [0] * (size - len(used))
        self._free = list(range(len(used), size))  # ascending: already a heap
        if self.keys:
            self._repool(size, torch.tensor(used, dtype=torch.long, device=self.keys[0].device))
        self._table = None

    # ---- the transformers side ----------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write this layer's new keys/values into their pages; return the block's rows gathered up to kv_length."""
        step = self._ready(key_states, value_states, layer_idx)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        at_row, at_col = step.real_slots()  # the real tokens: padding has no pages to go to
        page, at = self.slot_index(at_row, step.write_index[at_row, at_col])
        keys[page, :, at] = key_states.transpose(1, 2)[at_row, at_col]
        values[page, :, at] = value_states.transpose(1, 2)[at_row, at_col]
        table = self.page_table().to(device=keys.device, dtype=torch.long)  # [rows, n]
        rows, n = table.shape

        def gathered(pool: torch.Tensor) -> torch.Tensor:
            flat = pool[table].permute(0, 2, 1, 3, 4).reshape(rows, pool.shape[1], n * self.page, pool.shape[3])
            return flat[:, :, : step.kv_length]

        return gathered(keys), gathered(values)
