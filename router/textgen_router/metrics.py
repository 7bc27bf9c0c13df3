"""The router's Prometheus metrics, named, typed and bucketed exactly as TGI's (`tgi_*`).

TGI renders through `metrics-exporter-prometheus`, which differs from `prometheus_client` in ways dashboards
see: counters carry no `_total` suffix and no `_created` series, histograms without configured buckets render
as summaries, and a series appears only once it has been recorded. A small registry of our own reproduces that
and keeps the hot path (one `observe` per batch step) to a dict lookup and a bisect.

Who records what (so nothing is counted twice):
- inference side (queue, batching loop, Infer): tgi_queue_size, tgi_batch_*, tgi_request_failure with
  err="overloaded" / "generation" / "dropped".
- HTTP layer: tgi_request_count, tgi_request_success, tgi_request_failure with err="validation" /
  "template" / "incomplete", the tgi_request_*_duration histograms, tgi_request_input_length,
  tgi_request_max_new_tokens, tgi_request_generated_tokens.
`GET /metrics` serves `render()`.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4"

# metrics-exporter-prometheus's default summary quantiles.
SUMMARY_QUANTILES = (0.0, 0.5, 0.9, 0.95, 0.99, 0.999, 1.0)
# Summaries keep a bounded window of recent observations instead of an unbounded list.
SUMMARY_WINDOW = 4096


def _duration_buckets() -> list[float]:
    # TGI: a geometric series built by repeated multiplication from 0.0001 (35 values, 0.00015 .. ~145.6 s).
    buckets, value = [], 0.0001
    for _ in range(35):
        value *= 1.5
        buckets.append(value)
    return buckets


def length_buckets(max_tokens: int) -> list[float]:
    """TGI's length buckets: (max_tokens / 100) * (1..100)."""
    return [(max_tokens / 100.0) * (x + 1) for x in range(100)]


def _fmt(value: float) -> str:
    # Rust's float Display: integral values without ".0", never exponent notation in our ranges.
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _labels(names: Sequence[str], values: tuple[str, ...], extra: str = "") -> str:
    parts = [f'{n}="{v}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


_Child = TypeVar("_Child")


class _Metric(Generic[_Child]):
    """A named metric and its series, one child (`_Child`, what records the values) per label values."""

    kind = ""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _Child] = {}
        REGISTRY.append(self)

    def labels(self, *values: str, **kwargs: str) -> _Child:
        """The series for these label values, created (and from then on rendered) on first use."""
        key = tuple(values) if values else tuple(kwargs[n] for n in self.labelnames)
        if len(key) != len(self.labelnames):
            raise ValueError(f"{self.name} takes labels {self.labelnames}, got {key}")
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._new_child()
        return child

    def _unlabelled(self) -> _Child:
        if self.labelnames:
            raise ValueError(f"{self.name} needs labels {self.labelnames}")
        return self.labels()

    def _new_child(self) -> _Child:
        raise NotImplementedError

    def clear(self) -> None:
        """Forget every series (tests; bucket reconfiguration)."""
        self._children.clear()

    def render(self) -> list[str]:
        if not self._children:
            return []
        lines = [f"# HELP {self.name} {self.documentation}", f"# TYPE {self.name} {self.kind}"]
        for key, child in self._children.items():
            lines.extend(self._render_child(key, child))
        return lines

    def _render_child(self, key: tuple[str, ...], child: _Child) -> list[str]:
        raise NotImplementedError


class _Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class Counter(_Metric[_Value]):
    """Monotonic counter; rendered under its bare name, like TGI's (no `_total`)."""

    kind = "counter"

    def _new_child(self) -> _Value:
        return _Value()

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def value(self, *labels: str) -> float:
        """Current value (0 when the series was never recorded)."""
        child = self._children.get(tuple(labels))
        return child.value if child is not None else 0.0

    def _render_child(self, key: tuple[str, ...], child: _Value) -> list[str]:
        return [f"{self.name}{_labels(self.labelnames, key)} {_fmt(child.value)}"]


