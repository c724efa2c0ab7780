"""`draftwise bench --batch-sizes`: metric arithmetic on hand-made stats, flag checks, and one
end-to-end run on tiny saved models (JSON fields, table, plot)."""

from __future__ import annotations

import json

import pytest

from draftwise.bench.batched import batched_report, parse_batch_sizes, percentile, summarize_runs
from draftwise.errors import DraftwiseError


def req(new, calls, fed, prompt, wall, ttft=0.1, ids=(), drafted=0, accepted=0):
    return {"new_tokens": new, "target_calls": calls, "target_tokens": fed, "prompt_tokens": prompt,
            "wall_time_s": wall, "time_to_first_token_s": ttft, "drafted": drafted, "accepted": accepted,
            "finish_reason": "length", "token_ids": list(ids)}


def test_parse_batch_sizes():
    assert parse_batch_sizes("1,4,16,32") == (1, 4, 16, 32)
    assert parse_batch_sizes(" 8 ") == (8,)
    for bad in ("0", "a", "", "1,,4", "1,-2", "4,4", "1.5"):
        with pytest.raises(DraftwiseError, match="--batch-sizes"):
            parse_batch_sizes(bad)


def test_percentile_interpolates_like_numpy():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(values, 99) == pytest.approx(4.96)
    assert percentile([7.0], 99) == 7.0


def test_summarize_runs_hand_computed():
    runs = [
        # repeat 0: 40 new tokens in 2 s -> 20 tok/s; latencies 1, 2
        {"wall_time_s": 2.0, "requests": [
            req(10, 4, fed=9 + 12, prompt=10, wall=1.0, ttft=0.2, drafted=12, accepted=6),
            req(30, 10, fed=4 + 35, prompt=5, wall=2.0, ttft=0.4, drafted=30, accepted=20)]},
        # repeat 1: 40 new tokens in 4 s -> 10 tok/s; latencies 3, 4
        {"wall_time_s": 4.0, "energy_j": 8.0, "requests": [
            req(10, 4, fed=9 + 12, prompt=10, wall=3.0, ttft=0.6, drafted=12, accepted=6),
            req(30, 10, fed=4 + 35, prompt=5, wall=4.0, ttft=0.8, drafted=30, accepted=20)]},
    ]
    m = summarize_runs(runs)
    assert m["throughput_tok_s_per_repeat"] == [20.0, 10.0]
    assert m["throughput_tok_s"] == 15.0  # median of two
    assert m["latency_p50_s"] == pytest.approx((1.5 + 3.5) / 2)  # median over repeats of each repeat's p50
    assert m["latency_p90_s"] == pytest.approx((1.9 + 3.9) / 2)
    assert m["latency_p99_s"] == pytest.approx((1.99 + 3.99) / 2)
    assert m["ttft_p50_s"] == pytest.approx((0.3 + 0.7) / 2)
    # TPOT: (wall - ttft) / (new - 1) ms: repeat 0 800/9 and 1600/29, repeat 1 2400/9 and 3200/29
    assert m["tpot_p50_ms"] == pytest.approx(((800 / 9 + 1600 / 29) / 2 + (2400 / 9 + 3200 / 29) / 2) / 2)
    assert m["mean_accepted_length"] == pytest.approx(80 / 28)
    # decode-phase tokens: fed - (prompt - 1) = 12 and 35 per request -> 94 over 80 committed
    assert m["verified_per_committed"] == pytest.approx(94 / 80)
    assert m["acceptance_rate"] == pytest.approx(52 / 84)
    assert m["requests"] == 2 and m["finish_reasons"] == {"length": 4}
    assert m["energy_j_per_token"] == pytest.approx(8.0 / 40)


def test_ar_verifies_one_token_per_committed_token():
    # ar: prefill feeds prompt[:-1], then one token per step: prompt - 1 + new tokens fed in all
    m = summarize_runs([{"wall_time_s": 1.0, "requests": [req(8, 8, fed=6 + 8, prompt=7, wall=1.0)]}])
    assert m["mean_accepted_length"] == 1.0 and m["verified_per_committed"] == 1.0
    assert m["acceptance_rate"] is None
    assert m["tpot_p50_ms"] == pytest.approx((1.0 - 0.1) / 7 * 1e3)


def test_tpot_skips_one_token_answers():
    one = {"wall_time_s": 1.0, "requests": [req(1, 1, fed=7, prompt=7, wall=1.0)]}
    assert summarize_runs([one])["tpot_p50_ms"] is None
    both = {"wall_time_s": 1.0, "requests": [req(1, 1, fed=7, prompt=7, wall=1.0), req(3, 3, 9, 7, wall=0.5)]}
    assert summarize_runs([both])["tpot_p50_ms"] == pytest.approx(200.0)


