"""The draft recipe at tiny scale: data records in, a trained HF draft out; resume; determinism."""

from __future__ import annotations

import json

import pytest
import torch

from draftwise.errors import DraftwiseError
from draftwise.training.distill import DistillConfig, distill
from draftwise.training.data import read_answers

from conftest import tiny_llama


def _write_records(path, n=24, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    with open(path, "w") as f:
        for i in range(n):
            prompt = torch.randint(1, vocab, (6,), generator=g).tolist()
            # A learnable rule: the answer counts up from the last prompt token.
            answer = [(prompt[-1] + j) % vocab for j in range(1, 9)]
            f.write(json.dumps({"uid": f"u{i}", "tag": "greedy", "source": "test", "category": "qa",
                                "prompt_ids": prompt, "answer_ids": answer}) + "\n")
        f.write('{"uid": "cut-by-a-crash", "tag"')  # an interrupted write: skipped, not fatal


def _config(tmp_path, **kw):
    base = dict(data=str(tmp_path / "data.jsonl"), out=str(tmp_path / "draft"), hidden_size=32, num_layers=1,
                num_heads=2, intermediate_size=64, max_len=32, batch_size=8, steps=60, warmup=5, lr=1e-2,
                checkpoint_every=20, save_dtype="fp32")
    base.update(kw)
    return DistillConfig(**base)


def test_interrupted_jsonl_line_is_skipped(tmp_path):
    _write_records(tmp_path / "data.jsonl")
    assert len(list(read_answers(tmp_path / "data.jsonl"))) == 24


def test_distill_learns_and_writes_a_loadable_draft(tmp_path):
    _write_records(tmp_path / "data.jsonl")
    target = tiny_llama(0)
    before = distill(_config(tmp_path, steps=1, out=str(tmp_path / "d0")), target.config,
                     target.get_input_embeddings().weight.detach(), pad=0)
    after = distill(_config(tmp_path), target.config, target.get_input_embeddings().weight.detach(), pad=0)
    assert after["validation"]["loss"] < before["validation"]["loss"] - 0.5
    import draftwise

    draft = draftwise.load_model(str(tmp_path / "draft"))
    assert draft.vocab_size == target.config.vocab_size
    out = draftwise.generate(target, [1, 2, 3], draft=draft, method="sd", temperature=0, max_new_tokens=6)
    assert len(out.token_ids) == 6


def test_resume_gives_the_same_weights_as_one_run(tmp_path):
    _write_records(tmp_path / "data.jsonl")
    target = tiny_llama(0)
    emb = target.get_input_embeddings().weight.detach()
    distill(_config(tmp_path, out=str(tmp_path / "one")), target.config, emb, pad=0)
    # "Interrupted" run: stop at step 40 (a checkpoint), then resume to 60 with the same config.
    cfg = _config(tmp_path, out=str(tmp_path / "two"))
    assert distill(cfg, target.config, emb, pad=0, stop_at=40)["stopped_early"]  # "interrupted" at step 40
    distill(cfg, target.config, emb, pad=0)  # resumes from the step-40 checkpoint
    a = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=False)["model"]
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key


def test_resume_with_other_options_is_refused(tmp_path):
    _write_records(tmp_path / "data.jsonl")
    target = tiny_llama(0)
    emb = target.get_input_embeddings().weight.detach()
    distill(_config(tmp_path, steps=20), target.config, emb, pad=0)
    with pytest.raises(DraftwiseError, match="different configuration"):
        distill(_config(tmp_path, steps=20, lr=5e-3), target.config, emb, pad=0)


def test_no_data_is_a_clear_error(tmp_path):
    (tmp_path / "data.jsonl").write_text("")
    target = tiny_llama(0)
    with pytest.raises(DraftwiseError, match="no training records"):
        distill(_config(tmp_path), target.config, target.get_input_embeddings().weight.detach(), pad=0)


def test_eagle_head_trains_and_drafts_exactly(tmp_path):
    """Tiny EAGLE run: agreement rises, the saved head loads, and sd with it stays exact at temperature 0."""
    import draftwise
    from draftwise.heads.eagle import EagleHead
    from draftwise.training.eagle_train import EagleTrainConfig, train_eagle

    _write_records(tmp_path / "data.jsonl")
    target = tiny_llama(0)
    cfg = EagleTrainConfig(data=str(tmp_path / "data.jsonl"), out=str(tmp_path / "eagle"), draft_vocab=48,
                           intermediate_size=64, max_len=32, batch_size=8, steps=40, warmup=5, lr=5e-3,
                           checkpoint_every=20)
    first = train_eagle(EagleTrainConfig(**{**cfg.__dict__, "steps": 1, "out": str(tmp_path / "e1")}), target,
                        pad=0, eos_ids=set())
    report = train_eagle(cfg, target, pad=0, eos_ids=set())
    assert report["validation"]["loss"] < first["validation"]["loss"] - 0.2
    head = EagleHead.load(tmp_path / "eagle")
    assert head.draft_vocab_size == 48
    prompt = [5, 9, 11, 3, 7]
    ref = draftwise.generate(target, prompt, method="ar", temperature=0, max_new_tokens=12)
    for gamma in (1, 3):
        out = draftwise.generate(target, prompt, draft=str(tmp_path / "eagle"), method="sd", temperature=0,
                                 max_new_tokens=12, gamma=gamma)
        assert out.token_ids == ref.token_ids
        assert out.stats["drafted"] > 0