class Gauge(Counter):
    """A value that goes up and down."""

    kind = "gauge"

    def set(self, value: float) -> None:
        self._unlabelled().set(value)

    def dec(self, amount: float = 1.0) -> None:
        self._unlabelled().dec(amount)


class _HistogramChild:
    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1


class Histogram(_Metric[_HistogramChild]):
    """Histogram with fixed buckets (`_bucket{le=..}`, `_sum`, `_count`)."""

    kind = "histogram"

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self.buckets = list(buckets)

    def set_buckets(self, buckets: Sequence[float]) -> None:
        """Replace the buckets (TGI sizes length buckets from the limits known after warmup); resets series."""
        self.buckets = list(buckets)
        self.clear()

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self.buckets)

    def observe(self, value: float) -> None:
        self._unlabelled().observe(value)

    def count(self, *labels: str) -> int:
        child = self._children.get(tuple(labels))
        return child.count if child is not None else 0

    def _render_child(self, key: tuple[str, ...], child: _HistogramChild) -> list[str]:
        lines, cumulative = [], 0
        for bound, n in zip(child.bounds, child.counts[:-1], strict=True):  # the +Inf count follows
            cumulative += n
            le = f'le="{_fmt(bound)}"'
            lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, le)} {cumulative}")
        inf = 'le="+Inf"'
        lines.append(f"{self.name}_bucket{_labels(self.labelnames, key, inf)} {child.count}")
        lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_fmt(child.sum)}")
        lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {child.count}")
        return lines


class _SummaryChild:
    __slots__ = ("window", "sum", "count")

    def __init__(self) -> None:
        self.window: deque[float] = deque(maxlen=SUMMARY_WINDOW)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.window.append(value)
        self.sum += value
        self.count += 1


class Summary(_Metric[_SummaryChild]):
    """What TGI's exporter makes of a histogram without buckets: quantiles over recent values."""

    kind = "summary"

    def _new_child(self) -> _SummaryChild:
        return _SummaryChild()

    def observe(self, value: float) -> None:
        self._unlabelled().observe(value)

    def _render_child(self, key: tuple[str, ...], child: _SummaryChild) -> list[str]:
        values = sorted(child.window)
        lines = []
        for q in SUMMARY_QUANTILES:
            v = values[min(len(values) - 1, int(q * len(values)))] if values else 0.0
            label = f'quantile="{_fmt(q)}"'
            lines.append(f"{self.name}{_labels(self.labelnames, key, label)} {_fmt(v)}")
        lines.append(f"{self.name}_sum{_labels(self.labelnames, key)} {_fmt(child.sum)}")
        lines.append(f"{self.name}_count{_labels(self.labelnames, key)} {child.count}")
        return lines


REGISTRY: list[_Metric[Any]] = []
DURATION_BUCKETS = _duration_buckets()
# Placeholder until `configure_length_buckets` runs after warmup: TGI's default limits (1024 / 2048).
_DEFAULT_INPUT, _DEFAULT_TOTAL = 1024, 2048


def render() -> tuple[bytes, str]:
    """The text exposition of every recorded series and its content type, for `GET /metrics`."""
    lines: list[str] = []
    for metric in REGISTRY:
        lines.extend(metric.render())
    return ("\n".join(lines) + "\n").encode() if lines else b"", CONTENT_TYPE


def configure_length_buckets(max_input_tokens: int, max_total_tokens: int) -> None:
    """Size the token-length histograms from the limits settled at startup, as TGI does."""
    REQUEST_INPUT_LENGTH.set_buckets(length_buckets(max_input_tokens))
    REQUEST_MAX_NEW_TOKENS.set_buckets(length_buckets(max_total_tokens))
    REQUEST_GENERATED_TOKENS.set_buckets(length_buckets(max_total_tokens))


