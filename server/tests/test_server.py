"""A real `textgen-server serve` process on a real unix socket, driven over gRPC like the router does."""

from __future__ import annotations

import json
import math
import os
import stat
import subprocess
import sys
import uuid
from functools import partial
from pathlib import Path

import grpc
import pytest
from shard_helpers import chooser, make_batch, make_request

from testing.preload import start_process
from testing.shards import ShardProcess, shard_stub
from textgen_pb import generate_pb2 as pb

MAX_INPUT_TOKENS = 48
PROMPTS = [
    "def foo(x):",
    "import os\nimport sys\n",
    "class",
    "return self._tail + value if ready else None",
    "a",
    "for i in range(10):\n    print(i)",
    "x = 1",
    "while True:",
]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"


POOL_TOKENS = 8192


@pytest.fixture(scope="module")
def shard(tiny_llama: Path, otlp_collector):  # type: ignore[no-untyped-def]
    _, port = otlp_collector
    uds_path = f"/tmp/tg-srv-{uuid.uuid4().hex[:8]}"
    stale = Path(f"{uds_path}-0")
    stale.write_text("stale")  # left by a crashed run: the shard must replace it
    try:
        with ShardProcess(
            tiny_llama,
            uds_path=uds_path,
            extra_args=["--max-input-tokens", str(MAX_INPUT_TOKENS), "--otlp-endpoint", f"http://127.0.0.1:{port}"],
            # Export spans within 0.1 s instead of 5 s; a KV pool of a known size; prompt logprobs computed.
            env={
                "OTEL_BSP_SCHEDULE_DELAY": "100",
                "TEXTGEN_KV_CACHE_TOKENS": str(POOL_TOKENS),
                "REQUEST_LOGPROBS": "1",
            },
        ) as handle:
            yield handle
    finally:
        stale.unlink(missing_ok=True)  # the shard's socket, or the stand-in where no shard started


@pytest.fixture(scope="module")
def stub(shard):  # type: ignore[no-untyped-def]
    return shard.stub()


def collect(generations, tokens, texts, finished) -> None:  # type: ignore[no-untyped-def]
    for g in generations:
        tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
        texts[g.request_id] = texts.get(g.request_id, "") + "".join(g.tokens.texts)
        if g.HasField("generated_text"):
            finished[g.request_id] = g.generated_text


def step(stub, call, tokens, texts, finished) -> pb.CachedBatch | None:  # type: ignore[no-untyped-def]
    """One Prefill/Decode as the router does it: collect, then filter out the requests that finished."""
    response = call()
    collect(response.generations, tokens, texts, finished)
    if not response.HasField("batch"):
        return None
    cached = response.batch
    live = [i for i in cached.request_ids if i not in finished]
    if not live:
        stub.ClearCache(pb.ClearCacheRequest(id=cached.id))
        return None
    if len(live) < len(cached.request_ids):
        cached = stub.FilterBatch(pb.FilterBatchRequest(batch_id=cached.id, request_ids=live), timeout=30).batch
    return cached


def run_to_end(stub, cached, tokens, texts, finished) -> None:  # type: ignore[no-untyped-def]
    while cached is not None:
        cached = step(
            stub, partial(stub.Decode, pb.DecodeRequest(batches=[cached]), timeout=30), tokens, texts, finished
        )


