"""Issue 12, "a newcomer's first hour": one test (or more) per finding, on tiny models.

The registry's default names (`smollm2-135m`, `-eagle`, `-draft`) are pointed at tiny models
(`newcomer_models`), so the defaults a newcomer meets are exercised without the real weights.
"""

from __future__ import annotations

import inspect
import json
import os
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import draftwise
from conftest import tiny_llama, tiny_tokenizer
from draftwise import DraftwiseError
from draftwise.errors import DraftwiseWarning
from draftwise.cli import main
from newcomer_models import DRAFT, EAGLE, TARGET, build, register

GREEDY = dict(temperature=0, max_new_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("newcomer")
    build(root)
    return root


@pytest.fixture
def dirs(root, monkeypatch):
    return register(root, monkeypatch.setitem)


@pytest.fixture(scope="module")
def chat_target(root):
    return draftwise.load_model(str(root / "target"))


def _run(capsys, argv):
    code = main(argv)
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_line_error(code, out, err, pattern, *, after_progress=False):
    assert code == 2, err
    if after_progress:  # a progress bar ran first: the error is the last line
        err = err.rsplit("\n", 2)[-2] + "\n"
    assert err.startswith("draftwise: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert pattern in err, err


# ------------------------------------------------- 1. the shipped EAGLE draft through the CLI

def test_cli_takes_an_eagle_head_as_draft(capsys, dirs):
    argv = ["generate", "--target", dirs["target"], "--draft", dirs["eagle"], "--method", "sd", "--json", "-",
            "--temperature", "0", "--max-new-tokens", "6", "--ignore-eos", "--no-chat", "the cat"]
    code, out, err = _run(capsys, argv)
    assert code == 0, err
    got = json.loads(out)
    api = draftwise.generate(dirs["target"], "the cat", draft=dirs["eagle"], method="sd", **GREEDY)
    ar = draftwise.generate(dirs["target"], "the cat", method="ar", **GREEDY)
    assert got["token_ids"] == api.token_ids == ar.token_ids  # exact at temperature 0
    assert got["stats"]["draft_calls"] > 0


def test_registry_eagle_name_through_the_cli(capsys, dirs):
    code, out, err = _run(capsys, ["generate", "--target", TARGET, "--draft", EAGLE, "--method", "sd",
                                   "--temperature", "0", "--max-new-tokens", "4", "the cat"])
    assert code == 0, err


def test_load_model_on_an_eagle_head_says_what_it_is(dirs):
    for spec in (EAGLE, dirs["eagle"]):
        with pytest.raises(DraftwiseError, match="EAGLE draft head, not a model.*draft="):
            draftwise.load_model(spec)
    head = draftwise.heads.loading.load_draft(EAGLE, draftwise.load_model(TARGET))
    assert type(head).__name__ == "EagleHead"


# ------------------------------------------------- 2. the default call works

def test_default_method_uses_the_registry_draft(dirs):
    ar = draftwise.generate(TARGET, "the cat", method="ar", **GREEDY)
    default = draftwise.generate(TARGET, "the cat", **GREEDY)  # method="sd", no draft
    assert default.stats["method"] == "sd" and default.stats["draft_calls"] > 0
    assert default.token_ids == ar.token_ids
    loaded = draftwise.load_model(TARGET)  # a target loaded by registry name keeps its defaults
    assert draftwise.generate(loaded, "the cat", **GREEDY).token_ids == ar.token_ids


def test_default_draft_depends_on_the_method(dirs):
    from draftwise.plan import default_draft

    assert default_draft(TARGET, "sd") == EAGLE
    assert default_draft(TARGET, "mtad") == EAGLE  # beam search runs on the head too
    assert default_draft(TARGET, "sprinter") == DRAFT  # a verifier reads a draft model's states: the independent draft
    assert default_draft(dirs["target"], "sd") is None  # not a registry target
    g = draftwise.generate(TARGET, "the cat", method="mtad", **GREEDY)
    assert g.stats["draft_calls"] > 0


def test_a_head_trained_on_sampled_answers_drafts_at_temperature_above_0(dirs, monkeypatch):
    from draftwise.models import registry
    from draftwise.plan import default_draft

    sampled = EAGLE + "-t1"
    state = {"now": "not trained yet"}
    monkeypatch.setitem(registry._ENTRIES, sampled, registry.RegistryEntry(
        name=sampled, role="eagle", description="tiny head for T > 0", resolve=lambda: Path(dirs["eagle"]),
        cached=lambda: state["now"]))
    monkeypatch.setitem(registry._SAMPLED_HEADS, TARGET, sampled)
    assert default_draft(TARGET, "sd", 1.0) == EAGLE  # not ready: the greedy head
    state["now"] = "ready"
    assert default_draft(TARGET, "sd", 1.0) == sampled and default_draft(TARGET, "mtad", 0.7) == sampled
    assert default_draft(TARGET, "sd", 0.0) == EAGLE and default_draft(TARGET, "sd") == EAGLE
    assert default_draft(TARGET, "sprinter", 1.0) == DRAFT  # no head for methods that need a draft model
    g = draftwise.generate(TARGET, "the cat", method="sd", temperature=1.0, seed=0, max_new_tokens=8)
    assert g.stats["draft_calls"] > 0


def test_default_cli_call_works(capsys, dirs):
    code, out, err = _run(capsys, ["generate", "--temperature", "0", "--max-new-tokens", "4", "Hello"])
    assert code == 0, err
    assert out.endswith("\n")


def test_a_target_without_a_draft_falls_back_to_suffix_unless_sd_is_asked_for(dirs):
    """No method asked for and no draft anywhere (a user's own model): `suffix`, which needs none, with one warning
    line saying so; its greedy tokens are ar's. Asking for `sd` by name still names the way out."""
    with pytest.warns(DraftwiseWarning, match=r"no draft model for this target: decoding with 'suffix'"):
        out = draftwise.generate(dirs["target"], "the cat", max_new_tokens=8, ignore_eos=True)
    ar = draftwise.generate(dirs["target"], "the cat", method="ar", max_new_tokens=8, ignore_eos=True)
    assert out.token_ids == ar.token_ids
    with pytest.raises(DraftwiseError, match=r"'sd' needs a draft model.*'ar' or 'prompt-lookup'"):
        draftwise.generate(dirs["target"], "the cat", method="sd")


# ------------------------------------------------- 3. chat by default (CLI), messages (API), the demo

def _chat_ids(tokenizer, text, system=None):
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def test_cli_applies_the_chat_template_by_default(capsys, dirs, chat_target):
    tok = chat_target.tokenizer  # the saved one (BPE training is not deterministic: never retrain to compare)
    base = ["generate", "--target", dirs["target"], "--method", "ar", "--json", "-", "--temperature", "0",
            "--max-new-tokens", "4"]
    code, out, err = _run(capsys, base + ["the cat"])
    assert code == 0, err
    chat = json.loads(out)
    expected = draftwise.generate(dirs["target"], _chat_ids(tok, "the cat"), method="ar", temperature=0,
                                  max_new_tokens=4)
    assert chat["stats"]["prompt_tokens"] == len(_chat_ids(tok, "the cat"))
    assert chat["token_ids"] == expected.token_ids
    for flag in ("--no-chat", "--raw"):
        code, out, err = _run(capsys, base + [flag, "the cat"])
        assert code == 0, err
        raw_len = len(tok("the cat")["input_ids"])
        assert json.loads(out)["stats"]["prompt_tokens"] == raw_len != len(_chat_ids(tok, "the cat"))
    code, out, err = _run(capsys, base + ["--system", "be brief", "the cat"])
    assert code == 0, err
    assert json.loads(out)["stats"]["prompt_tokens"] == len(_chat_ids(tok, "the cat", system="be brief"))


def test_cli_system_needs_chat(capsys, dirs):
    code, out, err = _run(capsys, ["generate", "--target", dirs["target"], "--method", "ar", "--no-chat",
                                   "--system", "x", "the cat"])
    _one_line_error(code, out, err, "--system and --no-chat")


def test_api_accepts_openai_messages(chat_target):
    messages = [{"role": "user", "content": "the cat"}]
    by_ids = draftwise.generate(chat_target, _chat_ids(chat_target.tokenizer, "the cat"), method="ar", **GREEDY)
    assert draftwise.generate(chat_target, messages, method="ar", **GREEDY).token_ids == by_ids.token_ids
    assert draftwise.generate(chat_target, None, messages=messages, method="ar", **GREEDY).token_ids == by_ids.token_ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "the cat"}]}]
    assert draftwise.generate(chat_target, parts, method="ar", **GREEDY).token_ids == by_ids.token_ids
    streamed = "".join(draftwise.stream(chat_target, messages, method="ar", **GREEDY))
    assert streamed == by_ids.text


