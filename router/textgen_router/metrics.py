"""The router's Prometheus metrics, named, typed and bucketed as TGI's (`tgi_*`), scraped as TGI's bytes.

The data model is prometheus-client's: counter and gauge values live in its per-series store
(`values.MutexValue`; histograms keep plain numbers, see `_HistogramChild`), and `COLLECTOR`, registered in
`REGISTRY` (a `CollectorRegistry`; it can join any other registry too), turns our metrics into `*MetricFamily`
objects. Only the text is ours: `tgi_text` prints those families as TGI's exporter does (its docstring says
why `generate_latest` cannot).

TGI renders through `metrics-exporter-prometheus`. What we keep of it: counters under their bare names (no
`_total`, no `_created` series), histograms without configured buckets rendered as summaries (quantiles over
recent values), a series shown only once it has been recorded, TGI's series order (`_sum` before `_count`),
numbers as Rust prints floats (`4`, `le="0.00015000000000000001"`), `le` / `quantile` after the other labels.
router/tests/data/metrics_scrape_tgi.txt pins one serving session's scrape.

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
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.values import MutexValue

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
    # A sample value, bucket bound or quantile as TGI prints it: integral values without ".0", no exponent from 1e6.
    if isinstance(value, int):  # bucket counts, most of a scrape
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class _Value(MutexValue):
    """A counter's or gauge's series: prometheus_client's in-process value (a float behind a lock, what its own
    metrics hold), with the defaults our call sites use (`.labels(..).inc()`)."""

    def __init__(self) -> None:
        # The arguments name the series for the multiprocess variant (`values.ValueClass` under
        # PROMETHEUS_MULTIPROC_DIR), which the router does not use: the in-process value ignores them.
        super().__init__("", "", "", (), (), "")

    def inc(self, amount: float = 1.0) -> None:
        super().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        super().inc(-amount)


_QUANTILE_LABELS = tuple(_fmt(q) for q in SUMMARY_QUANTILES)
_Child = TypeVar("_Child")


class _Metric(Generic[_Child]):
    """A named metric and its series, one child (`_Child`, what records the values) per label values."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _Child] = {}
        _METRICS.append(self)

    def labels(self, *values: str, **kwargs: str) -> _Child:
        """The series for these label values, created (and from then on rendered) on first use."""
        key = tuple(kwargs[n] for n in self.labelnames) if kwargs else values
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

    def family(self) -> Metric | None:
        """The recorded series as one prometheus_client metric family, None before the first is recorded."""
        raise NotImplementedError

    def _labels(self, key: tuple[str, ...]) -> dict[str, str]:
        return dict(zip(self.labelnames, key, strict=True))


class Counter(_Metric[_Value]):
    """Monotonic counter: a `CounterMetricFamily` (samples `<name>_total`), printed under its bare name like TGI's."""

    _family_type: type[CounterMetricFamily | GaugeMetricFamily] = CounterMetricFamily

    def _new_child(self) -> _Value:
        return _Value()

    def inc(self, amount: float = 1.0) -> None:
        self._unlabelled().inc(amount)

    def value(self, *labels: str) -> float:
        """Current value (0 when the series was never recorded)."""
        child = self._children.get(tuple(labels))
        return float(child.get()) if child is not None else 0.0

    def family(self) -> Metric | None:
        if not self._children:
            return None
        family = self._family_type(self.name, self.documentation, labels=self.labelnames)
        for key, child in self._children.items():
            family.add_metric(key, child.get())
        return family


class Gauge(Counter):
    """A value that goes up and down."""

    _family_type = GaugeMetricFamily

    def set(self, value: float) -> None:
        self._unlabelled().set(float(value))

    def dec(self, amount: float = 1.0) -> None:
        self._unlabelled().dec(amount)


