"""The EAGLE head drafting for rows of the batched engine.

Alignment (EAGLE): head position i reads (target feature_i,
token_{i+1}) and predicts feature_{i+1}, whose LM-head logits score token_{i+2}. The
head's one decoder layer keeps its own position-indexed KV cache, one row per request.

Per row: `features[row]` holds the target's true last-layer features of positions
`cached[row] .. num_features[row] - 1` not yet read by the head; head positions before
`cached[row]` were computed from true features and stay in its cache. Drafting steps
append predicted positions, which the rewind drops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from draftwise.drafters.base import Drafter, draft_chains
from draftwise.heads.eagle import DraftHead
from draftwise.errors import DraftwiseError
from draftwise.models.runner import ModelRunner, full_vocabulary_logits
from draftwise.drafters.policies import FixedLength, LengthPolicy

if TYPE_CHECKING:
    from draftwise.engine.protocols import RowsDraft

CATCH_UP = 256  # true-feature positions a row's head reads per step: a long prompt's catch-up is spread over
# steps (the row drafts nothing until it is done), so it never stalls the other rows' step


class EagleRowsDrafter(Drafter):
    wants_features = True

    def __init__(self, head: DraftHead, vocab_size: int, device: torch.device, *,
                 eos_token_ids: frozenset[int] = frozenset(), policy: LengthPolicy | None = None,
                 keep_raw: bool = False) -> None:
        self.head = head
        self.vocab_size = vocab_size
        self.device = device
        if hasattr(head, "pack_for_inference") and not head.training:
            head.pack_for_inference()
        self.runner = ModelRunner(head.body, rows=0)
        self.dtype = head.fc.weight.dtype  # the head's input dtype (read every step: a module attribute chain is slow)
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.long, device=device)
        self.policy = policy or FixedLength()
        self.keep_raw = keep_raw  # unwarped draft distributions for rules that read them (cascades)
        usable = head.vocab_ids < vocab_size  # padded vocabularies: draft ids past the shared size are never drafted
        if not bool(usable.any()):
            raise DraftwiseError(f"no id of this EAGLE head's draft vocabulary is below the vocabulary size {vocab_size}")
        self.usable = usable  # [draft_vocab] bool
        # the usable columns as indices (None: every column), so a step's logits are not masked by a boolean tensor
        self._usable_cols = None if bool(usable.all()) else usable.nonzero().squeeze(1)
        self.usable_ids = head.vocab_ids[usable]  # [usable] full-vocabulary ids
        self.features: list[torch.Tensor] = []  # per row [n, hidden]
        self.cached: list[int] = []
        self.num_features: list[int] = []
        self.last_state: list[torch.Tensor | None] = []  # per row: the head's output at position cached - 1
        self.prefill_calls = 0  # catch-up reads while every row was behind (see `catch_up`)

    @property
    def calls(self) -> int:
        """Drafting forwards (the catch-up reads of rows that were all behind are counted apart, in `prefill_calls`)."""
        return self.runner.calls - self.prefill_calls

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.feature_layers

    def admit(self, row: int, prompt_ids: Sequence[int]) -> None:
        while len(self.features) <= row:
            self.features.append(torch.empty(0, self.head.feature_size, device=self.device))
            self.cached.append(0)
            self.num_features.append(0)
            self.last_state.append(None)
        self.runner.cache.reset_row(row)
        self.features[row] = self.features[row][:0]
        self.cached[row] = self.num_features[row] = 0
        self.last_state[row] = None

    def observe(self, row: int, start: int, states: torch.Tensor) -> None:
        """The target's features of positions start .. start + n - 1 (earlier unread ones past `start` drop)."""
        keep = max(0, start - self.cached[row])
        states = self.head.take_features(states).to(self.features[row].dtype)
        # (the common case, nothing unread kept: the states themselves; `_read` copies what it reads)
        self.features[row] = torch.cat([self.features[row][:keep], states]) if keep else states
        self.num_features[row] = start + states.shape[0]

    def _embed_fuse(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """[rows, n, F] target features (or [rows, n, H] predicted ones), [rows, n] next tokens -> the head body's
        inputs."""
        return self.head.step_input(features, tokens)

    def catch_up(self, rows, limits: Sequence[int]) -> tuple[torch.Tensor, list[int]]:
        """The head reads each row's unread true features (at most CATCH_UP): returns its predicted state after
        the last one [rows, H] and the rows' drafting limits (0 for a row still catching up or without features)."""
        n = len(rows)
        # a row without any target feature yet (a one-token prompt) drafts nothing this step; it feeds
        # one dummy position that is rolled back below
        bare = [b for b in range(n) if self.num_features[b] == 0]
        # every row behind: no batch-mate's step is held up, so they read all but their last CATCH_UP features
        # now, CATCH_UP a forward, and draft in this very step
        while n and all(self.num_features[b] - self.cached[b] > CATCH_UP for b in range(n)):
            self._read(rows, [CATCH_UP] * n, [])
            self.prefill_calls += 1
        # catch up: head positions cached .. num_features - 1 read (feature_i, token_{i+1}), at most CATCH_UP
        counts = [max(self.num_features[b] - self.cached[b], 1) for b in range(n)]
        behind = [b for b in range(n) if counts[b] > CATCH_UP]
        counts = [min(c, CATCH_UP) for c in counts]
        limits = [0 if b in bare or b in behind else limit for b, limit in enumerate(limits)]
        predicted = self._read(rows, counts, bare)
        for b in bare:
            self.runner.trim_row(b, 0)
        return predicted, limits

    def _read(self, rows, counts: list[int], bare: list[int]) -> torch.Tensor:
        """The head reads counts[b] of row b's unread true features (a bare row: one dummy position); returns its
        predicted state after the last one read [rows, H]."""
        n = len(rows)
        dtype = self.dtype
        span = max(counts)
        nexts = [[] if b in bare else list(row.sequence[self.cached[b] + 1: self.cached[b] + 1 + counts[b]])
                 for b, row in enumerate(rows)]
        nexts = [tokens + [0] * (span - len(tokens)) for tokens in nexts]
        even = all(c == span for c in counts)
        if even and not bare:  # the common step: one stack, no padding
            feats = torch.stack([self.features[b][:span] for b in range(n)]).to(dtype)
        else:
            feats = torch.zeros(n, span, self.head.feature_size, dtype=dtype, device=self.device)
            for b in range(n):
                if b not in bare:
                    feats[b, :counts[b]] = self.features[b][:counts[b]].to(dtype)
        nexts = torch.tensor(nexts, dtype=torch.long, device=self.device)
        states = self.runner.forward_states(self._embed_fuse(feats, nexts), counts)
        if even:
            predicted = states[:, span - 1]  # [rows, H]
        else:
            last = torch.tensor([c - 1 for c in counts], device=self.device)
            predicted = states[torch.arange(n, device=self.device), last]  # [rows, H]
        for b in range(n):
            if b not in bare:
                self.cached[b] += counts[b]
                self.features[b] = self.features[b][counts[b]:]
            self.last_state[b] = None if b in bare else predicted[b]
        return predicted

    def begin(self, rows, limits: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Beam search's first step (mtad.BeamRowsDrafter): catch up, then the head's state scores the first token.
        Returns the logits [rows, vocab], the states [rows, H] and the rows' drafting limits."""
        state, limits = self.catch_up(rows, limits)
        return self.full_logits(state), state, limits

    @torch.inference_mode()
    def beam_step(self, tokens: torch.Tensor, states: torch.Tensor, begin: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One beam step on rows begin .. begin + m - 1 of the head's cache: each reads its state and its token
        [m]; returns the full-vocabulary logits of the next token [m, vocab] and the new states [m, H]."""
        logits, states = self.draft_step(states, tokens, begin=begin)
        return full_vocabulary_logits(logits, self.usable_ids, self.vocab_size), states

    def draft_step(self, states: torch.Tensor, tokens: torch.Tensor, *,
                   begin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafting step of the head on rows begin .. begin + m - 1 of its cache: each reads its last predicted
        state [m, H] and the token drafted from it [m]. Returns the next token's logits over the usable draft
        vocabulary [m, usable] and the new predicted states [m, H]."""
        assert states.ndim == 2 and tokens.ndim == 1, (states.shape, tokens.shape)
        fused = self._embed_fuse(states[:, None].to(self.dtype), tokens[:, None])
        states = self.runner.forward_states(fused, [1] * tokens.shape[0], begin=begin)[:, 0]
        return self._usable_logits(states), states

    def _usable_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[m, H] head states -> [m, usable draft vocabulary] logits."""
        logits = self.head.logits(states)
        return logits if self._usable_cols is None else logits.index_select(-1, self._usable_cols)

    def full_logits(self, states: torch.Tensor) -> torch.Tensor:
        """[m, H] head states -> [m, vocab] logits, -inf outside the draft vocabulary."""
        return full_vocabulary_logits(self._usable_logits(states), self.usable_ids, self.vocab_size)

    @torch.inference_mode()
    def propose(self, rows, limits, *, tree_nodes: int = 0, tree_min_prob: float = 0.0) -> "RowsDraft":
        from draftwise.engine.protocols import empty_draft

        n = len(rows)
        width = max(limits, default=0)
        if width == 0:
            return empty_draft(n, self.vocab_size, self.device)
        predicted, limits = self.catch_up(rows, limits)
        if tree_nodes > 0:
            return self._propose_trees(predicted, limits, tree_nodes, tree_min_prob)

        def advance(token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal predicted
            logits, predicted = self.draft_step(predicted, token)
            return logits, predicted

        # a verifier policy (SPRINTER, SpecDec++) reads the head's state behind each drafted token, as it reads a
        # draft model's last hidden state
        return draft_chains(rows, limits, (self._usable_logits(predicted), predicted), advance,
                            vocab_size=self.vocab_size, eos=self.eos, policy=self.policy, keep_raw=self.keep_raw,
                            ids=self.usable_ids)

    def _propose_trees(self, predicted: torch.Tensor, limits: Sequence[int], nodes: int, min_prob: float
                       ) -> "RowsDraft":
        """EAGLE-2's dynamic tree (tree_growth.grow_on): a node's head input is its parent's predicted state and its own
        token; deterministic candidates, so exact at any temperature. The tree grows over the draft vocabulary
        (the head gives nothing else any probability); its token ids map to the target's at the end."""
        from draftwise.drafters.tree_growth import grow_on, tree_draft

        dtype = self.dtype
        n = predicted.shape[0]
        fed_states: list[list[torch.Tensor]] = [[] for _ in range(n)]  # per row, the state at each fed region slot

        def expand(tokens, counts, mask, request):
            m = tokens.shape[1]
            parents = torch.zeros(n, m, predicted.shape[-1], dtype=predicted.dtype, device=self.device)
            for b, items in enumerate(request):
                for j, (_, parent, _, _) in enumerate(items):
                    parents[b, j] = predicted[b] if parent < 0 else fed_states[b][parent]
            states = self.runner.forward_states(self._embed_fuse(parents.to(dtype), tokens), counts, tree=mask)
            for b, items in enumerate(request):
                fed_states[b].extend(states[b, : len(items)])
            return draft_logprobs(states.reshape(n * m, -1)).view(n, m, -1)

        def draft_logprobs(states: torch.Tensor) -> torch.Tensor:  # [m, usable draft vocabulary]
            return torch.log_softmax(self._usable_logits(states).float(), -1)

        tokens, parents, scores = grow_on(self.runner, draft_logprobs(predicted), expand,
                                          budgets=[nodes if limit > 0 else 0 for limit in limits],
                                          max_depths=limits, stop_tokens=frozenset(self.eos.tolist()),
                                          min_probs=[min_prob] * n, token_ids=self.usable_ids.tolist())
        return tree_draft(tokens, parents, self.vocab_size, self.device, scores)

    def rewind(self, row: int, keep: int) -> None:
        """The row keeps `keep` positions with true features; predicted head positions are dropped."""
        self.num_features[row] = min(self.num_features[row], keep)
        self.features[row] = self.features[row][: max(0, self.num_features[row] - self.cached[row])]
        self.cached[row] = min(self.cached[row], self.num_features[row])
        self.runner.trim_row(row, min(self.runner.lengths[row], self.cached[row]))

    @torch.inference_mode()
    def next_distribution(self, contexts: Sequence[Sequence[int]], configs) -> tuple[torch.Tensor, torch.Tensor]:
        """(unwarped, warped) head distributions of the token after each row's context (cascades' bonus from pi);
        NaN rows where the head has no state to score from (the engine takes the target's distribution there).

        Called after verification, before the rewind: the target's features of the context's positions
        are in, so the head catches up on them (its drafted positions are dropped first) and scores the
        next token. Features of the context's last position stay unread, as the rewind expects."""
        from draftwise.engine.sampler import warp_rows
        from draftwise.engine.sampling import unwarped

        n = len(contexts)
        counts = []
        for b, context in enumerate(contexts):
            self.runner.trim_row(b, min(self.runner.lengths[b], self.cached[b]))
            count = len(context) - 1 - self.cached[b]
            if count < 0 or count > self.features[b].shape[0]:
                raise DraftwiseError(f"EAGLE head row {b}: no target features for a context of {len(context)} tokens")
            counts.append(count)
        dtype = self.dtype
        span = max(max(counts, default=0), 1)
        feats = torch.zeros(n, span, self.head.feature_size, dtype=dtype, device=self.device)
        nexts = torch.zeros(n, span, dtype=torch.long)
        for b, context in enumerate(contexts):
            c, start = counts[b], self.cached[b]
            feats[b, :c] = self.features[b][:c].to(dtype)
            nexts[b, :c] = torch.tensor(list(context[start + 1 : start + 1 + c]), dtype=torch.long)
        states = self.runner.forward_states(self._embed_fuse(feats, nexts.to(self.device)), [max(c, 1) for c in counts])
        picked, unknown = [], []
        for b in range(n):
            c = counts[b]
            if c == 0:  # nothing new was accepted: the state from the last catch-up scores the next token
                self.runner.trim_row(b, self.cached[b])
            else:
                self.cached[b] += c
                self.features[b] = self.features[b][c:]
                self.last_state[b] = states[b, c - 1]
            # no state yet (a one-token prompt: no target feature precedes the token to score)
            unknown.append(self.last_state[b] is None)
            picked.append(states[b, 0] if self.last_state[b] is None else self.last_state[b])
        logits = self._usable_logits(torch.stack(picked))
        full = full_vocabulary_logits(logits, self.usable_ids, self.vocab_size)
        q_raw, q_warped = unwarped(full), warp_rows(full, configs)
        if any(unknown):  # rows the head cannot score: NaN, which the engine replaces with the target's
            rows = torch.tensor(unknown, device=q_raw.device)
            q_raw[rows], q_warped[rows] = float("nan"), float("nan")
        return q_raw, q_warped

    def move_row(self, src: int, dst: int) -> None:
        self.runner.cache.move_row(src, dst)
        self.features[dst] = self.features[src]
        self.cached[dst] = self.cached[src]
        self.num_features[dst] = self.num_features[src]
        self.last_state[dst] = self.last_state[src]

    def release(self, live: int) -> None:
        self.runner.cache.drop_rows(live)
        self.runner.cache.fit()
        del self.features[live:], self.cached[live:], self.num_features[live:], self.last_state[live:]