def test_eagle_head_refuses_another_target(tmp_path):
    from draftwise.heads.eagle import EagleConfig, EagleHead

    head = EagleHead(EagleConfig(hidden_size=32, num_heads=2, num_kv_heads=2, intermediate_size=64,
                                 target_vocab_size=64, target="other"), torch.arange(10))
    with pytest.raises(DraftwiseError, match="hidden size 32"):
        head.attach(tiny_llama(0))


def test_distill_from_feature_shards_with_an_output_vocabulary(tmp_path):
    """A shard directory (`train-data --features`) is read for its tokens; --output-vocab writes the draft's
    restricted vocabulary (the data's frequent tokens, special tokens in), which load_draft then uses."""
    from types import SimpleNamespace

    from draftwise.heads.loading import load_draft
    from draftwise.models.loading import LoadedModel
    from draftwise.training.shards import generate_shards

    target = LoadedModel(tiny_llama(0), name="tiny", eos_token_ids=frozenset({0}))
    prompts = [SimpleNamespace(uid=f"p{i}", source="test", category="qa", text=str(i)) for i in range(6)]
    generate_shards(target, prompts, tmp_path / "shards", max_new_tokens=8, batch_size=3, temperature=0.0,
                    tag="greedy", shard_size=4, layers=(0, 1, 1), encode=lambda text: [1 + int(text), 7, 9])
    emb = target.model.get_input_embeddings().weight.detach()
    config = _config(tmp_path, data=str(tmp_path / "shards"), steps=10, output_vocab=16)
    report = distill(config, target.model.config, emb, pad=0)
    assert report["train_examples"] + report["val_examples"] == 6
    vocab = json.loads((tmp_path / "draft" / "output-vocab.json").read_text())
    assert len(vocab["ids"]) == 16 and 0 <= vocab["validation_answer_coverage"] <= 1
    loaded = load_draft(str(tmp_path / "draft"), target)
    assert loaded.output_ids.tolist() == vocab["ids"]
    # resuming to export another vocabulary size is not a different training run
    distill(_config(tmp_path, data=str(tmp_path / "shards"), steps=10, output_vocab=8), target.model.config, emb,
            pad=0)
    assert len(json.loads((tmp_path / "draft" / "output-vocab.json").read_text())["ids"]) == 8


def test_length_grouped_epochs_cover_every_example_once_and_pad_less():
    """A grouped epoch is a permutation of the examples, its batches pad far less than random ones, and it stays
    random (two seeds give different orders)."""
    import random

    from draftwise.training.loop import epoch_order

    rng = random.Random(0)
    lengths = [rng.randint(20, 600) for _ in range(1003)]
    batch = 8

    def padded(order):
        return sum(max(lengths[i] for i in order[s:s + batch]) * len(order[s:s + batch])
                   for s in range(0, len(order), batch))

    grouped = epoch_order(random.Random(1), len(lengths), batch, lengths)
    plain = epoch_order(random.Random(1), len(lengths), batch)
    assert sorted(grouped) == list(range(len(lengths))) and sorted(plain) == list(range(len(lengths)))
    assert padded(grouped) < 0.8 * padded(plain)  # random batches of 8 pad to ~1.6x the mean length here
    assert padded(grouped) < 1.05 * sum(lengths)
    assert grouped != epoch_order(random.Random(2), len(lengths), batch, lengths)


def test_resume_with_length_grouped_batches_gives_the_same_weights(tmp_path):
    """Resume exactness where grouping changes the batches (answers of 2 to 20 tokens)."""
    g = torch.Generator().manual_seed(3)
    with open(tmp_path / "data.jsonl", "w") as f:
        for i in range(40):
            prompt = torch.randint(1, 64, (4,), generator=g).tolist()
            answer = [(prompt[-1] + j) % 64 for j in range(1, 2 + i % 19)]
            f.write(json.dumps({"uid": f"u{i}", "tag": "greedy", "source": "test", "category": "qa",
                                "prompt_ids": prompt, "answer_ids": answer}) + "\n")
    target = tiny_llama(0)
    emb = target.get_input_embeddings().weight.detach()
    distill(_config(tmp_path, out=str(tmp_path / "one"), steps=30, checkpoint_every=10, batch_size=4),
            target.config, emb, pad=0)
    cfg = _config(tmp_path, out=str(tmp_path / "two"), steps=30, checkpoint_every=10, batch_size=4)
    distill(cfg, target.config, emb, pad=0, stop_at=20)
    distill(cfg, target.config, emb, pad=0)
    a = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=False)["model"]
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key
