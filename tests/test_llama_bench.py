"""The parsers of llama.cpp's tools (draftwise/bench/peers/llama_tools.py), on sample output written here (nothing is
built, no model is loaded): llama-bench's JSON and llama-speculative-simple's summary."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftwise.bench.peers import llama_tools


def _entry(n_prompt: int, n_gen: int, avg_ts: float, stddev_ts: float, samples: list[float], depth: int = 0) -> str:
    samples_ns = ", ".join(str(round(1e9 * max(n_prompt, n_gen) / s)) for s in samples)
    return f"""  {{
    "build_commit": "abc1234",
    "build_number": 7001,
    "cpu_info": "AMD EPYC 9B45",
    "backends": "CPU",
    "model_filename": "/cache/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "model_type": "qwen2 1.5B Q4_K - Medium",
    "model_size": 1117320736,
    "model_n_params": 1543714304,
    "n_threads": 2,
    "repack": true,
    "n_prompt": {n_prompt},
    "n_gen": {n_gen},
    "n_depth": {depth},
    "test_time": "2026-11-27T20:00:00Z",
    "avg_ns": {round(1e9 * max(n_prompt, n_gen) / avg_ts)},
    "stddev_ns": 1000,
    "avg_ts": {avg_ts:.6f},
    "stddev_ts": {stddev_ts:.6f},
    "samples_ns": [ {samples_ns} ],
    "samples_ts": [ {", ".join(f"{s:.6f}" for s in samples)} ]
  }}"""


BENCH_STDOUT = "[\n" + ",\n".join([
    _entry(1, 0, 38.25, 0.4, [38.0, 38.1, 38.65]),
    _entry(16, 0, 146.5, 1.5, [145.0, 146.5, 148.0]),
    _entry(512, 0, 176.0, 2.0, [174.0, 176.0, 178.0]),
    _entry(0, 128, 37.9, 0.3, [37.6, 37.9, 38.2]),
]) + "\n]\n"

SPEC_SUMMARY = """\
llama_model_loader: loaded meta data with 34 key-value pairs and 338 tensors from qwen2.5-coder-1.5b.gguf
load_tensors:          CPU model buffer size =  1059.89 MiB
llama_context: n_ctx         = 4096
common_speculative_init: draft-simple: n_max = 8, n_min = 0, p_min = 0.00


encoded   24 tokens in    0.411 seconds, speed:   58.394 t/s
decoded  130 tokens in    3.127 seconds, speed:   41.573 t/s

n_draft   = 8
n_predict = 130
n_drafted = 152
n_accept  = 95
accept    = 62.500%

draft:

llama_perf_context_print:        load time =     180.20 ms
llama_perf_context_print:        eval time =    1310.44 ms /   150 runs   (    8.74 ms per token,   114.47 tokens per second)

target:

