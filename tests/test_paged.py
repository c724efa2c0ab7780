"""The paged KV cache (`kvcache.PagedCache`) and the attention kernel reading pages in place.

What is proven here:
- a random script of every cache operation (ragged feeds over several pages, rollbacks, `move_row`, `swap_rows`,
  `copy_rows`, `compact_rows`, `reset_row`, `drop_rows`, `fit`, prefix `read_row` / `restore_row`) leaves a paged
  cache holding exactly what the one-buffer `PositionCache` holds, row for row, and `update` returns the same keys
  and values; pages are counted right (every page held is referenced by exactly its holders, the free ones by
  none); the control, a paged cache that writes into a page another row shares, is caught;
- a long row's pages go back when it is trimmed, reset or dropped, and `fit` compacts the pool;
- the fast forward on pages gives the same logits, bit for bit, as on one buffer a layer, through a ragged
  script whose rows span several pages and share pages (move, beam copies) before writing into them;
- the runner takes a paged cache exactly where every forward runs draftwise's attention kernel.
"""

from __future__ import annotations

import random

import pytest
import torch

from conftest import tiny_llama
from draftwise.models import ModelRunner, qkernel
from draftwise.models.kvcache import SHRINK, PagedCache, PositionCache

LAYERS, KV_HEADS, D = 2, 2, 4


def _check_counts(cache: PagedCache) -> None:
    held: dict[int, int] = {}
    for table in cache.tables:
        for page in table:
            held[page] = held.get(page, 0) + 1
    assert all(cache.refs[p] == n for p, n in held.items()), "a page's count is not its holders"
    assert all(n == 0 for p, n in enumerate(cache.refs) if p not in held), "a page no row holds is not free"
    assert sorted(cache._free) == [p for p in range(cache.pages_allocated) if p not in held]


def _same(flat: PositionCache, paged: PagedCache) -> None:
    assert flat.lengths == paged.lengths
    _check_counts(paged)
    for row, n in enumerate(flat.lengths):
        assert len(paged.tables[row]) * paged.page >= n
        if n and flat.keys:
            assert torch.equal(flat.read_row(row, 0, n), paged.read_row(row, 0, n)), row


def _feed(caches, rng: random.Random, counts: list[int], begin: int) -> None:
    """One forward's writes through `update` (the generic path), the same random keys and values on both caches;
    the keys and values each returns agree at every row's visible positions."""
    width = max(counts)
    outs = []
    new = [(torch.randn(len(counts), KV_HEADS, width, D), torch.randn(len(counts), KV_HEADS, width, D))
           for _ in range(LAYERS)]
    for cache in caches:
        cache.begin_forward(counts, begin=begin)
        outs.append([cache.update(k, v, layer) for layer, (k, v) in enumerate(new)])
        cache.commit(counts)
    for (fk, fv), (pk, pv) in zip(*outs):
        for i, count in enumerate(counts):
            n = caches[0].lengths[begin + i]
            assert torch.equal(fk[i, :, :n], pk[i, :, :n]) and torch.equal(fv[i, :, :n], pv[i, :, :n])


@torch.inference_mode()  # as every forward runs
def _script(flat: PositionCache, paged: PagedCache, seed: int, steps: int = 60) -> int:
    """Returns the most pages the pool held."""
    rng = random.Random(seed)
    most = 0
    caches = (flat, paged)
    torch.manual_seed(seed)
    _feed(caches, rng, [rng.randint(1, 150) for _ in range(4)], 0)
    for _ in range(steps):
        rows = flat.num_rows
        op = rng.choice(["feed", "feed", "feed", "trim", "move", "swap", "copy", "compact", "reset", "drop", "fit",
                         "prefix"])
        if op == "feed" and rows:
            begin = rng.randrange(rows)
            count = rng.randint(1, rows - begin)
            _feed(caches, rng, [rng.choice([1, 1, 3, 5, 40, 90]) for _ in range(count)], begin)
        elif op == "trim" and rows:
            row = rng.randrange(rows)
            keep = rng.randint(0, flat.lengths[row])
            for c in caches:
                c.trim(row, keep)
        elif op == "move" and rows > 1:
            src, dst = rng.sample(range(rows), 2)
            for c in caches:
                c.move_row(src, dst)
        elif op == "swap" and rows > 1:
            a, b = rng.sample(range(rows), 2)
            for c in caches:
                c.swap_rows(a, b)
        elif op == "copy" and rows:
            sources = [rng.randrange(rows) for _ in range(rng.randint(1, 3))]
            begin = rng.randint(0, rows)
            for c in caches:
                c.copy_rows(sources, begin)
        elif op == "compact" and rows:
            row = rng.randrange(rows)
            n = flat.lengths[row]
            if n >= 4:
                dest = rng.randrange(n - 3)
                sources = sorted(rng.sample(range(dest + 1, n), rng.randint(1, min(3, n - dest - 1))))
                for c in caches:
                    c.compact_rows([(row, dest, sources)])
        elif op == "reset" and rows:
            row = rng.randrange(rows + 1)
            for c in caches:
                c.reset_row(row)
        elif op == "drop" and rows > 1:
            keep = rng.randint(1, rows - 1)
            for c in caches:
                c.drop_rows(keep)
                c.fit()
        elif op == "fit":
            for c in caches:
                c.fit()
        elif op == "prefix" and rows:  # a stored prefix read from one row and restored into an empty one
            row = rng.randrange(rows)
            n = flat.lengths[row]
            if n:
                end = rng.randint(1, n)
                stored = flat.read_row(row, 0, end)
                assert torch.equal(stored, paged.read_row(row, 0, end))
                for c in caches:
                    c.reset_row(rows)
                    c.restore_row(rows, stored)
        _same(flat, paged)
        most = max(most, paged.pages_allocated)
    return most