def test_api_messages_keyword_alone(chat_target):
    messages = [{"role": "user", "content": "the cat"}]
    by_ids = draftwise.generate(chat_target, _chat_ids(chat_target.tokenizer, "the cat"), method="ar", **GREEDY)
    assert draftwise.generate(chat_target, messages=messages, method="ar", **GREEDY).token_ids == by_ids.token_ids


@pytest.mark.parametrize("messages, pattern", [
    ([{"content": "x"}], "needs a 'role'"),
    ([{"role": "user", "content": 3}], "content must be a string"),
])
def test_bad_messages_fail_clearly(chat_target, messages, pattern):
    with pytest.raises(DraftwiseError, match=pattern):
        draftwise.generate(chat_target, messages, method="ar", **GREEDY)


def test_messages_without_a_chat_template_fail_clearly():
    target = draftwise.load_model(tiny_llama(0), tokenizer=tiny_tokenizer())
    with pytest.raises(DraftwiseError, match="no chat template"):
        draftwise.generate(target, [{"role": "user", "content": "hi"}], method="ar", **GREEDY)


def test_demo_sample_is_a_chat_question():
    from draftwise import demo

    assert demo.SAMPLE_CHAT[-1]["role"] == "user" and demo.SAMPLE_CHAT[-1]["content"].endswith("?")
    assert "tokenize=False" not in inspect.getsource(demo)  # messages go through the API, not a formatted string


