"""The EAGLE-3-style head: feature capture during generation, training-time test, drafting against cache-free
rollouts, exactness at T=0, and resumable data and training."""

from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace
import tempfile
from pathlib import Path

import pytest
import torch

import draftwise
from conftest import tiny_llama, tiny_tokenizer
from draftwise.heads.eagle3 import Eagle3Head
from draftwise.engine.rows import Request
from draftwise.errors import DraftwiseError
from draftwise.models.loading import LoadedModel
from draftwise.models.runner import ModelRunner
from draftwise.engine.sampling import SamplingConfig, make_generator

LAYERS = (0, 2, 3)
GREEDY = SamplingConfig(temperature=0.0)


class Row:
    """What a rows drafter reads of an engine row."""

    def __init__(self, sequence):
        self.sequence = sequence
        self.request = Request(tuple(sequence), GREEDY)
        self.generator = make_generator(0)


def _target(seed: int = 0, vocab: int = 64):
    return tiny_llama(seed, layers=4, width=32, vocab=vocab)


def _head(target, vocab_ids, *, scale: float = 3.0, seed: int = 3) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head.new(target, vocab_ids=vocab_ids, intermediate_size=48, feature_layers=LAYERS)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.3 * torch.randn_like(p)).mul_(scale)  # sharp, and unlike the target
        head.feature_scale.copy_(0.5 + 4 * torch.rand(head.feature_size))  # every path must divide by it
    return head.eval()


def _features(target, seq) -> torch.Tensor:
    """Cache-free: the inputs of LAYERS and the final normed state, [len(seq), 4H]."""
    with torch.no_grad():
        hs = target(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in LAYERS] + [hs[-1][0]], dim=-1)


def _rollout(head, target, seq, limit):
    """Greedy drafts with no cache at all: the true prefix's features, then the head's own outputs."""
    aux = list(_features(target, seq)[: len(seq) - 1, : head.feature_size])
    tokens = list(seq[1:])
    out = []
    with torch.no_grad():
        fused = head.fuse(torch.stack(aux))  # [n, H]
        states = list(fused)
        for _ in range(limit):
            x = torch.cat([head.embed(torch.tensor([tokens])), torch.stack(states)[None]], dim=-1)
            pre = head.body(x).last_hidden_state[0, -1]
            token = int(head.vocab_ids[head.logits(pre).argmax()])
            out.append(token)
            states.append(pre)
            tokens.append(token)
    return out


def test_runner_returns_the_chosen_layers_inputs_padded_and_packed():
    target = _target()
    ids = torch.randint(0, 64, (3, 9))
    with torch.no_grad():
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
    for packing in (False, True):
        runner = ModelRunner(target, rows=0)
        runner.packing = packing
        runner.feature_layers = LAYERS
        states = runner.forward_rows(ids, [9, 4, 6], hidden=True).hidden
        for row, n in enumerate([9, 4, 6]):
            expected = torch.cat([hs[i][row, :n] for i in LAYERS] + [hs[-1][row, :n]], dim=-1)
            torch.testing.assert_close(states[row, :n], expected, atol=1e-4, rtol=1e-4)


def test_training_time_test_equals_a_cache_free_rollout_with_teacher_tokens():
    """Step k of the unrolled training forward at position i = the head run without cache on the true prefix to i,
    then k steps on its own outputs with the true tokens: what drafting sees when the earlier drafts were right."""
    from draftwise.training.eagle3_train import Example, _batch, ttt_forward

    target = _target()
    head = _head(target, torch.arange(64))
    seq = [random.Random(1).randrange(64) for _ in range(14)]
    feats = _features(target, seq)
    feats[-1] = 0  # the shards' layout: the last token was never fed
    batch = _batch([Example(torch.tensor(seq), 4, "x", loaded=feats.half().float())], 3, 32)
    batch["aux"] = _features(target, seq)[:-1, : head.feature_size][None]  # full precision for the comparison
    with torch.no_grad():
        logits = ttt_forward(head, batch, 3)
    aux = _features(target, seq)[:, : head.feature_size]
    for i in (0, 5, 9):
        for k in range(3):
            if i + 1 + k > len(seq) - 1:
                continue
            with torch.no_grad():
                states = list(head.fuse(aux[: i + 1]))
                tokens = seq[1 : i + 2]
                pre = None
                for step in range(k + 1):
                    x = torch.cat([head.embed(torch.tensor([tokens])), torch.stack(states)[None]], dim=-1)
                    pre = head.body(x).last_hidden_state[0, -1]
                    states.append(pre)
                    tokens = tokens + [seq[i + 2 + step]] if i + 2 + step < len(seq) else tokens
                torch.testing.assert_close(head.logits(logits[k][0, i]), head.logits(pre), atol=1e-4, rtol=1e-4)


def test_training_losses_equal_the_per_step_teacher_computed_from_scratch():
    """The teacher's distribution is computed once per batch and shared by the steps; the loss and the agreement
    must equal a per-step computation from the final states (two sequences of different lengths)."""
    import torch.nn.functional as F

    from draftwise.training.eagle3_train import Example, _batch, ttt_forward, ttt_losses

    target = _target()
    vocab_ids = torch.arange(0, 64, 2)
    head = _head(target, vocab_ids, scale=1.0)
    rng = random.Random(4)
    seqs = [[rng.randrange(64) for _ in range(n)] for n in (14, 9)]
    examples = []
    for seq in seqs:
        feats = _features(target, seq)
        feats[-1] = 0
        examples.append(Example(torch.tensor(seq), 3, "x", loaded=feats))
    batch = _batch(examples, 3, 32)
    rows = target.get_output_embeddings().weight.detach()[vocab_ids]
    with torch.no_grad():
        total, stats = ttt_losses(head, rows, batch, 3, 0.8)
        W = batch["aux"].shape[1]
        expected = 0.0
        for k, pre in enumerate(ttt_forward(head, batch, 3)):
            at = batch["valid"][:, k : k + W].nonzero(as_tuple=True)
            logits = head.logits(pre[at])
            teacher_logits = batch["final"][:, k : k + W][at] @ rows.T
            loss = -(torch.softmax(teacher_logits, -1) * F.log_softmax(logits, -1)).sum(-1).mean()
            expected += 0.8 ** k * float(loss)
            assert stats[f"acc{k}"] == pytest.approx(float((logits.argmax(-1) == teacher_logits.argmax(-1)).float().mean()))
    assert float(total) == pytest.approx(expected, rel=1e-5)