@pytest.mark.parametrize("seed", range(6))
def test_a_paged_cache_holds_what_one_buffer_holds_through_every_operation(seed):
    flat, paged = PositionCache(rows=4), PagedCache(rows=4)
    assert _script(flat, paged, seed) > 4  # the pool grew: the script spans several pages


def test_control_writing_into_a_shared_page_is_caught(monkeypatch):
    """Without the copy before a write into a page two rows hold, one row's write shows in the other."""
    monkeypatch.setattr(PagedCache, "_own", _own_without_copies)
    with pytest.raises(AssertionError):
        for seed in range(6):
            _script(PositionCache(rows=4), PagedCache(rows=4), seed)


def _own_without_copies(self, row, start, end, copies):
    table = self.tables[row]
    last = (end - 1) // self.page
    if last >= len(table):
        table.extend(self._take(last + 1 - len(table)))
    self._table = None


@torch.inference_mode()
def test_a_long_rows_pages_go_back_and_fit_compacts_the_pool():
    cache = PagedCache(rows=2)
    k = torch.zeros(2, KV_HEADS, 1000, D)
    cache.begin_forward([1000, 10])
    cache.update(k, k, 0)
    cache.commit([1000, 10])
    assert cache.pages_used == 16 + 1 and cache.pages_allocated >= 17
    allocated = cache.pages_allocated
    cache.trim(0, 130)
    assert cache.pages_used == 3 + 1
    cache.reset_row(0)
    assert cache.pages_used == 1 and cache.tables[0] == []
    cache.fit()  # 1 page in use of 32: cut to the initial 4
    assert cache.pages_allocated == 4 and cache.pages_allocated * SHRINK <= allocated
    assert cache.keys[0].shape[0] == 4 and cache.tables[1] == [0]
    cache.drop_rows(1)
    cache.trim(0, 0)
    assert cache.pages_used == 0


def test_bad_pages_are_refused():
    with pytest.raises(ValueError, match="multiple of 64"):
        PagedCache(page=48)


def _long_script(rng: random.Random) -> list[tuple]:
    ops = [("feed", [rng.randint(60, 140), 1, rng.randint(65, 129)], 0)]
    for step in range(10):
        if step == 3:
            ops.append(("move", 2, 1))  # rows 1 and 2 share pages, then both write
        if step == 6:
            ops.append(("select", [0, 0, 2]))  # beams: rows 0 and 1 share row 0's pages
        ops.append(("feed", [rng.choice([1, 2, 5, 17, 70]) for _ in range(3)], 0))
        for row in range(3):
            if rng.random() < 0.5:
                ops.append(("trim", row, rng.randint(1, 4)))
    return ops


def _play_long(runner: ModelRunner, ops: list[tuple], seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    out = []
    for op in ops:
        if op[0] == "feed":
            counts = op[1]
            tokens = torch.tensor([[rng.randrange(64) for _ in range(max(counts))] for _ in counts])
            logits = runner.forward_rows(tokens, counts, begin=op[2]).logits
            out += [logits[i, :c].clone() for i, c in enumerate(counts)]
        elif op[0] == "trim":
            _, row, back = op
            runner.trim_row(row, max(1, runner.lengths[row] - back))
        elif op[0] == "move":
            runner.cache.move_row(op[1], op[2])
        elif op[0] == "select":
            runner.cache.copy_rows(op[1], 0)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fast_forward_on_pages_gives_the_bits_of_one_buffer(monkeypatch, dtype):
    if not qkernel.available():
        pytest.skip(f"draftwise's kernel is not built here: {qkernel.problem()}")
    model = tiny_llama(21).to(dtype)
    ops = _long_script(random.Random(5))
    played = {}
    for paged in (True, False):
        monkeypatch.setenv("DRAFTWISE_PAGED", "1" if paged else "0")
        runner = ModelRunner(model, rows=3)
        assert isinstance(runner.cache, PagedCache) == paged
        played[paged] = _play_long(runner, ops, seed=9)
        if paged:
            assert runner.cache.pages_allocated > 4 and max(runner.lengths) > 64
    assert len(played[True]) == len(played[False])
    for a, b in zip(played[True], played[False]):
        assert torch.equal(a, b)


def test_the_runner_pages_only_where_the_kernel_reads_every_forward(monkeypatch):
    model = tiny_llama(3)
    monkeypatch.setenv("DRAFTWISE_FAST", "0")  # the generic path: PyTorch's attention reads one buffer
    assert type(ModelRunner(model).cache) is PositionCache
    monkeypatch.setenv("DRAFTWISE_FAST", "1")
    runner = ModelRunner(model)
    assert isinstance(runner.cache, PagedCache) == (runner.fast is not None and runner.fast.reads_pages)
    runner.reset()
    assert isinstance(runner.cache, PagedCache) == (runner.fast is not None and runner.fast.reads_pages)
    monkeypatch.setenv("DRAFTWISE_PAGED", "0")
    assert type(ModelRunner(model).cache) is PositionCache
