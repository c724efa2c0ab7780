"""Prefix reuse on a multi-turn chat: time to first token of the second turn, with and without the store.

Each conversation opens with a long system message (a document of Spec-Bench questions, a different one
per conversation) and a first question; the second turn resends the conversation with the model's answer
and a follow-up question, as chat clients do. Two in-process servers over the same loaded models, one
with `prefix_cache_mb` and one with 0, answer the same conversations in alternating order; time to first
token is measured on the stream (the first chunk with content). Writes JSON:

    python benchmarks/multi_turn.py --json benchmarks/results/multi-turn.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from draftwise.bench import scripts
from draftwise.server import ServerConfig, Service, ThreadedServer, create_app, loadtest

QUESTIONS = Path(__file__).resolve().parents[1] / "draftwise" / "data" / "spec_bench" / "question.jsonl"


def documents(count: int, words: int) -> list[str]:
    turns = [t for line in QUESTIONS.read_text().splitlines() for t in json.loads(line)["turns"]]
    out = []
    for i in range(count):
        text, j = [], i * 37
        while sum(len(t.split()) for t in text) < words:
            text.append(turns[j % len(turns)])
            j += 1
        out.append("\n\n".join(text))
    return out


def stream(url: str, body: dict) -> tuple[float, str, dict]:
    """(time to first content, full text, usage) of a streamed chat request (the load test's client)."""
    path, request = "/v1/chat/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    record = loadtest.Client(url).stream(path, request, time.perf_counter() + 600)
    if not record["ok"]:
        raise SystemExit(f"multi_turn: the request failed: {record.get('error') or record.get('status')}")
    return record["ttft_s"] or record["e2e_s"], record["text"], record["usage"]


def conversation(url: str, document: str, max_tokens: int) -> dict:
    messages = [{"role": "system", "content": "Answer questions about these notes.\n\n" + document},
                {"role": "user", "content": "Which topic comes first in the notes?"}]
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    ttft1, answer, usage1 = stream(url, body)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And which comes last?"}]
    ttft2, _, usage2 = stream(url, {**body, "messages": messages})
    return {"ttft_turn1_s": ttft1, "ttft_turn2_s": ttft2, "prompt_tokens_turn2": usage2.get("prompt_tokens"),
            "cached_tokens_turn2": (usage2.get("prompt_tokens_details") or {}).get("cached_tokens")}


def main() -> int:
    parser = scripts.parser(__doc__, threads=None)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--method", default="sd")
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--document-words", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prefix-cache-mb", type=float, default=256.0)
    args = scripts.parse(parser)

    target, draft = scripts.target_and_draft(args.target, args.method)
    servers = {on: ThreadedServer(create_app(Service(ServerConfig(
        model_name="m", method=args.method, prefix_cache_mb=args.prefix_cache_mb if on else 0.0), target, draft)))
        for on in (True, False)}
    runs: dict[bool, list[dict]] = {True: [], False: []}
    try:
        for server in servers.values():
            server.start()
            conversation(server.url, documents(1, 200)[0], 4)  # warm-up (a short document, its own store)
        for i, document in enumerate(documents(args.conversations, args.document_words)):
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                runs[on].append(conversation(servers[on].url, document, args.max_tokens))
                print(json.dumps({"prefix_cache": on, **runs[on][-1]}), flush=True)
    finally:
        for server in servers.values():
            server.stop()

    def median(on: bool, key: str) -> float:
        return statistics.median(r[key] for r in runs[on])

    report = {
        "target": args.target, "method": args.method, "conversations": args.conversations,
        "document_words": args.document_words, "max_tokens": args.max_tokens, "prefix_cache_mb": args.prefix_cache_mb,
        "median_ttft_turn2_with_s": median(True, "ttft_turn2_s"), "median_ttft_turn2_without_s": median(False, "ttft_turn2_s"),
        "ttft_turn2_speedup": median(False, "ttft_turn2_s") / median(True, "ttft_turn2_s"),
        "median_ttft_turn1_with_s": median(True, "ttft_turn1_s"), "median_ttft_turn1_without_s": median(False, "ttft_turn1_s"),
        "median_prompt_tokens_turn2": median(True, "prompt_tokens_turn2"),
        "median_cached_tokens_turn2": median(True, "cached_tokens_turn2"),
        "runs": {"with": runs[True], "without": runs[False]},
    }
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    scripts.finish(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
