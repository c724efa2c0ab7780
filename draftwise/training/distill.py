"""`draftwise distill`: train an independent draft model for a target.

The draft is a small Llama sharing the target's tokenizer. Its embedding starts
as a principal-component projection of the target's embedding (so token
geometry is not relearned from scratch) and is tied to its output layer. It is
trained on the target's own chat answers (`draftwise train-data`) with
cross-entropy on the answer tokens only: for greedy answers each label is the
target's argmax, the token the draft must propose for its drafts to be accepted.
The data is JSONL from `draftwise train-data`, or a shard directory from
`draftwise train-data --features` (only its tokens are read).

Checkpoints (model, optimizer, step, data order) are written atomically every
`checkpoint_every` steps; re-running with the same output directory resumes from
the last one. Runs are deterministic for a seed.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from draftwise.atomic import write_text
from draftwise.errors import DraftwiseError
from draftwise.training.data import read_answers
from draftwise.training.loop import cosine_lr, train_loop


@dataclass(frozen=True)
class DistillConfig:
    data: str  # JSONL from `draftwise train-data`, or shard directories (comma-separated for several)
    out: str  # output directory: checkpoint.pt while training, then an HF directory
    hidden_size: int = 160
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 480
    max_len: int = 448
    batch_size: int = 8
    steps: int = 2000
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.01
    seed: int = 0
    checkpoint_every: int = 200
    save_dtype: str = "fp16"
    val_fraction: float = 0.05
    bf16: bool = False  # bf16 autocast for the matmuls (fp32 master weights): ~10x on CPUs with AMX
    group_by_length: bool = True  # batches of similar lengths (less padding)
    output_vocab: int = 0  # > 0: also write output-vocab.json, the most frequent tokens of the data (runtime cut)


def read_examples(paths: str | Path, max_len: int, *, keep_prompt_only: bool = False) -> list[tuple[list[int], int]]:
    """(ids, answer_start) per record of comma-separated JSONL files or shard directories, cut to the last
    max_len tokens."""
    out = []
    for path in [Path(p) for p in str(paths).split(",") if p]:
        if path.is_dir():
            from draftwise.training.shards import read_shards

            records = ((s.tokens[: s.answer_start].tolist(), s.tokens[s.answer_start :].tolist())
                       for s in read_shards(path, features=False))
        else:
            records = ((r["prompt_ids"], r["answer_ids"]) for r in read_answers(path))
        for prompt, answer in records:
            if not answer and not keep_prompt_only:
                continue
            ids = (prompt + answer)[-max_len:]
            start = max(1, len(ids) - len(answer)) if answer else len(ids)
            out.append((ids, start))
    if not out:
        raise DraftwiseError(f"{paths}: no training records (run `draftwise train-data` first)")
    return out


def split_examples(examples: list, fraction: float, seed: int) -> tuple[list, list]:
    order = list(range(len(examples)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(len(order) * fraction)) if len(order) > 1 else 0
    val = [examples[i] for i in order[:n_val]]
    train = [examples[i] for i in order[n_val:]] or val
    return train, val


def pad_batch(examples: list[tuple[list[int], int]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, (seq, start) in enumerate(examples):  # right padding; labels only on answer tokens
        ids[row, : len(seq)] = torch.tensor(seq)
        mask[row, : len(seq)] = 1
        labels[row, start : len(seq)] = torch.tensor(seq[start:])
    return ids, mask, labels


def draft_config(target_config, config: DistillConfig) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=target_config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=getattr(target_config, "rope_parameters", None),
        rms_norm_eps=target_config.rms_norm_eps, tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id,
        pad_token_id=getattr(target_config, "pad_token_id", None),
    )


def init_from_target(draft: LlamaForCausalLM, target_embedding: torch.Tensor, seed: int) -> None:
    """Embedding = the target's embedding projected on its top principal components (scaled)."""
    emb = target_embedding.float()
    centered = emb - emb.mean(0, keepdim=True)
    generator = torch.Generator().manual_seed(seed)
    # Randomised SVD on a fixed generator: deterministic and fast for 49k x 576.
    width = draft.config.hidden_size
    probe = torch.randn(emb.shape[1], width + 16, generator=generator)
    q, _ = torch.linalg.qr(centered @ probe)
    _, _, vh = torch.linalg.svd(q.T @ centered, full_matrices=False)
    projected = centered @ vh[:width].T  # [vocab, width]
    projected = projected / projected.std() * 0.05  # small logits at the start: loss near log(vocab)
    with torch.no_grad():
        draft.get_input_embeddings().weight.copy_(projected)


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, examples: list, pad: int, batch_size: int = 8) -> dict[str, float]:
    """Top-1 agreement with the labels (the target's tokens) and mean loss, answer tokens only."""
    model.eval()
    device = model.get_input_embeddings().weight.device
    correct = total = 0
    loss_sum = 0.0
    for i in range(0, len(examples), batch_size):
        ids, mask, labels = (t.to(device) for t in pad_batch(examples[i : i + batch_size], pad))
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        target = labels[:, 1:]
        valid = target != -100
        correct += int((logits.argmax(-1)[valid] == target[valid]).sum())
        total += int(valid.sum())
        loss_sum += float(F.cross_entropy(logits[valid], target[valid], reduction="sum"))
    model.train()
    return {"top1_agreement": correct / max(total, 1), "loss": loss_sum / max(total, 1), "tokens": total}


