"""The batched engine: continuous batching over one target and one drafter.

A request is one row of the target's position-indexed KV cache (and of the
drafter's, when it has one). Live rows are kept contiguous (`0 .. rows - 1`): a
finished or cancelled row is replaced by the last live row (`move_row`), so every
forward runs on a slice of the cache, never a gather.

One `step()`:
1. **admit**: waiting requests join while the batch has room and the KV budget
   allows. Their prompts (all but the last token, left for the first decoding
   step) are fed in chunks that share the verification forward with the decoding
   rows: short prompts at once, while they cost at most a share of the decoding rows'
   remaining time, long ones within a time budget per step (`prefill_share` of a
   decoding step), so a long prompt never stalls the others; with nothing
   decoding, in chunks cut to about PREFILL_FORWARD_S a forward.
   Rows still prefilling sit after the live rows in the cache;
2. **draft**: the drafter proposes up to `min(gamma, budget - 1)` tokens per row;
   rows stop on their own rule (EOS, a stop rule, a lookup miss);
3. **verify**: one target forward feeds each row its pending token and its drafts
   (`1 + k_b` tokens, right-padded);
4. **accept**: the rule gives pi, the vectorised sampler accepts / recovers /
   draws a bonus per row, one device-to-host copy;
5. **rewind**: each row keeps its sequence minus the newest token, in the target
   and in the drafter; then **record** (counters) and emit text.

Interface (for the API, the server and Speculative Verification): `submit`,
`step`, `cancel`, `results` / `result`, `has_work`.
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from draftwise.engine.keyed import COUPLINGS, fresh_seed, row_draws
from draftwise.engine.sampler import (RowsAcceptance, accept_greedy, accept_own_draws, speculative_sample_rows,
                                      warp_rows)
from draftwise.errors import DraftwiseError
from draftwise.engine.grammar import compiler_for, mask_logits
from draftwise.models.kvcache import release_heap
from draftwise.models.runner import ModelRunner, RowsOutput
from draftwise.engine.sampling import make_generator
from draftwise.engine.protocols import (PREFILL_CHUNK, PREFILL_TOKENS, RowsDraft, RowsDrafter, StepDistributions, TargetRule,
                                        VerifyAll, VerifySelector, pad_rows)
from draftwise.engine.rows import Detokenizer, Event, Request, Result, Row, RowCounters, cut_at_eos, token_logprobs
from draftwise.engine.tree import TreeBudget, accept_tree, depths, verify_mask
from draftwise.models.linear import out_rows


PREFILL_SHARE = 0.25  # long prompts' tokens a step feeds beside decoding rows may cost this fraction of a decoding step
LONG_PIECE = 8  # a long prompt beside decoding rows advances this many tokens at least (a piece reads its whole
# context once, as the attention kernel's tile of 8 queries does: a token or two at a time would read it for each)
PREFILL_FORWARD_S = 0.25  # a forward of prompts alone is cut to about this long: a request arriving meanwhile waits
SHORT_PROMPT_STEPS = 8.0  # prompts fed at once beside decoding rows may cost this many decoding steps in a step,
SHORT_SHARE = 0.5  # or this share of the decoding rows' remaining steps when that is more (mean over the rows,
SHORT_HORIZON = 64  # each row's counted up to this many steps). At concurrency 16 (SmolLM2-135M bf16, Zen 5 with
# the AVX-512 attention, guidellm, 256-token prompts, one 120 s run each): 4 steps gave TTFT p50 2,405 ms at 273
# tokens/s (ITL 37 ms), 8 gave 739 ms at 273 (ITL 50 ms), 12 gave 979 ms at 252 (ITL 54 ms). Share 0.5 against
# 0.25 (4 steps, before that kernel): 709 against 2,115 ms
PREFILL_FIRST = 8  # prompt tokens per step beside decoding rows before their cost is measured
PREFILL_SHARED = 16  # prompt tokens per forward of an engine with nothing decoding while another engine decodes
DECODE_SAMPLE = 16  # one step in this many feeds no prompt tokens: it times a decoding step alone


def _average(old: float | None, new: float, weight: float) -> float:
    """A moving average: `new` counts `weight`, the past the rest (the first value stands alone)."""
    return new if old is None else (1.0 - weight) * old + weight * new


class Engine:
    """Continuous batching of one method over many requests. See the module docstring."""

    def __init__(
        self, target: ModelRunner, drafter: RowsDrafter, rule: TargetRule, *, gamma: int, tokenizer: Any = None,
        max_batch_size: int = 16, kv_budget_tokens: int | None = None, method: str = "", stream_text: bool = True,
        selector: VerifySelector | None = None, prefill_share: float | None = None, prefixes: Any = None,
        tree_nodes: int = 0, tree_adaptive: bool = True, prefill_first: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise DraftwiseError(f"max_batch_size must be >= 1, got {max_batch_size!r}")
        prefill_share = PREFILL_SHARE if prefill_share is None else prefill_share
        if not prefill_share > 0:
            raise DraftwiseError(f"prefill_share must be > 0, got {prefill_share!r}")
        self.target = target
        self.drafter = drafter
        self.rule = rule
        self.gamma = gamma
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.kv_budget_tokens = kv_budget_tokens  # None: no limit beyond the batch size
        self.method = method
        self.selector = selector or VerifyAll()
        self.exact = rule.exact  # pi = target: deterministic drafts may take the target's own draws
        # the exact rule's coupling (keyed.py): "gumbel" (the default) commits the target's own Gumbel-max draw at
        # every position, so an answer is `ar`'s for the same seed whatever was drafted; "rejection" is Algorithm 4
        # with keyed uniforms. Other rules are defined by rejection sampling.
        coupling = rule.coupling if self.exact else "rejection"
        if coupling not in COUPLINGS:
            raise DraftwiseError(f"coupling must be one of {', '.join(COUPLINGS)}, got {coupling!r}")
        self.gumbel = coupling == "gumbel"
        # all-greedy steps compare argmax tokens (sampler.accept_greedy) when nothing reads the target's distributions:
        # the exact rule, and a selector that does not observe them (one that does not say is taken to)
        self.argmax_accept = self.exact and not getattr(self.selector, "observes", True)
        # token trees: the drafter's node budget per row, at most tree_nodes, chosen each step from the measured
        # verification cost at the batch size (tree.TreeBudget; not adaptive: always the best tree_nodes); 0: the
        # drafter's drafts are chains
        self.tree_budget = TreeBudget(tree_nodes, adaptive=tree_adaptive) if tree_nodes else None
        if tree_nodes and (self.selector.discards or not self.exact):
            raise DraftwiseError("token trees are verified with exact multi-candidate sampling: they need the exact "
                                 "rule and no select phase")
        self.draft_width = max(gamma, tree_nodes)  # drafted tokens a step may feed per row
        if drafter.wants_features:
            target.feature_layers = tuple(drafter.feature_layers)  # EAGLE-3 reads several layers
        self.stream_text = stream_text  # False: text only at the end (and for stop strings), no per-step decoding
        self.waiting: list[Row] = []
        self.live: list[Row] = []  # row i of every cache is live[i]
        self.prefilling: list[Row] = []  # row len(live) + j of the target's cache is prefilling[j]
        self.prefill_share = prefill_share
        # a batch whose caller waits for every request (`generate` with a list of prompts): every waiting prompt is fed
        # each step (a chunk a row, PREFILL_TOKENS a forward), as vLLM's offline generate schedules prefill first,
        # so the rows decode together; no time budget, and no forward of prompts alone is cut short
        self.prefill_first = prefill_first
        self._decode_s: float | None = None  # moving averages: a decoding step's time,
        self._prompt_token_s: float | None = None  # and what one prompt token adds to it
        self._idle_token_s: float | None = None  # a prompt token's time in a forward of prompts alone
        self._steps = 0
        self._credit = 0.0  # seconds of prompt feeding earned (see `_prompt_budget`)
        self.finished: dict[int, Result] = {}
        self._ids = itertools.count()
        self.prefixes = prefixes  # a prefix.PrefixStore: prompt prefixes' keys and values across requests
        self.others_decoding = False  # set by a server's worker: another engine has rows decoding

    # ---- interface ----

    def submit(self, request: Request) -> int:
        seed = fresh_seed() if request.seed is None else int(request.seed)
        row = Row(
            id=next(self._ids), request=request,
            generator=make_generator(seed, self.target.device),  # a stream for MTAD's beams; the rest is keyed
            counters=RowCounters(gamma=self.gamma), detok=Detokenizer(self.tokenizer),
            sequence=list(request.prompt_ids), submitted=time.perf_counter(), seed=seed, gumbel=self.gumbel,
        )
        if request.grammar is not None:
            vocab = self.target.vocab_size or out_rows(self.target.model.get_output_embeddings())
            row.grammar = compiler_for(self.tokenizer, vocab, request.eos_token_ids).state(
                request.grammar, self.target.device)
        self.waiting.append(row)
        return row.id

    def cancel(self, request_id: int) -> bool:
        """Stop a request now; its row is freed, other rows are untouched. False when unknown or done."""
        for i, row in enumerate(self.waiting):
            if row.id == request_id:
                self.waiting.pop(i)
                self._finish(row, "cancelled")
                return True
        for i, row in enumerate(self.live):
            if row.id == request_id:
                self._finish(row, "cancelled")
                self._free(i)
                return True
        for j, row in enumerate(self.prefilling):
            if row.id == request_id:
                self._finish(row, "cancelled")
                self._unprefill(j)
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.live or self.prefilling)

    @property
    def admitted(self) -> list[Row]:
        """Requests holding a row: decoding, then prefilling."""
        return [*self.live, *self.prefilling]

    def result(self, request_id: int) -> Result | None:
        return self.finished.get(request_id)

    def results(self) -> dict[int, Result]:
        return dict(self.finished)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Admit what fits, then one draft -> verify -> accept -> rewind step over the live rows (with a share of
        the waiting prompts fed in the same target forward)."""
        self._admit()
        if not self.live and self.prefilling:  # nothing decoding here: prompts in wide chunks (short ones when
            # another engine of the server decodes: its steps wait for this one's)
            wide = PREFILL_SHARED if self.others_decoding else PREFILL_TOKENS
            if self._idle_token_s is not None and not self.prefill_first:  # no longer than PREFILL_FORWARD_S at
                # the measured cost a token, though the prompt nearest its end may finish (a short one arriving
                # beside a long one starts now)
                nearest = min(row.unfed for row in self.prefilling)
                finish = nearest + len(self.prefilling) - 1 if nearest <= PREFILL_CHUNK else 0
                wide = max(LONG_PIECE, min(wide, max(int(PREFILL_FORWARD_S / self._idle_token_s), finish)))
            self._feed_prompts(self._prompt_plan(wide, min(wide, PREFILL_CHUNK)))
        if not self.live:
            return []
        started = time.perf_counter()
        rows = self.live
        limits = [max(0, min(self.gamma, row.budget - 1)) for row in rows]
        limits = self.selector.limits(rows, limits)
        drafter_calls = self.drafter.calls

        if self.tree_budget is not None:  # each row's node budget at this batch size, and the least path
            # probability worth growing (tree.TreeBudget)
            self.drafter.tree_nodes = self.tree_budget.growth(len(rows))
            self.drafter.tree_min_prob = self.tree_budget.min_prob(len(rows))
        draft = self.drafter.propose(rows, limits)  # draft
        proposed = draft.counts
        if draft.parents is not None:  # token trees: their own verification and acceptance
            if self.tree_budget is not None:
                self.tree_budget.observe_draft(time.perf_counter() - started)
                if draft.scores is not None:  # each row's tree cut where its nodes stop paying
                    kept = self.tree_budget.cut(draft.scores)
                    if kept != list(draft.counts):
                        draft = draft.prefix(kept)
            return self._tree_step(rows, draft, proposed, drafter_calls, started)
        if draft.width:  # select: the prefix of each draft to verify
            chosen = self.selector.select(rows, draft)
            if list(chosen) != list(draft.counts):
                draft = draft.prefix(chosen)
        grammars = [b for b, row in enumerate(rows) if row.grammar is not None]
        if grammars:  # the grammar rows' paths follow their drafts, cut at a token the grammar refuses
            draft = self._grammar_drafts(rows, grammars, draft)
        k = draft.width
        counts = [1 + c for c in draft.counts]  # verify: the pending token and the drafts
        verified, plan = self._verify(rows, draft, counts)
        if self.drafter.wants_features:
            for b, row in enumerate(rows):
                self.drafter.observe(b, len(row.sequence) - 1, verified.hidden[b, : counts[b]])
        target_logits = self._processed(rows, draft, verified.logits)  # [rows, k + 1, vocab]
        if grammars:  # the target's distribution at every verified position, masked by the grammar there
            target_logits = self._grammar_masked(rows, grammars, draft, target_logits)
        drafted = draft.counts
        greedy_host = [row.request.sampling.greedy for row in rows]  # per row, read once a step
        drafted_host = draft.tokens.tolist() if k else [[] for _ in rows]
        if self.argmax_accept and all(greedy_host):  # temperature 0: no distribution built
            outcome = accept_greedy(draft.tokens, draft.counts, target_logits)
        else:
            outcome, draft = self._accept(rows, draft, target_logits, greedy_host, drafted_host)
        drafter_calls = self.drafter.calls - drafter_calls  # drafting forwards of this step, over every row
        verdicts_host = draft.verdicts.tolist() if draft.verdicts is not None else None
        committed = [drafted_host[b][:a] + [t] for b, (a, t) in enumerate(zip(outcome.num_accepted,
                                                                            outcome.next_tokens))]
        verifier = [sum(v[:c]) for v, c in zip(verdicts_host, draft.counts)] if verdicts_host else [0] * len(rows)

        def record(b: int, row: Row, accepted: int) -> None:  # nothing past an EOS or a stop string is accepted
            row.counters.record(drafted[b], accepted)

        return self._commit_rows(rows, committed, list(verified.logits), outcome.num_accepted, record, verifier,
                                 counts, proposed, drafter_calls, verified.hidden, plan, started)

    def _commit_rows(self, rows: Sequence[Row], committed: list[list[int]], logits: Sequence[torch.Tensor],
                     accepted: Sequence[int], record: Callable[[int, Row, int], None], verifier: Sequence[int],
                     counts: Sequence[int], proposed: Sequence[int], drafter_calls: int, hidden: torch.Tensor | None,
                     plan: list[int], started: float) -> list[Event]:
        """Commit, record and rewind, for chains and trees alike: row b appends committed[b] (cut at EOS and stop
        strings; logits[b][j] came before its token j), its counters record the step (`record(b, row, accepted
        tokens kept)`), and every cache keeps the row's sequence minus its new pending token."""
        events, done = [], []
        now = time.perf_counter()
        for b, row in enumerate(rows):
            kept = self._conclude(b, row, committed[b], logits[b], now, drafter_calls, verifier[b])
            record(b, row, min(accepted[b], len(kept)))
            row.counters.target_tokens += counts[b]
            row.counters.proposed += proposed[b]
            events.append(self._event(row, kept))
            # rewind: the row keeps everything but its newest token
            self.target.trim_row(b, len(row.sequence) - 1)
            self.drafter.rewind(b, len(row.sequence) - 1)
            if row.finish_reason is not None:
                done.append(b)
        if self.prefixes is not None:
            self._store_last_blocks(rows, hidden)
        self._end_step(done, started, plan)
        return events

    def _accept(self, rows: Sequence[Row], draft: RowsDraft, target_logits: torch.Tensor, greedy_host: list[bool],
                drafted_host: list[list[int]]) -> tuple[RowsAcceptance, RowsDraft]:
        """The accept phase with distributions: pi = rule(draft, target) at the drafted positions (one rule call with
        per-row greedy flags), then the speculative sampler; the selector observes what the target said. Returns the
        outcome and the draft it decided (a rule that cuts drafts shortens it)."""
        target_probs = warp_rows(target_logits, [row.request.sampling for row in rows])
        greedy = torch.tensor(greedy_host, device=target_probs.device)
        k = draft.width
        if self.rule.cuts_draft and k:  # MTAD: the rule keeps a prefix of each draft; the target's token follows it
            draft = draft.prefix(self.rule.prefix(self._step_distributions(draft, target_probs, target_logits,
                                                                           greedy), greedy))
            k = draft.width
        pi = self.rule(self._step_distributions(draft, target_probs, target_logits, greedy)) if k \
            else target_probs[:, :0]
        bonus: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] = target_probs
        if self.rule.bonus_from_pi:  # Algorithm 4: the bonus comes from pi = T(q, p) after the last drafted token
            bonus = self._bonus_maker(rows, draft, target_probs, target_logits, greedy)
        draws = row_draws(rows, target_probs.device)
        if self.exact and (self.gumbel or draft.deterministic):  # the target's own draw at each position: Gumbel
            # coupled drafts, and deterministic ones (lookup, suffix) under either coupling
            outcome = accept_own_draws(draft.tokens, draft.counts, target_probs, draws, greedy_host)
        else:
            outcome = speculative_sample_rows(draft.tokens, draft.probs, pi, bonus, draft.counts, draws, greedy_host)
        self.selector.observe(rows, draft, target_probs, target_logits, outcome.num_accepted)
        return outcome, draft

    def _verify(self, rows: Sequence[Row], draft: RowsDraft, counts: list[int], tree: bool = False
                ) -> tuple[RowsOutput, list[int]]:
        """The verification forward: each row's pending token and its drafts (`counts[b]` tokens), with a share of
        the prefilling rows' prompt chunks after them. Returns the live rows' output and the prompt plan."""
        k = draft.width
        last = torch.tensor([row.sequence[-1] for row in rows], dtype=torch.long, device=draft.tokens.device)
        feed = torch.cat([last[:, None], draft.tokens], 1)  # [rows, 1 + k]
        plan = self._prompt_plan(self._prompt_budget(), PREFILL_CHUNK) if self.prefilling else []
        wants = self.drafter.wants_features
        chunk_counts: list[int] = []
        if plan:  # prompt chunks of the rows prefilling, in the same forward (rows after the live ones)
            pieces = [list(row.request.prompt_ids[row.fed: row.fed + n]) for row, n in zip(self.prefilling, plan)]
            chunks, chunk_counts = pad_rows(pieces)
            width = max(feed.shape[1], chunks.shape[1])
            feed = torch.cat([F.pad(feed, (0, width - feed.shape[1])),
                              F.pad(chunks.to(feed.device), (0, width - chunks.shape[1]))])
        mask = None
        if tree:
            starts = self.target.lengths[: len(rows) + len(chunk_counts)]
            mask = verify_mask(draft.parents, starts, feed.shape[1], feed.device, extra=chunk_counts)
        begun = time.perf_counter()
        if plan:
            at = torch.arange(k + 1, device=feed.device).expand(feed.shape[0], -1)
            verified = self.target.forward_rows(feed, counts + chunk_counts, logits_at=at, hidden=wants,
                                                prompt=sum(counts), tree=mask)
            self._fed(plan, verified.hidden[len(rows):] if wants else None)
            verified = RowsOutput(verified.logits[: len(rows)],
                                  verified.hidden[: len(rows)] if verified.hidden is not None else None)
        else:
            verified = self.target.forward_rows(feed, counts, hidden=wants, tree=mask)
            if self.tree_budget is not None:
                if verified.logits.is_cuda:  # the forward's time, not its launch
                    torch.cuda.synchronize(verified.logits.device)
                self.tree_budget.observe(sum(counts), time.perf_counter() - begun)
        return verified, plan

    def _conclude(self, b: int, row: Row, committed: list[int], logits: torch.Tensor, now: float,
                  drafter_calls: int, verifier: int) -> list[int]:
        """Commit a row's tokens of this step (cut at EOS), its log-probabilities (logits[j] came before committed
        token j) and counters; returns the tokens kept. The caller records the step's acceptance, then makes the
        row's event (a finished row's event carries its final counters)."""
        committed = cut_at_eos(committed, row.request.eos_token_ids)
        kept = self._commit(row, committed, now)  # may cut further, at a stop string
        if row.grammar is not None and not row.grammar.commit(kept) and row.finish_reason is None:
            row.finish_reason = "grammar"  # the grammar engine failed (a parser limit): the answer ends here
        if row.request.logprobs is not None:
            row.logprobs += token_logprobs(logits, kept, row.request.logprobs)
        row.counters.draft_calls += drafter_calls
        row.counters.verifier_accepted += verifier
        return kept

    def _store_last_blocks(self, rows: Sequence[Row], hidden: torch.Tensor | None) -> None:
        """After a decoding step: the prefix store gets the last block of each prompt whose last token this step
        fed (the token at the step's first slot; `hidden[b, 0]` its features, for a drafter that wants them)."""
        for b, row in enumerate(rows):
            if not row.last_block_pending:
                continue
            row.last_block_pending = False
            prompt = row.request.prompt_ids
            if self.target.lengths[b] < len(prompt):  # nothing kept past the prompt (a stop string cut it all)
                continue
            states = row.last_block_states
            if self.drafter.wants_features:
                if hidden is None or states is None and len(prompt) > 1:
                    continue
                last = hidden[b, :1]
                states = last if states is None else torch.cat([states, last.to(states.dtype)])
            row.last_block_states = None
            self.prefixes.insert(prompt, self.target.cache, b, states)

    def _end_step(self, done: list[int], started: float, plan: list[int]) -> None:
        for b in reversed(done):  # highest first: moving the last row never touches a pending index
            self._free(b)
        self._timed(time.perf_counter() - started, sum(plan))
        self._start_decoding()

    def _tree_step(self, rows: Sequence[Row], draft: RowsDraft, proposed: list[int], drafter_calls: int,
                   started: float) -> list[Event]:
        """Verify and accept token trees (tree.py): one forward over every row's tree, multi-candidate
        speculative sampling, then the accepted path's keys and values move to contiguous positions."""
        if any(row.grammar is not None for row in rows):
            raise DraftwiseError("token trees cannot follow a grammar; use a chain draft (tree_nodes=0)")
        k = draft.width
        counts = [1 + c for c in draft.counts]
        starts = self.target.lengths[: len(rows)]
        verified, plan = self._verify(rows, draft, counts, tree=True)
        target_logits = self._processed(rows, draft, verified.logits)  # [rows, k + 1, vocab]
        greedy = [row.request.sampling.greedy for row in rows]
        # greedy rows walk the tree by the target's argmax: its logits serve, no distribution is built
        target_probs = target_logits if all(greedy) else warp_rows(target_logits, [r.request.sampling for r in rows])
        tokens_host = draft.tokens.tolist() if k else [[] for _ in rows]
        tokens_host = [t[:c] for t, c in zip(tokens_host, draft.counts)]
        outcome = accept_tree(draft.parents, tokens_host, target_probs, row_draws(rows, target_probs.device), greedy)
        drafter_calls = self.drafter.calls - drafter_calls
        slots = [[0] + [i + 1 for i in path] for path in outcome.paths]  # the pending token's and the path's
        if self.drafter.wants_features:  # the target's features of the pending token and the accepted path
            for b, row in enumerate(rows):
                self.drafter.observe(b, len(row.sequence) - 1, verified.hidden[b, slots[b]])
        # the accepted paths' keys and values follow the pending tokens (one gather per layer); the rest is dropped
        self.target.cache.compact_rows([(b, starts[b] + 1, [starts[b] + s for s in slots[b][1:]])
                                        for b in range(len(rows))])
        committed = [[tokens_host[b][i] for i in path] + [outcome.next_tokens[b]]
                     for b, path in enumerate(outcome.paths)]

        def record(b: int, row: Row, accepted: int) -> None:
            parents = draft.parents[b]
            row.counters.record_tree(len(parents), max(depths(parents), default=0), accepted)

        return self._commit_rows(rows, committed, [verified.logits[b, slots[b]] for b in range(len(rows))],
                                 [len(path) for path in outcome.paths], record, [0] * len(rows), counts, proposed,
                                 drafter_calls, verified.hidden, plan, started)

    def run(self) -> dict[int, Result]:
        while self.has_work:
            self.step()
        return self.results()

    # ---- phases ----

    @staticmethod
    def _step_distributions(draft: RowsDraft, target_probs: torch.Tensor, target_logits: torch.Tensor,
                            greedy: torch.Tensor) -> StepDistributions:
        return StepDistributions(draft.tokens, draft.probs, target_probs, target_logits, draft.draft_raw,
                                 greedy.to(draft.tokens.device),
                                 draft.verdicts, draft.joint,
                                 torch.tensor(draft.counts, device=draft.tokens.device))

    def _grammar_drafts(self, rows: Sequence[Row], grammars: list[int], draft: RowsDraft) -> RowsDraft:
        """Each grammar row's path becomes its draft, cut before the first token its grammar refuses (a lookup
        or suffix draft; a model's was drawn under the mask and is whole)."""
        host = draft.tokens.tolist() if draft.width else [[] for _ in rows]
        counts = list(draft.counts)
        for b in grammars:
            counts[b] = rows[b].grammar.follow(host[b][: counts[b]])
        return draft.prefix(counts) if counts != list(draft.counts) else draft

    def _grammar_masked(self, rows: Sequence[Row], grammars: list[int], draft: RowsDraft,
                        logits: torch.Tensor) -> torch.Tensor:
        """logits [rows, k + 1, vocab] with each grammar row's masks at depths 0 .. its draft length."""
        logits = logits.clone()
        for b in grammars:
            n = draft.counts[b]
            logits[b, : n + 1] = mask_logits(logits[b, : n + 1], rows[b].grammar.masks(n))[0]
        return logits

    def _processed(self, rows: Sequence[Row], draft: RowsDraft, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits after each request's repetition, frequency and presence penalties, logit_bias and
        min_new_tokens: [rows, k + 1, vocab].

        Position j of row b follows the row's sequence plus the drafted tokens before it (a chain's first j; a
        tree node's ancestors and itself), so the penalty there counts those drafts as already generated, exactly
        as one-token-at-a-time decoding would. The speculative sampler then targets the processed distribution,
        so lossless methods stay exact."""
        penalised = [b for b, row in enumerate(rows) if row.request.repetition_penalty != 1.0]
        counted = [b for b, row in enumerate(rows) if row.request.frequency_penalty or row.request.presence_penalty]
        biased = [b for b, row in enumerate(rows) if row.request.logit_bias]
        short = [b for b, row in enumerate(rows)
                 if len(row.token_ids) < row.request.min_new_tokens and row.request.eos_token_ids]
        if not penalised and not short and not counted and not biased:
            return logits
        logits = logits.clone()
        width = logits.shape[1]
        drafted = draft.tokens.tolist() if draft.width else [[] for _ in rows]
        for b in penalised:
            seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            seen[torch.tensor(rows[b].sequence, device=logits.device)] = True
            present = seen.expand(width, -1).clone()  # [k + 1, vocab]
            for j, history in enumerate(_slot_histories(draft, b, drafted[b])):
                if history:
                    present[j, torch.tensor(history, device=logits.device)] = True
            penalty = rows[b].request.repetition_penalty
            row = logits[b]
            logits[b] = torch.where(present, torch.where(row < 0, row * penalty, row / penalty), row)
        vocab = logits.shape[-1]
        for b in counted:  # OpenAI's: the tokens this request generated (not its prompt), and the drafts before j
            request = rows[b].request
            made = torch.tensor(rows[b].token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(made[made < vocab], minlength=vocab).to(logits.dtype).expand(width, -1).clone()
            for j, history in enumerate(_slot_histories(draft, b, drafted[b])):
                if history:
                    counts[j] += torch.bincount(torch.tensor(history, device=logits.device), minlength=vocab)[:vocab]
            logits[b] -= request.frequency_penalty * counts + request.presence_penalty * (counts > 0).to(logits.dtype)
        for b in biased:
            ids, bias = zip(*rows[b].request.logit_bias)
            logits[b, :, torch.tensor(ids, device=logits.device)] += torch.tensor(bias, dtype=logits.dtype,
                                                                                  device=logits.device)
        for b in short:
            request = rows[b].request
            eos = torch.tensor(sorted(request.eos_token_ids), device=logits.device)
            eos = eos[eos < logits.shape[-1]]
            missing = request.min_new_tokens - len(rows[b].token_ids)  # positions at depth < missing lose EOS
            if draft.parents is None:
                logits[b, :missing, eos] = float("-inf")
            else:
                slot_depths = [0] + depths(draft.parents[b])
                early = torch.tensor([j for j, d in enumerate(slot_depths) if d < missing], device=logits.device)
                logits[b, early[:, None], eos[None, :]] = float("-inf")
        return logits

    def _bonus_maker(self, rows: Sequence[Row], draft: RowsDraft, target_probs: torch.Tensor,
                     target_logits: torch.Tensor, greedy: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The sampler calls this with the rows that need a bonus; the draft's extra forward runs only then."""
        def bonus(needed: torch.Tensor) -> torch.Tensor:
            if not bool(needed.any()):
                return target_probs
            return self._bonus_from_pi(rows, draft, target_probs, target_logits, greedy, needed.tolist())
        return bonus

    def _bonus_from_pi(self, rows: Sequence[Row], draft: RowsDraft, target_probs: torch.Tensor,
                       target_logits: torch.Tensor, greedy: torch.Tensor, needed: Sequence[bool]) -> torch.Tensor:
        """target_probs with row b's position counts[b] replaced by rule.bonus(q, p) there: [rows, k + 1, vocab].

        Only the rows that need a bonus (every drafted token accepted) read the draft past their drafts: a row with
        a rejection reads no further than its sequence, so a drafter never consumes what the rewind drops (an EAGLE
        head would lose the target's features of its rejected positions). Those rows' bonus rows are unused."""
        from draftwise.engine.sampling import unwarped

        contexts = [row.sequence + (draft.tokens[b, : draft.counts[b]].tolist() if needed[b] else [])
                    for b, row in enumerate(rows)]
        q_raw, q_warped = self.drafter.next_distribution(contexts, [row.request.sampling for row in rows])
        for b, row in enumerate(rows):  # the draft's distribution after its last token, under the grammar
            if row.grammar is not None:
                allowed = row.grammar.masks(draft.counts[b])[-1]
                q_raw[b], q_warped[b] = (_renormalised(q[b] * allowed) for q in (q_raw, q_warped))
        index = torch.arange(len(rows), device=target_probs.device)
        at = torch.tensor(draft.counts, device=target_probs.device)
        p_raw, p_warped = unwarped(target_logits[index, at]), target_probs[index, at]  # [rows, vocab]
        out = target_probs.clone()
        mixed = self.rule.bonus(q_raw, q_warped, p_raw, p_warped, greedy)
        unknown = torch.isnan(q_raw).any(-1)  # the drafter cannot score that position: the target's distribution
        out[index, at] = torch.where(unknown[:, None], p_warped, mixed)
        return out

    def _commit(self, row: Row, committed: list[int], now: float) -> list[int]:
        """Append the step's tokens (cut at a stop string) and decide whether the row ends; returns the kept tokens."""
        stop_hit = False
        if row.request.stop and self.tokenizer is not None:
            kept = []
            for token in committed:  # token by token, so the cut is exact
                kept.append(token)
                row.text += row.detok.push([token])
                cut = _find_stop(row.text, row.request.stop)
                if cut is not None:
                    row.text = row.text[:cut]
                    stop_hit = True
                    break
            committed = kept
        elif self.stream_text:
            row.text += row.detok.push(committed)
        row.sequence.extend(committed)
        row.token_ids.extend(committed)
        if row.first_token_at is None:
            row.first_token_at = now
        if stop_hit:
            row.finish_reason = "stop"
        elif committed and committed[-1] in row.request.eos_token_ids:
            row.finish_reason = "eos"
        elif row.budget <= 0:
            row.finish_reason = "length"
        return committed

    def _event(self, row: Row, kept: list[int]) -> Event:
        """The step's event for a row, after its counters were recorded (a finished row's stats are final)."""
        if row.finish_reason is not None:
            self._finish(row, row.finish_reason)
            ready = len(row.text)
        else:
            ready = _safe_prefix(row.text, row.request.stop)
        piece = row.text[row.emitted:ready] if ready > row.emitted else ""
        row.emitted = max(row.emitted, ready)
        logprobs = row.logprobs[len(row.logprobs) - len(kept):] if row.request.logprobs is not None else None
        first = row.request.prompt_logprobs is not None and row.counters.steps == 1
        return Event(row.id, kept, piece, row.finish_reason is not None, row.finish_reason, logprobs,
                     row.prompt_logprobs if first else None)

    def _admit(self) -> None:
        """Take waiting requests while they fit; they prefill from the next forward on (see `step`)."""
        while self.waiting and len(self.live) + len(self.prefilling) < self.max_batch_size:
            candidate = self.waiting[0]
            held = self.admitted
            if self.kv_budget_tokens is not None and held:
                # each row may reach its prompt, its new tokens and a draft window; admit only what the cache's
                # buffers would then hold (pages a row, or the longest row's capacity in every row) within budget
                lengths = [len(r.request.prompt_ids) + r.request.max_new_tokens + self.draft_width + 1
                           for r in [*held, candidate]]
                if self.target.cache.slots_for(lengths) > self.kv_budget_tokens:
                    break
            row = self.waiting.pop(0)
            self.target.cache.reset_row(len(held))
            if self.prefixes is not None and row.request.prompt_logprobs is None:  # a stored prefix: no prefill
                wants = self.drafter.wants_features
                row.cached, features = self.prefixes.restore(row.request.prompt_ids[:-1], self.target.cache,
                                                             len(held), want_features=wants)
                row.fed = row.cached
                if features is not None:
                    row.prefill_states.append(features)
            row.counters.target_tokens += len(row.request.prompt_ids) - 1 - row.cached
            if row.request.prompt_logprobs is not None:
                self._prefill_scored(row, len(held))
            self.prefilling.append(row)
        self._start_decoding()

    def _prompt_budget(self) -> int:
        """Prompt tokens the next step feeds beside the decoding rows, keyed on what waits. Prompts are fed at once
        (up to a chunk a forward), fewest unfed tokens first, while together they cost at most the allowance of
        `_short_allowance`: a short request does not queue behind a long prompt, a wave of requests starts as soon
        as the decoding rows can afford it, and those rows pay a share of their own remaining time. A prompt
        costing more than the allowance is long: the long ones share a time credit, each step earning
        `prefill_share` of a decoding step (more when more of them wait than rows decode), spent in pieces of at
        least LONG_PIECE tokens a prompt, so a long prompt advances without slowing the decoding rows by more
        than that share on average. Every `DECODE_SAMPLE`-th step (and before the first measure) feeds none, to
        time a decoding step alone."""
        self._steps += 1
        if self.prefill_first:
            return min(PREFILL_TOKENS, sum(min(row.unfed, PREFILL_CHUNK) for row in self.prefilling))
        if self._decode_s is None or self._steps % DECODE_SAMPLE == 0:
            return 0
        if self._prompt_token_s is None:
            return PREFILL_FIRST
        cost = max(self._prompt_token_s, 1e-9)
        allowance = self._short_allowance()
        now, spent, waiting_long = 0, 0.0, 0
        for unfed in sorted(row.unfed for row in self.prefilling):
            if unfed * cost > allowance:
                waiting_long += 1
            elif spent + min(unfed, PREFILL_CHUNK) * cost <= allowance or not now:  # short: fed now if it fits
                spent += min(unfed, PREFILL_CHUNK) * cost
                now += min(unfed, PREFILL_CHUNK)
        now = min(PREFILL_TOKENS, now)
        if not waiting_long:
            self._credit = 0.0
            return now
        # time credit for the long prompts, built up over steps that feed none until it buys each a piece
        share = self.prefill_share * max(1.0, waiting_long / max(len(self.live), 1))
        self._credit = min(self._credit + share * self._decode_s, PREFILL_TOKENS * cost)
        budget = min(PREFILL_TOKENS - now, int(self._credit / cost))
        if budget < LONG_PIECE * waiting_long:  # short prompts only (a forward takes a token of every row)
            return min(PREFILL_TOKENS, now + waiting_long) if now else 0
        self._credit -= budget * cost
        return now + budget

    def _short_allowance(self) -> float:
        """Seconds of prompt feeding one step may spend at once beside the decoding rows: SHORT_PROMPT_STEPS
        decoding steps, or SHORT_SHARE of the rows' remaining steps when that is more (the mean over the rows of
        what each has left, at its own tokens a step, counted up to SHORT_HORIZON). Rows with long to go can
        afford a prompt that starts another row now; rows about to end are not held for one."""
        left = []
        for row in self.live:
            per_step = len(row.token_ids) / row.counters.steps if row.counters.steps else 1.0
            left.append(min(row.budget / max(per_step, 1.0), SHORT_HORIZON))
        mean = sum(left) / len(left) if left else 0.0
        return max(SHORT_PROMPT_STEPS, SHORT_SHARE * mean) * self._decode_s

    def _prompt_plan(self, budget: int, chunk: int) -> list[int]:
        """Tokens per prefilling row for one forward: at least one each (the forward covers them all), the rest
        to the rows with the fewest left first, so a short prompt is not held behind a long one; when some rows
        can finish in this forward, the others get one token each, so the finishing ones start decoding soon (not
        with `prefill_first`: every row gets its chunk).
        [] when the budget is 0."""
        if budget <= 0:
            return []
        plan = [min(1, row.unfed) for row in self.prefilling]
        left = budget - sum(plan)
        for j in sorted(range(len(plan)), key=lambda j: self.prefilling[j].unfed):
            if left <= 0:
                break
            extra = min(min(self.prefilling[j].unfed, chunk) - plan[j], left)
            plan[j] += extra
            left -= extra
        finishing = [n == row.unfed for n, row in zip(plan, self.prefilling)]
        if any(finishing) and not all(finishing) and not self.prefill_first:
            plan = [n if done else 1 for n, done in zip(plan, finishing)]
        return plan

    def _feed_prompts(self, plan: list[int]) -> None:
        """One forward over the prefilling rows alone (nothing is decoding)."""
        pieces = [list(row.request.prompt_ids[row.fed: row.fed + n]) for row, n in zip(self.prefilling, plan)]
        tokens, counts = pad_rows(pieces)
        started = time.perf_counter()
        out = self.target.forward_rows(tokens, counts, begin=len(self.live),
                                       logits_at=torch.zeros(len(pieces), 1, dtype=torch.long),
                                       hidden=self.drafter.wants_features, prompt=True)
        # a prompt token's cost in such forwards (it grows with the context the prompts have reached)
        per_token = (time.perf_counter() - started) / max(sum(counts), 1)
        self._idle_token_s = _average(self._idle_token_s, per_token, 0.5)
        self._fed(plan, out.hidden if self.drafter.wants_features else None)
        self._start_decoding()

    def _prefill_scored(self, row: Row, index: int) -> None:
        """Prefill a prompt whose log-probabilities were asked for, alone and now (logits at every position:
        too wide to share a forward with decoding rows), in chunks; the row then waits to start decoding."""
        prompt = row.request.prompt_ids
        row.prompt_logprobs = [None]
        while row.unfed:
            n = min(row.unfed, PREFILL_CHUNK)
            out = self.target.forward_rows(torch.tensor([prompt[row.fed: row.fed + n]]), [n], begin=index,
                                           hidden=self.drafter.wants_features, prompt=True)
            row.prompt_logprobs += token_logprobs(out.logits[0], prompt[row.fed + 1: row.fed + n + 1],
                                                  row.request.prompt_logprobs)
            self._fed([n], out.hidden, rows=[row])

    def _fed(self, plan: list[int], hidden: torch.Tensor | None, rows: list[Row] | None = None) -> None:
        for j, (row, n) in enumerate(zip(self.prefilling if rows is None else rows, plan)):
            row.fed += n
            row.counters.prefill_calls += 1
            if hidden is not None:
                row.prefill_states.append(hidden[j, :n])

    def _start_decoding(self) -> None:
        """Prefilled rows join the live ones (row len(live) of the cache), and the drafter hears of them (then
        `live[row].id` is the request's id, for a drafter that keeps something per request)."""
        while True:
            j = next((j for j, row in enumerate(self.prefilling) if row.unfed == 0), None)
            if j is None:
                return
            begin = len(self.live)
            if j:
                self.target.cache.swap_rows(begin, begin + j)
                self.prefilling[0], self.prefilling[j] = self.prefilling[j], self.prefilling[0]
            row = self.prefilling.pop(0)
            if self.prefixes is not None:  # its prompt's blocks, for the requests that share them
                wants = self.drafter.wants_features
                states = torch.cat(row.prefill_states) if wants and row.prefill_states else None
                self.prefixes.insert(row.request.prompt_ids[:-1], self.target.cache, begin, states)
                if len(row.request.prompt_ids) % self.prefixes.block == 0:  # the last block: after the first step
                    row.last_block_pending, row.last_block_states = True, states
            self.live.append(row)
            self.drafter.admit(begin, row.request.prompt_ids)
            if row.prefill_states and self.drafter.wants_features:
                self.drafter.observe(begin, 0, torch.cat(row.prefill_states))
            row.prefill_states = []

    def _timed(self, seconds: float, prompt_tokens: int) -> None:
        """Moving averages of a decoding step and of what a prompt token adds to it (the prompt budget's basis)."""
        if prompt_tokens == 0:
            self._decode_s = _average(self._decode_s, seconds, 0.2)
        elif self._decode_s is not None:
            self._prompt_token_s = _average(self._prompt_token_s, max(seconds - self._decode_s, 0.0) / prompt_tokens,
                                            0.2)

    def _unprefill(self, j: int) -> None:
        """Drop prefilling row j: the last prefilling row takes its place in the cache."""
        begin, last = len(self.live), len(self.prefilling) - 1
        if j != last:
            self.target.cache.move_row(begin + last, begin + j)
            self.prefilling[j] = self.prefilling[last]
        self.prefilling.pop()
        self.target.cache.drop_rows(begin + len(self.prefilling))

    def _free(self, index: int) -> None:
        last = len(self.live) - 1
        if index != last:
            self.target.cache.move_row(last, index)
            self.drafter.move_row(last, index)
            self.live[index] = self.live[last]
        self.live.pop()
        if self.prefilling:  # the prefilling rows follow the live ones: the last of them fills the hole
            self.target.cache.move_row(last + len(self.prefilling), last)
            self.prefilling.insert(0, self.prefilling.pop())
        self.target.cache.drop_rows(len(self.live) + len(self.prefilling))
        self.drafter.release(len(self.live))
        if not self.live and not self.prefilling:
            self.target.cache.shrink()  # idle: a long prompt's memory goes back
            if not self.waiting:
                release_heap()
        else:  # a long row's memory goes back when it ends, though others go on
            self.target.cache.fit()

    def _finish(self, row: Row, reason: str) -> None:
        row.finish_reason = reason
        row.finished_at = time.perf_counter()
        if self.tokenizer is not None and reason != "stop":
            row.text = self.tokenizer.decode(row.token_ids, skip_special_tokens=True)
        c = row.counters
        stats = {
            "method": self.method,
            "new_tokens": len(row.token_ids),
            "target_calls": c.steps,
            "draft_calls": c.draft_calls,  # forwards shared by the batch: each row counts the ones it took part in
            "target_tokens": c.target_tokens,
            "steps": c.steps,
            "drafted": c.drafted,
            "accepted": c.accepted,
            "accepted_per_position": c.accepted_per_position,
            "drafted_per_position": c.drafted_per_position,
            "prompt_tokens": len(row.request.prompt_ids),
            "cached_tokens": row.cached,  # prompt positions restored from the prefix store, not prefilled
            "prefill_calls": c.prefill_calls,
            "verifier_accepted": c.verifier_accepted,
            "finish_reason": reason,
            "seed": row.seed,
            "wall_time_s": row.finished_at - row.submitted,
            "time_to_first_token_s": (row.first_token_at - row.submitted) if row.first_token_at else None,
        }
        if self.selector.discards:
            stats["proposed"] = c.proposed  # drafted, before the select phase dropped some unverified
        self.finished[row.id] = Result(
            row.id, list(row.token_ids), row.text, reason, stats,
            list(row.logprobs) if row.request.logprobs is not None else None,
            list(row.prompt_logprobs) if row.request.prompt_logprobs is not None else None)


def _slot_histories(draft: RowsDraft, b: int, tokens: list[int]) -> list[list[int]]:
    """Row b's drafted tokens each verified position follows: a chain's position j, its first j; a tree's slot
    1 + i, node i's ancestors and itself (slot 0, the pending token, none)."""
    n = draft.counts[b]
    if draft.parents is None:
        return [tokens[:j] for j in range(n + 1)]
    paths: list[list[int]] = []
    for i, p in enumerate(draft.parents[b]):
        paths.append((paths[p] if p >= 0 else []) + [tokens[i]])
    return [[]] + paths


def _renormalised(probs: torch.Tensor) -> torch.Tensor:
    total = probs.sum(-1, keepdim=True)
    return torch.where(total > 0, probs / total.clamp_min(1e-30), probs)


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