@pytest.mark.slow
def test_demo_sample_answers_on_the_real_model():
    from draftwise import demo

    g = draftwise.generate(demo.TARGET, demo.SAMPLE_CHAT, method="ar", temperature=0, max_new_tokens=48)
    assert "def " in g.text and "palindrome" in g.text  # the demo asks the pair a coding question


# ------------------------------------------------- 4. the usual chat-template idiom and other id containers

def test_batch_encoding_tensors_and_arrays_are_accepted(chat_target):
    tok = chat_target.tokenizer
    encoded = tok.apply_chat_template([{"role": "user", "content": "the cat"}], add_generation_prompt=True)
    assert type(encoded).__name__ == "BatchEncoding"
    ids = list(encoded["input_ids"])
    expected = draftwise.generate(chat_target, ids, method="ar", **GREEDY).token_ids
    for prompt in (encoded, torch.tensor(ids), torch.tensor([ids]), torch.tensor(ids, dtype=torch.int32),
                   np.array(ids), np.array([ids], dtype=np.int32)):
        assert draftwise.generate(chat_target, prompt, method="ar", **GREEDY).token_ids == expected
    pt = tok("the cat", return_tensors="pt")  # [1, n] input_ids + attention_mask
    assert draftwise.generate(chat_target, pt, method="ar", **GREEDY).token_ids == draftwise.generate(
        chat_target, "the cat", method="ar", **GREEDY).token_ids


@pytest.mark.parametrize("prompt, pattern", [
    (None, "no prompt: give a string"),
    (3.5, "got float"),
    ({"text": "hi"}, r"got dict with keys \['text'\]"),
    ([1.5, 2.0], "got list of 2 float"),
    (torch.tensor([1.0, 2.0]), "got Tensor of shape"),
    ([[1, 2], None], "got list of 2 NoneType/list"),
])
def test_unsupported_prompts_name_what_was_passed(chat_target, prompt, pattern):
    with pytest.raises(DraftwiseError, match=pattern):
        draftwise.generate(chat_target, prompt, method="ar", **GREEDY)


def test_split_prompts_tells_one_prompt_from_a_batch():
    from draftwise.prompts import split_prompts

    chat = [{"role": "user", "content": "x"}]
    assert split_prompts("hi") == (["hi"], False)
    assert split_prompts(chat) == ([chat], False)
    assert split_prompts([1, 2]) == ([[1, 2]], False)
    assert split_prompts(["a", "b"]) == (["a", "b"], True)
    assert split_prompts([chat, chat]) == ([chat, chat], True)
    assert split_prompts(torch.tensor([[1, 2], [3, 4]])) == ([[1, 2], [3, 4]], True)
    with pytest.raises(DraftwiseError, match="no prompt"):
        split_prompts(None)