def test_row_drafter_with_eagle3_head_equals_cache_free_rollouts_under_forced_acceptance():
    from draftwise.drafters.eagle import EagleRowsDrafter

    target = _target()
    head = _head(target, torch.arange(0, 64, 2))  # a reduced draft vocabulary
    drafter = EagleRowsDrafter(head, 64, torch.device("cpu"))

    rng = random.Random(2)
    rows = [Row([rng.randrange(64) for _ in range(n)]) for n in (3, 7, 5)]
    for b, row in enumerate(rows):
        drafter.admit(b, row.sequence)
        drafter.observe(b, 0, _features(target, row.sequence)[: len(row.sequence) - 1])
    for _ in range(6):
        limits = [rng.randint(1, 4) for _ in rows]
        proposal = drafter.propose(rows, limits)
        for b, row in enumerate(rows):
            drafted = proposal.tokens[b, : proposal.counts[b]].tolist()
            assert drafted == _rollout(head, target, row.sequence, limits[b]), b
            fed = row.sequence + drafted
            drafter.observe(b, len(row.sequence) - 1, _features(target, fed)[len(row.sequence) - 1 :])
            keep = rng.randint(0, len(drafted))
            row.sequence += drafted[:keep] + [rng.randrange(64)]
            drafter.rewind(b, len(row.sequence) - 1)


@pytest.mark.parametrize("batched", [False, True])
def test_sd_with_eagle3_head_equals_ar_token_for_token_at_t0(batched):
    target = _target()
    head = _head(target, torch.arange(64), scale=1.0)
    prompts = [[1, 2, 3], [5, 9, 11, 20, 7], [33]]
    kwargs = dict(method="sd", temperature=0, max_new_tokens=24, gamma=4, ignore_eos=True)
    if batched:
        kwargs["max_batch_size"] = 3
    ar = draftwise.generate(target, prompts if batched else prompts[1], method="ar", temperature=0,
                            max_new_tokens=24, ignore_eos=True, **({"max_batch_size": 3} if batched else {}))
    sd = draftwise.generate(target, prompts if batched else prompts[1], draft=head, **kwargs)
    ar, sd = (ar, sd) if batched else ([ar], [sd])
    for a, s in zip(ar, sd):
        assert s.token_ids == a.token_ids
    assert sum(s.stats["drafted"] for s in sd) > 0


def test_eagle3_head_saves_loads_and_refuses_another_target(tmp_path):
    target = _target()
    head = _head(target, torch.arange(0, 64, 2))
    head.save(tmp_path / "h32", dtype=torch.float32)
    back = Eagle3Head.load(tmp_path / "h32").attach(target)
    x = torch.randn(1, 5, head.feature_size)
    t = torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(back.logits(back(x, t)), head.logits(head(x, t)))
    head.save(tmp_path / "h")  # fp16 by default: half the bytes
    assert (tmp_path / "h" / "eagle3.safetensors").stat().st_size < 0.6 * (tmp_path / "h32" / "eagle3.safetensors").stat().st_size
    other = tiny_llama(0, layers=4, width=48, vocab=64)
    with pytest.raises(DraftwiseError, match="trained for a target"):
        Eagle3Head.load(tmp_path / "h").attach(other)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "eagle3.json").write_text("{not json")
    with pytest.raises(DraftwiseError, match="not a readable EAGLE-3 head"):
        Eagle3Head.load(tmp_path / "bad")


# ---------------------------------------------------------------- data with online feature capture


class _Prompt:
    def __init__(self, uid, text):
        self.uid, self.source, self.category, self.text = uid, "test", "writing", text


def _loaded(target):
    tok = tiny_tokenizer(64)
    return LoadedModel(target, tok, "tiny", frozenset({tok.eos_token_id}))


def test_generate_shards_captures_the_features_a_cache_free_forward_gives_and_resumes(tmp_path):
    from draftwise.training.shards import generate_shards, read_shards, shard_paths

    target = _target()
    loaded = _loaded(target)
    encode = lambda text: loaded.tokenizer(text)["input_ids"]  # noqa: E731
    prompts = [_Prompt(f"p{i}", t) for i, t in enumerate(
        ["the cat sat", "a small draft model", "once upon a time there", "the target verifies", "speculative",
         "the dog sat on the log and"])]
    out = tmp_path / "shards"
    import time

    nothing = generate_shards(loaded, prompts, out, max_new_tokens=9, batch_size=3, temperature=0.0, tag="greedy",
                              shard_size=2, layers=LAYERS, encode=encode, deadline=time.monotonic() - 1)
    assert nothing["sequences"] == 0 and shard_paths(out) == []  # a spent budget writes nothing, and no half shard
    first = generate_shards(loaded, prompts[:4], out, max_new_tokens=9, batch_size=3, temperature=0.0, tag="greedy",
                            shard_size=2, layers=LAYERS, encode=encode)
    assert first["sequences"] == 4 and len(shard_paths(out)) == 2
    (out / "shard-00009.safetensors.tmp").write_bytes(b"half a shard")  # an interrupted write is ignored
    second = generate_shards(loaded, prompts, out, max_new_tokens=9, batch_size=3, temperature=0.0, tag="greedy",
                             shard_size=2, layers=LAYERS, encode=encode)
    assert second["sequences"] == 2 and second["skipped"] == 4
    seen = []
    for s in read_shards(out, layers=LAYERS):
        seen.append(s.uid)
        seq = s.tokens.tolist()
        expected = _features(target, seq)
        assert s.features.shape == expected.shape
        torch.testing.assert_close(s.features[:-1].float(), expected[:-1], atol=2e-2, rtol=1e-2)
        assert float(s.features[-1].abs().sum()) == 0.0
        # greedy answers: the target's argmax at each answer position's predecessor
        # (the data was generated on draftwise's forward, the reference is transformers': fp32 in two summation
        # orders, so a near-tie may go either way; a token that is not the argmax must be within 1e-3 of it)
        logits = target.lm_head(expected[s.answer_start - 1 : -1, -32:])
        chosen = logits.gather(-1, torch.tensor(seq[s.answer_start :])[:, None])[:, 0]
        assert float((logits.max(-1).values - chosen).max()) < 1e-3, (logits.argmax(-1).tolist(), seq[s.answer_start :])
    assert sorted(seen) == sorted(p.uid for p in prompts)
    with pytest.raises(DraftwiseError, match="layers"):
        next(read_shards(out, layers=(1, 2, 3)))