def test_greedy_through_filter_and_concatenate_matches_transformers(stub, llama_oracle) -> None:
    """8 prompts of different lengths: 5 prefilled together, 2 filtered out mid-way, 3 joined later."""
    new_tokens = {i: 6 + i for i in range(8)}
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    finished: dict[int, pb.GeneratedText] = {}

    first = make_batch(1, [make_request(i, PROMPTS[i], new_tokens[i]) for i in range(5)])
    cached = step(stub, lambda: stub.Prefill(pb.PrefillRequest(batch=first), timeout=30), tokens, texts, finished)
    for _ in range(2):
        cached = step(
            stub, partial(stub.Decode, pb.DecodeRequest(batches=[cached]), timeout=30), tokens, texts, finished
        )
    # The router drops requests 1 and 3 (e.g. clients gone): the others must continue exactly.
    cached = stub.FilterBatch(pb.FilterBatchRequest(batch_id=1, request_ids=[0, 2, 4]), timeout=30).batch
    # Row order is the shard's choice (longest prompt first, holes filled from the tail).
    assert sorted(cached.request_ids) == [0, 2, 4] and cached.size == 3

    second = make_batch(2, [make_request(i, PROMPTS[i], new_tokens[i]) for i in range(5, 8)])
    new = step(stub, lambda: stub.Prefill(pb.PrefillRequest(batch=second), timeout=30), tokens, texts, finished)
    merged = stub.Decode(pb.DecodeRequest(batches=[cached, new]), timeout=30)
    assert merged.HasField("concat_ns") and merged.batch.id == 1
    assert list(merged.batch.request_ids)[:3] == list(cached.request_ids)
    assert sorted(merged.batch.request_ids) == [0, 2, 4, 5, 6, 7]
    cached = step(stub, lambda: merged, tokens, texts, finished)
    run_to_end(stub, cached, tokens, texts, finished)

    for i in (0, 2, 4, 5, 6, 7):
        expected = llama_oracle.greedy(PROMPTS[i], new_tokens[i])
        assert tokens[i] == expected, f"request {i}"
        assert finished[i].text == llama_oracle.tokenizer.decode(expected, skip_special_tokens=True)
        assert finished[i].generated_tokens == new_tokens[i]
        assert finished[i].finish_reason == pb.FINISH_REASON_LENGTH
        assert not finished[i].HasField("seed")  # greedy requests report no seed
        assert finished[i].text.startswith(texts[i].rstrip("\ufffd"))
    for dropped in (1, 3):
        assert len(tokens[dropped]) == 3 and dropped not in finished


def test_stop_sequence_finishes_with_stop_reason(stub, llama_oracle) -> None:
    expected = llama_oracle.greedy(PROMPTS[0], 10)
    stop = llama_oracle.tokenizer.decode(expected[:4]).strip()[-3:]
    assert stop, "the 4th greedy token must add visible text"
    batch = make_batch(3, [make_request(0, PROMPTS[0], 10, stop=(stop,))])
    tokens: dict[int, list[int]] = {}
    finished: dict[int, pb.GeneratedText] = {}
    cached = step(stub, lambda: stub.Prefill(pb.PrefillRequest(batch=batch)), tokens, {}, finished)
    run_to_end(stub, cached, tokens, {}, finished)
    assert finished[0].finish_reason == pb.FINISH_REASON_STOP_SEQUENCE
    assert finished[0].text.endswith(stop) or finished[0].text.endswith(stop + "\n")
    assert tokens[0] == expected[: len(tokens[0])] and len(tokens[0]) <= 4


def test_single_token_request_finishes_in_prefill(stub) -> None:
    response = stub.Prefill(pb.PrefillRequest(batch=make_batch(4, [make_request(9, "x", 1)])))
    assert not response.HasField("batch")  # every request finished: nothing is cached
    (generation,) = response.generations
    assert generation.generated_text.finish_reason == pb.FINISH_REASON_LENGTH
    assert generation.generated_text.generated_tokens == 1
    assert response.total_ns >= response.forward_ns > 0


def test_prefill_logprobs_and_top_n_equal_log_softmax_of_logits(stub, llama_oracle) -> None:
    # Two prompts of different lengths so the shorter one is left padded in the batch.
    prompts = {20: "return self._tail + value", 21: "x = 1"}
    response = stub.Prefill(
        pb.PrefillRequest(
            batch=make_batch(
                5, [make_request(i, text, 1, prefill_logprobs=True, top_n_tokens=3) for i, text in prompts.items()]
            )
        )
    )
    for generation in response.generations:
        text = prompts[generation.request_id]
        reference = llama_oracle.log_softmax(text)
        prompt_ids = llama_oracle.tokenizer(text)["input_ids"]
        prefill = generation.prefill_tokens
        assert list(prefill.ids) == prompt_ids
        assert math.isnan(prefill.logprobs[0])
        for position, (token, logprob) in enumerate(zip(prompt_ids[1:], prefill.logprobs[1:], strict=True)):
            assert logprob == pytest.approx(float(reference[position, token]), abs=1e-4)
        assert list(prefill.texts) == [llama_oracle.tokenizer.decode([t]) for t in prompt_ids]
        assert prefill.is_special[0] and not any(prefill.is_special[1:])  # <s> is special

        top = reference[-1].topk(3)
        (top_tokens,) = generation.top_tokens
        assert list(top_tokens.ids) == top.indices.tolist()
        assert list(top_tokens.logprobs) == pytest.approx(top.values.tolist(), abs=1e-4)
        assert generation.tokens.ids[0] == top.indices[0]  # greedy picks the best token
        assert generation.tokens.logprobs[0] == pytest.approx(float(top.values[0]), abs=1e-4)