# ------------------------------------------------- 5. bench: a helper per method, every method checked first

def test_bench_resolves_the_draft_per_method(dirs):
    from draftwise.bench.harness import BenchConfig, plan_drafts, run_bench

    config = BenchConfig(target=TARGET, methods=("ar", "sd", "mtad", "draft-only"), num_prompts=1,
                         max_new_tokens=4, repeats=1, warmup=0, dtype="fp32", categories=("qa",))
    assert plan_drafts(config) == {"ar": None, "sd": EAGLE, "mtad": EAGLE, "draft-only": DRAFT}
    results = run_bench(config)
    assert results["config"]["drafts"]["mtad"] == EAGLE
    assert set(results["methods"]) == {"ar", "sd", "mtad", "draft-only"}


def test_bench_checks_every_method_before_any_model_loads(dirs, monkeypatch):
    from draftwise.bench import harness

    def no_loading(*args, **kwargs):
        raise AssertionError("a model loaded before every method was checked")

    monkeypatch.setattr(harness, "load_model", no_loading)
    monkeypatch.setattr(harness, "load_draft", no_loading)
    cases = [
        (dict(methods=("ar", "sd", "sprinter")), "method sprinter: sprinter needs verifier=PATH"),
        (dict(methods=("ar", "lossy-greedy"), temperature=1.0), "method lossy-greedy:"),
        (dict(methods=("ar", "seq-cascade"), draft=EAGLE), "method seq-cascade: an EAGLE draft head"),
        (dict(methods=("ar", "draft-only"), draft=EAGLE), "method draft-only: smollm2-135m-eagle is an EAGLE"),
    ]
    for kwargs, message in cases:
        with pytest.raises(DraftwiseError, match=message):
            harness.run_bench(harness.BenchConfig(target=TARGET, num_prompts=1, max_new_tokens=2, **kwargs))


