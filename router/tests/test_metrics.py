"""The /metrics exposition: TGI's names, types, labels and buckets as metrics-exporter-prometheus renders them, from
prometheus_client's metric families (metrics module doc)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from textgen_router import metrics


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    length_histograms = (metrics.REQUEST_INPUT_LENGTH, metrics.REQUEST_MAX_NEW_TOKENS, metrics.REQUEST_GENERATED_TOKENS)
    saved = [h.buckets for h in length_histograms]
    metrics.reset()
    yield
    for histogram, buckets in zip(length_histograms, saved, strict=True):
        histogram.set_buckets(buckets)
    metrics.reset()


def lines() -> list[str]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    return body.decode().splitlines()


def test_nothing_recorded_renders_nothing() -> None:
    assert metrics.render()[0] == b""


def test_counters_keep_their_bare_names() -> None:
    metrics.REQUEST_COUNT.inc()
    metrics.REQUEST_COUNT.inc()
    metrics.REQUEST_FAILURE.labels("validation").inc()
    metrics.BATCH_CONCAT.labels(reason="backpressure").inc(3)
    out = lines()
    assert "# TYPE tgi_request_count counter" in out and "tgi_request_count 2" in out
    assert 'tgi_request_failure{err="validation"} 1' in out
    assert 'tgi_batch_concat{reason="backpressure"} 3' in out
    assert not [line for line in out if "_total" in line or "_created" in line]


def test_gauges() -> None:
    metrics.QUEUE_SIZE.set(4)
    metrics.QUEUE_SIZE.dec()
    metrics.BATCH_MAX_TOTAL_TOKENS.set(16000)
    out = lines()
    assert "# TYPE tgi_queue_size gauge" in out and "tgi_queue_size 3" in out
    assert "tgi_batch_max_total_tokens 16000" in out


def test_duration_histograms_use_tgi_buckets() -> None:
    metrics.BATCH_FORWARD_DURATION.labels("decode").observe(0.0002)
    metrics.BATCH_FORWARD_DURATION.labels("decode").observe(200.0)
    buckets = [line for line in lines() if line.startswith("tgi_batch_forward_duration_bucket")]
    assert len(buckets) == 36  # 35 bounds 0.0001 * 1.5^k, then +Inf
    assert buckets[0] == 'tgi_batch_forward_duration_bucket{method="decode",le="0.00015000000000000001"} 0'
    assert buckets[1].endswith(" 1") and buckets[-2].endswith(" 1")  # 200 s is past the last bound
    assert buckets[-1] == 'tgi_batch_forward_duration_bucket{method="decode",le="+Inf"} 2'
    assert metrics.DURATION_BUCKETS[-1] == pytest.approx(145.611, rel=1e-4)
    out = lines()
    assert 'tgi_batch_forward_duration_count{method="decode"} 2' in out
    assert 'tgi_batch_forward_duration_sum{method="decode"} 200.0002' in out


def test_length_buckets_follow_the_limits() -> None:
    metrics.configure_length_buckets(max_input_tokens=200, max_total_tokens=1000)
    metrics.REQUEST_INPUT_LENGTH.observe(3)
    metrics.REQUEST_GENERATED_TOKENS.observe(10)
    out = lines()
    assert 'tgi_request_input_length_bucket{le="2"} 0' in out and 'tgi_request_input_length_bucket{le="4"} 1' in out
    assert 'tgi_request_input_length_bucket{le="200"} 1' in out
    assert 'tgi_request_generated_tokens_bucket{le="10"} 1' in out
    assert len([line for line in out if line.startswith("tgi_request_generated_tokens_bucket")]) == 101


def test_bucketless_histogram_renders_as_summary() -> None:
    for value in (0, 0, 1, 3):
        metrics.REQUEST_SKIPPED_TOKENS.observe(value)
    out = lines()
    assert "# TYPE tgi_request_skipped_tokens summary" in out
    assert 'tgi_request_skipped_tokens{quantile="0"} 0' in out and 'tgi_request_skipped_tokens{quantile="1"} 3' in out
    assert "tgi_request_skipped_tokens_sum 4" in out and "tgi_request_skipped_tokens_count 4" in out


def test_label_misuse_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs labels"):
        metrics.REQUEST_FAILURE.inc()
    with pytest.raises(ValueError, match="takes labels"):
        metrics.BATCH_CONCAT.labels("a", "b")


# The session's scrape as TGI's exporter prints it, pinned from the hand-written exposition before prometheus-client.
GOLDEN_TGI = Path(__file__).parent / "data" / "metrics_scrape_tgi.txt"


def record_serving_session() -> None:
    """A short serving session that records every series the router records, through the API the router uses.

    Its scrape is pinned in `GOLDEN_TGI`; it reaches the formatting edges: integral and non-integral values and
    bucket bounds (max_input_tokens=64 gives 0.64-step bounds), a value on a bound, one past the last bound, one
    below 1e-4, a large gauge, labelled and unlabelled series, series created in different orders.
    """
    m = metrics
    # Start-up (backend.py): the shard's limits size the length buckets.
    m.BATCH_MAX_TOTAL_TOKENS.set(1_310_720)
    m.configure_length_buckets(max_input_tokens=64, max_total_tokens=1000)
    # Four requests arrive (HTTP layer); one fails validation, one the chat template.
    for _ in range(4):
        m.REQUEST_COUNT.inc()
    m.REQUEST_FAILURE.labels("validation").inc()
    m.REQUEST_FAILURE.labels(err="template").inc()
    for input_length, max_new_tokens in ((7, 20), (12, 100)):
        m.REQUEST_INPUT_LENGTH.observe(input_length)
        m.REQUEST_MAX_NEW_TOKENS.observe(max_new_tokens)
    # Queue and batching loop: a prefill of two, decode steps, a third request joins, one step fails.
    m.QUEUE_SIZE.set(3)
    m.QUEUE_SIZE.dec()
    m.QUEUE_SIZE.set(0)
    m.BATCH_NEXT_SIZE.observe(2)
    m.BATCH_CURRENT_SIZE.set(2)
    m.BATCH_CURRENT_MAX_TOKENS.set(139)
    steps = (("prefill", 0.0123, 0.0004, 0.00002, 0.0131),) + (("decode", 0.0051, 0.0001, 0.00003, 0.0053),) * 3
    for method, forward, decode, filter_, total in steps:
        m.BATCH_INFERENCE_COUNT.labels(method).inc()
        m.BATCH_FORWARD_DURATION.labels(method).observe(forward)
        m.BATCH_DECODE_DURATION.labels(method).observe(decode)
        m.BATCH_FILTER_DURATION.labels(method).observe(filter_)
        m.BATCH_INFERENCE_DURATION.labels(method).observe(total)
        m.BATCH_INFERENCE_SUCCESS.labels(method).inc()
    m.BATCH_CONCAT.labels(reason="backpressure").inc()
    m.BATCH_NEXT_SIZE.observe(1)
    m.BATCH_CONCAT_DURATION.labels("decode").observe(0.0007)
    m.BATCH_INFERENCE_COUNT.labels("decode").inc()
    m.BATCH_INFERENCE_FAILURE.labels("decode").inc()
    m.REQUEST_FAILURE.labels("generation").inc()
    m.BATCH_CONCAT.labels("wait_exceeded").inc(2)
    skipped = m.REQUEST_SKIPPED_TOKENS.labels()
    for value in (0, 2, 1, 3, 0):
        skipped.observe(value)
    m.REQUEST_FAILURE.labels("dropped").inc()
    m.REQUEST_FAILURE.labels("overloaded").inc()
    # The two that finished (HTTP layer).
    for total, validation, queue, inference, per_token, generated in (
        (0.2503, 0.0011, 0.00015, 0.249, 0.0051, 20),
        (200.0, 0.0009, 0.0021, 199.5, 1.995, 100),
    ):
        m.REQUEST_SUCCESS.inc()
        m.REQUEST_DURATION.observe(total)
        m.REQUEST_VALIDATION_DURATION.observe(validation)
        m.REQUEST_QUEUE_DURATION.observe(queue)
        m.REQUEST_INFERENCE_DURATION.observe(inference)
        m.REQUEST_MEAN_TIME_PER_TOKEN_DURATION.observe(per_token)
        m.REQUEST_GENERATED_TOKENS.observe(generated)
    m.REQUEST_FAILURE.labels("incomplete").inc()
    m.BATCH_CURRENT_SIZE.set(0)
    m.BATCH_CURRENT_MAX_TOKENS.set(0)


def test_golden_scrape_is_tgis_to_the_byte() -> None:
    record_serving_session()
    assert metrics.render()[0] == GOLDEN_TGI.read_bytes()


def test_the_scrape_parses_back_to_the_collectors_families() -> None:
    """prometheus_client's parser reads the scrape back as the families the collector yields, types included."""
    record_serving_session()
    families = list(text_string_to_metric_families(metrics.render()[0].decode()))
    assert families == list(metrics.COLLECTOR.collect())
    assert [f.name for f in families] == [m.name for m in metrics._METRICS]  # every metric, in definition order
    by_name = {f.name: f for f in families}
    requests = by_name["tgi_request_count"]  # the parser's model of a bare counter: samples named <name>_total
    assert requests.type == "counter" and [(s.name, s.value) for s in requests.samples] == [
        ("tgi_request_count_total", 4)
    ]
    assert by_name["tgi_batch_concat"].type == "counter"
    assert by_name["tgi_batch_max_total_tokens"].samples[0].value == 1_310_720
    forward = by_name["tgi_batch_forward_duration"]
    assert forward.type == "histogram"
    count = {s.labels["method"]: s.value for s in forward.samples if s.name == "tgi_batch_forward_duration_count"}
    assert count == {"prefill": 1, "decode": 3}
    skipped = by_name["tgi_request_skipped_tokens"]
    assert skipped.type == "summary" and [s.value for s in skipped.samples][-2:] == [6, 5]


def test_the_collector_serves_any_registry() -> None:
    metrics.REQUEST_COUNT.inc()
    metrics.BATCH_FORWARD_DURATION.labels("decode").observe(0.01)
    registry = CollectorRegistry()
    registry.register(metrics.COLLECTOR)
    families = list(registry.collect())
    assert [(f.name, f.type) for f in families] == [
        ("tgi_request_count", "counter"),
        ("tgi_batch_forward_duration", "histogram"),
    ]
    assert registry.get_sample_value("tgi_request_count_total") == 1
    assert registry.get_sample_value("tgi_batch_forward_duration_count", {"method": "decode"}) == 1
    assert metrics.tgi_text(families) == metrics.render()[0]
