"""Every method's speed on two checkouts of draftwise, before and after a change, in one run (issue 21):
`benchmarks/compare_trees.py`.

Each tree is a checkout of the repository (its `draftwise/` package at the root). Both packages import as
`draftwise`, so every measurement runs in a worker process (`worker.py`, run by path) whose sys.path
starts with that tree. A worker loads the target, the registry's drafts and companion once (outside the
timing), then for every (method, batch size) makes one warm-up call and one timed call, and prints one
JSON line. Repeats alternate trees: before, after, before, after, ... (one worker per tree per repeat); the
report takes the median tokens/s per (tree, method, batch size) and the ratio after / before.

- Models: the registry's defaults, as `draftwise.generate` picks them for a registry target (`--target`,
  default smollm2-135m; `--dtype` unset: generate's own choice): each method's default draft
  (`default_draft`), the registry's companion for `sv` / `staged`, the shipped SPRINTER verifier,
  SpecDec++ head and SV profiles (resolved by generate from the registry names).
- Prompts: the first `--prompts` Spec-Bench questions (first turn, `draftwise/data/spec_bench/question.jsonl`
  of the after tree), passed as strings (chat-formatted by generate). Temperature 0, ignore_eos, `--seed`.
- Batch 1: each prompt decoded alone (`generate(target, prompt)`), tokens/s = new tokens / summed wall time.
  Batch B > 1: one call `generate(target, prompts, max_batch_size=B)` over the first max(--prompts, B)
  prompts, so a batch of B is full (the row records how many prompts it decoded).
- `--batch-sizes` apply to every method; `--extra METHOD:B,...` adds sizes for single methods (only for
  methods selected by `--methods`).
- A (method, batch size) a tree refuses (a DraftwiseError, e.g. the old tree's one-request-at-a-time
  methods given a list of prompts) or fails on is recorded with its message; the other rows go on.
- Per row: tokens/s, target calls per token, mean accepted length (new tokens / target calls, as
  `draftwise.bench.metrics`), acceptance rate, and for the after tree whether each request's token ids equal
  the before tree's (where the before tree refused a batch size, against its batch-1 outputs).

The JSON is rewritten (atomically) after every worker, so an interrupted run keeps what it measured (`compare.run`).
Run it with nothing else on the machine.
"""