def _write_output_vocab(out: Path, size: int, train: list, val: list, target_config) -> dict:
    """The draft's restricted output vocabulary: the training data's most frequent tokens (special tokens
    always in). Decoding with it gives every other token probability zero, which keeps speculative decoding
    exact and cuts the draft's LM head to `size` rows; the model file itself stays a full-vocabulary model."""
    from draftwise.models.loading import write_output_vocabulary
    from draftwise.training.eagle3_train import frequency_vocabulary

    vocab = target_config.vocab_size
    if not 0 < size <= vocab:
        raise DraftwiseError(f"--output-vocab must be in [1, {vocab}], got {size}")
    special = {getattr(target_config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    always = {int(t) for t in special if isinstance(t, int)}
    ids = frequency_vocabulary(train, size, always, vocab)
    inside = torch.zeros(vocab, dtype=torch.bool)
    inside[ids] = True
    answers = [t for seq, start in val for t in seq[start:]]
    coverage = float(inside[torch.tensor(answers, dtype=torch.long)].float().mean()) if answers else None
    write_output_vocabulary(out, ids, size=size, validation_answer_coverage=coverage,
                            source="the distillation data: answer tokens x4, prompt tokens x1")
    return {"size": size, "validation_answer_coverage": coverage}


def distill(
    config: DistillConfig, target_config, target_embedding: torch.Tensor, *, pad: int,
    progress: Callable[[int, dict], None] | None = None, stop_at: int | None = None, minutes: float | None = None,
    device: str | torch.device = "cpu",
) -> dict:
    """Train (or resume) and write `config.out` as a Hugging Face directory; returns the final report.

    stop_at: end this run after that step (checkpointed), as an interruption would; `minutes`: end it
    after that much time. The next call with the same config resumes.
    """
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = out / "checkpoint.pt"
    examples = read_examples(config.data, config.max_len)
    train, val = split_examples(examples, config.val_fraction, config.seed)

    torch.manual_seed(config.seed)
    model = LlamaForCausalLM(draft_config(target_config, config))
    init_from_target(model, target_embedding.cpu(), config.seed)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(0.9, 0.98))

    def step_fn(picked: list[int]):
        ids, mask, labels = (t.to(device) for t in pad_batch([train[i] for i in picked], pad))
        with torch.autocast(device_type=ids.device.type, dtype=torch.bfloat16, enabled=config.bf16):
            hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1]
            target = labels[:, 1:]
            valid = target != -100  # the LM head only where there is a label: no logits for prompt and padding
            logits = model.lm_head(hidden[valid])
        loss = F.cross_entropy(logits.float(), target[valid])
        return loss, {"loss": float(loss.detach())}

    start = time.perf_counter()
    step = train_loop(
        model=model, optimizer=optimizer, num_examples=len(train), batch_size=config.batch_size,
        total_steps=config.steps, lr=lambda s: cosine_lr(s, peak=config.lr, warmup=config.warmup, total=config.steps),
        step_fn=step_fn, checkpoint=checkpoint_path, checkpoint_every=config.checkpoint_every,
        config={k: v for k, v in asdict(config).items() if k != "output_vocab"},  # an export choice, not training's
        seed=config.seed, progress=progress, stop_at=stop_at, deadline=time.monotonic() + 60 * minutes if minutes else None,
        lengths=[len(ids) for ids, _ in train] if config.group_by_length else None,
    )
    stopped_early = step < config.steps  # an interrupted run still exports what it has (and can resume)
    report = {"steps": step, "stopped_early": stopped_early, "train_examples": len(train), "val_examples": len(val),
              "train_seconds_this_run": time.perf_counter() - start, "validation": evaluate(model, val, pad)}
    if config.output_vocab:
        report["output_vocab"] = _write_output_vocab(out, config.output_vocab, train, val, target_config)
    save_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[config.save_dtype]
    model.to("cpu", save_dtype).save_pretrained(out)
    write_text(out / "distill-report.json", json.dumps({"config": asdict(config), **report}, indent=2))
    return report
