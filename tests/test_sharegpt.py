"""ShareGPT reader (training/sharegpt.py): a truncated array read item by item, the evaluation sets kept out, the
order, and assistant turns as Answers. No model: a character tokenizer stands in for the target's."""

from __future__ import annotations

import json

import pytest

from draftwise.bench.datasets import load_prompts, read_human_eval
from draftwise.training import sharegpt


def conversation_json(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": who, "value": text} for who, text in turns]}


def truncated_array(items: list[dict], tail: str) -> str:
    """A JSON array, indented as the package's file is, cut off inside one more item."""
    text = json.dumps(items, indent=2)
    return text[: text.rindex("]")].rstrip() + ",\n  " + tail


def test_reader_keeps_whole_items_of_a_truncated_array():
    items = [conversation_json("a_0", ("human", "Hi there"), ("gpt", "  Hello!  "), ("gpt", "   ")),
             conversation_json("b_1", ("system", "Be terse."), ("user", "2+2?"), ("chatgpt", "4"), ("weird", "x"))]
    tail = '{\n    "id": "c_0",\n    "conversations": [\n      {"from": "human", "value": "cut off in the mid'
    conversations = list(sharegpt.read_conversations(truncated_array(items, tail)))
    assert [c.id for c in conversations] == ["a_0", "b_1"]
    assert [c.position for c in conversations] == [0, 1]
    assert conversations[0].messages == (("user", "Hi there"), ("assistant", "Hello!"))  # stripped, empty dropped
    assert conversations[1].messages == (("system", "Be terse."), ("user", "2+2?"), ("assistant", "4"))
    # a whole array reads whole; an array cut inside its first item reads as nothing
    assert len(list(sharegpt.read_conversations(json.dumps(items)))) == 2
    assert list(sharegpt.read_conversations(tail.join(["[\n  ", ""]))) == []


def test_code_detection():
    assert sharegpt.is_code("Here:\n```\nls -la\n```")
    assert sharegpt.is_code("import os\ndef main():\n    pass")
    assert not sharegpt.is_code("Paris is the capital of France.\nIt is in Europe.")
    assert not sharegpt.is_code("I think we should import more goods.")  # one code-like phrase, not a line of code


def test_exclusion_ngrams():
    ex = sharegpt.Exclusion(n=5, min_words=3)
    ex.add_text("one two three four five six")  # n-grams of 5 words
    ex.add_text("No.")  # too short to mean anything
    ex.add_text("Alpha, beta: gamma!")  # short: counts whole
    assert ex.matches("zero ONE two\nthree four-five!") and not ex.matches("one two three four")
    assert ex.matches("say alpha beta gamma delta") and not ex.matches("alpha beta")
    assert not ex.matches("No, I will not.")
    ex.add_definitions(["below_zero"])
    assert ex.matches("def below_zero(ops):") and not ex.matches("def below_zero_or_not(ops):")


@pytest.fixture(scope="module")
def exclusion():
    return sharegpt.evaluation_exclusion()


def test_exclusion_of_humaneval_and_spec_bench_eval(exclusion):
    problem = read_human_eval()[0]
    quoted = "Can you solve this?\n" + problem["prompt"].upper().replace("    ", "\t")  # case and layout differ
    defined = f"def {problem['entry_point']} (xs):\n    return xs"
    eval_turn = load_prompts("spec-bench", split="eval", categories=["writing"])[0].text
    train_turn = load_prompts("spec-bench", split="train", categories=["writing"])[0].text
    assert exclusion.matches(quoted)
    assert exclusion.matches(defined)
    assert exclusion.matches("Please help: " + eval_turn)
    assert not exclusion.matches(train_turn)  # the training split is not the evaluation split
    assert not exclusion.matches("def my_function(xs):\n    return sorted(xs)\n" + "No. Uncertain. Yes.")

    def conv(position: int, *messages: tuple[str, str]) -> sharegpt.Conversation:
        return sharegpt.Conversation(position, f"x{position}", messages)

    chat = conv(0, ("user", "Tell me a story about a cat."), ("assistant", "Once upon a time there was a cat."))
    code = conv(1, ("user", "Sort a list in Python"), ("assistant", "```python\nsorted(xs)\n```"))
    leaked = conv(2, ("user", "hello"), ("assistant", "Sure."), ("user", quoted), ("assistant", "```\npass\n```"))
    defines = conv(3, ("user", "write it"), ("assistant", defined))
    no_answer = conv(4, ("user", "anyone there?"))
    first, second, excluded = sharegpt.ordered([chat, code, leaked, defines, no_answer], exclusion)
    assert [c.position for c in first] == [1] and [c.position for c in second] == [0] and excluded == 2


class CharTokenizer:
    """One token a character; a chat template in the shape of Qwen's (a default system message when none)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) for ch in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> list[int]:
        if messages[0]["role"] != "system":
            messages = [{"role": "system", "content": "S"}] + list(messages)
        text = "".join(f"<{m['role'][0]}>{m['content']}|" for m in messages) + ("<a>" if add_generation_prompt else "")
        return self.encode(text)


def test_assistant_turns_as_answers():
    c = sharegpt.Conversation(7, "q", (("assistant", "orphan"), ("user", "u" * 30), ("assistant", "a" * 40),
                                       ("user", "v" * 10), ("assistant", "b" * 20), ("user", "w" * 130),
                                       ("assistant", "c")))
    assert sharegpt.turn_uids(c) == ["sharegpt-00007-02", "sharegpt-00007-04", "sharegpt-00007-06"]
    tok = CharTokenizer()
    decode = lambda ids: "".join(chr(i) for i in ids)  # noqa: E731
    got = list(sharegpt.answers(c, tok, max_prompt=120, max_len=110, category="code", end_of_turn=0))
    # the orphan assistant turn (no user turn before it) is no answer; the last user turn alone is too long
    assert [a.uid for a in got] == ["sharegpt-00007-02", "sharegpt-00007-04"]
    first, second = got
    assert decode(first.prompt_ids) == "<s>S|<u>" + "u" * 30 + "|<a>"
    assert first.answer_ids == tok.encode("a" * 40) + [0] and first.finish_reason == "eos"
    # the second prompt holds the whole history (100 tokens, under 120); its answer is cut at 110 tokens in all
    assert decode(second.prompt_ids) == "<s>S|<u>" + "u" * 30 + "|<a>" + "a" * 40 + "|<u>" + "v" * 10 + "|<a>"
    assert second.answer_ids == tok.encode("b" * 10) and second.finish_reason == "length"
    got = list(sharegpt.answers(c, tok, max_prompt=45, max_len=200, category="code", end_of_turn=0))
    # a 45-token prompt holds only the last user turn (a window starts at a user turn, not at the answer before)
    assert decode(got[1].prompt_ids) == "<s>S|<u>" + "v" * 10 + "|<a>"
    assert got[1].answer_ids == tok.encode("b" * 20) + [0]
    assert len(got[0].prompt_ids) + len(got[0].answer_ids) <= 200 and got[0].tag == sharegpt.TAG
    # turns already done are skipped by uid
    skipped = sharegpt.answers(c, tok, max_prompt=120, max_len=200, category="code", end_of_turn=0,
                               skip={"sharegpt-00007-02"})
    assert [a.uid for a in skipped] == ["sharegpt-00007-04"]


def test_first_user_turns_as_train_data_prompts(monkeypatch):
    """`train-data --sources sharegpt`: each kept conversation's first user turn, once, in the fixed order; a
    conversation the exclusion matches is dropped whole; a first turn too short or too long, or not a user's, is
    skipped; the count stops the list."""
    from draftwise.training.data import build_prompts, sharegpt_prompts

    items = [conversation_json("ok_0", ("human", "Explain how tides work, please."), ("gpt", "The moon.")),
             conversation_json("code_0", ("human", "Fix this:\nimport os\ndef main():\n    pass"), ("gpt", "Done.")),
             conversation_json("short_0", ("human", "hi"), ("gpt", "Hello!")),
             conversation_json("long_0", ("human", "x " * 1500), ("gpt", "Long.")),
             conversation_json("bot_first_0", ("gpt", "How can I help you today?"), ("human", "Tell me a joke now."),
                               ("gpt", "No.")),
             conversation_json("eval_0", ("human", "Write def below_zero(ops): for me now"), ("gpt", "Sure.")),
             conversation_json("ok_1", ("human", "What is the capital of Peru?"), ("gpt", "Lima."),
                               ("human", "And of Chile, then?"), ("gpt", "Santiago."))]
    conversations = list(sharegpt.read_conversations(json.dumps(items)))
    monkeypatch.setattr(sharegpt, "load_conversations", lambda: conversations)
    ex = sharegpt.Exclusion()
    ex.add_definitions(["below_zero"])
    monkeypatch.setattr(sharegpt, "evaluation_exclusion", lambda: ex)
    prompts = sharegpt_prompts(10)
    kept = {0: "chat", 1: "coding", 6: "chat"}
    order = sorted((c for c in conversations if c.position in kept), key=sharegpt.order_key)
    assert [p.uid for p in prompts] == [f"sharegpt-first-{c.position:05d}" for c in order]
    assert {p.uid: p.category for p in prompts} == {f"sharegpt-first-{i:05d}": k for i, k in kept.items()}
    assert {p.text for p in prompts} >= {"What is the capital of Peru?"} and all(p.source == "sharegpt" for p in prompts)
    assert [p.uid for p in sharegpt_prompts(2)] == [p.uid for p in prompts[:2]]
    assert [p.uid for p in build_prompts(num_fortunes=0, num_sharegpt=2) if p.source == "sharegpt"] == \
        [p.uid for p in prompts[:2]]