def reset() -> None:
    """Forget every recorded series (tests sharing one process)."""
    for metric in REGISTRY:
        metric.clear()


# Request level (recorded by the HTTP layer, except the failure reasons listed in the module docstring).
REQUEST_COUNT = Counter("tgi_request_count", "Total number of requests")
REQUEST_SUCCESS = Counter("tgi_request_success", "Number of successful requests")
REQUEST_FAILURE = Counter("tgi_request_failure", "Number of failed requests", ["err"])
REQUEST_DURATION = Histogram("tgi_request_duration", "Request duration", DURATION_BUCKETS)
REQUEST_VALIDATION_DURATION = Histogram(
    "tgi_request_validation_duration", "Request validation duration", DURATION_BUCKETS
)
REQUEST_QUEUE_DURATION = Histogram("tgi_request_queue_duration", "Request queue duration", DURATION_BUCKETS)
REQUEST_INFERENCE_DURATION = Histogram("tgi_request_inference_duration", "Request inference duration", DURATION_BUCKETS)
REQUEST_MEAN_TIME_PER_TOKEN_DURATION = Histogram(
    "tgi_request_mean_time_per_token_duration", "Mean time per token per request", DURATION_BUCKETS
)
REQUEST_INPUT_LENGTH = Histogram(
    "tgi_request_input_length", "Input token length per request", length_buckets(_DEFAULT_INPUT)
)
REQUEST_MAX_NEW_TOKENS = Histogram(
    "tgi_request_max_new_tokens", "Maximum new tokens per request", length_buckets(_DEFAULT_TOTAL)
)
REQUEST_GENERATED_TOKENS = Histogram(
    "tgi_request_generated_tokens", "Generated tokens per request", length_buckets(_DEFAULT_TOTAL)
)
REQUEST_SKIPPED_TOKENS = Summary("tgi_request_skipped_tokens", "Speculated tokens per request")

# Queue and batches (recorded by the inference side).
QUEUE_SIZE = Gauge("tgi_queue_size", "Current queue size")
BATCH_CURRENT_SIZE = Gauge("tgi_batch_current_size", "Current batch size")
BATCH_CURRENT_MAX_TOKENS = Gauge("tgi_batch_current_max_tokens", "Maximum tokens for the current batch")
BATCH_MAX_TOTAL_TOKENS = Gauge("tgi_batch_max_total_tokens", "Maximum amount of tokens in total")
BATCH_NEXT_SIZE = Histogram("tgi_batch_next_size", "Batch size distribution", [float(x + 1) for x in range(1024)])
BATCH_CONCAT = Counter("tgi_batch_concat", "Number of batch concatenations", ["reason"])
BATCH_INFERENCE_COUNT = Counter("tgi_batch_inference_count", "Inference calls per method", ["method"])
BATCH_INFERENCE_SUCCESS = Counter("tgi_batch_inference_success", "Successful inference calls per method", ["method"])
BATCH_INFERENCE_FAILURE = Counter("tgi_batch_inference_failure", "Failed inference calls per method", ["method"])
BATCH_FORWARD_DURATION = Histogram(
    "tgi_batch_forward_duration", "Batch forward duration per method", DURATION_BUCKETS, ["method"]
)
BATCH_DECODE_DURATION = Histogram(
    "tgi_batch_decode_duration", "Batch token decoding duration per method", DURATION_BUCKETS, ["method"]
)
BATCH_FILTER_DURATION = Histogram(
    "tgi_batch_filter_duration", "Batch filtering duration per method", DURATION_BUCKETS, ["method"]
)
BATCH_INFERENCE_DURATION = Histogram(
    "tgi_batch_inference_duration", "Batch inference duration per method", DURATION_BUCKETS, ["method"]
)
BATCH_CONCAT_DURATION = Histogram(
    "tgi_batch_concat_duration", "Batch concatenation duration", DURATION_BUCKETS, ["method"]
)
