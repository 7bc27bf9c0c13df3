"""Fetching a request's image URL without making the router an open proxy (vLLM's CVE-2025-6242 was a server-side
request forgery through image URLs).

Every hop, the first URL and each redirect alike, is checked before anything is sent: an http(s) URL; a host on
the operator's allow-list when one is set (`--image-fetch-allowed-hosts`, textgen's own flag: exact names, or
`*.example.com` for its subdomains); and every address the host resolves to outside link-local and the clouds'
metadata addresses unless `--image-fetch-allow-link-local`. The connection then goes to the address that was
checked (the Host header and TLS name stay the URL's), so a DNS answer that changes between the check and the
connection cannot redirect it. At most MAX_REDIRECTS redirects are followed; the whole fetch, redirects
included, has FETCH_TIMEOUT_S; the body is read up to `--max-image-fetch-size` bytes (TGI's limit and message).
The fetch is asynchronous: a slow server delays only its own request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx

from textgen_router.types import ValidationError

FETCH_TIMEOUT_S = 10.0
MAX_REDIRECTS = 5
# Link-local covers 169.254.169.254 (AWS, GCP, Azure, OpenStack); these are the other metadata endpoints.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in ("fd00:ec2::254", "100.100.100.200"))


class FetchRefused(Exception):
    """Why a URL is not fetched (the 422's text after TGI's "Could not fetch image: <url>: ")."""


@dataclass(frozen=True)
class FetchPolicy:
    max_bytes: int  # --max-image-fetch-size
    allowed_hosts: tuple[str, ...] = ()  # empty: any host
    allow_link_local: bool = False
    timeout_s: float = FETCH_TIMEOUT_S

    def host_allowed(self, host: str) -> bool:
        if not self.allowed_hosts:
            return True
        host = host.lower().rstrip(".")
        return any(
            host == allowed or (allowed.startswith("*.") and host.endswith(allowed[1:]))
            for allowed in self.allowed_hosts
        )

    def address_allowed(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if self.allow_link_local:
            return True
        mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:169.254.169.254 is that address too
        return not any(a.is_link_local or a in METADATA_ADDRESSES for a in (address, mapped) if a is not None)


async def fetch_image(url: str, policy: FetchPolicy) -> tuple[bytes, str]:
    """The body and Content-Type of `url` under `policy`; ValidationError (422) with TGI's messages otherwise."""
    try:
        return await asyncio.wait_for(_fetch(url, policy), policy.timeout_s)
    except TimeoutError:
        raise ValidationError(f"Could not fetch image: {url}: no answer within {policy.timeout_s:g} s") from None
    except FetchRefused as why:
        raise ValidationError(f"Could not fetch image: {url}: {why}") from None
    except httpx.HTTPError as err:
        raise ValidationError(f"Could not fetch image: {url}: {err or type(err).__name__}") from None


async def _fetch(url: str, policy: FetchPolicy) -> tuple[bytes, str]:
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            request = await _pinned_request(client, url, policy)
            response = await client.send(request, stream=True)
            try:
                if response.is_redirect:
                    url = urljoin(url, response.headers["location"])
                    continue
                if response.status_code != 200:
                    raise FetchRefused(f"HTTP status {response.status_code}")
                return await _body(response, policy.max_bytes), response.headers.get("content-type", "")
            finally:
                await response.aclose()
    raise FetchRefused(f"more than {MAX_REDIRECTS} redirects")


async def _pinned_request(client: httpx.AsyncClient, url: str, policy: FetchPolicy) -> httpx.Request:
    """The GET of `url` sent to an address of its host that the policy allows (every address is checked)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise FetchRefused("only http and https URLs are fetched")
    host = parts.hostname
    if not policy.host_allowed(host):
        raise FetchRefused(f"the host {host} is not in --image-fetch-allowed-hosts")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as err:
        raise FetchRefused(f"{host} does not resolve: {err}") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    refused = [a for a in addresses if not policy.address_allowed(a)]
    if refused:
        raise FetchRefused(
            f"{host} resolves to {refused[0]}, a link-local or cloud metadata address (--image-fetch-allow-link-local)"
        )
    pinned = f"[{addresses[0]}]" if addresses[0].version == 6 else str(addresses[0])
    target = parts._replace(netloc=f"{pinned}:{port}").geturl()
    headers = {"host": parts.netloc.rsplit("@", 1)[-1]}
    extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
    return client.build_request("GET", target, headers=headers, extensions=extensions)


async def _body(response: httpx.Response, max_bytes: int) -> bytes:
    """The body, refused (TGI's ImageTooLarge) once it is known to pass `max_bytes`."""
    declared = response.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ValidationError(f"Image size {declared} bytes exceeds maximum allowed size of {max_bytes} bytes")
    body = bytearray()
    async for piece in response.aiter_bytes():
        body += piece
        if len(body) > max_bytes:
            raise ValidationError(f"Image size {len(body)} bytes exceeds maximum allowed size of {max_bytes} bytes")
    return bytes(body)
