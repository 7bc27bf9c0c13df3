"""A tiny vision-language model served by the real launcher, as a user starts it (no flag: the shard and the
router read the family from config.json): markdown images, as data URIs or URLs of a loopback server, in
`/generate`, `image_url` parts in chat, TGI's errors for bad images, and greedy tokens equal to transformers'
`generate` with the model's processor."""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading
from collections.abc import Callable, Iterator

import httpx
import psutil
import pytest

from testing.launcher import LauncherProcess
from testing.models import build_vlm
from testing.vlm_oracle import VlmOracle, image_bytes

NEW_TOKENS = 8
PNG, JPEG = image_bytes(0, 48, 80), image_bytes(1, 90, 40, "JPEG")


def data_uri(image: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(image).decode()}"


@pytest.fixture(scope="module")
def served(launcher: Callable[..., LauncherProcess]) -> Iterator[tuple[LauncherProcess, VlmOracle]]:
    """llava_next behind the launcher, with the prefix cache on. The router's part is the same for every family
    (the family is in the processor it runs); server/tests/test_vlm.py serves each family over gRPC against the
    same oracle."""
    model_dir = build_vlm("llava_next")
    server = launcher(model_dir, env={"PREFIX_CACHING": "1"})  # on CPU TGI's default is off (paged attention)
    yield server, VlmOracle(model_dir)
    server.stop()


def generate(server: LauncherProcess, inputs: str, **parameters: object) -> httpx.Response:
    body = {"inputs": inputs, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True, **parameters}}
    return httpx.post(f"{server.base_url}/generate", json=body, timeout=120)


def generate_all(server: LauncherProcess, cases: list[tuple[str, bytes | None, str, str]]) -> list[httpx.Response]:
    """One `/generate` per (text before, image, its mimetype, text after), all sent at once."""

    async def send_all() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/generate",
                        json={
                            "inputs": before + (f"![]({data_uri(image, mime)})" if image else "") + after,
                            "parameters": {"max_new_tokens": NEW_TOKENS, "details": True},
                        },
                    )
                    for before, image, mime, after in cases
                )
            )

    return asyncio.run(send_all())


CASES = [
    ("Look: ", PNG, "image/png", " what is it?"),
    ("Here ", JPEG, "image/jpeg", " and then"),
    ("No image here, only text", None, "", ""),
]


def test_concurrent_requests_with_and_without_images_get_transformers_tokens(served) -> None:  # type: ignore[no-untyped-def]
    server, oracle = served
    for (before, image, _, after), response in zip(CASES, generate_all(server, CASES), strict=True):
        assert response.status_code == 200, response.text
        tokens = [t["id"] for t in response.json()["details"]["tokens"]]
        assert tokens == oracle.greedy(before, image, after, NEW_TOKENS)


