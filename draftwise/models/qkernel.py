"""draftwise's own products for weights kept in a GGUF file's format (csrc/qmm.cpp, csrc/qblocks.cpp), built as one
torch extension.

`make install` builds it once (`python -m draftwise.models.qkernel`) into `<cache>/kernels/qmm-<hash>/`, keyed by
the sources, torch's version and the compiler; a later import loads the built library without compiling. Where it
cannot be built (no compiler), `available()` says why in one line and the GGUF formats fall back to PyTorch's
kernels (`models.quant`). The AVX2 paths run where the CPU has AVX2 and FMA (and F16C for the blocks); elsewhere the
portable loops (same arithmetic, scalar sums) run.

`BlockLinear` is one projection in a K-quant file's own blocks (Q4_K, Q6_K, Q5_0, Q8_0, byte for byte), multiplied
as integers against activations quantised to int8 per block, as llama.cpp does (csrc/qblocks.cpp).

`CodesLinear` is one projection in decoded codes (Q4_0 and Q4_1 files): 4-bit codes packed two to a byte (0.5 byte a
weight plus a float32 scale and zero per 32), 5-, 6- and 8-bit codes one signed byte a weight (less their offsets; a
float32 scale per 16 or 32), with float32 activations.

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


class _Product:
    """What a projection on draftwise's kernels shares: float activations of any shape in, `_product` (the kernel)
    on them flattened to float32 rows, the bias added, the activations' type and shape back (float32 for the LM
    head's `logits`: the kernel's float32 sums as they are, never rounded to bf16 activations' type)."""

    format = "codes"
    out_features: int
    bias: torch.Tensor | None

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, wide: bool | int = False, *, logits: bool = False) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous():  # the fast forward's packed rows
            y = self._product(x)
            return y if self.bias is None else y.add_(self.bias)  # in place: y + bias's bits, no new tensor
        shape = x.shape
        y = self._product(x.reshape(-1, shape[-1]).float().contiguous())
        if self.bias is not None:
            y.add_(self.bias)
        return (y if logits else y.to(x.dtype)).reshape(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The float32 weights (every row), for checks and round trips."""
        return self.rows(torch.arange(self.out_features))


class CodesLinear(_Product):
    """y = x W^T (+ b) with W in its GGUF codes (see the module docstring)."""

    def __init__(self, kind: str, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group: int, offset: int, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        out_features, in_features = codes.shape
        if in_features % 32:
            raise ValueError(f"{kind}: {in_features} inputs, not a multiple of 32")
        self.kind, self.group, self.dtype = kind, group, dtype
        self.out_features, self.in_features = out_features, in_features
        if kind in ("q4_0", "q4_1", "q4_k"):
            self.bits = 4
            q = codes.to(torch.uint8).reshape(out_features, -1, 2, 16)  # per 32: weights 0..15, then 16..31
            self.codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(out_features, -1).contiguous()
            zero = zeros if zeros is not None else torch.zeros_like(scales)
            if kind in ("q4_0", "q4_1"):  # Int4Linear's convention (q - 8) * scale + zero: fold the 8 in
                zero = zero - 8 * scales
            self.zeros = zero.float().contiguous()
        else:
            self.bits = 8
            signed = codes if codes.dtype == torch.int8 else codes.view(torch.int8)  # uint8 codes < 128 here
            self.codes = (signed - offset if offset else signed).view(torch.uint8).contiguous()
            self.zeros = None if zeros is None else zeros.float().contiguous()
        self.scales = scales.float().contiguous()
        self.bias = None if bias is None else bias.float()

    @classmethod
    def packed(cls, kind: str, bits: int, group: int, codes: torch.Tensor, scales: torch.Tensor,
               zeros: torch.Tensor | None, bias: torch.Tensor | None, in_features: int) -> "CodesLinear":
        """From codes already packed for the kernel (a cache entry's tensors)."""
        out = cls.__new__(cls)
        out.kind, out.bits, out.group, out.dtype = kind, int(bits), int(group), torch.float32
        out.out_features, out.in_features = codes.shape[0], int(in_features)
        out.codes, out.scales, out.zeros, out.bias = codes, scales, zeros, bias
        if codes.shape[1] != (in_features // 2 if out.bits == 4 else in_features):
            raise ValueError(f"{kind}: codes of shape {tuple(codes.shape)} do not hold {in_features} inputs")
        return out

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        return load().qmm(flat, self.codes, self.bits, self.scales, self.zeros, self.group, False)

    def subset(self, index: torch.Tensor) -> "CodesLinear":
        """Output rows `index` only, their codes as they are (a draft's restricted output vocabulary)."""
        index = index.reshape(-1).to(torch.long)
        return CodesLinear.packed(self.kind, self.bits, self.group, self.codes[index].contiguous(),
                                  self.scales[index].contiguous(),
                                  None if self.zeros is None else self.zeros[index].contiguous(),
                                  None if self.bias is None else self.bias[index], self.in_features)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros) if t is not None)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 weights of output rows `index` (an embedding lookup): [len(index), in_features]."""
        codes = self.codes[index]
        if self.bits == 4:
            packed = codes.reshape(len(index), -1, 16)
            q = torch.stack([packed & 15, packed >> 4], dim=2).reshape(len(index), -1).float()
        else:
            q = codes.view(torch.int8).float()
        w = q * self.scales[index].repeat_interleave(self.group, dim=1)
        return w + self.zeros[index].repeat_interleave(self.group, dim=1) if self.zeros is not None else w


def split_feed(linear, x: torch.Tensor, wide: bool | int) -> tuple[torch.Tensor | None, bool]:
    """For a projection whose prompt tokens take another product than the rest: `wide` is True for a prompt feed,
    False for decoding or verification, or an int n for a feed whose packed tokens (x [tokens, in]) from n on are
    prompt tokens. Returns (the mixed feed's result, each part run as it would be alone, or None; whether the feed,
    being of one kind, is a prompt)."""
    if isinstance(wide, bool):
        return None, wide
    if 0 < wide < x.shape[0]:
        return torch.cat([linear(x[:wide]), linear(x[wide:], True)]), True
    return None, wide == 0


def prompt_bf16() -> bool:
    """Whether prompt feeds of bf16 activations run a block projection's weights rounded to bf16 (`BlockLinear`):
    only where asked (DRAFTWISE_PROMPT_BF16=1) and the CPU has AVX512-BF16 (bmm16). Off by default: it costs 2 bytes
    a weight more memory (2.6 GB for Qwen2.5-Coder-1.5B, taken at the first prompt), and prompts run the blocks'
    integer kernel like every other feed."""
    module = load()
    return module is not None and module.bf16_native() and os.environ.get("DRAFTWISE_PROMPT_BF16", "0") == "1"


BLOCK_KINDS = {"q4_k": (0, 256, 144), "q6_k": (1, 256, 210), "q5_0": (2, 32, 22), "q8_0": (3, 32, 34)}
"""The kinds `BlockLinear` runs from the file's own blocks: (the kernel's id, weights a block, bytes a block)."""


class BlockLinear(_Product):
    """y = x W^T (+ b) with W in a GGUF file's own blocks, byte for byte (csrc/qblocks.cpp): Q4_K 4.5 bits a weight,
    Q6_K 6.56, Q5_0 5.5, Q8_0 8.5. Each activation row is quantised to int8 per block of inputs first (256 for the
    K-quants, 32 for Q5_0 and Q8_0; a float32 scale each), as llama.cpp does, and every block's product is an exact
    integer sum scaled once: the result is the exact product of the dequantised weights with those quantised
    activations, up to float32 rounding of the per-block sums, and a row's result never depends on its
    batch-mates."""

    def __init__(self, kind: str, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None) -> None:
        if kind not in BLOCK_KINDS:
            raise ValueError(f"{kind}: the block kernel takes {', '.join(BLOCK_KINDS)}")
        self.kind_id, per, size = BLOCK_KINDS[kind]
        if in_features % per or blocks.dtype != torch.uint8 or blocks.dim() != 2 \
                or blocks.shape[1] != in_features // per * size:
            raise ValueError(f"{kind}: blocks of shape {tuple(blocks.shape)} do not hold {in_features} inputs")
        self.kind, self.blocks, self.in_features = kind, blocks.contiguous(), int(in_features)
        self.out_features = blocks.shape[0]
        self.bias = None if bias is None else bias.float()
        self._wide = None  # the weights in bf16 for prompt feeds (`prompt_bf16`), built at the first one

    def __call__(self, x: torch.Tensor, wide: bool | int = False, *, logits: bool = False) -> torch.Tensor:
        """wide: True for a prompt feed; an int n for a feed whose packed tokens from n on are prompt tokens (a
        verification forward that also carries prompt chunks): each part runs as it would alone. logits: the LM
        head's product, float32 out whatever the activations (an LM head runs no prompt feed). With bf16
        activations on a CPU with AVX512-BF16, a prompt runs the weights rounded to bf16 through `bmm16` (a prompt's
        product is bound by arithmetic, which bf16 pairs do at about twice the int8 blocks' rate here); decoding and
        verification read the blocks (bound by reading weights). Which path a token takes depends only on whether it
        is a prompt token, never on its batch-mates."""
        if logits:
            return super().__call__(x, logits=True)
        mixed, wide = split_feed(self, x, wide)
        if mixed is not None:
            return mixed
        if wide and x.dtype == torch.bfloat16 and prompt_bf16():
            if self._wide is None:
                from draftwise.models.fast import FloatLinear

                self._wide = FloatLinear(load().dequantised_blocks(self.blocks, self.kind_id, self.in_features),
                                         self.bias)  # the bias stays float32, added before rounding as here
            return self._wide(x, True)
        return super().__call__(x)

    def _product(self, flat: torch.Tensor) -> torch.Tensor:
        return load().qmm_blocks(flat, self.blocks, self.kind_id, self.in_features, False)

    def subset(self, index: torch.Tensor) -> "BlockLinear":
        """Output rows `index` only, their blocks byte for byte (a draft's restricted output vocabulary)."""
        index = index.reshape(-1).to(torch.long)
        return BlockLinear(self.kind, self.blocks[index], self.in_features,
                           None if self.bias is None else self.bias[index])

    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 weights of output rows `index`, as gguf's reference dequantises them."""
        from draftwise.models.quant import _decode

        return _decode(self.kind, self.blocks[index.reshape(-1)].numpy()).dequantized()


def q8_0_blocks(weight: torch.Tensor) -> torch.Tensor:
    """Float weights [out, in] (in a multiple of 32) as GGUF Q8_0 blocks [out, in / 32 * 34] uint8: per block of 32
    an fp16 scale d = max |w| / 127 and 32 int8 codes round(w / d), as llama.cpp's quantize writes them."""
    out, n = weight.shape
    if n % 32:
        raise ValueError(f"Q8_0 blocks need inputs in multiples of 32, got {n}")
    w = weight.detach().float().reshape(out, n // 32, 32)
    d = (w.abs().amax(-1) / 127.0).to(torch.float16)  # [out, blocks]
    inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros(()))
    codes = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return torch.cat([d[..., None].contiguous().view(torch.uint8), codes.view(torch.uint8)], dim=-1).reshape(out, -1).contiguous()


def q8_0_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> "BlockLinear":
    """A float projection as Q8_0 blocks on the block kernel (`q8_0_blocks`)."""
    return BlockLinear("q8_0", q8_0_blocks(weight), weight.shape[1], bias)


class JoinedLinear:
    """Projections of different code kinds side by side (a fused q|k|v whose parts differ): outputs concatenated."""

    format = "codes"

    def __init__(self, parts: list[CodesLinear]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    def __call__(self, x: torch.Tensor, wide: bool | int = False, *, logits: bool = False) -> torch.Tensor:
        return torch.cat([p(x, wide, logits=logits) for p in self.parts], dim=-1)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([p.dequantized() for p in self.parts])

    def nbytes(self) -> int:
        return sum(p.nbytes() for p in self.parts)


def _layout(p) -> tuple:
    """What two projections must share to be stacked into one product."""
    if isinstance(p, BlockLinear):
        return ("blocks", p.kind)
    return ("codes", p.bits, p.group, p.zeros is None)


def joined(parts: list) -> "CodesLinear | BlockLinear | JoinedLinear":
    """Projections side by side: one product where they share a layout (their codes stacked), else one product per
    run of parts that share one (a Q4_K_M layer's q and k are Q4_K, its v Q6_K: two products)."""
    flat = [q for p in parts for q in (p.parts if isinstance(p, JoinedLinear) else [p])]
    runs: list[list] = []
    for p in flat:
        if runs and _layout(runs[-1][0]) == _layout(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    if len(runs) > 1:
        return JoinedLinear([joined(run) if len(run) > 1 else run[0] for run in runs])
    first = parts[0]
    if isinstance(first, BlockLinear):
        return _joined_blocks(flat)
    out = CodesLinear.__new__(CodesLinear)
    out.kind, out.group, out.dtype, out.bits = first.kind, first.group, first.dtype, first.bits
    out.in_features, out.out_features = first.in_features, sum(p.out_features for p in flat)
    out.codes = torch.cat([p.codes for p in flat])
    out.scales = torch.cat([p.scales for p in flat])
    out.zeros = None if first.zeros is None else torch.cat([p.zeros for p in flat])
    biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in flat]
    out.bias = None if all(p.bias is None for p in flat) else torch.cat(biases)
    start = 0
    for p in flat:  # the parts become views of the fused tensors: one copy of the codes
        end = start + p.out_features
        p.codes, p.scales = out.codes[start:end], out.scales[start:end]
        if out.zeros is not None:
            p.zeros = out.zeros[start:end]
        start = end
    return out


def _joined_blocks(parts: list[BlockLinear]) -> BlockLinear:
    biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
    bias = None if all(p.bias is None for p in parts) else torch.cat(biases)
    out = BlockLinear(parts[0].kind, torch.cat([p.blocks for p in parts]), parts[0].in_features, bias)
    start = 0
    for p in parts:  # the parts become views of the fused blocks: one copy
        p.blocks = out.blocks[start: start + p.out_features]
        start += p.out_features
    return out


class CodesProjection(torch.nn.Module):
    """A model's Linear whose weights live only in their codes (the direct GGUF loader puts these in place of the
    decoder's projections and the LM head): transformers' own forward runs through the kernel too, and the fast
    forward takes `linear` as it is. `weight` dequantises on demand (float32; for tools that read it, not for
    decoding)."""

    def __init__(self, linear: "CodesLinear | BlockLinear | JoinedLinear") -> None:
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, linear.out_features

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.dequantized()

    bias = None  # a projection's bias is inside `linear`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class CodesEmbedding(torch.nn.Module):
    """A token embedding kept in its codes: a lookup dequantises the rows it reads into the activations' type."""

    def __init__(self, linear: "CodesLinear | BlockLinear", dtype: torch.dtype) -> None:
        super().__init__()
        self.codes = linear
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = linear.out_features, linear.in_features

    @property
    def weight(self) -> torch.Tensor:
        return self.codes.dequantized().to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows = self.codes.rows(flat)
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)


def out_rows(module) -> int:
    """Rows of a model's output or input embedding module (its vocabulary), without reading its weights."""
    for name in ("out_features", "num_embeddings"):
        if hasattr(module, name):
            return int(getattr(module, name))
    return int(module.weight.shape[0])


def weight_rows(module, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of an embedding's or a projection's weights: from the codes where it holds codes (no full
    dequantisation), else the float weights' rows."""
    if isinstance(module, CodesProjection) and isinstance(module.linear, (CodesLinear, BlockLinear)):
        return module.linear.rows(index)
    if isinstance(module, CodesEmbedding):
        return module.codes.rows(index).to(module.dtype)
    return module.weight.detach()[index]


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
