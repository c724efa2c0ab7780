"""The data job's thread choice (draftwise/training/threads.py, `Threads`): both cores while the rest of the machine is
idle, one while other work keeps a core busy, judged over the last forward from /proc/stat less the job's own time.
Control: the job's own busy threads alone never make it drop to one."""

from __future__ import annotations

import pytest
import torch

from draftwise.training.threads import Threads


@pytest.fixture
def samples(monkeypatch):
    feed: list[tuple[float, float, float]] = []
    monkeypatch.setattr(Threads, "_sample", staticmethod(lambda: feed.pop(0)))
    monkeypatch.setattr("os.sysconf", lambda name: 100)  # 100 ticks a second
    before = torch.get_num_threads()
    yield feed
    torch.set_num_threads(before)


def test_one_thread_while_another_process_keeps_a_core_busy(samples):
    samples.append((0.0, 0.0, 0.0))  # at start: machine busy ticks, own ticks, seconds
    threads = Threads(2)
    samples.append((2000.0, 1000.0, 10.0))  # 10 s: the machine 20 core-s busy, the job 10: another core taken
    threads()
    assert threads.count == 1 and torch.get_num_threads() == 1
    samples.append((3900.0, 2800.0, 20.0))  # next 10 s: the job 18 core-s of 19: the machine is free again
    threads()
    assert threads.count == 2 and torch.get_num_threads() == 2


def test_the_jobs_own_two_busy_threads_keep_both(samples):
    samples.append((0.0, 0.0, 0.0))
    threads = Threads(2)
    samples.append((2000.0, 1950.0, 10.0))  # the job itself used both cores
    threads()
    assert threads.count == 2
    samples.append((2010.0, 1950.0, 10.5))  # too short a window to judge: unchanged
    threads()
    assert threads.count == 2
