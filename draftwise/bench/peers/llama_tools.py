"""llama.cpp's own tools as a peer: `llama-bench` (pp1, pp2, pp4, pp8, pp16, pp512 and tg128) and
`llama-speculative-simple` (the target with a draft model), on GGUF files (`benchmarks/llama_bench.py`, and the
llama-bench part of `benchmarks/peers.py`).

Build (once, `setup_tools`): the two tools from the llama.cpp source that the llama-cpp-python 0.3.36 sdist vendors
(`.peers/src`, downloaded by pip, shared with the peers' GGUF converter), Release, `-march=native`, static
libraries, into `.peers/llama-tools/bin` with a `build.json` beside them (the cmake arguments, the compiler, the
seconds). It is built in a temporary folder and renamed into place, so a half build is never taken for a build.
AMX is compiled out: on Xeons with AMX, llama.cpp's AMX weight repacking crashes on quantised files, and
`-march=native` would turn it on whatever GGML_AMX_* says, so the compiler also gets `-mno-amx-tile
-mno-amx-int8 -mno-amx-bf16` (GCC and Clang honour an explicit -mno-* over -march). The CPU repacking of the
other paths (AVX2 / AVX-512) stays on, as in a stock build. The build runs at `nice 19` with `--jobs` (2) jobs.

Measures:
- `run_bench`: `llama-bench -o json -t THREADS -p 1,2,4,8,16,512 -n 128 -r REPEATS` on one file; per test (pp1 ..
  pp512, tg128) llama-bench's own mean tokens/s over its repetitions, its standard deviation and the samples
  (ppN: N prompt tokens in one batch, so pp1 is one token's forward; tg128: 128 tokens decoded one at a time
  after an empty context, llama-bench's convention).
- `speculative`: `llama-speculative-simple` (greedy, `--spec-type draft-simple`) with a draft model, for each draft
  length, on a prompt file, `repeats` times; its own "decoded N tokens in S seconds" line (decode only, the prompt
  excluded) gives tokens/s, and n_drafted / n_accept the acceptance; the target's forward passes come from its perf
  summary ("eval time = ... / N runs"). llama.cpp's tools stop at EOS.
The parsers are pure (tests/test_llama_bench.py feeds them text).
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from draftwise.bench.peers import PEERS
from draftwise.bench.peers.worker import one_line

LLAMA_CPP_VERSION = "0.3.36"  # llama-cpp-python; its sdist vendors llama.cpp's source
TOOLS = ("llama-bench", "llama-speculative-simple")
TOOLS_DIR = PEERS / "llama-tools"
PROMPT_SIZES = (1, 2, 4, 8, 16, 512)
GEN_TOKENS = 128
NO_AMX = ("-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16")
CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
              "-DGGML_AMX_BF16=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_CCACHE=OFF", "-DLLAMA_OPENSSL=OFF",
              "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_EXAMPLES=ON", "-DLLAMA_BUILD_TESTS=OFF",
              "-DLLAMA_BUILD_SERVER=OFF")


def source_dir() -> Path:
    return PEERS / "src" / f"llama_cpp_python-{LLAMA_CPP_VERSION}" / "vendor" / "llama.cpp"


def bin_dir() -> Path:
    return TOOLS_DIR / "bin"


def tool(name: str) -> Path:
    return bin_dir() / name


def run_logged(cmd: list[str], log: Path, *, env: dict[str, str] | None = None, niceness: int = 0,
               timeout: float | None = None) -> None:
    """Run `cmd` with its output appended to `log`; a RuntimeError (one line) when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        result = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout,
                                preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {result.returncode}); see {log}")


