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

from draftwise.engine.grammar import compiler_for
from draftwise.engine.keyed import COUPLINGS, fresh_seed
from draftwise.engine.output import Output
from draftwise.engine.protocols import RowsDrafter, TargetRule, VerifyAll, VerifySelector
from draftwise.engine.rows import Detokenizer, Request, Result, Row, RowCounters
from draftwise.engine.sampling import make_generator
from draftwise.engine.scheduler import Scheduler
from draftwise.engine.step import Stepper
from draftwise.engine.tree import TreeBudget
from draftwise.errors import DraftwiseError
from draftwise.models.linear import out_rows
from draftwise.models.runner import ModelRunner


PREFILL_SHARE = 0.25  # long prompts' tokens a step feeds beside decoding rows may cost this fraction of a decoding step


class Engine(Scheduler, Stepper, Output):
    """Continuous batching of one method over many requests. See the module docstring; the scheduler, the step
    and the output live in scheduler.py, step.py and output.py."""

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
        self._feedback = getattr(drafter, "update", None)  # drafters.base.Drafter.update
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
        if request.params.grammar is not None:
            vocab = self.target.vocab_size or out_rows(self.target.model.get_output_embeddings())
            row.grammar = compiler_for(self.tokenizer, vocab, request.eos_token_ids).state(
                request.params.grammar, self.target.device)
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

    def run(self) -> dict[int, Result]:
        while self.has_work:
            self.step()
        return self.results()