def test_answer_chunks_resume_and_their_features_equal_a_cache_free_forward(tmp_path):
    """The durable half of the data (token ids only): answers resume by (uid, tag), a stray temporary file is
    ignored, and the features made from them in one prefill equal the cache-free forward's (and the shards
    captured while decoding)."""
    from draftwise.training.answers import (chunk_paths, features_from_answers, generate_answers_chunks,
                                            read_answers)
    from draftwise.training.shards import generate_shards, read_shards

    target = _target()
    loaded = _loaded(target)
    encode = lambda text: loaded.tokenizer(text)["input_ids"]  # noqa: E731
    prompts = [_Prompt(f"p{i}", t) for i, t in enumerate(
        ["the cat sat", "a small draft model", "once upon a time there", "the target verifies", "speculative",
         "the dog sat on the log and"])]
    out = tmp_path / "answers"
    kw = dict(max_new_tokens=9, batch_size=3, temperature=0.0, tag="greedy", encode=encode)
    first = generate_answers_chunks(loaded, prompts[:4], out, chunk_size=3, **kw)
    assert first["sequences"] == 4 and len(chunk_paths(out)) == 2
    (out / ".answers-greedy-00009.npz.x").write_bytes(b"half a chunk")  # an interrupted write is not a chunk
    second = generate_answers_chunks(loaded, prompts, out, chunk_size=3, **kw)
    assert second["sequences"] == 2 and second["skipped"] == 4
    answers = list(read_answers(out))
    assert sorted(a.uid for a in answers) == sorted(p.uid for p in prompts)
    assert list(read_answers(out, tags=["t1"])) == [] and list(read_answers(out, sources={"magpie"})) == []
    assert len(list(read_answers(out, tags=["greedy"], sources={"test"}))) == len(prompts)
    feats = features_from_answers(loaded, answers, tmp_path / "f", layers=LAYERS, shard_size=4, batch_tokens=40)
    assert feats["sequences"] == 6 and features_from_answers(loaded, answers, tmp_path / "f",
                                                               layers=LAYERS)["skipped"] == 6
    generate_shards(loaded, prompts, tmp_path / "decoded", layers=LAYERS, shard_size=4, answers_dir=tmp_path / "kept",
                    **kw)
    decoded = {s.uid: s for s in read_shards(tmp_path / "decoded", layers=LAYERS)}
    # the shards' answers kept beside them (--keep-answers): one chunk a shard, the same tokens, finish reasons
    kept = list(read_answers(tmp_path / "kept"))
    assert len(chunk_paths(tmp_path / "kept")) == 2 and sorted(a.uid for a in kept) == sorted(decoded)
    for a in kept:
        assert a.prompt_ids + a.answer_ids == decoded[a.uid].tokens.tolist()
        assert len(a.prompt_ids) == decoded[a.uid].answer_start and a.finish_reason in ("stop", "length", "eos")
    for s in read_shards(tmp_path / "f", layers=LAYERS):
        expected = _features(target, s.tokens.tolist())
        torch.testing.assert_close(s.features[:-1].float(), expected[:-1], atol=2e-2, rtol=1e-2)
        assert float(s.features[-1].abs().sum()) == 0.0
        assert torch.equal(s.tokens, decoded[s.uid].tokens) and s.answer_start == decoded[s.uid].answer_start
        torch.testing.assert_close(s.features.float(), decoded[s.uid].features.float(), atol=2e-2, rtol=1e-2)
    bad = out / "answers-greedy-00099.npz"
    bad.write_bytes(b"not numpy")
    with pytest.raises(DraftwiseError, match="answers-greedy-00099"):
        list(read_answers(out))


def test_feature_noise_is_uniform_in_units_of_each_dimensions_scale():
    from draftwise.training.eagle3_train import with_feature_noise

    torch.manual_seed(0)
    aux = torch.randn(2, 50, 6) * 4
    scale = torch.tensor([0.5, 1.0, 2.0, 8.0, 0.1, 3.0])
    noisy = with_feature_noise(aux, scale, 0.2)
    relative = (noisy - aux) / scale
    assert float(relative.abs().max()) <= 0.2 + 1e-6
    assert float(relative.abs().max()) > 0.18  # it reaches the amplitude in every dimension's units...
    assert abs(float(relative.mean())) < 0.02  # ...centred on zero
    for d in range(6):  # the same spread in every dimension
        assert 0.1 < float(relative[..., d].std()) < 0.13  # uniform on [-a, a]: a / sqrt(3) = 0.115
    assert not torch.equal(with_feature_noise(aux, scale, 0.2), noisy)
    assert torch.equal(with_feature_noise(aux, scale, 0.0), aux)


