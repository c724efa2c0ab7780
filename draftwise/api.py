"""The Python API: `generate` and `stream`.

Both take the same arguments; every check on them runs before any model does.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from .cascades import deferral, sequence_confidence
from .decoding import Counters, Limits, decode, decode_mtjd, decode_oracle, decode_sequence_cascade
from .drafters import Drafter, ModelDrafter, NoDrafter, PromptLookupDrafter
from .errors import DraftwiseError
from .methods import Method, get_method
from .eagle import EagleDrafter, EagleHead, is_eagle_dir
from .models.loading import LoadedModel, load_model, resolve_path
from .models.runner import ModelRunner
from .sampling import SamplingConfig, make_generator


@dataclass
class Generation:
    token_ids: list[int]  # new tokens only (an end-of-sequence token that ended generation included)
    text: str  # decoded new tokens, special tokens skipped, cut before a matched stop string
    stats: dict[str, Any]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per target call, bonus/recovered token included (`ar` = 1.0)."""
        return self.stats["new_tokens"] / max(self.stats["target_calls"], 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted-and-verified (0 when nothing was drafted)."""
        return self.stats["accepted"] / self.stats["drafted"] if self.stats["drafted"] else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "stats": self.stats,
            "rates": {"mean_accepted_length": self.mean_accepted_length, "acceptance_rate": self.acceptance_rate},
        }


@dataclass(frozen=True)
class _Plan:
    """A validated request: everything `decode` needs, checked before any model runs."""

    target: LoadedModel
    draft: LoadedModel | EagleHead | None
    method: Method
    options: dict[str, Any]
    sampling: SamplingConfig
    gamma: int
    prompt_ids: list[int]
    max_new_tokens: int
    stop: tuple[str, ...]
    eos_token_ids: frozenset[int]
    vocab_size: int
    seed: int | None
    verifier: Any = None  # SPRINTER's verifier or SpecDec++'s head, loaded and checked with the plan


def generate(
    target: Any,
    prompt: str | Sequence[int],
    *,
    draft: Any = None,
    method: str = "sd",
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    gamma: int = 4,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    **method_options: Any,
) -> Generation:
    """Decode `prompt` with `method`; returns the new tokens, their text and the step counters."""
    run = _Run(_plan(**locals()), streaming=False)
    for _ in run.pieces():
        pass
    return run.result()


def stream(
    target: Any,
    prompt: str | Sequence[int],
    *,
    draft: Any = None,
    method: str = "sd",
    max_new_tokens: int = 128,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    gamma: int = 4,
    stop: str | Sequence[str] | None = None,
    ignore_eos: bool = False,
    **method_options: Any,
) -> Iterator[str]:
    """Like `generate`, but yields text pieces as tokens are committed; they join to `generate(...).text`.

    Arguments are checked (and models loaded) here, before the first piece is asked for.
    """
    return _Run(_plan(**locals()), streaming=True).pieces()


def check_options(
    *, method: str, max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None,
    gamma: int, stop: Any, ignore_eos: bool, draft_given: bool, **method_options: Any,
) -> tuple[Method, dict[str, Any], SamplingConfig, tuple[str, ...]]:
    """Every check that needs no model: runs first, so bad input fails before weights load."""
    spec = get_method(method)
    options = spec.resolve_options(method_options)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    spec.make_rule(options)  # validates option values (alpha range, n-gram sizes) now
    spec.check_required(options)
    if spec.greedy_only and not sampling.greedy:
        raise DraftwiseError(f"method {spec.name!r} is defined for greedy decoding only: pass temperature=0")
    if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
        raise DraftwiseError(f"gamma (draft tokens per step) must be an integer >= 1, got {gamma!r}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise DraftwiseError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
        raise DraftwiseError(f"seed must be an integer in [0, 2**64) or None, got {seed!r}")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not isinstance(s, str) or not s for s in stops):
        raise DraftwiseError(f"stop must be a non-empty string or a list of them, got {stop!r}")
    if spec.needs_draft and not draft_given:
        raise DraftwiseError(f"method {spec.name!r} needs a draft model: pass draft=... (or --draft)")
    if not spec.needs_draft and draft_given:
        raise DraftwiseError(f"method {spec.name!r} does not use a draft model; drop draft=... or pick 'sd'")
    return spec, options, sampling, stops


def _plan(
    *, target: Any, prompt: Any, draft: Any, method: str, max_new_tokens: int, temperature: float, top_k: int,
    top_p: float, seed: int | None, gamma: int, stop: Any, ignore_eos: bool, method_options: dict[str, Any],
) -> _Plan:
    spec, options, sampling, stops = check_options(
        method=method, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        gamma=gamma, stop=stop, ignore_eos=ignore_eos, draft_given=draft is not None, **method_options,
    )
    target_model = load_model(target)
    draft_model = _load_draft(draft, target_model) if draft is not None else None
    if isinstance(draft_model, EagleHead):
        if spec.name not in ("sd", "lossy", "lossy-greedy", "fly"):
            raise DraftwiseError(f"an EAGLE draft head drafts for sd, lossy, lossy-greedy and fly, not {spec.name!r}: "
                                 "give an independent draft model (for smollm2-135m: smollm2-135m-draft)")
        vocab_size = _shared_vocab(target_model, None)
    else:
        vocab_size = _shared_vocab(target_model, draft_model)
    if isinstance(draft_model, LoadedModel) and draft_model.device != target_model.device:
        raise DraftwiseError(f"draft is on {draft_model.device} but target on {target_model.device}; use one device")
    if stops and target_model.tokenizer is None:
        raise DraftwiseError("stop strings need a tokenizer; load the target with tokenizer=...")

    verifier = None
    if spec.drafter in ("sprinter", "stophead"):  # loaded now, so a bad file fails at the call, not mid-stream
        from .sprinter import Verifier

        path = next(options[o.name] for o in spec.options if o.required)  # the trained file's option
        verifier = Verifier.load(path, draft_model.model)
        verifier.check_sampling(sampling)
    prompt_ids = _prompt_ids(prompt, target_model, vocab_size)
    draft_window = draft_model.context_window if isinstance(draft_model, LoadedModel) else None
    window = min(w for w in (target_model.context_window, draft_window, 10**12) if w)
    if len(prompt_ids) >= window:
        raise DraftwiseError(
            f"prompt has {len(prompt_ids)} tokens but the context window is {window}: shorten the prompt"
        )
    return _Plan(
        target=target_model, draft=draft_model, method=spec, options=options, sampling=sampling, gamma=gamma,
        prompt_ids=prompt_ids, max_new_tokens=min(max_new_tokens, window - len(prompt_ids)), stop=stops,
        eos_token_ids=frozenset() if ignore_eos else target_model.eos_token_ids, vocab_size=vocab_size, seed=seed,
        verifier=verifier,
    )


def _load_draft(draft: Any, target: LoadedModel) -> LoadedModel | EagleHead:
    """A draft model, or an EAGLE head (a directory with eagle.json, or a registry name of one)."""
    if isinstance(draft, EagleHead):
        head = draft
    else:
        path = resolve_path(draft) if isinstance(draft, (str, os.PathLike)) else None
        if path is None or not is_eagle_dir(path):
            return load_model(draft)
        head = EagleHead.load(path)
    head.attach(target.model)
    return head if head.fc.weight.device == target.device else head.to(target.device)


def _shared_vocab(target: LoadedModel, draft: LoadedModel | None) -> int:
    """The distribution size every method uses for this pair. Padding-only differences are tolerated.

    Some checkpoints pad the embedding matrix past the tokenizer (Qwen: 151,936 rows
    for 151,665 tokens). Logits are cut to the tokenizer's size when it is smaller than
    every model's: the rows past it hold no real token, and cutting them for every
    method (with or without a draft) keeps `ar`, `sd` and the others on one distribution.
    Without a tokenizer the models must agree exactly.
    """
    sizes = [target.vocab_size] + ([draft.vocab_size] if draft is not None else [])
    smaller = min(sizes)
    tokenizer = target.tokenizer or (draft.tokenizer if draft is not None else None)
    if tokenizer is not None and len(tokenizer) <= smaller:
        return len(tokenizer)
    if len(set(sizes)) == 1:
        return smaller
    raise DraftwiseError(
        f"draft vocabulary size {draft.vocab_size} differs from target vocabulary size {target.vocab_size}: "
        "the draft must share the target's tokenizer"
        + ("" if tokenizer is None else f" ({len(tokenizer)} tokens; padding past it is tolerated)")
    )


def _prompt_ids(prompt: Any, target: LoadedModel, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise DraftwiseError("prompt is empty")
        if target.tokenizer is None:
            raise DraftwiseError("a text prompt needs a tokenizer; pass token ids or load the target with tokenizer=...")
        ids = target.tokenizer(prompt, add_special_tokens=True)["input_ids"]
    elif isinstance(prompt, torch.Tensor):
        ids = prompt.flatten().tolist()
    else:
        ids = list(prompt)
    if not ids:
        raise DraftwiseError("prompt is empty")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise DraftwiseError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    return ids


class _Run:
    """One request in flight: runs `decode`, applies stop strings, keeps text and stats."""

    def __init__(self, plan: _Plan, *, streaming: bool) -> None:
        self.plan = plan
        self.streaming = streaming
        self.token_ids: list[int] = []
        self.text = ""
        self.stats: dict[str, Any] = {}

    def _drafter(self, generator_device: torch.device, rule: Any) -> Drafter:
        plan = self.plan
        if isinstance(plan.draft, EagleHead):
            return EagleDrafter(plan.draft, plan.sampling, plan.vocab_size, generator_device)
        runner = ModelRunner(plan.draft.model, vocab_size=plan.vocab_size) if plan.method.needs_draft else None
        if plan.method.drafter == "model":
            spec = plan.method
            return ModelDrafter(
                runner, plan.sampling, plan.vocab_size,
                keep_raw=getattr(rule, "needs_draft_raw", False),
                stop_when=spec.make_stop(plan.options) if spec.make_stop else None,
            )
        if plan.method.drafter == "sprinter":
            from .sprinter import SprinterDrafter

            return SprinterDrafter(runner, plan.sampling, plan.vocab_size, plan.verifier, plan.options["tau"])
        if plan.method.drafter == "stophead":
            from .sprinter import StopHeadDrafter

            return StopHeadDrafter(runner, plan.sampling, plan.vocab_size, plan.verifier, plan.options["threshold"])
        if plan.method.drafter == "beam":
            from .mtad import BeamDrafter

            return BeamDrafter(runner, plan.sampling, plan.vocab_size, plan.options["num_beams"])
        if plan.method.drafter == "ngram":
            return PromptLookupDrafter(
                plan.vocab_size, generator_device,
                max_ngram=plan.options["max_ngram"], min_ngram=plan.options["min_ngram"],
            )
        return NoDrafter(plan.vocab_size, generator_device)

    def pieces(self) -> Iterator[str]:
        plan = self.plan
        device = plan.target.device
        generator = make_generator(plan.seed, device)
        target = ModelRunner(plan.target.model, vocab_size=plan.vocab_size)
        spec = plan.method
        rule = spec.make_rule(plan.options)  # one rule per request: the drafter and the loop share it
        drafter = self._drafter(device, rule)
        gamma = plan.options[spec.window_option] if spec.window_option else plan.gamma if spec.uses_gamma else 0
        counters = Counters(gamma=gamma)
        tokenizer = plan.target.tokenizer
        emitted = 0  # characters of self.text already yielded
        finish = "length"
        start = time.perf_counter()
        limits = Limits(plan.max_new_tokens, plan.eos_token_ids)
        if spec.loop == "oracle":
            greedy = plan.sampling.greedy

            def defer(q, p, q_warped, p_warped) -> bool:
                return bool(deferral(rule.rule, rule.alpha, q, p, q_warped, p_warped, greedy=greedy))

            steps = decode_oracle(plan.prompt_ids, target=target, draft=drafter.runner, defer=defer,
                                  sampling=plan.sampling, limits=limits, generator=generator, counters=counters)
        elif spec.loop == "sequence":
            aggregate = plan.options["aggregate"]
            steps = decode_sequence_cascade(
                plan.prompt_ids, target=target, draft=drafter.runner,
                confidence=lambda log_probs: sequence_confidence(log_probs, aggregate),
                threshold=1.0 - plan.options["alpha"], sampling=plan.sampling, limits=limits, generator=generator,
                counters=counters,
            )
        elif spec.loop == "mtjd":
            steps = decode_mtjd(plan.prompt_ids, target=target, k=plan.options["k"],
                                num_beams=plan.options["num_beams"], sampling=plan.sampling, limits=limits,
                                generator=generator, counters=counters)
        else:
            steps = decode(
                plan.prompt_ids, target=target, drafter=drafter, rule=rule,
                sampling=plan.sampling, gamma=gamma, limits=limits, generator=generator, counters=counters,
            )
        try:
            for committed in steps:
                if plan.stop and tokenizer is not None:
                    # Stop strings are checked token by token, so the cut is exact.
                    for token in committed:
                        self.token_ids.append(token)
                        self.text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
                        cut = _find_stop(self.text, plan.stop)
                        if cut is not None:
                            self.text = self.text[:cut]
                            finish = "stop"
                            break
                    if finish == "stop":
                        break
                else:
                    self.token_ids.extend(committed)
                if self.token_ids[-1] in plan.eos_token_ids:
                    finish = "eos"
                if not self.streaming or tokenizer is None:
                    continue  # `generate` decodes once at the end: no text work in the loop
                if not plan.stop:
                    self.text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
                ready = _safe_prefix(self.text, plan.stop)
                if ready > emitted:
                    yield self.text[emitted:ready]
                    emitted = ready
        finally:
            steps.close()
            wall = time.perf_counter() - start
            self.stats = {
                "method": plan.method.name,
                "new_tokens": len(self.token_ids),
                "target_calls": target.calls,
                "draft_calls": drafter.calls,
                "target_tokens": target.tokens_processed,
                "steps": counters.steps,
                "drafted": counters.drafted,
                "accepted": counters.accepted,
                "accepted_per_position": counters.accepted_per_position,
                "drafted_per_position": counters.drafted_per_position,
                "prompt_tokens": len(plan.prompt_ids),
                "finish_reason": finish,
                "seed": generator.initial_seed(),
                "wall_time_s": wall,
            }
            if hasattr(drafter, "verifier_calls"):
                self.stats["verifier_calls"] = drafter.verifier_calls
                self.stats["verifier_accepted"] = drafter.verifier_accepted
        if tokenizer is not None and finish != "stop":
            self.text = tokenizer.decode(self.token_ids, skip_special_tokens=True)
        if self.streaming and len(self.text) > emitted:
            yield self.text[emitted:]

    def result(self) -> Generation:
        return Generation(token_ids=list(self.token_ids), text=self.text, stats=self.stats)


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _safe_prefix(text: str, stops: tuple[str, ...]) -> int:
    """How much of `text` can be shown: not a trailing incomplete character, not a possible stop-string start."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for s in stops:
        for n in range(min(len(s) - 1, end), 0, -1):
            if text[end - n : end] == s[:n]:
                end -= n
                break
    return end
