"""A bounded property-based fuzz of the HTTP API, generated from the router's own OpenAPI spec (schemathesis),
against a real router + shard of its own (the shared router's flags, a lower --max-total-tokens). Every operation
gets a fixed number of generated requests, valid and invalid; each response must be no 5xx and must conform to the
spec: a documented status, content type and body schema (SSE events included). A failure means the server or
openapi_spec.py is wrong: fix that rather than loosen the checks. Derandomized, so a run is the same run every
time.

The operations are driven from one test with hypothesis directly rather than through schemathesis' pytest
plugin, which depends on pytest internals that change between pytest releases.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_fixtures import API_KEY, MAX_INPUT_TOKENS, PAYLOAD_LIMIT, ROUTER_FLAGS, RouterProcess
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from testing.shards import ShardProcess

EXAMPLES_PER_OPERATION = 16
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# Bodies the generators do not send but clients do: none, not JSON, not declared as JSON, over --payload-limit.
EDGE_CASES: list[dict[str, Any]] = [
    {},
    {"body": b'{"inputs": "x",', "media_type": "application/json"},
    {"body": "inputs", "media_type": "text/plain"},
    {"body": b'{"inputs": "' + b"x" * PAYLOAD_LIMIT + b'"}', "media_type": "application/json"},
]
pytestmark = pytest.mark.timeout(600)
# A generated request that leaves out `max_new_tokens` generates up to --max-total-tokens: on the shared router
# (512) each such request took ~2 s of a 2-core box, most of this test's 34-50 s. The fuzz is about the API's
# shapes, not long generations, so it has a router of its own whose total is just above the input limit.
FUZZ_MAX_TOTAL_TOKENS = MAX_INPUT_TOKENS + 32
FUZZ_FLAGS = (*ROUTER_FLAGS, "--max-total-tokens", str(FUZZ_MAX_TOTAL_TOKENS))  # the last one counts


@pytest.fixture(scope="module")
def router(tiny_llama: Path) -> Iterator[RouterProcess]:
    """The shared router's flags (conftest `router`) but FUZZ_MAX_TOTAL_TOKENS; the test checks that it applied."""
    with ShardProcess(tiny_llama) as shard:
        with RouterProcess(shard.socket, tiny_llama, FUZZ_FLAGS) as proc:
            yield proc


def fuzz(operation: schemathesis.APIOperation) -> None:
    valid, invalid = (operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE))

    @given(case=st.one_of(valid, invalid))
    @settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    def one_request(case: schemathesis.Case) -> None:
        case.call_and_validate(headers=HEADERS, checks=CHECKS, timeout=60)

    one_request()
    if operation.method.upper() == "POST":
        for edge in EDGE_CASES:
            case = operation.Case(**edge)
            case.validate_response(case.call(headers=HEADERS, timeout=60), checks=CHECKS)


def test_every_response_conforms_to_the_spec(router: RouterProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{router.base_url}/api-doc/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 14  # every route of routes.py and openai.py is in the spec
    assert httpx.get(f"{router.base_url}/info", timeout=10).json()["max_total_tokens"] == FUZZ_MAX_TOTAL_TOKENS
    failures: dict[str, BaseException] = {}
    for operation in operations:
        try:
            fuzz(operation)
        except Exception as err:  # every operation is fuzzed; the report names each one that failed
            failures[operation.label] = err
    assert not failures, "\n\n".join(f"{label}:\n{err}" for label, err in failures.items())