def test_bench_cli_names_the_failing_method_before_loading(capsys, dirs, monkeypatch):
    from draftwise.bench import harness

    monkeypatch.setattr(harness, "load_model", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    code, out, err = _run(capsys, ["bench", "--target", TARGET, "--methods", "ar,sd,mtad,sprinter,cascade",
                                   "--num-prompts", "1"])
    _one_line_error(code, out, err, "method sprinter: sprinter needs verifier=PATH")


def test_bench_keeps_output_texts_on_request(dirs, chat_target):
    from draftwise.bench.harness import BenchConfig, run_bench

    config = BenchConfig(target=TARGET, methods=("ar", "prompt-lookup"), num_prompts=2, max_new_tokens=4,
                         repeats=1, warmup=0, dtype="fp32", categories=("qa",), save_outputs=True)
    results = run_bench(config)
    outputs = results["outputs"]
    assert set(outputs) == {"ar", "prompt-lookup"} and len(outputs["ar"]) == 2
    first = outputs["ar"][0]
    assert first["text"] == chat_target.tokenizer.decode(first["token_ids"], skip_special_tokens=True)
    assert "outputs" not in run_bench(BenchConfig(**{**config.__dict__, "save_outputs": False}))


# ------------------------------------------------- 6. one-line errors instead of tracebacks

def test_truncated_safetensors_is_a_clear_error(tmp_path, capsys):
    from conftest import save_pair

    target, _ = save_pair(tmp_path)
    weights = tmp_path / "target" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(DraftwiseError, match="cannot load the model.*is the file complete"):
        draftwise.load_model(target)
    code, out, err = _run(capsys, ["generate", "--target", target, "--method", "ar", "the cat"])
    _one_line_error(code, out, err, "cannot load the model")


def test_a_gguf_name_on_another_file_is_a_clear_error(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"PK\x03\x04 not a gguf file")
    with pytest.raises(DraftwiseError, match="is not a GGUF file"):
        draftwise.load_model(str(fake))


def test_generate_none_is_a_clear_error(chat_target):
    with pytest.raises(DraftwiseError, match="no prompt"):
        draftwise.generate(chat_target, None, method="ar")


@pytest.mark.parametrize("name", ["x.png", "x.json"])
def test_bench_output_paths_are_checked_before_any_work(capsys, dirs, tmp_path, monkeypatch, name):
    from draftwise.bench import harness

    monkeypatch.setattr(harness, "run_bench", lambda *a, **k: pytest.fail("the benchmark ran"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    flag = "--plot" if name.endswith(".png") else "--json"
    code, out, err = _run(capsys, ["bench", "--target", TARGET, "--methods", "ar", "--num-prompts", "1",
                                   flag, str(blocker / name)])
    _one_line_error(code, out, err, f"{flag} {blocker / name}: cannot create the folder")


def test_bench_plot_type_is_checked_before_any_work(capsys, dirs, tmp_path, monkeypatch):
    from draftwise.bench import harness

    monkeypatch.setattr(harness, "run_bench", lambda *a, **k: pytest.fail("the benchmark ran"))
    code, out, err = _run(capsys, ["bench", "--target", TARGET, "--methods", "ar", "--plot", str(tmp_path / "x.pnk")])
    _one_line_error(code, out, err, "unknown image type '.pnk'")


def test_bench_writes_results_before_plotting_and_creates_folders_alike(capsys, dirs, tmp_path, monkeypatch):
    from draftwise.bench import report

    def broken_plot(results, path):
        raise RuntimeError("no display")

    monkeypatch.setattr(report, "plot", broken_plot)
    out_json, out_png = tmp_path / "new" / "r.json", tmp_path / "other" / "r.png"
    code, out, err = _run(capsys, ["bench", "--target", TARGET, "--methods", "ar", "--num-prompts", "1",
                                   "--max-new-tokens", "2", "--repeats", "1", "--warmup", "0", "--categories", "qa",
                                   "--json", str(out_json), "--plot", str(out_png)])
    _one_line_error(code, out, err, f"the results are in {out_json}", after_progress=True)
    assert json.loads(out_json.read_text())["methods"]["ar"]["new_tokens"] > 0
    assert out_png.parent.is_dir()  # --plot's folder was created like --json's
    mode = stat.S_IMODE(out_json.stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask, oct(mode)


def test_written_json_has_the_normal_mode(tmp_path):
    from draftwise.bench.report import write_json

    write_json({"a": 1}, tmp_path / "x.json")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / "x.json").stat().st_mode) == 0o666 & ~umask


# ------------------------------------------------- 7. silent surprises

def test_a_budget_cut_by_the_context_window_warns(chat_target):
    model = draftwise.load_model(tiny_llama(0, window=16), tokenizer=tiny_tokenizer())
    with pytest.warns(draftwise.errors.DraftwiseWarning, match="at most 3 new tokens fit, not 10"):
        g = draftwise.generate(model, list(range(1, 14)), method="ar", max_new_tokens=10, ignore_eos=True)
    assert len(g.token_ids) == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning where the budget fits
        draftwise.generate(model, list(range(1, 4)), method="ar", max_new_tokens=4, temperature=0)


def test_a_budget_cut_by_the_context_window_has_its_own_finish_reason():
    model = draftwise.load_model(tiny_llama(0, window=16), tokenizer=tiny_tokenizer())
    with pytest.warns(draftwise.errors.DraftwiseWarning):
        g = draftwise.generate(model, list(range(1, 14)), method="ar", max_new_tokens=10, ignore_eos=True)
    assert g.stats["finish_reason"] == "context"
    full = draftwise.generate(model, list(range(1, 4)), method="ar", max_new_tokens=4, ignore_eos=True)
    assert full.stats["finish_reason"] == "length"


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(tmp_path, chat_target, root):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=64, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet()[40:80], show_progress=False)
    tok.train_from_iterator(["zebras quietly jump over lazy foxes"] * 8, trainer)
    other = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    assert len(other) == len(chat_target.tokenizer)
    draft = draftwise.load_model(tiny_llama(1, layers=1), tokenizer=other)
    with pytest.raises(DraftwiseError, match="draft's tokenizer differs from the target's"):
        draftwise.generate(chat_target, "the cat", draft=draft, method="sd", **GREEDY)
    same = draftwise.load_model(tiny_llama(1, layers=1), tokenizer=str(root / "target"))
    draftwise.generate(chat_target, "the cat", draft=same, method="sd", **GREEDY)  # a copy of the same tokenizer


@pytest.mark.parametrize("objective, method, option", [("sprinter", "specdec++", "head"),
                                                       ("acceptance", "sprinter", "verifier")])
def test_a_head_trained_for_the_other_method_is_refused(tmp_path, chat_target, objective, method, option):
    from draftwise.heads.sprinter import Verifier, VerifierSpec, draft_fingerprint

    draft = draftwise.load_model(tiny_llama(1, layers=1))
    spec = VerifierSpec(features=("stats",), input_size=3, draft_fingerprint=draft_fingerprint(draft.model),
                        temperature=0.0, extra={"objective": objective})
    path = tmp_path / "head.pt"
    Verifier(spec).save(path)
    with pytest.raises(DraftwiseError, match=f"trained with the '{objective}' objective.*--objective"):
        draftwise.generate(chat_target, "the cat", draft=draft, method=method, **{option: str(path)}, **GREEDY)


def test_bench_says_when_fewer_prompts_exist(capsys, dirs, monkeypatch):
    from draftwise.bench import harness

    def stop(*args, **kwargs):
        raise DraftwiseError("stopped here")

    monkeypatch.setattr(harness, "run_bench", stop)
    code, out, err = _run(capsys, ["bench", "--target", TARGET, "--methods", "ar", "--num-prompts", "1000"])
    assert code == 2
    assert "draftwise: warning: --num-prompts 1000: spec-bench has only 96 evaluation prompts; running 96" in err


# ------------------------------------------------- minor: what users of transformers / vLLM expect

def test_version_flag(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"draftwise {draftwise.__version__}"


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: 128)" in text and "(default: 1.0)" in text and f"(default: {TARGET})" in text
    assert "(default: None)" not in text


def test_generate_threads_and_tokenizer_flags(capsys, tmp_path, monkeypatch):
    tiny_llama(0).save_pretrained(tmp_path / "bare")  # weights without a tokenizer
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(n))
    calls: list[int] = []
    code, out, err = _run(capsys, ["generate", "--target", str(tmp_path / "bare"), "--tokenizer", str(tmp_path / "tok"),
                                   "--threads", "1", "--method", "ar", "--temperature", "0", "--max-new-tokens", "3",
                                   "the cat"])
    assert code == 0, err
    assert calls == [1]


