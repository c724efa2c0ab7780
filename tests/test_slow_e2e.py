"""Opt-in end-to-end runs on the real default model (`make test-slow`)."""

from __future__ import annotations

import pytest
import torch

import draftwise

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(2)
    return draftwise.load_model("smollm2-135m", dtype="fp32")


@pytest.mark.parametrize("method", ["ar", "prompt-lookup"])
def test_greedy_matches_transformers_on_smollm2(smollm2, method):
    tok = smollm2.tokenizer
    for text in ["Summarize: The cat sat on the mat. The cat was happy on the mat.", "Write a haiku about rain."]:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                      tokenize=True)["input_ids"]
        ref = smollm2.model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32,
                                     temperature=None, top_p=None, top_k=None)[0, len(ids):].tolist()
        out = draftwise.generate(smollm2, ids, method=method, temperature=0, max_new_tokens=32, gamma=4)
        assert out.token_ids == ref[: len(out.token_ids)] and (len(out.token_ids) == len(ref))


@pytest.mark.parametrize("method", ["sprinter", "specdec++"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_registry_verifiers_run_with_no_file(smollm2, method, temperature):
    """The shipped verifier and stop head for smollm2-135m with smollm2-135m-draft: no file argument."""
    out = draftwise.generate("smollm2-135m", [{"role": "user", "content": "Name three colours."}], method=method,
                             temperature=temperature, max_new_tokens=16, seed=0)
    assert out.stats["verifier_calls"] > 0 and len(out.token_ids) > 0
