"""draftwise's own products for weights kept in a GGUF file's format (csrc/qmm.cpp, csrc/qblocks.cpp), built as one
torch extension.

`make install` builds it once (`python -m draftwise.models.qkernel`) into `<cache>/kernels/qmm-<hash>/`, keyed by
the sources, torch's version and the compiler; a later import loads the built library without compiling. Where it
cannot be built (no compiler), `available()` says why in one line and the GGUF formats fall back to PyTorch's
kernels (`models.formats`). The AVX2 paths run where the CPU has AVX2 and FMA (and F16C for the blocks); elsewhere
the portable loops (same arithmetic, scalar sums) run.

The projections that run them are in `models.linear`: `BlockLinear` is one projection in a K-quant file's own
blocks (Q4_K, Q6_K, Q5_0, Q8_0, byte for byte), multiplied as integers against activations quantised to int8 per
block, as llama.cpp does (csrc/qblocks.cpp).

`CodesLinear` is one projection in decoded codes (Q4_0 and Q4_1 files): 4-bit codes packed two to a byte (0.5 byte
a weight plus a float32 scale and zero per 32), 5-, 6- and 8-bit codes one signed byte a weight (less their
offsets; a float32 scale per 16 or 32), with float32 activations.

Both keep nothing else: no float copy. Every width (one decoding token, a verification of 16, a prompt chunk) runs
the same kernel, whose per-row sums are taken in one order whatever the width: a token's result never depends on its
batch-mates."""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path

import torch

from draftwise.models.cache import cache_root

SOURCES = [Path(__file__).resolve().parent / "csrc" / name for name in ("qmm.cpp", "qblocks.cpp", "attention.cpp",
                                                                              "floats.cpp")]
_module = None
_problem: str | None = None


# included by the sources: part of the build's key
HEADERS = [Path(__file__).resolve().parent / "csrc" / name for name in ("simd.h", "qblocks_avx2.inc")]


def _build_dir() -> Path:
    # the sources' folder is part of the key: torch's build files name the sources by path, so two checkouts sharing
    # one folder would rebuild it in turn (and a build killed midway leaves a lock that stalls the next load)
    key = hashlib.sha256(b"".join(s.read_bytes() for s in SOURCES + HEADERS) + torch.__version__.encode()
                         + sys.version.encode() + str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:16]
    return cache_root() / "kernels" / f"qmm-{key}"


_loading = threading.RLock()  # one load at a time in a process (the server's threads)

DEFAULT_WAIT = 300.0  # seconds: a live build here takes about 2 minutes on 2 cores


def _wait_limit() -> float:
    """How long a load waits for another live process's build (DRAFTWISE_QKERNEL_WAIT seconds, default 300)."""
    try:
        return max(0.0, float(os.environ.get("DRAFTWISE_QKERNEL_WAIT", DEFAULT_WAIT)))
    except ValueError:
        return DEFAULT_WAIT


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _lock_holders(lock: Path) -> list[int] | None:
    """The ids of live processes that hold `lock` open, or None where /proc cannot tell (not Linux). torch's builder
    (`FileBaton`) keeps the lock file open from its creation to its removal, so a lock no process holds open was left
    by a process that is gone. A killed process's descriptors are closed (a zombie's too)."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target = os.path.realpath(lock)
    holders = []
    try:
        entries = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        return None
    for pid in entries:
        try:
            with os.scandir(f"/proc/{pid}/fd") as fds:
                for fd in fds:
                    try:
                        if os.readlink(fd.path) == target:
                            holders.append(int(pid))
                            break
                    except OSError:
                        continue
        except OSError:  # gone meanwhile, or another user's
            continue
    return holders


class _Guard:
    """An advisory lock (flock) on `<build dir>/build.flock`, held by a draftwise process for the whole of its build:
    the kernel drops it the moment its holder dies, so it tells a live build from a dead one, and it keeps two
    processes from both judging torch's lock stale and removing each other's. No-op where fcntl is missing."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "build.flock"
        self.fd: int | None = None

    def take(self) -> bool:
        try:
            import fcntl
        except ImportError:  # not POSIX: no guard, the /proc test alone (which also says None there)
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def _clear_lock(directory: Path, guard: _Guard, limit: float) -> str | None:
    """Take `guard` and leave torch's build lock (`<directory>/lock`) free for this process's build. A lock whose owner
    is gone (no draftwise build holds the guard, and no process holds the file open) is removed, with one line on
    stderr. While a live process builds, waits up to `limit` seconds (one line on stderr once the wait passes a
    second). Returns None when the build may go ahead (the guard held), else why not, in a line naming the lock."""
    lock = directory / "lock"
    start = time.monotonic()
    said = False
    while True:
        if guard.take():
            if not lock.exists():
                return None
            holders = _lock_holders(lock)
            if not holders:  # [] or None (cannot tell: no draftwise build holds the guard, so taken as gone)
                try:
                    age = time.time() - lock.stat().st_mtime
                    lock.unlink()
                except FileNotFoundError:  # its owner finished meanwhile
                    return None
                _say(f"draftwise: removed a stale kernel build lock {lock} ({age:.0f} s old; the process that left it"
                     f" is gone)")
                return None
            guard.release()
            owner = f"process {holders[0]}"
        else:
            owner = "another draftwise process"
        waited = time.monotonic() - start
        if waited >= limit:
            return (f"the kernel's build lock {lock} is still held by {owner} after {waited:.0f} s "
                    f"(DRAFTWISE_QKERNEL_WAIT={limit:g})")
        if not said and waited >= 1.0:
            _say(f"draftwise: waiting up to {limit:.0f} s for {owner}, which is building the kernel (lock {lock})")
            said = True
        time.sleep(0.1)