def test_a_draft_given_to_ar_is_ignored_with_a_warning(capsys, chat_target, dirs):
    draft = tiny_llama(1, layers=1)
    with pytest.warns(draftwise.errors.DraftwiseWarning, match="'ar' uses no draft model"):
        g = draftwise.generate(chat_target, "the cat", draft=draft, method="ar", **GREEDY)
    assert g.token_ids == draftwise.generate(chat_target, "the cat", method="ar", **GREEDY).token_ids
    code, out, err = _run(capsys, ["generate", "--target", dirs["target"], "--draft", dirs["draft"], "--method", "ar",
                                   "--temperature", "0", "--max-new-tokens", "3", "the cat"])
    assert code == 0
    assert err == "draftwise: warning: method 'ar' uses no draft model: the draft given is ignored\n"


def test_load_model_is_quiet(capfd, dirs):
    capfd.readouterr()
    draftwise.load_model(DRAFT)
    assert "Loading weights" not in capfd.readouterr().err
    draftwise.load_model(DRAFT, progress=True)
    assert "Loading weights" in capfd.readouterr().err


def test_a_gguf_path_is_converted_once(tmp_path, monkeypatch, dirs):
    from draftwise.models import registry

    monkeypatch.setenv("DRAFTWISE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + bytes(16))  # version 3, no tensors, no metadata
    calls = []

    def fake_convert(path, out, *, expected_sha256):
        calls.append(path)
        tiny_llama(0).save_pretrained(out)
        tiny_tokenizer().save_pretrained(out)

    monkeypatch.setattr(registry, "convert_gguf", fake_convert)
    first = draftwise.load_model(str(gguf), dtype="dequantize")  # the fake file has no tensors to keep quantised
    second = draftwise.load_model(str(gguf), dtype="dequantize")
    assert len(calls) == 1 and first.name == second.name == "m"
    assert first.tokenizer is not None


# ------------------------------------------------- the CLI takes several prompts

def test_cli_several_prompts_and_a_prompts_file(capsys, dirs, tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("the dog\n\nthe log\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a small"}) + "\n" + json.dumps({"turns": ["once upon", "x"]}) + "\n"
                     + json.dumps({"messages": [{"role": "user", "content": "the mat"}]}) + "\n")
    base = ["generate", "--target", dirs["target"], "--method", "ar", "--temperature", "0", "--max-new-tokens", "3",
            "--json", "--max-batch-size", "2"]
    code, out, err = _run(capsys, base + ["the cat", "--prompts-file", str(lines)])
    assert code == 0, err
    results = json.loads(out)
    assert len(results) == 3
    for result, text in zip(results, ["the cat", "the dog", "the log"]):
        single = draftwise.generate(dirs["target"], [{"role": "user", "content": text}], method="ar", temperature=0,
                                    max_new_tokens=3)
        assert result["token_ids"] == single.token_ids
    code, out, err = _run(capsys, base + ["--prompts-file", str(jsonl)])
    assert code == 0, err
    assert len(json.loads(out)) == 3


