"""The block kernel's arithmetic rate against this machine's own peak (`benchmarks/kernel.py`).

For each GGUF block format the pair uses (Q4_K, Q6_K, Q5_0, Q8_0), on the shapes of its projections (SHAPES), and for
activation widths 1..64 (one decoding token, a verification, a prompt chunk), the median time of `qmm_blocks` on
random blocks gives G multiply-adds a second (`kernel_rates`). The peak comes from a tiny loop built here with the
same compiler (shared/tools/peak's method: independent chains of the instruction a kernel lives on), on 1 thread and
on every thread at once (`peaks`): `vpdpbusd` (AVX512-VNNI), `vpmaddubsw` + `vpmaddwd` + `vpaddd` (the AVX2 kernel's
inner step, which a u8 x s8 product needs: the `maddubs` alone is an upper bound), and `vfmadd231ps`.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

from draftwise.bench.timing import interleaved, medians
from draftwise.models.linear import BLOCK_KINDS

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/wait.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#define N 20000000L
/* 8 independent chains; `asm volatile` so that no chain is dropped; G multiply-adds a second */
static double step_avx2(void) {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5), one = _mm256_set1_epi16(1), c[8], p;
  for (int j = 0; j < 8; j++) c[j] = _mm256_set1_epi32(j);
  double t = now();
  for (long i = 0; i < N; i++)
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
      __asm__ volatile("vpmaddubsw %2, %1, %0" : "=v"(p) : "v"(a), "v"(b));
      __asm__ volatile("vpmaddwd %2, %1, %0" : "=v"(p) : "v"(p), "v"(one));
      __asm__ volatile("vpaddd %1, %0, %0" : "+v"(c[j]) : "v"(p));
    }
  return N * 8 * 32.0 / (now() - t) / 1e9;
}
static double maddubs(void) {
  __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(5), c[8];
  for (int j = 0; j < 8; j++) c[j] = _mm256_set1_epi16(j);
  double t = now();
  for (long i = 0; i < N; i++)
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) __asm__ volatile("vpmaddubsw %2, %1, %0" : "+v"(c[j]) : "v"(a), "v"(b));
  return N * 8 * 32.0 / (now() - t) / 1e9;
}
static double fma32(void) {
  __m256 a = _mm256_set1_ps(1.0f), c[8];
  for (int j = 0; j < 8; j++) c[j] = _mm256_set1_ps(j);
  double t = now();
  for (long i = 0; i < N; i++)
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) __asm__ volatile("vfmadd231ps %2, %1, %0" : "+v"(c[j]) : "v"(a), "v"(a));
  return N * 8 * 8.0 / (now() - t) / 1e9;
}
#ifdef __AVX512VNNI__
static double vnni(void) {
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5), c[8];
  for (int j = 0; j < 8; j++) c[j] = _mm512_set1_epi32(j);
  double t = now();
  for (long i = 0; i < N; i++)
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) __asm__ volatile("vpdpbusd %2, %1, %0" : "+v"(c[j]) : "v"(a), "v"(b));
  return N * 8 * 64.0 / (now() - t) / 1e9;
}
#endif
static double run(const char* kind) {
  if (!strcmp(kind, "avx2-step")) return step_avx2();
  if (!strcmp(kind, "avx2-maddubs")) return maddubs();
  if (!strcmp(kind, "fma-fp32")) return fma32();
#ifdef __AVX512VNNI__
  if (!strcmp(kind, "vnni512")) return vnni();
#endif
  return -1;
}
int main(int argc, char** argv) {
  int threads = atoi(argv[2]);
  double one = run(argv[1]);
  if (one < 0) { printf("%s none\n", argv[1]); return 0; }
  int fd[2]; if (pipe(fd)) return 1;
  for (int k = 0; k < threads; k++) if (fork() == 0) { double g = run(argv[1]); if (write(fd[1], &g, sizeof g)) {} _exit(0); }
  double all = 0, g; for (int k = 0; k < threads; k++) { if (read(fd[0], &g, sizeof g) != sizeof g) return 1; all += g; }
  while (wait(NULL) > 0) {}
  printf("%s %.2f %.2f\n", argv[1], one, all);
  return 0;
}
"""

