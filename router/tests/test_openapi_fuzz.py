"""A bounded property-based fuzz of the HTTP API, generated from the router's own OpenAPI spec (schemathesis),
against the shared real router + shard (conftest `router`). Every operation gets a fixed number of generated
requests, valid and invalid; each response must be no 5xx and must conform to the spec: a documented status,
content type and body schema. A failure means the server or openapi_spec.py is wrong; fix that rather than
loosen the checks. Derandomized, so a run is the same run every time.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from router_fixtures import API_KEY, RouterProcess
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES_PER_OPERATION = 12
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def api_schema(router: RouterProcess) -> schemathesis.BaseSchema:
    return schemathesis.openapi.from_url(f"{router.base_url}/api-doc/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_every_response_conforms_to_the_spec(case: schemathesis.Case) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {API_KEY}"}, checks=CHECKS, timeout=60)
