"""What the API says of itself (issue 37): a 405 names every method of the path, and the OpenAPI schema states
the rules the server enforces (a TP degree is a power of two)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from toposched.service.app import create_app
from toposched.service.config import ServiceConfig
from toposched.service.state import ServiceState
from toposched.topology.sources import SourceRef


def _client() -> TestClient:
    config = ServiceConfig(state="memory", source=SourceRef(kind="preset", ref="hgx-h100"), auth=False)
    return TestClient(create_app(config, ServiceState(config)))


def test_a_405_lists_every_method_of_the_path() -> None:
    """GET and POST /v1/placements are two routes: Starlette's Allow named the first one's only."""
    with _client() as client:
        for path, methods in (
            ("/v1/placements", "GET, POST"),
            ("/v1/placements/x", "DELETE, GET"),
            ("/v1/placements/x/renew", "POST"),
            ("/healthz", "GET"),
        ):
            answer = client.options(path)
            assert answer.status_code == 405 and answer.headers["allow"] == methods, path
            assert f"it takes {methods}" in answer.json()["detail"]
        assert client.put("/v1/placements").headers["allow"] == "GET, POST"


def test_the_schema_states_that_a_tp_degree_is_a_power_of_two() -> None:
    with _client() as client:
        spec = client.get("/openapi.json").json()
        body = spec["components"]["schemas"]["PlaceBody"]["properties"]["allowed_tp"]
        (array,) = [s for s in body["anyOf"] if s.get("type") == "array"]
        assert array["items"]["enum"] == [1 << k for k in range(17)]
        refused = client.post("/v1/placements", json={"model": "llama-3.1-8b", "allowed_tp": [3]})
        assert refused.status_code == 422 and "powers of two" in refused.text


def test_the_schema_states_the_limits_the_server_checks() -> None:
    """schemathesis (positive data, 100 examples a route) found two rules only the server knew: the queue wait
    this replica allows (its --max-wait, 60 s by default, where the schema said 3,600) and what a placement id
    is (the defrag finish call accepted '' and 199 characters by the schema)."""
    import re

    from toposched.names import placement_id_problem

    with _client() as client:
        spec = client.get("/openapi.json").json()
        schemas = spec["components"]["schemas"]
        assert schemas["PlaceBody"]["properties"]["wait_s"]["maximum"] == 60.0
        finish = schemas["FinishMoveBody"]["properties"]["placement_id"]
        pattern = re.compile(finish["pattern"])
        for value in ("plan", "plan-0", "a" * 120, "a" * 119 + "-12345", "", "-x", "a" * 121, "a b", "x/y"):
            by_schema = bool(pattern.fullmatch(value)) and finish["minLength"] <= len(value) <= finish["maxLength"]
            assert by_schema == (placement_id_problem(value) is None), value
        late = client.post("/v1/placements", json={"model": "llama-3.1-8b", "wait_s": 61})
        assert late.status_code == 422 and "at most 60 s" in late.text