def test_seeded_sampling_same_alone_and_batched(stub) -> None:
    sampled = chooser(do_sample=True, seed=1234, temperature=0.9, top_k=50)

    def run(batch_id: int, requests: list[pb.Request]) -> tuple[list[int], pb.GeneratedText]:
        tokens: dict[int, list[int]] = {}
        finished: dict[int, pb.GeneratedText] = {}
        batch = make_batch(batch_id, requests)
        cached = step(stub, lambda: stub.Prefill(pb.PrefillRequest(batch=batch)), tokens, {}, finished)
        run_to_end(stub, cached, tokens, {}, finished)
        return tokens[100], finished[100]

    alone, alone_text = run(6, [make_request(100, PROMPTS[1], 8, params=sampled)])
    batched, batched_text = run(
        7,
        [
            make_request(101, PROMPTS[3], 5),
            make_request(100, PROMPTS[1], 8, params=sampled),
            make_request(102, PROMPTS[5], 8, params=chooser(do_sample=True, seed=7)),
        ],
    )
    assert alone == batched
    assert alone_text.text == batched_text.text
    assert alone_text.seed == 1234


def test_info_health_and_service_discovery(stub, shard) -> None:
    # The Llama family runs the paged engine; without the launcher's environment: ATTENTION "paged" (blocks of
    # 16), no prefix caching, chunking on (TGI's defaults).
    info = stub.Info(pb.InfoRequest())
    assert not info.requires_padding and info.dtype == "torch.float32" and info.device_type == "cpu"
    assert not info.HasField("window_size") and info.speculate == 0
    assert info.support_chunking and not info.use_prefix_caching
    assert info.attention_impl == "paged" and info.block_size == 16
    stub.Health(pb.HealthRequest())
    assert list(stub.ServiceDiscovery(pb.ServiceDiscoveryRequest()).urls) == [shard.url]


def test_stale_socket_file_was_replaced(shard) -> None:
    assert stat.S_ISSOCK(os.stat(shard.socket).st_mode)


def test_warmup_defaults_and_given_limits(stub, llama_oracle) -> None:
    batch = make_batch(8, [make_request(i, PROMPTS[i], 4) for i in range(4)])
    derived = stub.Warmup(pb.WarmupRequest(batch=batch, max_prefill_tokens=4096))
    # The KV pool's capacity; with chunking a request may use it up to the model's context (2048 positions).
    assert derived.max_supported_total_tokens == POOL_TOKENS
    assert (derived.max_input_tokens, derived.max_total_tokens) == (2047, 2048)
    given = stub.Warmup(
        pb.WarmupRequest(batch=batch, max_prefill_tokens=4096, max_input_tokens=40, max_total_tokens=48)
    )
    assert (given.max_input_tokens, given.max_total_tokens) == (40, 48)
    # The warmup batch is freed, never cached.
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=8)]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_clear_cache_one_or_all(stub) -> None:
    a = stub.Prefill(pb.PrefillRequest(batch=make_batch(10, [make_request(0, "a", 4)]))).batch
    b = stub.Prefill(pb.PrefillRequest(batch=make_batch(11, [make_request(1, "b", 4)]))).batch
    stub.ClearCache(pb.ClearCacheRequest(id=10))
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(batches=[a]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert stub.Decode(pb.DecodeRequest(batches=[b])).batch.id == 11
    stub.ClearCache(pb.ClearCacheRequest())
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(batches=[b]))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def two_chunks() -> pb.Request:
    request = make_request(1, "one")
    request.input_chunks.chunks.append(pb.InputChunk(text="two"))
    return request


