"""`draftwise distill --kind eagle`: train an EAGLE draft head on a target's own features.

The frozen target runs once over the target's chat answers (`draftwise
train-data`); its last-layer features (fp16) and greedy tokens are kept for every epoch. The head learns to
predict feature t+1 from (feature t, token t+1): KL to the target's distribution
(over the draft vocabulary) plus a feature regression. A second pass feeds the
head its own predicted features in place of the target's (a training-time test,
as in EAGLE-3), so multi-token drafts do not collapse after the first step.
Loss covers answer positions only. Checkpoints are atomic; re-running resumes.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from draftwise.heads.eagle import EagleConfig, EagleHead
from draftwise.errors import DraftwiseError
from draftwise.training.data import read_answers
from draftwise.training.distill import pad_batch, read_examples, split_examples
from draftwise.training.loop import cosine_lr, train_loop


@dataclass(frozen=True)
class EagleTrainConfig:
    data: str
    out: str
    target_name: str = ""
    draft_vocab: int = 8192
    intermediate_size: int = 1536
    max_len: int = 384
    batch_size: int = 8
    steps: int = 1000
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    regression_weight: float = 1.0
    second_pass_weight: float = 0.7
    seed: int = 0
    checkpoint_every: int = 50
    val_fraction: float = 0.05
    loss_on: str = "all"  # "all" positions (prompt text too: the target's features are valid anywhere) or "answer"
    init_from: str = ""  # an EAGLE directory to start from (its draft vocabulary and weights): fine-tuning


def draft_vocabulary(path: Path, size: int, always: set[int]) -> torch.Tensor:
    """The `size` tokens the target emits most often in its answers (plus `always`), sorted by id."""
    counts: Counter[int] = Counter()
    for file in [Path(p) for p in str(path).split(",") if p]:
        for r in read_answers(file):
            counts.update(r["answer_ids"] or r["prompt_ids"])
    chosen = set(always) | {t for t, _ in counts.most_common(max(0, size - len(always)))}
    return torch.tensor(sorted(chosen)[:size], dtype=torch.long)


@torch.no_grad()
def target_features(target, examples: list, pad: int, batch_size: int = 8, progress=None) -> list[tuple]:
    """One frozen-target pass per example: (features [T, H] fp16, greedy tokens [T]) per example.

    Computed once and reused every epoch: the target's forward costs far more than the head's
    step. Batches are formed in length order so little compute goes to padding.
    """
    out: list[tuple | None] = [None] * len(examples)
    by_length = sorted(range(len(examples)), key=lambda i: len(examples[i][0]))
    for start in range(0, len(by_length), batch_size):
        indices = by_length[start : start + batch_size]
        ids, mask, _ = pad_batch([examples[i] for i in indices], pad)
        hidden = target(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]  # [B,T,H]
        greedy = target.get_output_embeddings()(hidden).argmax(-1)  # [B, T]
        for row, i in enumerate(indices):
            length = len(examples[i][0])
            out[i] = (hidden[row, :length].half(), greedy[row, :length])
        if progress:
            progress(len(indices))
    return out


def _features_batch(cached: list[tuple], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    hidden = cached[0][0].shape[-1]
    feats = torch.zeros(len(cached), width, hidden)
    greedy = torch.zeros(len(cached), width, dtype=torch.long)
    for row, (f, g) in enumerate(cached):
        feats[row, : f.shape[0]] = f.float()
        greedy[row, : g.shape[0]] = g
    return feats, greedy


def _losses(head: EagleHead, batch, cached: list[tuple], config: EagleTrainConfig) -> tuple[torch.Tensor, dict]:
    ids, _, labels = batch
    features, greedy = _features_batch(cached, ids.shape[1])  # [B,T,H], [B,T]
    full_argmax = greedy[:, 1:-1]  # the target's greedy token after position i+1
    feats_in, tokens_in, feats_out = features[:, :-1], ids[:, 1:], features[:, 1:]  # head position i -> feature i+1
    valid = (labels[:, 2:] != -100).float()  # [B, T-2]: positions whose predicted token is an answer token
    denom = valid.sum().clamp(min=1)
    with torch.no_grad():
        teacher = F.softmax(head.logits(feats_out[:, :-1]), dim=-1)  # [B, T-2, Vd]
    total = torch.zeros(())
    stats: dict[str, float] = {}
    predicted = None
    for pass_index, weight in ((1, 1.0), (2, config.second_pass_weight)):
        if pass_index == 2:  # training-time test: the head reads its own predicted features
            feats_in = torch.cat([features[:, :1], predicted[:, :-1].detach()], dim=1)
        predicted = head(feats_in, tokens_in)  # [B, T-1, H]
        logits = head.logits(predicted[:, :-1])  # [B, T-2, Vd]
        cls = -(teacher * F.log_softmax(logits, dim=-1)).sum(-1)
        reg = F.smooth_l1_loss(predicted[:, :-1], feats_out[:, :-1], reduction="none").mean(-1)
        loss = ((cls + config.regression_weight * reg) * valid).sum() / denom
        total = total + weight * loss
        agree = (head.vocab_ids[logits.argmax(-1)] == full_argmax).float()
        stats[f"agree_pass{pass_index}"] = float((agree * valid).sum() / denom)
    stats["loss"] = float(total.detach())
    return total, stats


def train_eagle(
    config: EagleTrainConfig, target, *, pad: int, eos_ids: set[int],
    progress: Callable[[int, dict], None] | None = None, stop_at: int | None = None,
) -> dict:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out / "checkpoint.pt"
    examples = read_examples(config.data, config.max_len, keep_prompt_only=config.loss_on == "all")
    if config.loss_on == "all":
        examples = [(ids, 1) for ids, _ in examples]
    train, val = split_examples(examples, config.val_fraction, config.seed)
    tc = target.config
    torch.manual_seed(config.seed)
    start = EagleHead.load(config.init_from) if config.init_from else None
    vocab_ids = start.vocab_ids.clone() if start is not None else draft_vocabulary(config.data, config.draft_vocab, eos_ids)
    head = EagleHead(EagleConfig(
        hidden_size=tc.hidden_size, num_heads=tc.num_attention_heads, num_kv_heads=tc.num_key_value_heads,
        intermediate_size=config.intermediate_size, target_vocab_size=target.get_output_embeddings().weight.shape[0],
        rms_norm_eps=tc.rms_norm_eps, rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
        max_position_embeddings=tc.max_position_embeddings, target=config.target_name,
    ), vocab_ids).attach(target)
    if start is not None:
        if start.config != head.config:
            raise DraftwiseError(f"--init-from {config.init_from}: its head has another configuration "
                                 f"({start.config}) than this run ({head.config})")
        head.load_state_dict(start.state_dict())
    optimizer = torch.optim.AdamW(head.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(0.9, 0.95))
    target.eval()
    features = target_features(target, train + val, pad)
    train_features, val_features = features[: len(train)], features[len(train) :]

    def step_fn(picked: list[int]):
        return _losses(head, pad_batch([train[i] for i in picked], pad), [train_features[i] for i in picked], config)

    started = time.perf_counter()
    step = train_loop(
        model=head, optimizer=optimizer, num_examples=len(train), batch_size=config.batch_size,
        total_steps=config.steps, lr=lambda s: cosine_lr(s, peak=config.lr, warmup=config.warmup, total=config.steps),
        step_fn=step_fn, checkpoint=checkpoint_path, checkpoint_every=config.checkpoint_every,
        config=asdict(config), seed=config.seed, progress=progress, stop_at=stop_at,
    )
    stopped_early = step < config.steps  # an interrupted run still exports what it has (and can resume)
    head.eval()
    with torch.no_grad():
        sums: Counter[str] = Counter()
        n = 0
        for i in range(0, len(val), config.batch_size):
            _, stats = _losses(head, pad_batch(val[i : i + config.batch_size], pad),
                               val_features[i : i + config.batch_size], config)
            sums.update(stats)
            n += 1
    report = {"steps": step, "stopped_early": stopped_early, "train_examples": len(train), "val_examples": len(val),
              "train_seconds_this_run": time.perf_counter() - started,
              "validation": {k: v / max(n, 1) for k, v in sums.items()}}
    head.save(out)
    (out / "distill-report.json").write_text(json.dumps({"config": asdict(config), **report}, indent=2))
    return report