@pytest.mark.parametrize("content, message", [
    ("{not json\n", "line 1: not JSON"),
    (json.dumps({"text": "x"}) + "\n", "needs a 'prompt' string"),
])
def test_bad_prompts_file_is_a_clear_error(capsys, dirs, tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    code, out, err = _run(capsys, ["generate", "--target", dirs["target"], "--method", "ar", "--prompts-file",
                                   str(path)])
    _one_line_error(code, out, err, message)


def test_cli_without_any_prompt_is_a_clear_error(capsys, dirs):
    code, out, err = _run(capsys, ["generate", "--target", dirs["target"], "--method", "ar"])
    _one_line_error(code, out, err, "no prompt")




def test_cli_several_prompts_with_the_default_eagle_draft(capsys, dirs):
    """Several prompts with the registry's default (EAGLE) draft: each gets the tokens it gets alone."""
    code, out, err = _run(capsys, ["generate", "--temperature", "0", "--max-new-tokens", "3", "--json", "--seed", "1",
                                   "the cat", "the dog"])
    assert code == 0, err
    results = json.loads(out)
    for result, text in zip(results, ["the cat", "the dog"]):
        single = draftwise.generate(TARGET, [{"role": "user", "content": text}], temperature=0, max_new_tokens=3,
                                    seed=1)
        assert result["token_ids"] == single.token_ids and result["stats"]["method"] == "sd"


# ------------------------------------------------- issue 13: SPRINTER's verifier and SpecDec++'s head out of the box

@pytest.fixture(scope="module")
def shipped_verifiers(root):
    """A SPRINTER verifier and a SpecDec++ head for the tiny registry pair at T=1, where the registry looks."""
    from draftwise.training.verifier import VerifierDataConfig, VerifierTrainConfig, collect, spec_base, train

    target = draftwise.load_model(str(root / "target"))
    draft = draftwise.load_model(str(root / "draft"))
    config = VerifierDataConfig(continuation=12, per_kind=6, temperature=1.0)
    data = collect(target, draft, [[i, i + 1, i + 2, 5, 6, 7] for i in range(40)], config, vocab_size=64)
    base = spec_base(draft, DRAFT, config, target, TARGET)
    paths = {}
    for objective in ("sprinter", "acceptance"):
        verifier, _ = train(data, VerifierTrainConfig(lam=1.2, features=("hidden", "stats"), objective=objective),
                            base)
        paths[objective] = root / "verifiers" / f"{DRAFT}-{objective}-t1.pt"
        verifier.save(paths[objective])
    yield paths
    for path in paths.values():
        path.unlink()


@pytest.mark.parametrize("method, option, objective", [("sprinter", "verifier", "sprinter"),
                                                       ("specdec++", "head", "acceptance")])
def test_sprinter_and_specdecpp_run_with_the_registry_files(dirs, shipped_verifiers, method, option, objective):
    kwargs = dict(method=method, temperature=1.0, seed=3, max_new_tokens=12, ignore_eos=True)
    default = draftwise.generate(TARGET, "the cat", **kwargs)
    explicit = draftwise.generate(TARGET, "the cat", draft=DRAFT, **{option: str(shipped_verifiers[objective])},
                                  **kwargs)
    assert default.token_ids == explicit.token_ids
    assert default.stats["verifier_calls"] > 0


def test_cli_sprinter_needs_no_file_for_the_registry_pair(capsys, dirs, shipped_verifiers):
    for method in ("sprinter", "specdec++"):
        code, out, err = _run(capsys, ["generate", "--method", method, "--temperature", "1", "--max-new-tokens", "4",
                                       "--json", "-", "the cat"])
        assert code == 0, err
        assert json.loads(out)["stats"]["method"] == method


def test_registry_verifier_refuses_other_settings_and_targets(capsys, dirs, shipped_verifiers, root):
    from draftwise.heads.sprinter import Verifier

    # a sampling setting the registry has no file for: the error says what it ships
    code, out, err = _run(capsys, ["generate", "--method", "sprinter", "--temperature", "0", "the cat"])
    _one_line_error(code, out, err, "sprinter needs --verifier PATH: the registry ships one for smollm2-135m with "
                                    "smollm2-135m-draft at temperature 1")
    with pytest.raises(DraftwiseError, match="needs head=PATH: the registry ships one"):
        draftwise.generate(TARGET, "the cat", method="specdec++", temperature=1.0, top_k=5)
    # another target: no registry file, and the shipped file itself refuses it
    with pytest.raises(DraftwiseError, match="needs verifier=PATH"):
        draftwise.generate(dirs["target"], "the cat", draft=DRAFT, method="sprinter", temperature=1.0)
    other = tiny_llama(5, window=512)
    with pytest.raises(DraftwiseError, match="trained for another target model"):
        Verifier.load(shipped_verifiers["sprinter"], draftwise.load_model(dirs["draft"]).model, other)
    with pytest.raises(DraftwiseError, match="trained for another target model"):
        draftwise.generate(draftwise.load_model(other, tokenizer=dirs["target"]), "the cat", draft=dirs["draft"],
                           method="sprinter", verifier=str(shipped_verifiers["sprinter"]), temperature=1.0)
    # the same weights in another dtype are the same model
    bf16 = draftwise.load_model(dirs["target"], dtype="bf16")
    Verifier.load(shipped_verifiers["sprinter"], draftwise.load_model(dirs["draft"], dtype="bf16").model, bf16.model)


def test_bench_plans_sprinter_with_the_registry_files(dirs, shipped_verifiers):
    from draftwise.bench import harness

    config = harness.BenchConfig(target=TARGET, methods=("ar", "sd", "sprinter", "specdec++", "mtad"),
                                 temperature=1.0, num_prompts=1, max_new_tokens=2)
    assert harness.plan_drafts(config) == {"ar": None, "sd": EAGLE, "sprinter": DRAFT, "specdec++": DRAFT,
                                           "mtad": EAGLE}


# ------------------------------------------------- issue 13: a draft's restricted output vocabulary

def test_draft_directory_with_an_output_vocabulary(capsys, root, tmp_path):
    import shutil

    from draftwise.heads.loading import load_draft
    from draftwise.models.loading import write_output_vocabulary

    draft_dir = tmp_path / "draft"
    shutil.copytree(root / "draft", draft_dir)
    ids = torch.arange(0, 64, 2)
    write_output_vocabulary(draft_dir, ids, size=32)
    target = draftwise.load_model(str(root / "target"))
    loaded = load_draft(str(draft_dir), target)
    assert torch.equal(loaded.output_ids, ids)
    ar = draftwise.generate(target, "the cat", method="ar", **GREEDY)
    sd = draftwise.generate(target, "the cat", draft=str(draft_dir), method="sd", gamma=3, **GREEDY)
    assert sd.token_ids == ar.token_ids and sd.stats["drafted"] > 0  # exact at temperature 0
    # a damaged file is a one-line error naming it
    for content, message in (("{", "not an output vocabulary"), ('{"ids": [1, 1]}', "distinct"),
                             ('{"ids": [99]}', "in [0, 64)")):
        (draft_dir / "output-vocab.json").write_text(content)
        code, out, err = _run(capsys, ["generate", "--target", str(root / "target"), "--draft", str(draft_dir),
                                       "--method", "sd", "--no-chat", "the cat"])
        _one_line_error(code, out, err, message)