def test_eagle3_training_lowers_the_loss_resumes_and_drafts_exactly(tmp_path):
    from draftwise.training.eagle3_train import Eagle3TrainConfig, train_eagle3
    from draftwise.training.shards import generate_shards

    target = _target(vocab=64)
    loaded = _loaded(target)
    encode = lambda text: loaded.tokenizer(text)["input_ids"]  # noqa: E731
    words = "the cat sat on the mat and the dog sat on the log once upon a time".split()
    rng = random.Random(0)
    prompts = [_Prompt(f"p{i}", " ".join(rng.choice(words) for _ in range(4))) for i in range(24)]
    generate_shards(loaded, prompts, tmp_path / "d", max_new_tokens=16, batch_size=8, temperature=0.0, tag="greedy",
                    shard_size=8, layers=LAYERS, encode=encode)
    cfg = Eagle3TrainConfig(data=str(tmp_path / "d"), out=str(tmp_path / "h"), draft_vocab=40, intermediate_size=48,
                            batch_size=4, steps=40, lr=3e-3, warmup=4, ttt_steps=3, checkpoint_every=10,
                            val_fraction=0.2, bf16=False)
    first = train_eagle3(cfg, target, eos_ids={loaded.tokenizer.eos_token_id}, stop_at=1, feature_layers=LAYERS)
    assert first["steps"] == 1 and not first["finished"]
    resumed = train_eagle3(cfg, target, eos_ids={loaded.tokenizer.eos_token_id}, feature_layers=LAYERS)
    assert resumed["steps"] == 40 and resumed["finished"]
    assert resumed["validation"]["loss"] < first["validation"]["loss"]
    head = Eagle3Head.load(tmp_path / "h" / "head").attach(target)
    prompt = encode("the cat sat on")
    ar = draftwise.generate(target, prompt, method="ar", temperature=0, max_new_tokens=16, ignore_eos=True)
    sd = draftwise.generate(target, prompt, draft=head, method="sd", temperature=0, max_new_tokens=16, gamma=3,
                            ignore_eos=True)
    assert sd.token_ids == ar.token_ids

    # fine-tuning: a run started from the trained head begins at its weights and draft vocabulary (zero steps
    # leave the head as it was), and a head of another shape is refused in one line
    tuned = dataclasses.replace(cfg, out=str(tmp_path / "t"), init_from=str(tmp_path / "h" / "head"), lr=1e-9)
    same = train_eagle3(tuned, target, eos_ids={loaded.tokenizer.eos_token_id}, stop_at=0, feature_layers=LAYERS)
    assert same["steps"] == 0
    assert same["validation"]["loss"] == pytest.approx(resumed["validation"]["loss"], rel=1e-4)
    assert (tmp_path / "t" / "vocab_ids.json").read_text() == (tmp_path / "h" / "vocab_ids.json").read_text()
    wider = dataclasses.replace(tuned, out=str(tmp_path / "w"), intermediate_size=64)
    with pytest.raises(DraftwiseError, match="--init-from .*width 48"):
        train_eagle3(wider, target, eos_ids={loaded.tokenizer.eos_token_id}, stop_at=0, feature_layers=LAYERS)
    other = tiny_llama(5, layers=4, width=48, vocab=64)  # another target's head, same layers and head width
    vocab_ids = torch.tensor(json.loads((tmp_path / "h" / "vocab_ids.json").read_text()))
    Eagle3Head.new(other, vocab_ids=vocab_ids, intermediate_size=48, feature_layers=LAYERS,
                   shared_lm_head=cfg.shared_lm_head).save(tmp_path / "other")
    foreign = dataclasses.replace(tuned, out=str(tmp_path / "f"), init_from=str(tmp_path / "other"))
    with pytest.raises(DraftwiseError, match="--init-from .*target of width 48"):
        train_eagle3(foreign, target, eos_ids={loaded.tokenizer.eos_token_id}, stop_at=0, feature_layers=LAYERS)


def test_confidence_stop_shortens_drafts_and_stays_exact_at_t0(tmp_path):
    from dataclasses import replace

    target = _target()
    head = _head(target, torch.arange(64), scale=1.0)
    prompt = [5, 9, 11, 20, 7]
    kw = dict(method="sd", temperature=0, max_new_tokens=24, gamma=5, ignore_eos=True)
    ar = draftwise.generate(target, prompt, method="ar", temperature=0, max_new_tokens=24, ignore_eos=True)
    fixed = draftwise.generate(target, prompt, draft=head, confidence=0.0, **kw)
    high = draftwise.generate(target, prompt, draft=head, confidence=0.999, **kw)
    assert fixed.token_ids == high.token_ids == ar.token_ids
    assert high.stats["drafted"] < fixed.stats["drafted"]
    # -1 (the default) reads the head's tuned value
    tuned = _head(target, torch.arange(64), scale=1.0)
    tuned.config = replace(tuned.config, dynamic={"confidence": 0.999})
    auto = draftwise.generate(target, prompt, draft=tuned, **kw)
    assert auto.stats["drafted"] == high.stats["drafted"]
    with pytest.raises(DraftwiseError, match="confidence"):
        draftwise.generate(target, prompt, draft=head, confidence=1.5, **kw)


def test_head_bonus_distribution_equals_a_cache_free_rollout_and_drafting_goes_on():
    """Cascades' bonus from pi: after verification the head catches up on the accepted positions and scores the
    next token exactly as a cache-free head would; the rewind that follows leaves drafting consistent."""
    from draftwise.drafters.eagle import EagleRowsDrafter

    target = _target()
    head = _head(target, torch.arange(0, 64, 2))
    drafter = EagleRowsDrafter(head, 64, torch.device("cpu"), keep_raw=True)

    def next_logits(seq):
        aux = _features(target, seq)[: len(seq) - 1, : head.feature_size]
        with torch.no_grad():
            x = torch.cat([head.embed(torch.tensor([seq[1:]])), head.fuse(aux)[None]], dim=-1)
            return head.logits(head.body(x).last_hidden_state[0, -1])

    rng = random.Random(5)
    rows = [Row([rng.randrange(64) for _ in range(n)]) for n in (4, 6)]
    for b, row in enumerate(rows):
        drafter.admit(b, row.sequence)
        drafter.observe(b, 0, _features(target, row.sequence)[: len(row.sequence) - 1])
    for _ in range(5):
        limits = [rng.randint(1, 4) for _ in rows]
        proposal = drafter.propose(rows, limits)
        contexts = []
        for b, row in enumerate(rows):
            drafted = proposal.tokens[b, : proposal.counts[b]].tolist()
            assert drafted == _rollout(head, target, row.sequence, limits[b])
            drafter.observe(b, len(row.sequence) - 1, _features(target, row.sequence + drafted)[len(row.sequence) - 1 :])
            contexts.append(row.sequence + drafted[: rng.randint(0, len(drafted))])
        raw, _ = drafter.next_distribution(contexts, [GREEDY, GREEDY])
        for b, context in enumerate(contexts):
            expected = torch.full((64,), float("-inf"))
            expected[head.vocab_ids] = next_logits(context)
            torch.testing.assert_close(raw[b], torch.softmax(expected, -1), atol=1e-5, rtol=1e-4)
            bonus = int(raw[b].argmax())
            rows[b].sequence = context + [bonus]
            drafter.rewind(b, len(rows[b].sequence) - 1)


