"""A real shard serving the tiny vision-language models (models/vlm_causal_lm.py) over generate.v3: images as input
chunks, greedy tokens equal to transformers' `generate` with the model's own processor (float32), alone and in
mixed batches, after TGI's warmup (whose first request carries an image)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from shard_helpers import chooser, generate_over_grpc, make_batch, make_request

from testing.models import build_vlm
from testing.shards import ShardHandle, ShardProcess
from testing.vlm_oracle import VlmOracle, image_bytes
from textgen_pb import generate_pb2 as pb
from textgen_router.backend import warmup_batch
from textgen_server.vlm_builder import VLM_ARCHS

NEW_TOKENS = 8


# (text, image, text) prompts: images of several sizes and formats, and one without an image
CASES = [
    ("Look: ", image_bytes(0, 48, 80), " what is it?"),
    ("Here ", image_bytes(1, 90, 40, "JPEG"), " and then"),
    ("Describe: ", image_bytes(2, 33, 33, "WEBP"), ""),
    ("No image here, only text", None, ""),
]


def vlm_request(request_id: int, before: str, image: bytes | None, after: str, truncate: int = 0) -> pb.Request:
    """A request as TGI's router sends a VLM's: the text around each image in its own chunk."""
    chunks = [pb.InputChunk(text=before)]
    if image is not None:
        chunks += [pb.InputChunk(image=pb.Image(data=image, mimetype="image/png")), pb.InputChunk(text=after)]
    request = make_request(request_id, before + after, NEW_TOKENS, truncate=truncate)
    request.input_chunks.CopyFrom(pb.Input(chunks=chunks))
    return request


@pytest.fixture(scope="module", params=VLM_ARCHS)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[ShardHandle, VlmOracle]]:
    model_dir = build_vlm(request.param)
    with ShardProcess(model_dir) as handle:
        stub = handle.stub()
        stub.Warmup(
            pb.WarmupRequest(
                batch=warmup_batch(255, 256, 256, None),
                max_input_tokens=255,
                max_prefill_tokens=256,
                max_total_tokens=256,
            ),
            timeout=60,
        )
        yield handle, VlmOracle(model_dir)


def generate(stub, requests: list[pb.Request], batch_id: int) -> dict[int, list[int]]:  # type: ignore[no-untyped-def]
    return generate_over_grpc(stub, make_batch(batch_id, requests))


def test_each_request_alone_and_all_in_one_batch_give_transformers_tokens(served) -> None:  # type: ignore[no-untyped-def]
    handle, oracle = served
    stub = handle.stub()
    expected = {i: oracle.greedy(*case, NEW_TOKENS) for i, case in enumerate(CASES)}
    for i, case in enumerate(CASES):
        assert generate(stub, [vlm_request(i, *case)], batch_id=10 + i) == {i: expected[i]}
    mixed = generate(stub, [vlm_request(i, *case) for i, case in enumerate(CASES)], batch_id=20)
    assert mixed == expected
    assert len({tuple(t) for t in expected.values()}) == len(CASES)  # every image led somewhere else


def test_a_bad_image_or_a_cut_image_refuses_its_request_only(served) -> None:  # type: ignore[no-untyped-def]
    handle, oracle = served
    stub = handle.stub()
    bad = vlm_request(1, "Look: ", b"not an image at all", " what?")
    cut = vlm_request(2, *CASES[0], truncate=4)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Prefill(pb.PrefillRequest(batch=make_batch(30, [bad, cut, vlm_request(3, *CASES[1])])), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details()
    assert "request 1: invalid image: cannot identify image file" in details
    assert "request 2: the prompt with its images is" in details and "truncating it to 4 would cut an image" in details
    assert "request 3" not in details
    assert generate(stub, [vlm_request(3, *CASES[1])], batch_id=31) == {3: oracle.greedy(*CASES[1], NEW_TOKENS)}


def test_a_text_row_of_several_chunks_is_their_text_in_order(served) -> None:  # type: ignore[no-untyped-def]
    handle, oracle = served
    request = make_request(5, "unused", NEW_TOKENS, params=chooser())
    request.input_chunks.CopyFrom(
        pb.Input(chunks=[pb.InputChunk(text="No image here, "), pb.InputChunk(text="only text")])
    )
    assert generate(handle.stub(), [request], batch_id=40) == {
        5: oracle.greedy("No image here, only text", None, "", NEW_TOKENS)
    }


def test_a_text_row_of_several_chunks_truncates_as_one_chunk_does(served) -> None:  # type: ignore[no-untyped-def]
    """No image in the row, so nothing stops the left cut (the truncation rule found no image and once failed)."""
    handle, _ = served
    several = make_request(6, "unused", NEW_TOKENS, truncate=3)
    several.input_chunks.CopyFrom(
        pb.Input(chunks=[pb.InputChunk(text="No image here, "), pb.InputChunk(text="only text")])
    )
    one = make_request(7, "No image here, only text", NEW_TOKENS, truncate=3)
    stub = handle.stub()
    assert generate(stub, [several], batch_id=50)[6] == generate(stub, [one], batch_id=51)[7]