def test_the_prefix_cache_shares_an_image_s_blocks_only_with_the_same_image(served) -> None:  # type: ignore[no-untyped-def]
    server, oracle = served
    other = image_bytes(5, 48, 80)  # PNG's size: the same placeholder ids, other pixels
    before = "An opening sentence long enough to fill a whole block of the cache or two. Look: "
    for image in (PNG, other, PNG):  # the second would read the first's KV if placeholders matched
        response = generate(server, f"{before}![]({data_uri(image, 'image/png')}) what is it?")
        assert response.status_code == 200, response.text
        tokens = [t["id"] for t in response.json()["details"]["tokens"]]
        assert tokens == oracle.greedy(before, image, " what is it?", NEW_TOKENS)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        (
            "Look: ![](http://169.254.169.254/latest/meta-data/)",
            "Could not fetch image: http://169.254.169.254/latest/meta-data/: 169.254.169.254 resolves to "
            "169.254.169.254, a link-local or cloud metadata address",
        ),
        ("Look: ![](data:image/png;base64,%%%)", "base64 encoding is invalid: "),
        ("Look: ![](data:image/png,abc)", "invalid image content: image/png,abc"),
        ("Look: ![](ftp://host/cat.png)", "invalid image content: ftp://host/cat.png"),
        (f"Look: ![]({data_uri(b'not an image', 'image/png')})", "invalid image: cannot identify image file"),
    ],
)
def test_a_bad_image_is_a_422_and_the_server_stays_up(served, inputs: str, message: str) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    response = generate(server, inputs)
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"
    assert response.json()["error"].startswith(f"Input validation error: {message}")
    assert generate(server, "Still up?").status_code == 200


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """A loopback HTTP server of the JPEG image at /cat.jpg."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            found = self.path == "/cat.jpg"
            self.send_response(200 if found else 404)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(JPEG) if found else 0))
            self.end_headers()
            if found:
                self.wfile.write(JPEG)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()


def test_an_image_url_is_fetched(served, image_server: str) -> None:  # type: ignore[no-untyped-def]
    server, oracle = served
    response = generate(server, f"Here ![]({image_server}/cat.jpg) and then")
    assert response.status_code == 200, response.text
    assert [t["id"] for t in response.json()["details"]["tokens"]] == oracle.greedy(
        "Here ", JPEG, " and then", NEW_TOKENS
    )
    missing = generate(server, f"![]({image_server}/dog.jpg)")
    assert missing.status_code == 422
    assert missing.json()["error"].endswith(f"Could not fetch image: {image_server}/dog.jpg: HTTP status 404")


def test_truncation_may_drop_text_but_never_an_image(served) -> None:  # type: ignore[no-untyped-def]
    server, oracle = served
    inputs = "one two three four five six seven " + f"![]({data_uri(PNG, 'image/png')})"
    refused = generate(server, inputs, truncate=3)
    assert refused.status_code == 422
    assert "truncating it to 3 would cut an image" in refused.json()["error"]
    whole = generate(server, inputs)
    assert whole.status_code == 200
    assert [t["id"] for t in whole.json()["details"]["tokens"]] == oracle.greedy(
        "one two three four five six seven ", PNG, "", NEW_TOKENS
    )


def test_markdown_with_alt_text_is_text_as_in_tgi(served) -> None:  # type: ignore[no-untyped-def]
    server, oracle = served
    inputs = "See ![a cat](https://example.invalid/cat.png)"
    response = generate(server, inputs)
    assert response.status_code == 200  # not fetched, not refused: only `![](...)` is an image
    assert [t["id"] for t in response.json()["details"]["tokens"]] == oracle.greedy(inputs, None, "", NEW_TOKENS)


def test_chat_image_url_parts_are_images(served) -> None:  # type: ignore[no-untyped-def]
    server, _ = served
    image = {"type": "image_url", "image_url": {"url": data_uri(PNG, "image/png")}}
    # temperature 0: greedy. Unset, a chat request samples (OpenAI's and TGI's default) with a random seed, and a
    # sampled end-of-sequence ended it after one token in one CI run.
    content = [{"type": "text", "text": "Look: "}, image]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    # the template's text holds the image as markdown, which the prompt's validation turned into an image
    prompt_tokens = response.json()["usage"]["prompt_tokens"]
    text_only = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Look: "}], "max_tokens": 4},
        timeout=120,
    )
    assert prompt_tokens > text_only.json()["usage"]["prompt_tokens"] + 4  # an image is more than a few tokens
    url = {"type": "image_url", "image_url": {"url": "http://169.254.169.254/cat.png"}}
    refused = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": [url]}], "max_tokens": 4},
        timeout=120,
    )
    assert refused.status_code == 422
    assert "a link-local or cloud metadata address" in refused.json()["error"]


def test_a_dead_image_worker_fails_one_request_and_the_next_gets_new_workers(served) -> None:  # type: ignore[no-untyped-def]
    server, oracle = served
    launcher = psutil.Process(server.process.pid)
    router = next(p for p in launcher.children() if "textgen-router" in " ".join(p.cmdline()))
    forkserver = next(p for p in router.children() if "forkserver" in " ".join(p.cmdline()))
    workers = forkserver.children()  # the image workers fork from the preloaded server
    assert workers
    workers[0].kill()
    # The pool sees the death and stops its other workers: once all are gone it is broken, before any request.
    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive
    inputs = f"Look: ![]({data_uri(PNG, 'image/png')}) what is it?"
    failed = generate(server, inputs)
    assert failed.status_code == 422
    assert failed.json()["error"].endswith("the images could not be prepared: the worker preparing them died")
    again = generate(server, inputs)
    assert again.status_code == 200, again.text
    assert [t["id"] for t in again.json()["details"]["tokens"]] == oracle.greedy(
        "Look: ", PNG, " what is it?", NEW_TOKENS
    )
    assert forkserver.children()  # a new pool's workers


def test_qwen2_vl_behind_the_launcher_gets_transformers_tokens(launcher: Callable[..., LauncherProcess]) -> None:
    """What differs for Qwen2-VL from the router to the shard: its processor is built without the video processor
    transformers cannot build without torchvision, an image is framed by its vision tags, and the shard places its
    tokens with M-RoPE. An image at several sizes, a text-only request beside them, then the same image and prompt
    again (a prefix-cache hit through the image, whose positions are its grid's)."""
    model_dir = build_vlm("qwen2_vl")
    server = launcher(model_dir, env={"PREFIX_CACHING": "1"})
    oracle = VlmOracle(model_dir)
    for (before, image, _, after), response in zip(CASES, generate_all(server, CASES), strict=True):
        assert response.status_code == 200, response.text
        expected = oracle.greedy(before, image, after, NEW_TOKENS, ignore_eos=False)
        assert [t["id"] for t in response.json()["details"]["tokens"]] == expected
    again = generate(server, f"Look: ![]({data_uri(PNG, 'image/png')}) what is it?")
    before, image, _, after = CASES[0]
    assert [t["id"] for t in again.json()["details"]["tokens"]] == oracle.greedy(
        before, image, after, NEW_TOKENS, False
    )
    server.stop()