def test_a_head_is_refused_with_the_reason_where_it_cannot_draft():
    target = _target()
    head = _head(target, torch.arange(64))
    for method, reason in (("oracle-diff", "each decode alone"), ("seq-cascade", "whole response"),
                           ("staged", "companion"), ("sv", "unwarped distributions")):
        with pytest.raises(DraftwiseError, match=reason):
            draftwise.generate(target, [1, 2, 3], draft=head, method=method, temperature=0, max_new_tokens=4)


@pytest.mark.parametrize("method", ["lossy", "cascade", "token-cascade", "adaedl", "fly", "bild", "svip"])
def test_every_token_wise_rule_runs_with_an_eagle3_head(method):
    target = _target()
    head = _head(target, torch.arange(64), scale=1.0)
    out = draftwise.generate(target, [[1, 2, 3], [4, 5]], draft=head, method=method, temperature=0,
                             max_new_tokens=12, ignore_eos=True, max_batch_size=2)
    assert all(len(g.token_ids) == 12 for g in out)


def test_a_shared_lm_head_is_not_stored_and_comes_back_from_the_target(tmp_path):
    target = _target()
    torch.manual_seed(1)
    head = Eagle3Head.new(target, vocab_ids=torch.arange(0, 64, 2), intermediate_size=48, feature_layers=LAYERS,
                          shared_lm_head=True).eval()
    assert not head.lm_head.weight.requires_grad
    torch.testing.assert_close(head.lm_head.weight, target.lm_head.weight[0::2])
    head.save(tmp_path / "h", dtype=torch.float32)
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(str(tmp_path / "h" / "eagle3.safetensors"))
    back = Eagle3Head.load(tmp_path / "h").attach(target)
    x, t = torch.randn(1, 5, head.feature_size), torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(back.logits(back(x, t)), head.logits(head(x, t)))


