"""Fuzz the gateway's OpenAPI schema with schemathesis: whatever it sends, never a 5xx.

The gateway runs for real (uvicorn in a thread, its whole lifespan) in front of the canned
vLLM-shaped upstream, so valid completions succeed and everything else must be a 4xx envelope.
Schemathesis generates bodies from the request schemas the routes publish (valid and invalid ones)
plus its own edge cases for headers and paths.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings

from bench.upstream import running
from flywheel.settings import load_settings
from serving.gateway.app import create_app
from testbed.procs import free_port
from tests.fixtures.roles import served_app

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway_url(tmp_path_factory):
    port = free_port()
    with running(port):
        settings = load_settings(
            data_dir=str(tmp_path_factory.mktemp("fuzz")),
            bus={"kind": "local", "partitions": 1, "topic_prefix": "fuzz."},
            gateway={"upstream": f"http://127.0.0.1:{port}", "max_body_bytes": 65_536},
        )
        with served_app(create_app(settings)) as url:
            yield url


def test_no_input_makes_the_gateway_fail(gateway_url):
    # The schemathesis pytest plugin predates pytest 9; drive its strategies with hypothesis directly.
    schema = schemathesis.openapi.from_url(f"{gateway_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/v1/feedback", "/v1/models"}
    seen: dict[str, dict[int, int]] = {}
    for operation in operations:

        @given(case=operation.as_strategy())
        @hypothesis_settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(timeout=30)
            counts = seen.setdefault(f"{case.method} {case.path}", {})
            counts[response.status_code] = counts.get(response.status_code, 0) + 1
            assert response.status_code < 500, (case.method, case.path, response.status_code, response.text[:500])
            if response.status_code >= 400:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"]

        check()
    # The generator reached the upstream, not only the validators.
    assert seen["POST /v1/chat/completions"].get(200, 0) > 0, seen