SHAPES = {  # (kind, output rows, inputs): the pair's projections
    "q4_k": [(17920, 1536, "1.5B gate|up"), (2048, 1536, "1.5B q|k")],
    "q6_k": [(1536, 8960, "1.5B down"), (151936, 1536, "1.5B LM head")],
    "q5_0": [(9728, 896, "0.5B gate|up")],
    "q8_0": [(9728, 896, "0.5B gate|up (as Q8_0)")],
}


def peaks(threads: int) -> dict[str, dict[str, float]]:
    flags = open("/proc/cpuinfo").read()
    extra = ["-mavx512f", "-mavx512bw", "-mavx512vnni"] if " avx512_vnni" in flags else []
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.c", Path(tmp) / "peak"
        source.write_text(PEAK_SOURCE)
        subprocess.run(["gcc", "-O2", "-mavx2", "-mfma", *extra, str(source), "-o", str(binary)], check=True)
        out = {}
        for kind in ("avx2-step", "avx2-maddubs", "fma-fp32", "vnni512"):
            for _ in range(3):  # the best of three: a peak is what the machine can do, not its noise
                line = subprocess.run([str(binary), kind, str(threads)], capture_output=True, text=True,
                                      check=True).stdout.split()
                if line[1] == "none":
                    break
                best = out.setdefault(kind, {"one_thread": 0.0, "all_threads": 0.0})
                best["one_thread"] = max(best["one_thread"], float(line[1]))
                best["all_threads"] = max(best["all_threads"], float(line[2]))
        return out


def random_blocks(kind: str, rows: int, inputs: int) -> torch.Tensor:
    kid, per, size = BLOCK_KINDS[kind]
    blocks = torch.randint(0, 256, (rows, inputs // per * size), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(0))
    view = blocks.view(rows, inputs // per, size)
    half_one = torch.tensor([0x00, 0x1C], dtype=torch.uint8)  # fp16 scales of 2^-8: finite sums
    if kind == "q4_k":
        view[:, :, 0:2] = half_one
        view[:, :, 2:4] = half_one
    elif kind == "q6_k":
        view[:, :, 208:210] = half_one
    else:
        view[:, :, 0:2] = half_one
    return blocks


def kernel_rates(module: Any, formats: list[str], widths: list[int], repeats: int, ceiling: float,
                 progress: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """A row per (format, shape, width, path): the median ms over `repeats` calls after 2 warm-up calls of
    `qmm_blocks` on the file's blocks ("blocks") and, where the CPU packs rows 16 to a vector, of `qmm_packed` (the
    path a model takes there: "packed"), interleaved; G multiply-adds a second, its share of `ceiling` and the
    weights' GB/s; a line per shape to `progress` (the path a model takes, the file blocks' rate beside it)."""
    rows = []
    for kind in formats:
        kid = BLOCK_KINDS[kind][0]
        for n, k, name in SHAPES[kind]:
            blocks = random_blocks(kind, n, k)
            line = []
            packed = module.pack_blocks(blocks, kid, k) if module.blocks_packed() and n % 16 == 0 else None
            for m in widths:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                calls = {"blocks": lambda x=x: module.qmm_blocks(x, blocks, kid, k, False, True)}
                if packed is not None:
                    calls["packed"] = lambda x=x: module.qmm_packed(x, packed, kid, k)
                times = medians(interleaved(calls, rounds=repeats, warmup=2))
                rates = {path: m * n * k / t / 1e9 for path, t in times.items()}
                for path, t in times.items():
                    rows.append({"format": kind, "shape": name, "rows": n, "inputs": k, "width": m, "path": path,
                                 "ms": 1e3 * t, "gmacs": rates[path], "of_peak": rates[path] / ceiling,
                                 "weights_gb_s": blocks.numel() / t / 1e9})
                rate = rates.get("packed", rates["blocks"])  # the path a model takes
                line.append(f"{m}: {rate:5.1f} ({rate / ceiling:4.0%})"
                            + (f" [file blocks {rates['blocks']:.1f}]" if packed is not None else ""))
            progress(f"{kind} {name:22s} " + "  ".join(line))
    return rows
