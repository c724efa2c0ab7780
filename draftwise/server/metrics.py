"""Prometheus text format for `GET /metrics`, with names like vLLM's (`draftwise:` in place of `vllm:`).

The speculative counters are sums of exactly the per-request numbers each response carries in
`usage.draftwise`, so a client can check one against the other. Written by the engine thread and
the HTTP handlers, read by `/metrics`: one lock.
"""

from __future__ import annotations

import math
import threading
from typing import Any

PREFIX = "draftwise:"

# name -> (type, help); counters carry the `_total` suffix in their name, as the text format 0.0.4 has it
SPEC: dict[str, tuple[str, str]] = {
    "spec_decode_num_drafts_total": ("counter", "Verification steps that carried at least one draft token."),
    "spec_decode_num_draft_tokens_total": ("counter", "Draft tokens sent to verification (usage.draftwise.drafted)."),
    "spec_decode_num_accepted_tokens_total": ("counter", "Draft tokens accepted (usage.draftwise.accepted)."),
    "spec_decode_num_accepted_tokens_per_pos_total": ("counter", "Accepted draft tokens by draft position."),
    "spec_decode_num_target_calls_total": ("counter", "Target verification forwards per request, summed "
                                           "(usage.draftwise.target_calls)."),
    "prompt_tokens_total": ("counter", "Prompt tokens of finished requests (usage.prompt_tokens)."),
    "prefix_cache_queries_total": ("counter", "Prompt tokens looked up in the prefix store."),
    "prefix_cache_hits_total": ("counter", "Prompt tokens restored from the prefix store, not prefilled "
                                "(usage.prompt_tokens_details.cached_tokens)."),
    "generation_tokens_total": ("counter", "Generated tokens of finished requests (usage.completion_tokens)."),
    "request_success_total": ("counter", "Requests that finished, by finish reason."),
    "request_cancelled_total": ("counter", "Requests cancelled before they finished (client gone, shutdown)."),
    "request_failure_total": ("counter", "Requests that failed inside the engine."),
    "request_rejected_total": ("counter", "Requests refused before decoding, by HTTP status."),
    "num_requests_running": ("gauge", "Requests decoding in an engine row."),
    "num_requests_waiting": ("gauge", "Requests waiting for an engine row."),
    "time_to_first_token_seconds": ("histogram", "Arrival to first generated token."),
    "inter_token_latency_seconds": ("histogram", "Time between consecutive token deliveries of a request (a "
                                    "speculative step delivers several tokens at once)."),
    "e2e_request_latency_seconds": ("histogram", "Arrival to the request's last token."),
    "engine_step_rows": ("histogram", "Rows (requests) decoded together in one engine step."),
}

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BUCKETS = {"time_to_first_token_seconds": _LATENCY_BUCKETS, "inter_token_latency_seconds": _LATENCY_BUCKETS,
           "e2e_request_latency_seconds": _LATENCY_BUCKETS, "engine_step_rows": _ROW_BUCKETS}

Labels = tuple[tuple[str, str], ...]


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        i = next((i for i, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.sum += value
        self.count += 1


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self._values: dict[str, dict[Labels, float]] = {name: {} for name, (kind, _) in SPEC.items()
                                                         if kind != "histogram"}
        self._histograms: dict[str, dict[Labels, _Histogram]] = {name: {} for name, (kind, _) in SPEC.items()
                                                                  if kind == "histogram"}

    def _labels(self, labels: dict[str, Any]) -> Labels:
        return (("model_name", self.model_name),) + tuple((k, str(v)) for k, v in sorted(labels.items()))

    def inc(self, name: str, value: float = 1, **labels: Any) -> None:
        key = self._labels(labels)
        with self._lock:
            self._values[name][key] = self._values[name].get(key, 0) + value

    def set(self, name: str, value: float, **labels: Any) -> None:
        with self._lock:
            self._values[name][self._labels(labels)] = value

    def observe(self, name: str, value: float, **labels: Any) -> None:
        key = self._labels(labels)
        with self._lock:
            series = self._histograms[name]
            if key not in series:
                series[key] = _Histogram(BUCKETS[name])
            series[key].observe(value)

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
        lines: list[str] = []
        with self._lock:
            for name, (kind, help_text) in SPEC.items():
                full = PREFIX + name
                lines.append(f"# HELP {full} {help_text}")
                lines.append(f"# TYPE {full} {kind}")
                if kind != "histogram":
                    series = self._values[name] or ({self._labels({}): 0} if kind == "gauge" else {})
                    for labels, value in sorted(series.items()):
                        lines.append(f"{full}{_format(labels)} {_number(value)}")
                    continue
                for labels, histogram in sorted(self._histograms[name].items()):
                    cumulative = 0
                    for bound, count in zip((*histogram.bounds, math.inf), histogram.counts):
                        cumulative += count
                        le = "+Inf" if bound == math.inf else _number(bound)
                        lines.append(f"{full}_bucket{_format(labels + (('le', le),))} {cumulative}")
                    lines.append(f"{full}_sum{_format(labels)} {_number(histogram.sum)}")
                    lines.append(f"{full}_count{_format(labels)} {histogram.count}")
        return "\n".join(lines) + "\n"


def _format(labels: Labels) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(10), chr(92) + "n").replace(chr(34), chr(92) + chr(34))}"'
               for k, v in labels)
    return "{" + ",".join(escaped) + "}"


def _number(value: float) -> str:
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))