def test_mtad_beams_on_a_head_equal_a_brute_force_beam_search_under_forced_acceptance():
    """MTAD's drafter on the head: each proposal (best beam and its joint log-probabilities) equals a beam search
    whose every distribution is a cache-free head rollout; then a forced outcome and rewind, and again."""
    from draftwise.drafters.eagle import EagleRowsDrafter
    from draftwise.drafters.mtad import BeamRowsDrafter, beam_log_probs

    target = _target()
    head = _head(target, torch.arange(0, 64, 2), scale=1.0)
    beams_wanted = 3

    def logprobs_after(seq, beam):
        aux = _features(target, seq)[: len(seq) - 1, : head.feature_size]
        with torch.no_grad():
            states, tokens = list(head.fuse(aux)), list(seq[1:])
            pre = None
            for step in range(len(beam) + 1):
                x = torch.cat([head.embed(torch.tensor([tokens])), torch.stack(states)[None]], dim=-1)
                pre = head.body(x).last_hidden_state[0, -1]
                if step < len(beam):
                    states.append(pre)
                    tokens.append(beam[step])
            full = torch.full((64,), float("-inf"))
            full[head.vocab_ids] = head.logits(pre)
            return beam_log_probs(full[None], [GREEDY])[0]

    def brute(seq, length):
        beams = [([], 0.0, [])]
        for _ in range(length):
            candidates = []
            for tokens, score, joints in beams:
                lp = logprobs_after(seq, tokens)
                for v in range(64):
                    if torch.isfinite(lp[v]):
                        candidates.append((tokens + [v], score + float(lp[v]), joints + [score + float(lp[v])]))
            candidates.sort(key=lambda c: -c[1])
            beams = candidates[:beams_wanted]
        return max(beams, key=lambda b: b[1])

    drafter = BeamRowsDrafter(EagleRowsDrafter(head, 64, torch.device("cpu")), 64, beams_wanted)
    rng = random.Random(7)
    rows = []
    for b in range(2):  # two rows drafting together, each with its own forced outcomes
        seq = [rng.randrange(64) for _ in range(6 + 3 * b)]
        drafter.admit(b, seq)
        drafter.observe(b, 0, _features(target, seq)[: len(seq) - 1])
        rows.append(SimpleNamespace(sequence=seq, request=SimpleNamespace(sampling=GREEDY), grammar=None,
                                    generator=make_generator(b)))
    for _ in range(4):
        limits = [rng.randint(1, 3) for _ in rows]
        draft = drafter.propose(rows, limits)
        for b, row in enumerate(rows):
            seq = row.sequence
            tokens, _, joints = brute(seq, limits[b])
            drafted = draft.tokens[b, : draft.counts[b]].tolist()
            assert drafted == tokens
            torch.testing.assert_close(draft.joint[b, : draft.counts[b]], torch.tensor(joints), atol=1e-4, rtol=1e-4)
            drafter.observe(b, len(seq) - 1, _features(target, seq + drafted)[len(seq) - 1 :])
            row.sequence = seq + drafted[: rng.randint(0, len(drafted))] + [rng.randrange(64)]
            drafter.rewind(b, len(row.sequence) - 1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_cascade_with_a_head_batches_like_single_requests(temperature):
    """Algorithm 4's bonus from pi reads the head past the drafts only for rows that accepted every drafted token: a
    batch mixing rejections and full acceptances runs (it once lost a rejected row's target features and failed) and
    gives each request the tokens it gets alone."""
    target = _target()
    head = _head(target, torch.arange(64), scale=1.0)
    prompts = [[1, 2, 3, 4], [9, 8, 7], [5, 5, 6, 1, 2], [30]]
    kwargs = dict(draft=head, method="cascade", rule="diff", alpha=0.05, temperature=temperature, seed=4,
                  max_new_tokens=20, gamma=3, ignore_eos=True)
    batch = draftwise.generate(target, prompts, max_batch_size=4, **kwargs)
    alone = [draftwise.generate(target, p, **kwargs) for p in prompts]
    assert [g.token_ids for g in batch] == [g.token_ids for g in alone]
    accepted = [g.stats["accepted"] for g in batch]
    drafted = [g.stats["drafted"] for g in batch]
    assert 0 < sum(accepted) < sum(drafted)  # both rejections and acceptances happened


def test_mtad_runs_on_a_head():
    target = _target()
    head = _head(target, torch.arange(64), scale=1.0)
    for temperature in (0.0, 1.0):
        out = draftwise.generate(target, [1, 2, 3, 4], draft=head, method="mtad", temperature=temperature,
                                 max_new_tokens=16, ignore_eos=True, seed=0)
        assert len(out.token_ids) == 16 and out.stats["drafted"] > 0


def test_train_eagle3_and_export_cli_on_a_tiny_target(tmp_path):
    import json
    import subprocess
    import sys

    from draftwise.heads.eagle3 import eagle3_layers
    from draftwise.training.shards import generate_shards

    target = _target()
    tok = tiny_tokenizer(64)
    target.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    loaded = _loaded(target)
    prompts = [_Prompt(f"p{i}", t) for i, t in enumerate(["the cat sat", "a small draft", "once upon a time"] * 3)]
    for i, p in enumerate(prompts):
        p.uid = f"p{i}"
    generate_shards(loaded, prompts, tmp_path / "d", max_new_tokens=8, batch_size=4, temperature=0.0, tag="greedy",
                    shard_size=4, layers=eagle3_layers(4), encode=lambda text: loaded.tokenizer(text)["input_ids"])

    def cli(*argv):
        return subprocess.run([sys.executable, "-m", "draftwise", *argv], capture_output=True, text=True,
                              env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})

    run = cli("train-eagle3", "--target", str(tmp_path / "target"), "--data", str(tmp_path / "d"), "--out",
              str(tmp_path / "o"), "--steps", "3", "--draft-vocab", "40", "--intermediate-size", "48", "--batch-size",
              "2", "--warmup", "1", "--ttt-steps", "2", "--fp32", "--feature-noise", "0.1")
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads((tmp_path / "o" / "distill-report.json").read_text())
    assert report["steps"] == 3 and report["finished"] and report["config"]["feature_noise"] == 0.1
    run = cli("export-eagle", "--head", str(tmp_path / "o" / "head"), "--out", str(tmp_path / "x"), "--target",
              str(tmp_path / "target"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "x" / "config.json").is_file()
    for argv, message in ((("train-eagle3", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "o2"),
                            "--target", str(tmp_path / "target")), "no feature shards"),
                          (("train-eagle3", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o3"), "--steps", "0"),
                           "--steps must be >= 1"),
                          (("train-eagle3", "--data", str(tmp_path / "d"), "--out", str(tmp_path / "o4"),
                            "--feature-noise", "-0.5"), "--feature-noise must be a finite number >= 0")):
        run = cli(*argv)
        assert run.returncode != 0 and message in run.stderr and "Traceback" not in run.stderr, run.stderr[-1500:]


# ------------------------------------------------------------------ SPRINTER and SpecDec++ on a head (issue 13)

def _rollout_states(head, target, seq, limit):
    """Cache-free greedy drafts and the head state behind each one (what a verifier reads)."""
    aux = list(_features(target, seq)[: len(seq) - 1, : head.feature_size])
    tokens, states, out = list(seq[1:]), [], []
    with torch.no_grad():
        states = list(head.fuse(torch.stack(aux)))
        for _ in range(limit):
            x = torch.cat([head.embed(torch.tensor([tokens])), torch.stack(states)[None]], dim=-1)
            pre = head.body(x).last_hidden_state[0, -1]
            token = int(head.vocab_ids[head.logits(pre).argmax()])
            out.append((token, pre))
            states.append(pre)
            tokens.append(token)
    return out


def test_verifier_policy_on_a_head_reads_the_states_of_a_cache_free_rollout():
    """The head drafter hands a verifier policy the head state behind each drafted token (and the unwarped
    distribution), checked under forced acceptance against cache-free rollouts; the first-step state is the one
    `train-verifier` collects for that prefix."""
    from draftwise.drafters.eagle import EagleRowsDrafter
    from draftwise.drafters.policies import FixedLength
    from draftwise.training.verifier import _head_outputs

    class Recording(FixedLength):
        needs_hidden = needs_raw = True

        def __init__(self):
            self.seen = []

        def after(self, hidden, tokens, q_raw):
            self.seen.append((hidden.clone(), tokens.clone(), q_raw.clone()))
            return super().after(hidden, tokens, q_raw)

    target = _target()
    head = _head(target, torch.arange(0, 64, 2), scale=1.0)  # moderate states: fp32 agreement to 1e-4
    policy = Recording()
    drafter = EagleRowsDrafter(head, 64, torch.device("cpu"), policy=policy)
    rng = random.Random(5)
    rows = [Row([rng.randrange(64) for _ in range(n)]) for n in (4, 7)]
    for b, row in enumerate(rows):
        drafter.admit(b, row.sequence)
        drafter.observe(b, 0, _features(target, row.sequence)[: len(row.sequence) - 1])
    loaded = draftwise.load_model(target)
    for _ in range(4):
        limits = [rng.randint(1, 4) for _ in rows]
        policy.seen.clear()
        proposal = drafter.propose(rows, limits)
        for b, row in enumerate(rows):
            expected = _rollout_states(head, target, row.sequence, limits[b])
            for step, (token, state) in enumerate(expected):
                hidden, tokens, raw = policy.seen[step]
                assert int(tokens[b]) == token
                torch.testing.assert_close(hidden[b], state, atol=1e-4, rtol=1e-4)
                assert (raw[b][1::2] == 0).all()  # zero probability outside the draft vocabulary
                torch.testing.assert_close(raw[b][0::2], torch.softmax(head.logits(state), -1), atol=1e-4, rtol=1e-3)
            collected, _ = _head_outputs(loaded, head, torch.tensor(row.sequence), 64)
            torch.testing.assert_close(collected[len(row.sequence) - 2], expected[0][1], atol=1e-3, rtol=1e-3)
            drafted = proposal.tokens[b, : proposal.counts[b]].tolist()
            fed = row.sequence + drafted
            drafter.observe(b, len(row.sequence) - 1, _features(target, fed)[len(row.sequence) - 1 :])
            keep = rng.randint(0, len(drafted))
            row.sequence += drafted[:keep] + [rng.randrange(64)]
            drafter.rewind(b, len(row.sequence) - 1)


@pytest.fixture(scope="module")
def head_verifiers(tmp_path_factory):
    """A SPRINTER verifier and a SpecDec++ head trained on a tiny EAGLE-3 head's states (train-verifier's data)."""
    from draftwise.training.verifier import VerifierDataConfig, VerifierTrainConfig, collect, spec_base, train

    target = _target()
    loaded = draftwise.load_model(target)
    head = _head(target, torch.arange(0, 64, 2), scale=1.5)
    with torch.no_grad():  # this head's labels need both classes in every split: its drafts as they were tuned
        head.feature_scale.fill_(1.0)
    config = VerifierDataConfig(continuation=12, per_kind=6)
    data = collect(loaded, head, [[i, i + 1, i + 2, 5, 6, 7] for i in range(40)], config, vocab_size=64)
    assert set(data["kind"].tolist()) == {0, 2, 3}  # no draft-only completions for a head
    base = spec_base(head, "tiny-head", config, loaded, "tiny")
    out = tmp_path_factory.mktemp("head-verifiers")
    paths = {}
    for objective in ("sprinter", "acceptance"):
        verifier, report = train(data, VerifierTrainConfig(lam=1.2, features=("hidden", "stats"),
                                                           objective=objective), base)
        paths[objective] = out / f"{objective}.pt"
        verifier.save(paths[objective])
    return target, head, paths


def test_sprinter_and_specdecpp_run_on_a_head(head_verifiers):
    target, head, paths = head_verifiers
    g = draftwise.generate(target, [1, 2, 3], draft=head, method="sprinter", verifier=str(paths["sprinter"]),
                           max_run=6, max_new_tokens=30, seed=1, ignore_eos=True, temperature=1.0)
    s = g.stats
    assert s["verifier_calls"] == s["drafted"] > 0 and s["target_calls"] == s["steps"]
    assert len(g.token_ids) == 30
    g = draftwise.generate(target, [1, 2, 3], draft=head, method="specdec++", head=str(paths["acceptance"]),
                           max_new_tokens=30, seed=1, ignore_eos=True, gamma=5, temperature=1.0)
    assert g.stats["drafted"] > 0 and len(g.token_ids) == 30
    # a verifier trained on this head refuses another head, and an independent draft's refuses this head
    other = _head(target, torch.arange(0, 64, 2), scale=1.5, seed=9)
    with pytest.raises(DraftwiseError, match="another draft model"):
        draftwise.generate(target, [1, 2, 3], draft=other, method="sprinter", verifier=str(paths["sprinter"]),
                           temperature=1.0)


def test_specdecpp_on_a_head_is_exact_at_t0(head_verifiers):
    from draftwise.heads.sprinter import Verifier, VerifierSpec, draft_fingerprint

    target, head, _ = head_verifiers
    spec = VerifierSpec(features=("hidden", "stats"), input_size=32 + 3, draft_fingerprint=draft_fingerprint(head),
                        temperature=0.0, extra={"objective": "acceptance"})
    path = Path(tempfile.mkdtemp()) / "greedy-head.pt"
    Verifier(spec).save(path)
    ar = draftwise.generate(target, [5, 9, 11], method="ar", temperature=0, max_new_tokens=24, ignore_eos=True)
    sd = draftwise.generate(target, [5, 9, 11], draft=head, method="specdec++", head=str(path), temperature=0,
                            max_new_tokens=24, ignore_eos=True)
    assert sd.token_ids == ar.token_ids and sd.stats["drafted"] > 0


def _body_and_logits(head, features, tokens):
    """The head body's states over `features` [1, n, F] and next `tokens` [1, n], and its logits, without autograd
    (where a packed head runs its packed products)."""
    with torch.inference_mode():
        states = head.body(head.step_input(features, tokens)).last_hidden_state
        return states, head.logits(states)


def test_prepacked_products_match_the_modules_and_are_dropped_when_weights_may_change():
    """pack_for_inference: the same states and logits as the nn.Linear modules (fp32: to rounding), used only in
    eval mode without autograd, and dropped by .to(), train() and load_state_dict (stale copies never run)."""
    target = _target()
    head = _head(target, torch.arange(0, 64, 2))
    seq = [3, 9, 27, 17, 5, 40]
    x = _features(target, seq)[None, :, : head.feature_size]
    tokens = torch.tensor([seq[1:] + [1]])

    plain = _body_and_logits(head, x, tokens)
    head.pack_for_inference()
    with torch.inference_mode():
        assert head.body.packed() is not None
    packed = _body_and_logits(head, x, tokens)
    for a, b in zip(plain, packed):  # two fp32 products in different orders (measured up to 3.7e-4 apart)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    assert head.body.packed() is None  # autograd on: the modules, whose gradients training needs
    head.to(torch.float64)
    with torch.inference_mode():
        assert head.body.packed() is None
    head.float().pack_for_inference()
    head.train()
    with torch.inference_mode():
        assert head.body.packed() is None
    head.eval().pack_for_inference()
    state = {k: v.clone() for k, v in head.state_dict().items()}
    head.load_state_dict(state)
    with torch.inference_mode():
        assert head.body.packed() is None


def test_a_packed_head_is_packed_once_and_again_after_an_in_place_weight_change():
    """A drafter per request packs the head: the products of unchanged weights are kept, and a weight changed in
    place (its version counter moves) packs afresh, so the new weights run."""
    target = _target()
    head = _head(target, torch.arange(0, 64, 2)).eval()
    pre = torch.randn(1, 3, head.lm_head.in_features)
    head.pack_for_inference()
    with torch.inference_mode():
        first, before = head.body.packed(), head.logits(pre)
    head.pack_for_inference()
    with torch.inference_mode():
        assert head.body.packed() is first
    with torch.no_grad():
        head.lm_head.weight.mul_(2.0)
    head.pack_for_inference()
    with torch.inference_mode():
        assert head.body.packed() is not first
        after = head.logits(pre)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, head.lm_head(head.norm(pre)), rtol=1e-3, atol=1e-3)


