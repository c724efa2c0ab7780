"""The training loop both draft recipes share: shuffled batches (optionally grouped by length), warm-up + cosine
learning rate, gradient clipping, atomic checkpoints and exact resume."""

from __future__ import annotations

import contextlib
import math
import random
import signal
import time
from pathlib import Path
from typing import Callable, Sequence

import torch

from draftwise.atomic import save_torch as atomic_save
from draftwise.errors import DraftwiseError


def cosine_lr(step: int, *, peak: float, warmup: int, total: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


GROUP_WINDOW = 64  # batches per window sorted by length: grouped batches stay a random draw of the data


def epoch_order(rng: random.Random, num_examples: int, batch_size: int,
                lengths: Sequence[int] | None = None) -> list[int]:
    """One epoch's example order, consumed `batch_size` at a time. With `lengths`, each batch holds examples of
    similar length, so padding to the batch's longest wastes little: the shuffled examples are sorted by length
    within windows of GROUP_WINDOW batches, cut into batches, and the batches shuffled (a window's remainder goes
    to a last, partial batch). Every example still appears exactly once per epoch."""
    order = list(range(num_examples))
    rng.shuffle(order)
    if lengths is None:
        return order
    span = GROUP_WINDOW * batch_size
    batches: list[list[int]] = []
    rest: list[int] = []
    for start in range(0, num_examples, span):
        window = sorted(order[start:start + span], key=lambda i: lengths[i])
        whole = len(window) - len(window) % batch_size
        batches += [window[i:i + batch_size] for i in range(0, whole, batch_size)]
        rest += window[whole:]
    rng.shuffle(batches)
    rest.sort(key=lambda i: lengths[i])
    return [i for batch in batches for i in batch] + rest


def train_loop(
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    num_examples: int,
    batch_size: int,
    total_steps: int,
    lr: Callable[[int], float],
    step_fn: Callable[[list[int]], tuple[torch.Tensor, dict]],
    checkpoint: Path,
    checkpoint_every: int,
    config: dict,
    seed: int,
    progress: Callable[[int, dict], None] | None = None,
    stop_at: int | None = None,
    deadline: float | None = None,
    lengths: Sequence[int] | None = None,
) -> int:
    """Run (or resume) training to `total_steps` (or `stop_at`, or until `time.monotonic()` passes
    `deadline`: a chunk of a longer schedule); returns the step reached.

    step_fn(indices) -> (loss, stats) for a batch of example indices; `lengths` (each example's padded cost)
    groups batches by length (`epoch_order`). The checkpoint holds
    model, optimizer, step and the data-order generator; it is refused if `config` differs.
    After every checkpoint the epoch order restarts from the saved generator, so a resumed
    run sees exactly the batches an uninterrupted one would.
    """
    step = 0
    order_rng = random.Random(seed)
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False, map_location="cpu")  # any device: load_state_dict moves it
        if state["config"] != config:
            raise DraftwiseError(f"{checkpoint} was written with a different configuration; "
                                 "use a new --out or the same options")
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        order_rng.setstate(state["order_rng"])
    params = [p for group in optimizer.param_groups for p in group["params"]]
    end = min(total_steps, stop_at) if stop_at is not None else total_steps
    order: list[int] = []
    model.train()
    with _stop_on_signal() as stop:
        while step < end:
            if len(order) < batch_size:
                order += epoch_order(order_rng, num_examples, batch_size, lengths)
            picked, order = order[:batch_size], order[batch_size:]
            for group in optimizer.param_groups:
                group["lr"] = lr(step)
            loss, stats = step_fn(picked)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            step += 1
            if progress:
                progress(step, stats)
            if deadline is not None and time.monotonic() > deadline:
                stop["requested"] = True
            if step % checkpoint_every == 0 or step == end or stop["requested"]:
                atomic_save({"config": config, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                             "step": step, "order_rng": order_rng.getstate()}, checkpoint)
                order = []
            if stop["requested"]:
                break
    model.eval()
    return step


@contextlib.contextmanager
def _stop_on_signal():
    """SIGINT / SIGTERM end training after the current step, with a checkpoint (resume later;
    the resumed run starts a fresh epoch order from the saved generator)."""
    import threading

    stop = {"requested": False}

    def handler(signum, frame):
        stop["requested"] = True

    previous = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers only install there
        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