def test_batched_report_speed_ratios_and_identity():
    def run(wall, ids):
        return [{"wall_time_s": wall, "requests": [req(10, 10, 19, 10, wall, ids=ids[0]),
                                                   req(10, 5, 19, 10, wall, ids=ids[1])]}]

    runs = {("ar", 1): run(4.0, ([1], [2])), ("ar", 4): run(1.0, ([1], [2])),
            ("sd", 1): run(2.0, ([1], [2])), ("sd", 4): run(0.8, ([1], [3]))}
    out = batched_report(runs, ("ar", "sd"), (1, 4), compare_identical=True)
    assert out["batch_sizes"] == [1, 4] and out["reference"] == "ar"
    ar, sd = out["methods"]["ar"], out["methods"]["sd"]
    assert ar["1"]["throughput_tok_s"] == 5.0 and ar["4"]["throughput_tok_s"] == 20.0
    assert ar["1"]["speedup_vs_ar"] == 1.0 and ar["4"]["speedup_vs_ar_b1"] == 4.0
    assert sd["1"]["speedup_vs_ar"] == 2.0 and sd["1"]["speedup_vs_ar_b1"] == 2.0
    assert sd["4"]["speedup_vs_ar"] == pytest.approx(25.0 / 20.0) and sd["4"]["speedup_vs_ar_b1"] == 5.0
    assert sd["4"]["identical_to_ar_b1"] == 0.5 and ar["4"]["identical_to_ar_b1"] == 1.0
    # without ar (or without batch 1) there is nothing to compare against
    alone = batched_report({k: v for k, v in runs.items() if k[0] == "sd"}, ("sd",), (1, 4))
    assert alone["reference"] is None and alone["methods"]["sd"]["4"]["speedup_vs_ar"] is None
    no_b1 = batched_report({k: v for k, v in runs.items() if k[1] == 4}, ("ar", "sd"), (4,))
    assert no_b1["methods"]["sd"]["4"]["speedup_vs_ar"] == pytest.approx(1.25)
    assert no_b1["methods"]["sd"]["4"]["speedup_vs_ar_b1"] is None


@pytest.mark.parametrize("value", ["0", "a", "", "2,0"])
def test_cli_rejects_bad_batch_sizes_in_one_line(value, capsys):
    from draftwise.cli import main

    assert main(["bench", "--target", "/nonexistent", "--methods", "ar", "--batch-sizes", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftwise: error: --batch-sizes") and err.count("\n") == 1, err


def test_cli_refuses_methods_the_engine_does_not_batch(capsys):
    from draftwise.cli import main

    for methods, expected in (("ar,hf-assisted", "hf-assisted"),):  # every draftwise method batches
        assert main(["bench", "--target", "/nonexistent", "--methods", methods, "--batch-sizes", "1,2"]) == 2
        err = capsys.readouterr().err
        assert "--batch-sizes" in err and expected in err and err.count("\n") == 1, err


def test_batched_bench_end_to_end_on_tiny_models(tmp_path, capsys):
    from conftest import save_pair

    from draftwise.cli import main

    target, draft = save_pair(tmp_path, window=2048)
    out, png = tmp_path / "res" / "batched.json", tmp_path / "res" / "batched.png"
    assert main(["bench", "--target", target, "--draft", draft, "--methods", "ar,sd,prompt-lookup",
                 "--batch-sizes", "1,3", "--num-prompts", "3", "--max-new-tokens", "6", "--repeats", "2",
                 "--temperature", "0", "--dtype", "fp32", "--threads", "1", "--json", str(out),
                 "--plot", str(png)]) == 0
    printed = capsys.readouterr().out
    assert "vs ar@1" in printed and "verified/tok" in printed
    assert png.stat().st_size > 0 and not list(png.parent.glob(".*"))  # no temporary file left behind
    results = json.loads(out.read_text())
    assert set(results) == {"config", "machine", "energy", "batched"}
    assert results["config"]["batch_sizes"] == [1, 3]
    batched = results["batched"]
    assert batched["batch_sizes"] == [1, 3] and set(batched["methods"]) == {"ar", "sd", "prompt-lookup"}
    for label, by_b in batched["methods"].items():
        assert set(by_b) == {"1", "3"}
        for b, m in by_b.items():
            assert m["throughput_tok_s"] > 0 and len(m["throughput_tok_s_per_repeat"]) == 2
            assert 0 < m["latency_p50_s"] <= m["latency_p90_s"] <= m["latency_p99_s"]
            assert m["speedup_vs_ar"] is not None and m["speedup_vs_ar_b1"] is not None
            assert m["requests"] == 3 and len(m["per_request"]) == 3
            assert m["mean_accepted_length"] >= 1.0 and m["verified_per_committed"] >= 1.0
            # the reported figures follow from the per-request stats
            reqs = m["per_request"]
            assert m["new_tokens"] == 2 * sum(r["new_tokens"] for r in reqs)  # same tokens both repeats (T=0)
            assert m["identical_to_ar_b1"] == 1.0, (label, b)  # fp32, T=0: exact and batch-invariant
    ar = batched["methods"]["ar"]
    assert ar["1"]["speedup_vs_ar"] == 1.0 and ar["1"]["mean_accepted_length"] == 1.0
    assert ar["1"]["verified_per_committed"] == 1.0