def test_q8_0_blocks_round_trip_and_are_stable_when_quantised_again():
    """q8_0_blocks writes GGUF Q8_0 (an fp16 scale max|w| / 127 and 32 int8 codes a block): the reference decoder
    reads each weight back within half a scale step, and quantising the decoded weights again gives the same bytes
    (a head stored in Q8_0 and packed again at load is the head that was stored)."""
    from draftwise.models import linear as linears
    from draftwise.models.quant import _decode

    torch.manual_seed(0)
    w = torch.randn(24, 96) * torch.logspace(-3, 0, 24)[:, None]
    w[3] = 0.0  # an all-zero row: scale 0, codes 0
    blocks = linears.q8_0_blocks(w)
    assert blocks.dtype == torch.uint8 and blocks.shape == (24, 3 * 34)
    back = _decode("q8_0", blocks.numpy()).dequantized()
    step = blocks.view(24, 3, 34)[..., :2].contiguous().view(torch.float16).float().reshape(24, 3)
    assert bool(((back - w).abs().reshape(24, 3, 32) <= step[..., None] / 2 + 1e-12).all())
    assert torch.equal(back[3], torch.zeros(96))
    assert torch.equal(linears.q8_0_blocks(back), blocks)
    with pytest.raises(ValueError, match="multiples of 32"):
        linears.q8_0_blocks(torch.randn(4, 40))


