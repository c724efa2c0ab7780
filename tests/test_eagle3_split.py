"""The EAGLE-3 trainer's held-out split, draft vocabulary file and precision default.

- A sequence is held out by a hash of its uid: the split of the first sequences stays the same when more shards
  arrive (the data job is still writing them while a head trains), and no sequence is in both parts. Control: a
  split by shuffled position (what the trainer did before) moves sequences between the parts as the data grows.
- `--vocab-file` reads the registry's vocabulary format and refuses ids outside the target's vocabulary.
- bf16 autocast is the default only where bf16 is native.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from draftwise.errors import DraftwiseError
from draftwise.training.eagle3_train import Eagle3TrainConfig, Example, held_out, native_bf16, vocabulary_file
from draftwise.training.shards import ShardSequence


def _examples(n: int) -> list[Example]:
    out = []
    for i in range(n):
        tokens = torch.arange(10) + i
        out.append(Example(tokens, 4, "chat", ShardSequence(tokens, None, 4, "chat", f"sharegpt:{i}:1")))
    return out


def _uids(examples: list[Example]) -> set[str]:
    return {e.sequence.uid for e in examples}


def test_a_held_out_sequence_stays_held_out_as_the_shards_grow():
    small, large = _examples(400), _examples(4000)
    val_small, train_small = held_out(small, 0.05)
    val_large, train_large = held_out(large, 0.05)
    assert _uids(val_small) and not _uids(val_small) & _uids(train_small)
    assert len(val_small) + len(train_small) == 400
    assert _uids(val_small) <= _uids(val_large)  # what was held out still is
    assert not _uids(train_small) & _uids(val_large)  # nothing trained on is evaluated later
    assert 0.02 < len(val_large) / 4000 < 0.08

    def by_position(examples, fraction, seed=0):  # control: the old split, by shuffled position
        order = list(range(len(examples)))
        random.Random(seed).shuffle(order)
        n = max(1, int(len(order) * fraction))
        return {examples[i].sequence.uid for i in order[:n]}, {examples[i].sequence.uid for i in order[n:]}

    old_val_small, old_train_small = by_position(small, 0.05)
    old_val_large, _ = by_position(large, 0.05)
    assert old_train_small & old_val_large  # the control leaks: trained-on sequences become validation


def test_a_tiny_set_still_holds_one_out():
    val, train = held_out(_examples(2), 0.01)
    assert len(val) == 1 and len(train) == 1
    val, train = held_out(_examples(1), 0.5)
    assert val == [] and len(train) == 1


def test_the_vocabulary_file_reads_the_registry_format_and_refuses_bad_ids(tmp_path):
    good = tmp_path / "vocab.json"
    good.write_text(json.dumps({"size": 3, "ids": [7, 2, 5, 2]}))
    assert vocabulary_file(str(good), 10).tolist() == [2, 5, 7]
    (tmp_path / "list.json").write_text("[1, 3]")
    assert vocabulary_file(str(tmp_path / "list.json"), 10).tolist() == [1, 3]
    (tmp_path / "big.json").write_text("[1, 30]")
    with pytest.raises(DraftwiseError, match="below 10"):
        vocabulary_file(str(tmp_path / "big.json"), 10)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DraftwiseError, match="bad.json"):
        vocabulary_file(str(tmp_path / "bad.json"), 10)
    with pytest.raises(DraftwiseError, match="missing.json"):
        vocabulary_file(str(tmp_path / "missing.json"), 10)


def test_bf16_is_the_default_only_where_it_is_native():
    from draftwise.models.loading import cpu_has_native_bf16

    assert Eagle3TrainConfig(data="", out="").bf16 is None
    assert native_bf16(torch.device("cpu")) == cpu_has_native_bf16()
