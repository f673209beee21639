"""``GET /openapi.json`` against a real server: it is valid OpenAPI 3.1, it
describes every route the app serves, and a fuzzer driven by it finds no
5xx and no reply outside what it declares."""

from __future__ import annotations

import tempfile
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from openapi_spec_validator import validate
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from lmspd.openapi import OPERATIONS, UndescribedRoute, build_spec, routed_operations

# Examples per operation: enough to cross every body model's branches a few
# times, small enough for a shared 2-core machine.
EXAMPLES_PER_OPERATION = 12


@pytest.fixture(scope="module")
def spec(server) -> dict:
    r = httpx.get(server.url + "/openapi.json", timeout=30)
    assert r.status_code == 200
    return r.json()


def test_the_document_is_valid_openapi_3_1(spec):
    assert spec["openapi"].startswith("3.1")
    validate(spec)


def test_every_route_of_the_app_is_described(spec):
    served = routed_operations(_app_routes())
    assert len(served) > 30
    described = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert set(served) == described
    # Bodies come from the decoders' own models, not a copy.
    body = spec["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CreateResponse"}
    assert "max_output_tokens" in spec["components"]["schemas"]["CreateResponse"]["properties"]


def test_an_undescribed_route_is_refused():
    from starlette.routing import Route

    async def nothing(request):  # pragma: no cover - never called
        ...

    with pytest.raises(UndescribedRoute, match="GET /v1/secret"):
        build_spec([Route("/v1/secret", nothing, methods=["GET"])])
    assert ("GET", "/v1/secret") not in OPERATIONS


def operation_keys() -> list[str]:
    """Every operation the document describes (built in process: the
    parametrize list is needed before the server starts)."""
    return [f"{m} {p}" for m, p in routed_operations(_app_routes())]


def _app_routes() -> list:
    """The app's routes, built in process with a data dir of its own: the
    default (~/.lmspd) is the user's, and two test workers collect this
    module at the same time."""
    from lmspd.app import build_app
    from lmspd.config import Settings
    from lmspd.core.limits import DEFAULT_LIMITS
    from lmspd.service import Service

    with tempfile.TemporaryDirectory(prefix="lmspd-test-openapi-") as data_dir:
        return list(build_app(Settings(data_dir=Path(data_dir)), Service(DEFAULT_LIMITS), None).routes)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def api(server, spec):
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.update(base_url=server.url)
    return schema


@pytest.mark.parametrize("key", operation_keys())
def test_fuzzed_requests_get_declared_replies_and_no_5xx(api, key):
    method, path = key.split(" ", 1)
    operation = api[path][method]

    @given(operation.as_strategy())
    @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                       response_schema_conformance], timeout=60)

    fuzz()
