"""A short request sent while a long prompt is being prefilled: its latency against its latency alone.

The fault probe of issue 23: a 7,000-token completions prompt (max_tokens 1), then 1 s later a short chat
request. Before chunked prefill shared the decoding steps, the short request waited for the whole prefill.
Runs `draftwise serve`'s app in-process (uvicorn on a free loopback port) over the registry target and
writes JSON:

    python benchmarks/long_prompt.py --json benchmarks/results/long-prompt.json
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
import urllib.request

from draftwise.bench import scripts
from draftwise.server import ServerConfig, Service, ThreadedServer, create_app

SHORT = {"messages": [{"role": "user", "content": "What is the capital of Germany?"}], "max_tokens": 32,
         "temperature": 0}


def post(url: str, path: str, body: dict) -> tuple[float, dict]:
    request = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return time.perf_counter() - started, answer


def cached_tokens(answer: dict) -> int:
    """Prompt tokens the server restored from its prefix store (usage.prompt_tokens_details.cached_tokens)."""
    return int(((answer.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def main() -> int:
    parser = scripts.parser(__doc__, threads=None)
    parser.add_argument("--target", default="smollm2-135m")
    parser.add_argument("--method", default="sd")
    parser.add_argument("--long-tokens", type=int, default=7000)
    parser.add_argument("--delay", type=float, default=1.0, help="seconds between the long and the short request")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--short-tokens", type=int, default=32, help="the short request's max_tokens")
    parser.add_argument("--ignore-eos", action="store_true", help="the short request runs to --short-tokens")
    parser.add_argument("--chunk", type=int, default=None, help="prompt tokens per row and forward when nothing "
                        "decodes (default: the engine's PREFILL_CHUNK)")
    parser.add_argument("--prefill-share", type=float, default=None,
                        help="what prompt tokens beside decoding rows may cost, as a share of a decoding step "
                        "(default: the engine's PREFILL_SHARE)")
    args = scripts.parse(parser)
    from draftwise.drafters import base as drafters
    from draftwise.engine import core as engine
    from draftwise.engine import scheduler
    if args.chunk:  # the engine's chunk and the prefill helper's
        scheduler.PREFILL_CHUNK = drafters.PREFILL_CHUNK = args.chunk
    if args.prefill_share:
        engine.PREFILL_SHARE = args.prefill_share

    target, draft = scripts.target_and_draft(args.target, args.method)
    service = Service(ServerConfig(model_name="m", method=args.method), target, draft)
    vocab = target.tokenizer.get_vocab()
    words = [i for t, i in sorted(vocab.items()) if t.isalpha() and len(t) > 3][:2000]  # token ids of words

    def long_prompt(repeat: int) -> list[int]:
        """Token ids of words, a different prompt each repeat: the server's prefix store would otherwise hold
        most of the last one, and the repeat would measure a shorter prefill at a deeper context."""
        return [words[(i * 7919 + repeat * 104729) % len(words)] for i in range(args.long_tokens)]
    runs = []
    with ThreadedServer(create_app(service)) as server:
        url = server.url
        body = {"model": "m", **SHORT, "max_tokens": args.short_tokens, "ignore_eos": args.ignore_eos}
        post(url, "/v1/chat/completions", body)  # warm-up
        for repeat in range(args.repeats):
            alone, answer = post(url, "/v1/chat/completions", body)
            results: dict[str, float] = {}

            def send_long() -> None:
                timed, answer_long = post(url, "/v1/completions", {"model": "m", "prompt": long_prompt(repeat),
                                                                   "max_tokens": 1})
                results["long_s"], results["long_cached"] = timed, cached_tokens(answer_long)

            thread = threading.Thread(target=send_long)
            thread.start()
            time.sleep(args.delay)
            beside, answer_beside = post(url, "/v1/chat/completions", body)
            thread.join()
            same = answer["choices"][0]["message"]["content"] == answer_beside["choices"][0]["message"]["content"]
            runs.append({"alone_s": alone, "beside_long_s": beside, "ratio": beside / alone, "long_s": results["long_s"],
                         "long_cached_tokens": results["long_cached"],
                         "same_text": same, "completion_tokens": answer["usage"]["completion_tokens"]})
            print(json.dumps(runs[-1]), flush=True)
    from draftwise.engine import core as engine, scheduler
    report = {"target": args.target, "method": args.method, "long_tokens": args.long_tokens, "delay_s": args.delay,
              "short_max_tokens": args.short_tokens, "short_ignore_eos": args.ignore_eos, "prefill_chunk": scheduler.PREFILL_CHUNK, "prefill_share": engine.PREFILL_SHARE,
              "weights": target.weights, "runs": runs,
              "median_ratio": statistics.median(r["ratio"] for r in runs),
              "median_alone_s": statistics.median(r["alone_s"] for r in runs),
              "median_beside_long_s": statistics.median(r["beside_long_s"] for r in runs),
              "median_long_s": statistics.median(r["long_s"] for r in runs)}
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    scripts.finish(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
