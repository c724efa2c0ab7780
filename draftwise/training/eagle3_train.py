"""`draftwise distill --kind eagle3`: train an EAGLE-3-style head with the training-time test.

Data: feature shards from `draftwise train-data --features` (the target's layer inputs and
final normed states, captured while it generated its own answers). Nothing runs the target
here: its distribution at a position is its LM head (restricted to the draft vocabulary)
applied to the stored final state.

Training-time test (EAGLE-3): the head is unrolled for `ttt_steps` steps. Step 0 reads the
fused target features; step k reads the head's own output of step k - 1 at the same
position, with the true token k places later, and predicts the token after it. Its query
attends to the step-0 keys of every earlier position and to the keys the same position got
at steps 1..k, which is what a drafting step sees at inference (the true prefix, then its
own drafted positions). Step k's loss (soft cross-entropy to the target's distribution over
the draft vocabulary, on answer tokens only) is weighted `decay ** k`.

Checkpoints are atomic; re-running the same command resumes. `--minutes` trains one chunk.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from draftwise.heads.eagle3 import Eagle3Head
from draftwise.errors import DraftwiseError
from draftwise.atomic import write_text
from draftwise.training.loop import cosine_lr, train_loop
from draftwise.heads.eagle3 import eagle3_layers
from draftwise.models.linear import out_rows, weight_rows
from draftwise.training.shards import ShardSequence, read_shards


@dataclass(frozen=True)
class Eagle3TrainConfig:
    data: str  # a directory of feature shards (comma-separated for several)
    out: str
    target_name: str = ""
    draft_vocab: int = 8192
    intermediate_size: int = 1536
    max_len: int = 1024  # the data recipe's sequences (benchmarks/eagle_data_recipe.sh) are at most 1,024 tokens
    batch_size: int = 8
    steps: int = 2000
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    ttt_steps: int = 5
    decay: float = 0.8
    seed: int = 0
    checkpoint_every: int = 50
    val_fraction: float = 0.03
    max_examples: int = 0  # 0: every sequence in the shards
    shared_lm_head: bool = True  # the target's LM-head rows, frozen (False: the head trains its own, stored)
    bf16: bool | None = None  # bf16 autocast for the matmuls (fp32 master weights): ~10x on CPUs with AMX; None:
    # where bf16 is native (AVX512-BF16 / AMX, or a GPU with it), float32 elsewhere (emulated bf16 is slower)
    vocab_file: str = ""  # the draft vocabulary's ids from a file (a JSON list, or an object with "ids": the
    # registry's draftwise/weights/vocab/*.json); empty: the most frequent tokens of the training data
    group_by_length: bool = True  # batches of similar lengths (less padding: every position costs the same)
    init_from: str = ""  # an EAGLE-3 head directory to start from (fine-tuning): its weights and draft vocabulary
    feature_noise: float = 0.0  # training batches only: uniform noise of this amplitude, in units of each feature
    # dimension's scale, on the target features the head reads (EAGLE-1's augmentation; 0: none)


@dataclass
class Example:
    tokens: torch.Tensor  # [T] int64
    answer_start: int
    category: str
    sequence: ShardSequence | None = None  # where the features are read from, a batch at a time
    loaded: torch.Tensor | None = None  # [T, 4H] fp16, when held in memory

    @property
    def features(self) -> torch.Tensor:
        if self.loaded is not None:
            return self.loaded
        return self.sequence.feature_rows(int(self.tokens.shape[0]))


def load_examples(data: str, layers, max_len: int, limit: int = 0) -> list[Example]:
    """Every usable sequence's tokens; features stay in the shard files and are read per batch (3M tokens of
    EAGLE-3 features are ~14 GB)."""
    out: list[Example] = []
    for directory in [d for d in data.split(",") if d]:
        for s in read_shards(directory, layers=layers, features=False):
            T = min(int(s.tokens.shape[0]), max_len)
            if T - s.answer_start < 2:  # fewer than two answer tokens inside the window: nothing to learn
                continue
            out.append(Example(s.tokens[:T].clone(), s.answer_start, s.category, s))
            if limit and len(out) >= limit:
                return out
    if not out:
        raise DraftwiseError(f"no usable sequence in {data}")
    return out


def held_out(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """(validation, training): a sequence is held out by a hash of its uid, so it stays held out while the shards
    grow (a data job still writing them) and across resumed chunks. Sequences without a uid are split by position.
    At least one is held out when there are two or more."""
    def key(i: int) -> int:
        e = examples[i]
        uid = e.sequence.uid if e.sequence is not None and e.sequence.uid else f"#{i}"
        return int.from_bytes(hashlib.sha256(uid.encode()).digest()[:8], "big")

    if len(examples) < 2:
        return [], list(examples)
    keys = [key(i) for i in range(len(examples))]
    bound = int(fraction * 2 ** 64)
    val_index = {i for i, k in enumerate(keys) if k < bound} or {min(range(len(keys)), key=keys.__getitem__)}
    if len(val_index) == len(examples):
        val_index.discard(max(range(len(keys)), key=keys.__getitem__))
    return ([e for i, e in enumerate(examples) if i in val_index],
            [e for i, e in enumerate(examples) if i not in val_index])


def native_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively there: a GPU that supports them, or a CPU with AVX512-BF16 / AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    from draftwise.models.loading import cpu_has_native_bf16

    return device.type == "cpu" and cpu_has_native_bf16()


def vocabulary_file(path: str, vocab: int) -> torch.Tensor:
    """Sorted token ids from a JSON file: a list, or an object with "ids"; each must be a token of the target."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise DraftwiseError(f"--vocab-file {path}: {e}") from None
    ids = data.get("ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
        raise DraftwiseError(f"--vocab-file {path}: expected a non-empty list of token ids below {vocab} (or an "
                             "object with \"ids\")")
    return torch.tensor(sorted(set(ids)), dtype=torch.long)


def draft_vocabulary(examples: list[Example], size: int, always: set[int], vocab: int) -> torch.Tensor:
    """`size` token ids, sorted, by `frequency_vocabulary` over the examples' prompts and answers."""
    return frequency_vocabulary(((e.tokens.tolist(), e.answer_start) for e in examples), size, always, vocab)


def frequency_vocabulary(sequences: Iterable[tuple[Sequence[int], int]], size: int, always: set[int],
                         vocab: int) -> torch.Tensor:
    """`size` token ids, sorted: `always`, then by frequency over (tokens, answer_start) sequences (an answer
    token counts 4, a prompt token 1: answers copy from prompts), then the lowest ids not yet chosen (a BPE
    vocabulary's ids follow its merges, most frequent first)."""
    counts: Counter[int] = Counter()
    for tokens, answer_start in sequences:
        counts.update(tokens[:answer_start])
        for token, n in Counter(tokens[answer_start:]).items():
            counts[token] += 4 * n
    chosen = {t for t in always if t < vocab}
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.add(token)
    for token in range(vocab):  # fewer distinct answer tokens than `size`: fill with low ids
        if len(chosen) >= size:
            break
        chosen.add(token)
    return torch.tensor(sorted(chosen), dtype=torch.long)


def coverage(examples: list[Example], vocab_ids: torch.Tensor) -> float:
    inside = torch.zeros(int(vocab_ids.max()) + 1 if len(vocab_ids) else 1, dtype=torch.bool)
    inside[vocab_ids] = True
    hit = total = 0
    for e in examples:
        answer = e.tokens[e.answer_start:]
        ok = answer < inside.shape[0]
        hit += int(inside[answer[ok]].sum())
        total += int(answer.shape[0])
    return hit / max(total, 1)


def _batch(examples: list[Example], steps: int, hidden: int, device: torch.device | None = None
           ) -> dict[str, torch.Tensor]:
    """Pad a batch to W = longest - 1 head positions; per step k the token, target state and validity (built on
    the CPU from the shards, then moved to `device`)."""
    W = max(int(e.tokens.shape[0]) for e in examples) - 1
    B = len(examples)
    aux = torch.zeros(B, W, 3 * hidden)
    final = torch.zeros(B, W + steps, hidden)  # final normed state at sequence position i + 1 (+ k)
    tokens = torch.zeros(B, W + steps, dtype=torch.long)  # token at sequence position i + 1 (+ k)
    valid = torch.zeros(B, W + steps, dtype=torch.bool)  # whether the token scored from there is an answer token
    for b, e in enumerate(examples):
        T = int(e.tokens.shape[0])
        feats = e.features.float()
        aux[b, : T - 1] = feats[: T - 1, : 3 * hidden]
        # shifted by one: entry j <-> sequence position j + 1
        final[b, : T - 2] = feats[1 : T - 1, 3 * hidden :]  # position T - 1 has no features
        tokens[b, : T - 1] = e.tokens[1:T]
        # entry j scores the token at position j + 2: an answer token, and a final state exists at j + 1
        j = torch.arange(T - 2)
        valid[b, : T - 2] = (j + 2) >= e.answer_start
    batch = {"aux": aux, "final": final, "tokens": tokens, "valid": valid}
    if device is not None and device.type != "cpu":
        batch = {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return batch


def ttt_forward(head: Eagle3Head, batch: dict[str, torch.Tensor], steps: int) -> list[torch.Tensor]:
    """Unroll the head `steps` times over a batch: per step, the layer's pre-norm outputs [B, W, H]
    (`head.logits` scores them)."""
    body = head.body
    c = head.config
    aux, tokens = batch["aux"], batch["tokens"]
    B, W, _ = aux.shape
    positions = torch.arange(W, device=aux.device)[None].expand(B, -1)
    causal = torch.ones(W, W, dtype=torch.bool, device=aux.device).tril()
    groups = c.num_heads // c.num_kv_heads
    scale = c.head_dim ** -0.5
    hidden_in = head.fuse(aux)  # [B, W, H]
    keys, values = [], []  # per step, [B, heads, W, d] (kv heads repeated)
    out = []
    for k in range(steps):
        x = torch.cat([head.embed(tokens[:, k : k + W]), hidden_in], dim=-1)
        q, kk, vv = body.qkv(x, positions + k)  # step k of position i drafts at sequence position i + k
        keys.append(kk.repeat_interleave(groups, dim=1))
        values.append(vv.repeat_interleave(groups, dim=1))
        scores = (q @ keys[0].transpose(-1, -2)) * scale  # [B, heads, W, W]: the true prefix, causal
        scores = scores.masked_fill(~causal, float("-inf"))
        diag = [((q * keys[j]).sum(-1) * scale)[..., None] for j in range(1, k + 1)]  # own earlier steps
        p = torch.softmax(torch.cat([scores, *diag], dim=-1), dim=-1)
        attended = p[..., :W] @ values[0]
        for j in range(1, k + 1):
            attended = attended + p[..., W + j - 1 : W + j] * values[j]
        pre = body.finish(hidden_in, attended)  # [B, W, H]
        out.append(pre)
        hidden_in = pre
    return out


def with_feature_noise(aux: torch.Tensor, scale: torch.Tensor, amplitude: float) -> torch.Tensor:
    """The fused target features [B, W, 3H] plus uniform noise in [-amplitude, amplitude] times each dimension's
    scale (the head divides by that scale first, so the noise is the same size in every dimension it reads): the
    head learns from features a little off the ones it was shown, as it meets at inference after its own steps.
    The teacher's distributions come from the final states, which the noise does not touch."""
    noise = (torch.rand_like(aux) * 2 - 1) * amplitude
    return aux + noise * scale.to(aux.device, aux.dtype)


def teacher_targets(final: torch.Tensor, valid: torch.Tensor, target_rows: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's distribution over the draft vocabulary and its argmax at every scored grid position, computed
    once: step k at head position j reads grid position j + k, so the steps share these rows. Returns (probs [M, Vd],
    argmax [M], index [B, W + steps]: the row of each valid grid position, -1 elsewhere)."""
    at = valid.nonzero(as_tuple=True)
    logits = (final[at] @ target_rows.T).float()  # [M, Vd]
    index = torch.full(valid.shape, -1, dtype=torch.long, device=valid.device)
    index[at] = torch.arange(at[0].numel(), device=valid.device)
    return torch.softmax(logits, dim=-1), logits.argmax(-1), index


def ttt_losses(head: Eagle3Head, target_rows: torch.Tensor, batch: dict[str, torch.Tensor], steps: int,
               decay: float, *, bf16: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted training-time-test loss over a batch, and per-step loss and top-1 agreement."""
    final, valid = batch["final"], batch["valid"]
    W = batch["aux"].shape[1]
    total = torch.zeros((), device=final.device)
    stats: dict[str, float] = {}
    # bf16 matmuls (AMX / tensor cores) with fp32 master weights; the loss itself in fp32
    with torch.autocast(device_type=head.fc.weight.device.type, dtype=torch.bfloat16, enabled=bf16):
        with torch.no_grad():
            teacher_probs, teacher_top, index = teacher_targets(final, valid, target_rows)
        states = ttt_forward(head, batch, steps)
        for k, pre in enumerate(states):
            at = valid[:, k : k + W].nonzero(as_tuple=True)  # answer positions only: the rest carry no loss
            if at[0].numel() == 0:
                continue
            logits = head.logits(pre[at]).float()  # [N, Vd]
            rows = index[at[0], at[1] + k]
            loss = -(teacher_probs[rows] * F.log_softmax(logits, dim=-1)).sum(-1).mean()
            total = total + (decay ** k) * loss
            with torch.no_grad():
                stats[f"acc{k}"] = float((logits.argmax(-1) == teacher_top[rows]).float().mean())
                stats[f"loss{k}"] = float(loss)
    stats["loss"] = float(total.detach())
    return total, stats


def train_eagle3(config: Eagle3TrainConfig, target, *, eos_ids: set[int], minutes: float | None = None,
                 progress: Callable[[int, dict], None] | None = None, stop_at: int | None = None,
                 feature_layers: tuple[int, ...] | None = None) -> dict:
    """Train (or resume) a head on `target` (the model) from feature shards; writes OUT/head and its report."""
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    layers = tuple(feature_layers or eagle3_layers(target.config.num_hidden_layers))
    examples = load_examples(config.data, layers, config.max_len, config.max_examples)
    val, train = held_out(examples, config.val_fraction)
    head_module = target.get_output_embeddings()  # float, or kept in its GGUF blocks (a target loaded as served)
    device = next(target.parameters()).device  # the head trains where the target was loaded
    bf16 = config.bf16 if config.bf16 is not None else native_bf16(device)
    config = replace(config, bf16=bf16)
    vocab_path = out / "vocab_ids.json"  # fixed at the first chunk, so resumed chunks keep the same head shape
    vocab = out_rows(head_module)
    start = _initial_head(config) if config.init_from else None
    if vocab_path.exists():
        vocab_ids = torch.tensor(json.loads(vocab_path.read_text()), dtype=torch.long)
    elif config.vocab_file:
        vocab_ids = vocabulary_file(config.vocab_file, vocab)
    else:
        vocab_ids = start.vocab_ids.clone() if start is not None else \
            draft_vocabulary(train, config.draft_vocab, eos_ids, vocab)
        write_text(vocab_path, json.dumps(vocab_ids.tolist()))
    head = Eagle3Head.new(target, vocab_ids=vocab_ids, intermediate_size=config.intermediate_size,
                          target_name=config.target_name, feature_layers=layers, shared_lm_head=config.shared_lm_head)
    if start is None:  # the checkpoint, when there is one, brings back the scale it was trained with
        with torch.no_grad():
            head.feature_scale.copy_(feature_scale(train, head.feature_size))
    if start is not None:  # the checkpoint, when there is one, overrides these weights as it resumes
        _check_initial_head(config.init_from, start, head)
        head.load_state_dict({k: v for k, v in start.state_dict().items()
                              if not (config.shared_lm_head and k == "lm_head.weight")}, strict=False)
        head.config = replace(head.config, dynamic=dict(start.config.dynamic))  # its tuned draft length, to retune
    head.to(device)
    target_rows = weight_rows(head_module, vocab_ids).detach().float().to(device)  # [Vd, H]
    hidden = head.config.hidden_size
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.95))

    def step_fn(picked: list[int]):
        batch = _batch([train[i] for i in picked], config.ttt_steps, hidden, device)
        if config.feature_noise:
            batch["aux"] = with_feature_noise(batch["aux"], head.feature_scale, config.feature_noise)
        return ttt_losses(head, target_rows, batch, config.ttt_steps, config.decay, bf16=config.bf16)

    started = time.perf_counter()
    deadline = time.monotonic() + minutes * 60 if minutes else None
    step = train_loop(
        model=head, optimizer=optimizer, num_examples=len(train), batch_size=config.batch_size,
        total_steps=config.steps, lr=lambda s: cosine_lr(s, peak=config.lr, warmup=config.warmup, total=config.steps),
        step_fn=step_fn, checkpoint=out / "checkpoint.pt", checkpoint_every=config.checkpoint_every,
        config=asdict(config), seed=config.seed, progress=progress, stop_at=stop_at, deadline=deadline,
        lengths=[int(e.tokens.shape[0]) for e in train] if config.group_by_length else None,
    )
    head.eval()
    validation = evaluate(head, target_rows, val, config)
    report = {"steps": step, "finished": step >= config.steps, "train_examples": len(train),
              "val_examples": len(val), "train_answer_tokens": sum(int(e.tokens.shape[0]) - e.answer_start for e in train),
              "draft_vocab_coverage": coverage(val or train, vocab_ids),
              "train_seconds_this_chunk": time.perf_counter() - started, "validation": validation}
    head.to("cpu").save(out / "head")
    write_text(out / "distill-report.json", json.dumps({"config": asdict(config), **report}, indent=2))
    return report


def feature_scale(examples: list[Example], size: int, sample: int = 64) -> torch.Tensor:
    """The fused features' scale, dimension by dimension, from up to `sample` sequences (spread over the set): each
    dimension's root mean square, raised to its layer's median (a dimension is only ever scaled down, to the size
    of a typical one). The target's massive activations (a few dimensions in the thousands) then reach fc at the
    size of the rest."""
    if not examples:
        return torch.ones(size)
    picked = examples[:: max(1, len(examples) // sample)][:sample]
    total, count = torch.zeros(size, dtype=torch.float64), 0
    for e in picked:
        feats = e.features[:, :size].double()
        total += feats.pow(2).sum(0)
        count += feats.shape[0]
    rms = (total / max(count, 1)).sqrt().float()
    hidden = size // 3
    parts = [rms[i * hidden: (i + 1) * hidden] for i in range(3)]
    return torch.cat([torch.maximum(p, p.median().clamp(min=1e-6)) for p in parts])


def _initial_head(config: Eagle3TrainConfig) -> Eagle3Head:
    """The head `--init-from` names (a registry name or a directory)."""
    from draftwise.heads.export import load_head
    from draftwise.models import registry

    try:
        start = load_head(registry.resolve(config.init_from) if registry.entry(config.init_from)
                          else config.init_from)
    except (DraftwiseError, OSError) as e:
        raise DraftwiseError(f"--init-from {config.init_from}: {e}") from None
    if not isinstance(start, Eagle3Head):
        raise DraftwiseError(f"--init-from {config.init_from}: not an EAGLE-3 head")
    return start


def _check_initial_head(name: str, start: Eagle3Head, head: Eagle3Head) -> None:
    """One error naming every way the head to start from differs from the one this run trains."""
    fields = (("feature_layers", "layers"), ("intermediate_size", "width"), ("shared_lm_head", "shared LM head"),
              ("hidden_size", "target of width"), ("target_vocab_size", "target vocabulary"))
    differ = [f"its {label} {getattr(start.config, f)}, this run's {getattr(head.config, f)}"
              for f, label in fields if getattr(start.config, f) != getattr(head.config, f)]
    if not torch.equal(start.vocab_ids, head.vocab_ids):
        differ.append("its draft vocabulary differs from this run's vocab_ids.json")
    if differ:
        raise DraftwiseError(f"--init-from {name}: " + "; ".join(differ))


@torch.no_grad()
def evaluate(head: Eagle3Head, target_rows: torch.Tensor, val: list[Example], config: Eagle3TrainConfig) -> dict:
    sums: Counter[str] = Counter()
    batches = 0
    for i in range(0, len(val), config.batch_size):
        _, stats = ttt_losses(head, target_rows, _batch(val[i : i + config.batch_size], config.ttt_steps,
                                                        head.config.hidden_size, target_rows.device),
                              config.ttt_steps, config.decay,
                              bf16=config.bf16 if config.bf16 is not None else native_bf16(target_rows.device))
        sums.update(stats)
        batches += 1
    return {k: v / max(batches, 1) for k, v in sums.items()}
