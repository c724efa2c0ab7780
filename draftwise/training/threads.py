"""The thread count of a long CPU job that shares the machine (the EAGLE-3 data job, benchmarks/eagle_data.py)."""

from __future__ import annotations

import os
import time

import torch


class Threads:
    """Both cores while the machine is otherwise idle, one while other work keeps a core busy. Measured over the
    last forward: the CPU time the whole machine spent (/proc/stat) less this process's own. With a core taken by
    other work, a second thread waits a scheduler tick at every parallel region (a forward slows several times);
    one thread then runs at a core's speed. The features are the same bits either way (the kernels' rows never
    depend on the thread that computes them)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.last = self._sample()
        self.count = most

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
        busy = sum(fields) - fields[3] - (fields[4] if len(fields) > 4 else 0)  # less idle and iowait (ticks)
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()
        mine = float(own[11]) + float(own[12])  # utime + stime of every thread (ticks)
        return busy, mine, time.monotonic()

    def __call__(self) -> None:
        busy, mine, now = self._sample()
        ticks = os.sysconf("SC_CLK_TCK")
        elapsed = now - self.last[2]
        if elapsed > 1.0:
            others = max(0.0, (busy - self.last[0]) - (mine - self.last[1])) / ticks / elapsed  # cores in use
            self.count = 1 if self.most > 1 and others > 0.4 else self.most
            torch.set_num_threads(self.count)
        self.last = (busy, mine, now)
