"""`GET /metrics` through `prometheus_client`, with names like vLLM's (`draftwise:` in place of `vllm:`).

The speculative counters are sums of exactly the per-request numbers each response carries in
`usage.draftwise`, so a client can check one against the other. Written by the engine thread and
the HTTP handlers, read by `/metrics`; `prometheus_client` locks each value. Every server has its
own registry, never the library's global one, so several can live in one process.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

# No `<name>_created` series beside each counter and histogram: the exposed names stay exactly the ones
# below, as vLLM's do. (A process-wide switch of the library; it touches nothing else.)
disable_created_metrics()

PREFIX = "draftwise:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# name -> (type, help, labels besides model_name); counters carry the `_total` suffix in their name
SPEC: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "spec_decode_num_drafts_total": ("counter", "Verification steps that carried at least one draft token.",
                                     ("method",)),
    "spec_decode_num_draft_tokens_total": ("counter", "Draft tokens sent to verification (usage.draftwise.drafted).",
                                           ("method",)),
    "spec_decode_num_accepted_tokens_total": ("counter", "Draft tokens accepted (usage.draftwise.accepted).",
                                              ("method",)),
    "spec_decode_num_accepted_tokens_per_pos_total": ("counter", "Accepted draft tokens by draft position.",
                                                      ("method", "position")),
    "spec_decode_num_target_calls_total": ("counter", "Target verification forwards per request, summed "
                                           "(usage.draftwise.target_calls).", ("method",)),
    "prompt_tokens_total": ("counter", "Prompt tokens of finished requests (usage.prompt_tokens).", ("method",)),
    "prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix store.", ("method",)),
    "prefix_cache_hits_total": ("counter", "Prompt tokens restored from the prefix store, not prefilled "
                                "(usage.prompt_tokens_details.cached_tokens).", ("method",)),
    "generation_tokens_total": ("counter", "Generated tokens of finished requests (usage.completion_tokens).",
                                ("method",)),
    "request_success_total": ("counter", "Requests that finished, by finish reason.", ("finished_reason", "method")),
    "request_cancelled_total": ("counter", "Requests cancelled before they finished (client gone, shutdown).",
                                ("method",)),
    "request_failure_total": ("counter", "Requests that failed inside the engine.", ()),
    "request_rejected_total": ("counter", "Requests refused before decoding, by HTTP status.", ("status",)),
    "num_requests_running": ("gauge", "Requests decoding in an engine row.", ()),
    "num_requests_waiting": ("gauge", "Requests waiting for an engine row.", ()),
    "time_to_first_token_seconds": ("histogram", "Arrival to first generated token.", ()),
    "inter_token_latency_seconds": ("histogram", "Time between consecutive token deliveries of a request (a "
                                    "speculative step delivers several tokens at once).", ()),
    "e2e_request_latency_seconds": ("histogram", "Arrival to the request's last token.", ()),
    "engine_step_rows": ("histogram", "Rows (requests) decoded together in one engine step.", ()),
}

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BUCKETS = {"time_to_first_token_seconds": _LATENCY_BUCKETS, "inter_token_latency_seconds": _LATENCY_BUCKETS,
           "e2e_request_latency_seconds": _LATENCY_BUCKETS, "engine_step_rows": _ROW_BUCKETS}


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._metrics: dict[str, Any] = {}
        for name, (kind, help_text, labels) in SPEC.items():
            options: dict[str, Any] = {"labelnames": ("model_name", *labels), "registry": self.registry}
            if kind == "counter":
                metric = Counter(PREFIX + name, help_text, **options)
            elif kind == "gauge":
                metric = Gauge(PREFIX + name, help_text, **options)
                metric.labels(model_name=model_name)  # a gauge reads 0 before its first value, not absent
            else:
                metric = Histogram(PREFIX + name, help_text, buckets=BUCKETS[name], **options)
            self._metrics[name] = metric

    def _series(self, name: str, labels: dict[str, Any]) -> Any:
        return self._metrics[name].labels(model_name=self.model_name, **{k: str(v) for k, v in labels.items()})

    def inc(self, name: str, value: float = 1, **labels: Any) -> None:
        self._series(name, labels).inc(value)

    def set(self, name: str, value: float, **labels: Any) -> None:
        self._series(name, labels).set(value)

    def observe(self, name: str, value: float, **labels: Any) -> None:
        self._series(name, labels).observe(value)

    def record_request(self, stats: dict[str, Any], *, num_drafts: int) -> None:
        """A finished (or cancelled) request's counters: the same numbers as its `usage`."""
        method = stats["method"]
        self.inc("spec_decode_num_drafts_total", num_drafts, method=method)
        self.inc("spec_decode_num_draft_tokens_total", stats["drafted"], method=method)
        self.inc("spec_decode_num_accepted_tokens_total", stats["accepted"], method=method)
        self.inc("spec_decode_num_target_calls_total", stats["target_calls"], method=method)
        for position, accepted in enumerate(stats.get("accepted_per_position") or []):
            self.inc("spec_decode_num_accepted_tokens_per_pos_total", accepted, method=method, position=position)
        self.inc("prompt_tokens_total", stats["prompt_tokens"], method=method)
        self.inc("generation_tokens_total", stats["new_tokens"], method=method)
        self.inc("prefix_cache_queries_total", max(stats["prompt_tokens"] - 1, 0), method=method)
        self.inc("prefix_cache_hits_total", stats.get("cached_tokens", 0), method=method)
        if stats["finish_reason"] == "cancelled":
            self.inc("request_cancelled_total", method=method)
        else:
            self.inc("request_success_total", method=method, finished_reason=stats["finish_reason"])

    def render(self) -> str:
        """The Prometheus text exposition of this server's registry (served with `CONTENT_TYPE`)."""
        return generate_latest(self.registry).decode()