def fetch_source(log: Path, python: str | None = None) -> bool:
    """The llama-cpp-python sdist (pip download) unpacked under .peers/src; False when it is already there."""
    if (source_dir() / "CMakeLists.txt").is_file():
        return False
    src = PEERS / "src"
    src.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    sdist = src / f"{name}.tar.gz"
    if not sdist.is_file():
        with tempfile.TemporaryDirectory(prefix=".download.", dir=src) as tmp:
            run_logged([python or sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", tmp], log)
            os.replace(Path(tmp) / sdist.name, sdist)
    with tempfile.TemporaryDirectory(prefix=".unpack.", dir=src) as tmp:
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        if (src / name).exists():  # a partial unpack of an older layout: replaced whole
            shutil.rmtree(src / name)
        os.replace(Path(tmp) / name, src / name)
    return True


def _compiler(env_var: str, names: tuple[str, ...]) -> str | None:
    chosen = os.environ.get(env_var)
    if chosen:
        return shutil.which(chosen.split()[0])
    return next((found for found in map(shutil.which, names) if found), None)


def _no_amx_flags(cxx: str) -> list[str]:
    """-mno-amx-* where the target is x86 and the compiler knows them (one too old to know them cannot emit AMX)."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "i386"):
        return []
    probe = subprocess.run([cxx, *NO_AMX, "-march=native", "-x", "c++", "-dM", "-E", "-"], input="",
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return []
    if "__AMX_INT8__" in probe.stdout or "__AMX_TILE__" in probe.stdout:
        raise RuntimeError(f"{cxx} keeps AMX on with {' '.join(NO_AMX)}; cannot build llama.cpp without AMX")
    return list(NO_AMX)


def tools_built() -> bool:
    info = TOOLS_DIR / "build.json"
    if not info.is_file() or not all(os.access(tool(t), os.X_OK) for t in TOOLS):
        return False
    try:
        return json.loads(info.read_text()).get("llama_cpp_python") == LLAMA_CPP_VERSION
    except (OSError, ValueError):
        return False


def build_info() -> dict[str, Any] | None:
    try:
        return json.loads((TOOLS_DIR / "build.json").read_text())
    except (OSError, ValueError):
        return None


def setup_tools(log: Path | None = None, jobs: int = 2, niceness: int = 19, python: str | None = None) -> bool:
    """llama-bench and llama-speculative-simple in .peers/llama-tools/bin; True when built now, False when a build
    of this version is there. Raises RuntimeError (one line) when cmake or a compiler is missing or the build fails."""
    if tools_built():
        return False
    log = log or PEERS / "logs" / "llama-tools-build.log"
    cc, cxx = _compiler("CC", ("cc", "gcc", "clang")), _compiler("CXX", ("c++", "g++", "clang++"))
    missing = [what for what, found in (("cmake", shutil.which("cmake")), ("a C compiler ($CC, cc, gcc or clang)", cc),
                                        ("a C++ compiler ($CXX, c++, g++ or clang++)", cxx)) if not found]
    if missing:
        raise RuntimeError(f"building llama.cpp's tools needs {' and '.join(missing)}: not found on PATH")
    started = time.time()
    fetch_source(log, python)
    flags = " ".join(_no_amx_flags(cxx))
    PEERS.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".llama-tools.", dir=PEERS))
    try:
        tmp.chmod(0o755)
        build = tmp / "build"
        args = [*CMAKE_ARGS, f"-DCMAKE_C_COMPILER={cc}", f"-DCMAKE_CXX_COMPILER={cxx}",
                f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"]
        run_logged(["cmake", "-S", str(source_dir()), "-B", str(build), *args], log, niceness=niceness)
        run_logged(["cmake", "--build", str(build), "--config", "Release", "--target", *TOOLS, "-j", str(jobs)], log,
                   niceness=niceness)
        (tmp / "bin").mkdir()
        for name in TOOLS:
            shutil.copy2(build / "bin" / name, tmp / "bin" / name)
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()
        info = {"llama_cpp_python": LLAMA_CPP_VERSION, "source": str(source_dir()), "tools": list(TOOLS),
                "cmake_args": args, "compiler": version[0] if version else cxx,
                "amx": f"compiled out ({flags})" if flags else "not an x86 target, or the compiler cannot emit it",
                "jobs": jobs, "nice": niceness, "seconds": round(time.time() - started, 1),
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        (tmp / "build.json").write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(build)
        if TOOLS_DIR.exists():  # an older version's build
            shutil.rmtree(TOOLS_DIR)
        os.replace(tmp, TOOLS_DIR)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return True


def bench_test_name(n_prompt: int, n_gen: int, n_depth: int = 0) -> str:
    """llama-bench's own names: pp512, tg128, pp512+tg128; `@ dN` after a context of N tokens."""
    name = "+".join(part for part in (f"pp{n_prompt}" if n_prompt else "", f"tg{n_gen}" if n_gen else "") if part)
    return f"{name} @ d{n_depth}" if n_depth else name


def parse_bench_json(text: str) -> list[dict[str, Any]]:
    """The tests of `llama-bench -o json` output (a JSON array, possibly with log lines around it), in llama-bench's
    order: name, token counts, mean tokens/s and its standard deviation over the repetitions, the samples."""
    start, end = text.find("["), text.rfind("]")
    if start < 0 or end < start:
        raise ValueError("no JSON array in llama-bench's output")
    entries = json.loads(text[start:end + 1])
    if not isinstance(entries, list) or not entries:
        raise ValueError("llama-bench reported no tests")
    tests = []
    for entry in entries:
        try:
            n_prompt, n_gen, n_depth = int(entry["n_prompt"]), int(entry["n_gen"]), int(entry.get("n_depth", 0))
            rate = float(entry["avg_ts"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"a llama-bench test without {error}") from None
        if rate <= 0 or n_prompt + n_gen <= 0:
            raise ValueError(f"llama-bench test {bench_test_name(n_prompt, n_gen, n_depth)!r}: {rate} tokens/s")
        samples = [float(x) for x in entry.get("samples_ts", [])]
        tests.append({"test": bench_test_name(n_prompt, n_gen, n_depth), "n_prompt": n_prompt, "n_gen": n_gen,
                      "n_depth": n_depth, "tokens_per_s": rate, "stddev_tokens_per_s": float(entry.get("stddev_ts", 0)),
                      "samples_tokens_per_s": samples, "repetitions": len(samples),
                      "ms_per_pass": float(entry["avg_ns"]) / 1e6 if "avg_ns" in entry else None})
    return tests


def bench_context(text: str) -> dict[str, Any]:
    """What every test of one llama-bench run shares: llama.cpp's build, the CPU it saw, the model, the threads."""
    start, end = text.find("["), text.rfind("]")
    first = json.loads(text[start:end + 1])[0]
    keys = ("build_commit", "build_number", "cpu_info", "backends", "model_filename", "model_type", "model_size",
            "model_n_params", "n_threads", "n_batch", "n_ubatch", "type_k", "type_v", "flash_attn", "repack")
    return {k: first[k] for k in keys if k in first}


_SPEC_LINES = {
    "encoded": re.compile(r"encoded\s+(\d+)\s+tokens\s+in\s+([\d.]+)\s+seconds,\s+speed:\s+([\d.]+|inf|nan)\s+t/s"),
    "decoded": re.compile(r"decoded\s+(\d+)\s+tokens\s+in\s+([\d.]+)\s+seconds,\s+speed:\s+([\d.]+|inf|nan)\s+t/s"),
}


_SPEC_COUNTS = {key: re.compile(rf"(?<![\w.]){key}\s*=\s*(\d+)\s*$", re.MULTILINE)  # n_draft is not n_drafted
                for key in ("n_draft", "n_predict", "n_drafted", "n_accept")}


def parse_speculative(text: str) -> dict[str, Any]:
    """The summary llama-speculative-simple prints at its end (stderr; each line after a time stamp and a level,
    `0.15.327.381 I `, where stderr is not a terminal):

        encoded   24 tokens in    0.411 seconds, speed:   58.394 t/s
        decoded  130 tokens in    3.127 seconds, speed:   41.573 t/s
        n_draft   = 8
        n_predict = 130
        n_drafted = 152
        n_accept  = 95
        accept    = 62.500%

    new tokens over decode seconds (the prompt excluded); every verification commits its accepted draft tokens and
    one of its own, so target passes = n_predict - n_accept and mean accepted length = n_predict / passes."""
    found = {key: pattern.search(text) for key, pattern in _SPEC_LINES.items()}
    if found["decoded"] is None:
        raise ValueError("no 'decoded N tokens in S seconds' line in llama-speculative-simple's output")
    counts = {}
    for key, pattern in _SPEC_COUNTS.items():
        matches = pattern.findall(text)
        if not matches:
            raise ValueError(f"no '{key} = N' line in llama-speculative-simple's output")
        counts[key] = int(matches[-1])
    new_tokens, seconds = int(found["decoded"].group(1)), float(found["decoded"].group(2))
    if counts["n_predict"] != new_tokens:
        raise ValueError(f"decoded {new_tokens} tokens but n_predict = {counts['n_predict']}")
    if seconds <= 0 or new_tokens <= 0 or not 0 <= counts["n_accept"] <= min(counts["n_drafted"], new_tokens - 1):
        raise ValueError(f"inconsistent summary: {new_tokens} tokens in {seconds} s, "
                         f"n_drafted {counts['n_drafted']}, n_accept {counts['n_accept']}")
    passes = new_tokens - counts["n_accept"]
    out: dict[str, Any] = {"new_tokens": new_tokens, "decode_s": seconds, "tokens_per_s": new_tokens / seconds,
                           "draft_max": counts["n_draft"], "drafted": counts["n_drafted"],
                           "accepted": counts["n_accept"], "target_passes": passes,
                           "mean_accepted_length": new_tokens / passes,
                           "acceptance_rate": counts["n_accept"] / counts["n_drafted"] if counts["n_drafted"] else None}
    if found["encoded"] is not None:
        out["prompt_tokens"] = int(found["encoded"].group(1))
        out["prompt_s"] = float(found["encoded"].group(2))
    return out


def _run_tool(cmd: list[str], log: Path, timeout: float) -> tuple[str, str]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{Path(cmd[0]).name} ran past {timeout:.0f} s; see {log}") from None
    with open(log, "a") as f:
        f.write(result.stdout[-8000:] + result.stderr[-8000:])
    if result.returncode != 0:
        last = next((ln.strip() for ln in reversed(result.stderr.splitlines()) if ln.strip()), "")
        raise RuntimeError(f"{Path(cmd[0]).name} failed (exit {result.returncode}): {last[:200]}; see {log}")
    return result.stdout, result.stderr


def bench_command(model: Path, threads: int, repeats: int, prompt_sizes: tuple[int, ...] = PROMPT_SIZES,
                  gen_tokens: int = GEN_TOKENS, depth: int = 0) -> list[str]:
    """-p sizes -n tokens: a pp test per size (prompt_sizes (0,): none) and one tg test; -d: after that context."""
    return [str(tool("llama-bench")), "-m", str(model), "-p", ",".join(map(str, prompt_sizes)),
            "-n", str(gen_tokens), "-r", str(repeats), "-t", str(threads), "-o", "json"] + \
        (["-d", str(depth)] if depth else [])


def run_bench(model: Path, threads: int = 2, repeats: int = 3, log: Path | None = None, timeout: float = 3600,
              prompt_sizes: tuple[int, ...] = PROMPT_SIZES, gen_tokens: int = GEN_TOKENS,
              depth: int = 0) -> dict[str, Any]:
    """One llama-bench run on one GGUF file: {test name: tokens/s ...} plus what the run shared."""
    log = log or PEERS / "logs" / "llama-bench.log"
    cmd = bench_command(model, threads, repeats, prompt_sizes, gen_tokens, depth)
    start = time.perf_counter()
    stdout, _ = _run_tool(cmd, log, timeout)
    tests = parse_bench_json(stdout)
    return {"model": str(model), "file_bytes": model.stat().st_size, "command": cmd[1:],
            "seconds": round(time.perf_counter() - start, 1), "context": bench_context(stdout),
            "tests": {t["test"]: t for t in tests}}


def speculative_command(target: Path, draft: Path, prompt_file: Path, draft_max: int, threads: int,
                        max_new_tokens: int, ctx: int = 4096) -> list[str]:
    """Greedy (--temp 0), a fixed draft of `draft_max` tokens (--spec-draft-n-min 0, p-min 0: llama.cpp's defaults,
    written out), both models on `threads` threads."""
    return [str(tool("llama-speculative-simple")), "-m", str(target), "-md", str(draft), "-f", str(prompt_file),
            "-n", str(max_new_tokens), "-c", str(ctx), "-t", str(threads), "-td", str(threads), "--temp", "0",
            "--seed", "0", "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max),
            "--spec-draft-n-min", "0", "--spec-draft-p-min", "0"]


def run_speculative(target: Path, draft: Path, prompt_file: Path, draft_max: int, threads: int = 2,
                    max_new_tokens: int = 128, log: Path | None = None, timeout: float = 1800) -> dict[str, Any]:
    log = log or PEERS / "logs" / "llama-speculative.log"
    stdout, stderr = _run_tool(speculative_command(target, draft, prompt_file, draft_max, threads, max_new_tokens),
                               log, timeout)
    return parse_speculative(stderr)  # the generated text (stdout) could hold "n_accept = 3" itself


def bench_table(runs: list[dict[str, Any]]) -> str:
    """Markdown: one row per file, one column per test (mean tokens/s +- standard deviation)."""
    names = list(dict.fromkeys(name for run in runs for name in run.get("tests", {})))
    lines = ["| model | " + " | ".join(names) + " | note |", "|---|" + "---:|" * len(names) + "---|"]
    for run in runs:
        label = run.get("label") or Path(run["model"]).name
        tests = run.get("tests", {})
        cells = [f"{t['tokens_per_s']:.1f} ± {t['stddev_tokens_per_s']:.1f}" if (t := tests.get(n)) else "-"
                 for n in names]
        note = str(run.get("error") or run.get("note") or "").replace("|", "/")
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines)


def speculative(target: Path, draft: Path, prompt_file: Path, draft_maxes: list[int], threads: int,
                max_new_tokens: int, repeats: int, timeout: float = 1800) -> dict[str, Any]:
    """llama-speculative-simple at each draft length, `repeats` times, interleaved (repeat r runs every length);
    per length the median tokens/s and the acceptance of the first run (greedy: every run drafts the same)."""
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in draft_maxes}
    for repeat in range(repeats):
        for n in draft_maxes:
            runs[n].append(run_speculative(target, draft, prompt_file, n, threads, max_new_tokens, timeout=timeout))
            print(f"repeat {repeat + 1}/{repeats} draft-max {n}: {runs[n][-1]['tokens_per_s']:.2f} tokens/s",
                  flush=True)
    rows = []
    for n, per in runs.items():
        rates = [r["tokens_per_s"] for r in per]
        rows.append({"draft_max": n, "tokens_per_s": statistics.median(rates), "tokens_per_s_per_repeat": rates,
                     **{k: per[0][k] for k in ("new_tokens", "prompt_tokens", "drafted", "accepted", "target_passes",
                                                "mean_accepted_length", "acceptance_rate") if k in per[0]}})
    lines = ["| draft max | tokens/s | mean accepted length | acceptance | new tokens |", "|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row['draft_max']} | {row['tokens_per_s']:.2f} | {row['mean_accepted_length']:.2f} | "
                     f"{row['acceptance_rate'] or 0:.3f} | {row['new_tokens']} |")
    return {"target": str(target), "draft": str(draft), "prompt_file": str(prompt_file),
            "command": speculative_command(target, draft, prompt_file, draft_maxes[0], threads, max_new_tokens)[1:],
            "rows": rows, "table_markdown": "\n".join(lines)}


def bench_runs(files: dict[str, Path | None], threads: int, repeats: int, log: Path) -> list[dict[str, Any]]:
    """llama-bench (pp1 .. pp16, pp512, tg128) on each file; a file that is missing or fails is a row with a reason."""
    runs = []
    for label, path in files.items():
        if path is None or not Path(path).is_file():
            runs.append({"label": label, "model": str(path), "error": "no such file"})
            continue
        print(f"llama-bench {label} ({Path(path).name}) ...", flush=True)
        try:
            runs.append({"label": label, **run_bench(Path(path), threads, repeats, log)})
        except (RuntimeError, ValueError, OSError) as error:
            runs.append({"label": label, "model": str(path), "error": one_line(error)})
    return runs