# Histograms and summaries keep plain numbers, not prometheus_client's Histogram layout (a MutexValue per bucket):
# they are observed on the hot path (each batch step; the summary per request per step), where the locks would
# cost more than all the rest (one decode step's metric calls on a 2-core VM: about 4 us with plain numbers
# everywhere, 5.5 us with MutexValues for counters and gauges only, 8.5 us with them in the histograms too), and
# the router records from its one event-loop thread.
class _HistogramChild:
    __slots__ = ("bounds", "buckets", "sum")

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: the first bound >= value, so a value on a bound counts in that bucket (`le`).
        self.buckets[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class Histogram(_Metric[_HistogramChild]):
    """Histogram with fixed buckets (`_bucket{le=..}`, `_sum`, `_count`)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, documentation, labelnames)
        self.set_buckets(buckets)

    def set_buckets(self, buckets: Sequence[float]) -> None:
        """Replace the buckets (TGI sizes length buckets from the limits known after warmup); resets series."""
        self.buckets = list(buckets)
        self._le = [_fmt(b) for b in self.buckets] + ["+Inf"]
        self.clear()

    def _new_child(self) -> _HistogramChild:
        return _HistogramChild(self.buckets)

    def observe(self, value: float) -> None:
        self._unlabelled().observe(value)

    def count(self, *labels: str) -> int:
        child = self._children.get(tuple(labels))
        return sum(child.buckets) if child is not None else 0

    def family(self) -> Metric | None:
        if not self._children:
            return None
        # Samples added one by one, not with `add_metric`: it puts `_count` before `_sum`, TGI the other way round.
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in self._children.items():
            labels, cumulative = self._labels(key), 0
            for le, bucket in zip(self._le, child.buckets, strict=True):
                cumulative += bucket
                family.add_sample(f"{self.name}_bucket", {**labels, "le": le}, cumulative)
            family.add_sample(f"{self.name}_sum", labels, child.sum)
            family.add_sample(f"{self.name}_count", labels, cumulative)
        return family


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

    def _new_child(self) -> _SummaryChild:
        return _SummaryChild()

    def observe(self, value: float) -> None:
        self._unlabelled().observe(value)

    def family(self) -> Metric | None:
        if not self._children:
            return None
        # prometheus_client's summaries have no quantiles (`add_metric` takes count and sum), so samples one by one.
        family = SummaryMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for key, child in self._children.items():
            labels, values = self._labels(key), sorted(child.window)
            for q, quantile in zip(SUMMARY_QUANTILES, _QUANTILE_LABELS, strict=True):
                value = values[min(len(values) - 1, int(q * len(values)))] if values else 0.0
                family.add_sample(self.name, {**labels, "quantile": quantile}, value)
            family.add_sample(f"{self.name}_sum", labels, child.sum)
            family.add_sample(f"{self.name}_count", labels, child.count)
        return family


class _TgiCollector:
    """prometheus_client's view of our metrics: one family per metric with a recorded series, in definition order."""

    def collect(self) -> Iterator[Metric]:
        for metric in _METRICS:
            family = metric.family()
            if family is not None:
                yield family


def tgi_text(families: Iterable[Metric]) -> bytes:
    """The families in TGI's text format (metrics-exporter-prometheus), what `GET /metrics` serves.

    Not `exposition.generate_latest` (checked with prometheus-client 0.26.0), whose text differs from TGI's:
    - it names a `counter` family `<name>_total` in its HELP/TYPE lines (and prints the samples under their
      `_total` names), where TGI has `# TYPE tgi_request_count counter` and `tgi_request_count 4`;
    - it prints every value through `utils.floatToGoString`: `4.0` for `4`, `1.31072e+06` for `1310720`;
    - it sorts labels by name (`{le="..",method=".."}`); TGI puts `le` / `quantile` last, the order our families'
      samples hold them in.
    Label values and HELP text are ours (no quotes, backslashes or newlines), so nothing is escaped.
    """
    out = []
    for family in families:
        name, counter = family.name, family.type == "counter"
        out.append(f"# HELP {name} {family.documentation}\n# TYPE {name} {family.type}\n")
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sample.labels.items())
            series = (name if counter else sample.name) + (f"{{{labels}}}" if labels else "")
            out.append(f"{series} {_fmt(sample.value)}\n")
    return "".join(out).encode()


_METRICS: list[_Metric[Any]] = []
COLLECTOR = _TgiCollector()
# Our own registry, not prometheus_client's global one: that one also exports process and GC metrics TGI has not.
REGISTRY = CollectorRegistry()
REGISTRY.register(COLLECTOR)
DURATION_BUCKETS = _duration_buckets()
# Placeholder until `configure_length_buckets` runs after warmup: TGI's default limits (1024 / 2048).
_DEFAULT_INPUT, _DEFAULT_TOTAL = 1024, 2048


def render() -> tuple[bytes, str]:
    """The text exposition of every recorded series and its content type, for `GET /metrics`."""
    return tgi_text(REGISTRY.collect()), CONTENT_TYPE


def configure_length_buckets(max_input_tokens: int, max_total_tokens: int) -> None:
    """Size the token-length histograms from the limits settled at startup, as TGI does."""
    REQUEST_INPUT_LENGTH.set_buckets(length_buckets(max_input_tokens))
    REQUEST_MAX_NEW_TOKENS.set_buckets(length_buckets(max_total_tokens))
    REQUEST_GENERATED_TOKENS.set_buckets(length_buckets(max_total_tokens))


def reset() -> None:
    """Forget every recorded series (tests sharing one process)."""
    for metric in _METRICS:
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
