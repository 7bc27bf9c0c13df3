"""Image URLs fetched for a vision-language model never make the router an open proxy (image_fetch.py): a loopback
server that serves, redirects, stalls and sends too much; addresses checked at every hop before any byte is sent."""

from __future__ import annotations

import asyncio
import http.server
import ipaddress
import threading
import time
from collections.abc import Iterator

import pytest

from textgen_router.image_fetch import MAX_REDIRECTS, FetchPolicy, fetch_image
from textgen_router.types import ValidationError

BODY = b"\x89PNG not really, but bytes" * 10
MAX_BYTES = 1000


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path
        if path == "/image.png":
            self.reply(200, BODY, {"Content-Type": "image/png"})
        elif path.startswith("/hops/"):
            left = int(path.rsplit("/", 1)[1])
            self.reply(302, b"", {"Location": "/image.png" if left == 0 else f"/hops/{left - 1}"})
        elif path == "/to-metadata":
            self.reply(302, b"", {"Location": "http://169.254.169.254/latest/meta-data/"})
        elif path == "/to-ftp":
            self.reply(302, b"", {"Location": "ftp://127.0.0.1/image.png"})
        elif path == "/to-ip":
            self.reply(302, b"", {"Location": f"http://127.0.0.1:{self.server.server_port}/image.png"})
        elif path == "/declared-too-big":
            self.reply(200, b"x" * (MAX_BYTES + 1), {"Content-Type": "image/png"})
        elif path == "/streamed-too-big":  # no Content-Length: the body is counted as it comes
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            for _ in range(4):
                self.wfile.write(b"x" * (MAX_BYTES // 2))
        elif path == "/stall":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            time.sleep(4)
        else:
            self.reply(404, b"no", {})

    def reply(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"localhost:{httpd.server_port}"
    httpd.shutdown()


POLICY = FetchPolicy(MAX_BYTES, timeout_s=1.0)


def fetch(url: str, policy: FetchPolicy = POLICY) -> tuple[bytes, str]:
    return asyncio.run(fetch_image(url, policy))


PREFIX = "Input validation error: "  # every 422 of validation, as TGI words it


def refused(url: str, policy: FetchPolicy = POLICY) -> str:
    """The 422's message after its prefix."""
    with pytest.raises(ValidationError) as error:
        fetch(url, policy)
    message = str(error.value)
    assert message.startswith(PREFIX)
    return message[len(PREFIX) :]


def test_an_image_and_a_chain_of_redirects_are_fetched(server: str) -> None:
    assert fetch(f"http://{server}/image.png") == (BODY, "image/png")
    assert fetch(f"http://{server}/hops/{MAX_REDIRECTS - 1}")[0] == BODY
    message = refused(f"http://{server}/hops/{MAX_REDIRECTS}")
    assert message == f"Could not fetch image: http://{server}/hops/{MAX_REDIRECTS}: more than 5 redirects"


def test_link_local_and_metadata_addresses_are_refused_at_every_hop(server: str) -> None:
    direct = "http://169.254.169.254/latest/meta-data/"
    assert refused(direct) == (
        f"Could not fetch image: {direct}: 169.254.169.254 resolves to 169.254.169.254, a link-local or cloud "
        "metadata address (--image-fetch-allow-link-local)"
    )
    assert "resolves to 169.254.169.254" in refused(f"http://{server}/to-metadata")  # a redirect is checked too
    assert "only http and https URLs are fetched" in refused(f"http://{server}/to-ftp")
    for address in ("169.254.169.254", "fe80::1", "fd00:ec2::254", "100.100.100.200", "::ffff:169.254.169.254"):
        assert not POLICY.address_allowed(ipaddress.ip_address(address)), address
        assert FetchPolicy(MAX_BYTES, allow_link_local=True).address_allowed(ipaddress.ip_address(address))
    for address in ("127.0.0.1", "10.1.2.3", "::1", "93.184.216.34"):
        assert POLICY.address_allowed(ipaddress.ip_address(address)), address


def test_an_allow_list_limits_the_hosts_of_every_hop(server: str) -> None:
    only_localhost = FetchPolicy(MAX_BYTES, ("localhost",), timeout_s=1.0)
    assert fetch(f"http://{server}/image.png", only_localhost)[0] == BODY
    assert "the host 127.0.0.1 is not in --image-fetch-allowed-hosts" in refused(
        f"http://{server}/to-ip", only_localhost
    )
    subdomains = FetchPolicy(MAX_BYTES, ("*.example.com",))
    assert subdomains.host_allowed("img.example.com") and subdomains.host_allowed("A.B.example.com.")
    assert not subdomains.host_allowed("example.com.evil.net") and not subdomains.host_allowed("badexample.com")


def test_too_much_is_refused_with_tgis_message(server: str) -> None:
    assert refused(f"http://{server}/declared-too-big") == (
        f"Image size {MAX_BYTES + 1} bytes exceeds maximum allowed size of {MAX_BYTES} bytes"
    )
    assert refused(f"http://{server}/streamed-too-big").startswith("Image size ")
    assert refused(f"http://{server}/missing") == f"Could not fetch image: http://{server}/missing: HTTP status 404"


def test_a_stalled_server_times_out_and_delays_no_other_fetch(server: str) -> None:
    patient = FetchPolicy(MAX_BYTES, timeout_s=2.0)  # room for the other fetch on a busy machine

    async def both() -> tuple[object, bool]:
        stalled = asyncio.create_task(fetch_image(f"http://{server}/stall", patient))
        await asyncio.sleep(0.1)  # the stalled one has its headers and waits for a body that does not come
        assert await fetch_image(f"http://{server}/image.png", POLICY) == (BODY, "image/png")
        waiting = not stalled.done()
        return (await asyncio.gather(stalled, return_exceptions=True))[0], waiting

    outcome, waiting = asyncio.run(both())
    assert waiting  # the other fetch was answered while this one waited
    assert isinstance(outcome, ValidationError)
    assert str(outcome) == f"{PREFIX}Could not fetch image: http://{server}/stall: no answer within 2 s"
