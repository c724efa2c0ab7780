"""HumanEval pass@1: answers' code run against the problems' tests in a subprocess (bench.execution)."""

import pytest

from draftwise.bench.datasets import load_prompts, read_human_eval
from draftwise.bench.execution import code_blocks, pass_all, passes, program_from_answer, run_program
from draftwise.errors import DraftwiseError


@pytest.fixture(scope="module")
def problems():
    canonical = {int(r["task_id"].split("/")[-1]): r for r in read_human_eval()}
    return [(p, canonical[p.question_id]) for p in load_prompts("humaneval")]


def test_humaneval_prompts_are_the_164_problems_evaluation_only():
    prompts = load_prompts("humaneval")
    assert len(prompts) == 164 and len({p.question_id for p in prompts}) == 164
    assert all(p.tests and p.entry_point and p.code_prompt in p.text for p in prompts)
    assert [p.question_id for p in load_prompts("humaneval", num_prompts=5)] == [p.question_id for p in prompts[:5]]
    assert [p.question_id for p in prompts[:5]] != [0, 1, 2, 3, 4]  # a sample is not the first problems
    with pytest.raises(DraftwiseError, match="no training split"):
        load_prompts("humaneval", split="train")
    with pytest.raises(DraftwiseError, match="one category"):
        load_prompts("humaneval", categories=["qa"])


def test_every_canonical_solution_passes_and_a_wrong_one_fails(problems):
    """Positive: the 164 reference solutions, as a chat answer would hold them. Negative control: each problem's
    solution swapped with another problem's fails its tests (an always-pass runner would not catch this)."""
    answers = [(f"Here is the function:\n\n```python\n{c['prompt']}{c['canonical_solution']}```\n\nIt works.",
                p.code_prompt, p.tests, p.entry_point) for p, c in problems]
    assert all(pass_all(answers, timeout=20))
    swapped = [(f"```python\n{problems[i - 1][1]['canonical_solution']}```", p.code_prompt, p.tests, p.entry_point)
               for i, (p, _) in enumerate(problems[:24])]
    assert sum(pass_all(swapped, timeout=20)) <= 1  # two problems could share a solution; 24 pairs here do not


def test_answer_forms(problems):
    p, c = next((p, c) for p, c in problems if "from typing import" in p.code_prompt)
    header_less = c["prompt"][c["prompt"].index(f"def {p.entry_point}"):] + c["canonical_solution"]
    assert passes(f"```python\n{header_less}```", p.code_prompt, p.tests, p.entry_point)  # imports left out
    assert passes(f"```python\n{c['canonical_solution']}```", p.code_prompt, p.tests, p.entry_point)  # the body only
    flush = "\n".join(line[4:] if line.startswith("    ") else line for line in c["canonical_solution"].splitlines())
    assert passes(f"```\n{flush}\n```", p.code_prompt, p.tests, p.entry_point)  # a body written flush left
    assert passes(f"{c['prompt']}{c['canonical_solution']}", p.code_prompt, p.tests, p.entry_point)  # no fence
    # The first block defining the function is run, after prose and a usage block
    usage = f"```python\nprint({p.entry_point}([]))\n```"
    assert program_from_answer(f"Use it so:\n{usage}\nCode:\n```py\n{header_less}```", p.code_prompt,
                               p.entry_point).endswith(header_less)
    assert code_blocks("```js\nx\n```\n```python\ny\n```") == ["y\n"]
    assert not passes("I cannot help with that.", p.code_prompt, p.tests, p.entry_point)


def test_programs_cannot_fake_a_pass_or_hang():
    assert run_program("x = 1")
    assert not run_program("raise ValueError")
    assert not run_program("import sys; sys.exit(0)")  # leaves before the tests would run: no pass
    assert not run_program("import os; os._exit(0)")
    assert not run_program("while True: pass", timeout=1)
    assert not run_program("x = bytearray(4 << 30)")  # the memory limit
    assert run_program("if __name__ == '__main__':\n    input()")  # an answer's demo block does not run
    assert run_program("print('x' * 100000)")  # long output is no failure


def test_bench_reports_pass_at_1(tmp_path, monkeypatch):
    """The harness decodes each answer and runs its tests: the tiny random model fails every problem; with its
    decoder swapped for the problem's reference solution, every repeat passes."""
    from conftest import save_pair

    from draftwise.bench import harness
    from draftwise.bench.harness import BenchConfig, run_bench
    from draftwise.bench.report import format_table

    save_pair(tmp_path, window=2048)
    config = BenchConfig(target=str(tmp_path / "target"), dataset="humaneval", num_prompts=1, max_new_tokens=4,
                         methods=("ar",), repeats=2, dtype="fp32", save_outputs=True)
    results = run_bench(config)
    ar = results["methods"]["ar"]
    assert ar["pass_at_1"] == 0.0 and ar["tested_answers"] == 2
    assert [o["passed"] for o in results["outputs"]["ar"]] == [False, False]
    assert "pass@1" in format_table(results)

    (problem,) = load_prompts("humaneval", num_prompts=1)
    solution = next(r for r in read_human_eval() if r["task_id"].endswith(f"/{problem.question_id}"))
    load = harness.load_model

    def solving(*args, **kwargs):
        model = load(*args, **kwargs)
        monkeypatch.setattr(model.tokenizer, "decode", lambda ids, **_: solution["canonical_solution"])
        return model

    monkeypatch.setattr(harness, "load_model", solving)
    assert run_bench(config)["methods"]["ar"]["pass_at_1"] == 1.0