def test_a_head_packed_in_q8_0_blocks_drafts_close_to_its_floats_and_reads_the_targets_own_rows():
    """pack_for_inference(blocks=True): the products whose inputs are multiples of 32 run Q8_0 blocks on the block
    kernel (products of other widths stay in floats), close to the float head; with a target whose LM head is in
    a GGUF's blocks, the head's LM head is the target's rows of the draft vocabulary byte for byte. sd with it stays
    token for token `ar`'s at T=0."""
    from draftwise.models import linear as linears, qkernel

    if not qkernel.available():
        pytest.skip("the block kernel is not built here")
    target = tiny_llama(0, layers=4, width=64, vocab=64)
    rows = linears.q8_0_linear(target.lm_head.weight.detach())
    target.lm_head = linears.CodesProjection(rows)
    vocab_ids = torch.arange(0, 64, 2)
    torch.manual_seed(3)
    head = Eagle3Head.new(target, vocab_ids=vocab_ids, intermediate_size=96, feature_layers=LAYERS).eval()
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name != "lm_head.weight":
                p.add_(0.3 * torch.randn_like(p))
    seq = [3, 9, 27, 17, 5, 40, 11, 2]
    x = _features(target, seq)[None, :, : head.feature_size]
    tokens = torch.tensor([seq[1:] + [1]])

    head.pack_for_inference(blocks=False)
    floats = _body_and_logits(head, x, tokens)
    head.pack_for_inference(blocks=True)
    packed = head.body.__dict__["_packed"]
    assert all(isinstance(packed[k], linears.BlockLinear) for k in ("qkv", "o", "gate_up", "down", "fc", "lm_head"))
    assert torch.equal(packed["lm_head"].blocks, rows.blocks[vocab_ids])
    assert head.inference_bytes() == sum(p.nbytes() for p in packed.values())
    blocks = _body_and_logits(head, x, tokens)
    for a, b in zip(floats, blocks):  # int8 weights and activations: about 1% of the values' scale
        assert float((a - b).norm() / a.norm()) < 0.03
    head.pack_for_inference()  # a drafter's default keeps the packing chosen by name
    assert head.body.__dict__["_packed"] is packed
    ar = draftwise.generate(target, seq, method="ar", temperature=0, max_new_tokens=16, ignore_eos=True)
    sd = draftwise.generate(target, seq, method="sd", draft=head, temperature=0, max_new_tokens=16, gamma=4,
                            ignore_eos=True)
    assert head.body.__dict__["_packed"] is packed  # the drafter drafted with the blocks
    assert sd.token_ids == ar.token_ids and sd.stats["drafted"] > 0


def test_a_head_saved_in_q8_0_loads_as_the_blocks_it_runs(tmp_path):
    """save(dtype="q8_0") stores the matrices as Q8_0 blocks (about a quarter of fp32's bytes, a shared LM head not
    at all); the loaded head packed in blocks runs the very blocks the saved head ran, and drafts the same tokens."""
    from draftwise.models import linear as linears, qkernel

    target = tiny_llama(0, layers=4, width=64, vocab=64)
    torch.manual_seed(3)
    head = Eagle3Head.new(target, vocab_ids=torch.arange(0, 64, 2), intermediate_size=96, feature_layers=LAYERS,
                          shared_lm_head=True).eval()
    head.save(tmp_path / "fp16")
    head.save(tmp_path / "q8", dtype="q8_0")
    size = {name: (tmp_path / name / "eagle3.safetensors").stat().st_size for name in ("fp16", "q8")}
    assert size["q8"] < 0.6 * size["fp16"]
    back = Eagle3Head.load(tmp_path / "q8").attach(target).eval()
    for name in ("fc.weight", "body.midlayer.self_attn.q_proj.weight", "body.midlayer.mlp.down_proj.weight"):
        mine, theirs = dict(head.named_parameters())[name], dict(back.named_parameters())[name]
        assert torch.equal(linears.q8_0_blocks(mine), linears.q8_0_blocks(theirs))
    if qkernel.available():
        head.pack_for_inference(blocks=True)
        back.pack_for_inference(blocks=True)
        for key in ("qkv", "o", "gate_up", "down", "fc"):
            assert torch.equal(head.body.__dict__["_packed"][key].blocks, back.body.__dict__["_packed"][key].blocks)
        seq = [3, 9, 27, 17, 5, 40]
        runs = [draftwise.generate(target, seq, method="sd", draft=h, temperature=0, max_new_tokens=12,
                                   ignore_eos=True) for h in (head, back)]
        assert runs[0].token_ids == runs[1].token_ids and runs[0].stats["drafted"] == runs[1].stats["drafted"]
