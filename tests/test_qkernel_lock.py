"""The kernel's build lock (issue 55): a lock left by a killed process never stalls a load; a live one is waited for
with a bound, then the kernel-free path runs with one line naming the lock. No test here builds the real kernel: the
build folder is a tmp folder and torch's builder is replaced by one that keeps torch's locking (`FileBaton`: take the
lock, or wait while it exists) around no compile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch.utils.cpp_extension
from torch.utils.file_baton import FileBaton

from draftwise.models import qkernel

ROOT = Path(__file__).resolve().parent.parent
BUILT = object()  # what the stand-in builder returns for the module


def _fake_build(**kwargs):
    """torch's `_jit_compile` locking around no compile: take the baton, or wait (forever) while the lock exists."""
    baton = FileBaton(os.path.join(kwargs["build_directory"], "lock"))
    if baton.try_acquire():
        baton.release()
    else:
        baton.wait()
    return BUILT


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """qkernel as if nothing were loaded yet, building into tmp_path with the stand-in builder."""
    monkeypatch.setattr(qkernel, "_module", None)
    monkeypatch.setattr(qkernel, "_problem", None)
    monkeypatch.setattr(qkernel, "_build_dir", lambda: tmp_path)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _fake_build)
    monkeypatch.delenv("DRAFTWISE_QKERNEL", raising=False)
    return tmp_path


def _load_within(seconds: float):
    """qkernel.load() in a daemon thread: its result, or a failure (not a hung suite) when it blocks past `seconds`."""
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("module", qkernel.load()), daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"load() still blocked after {seconds} s"
    return box["module"], time.monotonic() - start


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


def test_orphan_lock_file_is_removed_with_one_line(fresh, capsys):
    lock = fresh / "lock"
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))
    module, took = _load_within(30)
    assert module is BUILT and qkernel.problem() is None
    assert took < 10
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert "stale" in lines[0] and str(lock) in lines[0]
    assert not lock.exists()


def test_no_lock_no_line(fresh, capsys):
    module, _ = _load_within(30)
    assert module is BUILT
    assert capsys.readouterr().err == ""


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import torch.utils.cpp_extension
    from torch.utils.file_baton import FileBaton
    from draftwise.models import qkernel

    def slow_build(**kwargs):  # takes torch's lock the way torch does, then "compiles" until killed
        baton = FileBaton(kwargs["build_directory"] + "/lock")
        assert baton.try_acquire()
        print("building", flush=True)
        time.sleep(600)

    qkernel._build_dir = lambda: Path(sys.argv[1])
    torch.utils.cpp_extension.load = slow_build
    qkernel.load()
""")


def _builder(directory: Path) -> subprocess.Popen:
    """A draftwise process in the middle of building the kernel into `directory` (its lock taken)."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(directory)], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    line = child.stdout.readline()
    assert line.strip() == "building", child.stderr.read() if child.poll() is not None else line
    assert (directory / "lock").exists()
    return child


LIGHT = textwrap.dedent("""
    import fcntl, os, sys, time
    directory = sys.argv[1]
    guard = os.open(os.path.join(directory, "build.flock"), os.O_RDWR | os.O_CREAT)
    fcntl.flock(guard, fcntl.LOCK_EX)  # what draftwise's load() holds while it builds
    lock = os.open(os.path.join(directory, "lock"), os.O_CREAT | os.O_EXCL)  # torch's FileBaton
    print("building", flush=True)
    time.sleep(600)
""")


def _light_builder(directory: Path) -> subprocess.Popen:
    """The same as `_builder` without importing torch (fast): draftwise's guard and torch's lock, held."""
    child = subprocess.Popen([sys.executable, "-c", LIGHT, str(directory)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "building"
    return child


def test_lock_left_by_a_killed_build(fresh, capsys):
    """The figure: a draftwise process killed while it builds leaves torch's lock; the next load completes at once,
    with one line."""
    child = _builder(fresh)
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    child.stdout.close(), child.stderr.close()
    assert (fresh / "lock").exists()  # what torch leaves behind
    module, took = _load_within(30)
    assert module is BUILT and took < 30
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and "stale" in lines[0] and str(fresh / "lock") in lines[0], lines


def test_live_build_is_waited_for_then_the_kernel_free_path_with_one_line(fresh, capsys, monkeypatch):
    monkeypatch.setenv("DRAFTWISE_QKERNEL_WAIT", "0.5")
    child = _light_builder(fresh)
    try:
        module, took = _load_within(30)
    finally:
        child.kill()
        child.wait(10)
        child.stdout.close(), child.stderr.close()
    assert module is None and took < 10
    assert str(fresh / "lock") in qkernel.problem()
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert str(fresh / "lock") in lines[0] and "instead" in lines[0]


def test_live_lock_holder_outside_draftwise_is_not_removed(fresh, capsys, monkeypatch):
    """A process that holds torch's lock open without draftwise's guard (another torch program, an older draftwise)
    is alive: its lock stays, and the load falls back after the wait."""
    monkeypatch.setenv("DRAFTWISE_QKERNEL_WAIT", "0.5")
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc to see the lock's holder")
    lock = fresh / "lock"
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_CREAT | os.O_EXCL)\nprint('held', flush=True)\n"
                               "time.sleep(600)", str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        module, _ = _load_within(30)
    finally:
        holder.kill()
        holder.wait(10)
        holder.stdout.close()
    assert module is None and lock.exists()
    assert f"process {holder.pid}" in qkernel.problem()
    assert len(_lines(capsys.readouterr().err)) == 1


def test_a_finished_build_lets_the_waiter_through(fresh, capsys, monkeypatch):
    """A wait that ends when the other build ends: the module loads, with the one 'waiting' line."""
    monkeypatch.setenv("DRAFTWISE_QKERNEL_WAIT", "30")
    child = _light_builder(fresh)
    killer = threading.Timer(1.5, lambda: ((fresh / "lock").unlink(), child.kill(), child.wait()))
    killer.start()  # the other build "finishes": its process ends, its lock removed
    try:
        module, took = _load_within(30)
    finally:
        killer.join()
        child.stdout.close(), child.stderr.close()
    assert module is BUILT and took < 10
    lines = _lines(capsys.readouterr().err)
    assert len(lines) == 1 and "waiting" in lines[0], lines
