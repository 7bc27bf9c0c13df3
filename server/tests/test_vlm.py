"""A real shard serving the tiny vision-language models over generate.v3, on the paged engine (models/paged_vlm.py)
and the padded one (models/vlm_causal_lm.py; not Qwen2-VL's, whose M-RoPE it refuses): images as input chunks,
greedy tokens equal to transformers' `generate` with the model's own processor (float32), alone and in mixed
batches, after TGI's warmup (whose first request carries an image); on the paged engine also with the prompt's
prefill chunked through its images and with a prefix-cache hit that ends inside an image."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from safetensors.torch import load_file, save_file
from shard_helpers import chooser, generate_on_ranks, generate_over_grpc, make_batch, make_request

from testing.models import build_vlm, edited_copy
from testing.shards import ShardHandle, ShardProcess
from testing.vlm_oracle import VlmOracle, image_bytes
from textgen_pb import generate_pb2 as pb
from textgen_router.backend import warmup_batch
from textgen_server.build_choices import VLM_ARCHS
from textgen_server.models.paged_vlm import text_model_aliases

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


ENGINES = {"paged": {}, "padded": {"USE_FLASH_ATTENTION": "false"}}
MROPE_ARCHS = ("qwen2_vl", "qwen2_5_vl")  # served on the paged engine only (M-RoPE positions)
SERVED = [(arch, engine) for arch in VLM_ARCHS for engine in ENGINES if engine == "paged" or arch not in MROPE_ARCHS]


@pytest.fixture(scope="module", params=SERVED, ids="-".join)
def served(request: pytest.FixtureRequest) -> Iterator[tuple[ShardHandle, VlmOracle]]:
    arch, engine = request.param
    model_dir = build_vlm(arch)
    with ShardProcess(model_dir, env=ENGINES[engine]) as handle:
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


def test_two_images_in_one_prompt_give_transformers_tokens(served) -> None:  # type: ignore[no-untyped-def]
    """Images of two sizes in one prompt, text between them: each image's features at its own tokens, and with
    M-RoPE the text after the first image and the second image placed after the first one's grid."""
    handle, oracle = served
    pieces: list[str | bytes] = ["Compare ", CASES[1][1], " with ", CASES[0][1], " please"]
    request = make_request(8, "unused", NEW_TOKENS)
    chunks = [pb.InputChunk(text=p) if isinstance(p, str) else pb.InputChunk(image=pb.Image(data=p)) for p in pieces]
    request.input_chunks.CopyFrom(pb.Input(chunks=chunks))
    assert generate(handle.stub(), [request], batch_id=70) == {8: oracle.greedy_pieces(pieces, NEW_TOKENS)}


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


BLOCK_SIZE, BUDGET = 16, 16  # the paged engine's blocks; a prefill budget smaller than an image's tokens


@pytest.fixture(scope="module", params=VLM_ARCHS)
def paged(request: pytest.FixtureRequest) -> Iterator[tuple[ShardHandle, VlmOracle]]:
    """The paged engine as TGI v3's router drives it with prefix caching and chunking on."""
    model_dir = build_vlm(request.param)
    env = {"PREFIX_CACHING": "1", "PREFILL_CHUNKING": "1", "TEXTGEN_KV_CACHE_TOKENS": "4096"}
    with ShardProcess(model_dir, env=env) as handle:
        stub = handle.stub()
        info = stub.Info(pb.InfoRequest())
        assert (info.requires_padding, info.block_size, info.use_prefix_caching, info.support_chunking) == (
            False,
            BLOCK_SIZE,
            True,
            True,
        )
        warmup = make_batch(0, [make_request(0, "_test " * 8, 2)])
        stub.Warmup(pb.WarmupRequest(batch=warmup, max_prefill_tokens=BUDGET), timeout=60)
        yield handle, VlmOracle(model_dir)


