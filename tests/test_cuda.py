"""The engine on a GPU: opt-in (`pytest -m cuda`; CI has no GPU, so `make test` leaves these out). On a machine
without one they fail, rather than pass unseen.

- Greedy: every exact method writes `ar`'s tokens on CUDA, for a ragged batch (a one-token prompt among them) and
  for each prompt alone; an EAGLE-3 head's token trees too.
- Sampling: `sd` at T=1 on CUDA reproduces the target's joint distribution of its first two tokens (Pearson
  chi-square at ALPHA against the exact joint from plain forwards); negative control: the draft's own samples
  are rejected by the same test.
"""

from __future__ import annotations

import pytest
import torch

import draftwise
from conftest import tiny_llama
from test_exactness import ALPHA, PLAIN, SD_PROMPTS, exact_joint, pooled_chisquare, sample_joint, target_and_draft

pytestmark = pytest.mark.cuda


@pytest.fixture(scope="module")
def cuda():
    assert torch.cuda.is_available(), "these tests run the engine on a GPU and this machine has none"
    return torch.device("cuda")


PROMPTS = [[3, 17, 42, 8, 25, 3, 17, 9], [5], [11, 40, 2, 5, 60, 33, 11, 40, 2], [7, 7, 7, 7]]


@pytest.mark.parametrize("method", ["sd", "prompt-lookup", "suffix"])
def test_exact_methods_write_ars_tokens_on_cuda(cuda, method):
    target = tiny_llama(0).to(cuda)
    draft = tiny_llama(1, layers=1).to(cuda)
    kwargs = dict(temperature=0, max_new_tokens=16, ignore_eos=True)
    ar = draftwise.generate(target, PROMPTS, method="ar", **kwargs)
    draft_kw = {"draft": draft} if method == "sd" else {}
    batch = draftwise.generate(target, PROMPTS, method=method, **draft_kw, **kwargs)
    assert [b.token_ids for b in batch] == [a.token_ids for a in ar]
    for prompt, a in zip(PROMPTS, ar):
        assert draftwise.generate(target, prompt, method=method, **draft_kw, **kwargs).token_ids == a.token_ids
    assert batch[0].stats["target_calls"] <= ar[0].stats["target_calls"]


def test_eagle3_token_trees_write_ars_tokens_on_cuda(cuda):
    from test_eagle3 import _head

    target = tiny_llama(0, layers=4, width=32)
    head = _head(target, torch.arange(64), scale=1.0).to(cuda)
    target = target.to(cuda)
    kwargs = dict(temperature=0, max_new_tokens=16, ignore_eos=True)
    ar = draftwise.generate(target, PROMPTS, method="ar", **kwargs)
    tree = draftwise.generate(target, PROMPTS, method="sd", draft=head, tree_nodes=8, **kwargs)
    assert [t.token_ids for t in tree] == [a.token_ids for a in ar]


def test_sd_on_cuda_samples_the_targets_joint_distribution(cuda):
    vocab, length = 6, 2
    target, draft = target_and_draft(vocab)
    prompt = SD_PROMPTS[vocab]
    exact = exact_joint(target, prompt, PLAIN, length)  # on the CPU, from plain forwards
    gpu_target, gpu_draft = tiny_llama_copy(target, cuda), tiny_llama_copy(draft, cuda)
    counts, totals = sample_joint(2000, length, vocab, target=gpu_target, draft=gpu_draft, prompt=prompt,
                                  method="sd", temperature=1.0, max_new_tokens=4, gamma=3)
    assert totals["drafted"] > 0 and 0 < totals["accepted"] < totals["drafted"]
    assert pooled_chisquare(counts, exact) > ALPHA
    # negative control: the draft's own samples (what a sampler that accepted everything would give)
    control, _ = sample_joint(2000, length, vocab, target=gpu_draft, prompt=prompt, method="ar",
                              temperature=1.0, max_new_tokens=length)
    assert pooled_chisquare(control, exact) < ALPHA


def tiny_llama_copy(model, device):
    import copy

    return copy.deepcopy(model).to(device)
