"""The EAGLE row drafter on a padded target vocabulary: draft-vocabulary ids at or past the shared
vocabulary size are masked before warping, so they are never drafted and carry no mass."""

from __future__ import annotations

import pytest
import torch

from types import SimpleNamespace

from draftwise.heads.eagle import EagleConfig, EagleHead
from draftwise.drafters.eagle import EagleRowsDrafter
from draftwise.errors import DraftwiseError
from draftwise.engine.sampling import SamplingConfig, make_generator, warp

from conftest import tiny_llama

SHARED = 40  # the tokenizer's size; the target's embedding is padded to 64 rows
VOCAB_IDS = torch.arange(0, 64, 2)  # draft vocabulary: 32 ids, 12 of them >= SHARED


def padded_head(favour_padding: float) -> EagleHead:
    """A random head whose logits favour the ids past SHARED by `favour_padding` (so, unmasked, they win)."""
    target = tiny_llama(0)
    torch.manual_seed(3)
    head = EagleHead(EagleConfig(hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=64,
                                 target_vocab_size=64), VOCAB_IDS).attach(target).eval()
    bias = torch.where(VOCAB_IDS >= SHARED, favour_padding, 0.0)
    plain = head.logits
    head.logits = lambda predicted: plain(predicted) + bias  # instance attribute: shadows the method
    return head


def _drafter(head: EagleHead, sampling: SamplingConfig, seed: int):
    """A row drafter with one row: 6 tokens, the target's features of the first 5 observed."""
    drafter = EagleRowsDrafter(head, SHARED, torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(5, 64, generator=gen)
    sequence = torch.randint(0, SHARED, (6,), generator=gen).tolist()
    drafter.admit(0, sequence)
    drafter.observe(0, 0, features)
    row = SimpleNamespace(sequence=sequence, request=SimpleNamespace(sampling=sampling), grammar=None,
                          generator=make_generator(seed), seed=seed, gumbel=False)  # an engine Row's keyed draws
    return drafter, row


def drafts(head: EagleHead, sampling: SamplingConfig, seed: int, k: int = 4):
    """Row 0's draft: (tokens [k], probs [k, SHARED])."""
    drafter, row = _drafter(head, sampling, seed)
    out = drafter.propose([row], [k])
    return SimpleNamespace(tokens=out.tokens[0, : out.counts[0]], probs=out.probs[0, : out.counts[0]])


@pytest.mark.parametrize("sampling", [SamplingConfig(), SamplingConfig(temperature=0.7, top_k=3, top_p=0.9),
                                      SamplingConfig(temperature=0)])
def test_ids_past_the_shared_vocabulary_are_never_drafted(sampling: SamplingConfig):
    head = padded_head(favour_padding=30.0)
    usable = VOCAB_IDS[VOCAB_IDS < SHARED]
    for seed in range(20):
        draft = drafts(head, sampling, seed)
        assert len(draft.tokens) == 4
        assert bool((draft.tokens < SHARED).all()), draft.tokens
        assert draft.probs.shape == (4, SHARED)
        assert torch.allclose(draft.probs.sum(-1), torch.ones(4))  # the usable ids carry all the mass
        outside = torch.ones(SHARED, dtype=torch.bool)
        outside[usable] = False
        assert bool((draft.probs[:, outside] == 0).all())
        rows = torch.arange(4)
        assert bool((draft.probs[rows, draft.tokens] > 0).all())  # drawn from the distribution it reports
        if sampling.top_k:  # top-k counts usable ids only: masking came before warping
            assert bool(((draft.probs > 0).sum(-1) <= sampling.top_k).all())


def test_masking_happens_before_warping():
    """The reported distribution is warp(masked logits): top-k 3 keeps three usable ids, not fewer."""
    head = padded_head(favour_padding=30.0)
    sampling = SamplingConfig(temperature=1.0, top_k=3)
    draft = drafts(head, sampling, seed=0, k=1)
    assert int((draft.probs[0] > 0).sum()) == 3
    drafter, row = _drafter(head, sampling, 0)
    sequence = row.sequence
    feats = drafter.features[0][None]
    with torch.no_grad():
        predicted = head(feats, torch.tensor([sequence[1:6]]))[0, -1:]
    logits = head.logits(predicted).masked_fill(VOCAB_IDS >= SHARED, float("-inf"))
    expected = torch.zeros(1, SHARED)
    expected[0, VOCAB_IDS[VOCAB_IDS < SHARED]] = warp(logits, sampling)[0, VOCAB_IDS < SHARED]
    assert torch.allclose(draft.probs, expected, atol=1e-6)


def test_a_head_with_no_usable_id_is_refused():
    head = padded_head(favour_padding=0.0)
    with pytest.raises(DraftwiseError, match="draft vocabulary"):
        EagleRowsDrafter(head, 0, torch.device("cpu"))
