"""The step: draft, select, verify and accept over the live rows, for chains and token trees (the target's
logits processed per request, grammars, the rule's distributions and bonus). A mixin of `core.Engine`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from draftwise.engine.grammar import mask_logits
from draftwise.engine.keyed import row_draws
from draftwise.engine.protocols import RowsDraft, StepDistributions, pad_rows
from draftwise.engine.rows import Event, Row
from draftwise.engine.sampler import RowsAcceptance, accept_greedy, accept_own_draws, speculative_sample_rows, warp_rows
from draftwise.engine.sampling import SamplingConfig
from draftwise.engine.tree import TreeAcceptance, accept_tree, depths, verify_mask
from draftwise.errors import DraftwiseError
from draftwise.models.runner import RowsOutput


@dataclass
class StepBatch:
    """One step's rows as its phases read them, built once a step after drafting: each row's sampling config and
    greedy flag, and the drafted tokens copied to the host once (each row's whole draft: a prefix of the draft, cut
    by the selector, a grammar, a tree budget or the rule, reads the same lists up to its own counts)."""

    rows: Sequence[Row]
    samplings: list[SamplingConfig]
    greedy: list[bool]  # temperature-0 rows
    tokens: list[list[int]]  # [rows][k] the drafted tokens, on the host
    _greedy_mask: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def of(cls, rows: Sequence[Row], draft: RowsDraft) -> "StepBatch":
        samplings = [row.request.sampling for row in rows]
        return cls(rows, samplings, [config.greedy for config in samplings],
                   draft.tokens.tolist() if draft.width else [[] for _ in rows])

    def greedy_mask(self, device: torch.device) -> torch.Tensor:
        """[rows] bool on `device`, the greedy flags as a tensor (made once a step)."""
        if self._greedy_mask is None:
            self._greedy_mask = torch.tensor(self.greedy, device=device)
        return self._greedy_mask


class Stepper:
    """The step of `core.Engine` (see its docstring)."""

    @torch.inference_mode()
    def step(self) -> list[Event]:
        """Admit what fits, then one draft -> verify -> accept -> rewind step over the live rows (with a share of
        the waiting prompts fed in the same target forward)."""
        self._schedule()
        if not self.live:
            return []
        started = time.perf_counter()
        rows = self.live
        limits = [max(0, min(self.gamma, row.budget - 1)) for row in rows]
        limits = self.selector.limits(rows, limits)
        drafter_calls = self.drafter.calls

        if self.tree_budget is not None:  # draft: trees of each row's node budget at this batch size, grown no
            # lower than the least path probability worth growing (tree.TreeBudget)
            draft = self.drafter.propose(rows, limits, tree_nodes=self.tree_budget.growth(len(rows)),
                                         tree_min_prob=self.tree_budget.min_prob(len(rows)))
        else:
            draft = self.drafter.propose(rows, limits)  # draft: chains
        proposed = draft.counts
        batch = StepBatch.of(rows, draft)
        if draft.parents is not None:  # token trees: their own verification and acceptance
            if self.tree_budget is not None:
                self.tree_budget.observe_draft(time.perf_counter() - started)
                if draft.scores is not None:  # each row's tree cut where its nodes stop paying
                    kept = self.tree_budget.cut(draft.scores)
                    if kept != list(draft.counts):
                        draft = draft.prefix(kept)
            return self._tree_step(batch, draft, proposed, drafter_calls, started)
        if draft.width:  # select: the prefix of each draft to verify
            chosen = self.selector.select(rows, draft)
            if list(chosen) != list(draft.counts):
                draft = draft.prefix(chosen)
        grammars = [b for b, row in enumerate(rows) if row.grammar is not None]
        if grammars:  # the grammar rows' paths follow their drafts, cut at a token the grammar refuses
            draft = self._grammar_drafts(batch, grammars, draft)
        counts = [1 + c for c in draft.counts]  # verify: the pending token and the drafts
        verified, plan = self._verify(rows, draft, counts)
        if self.drafter.wants_features:
            for b, row in enumerate(rows):
                self.drafter.observe(b, len(row.sequence) - 1, verified.hidden[b, : counts[b]])
        target_logits = self._processed(batch, draft, verified.logits)  # [rows, k + 1, vocab]
        if grammars:  # the target's distribution at every verified position, masked by the grammar there
            target_logits = self._grammar_masked(rows, grammars, draft, target_logits)
        drafted = draft.counts
        outcome, draft = self._accept(batch, draft, target_logits)
        drafter_calls = self.drafter.calls - drafter_calls  # drafting forwards of this step, over every row
        verdicts_host = draft.verdicts.tolist() if draft.verdicts is not None else None
        committed = [batch.tokens[b][:a] + [t] for b, (a, t) in enumerate(zip(outcome.num_accepted,
                                                                            outcome.next_tokens))]
        verifier = [sum(v[:c]) for v, c in zip(verdicts_host, draft.counts)] if verdicts_host else [0] * len(rows)

        def record(b: int, row: Row, accepted: int) -> None:  # nothing past an EOS or a stop string is accepted
            row.counters.record(drafted[b], accepted)

        return self._commit_rows(rows, committed, list(verified.logits), outcome.num_accepted, record, verifier,
                                 counts, proposed, drafter_calls, verified.hidden, plan, started)

    def _accept(self, batch: StepBatch, draft: RowsDraft, target_logits: torch.Tensor
                ) -> tuple[RowsAcceptance | TreeAcceptance, RowsDraft]:
        """The accept phase, for chains and trees and any mix of greedy and sampled rows. Returns the outcome and the
        draft it decided (a rule that cuts drafts shortens it).

        - Under the exact rule nothing is built that only restates the target or a draft: pi is the target itself,
          a draft without distributions (`RowsDraft.q` None) is read as q(x) = 1 at its tokens, and (unless the
          selector reads the target's distributions) greedy rows keep their logits, of which only the argmax is
          read. No one-hot is made; an all-greedy chain step compares argmax tokens (`accept_greedy`).
        - Trees walk each row by the target's own draw (`tree.accept_tree`).
        - Chains: the target's own draw at each position (`accept_own_draws`) for Gumbel-coupled and deterministic
          drafts under the exact rule, otherwise the speculative sampler with pi = rule(draft, target) (one rule
          call with per-row greedy flags); the selector observes what the target said."""
        rows = batch.rows
        scores = self.argmax_accept  # greedy rows' distributions are read only for their argmax
        if draft.parents is not None:  # trees need the exact rule and no select phase (Engine.__init__)
            target_probs = warp_rows(target_logits, batch.samplings, greedy_scores=True)
            tokens_host = [t[:c] for t, c in zip(batch.tokens, draft.counts)]
            return accept_tree(draft.parents, tokens_host, target_probs, row_draws(rows, target_probs.device),
                               batch.greedy), draft
        if scores and all(batch.greedy):  # temperature 0: no distribution built
            return accept_greedy(batch.tokens, draft.counts, target_logits), draft
        target_probs = warp_rows(target_logits, batch.samplings, greedy_scores=scores)
        k = draft.width
        if self.exact:
            pi = target_probs[:, :k]  # the exact rule's pi (rules.acceptance.ExactRule), read by nothing else
        else:
            greedy = batch.greedy_mask(target_probs.device)
            if self.rule.cuts_draft and k:  # MTAD: the rule keeps a prefix of each draft; the target's token follows
                draft = draft.prefix(self.rule.prefix(self._step_distributions(draft, target_probs, target_logits,
                                                                               greedy), greedy))
                k = draft.width
            pi = self.rule(self._step_distributions(draft, target_probs, target_logits, greedy)) if k \
                else target_probs[:, :0]
        bonus: torch.Tensor | Callable[[torch.Tensor], torch.Tensor] = target_probs
        if self.rule.bonus_from_pi:  # Algorithm 4: the bonus comes from pi = T(q, p) after the last drafted token
            bonus = self._bonus_maker(batch, draft, target_probs, target_logits, batch.greedy_mask(target_probs.device))
        draws = row_draws(rows, target_probs.device)
        if self.exact and (self.gumbel or draft.deterministic):  # the target's own draw at each position: Gumbel
            # coupled drafts, and deterministic ones (lookup, suffix) under either coupling
            outcome = accept_own_draws(draft.tokens, draft.counts, target_probs, draws, batch.greedy)
        else:
            outcome = speculative_sample_rows(draft.tokens, draft.q, pi, bonus, draft.counts, draws, batch.greedy,
                                              greedy_argmax=scores)
        self.selector.observe(rows, draft, target_probs, target_logits, outcome.num_accepted)
        return outcome, draft

    def _verify(self, rows: Sequence[Row], draft: RowsDraft, counts: list[int], tree: bool = False
                ) -> tuple[RowsOutput, list[int]]:
        """The verification forward: each row's pending token and its drafts (`counts[b]` tokens), with a share of
        the prefilling rows' prompt chunks after them. Returns the live rows' output and the prompt plan."""
        k = draft.width
        last = torch.tensor([row.sequence[-1] for row in rows], dtype=torch.long, device=draft.tokens.device)
        feed = torch.cat([last[:, None], draft.tokens], 1)  # [rows, 1 + k]
        plan = self._shared_plan()
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

    def _tree_step(self, batch: StepBatch, draft: RowsDraft, proposed: list[int], drafter_calls: int,
                   started: float) -> list[Event]:
        """Verify and accept token trees (tree.py): one forward over every row's tree, multi-candidate
        speculative sampling, then the accepted path's keys and values move to contiguous positions."""
        rows = batch.rows
        if any(row.grammar is not None for row in rows):
            raise DraftwiseError("token trees cannot follow a grammar; use a chain draft (tree_nodes=0)")
        counts = [1 + c for c in draft.counts]
        starts = self.target.lengths[: len(rows)]
        verified, plan = self._verify(rows, draft, counts, tree=True)
        target_logits = self._processed(batch, draft, verified.logits)  # [rows, k + 1, vocab]
        outcome, _ = self._accept(batch, draft, target_logits)
        tokens_host = [t[:c] for t, c in zip(batch.tokens, draft.counts)]
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

    @staticmethod
    def _step_distributions(draft: RowsDraft, target_probs: torch.Tensor, target_logits: torch.Tensor,
                            greedy: torch.Tensor) -> StepDistributions:
        return StepDistributions(draft.tokens, draft.probs, target_probs, target_logits, draft.draft_raw,
                                 greedy.to(draft.tokens.device),
                                 draft.verdicts, draft.joint,
                                 torch.tensor(draft.counts, device=draft.tokens.device))

    def _grammar_drafts(self, batch: StepBatch, grammars: list[int], draft: RowsDraft) -> RowsDraft:
        """Each grammar row's path becomes its draft, cut before the first token its grammar refuses (a lookup
        or suffix draft; a model's was drawn under the mask and is whole)."""
        counts = list(draft.counts)
        for b in grammars:
            counts[b] = batch.rows[b].grammar.follow(batch.tokens[b][: counts[b]])
        return draft.prefix(counts) if counts != list(draft.counts) else draft

    def _grammar_masked(self, rows: Sequence[Row], grammars: list[int], draft: RowsDraft,
                        logits: torch.Tensor) -> torch.Tensor:
        """logits [rows, k + 1, vocab] with each grammar row's masks at depths 0 .. its draft length."""
        logits = logits.clone()
        for b in grammars:
            n = draft.counts[b]
            logits[b, : n + 1] = mask_logits(logits[b, : n + 1], rows[b].grammar.masks(n))[0]
        return logits

    def _processed(self, batch: StepBatch, draft: RowsDraft, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits after each request's repetition, frequency and presence penalties, logit_bias and
        min_new_tokens: [rows, k + 1, vocab].

        Position j of row b follows the row's sequence plus the drafted tokens before it (a chain's first j; a
        tree node's ancestors and itself), so the penalty there counts those drafts as already generated, exactly
        as one-token-at-a-time decoding would. The speculative sampler then targets the processed distribution,
        so lossless methods stay exact."""
        rows, drafted = batch.rows, batch.tokens
        penalised = [b for b, row in enumerate(rows) if row.request.params.repetition_penalty != 1.0]
        counted = [b for b, row in enumerate(rows)
                   if row.request.params.frequency_penalty or row.request.params.presence_penalty]
        biased = [b for b, row in enumerate(rows) if row.request.params.logit_bias]
        short = [b for b, row in enumerate(rows)
                 if len(row.token_ids) < row.request.params.min_new_tokens and row.request.eos_token_ids]
        if not penalised and not short and not counted and not biased:
            return logits
        logits = logits.clone()
        width = logits.shape[1]
        for b in penalised:
            seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            seen[torch.tensor(rows[b].sequence, device=logits.device)] = True
            present = seen.expand(width, -1).clone()  # [k + 1, vocab]
            for j, history in enumerate(_slot_histories(draft, b, drafted[b])):
                if history:
                    present[j, torch.tensor(history, device=logits.device)] = True
            penalty = rows[b].request.params.repetition_penalty
            row = logits[b]
            logits[b] = torch.where(present, torch.where(row < 0, row * penalty, row / penalty), row)
        vocab = logits.shape[-1]
        for b in counted:  # OpenAI's: the tokens this request generated (not its prompt), and the drafts before j
            params = rows[b].request.params
            made = torch.tensor(rows[b].token_ids, dtype=torch.long, device=logits.device)
            counts = torch.bincount(made[made < vocab], minlength=vocab).to(logits.dtype).expand(width, -1).clone()
            for j, history in enumerate(_slot_histories(draft, b, drafted[b])):
                if history:
                    counts[j] += torch.bincount(torch.tensor(history, device=logits.device), minlength=vocab)[:vocab]
            logits[b] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
        for b in biased:
            ids, bias = zip(*rows[b].request.params.logit_bias)
            logits[b, :, torch.tensor(ids, device=logits.device)] += torch.tensor(bias, dtype=logits.dtype,
                                                                                  device=logits.device)
        for b in short:
            request = rows[b].request
            eos = torch.tensor(sorted(request.eos_token_ids), device=logits.device)
            eos = eos[eos < logits.shape[-1]]
            missing = request.params.min_new_tokens - len(rows[b].token_ids)  # positions at depth < missing lose EOS
            if draft.parents is None:
                logits[b, :missing, eos] = float("-inf")
            else:
                slot_depths = [0] + depths(draft.parents[b])
                early = torch.tensor([j for j, d in enumerate(slot_depths) if d < missing], device=logits.device)
                logits[b, early[:, None], eos[None, :]] = float("-inf")
        return logits

    def _bonus_maker(self, batch: StepBatch, draft: RowsDraft, target_probs: torch.Tensor,
                     target_logits: torch.Tensor, greedy: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """The sampler calls this with the rows that need a bonus; the draft's extra forward runs only then."""
        def bonus(needed: torch.Tensor) -> torch.Tensor:
            if not bool(needed.any()):
                return target_probs
            return self._bonus_from_pi(batch, draft, target_probs, target_logits, greedy, needed.tolist())
        return bonus

    def _bonus_from_pi(self, batch: StepBatch, draft: RowsDraft, target_probs: torch.Tensor,
                       target_logits: torch.Tensor, greedy: torch.Tensor, needed: Sequence[bool]) -> torch.Tensor:
        """target_probs with row b's position counts[b] replaced by rule.bonus(q, p) there: [rows, k + 1, vocab].

        Only the rows that need a bonus (every drafted token accepted) read the draft past their drafts: a row with
        a rejection reads no further than its sequence, so a drafter never consumes what the rewind drops (an EAGLE
        head would lose the target's features of its rejected positions). Those rows' bonus rows are unused."""
        from draftwise.engine.sampling import unwarped

        rows = batch.rows
        contexts = [row.sequence + (batch.tokens[b][: draft.counts[b]] if needed[b] else [])
                    for b, row in enumerate(rows)]
        q_raw, q_warped = self.drafter.next_distribution(contexts, batch.samplings)
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