def load(verbose: bool = False):
    """The compiled module (building it on first use), or None with `problem()` saying why.

    Never blocks silently on torch's build lock: a lock left by a killed process is removed (one line on stderr); a
    live build elsewhere is waited for up to DRAFTWISE_QKERNEL_WAIT seconds (default 300), after which this process
    runs PyTorch's kernels instead, with one line naming the lock."""
    global _module, _problem
    if _module is not None or _problem is not None:
        return _module
    with _loading:
        if _module is not None or _problem is not None:
            return _module
        if os.environ.get("DRAFTWISE_QKERNEL", "1") == "0":
            _problem = "turned off (DRAFTWISE_QKERNEL=0)"
            return None
        guard = None
        try:
            from torch.utils.cpp_extension import load as build

            directory = _build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            guard = _Guard(directory)
            blocked = _clear_lock(directory, guard, _wait_limit())
            if blocked is not None:
                _problem = blocked
                _say(f"draftwise: {blocked}; running PyTorch's kernels instead of draftwise's")
                return None
            # one compiler a core (ninja's default runs cores + 2 at once: on 2 cores, 4 compilers of about 1.5 GB
            # each thrash rather than finish sooner); MAX_JOBS set by the user wins
            os.environ.setdefault("MAX_JOBS", str(max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                      else (os.cpu_count() or 1))))
            scripts = str(Path(sys.executable).parent)  # the venv's own ninja (a dependency), venv activated or not
            if scripts not in os.environ.get("PATH", "").split(os.pathsep):
                os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
            _module = build(name="draftwise_qmm", sources=[str(s) for s in SOURCES], build_directory=str(directory),
                            extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=verbose)
        except Exception as error:  # noqa: BLE001 - no compiler, no ninja: fall back, say why
            _problem = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
            _module = None
        finally:
            if guard is not None:
                guard.release()
        return _module


def available() -> bool:
    return load() is not None


def problem() -> str | None:
    load()
    return _problem


def invariant_kernel(name: str):
    """One of draftwise's batch-invariant kernels (qkernel's `attend` or `fmm`), or None where the kernel is not
    built or DRAFTWISE_INVARIANT=0 turns them off (then PyTorch's SDPA and oneDNN's products run, whose results
    move with the batch's shape)."""
    if os.environ.get("DRAFTWISE_INVARIANT", "1") in ("0", "false", "no"):
        return None
    module = load()
    return None if module is None else getattr(module, name)


def bf16_kernel():
    """qkernel's `bmm16` (bf16 x bf16, batch invariant) where the CPU has AVX512-BF16, else None (also where
    DRAFTWISE_INVARIANT=0 or DRAFTWISE_BMM16=0 turns it off: fmm then runs the bf16 weights in float32)."""
    if os.environ.get("DRAFTWISE_BMM16", "1") in ("0", "false", "no"):
        return None
    bmm16 = invariant_kernel("bmm16")
    if bmm16 is None:
        return None
    return bmm16 if load().bf16_native() else None


def prompt_bf16() -> bool:
    """Whether prompt feeds of bf16 activations run a block projection's weights rounded to bf16 (`BlockLinear`):
    only where asked (DRAFTWISE_PROMPT_BF16=1) and the CPU has AVX512-BF16 (bmm16). Off by default: it costs 2 bytes
    a weight more memory (2.6 GB for Qwen2.5-Coder-1.5B, taken at the first prompt), and prompts run the blocks'
    integer kernel like every other feed."""
    module = load()
    return module is not None and module.bf16_native() and os.environ.get("DRAFTWISE_PROMPT_BF16", "0") == "1"


def main() -> int:
    """`python -m draftwise.models.qkernel`: build the kernels now (make install does), say where or why not."""
    module = load(verbose="-v" in sys.argv)
    if module is None:
        print(f"draftwise: the GGUF-codes kernel was not built ({_problem}); PyTorch's kernels will run instead",
              file=sys.stderr)
        return 0
    print(f"draftwise: GGUF-codes kernel ready in {_build_dir()} "
          f"({'AVX2' if module.accelerated() else 'portable'} path on this CPU)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