def empty_prompt() -> pb.Request:
    request = make_request(1, "x")
    request.inputs = ""
    request.input_chunks.chunks[0].text = ""
    return request


BAD_PREFILLS = {
    "empty batch": ([], "at least one request"),
    "empty prompt": ([empty_prompt()], "prompt is empty"),
    "prompt over --max-input-tokens": ([make_request(1, "x = 1\n" * 40)], "must have less than 48 tokens"),
    "NaN temperature": ([make_request(1, "x", params=chooser(temperature=float("nan")))], "temperature"),
    "top_p above 1": ([make_request(1, "x", params=chooser(top_p=1.5))], "top_p"),
    "negative repetition penalty": ([make_request(1, "x", params=chooser(repetition_penalty=-1.0))], "repetition"),
    "max_new_tokens 0": ([make_request(1, "x", 0)], "max_new_tokens"),
    "two text chunks": ([two_chunks()], "more than one text chunk"),
}


@pytest.mark.parametrize("case", list(BAD_PREFILLS))
def test_bad_prefill_is_invalid_argument_and_shard_keeps_serving(stub, case: str) -> None:
    survivor = stub.Prefill(pb.PrefillRequest(batch=make_batch(20, [make_request(5, "while True:", 3)]))).batch
    requests, message = BAD_PREFILLS[case]
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(pb.PrefillRequest(batch=make_batch(21, requests)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    # The batch cached before the error is untouched and still decodes.
    assert stub.Decode(pb.DecodeRequest(batches=[survivor])).batch.id == 20
    stub.ClearCache(pb.ClearCacheRequest(id=20))


def test_prefill_names_each_invalid_row_and_the_rest_runs_alone(stub, llama_oracle) -> None:
    """Issue 24: a row whose temperature is 0 in float32 (1e-300 as sent), a NaN one and one with no new tokens,
    among valid rows. The refusal names exactly those rows, one `request {id}: {reason}` line each (what the
    router parses), caches nothing, and the valid rows prefilled again alone generate what transformers does."""
    good = {1: PROMPTS[0], 4: PROMPTS[1], 6: PROMPTS[3]}
    mixed = [
        make_request(1, good[1], 5),
        make_request(2, "x", params=chooser(temperature=1e-300, do_sample=True)),
        make_request(3, "y", params=chooser(temperature=float("nan"))),
        make_request(4, good[4], 5),
        make_request(5, "z", 0),
        make_request(6, good[6], 5),
    ]
    with pytest.raises(grpc.RpcError) as err:
        stub.Prefill(pb.PrefillRequest(batch=make_batch(40, mixed)), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().split("\n") == [
        "request 2: `temperature` must be strictly positive, got 0.0",
        "request 3: `temperature` must be strictly positive, got nan",
        "request 5: `max_new_tokens` must be strictly positive",
    ]
    with pytest.raises(grpc.RpcError) as err:
        stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=40)]), timeout=30)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND  # the refused Prefill cached nothing

    tokens: dict[int, list[int]] = {}
    finished: dict[int, pb.GeneratedText] = {}
    rest = make_batch(40, [r for r in mixed if r.id in good])
    cached = step(stub, lambda: stub.Prefill(pb.PrefillRequest(batch=rest), timeout=30), tokens, {}, finished)
    run_to_end(stub, cached, tokens, {}, finished)
    assert tokens == {i: llama_oracle.greedy(text, 5) for i, text in good.items()}


def test_prompt_is_truncated_to_its_last_tokens(stub, llama_oracle) -> None:
    long_prompt = "x = 1\n" * 40  # over --max-input-tokens, but truncate brings it under
    response = stub.Prefill(
        pb.PrefillRequest(batch=make_batch(22, [make_request(1, long_prompt, 1, truncate=10, prefill_logprobs=True)]))
    )
    ids = llama_oracle.tokenizer(long_prompt)["input_ids"]
    assert list(response.generations[0].prefill_tokens.ids) == ids[-10:]