def with_blocks(request: pb.Request, prompt_tokens: int, blocks: list[int]) -> pb.Request:
    """`request` with the blocks of its prompt and new tokens, as TGI's router gives them (`blocks` first)."""
    needed = -(-(prompt_tokens + request.stopping_parameters.max_new_tokens - 1) // BLOCK_SIZE)
    request.blocks.extend(blocks[:needed])
    request.slots.extend(b * BLOCK_SIZE + i for b in request.blocks for i in range(BLOCK_SIZE))
    return request


def test_paged_chunks_through_an_image_and_a_prefix_hit_inside_one_give_transformers_tokens(paged) -> None:  # type: ignore[no-untyped-def]
    handle, oracle = paged
    stub = handle.stub()
    first_text, second_text = (CASES[0][0], CASES[0][1], " what is it?"), (CASES[0][0], CASES[0][1], " and then?")
    first_ids = oracle.inputs(*first_text)["input_ids"][0].tolist()
    second_ids = oracle.inputs(*second_text)["input_ids"][0].tolist()
    image_at = [p for p, token in enumerate(second_ids) if token == oracle.model.config.image_token_id]
    # A cached prefix that ends inside the image: the rest of the image's tokens are computed after the hit.
    cache_len = (image_at[0] // BLOCK_SIZE + 1) * BLOCK_SIZE
    assert image_at[0] < cache_len < image_at[-1] and first_ids[:cache_len] == second_ids[:cache_len]
    assert len(first_ids) > 2 * BUDGET  # the first prompt's prefill takes several chunks, its image's tokens too

    first = with_blocks(vlm_request(1, *first_text), len(first_ids), list(range(1, 64)))
    first.chunk_len = BUDGET
    assert generate_over_grpc(stub, make_batch(60, [first])) == {1: oracle.greedy(*first_text, NEW_TOKENS)}

    reused = list(first.blocks[: cache_len // BLOCK_SIZE])
    second = with_blocks(vlm_request(2, *second_text), len(second_ids), reused + list(range(64, 128)))
    second.cache_len = cache_len
    second.chunk_len = BUDGET
    assert generate_over_grpc(stub, make_batch(61, [second])) == {2: oracle.greedy(*second_text, NEW_TOKENS)}


@pytest.mark.parametrize("arch", VLM_ARCHS)
def test_two_shards_split_the_text_model_and_give_transformers_tokens(arch: str) -> None:
    """The language model split as any Llama's, the vision tower whole on each rank."""
    model_dir = build_vlm(arch)
    oracle = VlmOracle(model_dir)
    with ShardProcess(model_dir, num_shard=2) as handle:
        got, _ = generate_on_ranks(handle, [vlm_request(i, *case) for i, case in enumerate(CASES)])
    assert got == {i: oracle.greedy(*case, NEW_TOKENS) for i, case in enumerate(CASES)}


def test_the_text_model_is_read_under_each_checkpoint_layout_s_names() -> None:
    layouts = {
        "language_model.model.": "language_model.lm_head.weight",  # llava-hf's (and transformers' save)
        "model.language_model.": "lm_head.weight",  # transformers 4.52-4.57's saves
        "model.text_model.": "lm_head.weight",  # idefics3's
    }
    for prefix, head in layouts.items():
        names = [f"{prefix}embed_tokens.weight", f"{prefix}layers.0.mlp.up_proj.weight", head, "vision.x"]
        aliases = text_model_aliases(names, tied=False)
        assert aliases["model.layers.0.mlp.up_proj.weight"] == [f"{prefix}layers.0.mlp.up_proj.weight"]
        assert head == "lm_head.weight" or aliases["lm_head.weight"] == [head]
        tied = text_model_aliases(names, tied=True)["lm_head.weight"]
        assert tied[-1] == f"{prefix}embed_tokens.weight"
    # Qwen2-VL's hub layout: the language model under tp_llama's own names, a tied head stored as the embedding
    qwen = ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "visual.blocks.0.mlp.fc1.weight"]
    assert "model.layers.0.mlp.up_proj.weight" not in text_model_aliases(qwen, tied=True)  # read as it is
    assert "model.embed_tokens.weight" in text_model_aliases(qwen, tied=True)["lm_head.weight"]


def test_qwen2_vl_in_the_hub_s_layout_with_a_tied_head_gives_transformers_tokens(tmp_path: Path) -> None:
    """Qwen2-VL-2B's checkpoint as the hub holds it: the language model under `model.*`, the tower under
    `visual.*`, and no `lm_head.weight` (the head is tied to the embedding)."""

    def tie(config: dict[str, Any]) -> None:
        config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True

    model_dir = edited_copy(build_vlm("qwen2_vl"), tmp_path / "hub", "config.json", tie)
    tensors = load_file(model_dir / "model.safetensors")
    hub = {}
    for name, tensor in tensors.items():
        if name != "lm_head.weight":
            hub[name.replace("model.language_model.", "model.").replace("model.visual.", "visual.")] = tensor
    assert "model.embed_tokens.weight" in hub and "visual.merger.mlp.0.weight" in hub
    save_file(hub, model_dir / "model.safetensors", metadata={"format": "pt"})
    oracle = VlmOracle(model_dir)
    with ShardProcess(model_dir) as handle:
        got = generate(handle.stub(), [vlm_request(i, *case) for i, case in enumerate(CASES[:2])], batch_id=1)
    assert got == {i: oracle.greedy(*case, NEW_TOKENS) for i, case in enumerate(CASES[:2])}