common_perf_print:    sampling time =      12.61 ms
common_perf_print:        load time =     402.30 ms
common_perf_print: prompt eval time =    2810.12 ms /   303 tokens (    9.27 ms per token,   107.82 tokens per second)
common_perf_print:        eval time =       0.00 ms /     1 runs   (    0.00 ms per token,      inf tokens per second)
common_perf_print:       total time =    3540.99 ms /   304 tokens
"""
# what it writes where stderr is not a terminal: a time stamp and a level before each line
SPEC_STDERR = "\n".join(f"0.15.{327 + i:03d}.{(17 * i) % 1000:03d} I {line}" for i, line in
                        enumerate(SPEC_SUMMARY.splitlines()))


def test_llama_bench_json_gives_tokens_per_second_per_test():
    text = "build: 7001 (abc1234) with cc\n" + BENCH_STDOUT  # a log line before the array is ignored
    tests = llama_tools.parse_bench_json(text)
    assert [t["test"] for t in tests] == ["pp1", "pp16", "pp512", "tg128"]
    by = {t["test"]: t for t in tests}
    assert by["pp512"]["tokens_per_s"] == pytest.approx(176.0)
    assert by["tg128"]["tokens_per_s"] == pytest.approx(37.9)
    assert by["tg128"]["stddev_tokens_per_s"] == pytest.approx(0.3)
    assert by["pp1"]["samples_tokens_per_s"] == pytest.approx([38.0, 38.1, 38.65])
    assert by["pp1"]["repetitions"] == 3
    assert (by["pp16"]["n_prompt"], by["pp16"]["n_gen"]) == (16, 0)
    assert by["tg128"]["ms_per_pass"] == pytest.approx(1e3 * 128 / 37.9, rel=1e-6)
    context = llama_tools.bench_context(text)
    assert context["build_number"] == 7001 and context["n_threads"] == 2 and context["repack"] is True


def test_llama_bench_test_names():
    assert llama_tools.bench_test_name(512, 0) == "pp512"
    assert llama_tools.bench_test_name(0, 128) == "tg128"
    assert llama_tools.bench_test_name(512, 128) == "pp512+tg128"
    assert llama_tools.bench_test_name(0, 128, 300) == "tg128 @ d300"
    text = "[\n" + _entry(0, 64, 30.0, 0.1, [30.0], depth=300) + "\n]"
    assert llama_tools.parse_bench_json(text)[0]["test"] == "tg64 @ d300"


@pytest.mark.parametrize("text", [
    "llama-bench: error: failed to load model\n",  # no array at all
    "[\n]\n",  # no tests
    BENCH_STDOUT.replace('"avg_ts"', '"avg_tps"'),  # a test without its rate
    BENCH_STDOUT.replace("176.000000", "0.000000", 1),  # a zero rate
])
def test_llama_bench_output_without_rates_is_an_error(text):
    with pytest.raises(ValueError):
        llama_tools.parse_bench_json(text)


@pytest.mark.parametrize("text", [SPEC_STDERR, SPEC_SUMMARY])
def test_speculative_summary(text):
    out = llama_tools.parse_speculative(text)
    assert out["new_tokens"] == 130 and out["decode_s"] == pytest.approx(3.127)
    assert out["tokens_per_s"] == pytest.approx(130 / 3.127)
    assert out["prompt_tokens"] == 24 and out["prompt_s"] == pytest.approx(0.411)
    assert (out["draft_max"], out["drafted"], out["accepted"]) == (8, 152, 95)  # n_draft is not n_drafted
    assert out["target_passes"] == 130 - 95
    assert out["mean_accepted_length"] == pytest.approx(130 / 35)
    assert out["acceptance_rate"] == pytest.approx(95 / 152)


@pytest.mark.parametrize("edit", [
    lambda t: t.replace("decoded  130 tokens", "decoded"),  # no decode line
    lambda t: t.replace("n_accept  = 95", "n_accepted = 95"),  # no n_accept line
    lambda t: t.replace("n_predict = 130", "n_predict = 129"),  # counts that disagree
    lambda t: t.replace("n_accept  = 95", "n_accept  = 130"),  # more accepted than drafted / than new tokens - 1
    lambda t: t.replace("n_draft   = 8", "n_draft_max = 8"),  # n_drafted alone is not n_draft
])
def test_speculative_summary_that_does_not_add_up_is_an_error(edit):
    with pytest.raises(ValueError):
        llama_tools.parse_speculative(edit(SPEC_STDERR))


def test_commands_and_table():
    cmd = llama_tools.bench_command(Path("m.gguf"), threads=2, repeats=3)
    assert cmd[0].endswith("llama-bench")
    args = dict(zip(cmd[1::2], cmd[2::2]))
    assert args == {"-m": "m.gguf", "-p": "1,2,4,8,16,512", "-n": "128", "-r": "3", "-t": "2", "-o": "json"}
    spec = llama_tools.speculative_command(Path("t.gguf"), Path("d.gguf"), Path("p.txt"), 8, 2, 128)
    assert spec[spec.index("-md") + 1] == "d.gguf" and spec[spec.index("--spec-draft-n-max") + 1] == "8"
    assert spec[spec.index("--temp") + 1] == "0" and spec[spec.index("-td") + 1] == "2"
    tests = {t["test"]: t for t in llama_tools.parse_bench_json(BENCH_STDOUT)}
    table = llama_tools.bench_table([{"label": "1.5B", "model": "m.gguf", "tests": tests},
                                     {"label": "0.5B", "model": "d.gguf", "error": "no such file"}])
    lines = table.splitlines()
    assert lines[0] == "| model | pp1 | pp16 | pp512 | tg128 | note |"
    assert lines[2].startswith("| 1.5B | 38.2 ± 0.4 | 146.5 ± 1.5 | 176.0 ± 2.0 | 37.9 ± 0.3 |")
    assert lines[3] == "| 0.5B | - | - | - | - | no such file |"


def test_setup_without_cmake_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(llama_tools, "TOOLS_DIR", tmp_path / "llama-tools")
    real_which = llama_tools.shutil.which
    monkeypatch.setattr(llama_tools.shutil, "which", lambda name: None if name == "cmake" else real_which(name))
    with pytest.raises(RuntimeError) as error:
        llama_tools.setup_tools(tmp_path / "build.log")
    assert "cmake" in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "llama-tools").exists()