def test_bad_batch_ids_and_filters(stub) -> None:
    cached = stub.Prefill(
        pb.PrefillRequest(batch=make_batch(30, [make_request(1, "a", 5), make_request(2, "b", 5)]))
    ).batch
    cases = [
        (lambda: stub.Decode(pb.DecodeRequest(batches=[pb.CachedBatch(id=999)])), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.Decode(pb.DecodeRequest(batches=[cached, pb.CachedBatch(id=999)])), grpc.StatusCode.NOT_FOUND),
        (lambda: stub.Decode(pb.DecodeRequest(batches=[])), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.Decode(pb.DecodeRequest(batches=[cached, cached])), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda: stub.FilterBatch(pb.FilterBatchRequest(batch_id=999, request_ids=[1])), grpc.StatusCode.NOT_FOUND),
        (
            lambda: stub.FilterBatch(pb.FilterBatchRequest(batch_id=30, request_ids=[])),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda: stub.FilterBatch(pb.FilterBatchRequest(batch_id=30, request_ids=[1, 77])),
            grpc.StatusCode.INVALID_ARGUMENT,
        ),
        (
            lambda: stub.Prefill(
                pb.PrefillRequest(batch=make_batch(31, [make_request(3, "c")]), cached_batch=pb.CachedBatch(id=999))
            ),
            grpc.StatusCode.NOT_FOUND,
        ),
    ]
    for call, code in cases:
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == code, err.value.details()
    # Batch 30 survived every rejected call, whole.
    step = stub.Decode(pb.DecodeRequest(batches=[cached]))
    assert sorted(g.request_id for g in step.generations) == [1, 2]
    stub.ClearCache(pb.ClearCacheRequest())


def test_rpcs_continue_the_routers_trace(stub, otlp_collector) -> None:
    collector, _ = otlp_collector
    metadata = (("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"),)
    stub.Health(pb.HealthRequest(), metadata=metadata)
    spans = collector.wait_for(lambda s: s.trace_id.hex() == TRACE_ID)
    assert spans, "no span with the router's trace id reached the collector"
    assert spans[0].parent_span_id.hex() == PARENT_SPAN_ID
    assert spans[0].name.endswith("/Health")


@pytest.mark.parametrize(
    "args, variables, message",
    [
        (["--quantize", "bitsandbytes"], {}, "--quantize bitsandbytes is not supported"),
        (
            ["--speculate", "2"],
            {"USE_FLASH_ATTENTION": "false"},
            "--speculate 2 is not supported with the padded CausalLM (model type llama, USE_FLASH_ATTENTION=false)",
        ),
        (["--speculate", "-1"], {}, "--speculate -1 is not supported: expected a count >= 0"),
        (["--sharded"], {}, "--sharded requires the environment variables"),
        ([], {"ROPE_SCALING": "yarn", "ROPE_FACTOR": "4.0"}, "ROPE_SCALING=yarn is not supported; use one of"),
    ],
)
def test_unsupported_options_are_startup_errors(
    tiny_llama: Path, tmp_path: Path, args: list[str], variables: dict[str, str], message: str
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(variables)
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "textgen_server.cli", "serve", str(tiny_llama), "--uds-path", "/tmp/tg-never", *args]
    assert start_process(cmd, env, log).wait(timeout=60) != 0
    errors = [line for line in log.read_text().splitlines() if "ERROR" in line]
    assert len(errors) == 1 and message in errors[0]


def test_startup_error_is_one_json_line_with_json_output(tiny_llama: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "textgen_server.cli",
            "serve",
            str(tiny_llama),
            "--uds-path",
            "/tmp/tg-never",
            "--quantize",
            "awq",
            "--json-output",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    (line,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert line["level"] == "ERROR" and line["target"] == "textgen_server.cli"
    assert line["message"] == (
        "--quantize awq needs a checkpoint quantized with awq (a quantization_config in config.json): textgen does "
        "not quantize float weights at load"
    )


def test_sigterm_stops_cleanly_and_removes_socket(shard) -> None:
    """Last on purpose: it stops the module's shard."""
    with shard_stub(shard.socket) as stub:
        stub.Health(pb.HealthRequest(), timeout=10)
    shard.stop()
    assert shard.process.returncode == 0
    assert not os.path.exists(shard.socket)
