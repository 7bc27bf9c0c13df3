"""The /metrics exposition: TGI's names, types, labels and buckets as metrics-exporter-prometheus renders them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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
