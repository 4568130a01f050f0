"""The HTTP API against a real ``toposched serve`` (uvicorn) on a SQLite state file."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.service.conftest import AUTH, Server

NINE = (
    "toposched_nvlink_affinity_ratio",
    "toposched_cross_domain_traffic_budget_ratio",
    "toposched_hbm_utilization_ratio",
    "toposched_placements_by_tp",
    "toposched_sidecar_drift_ratio",
    "toposched_cross_domain_compression_ratio",
    "toposched_comm_overlap_ratio",
    "toposched_migration_ratio",
    "toposched_cross_domain_p99_gap_seconds",
)


def samples(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith((name + " ", name + "{"))]


def place(server: Server, **body: Any) -> httpx.Response:
    return server.client.post("/v1/placements", json={"model": "llama-3.1-8b", "replicas": 1, **body})


def test_contract_place_without_token_delete_and_metrics(sqlite_server: Server) -> None:
    body = {"model": "llama-3.1-8b", "replicas": 1}
    denied = httpx.post(f"{sqlite_server.url}/v1/placements", json=body)
    assert denied.status_code == 401
    assert denied.headers["www-authenticate"].startswith("Bearer")
    wrong = httpx.post(f"{sqlite_server.url}/v1/placements", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401

    made = httpx.post(f"{sqlite_server.url}/v1/placements", json=body, headers=AUTH)
    assert made.status_code in (200, 201), made.text
    placement = made.json()
    assert placement["id"] and placement["ranks"]
    assert {"node", "gpu", "rank"} <= set(placement["ranks"][0])

    gone = httpx.delete(f"{sqlite_server.url}/v1/placements/{placement['id']}", headers=AUTH)
    assert gone.status_code == 200
    assert gone.json()["released"] == [placement["id"]]
    assert sqlite_server.client.get(f"/v1/placements/{placement['id']}").status_code == 404

    metrics = httpx.get(f"{sqlite_server.url}/metrics", headers=AUTH)
    assert metrics.status_code == 200
    for name in NINE:
        assert f"# TYPE {name} gauge" in metrics.text, name
    assert httpx.get(f"{sqlite_server.url}/metrics").status_code == 401


def test_a_body_is_read_as_json_whatever_its_content_type(sqlite_server: Server) -> None:
    form = {**AUTH, "Content-Type": "application/x-www-form-urlencoded"}  # what `curl -d` sends
    body = json.dumps({"model": "llama-3.1-8b", "id": "curl-1"})
    made = httpx.post(f"{sqlite_server.url}/v1/placements", content=body, headers=form)
    assert made.status_code == 201, made.text
    assert sqlite_server.client.delete("/v1/placements/curl-1").status_code == 200


def test_only_health_endpoints_and_the_page_shell_are_open(sqlite_server: Server) -> None:
    for path in ("/healthz", "/readyz", "/ui/", "/ui/app.js"):
        assert httpx.get(sqlite_server.url + path).status_code == 200, path
    for path in ("/v1/placements", "/v1/topology", "/v1/queue", "/v1/alerts", "/openapi.json", "/metrics"):
        assert httpx.get(sqlite_server.url + path).status_code == 401, path


def test_idempotent_by_id_and_conflict_on_other_body(sqlite_server: Server) -> None:
    first = place(sqlite_server, id="idem-1")
    again = place(sqlite_server, id="idem-1")
    other = place(sqlite_server, id="idem-1", concurrent_seqs=64)
    try:
        assert first.status_code == 201
        assert again.status_code == 200
        assert again.json()["ranks"] == first.json()["ranks"]
        assert other.status_code == 409
        assert "idem-1" in other.json()["reasons"][0]
        listed = sqlite_server.client.get("/v1/placements").json()["placements"]
        assert [p["id"] for p in listed].count("idem-1") == 1
    finally:
        sqlite_server.client.delete("/v1/placements/idem-1")


def test_validation_errors_name_the_field(sqlite_server: Server) -> None:
    bad = place(sqlite_server, replicas=0)
    assert bad.status_code == 422
    assert [f["field"] for f in bad.json()["fields"]] == ["body.replicas"]
    unknown = sqlite_server.client.post("/v1/placements", json={"model": "llama-3.1-8bb"})
    assert unknown.status_code == 422
    assert unknown.json()["fields"][0]["field"] == "body.model"
    assert "llama-3.1-8b" in unknown.json()["fields"][0]["message"]
    path = sqlite_server.client.post("/v1/placements", json={"model": "/etc/passwd"})
    assert path.status_code == 422  # catalog names only: no files read over HTTP
    extra = place(sqlite_server, colour="red")
    assert extra.status_code == 422 and extra.json()["fields"][0]["field"] == "body.colour"
    assert sqlite_server.client.get("/v1/placements/..%2Fx").status_code in (404, 422)


def test_body_over_the_limit_is_413(sqlite_server: Server) -> None:
    big = {"model": "llama-3.1-8b", "node_selector": {f"k{i}": "v" * 100 for i in range(1000)}}
    response = sqlite_server.client.post("/v1/placements", json=big)
    assert response.status_code == 413
    assert response.json() == {"error": "body too large", "detail": "at most 65536 bytes"}


def test_a_streamed_body_over_the_limit_is_413_too(sqlite_server: Server) -> None:
    def chunks(kib: int) -> Iterator[bytes]:  # no Content-Length: Transfer-Encoding: chunked
        yield b'{"model": "llama-3.1-8b", "id": "'
        for _ in range(kib):
            yield b"x" * 1024

    for path in ("/v1/placements", "/v1/reports", "/v1/placements/a/renew", "/v1/extender/prioritize"):
        kib = 1100 if "/extender/" in path else 80  # the extender takes up to 1 MiB (node lists)
        response = sqlite_server.client.post(path, content=chunks(kib))
        assert response.status_code == 413, (path, response.text)
        assert response.json()["error"] == "body too large"
        assert response.headers["connection"] == "close"


def test_bodies_that_are_not_json_and_unknown_routes_answer_in_the_error_format(sqlite_server: Server) -> None:
    for body in (b"\xff\xfe\xfd", b"{", b"[1, 2"):
        response = sqlite_server.client.post("/v1/placements", content=body)
        assert response.status_code == 422, response.text
        assert response.json()["fields"][0]["field"] == "body"
    missing = sqlite_server.client.get("/v1/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"] == "not found"
    wrong = sqlite_server.client.put("/v1/queue")
    assert wrong.status_code == 405 and wrong.json()["error"] == "method not allowed"
    assert wrong.headers["allow"] == "GET"


def test_renew_extends_the_lease(sqlite_server: Server) -> None:
    made = place(sqlite_server, id="lease-1", ttl_s=30)
    try:
        assert made.status_code == 201
        first = made.json()["expires_at"]
        assert first is not None
        renewed = sqlite_server.client.post("/v1/placements/lease-1/renew", json={"ttl_s": 3600})
        assert renewed.status_code == 200
        assert renewed.json()["expires_at"] > first + 3000
        assert sqlite_server.client.post("/v1/placements/nope/renew", json={"ttl_s": 5}).status_code == 404
        assert sqlite_server.client.post("/v1/placements/lease-1/renew", json={"ttl_s": -1}).status_code == 422
    finally:
        sqlite_server.client.delete("/v1/placements/lease-1")


def test_full_cluster_answers_409_then_a_waiting_request_is_served_on_release(sqlite_server: Server) -> None:
    whole = place(sqlite_server, id="whole", model="llama-3.1-70b", allowed_tp=[8])
    assert whole.status_code == 201, whole.text
    try:
        full = place(sqlite_server, id="late")
        assert full.status_code == 409
        assert full.json()["status"] == "no-capacity" and full.json()["reasons"]
        got: dict[str, httpx.Response] = {}
        waiter = threading.Thread(target=lambda: got.setdefault("r", place(sqlite_server, id="waiter", wait_s=30)))
        waiter.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            queued = sqlite_server.client.get("/v1/queue").json()
            if queued["depth"]:
                break
            time.sleep(0.05)
        assert [i["id"] for i in queued["items"]] == ["waiter"]
        assert sqlite_server.client.delete("/v1/placements/whole").status_code == 200
        waiter.join(30)
        assert got["r"].status_code == 201, got["r"].text
        assert sqlite_server.client.get("/v1/queue").json()["depth"] == 0
    finally:
        for pid in ("whole", "waiter"):
            sqlite_server.client.delete(f"/v1/placements/{pid}")


def test_waiting_request_times_out_and_leaves_the_queue(sqlite_server: Server) -> None:
    whole = place(sqlite_server, id="whole-2", model="llama-3.1-70b", allowed_tp=[8])
    assert whole.status_code == 201
    try:
        late = place(sqlite_server, id="late-2", wait_s=0.5)
        assert late.status_code == 409
        assert "waited" in late.json()["reasons"][0]
        assert sqlite_server.client.get("/v1/queue").json()["depth"] == 0
    finally:
        sqlite_server.client.delete("/v1/placements/whole-2")


def test_metrics_have_samples_only_where_there_is_a_source(sqlite_server: Server) -> None:
    made = place(sqlite_server, id="m-1", allowed_tp=[2])
    try:
        assert made.status_code == 201
        text = sqlite_server.client.get("/metrics").text
        assert samples(text, "toposched_nvlink_affinity_ratio") == ["toposched_nvlink_affinity_ratio 1.0"]
        assert samples(text, "toposched_placements_by_tp") == ['toposched_placements_by_tp{tp="2"} 1.0']
        hbm = float(samples(text, "toposched_hbm_utilization_ratio")[0].split()[1])
        assert 0 < hbm < 1
        for absent in ("toposched_comm_overlap_ratio", "toposched_cross_domain_p99_gap_seconds"):
            assert samples(text, absent) == [], absent
        assert samples(text, "toposched_cross_domain_compression_ratio") == []  # no cross-domain traffic
        assert 'toposched_decisions_total{outcome="placed"}' in text
        assert "toposched_decision_seconds_bucket" in text
        assert 'toposched_queue_depth{slo_class="batch"} 0.0' in text
    finally:
        sqlite_server.client.delete("/v1/placements/m-1")


def test_topology_shows_the_domain_and_who_holds_each_gpu(sqlite_server: Server) -> None:
    made = place(sqlite_server, id="topo-1", allowed_tp=[4])
    try:
        topo = sqlite_server.client.get("/v1/topology").json()
        assert topo["gpus"] == 8 and topo["free"] == 4
        (domain,) = topo["domains"]
        assert domain["used"] == 4 and domain["occupancy"] == 0.5
        held = {g["ref"] for n in topo["nodes"] for g in n["gpus"] if g["placement"] == "topo-1"}
        assert held == {f"{r['node']}/{r['gpu']}" for r in made.json()["ranks"]}
        refreshed = sqlite_server.client.post("/v1/topology/refresh")
        assert refreshed.status_code == 200 and refreshed.json()["version"] >= 1
    finally:
        sqlite_server.client.delete("/v1/placements/topo-1")


def test_sidecar_report_marks_degraded_and_proposes_a_move(sqlite_server: Server) -> None:
    made = place(sqlite_server, id="rep-1", allowed_tp=[2])
    assert made.status_code == 201
    gpu = "{node}/{gpu}".format(**made.json()["ranks"][0])
    alert = {"kind": "TOPOLOGY_DRIFT", "gpu": gpu, "subject": "nvlink", "observed": 0, "expected": 18}
    try:
        report = sqlite_server.client.post(
            "/v1/reports", json={"placement": "rep-1", "node": "hgx-h100", "cycle": 1, "active_alerts": [alert]}
        )
        assert report.status_code == 200, report.text
        reaction = report.json()
        assert reaction["status"] == "degraded" and reaction["drifted_gpus"] == [gpu]
        assert reaction["proposal"] is not None and gpu not in reaction["proposal"]["gpus"]
        assert sqlite_server.client.get("/v1/placements/rep-1").json()["status"] == "degraded"
        text = sqlite_server.client.get("/metrics").text
        assert samples(text, "toposched_sidecar_drift_ratio") and samples(text, "toposched_migration_ratio")
        missing = sqlite_server.client.post("/v1/reports", json={"placement": "nope", "active_alerts": []})
        assert missing.status_code == 404
    finally:
        sqlite_server.client.delete("/v1/placements/rep-1")


def test_openapi_lists_the_api(sqlite_server: Server) -> None:
    spec = sqlite_server.client.get("/openapi.json").json()
    for path in ("/v1/placements", "/v1/placements/{pid}", "/v1/placements/{pid}/renew", "/v1/topology",
                 "/v1/topology/refresh", "/v1/queue", "/v1/extender/filter", "/v1/extender/prioritize",
                 "/healthz", "/readyz", "/metrics"):  # fmt: skip
        assert path in spec["paths"], path


def test_openapi_documents_the_errors_each_route_can_answer(sqlite_server: Server) -> None:
    spec = sqlite_server.client.get("/openapi.json").json()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            answers = operation["responses"]
            if path.startswith("/v1/"):
                assert {"401", "503"} <= set(answers), (method, path)
            if path == "/v1/extender/filter":  # a malformed body is a 200 with Error set (kube-scheduler's contract)
                assert "413" in answers and "422" not in answers
            elif "requestBody" in operation:
                assert {"413", "422"} <= set(answers), (method, path)
            for code, answer in answers.items():
                if code >= "400" and path not in ("/readyz", "/v1/placements") and "/extender/" not in path:
                    ref = answer["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorOut"), (method, path, code)
    assert "WWW-Authenticate" in spec["paths"]["/v1/queue"]["get"]["responses"]["401"]["headers"]
    assert "Retry-After" in spec["paths"]["/v1/placements"]["post"]["responses"]["429"]["headers"]


@pytest.mark.parametrize("replicas", [2])
def test_several_replicas_all_or_none(sqlite_server: Server, replicas: int) -> None:
    made = place(sqlite_server, id="multi", replicas=replicas, allowed_tp=[4])
    try:
        assert made.status_code == 201
        group = made.json()
        assert [i["id"] for i in group["instances"]] == ["multi-0", "multi-1"]
        assert len({(r["node"], r["gpu"]) for r in group["ranks"]}) == 8
        too_many = place(sqlite_server, id="more", allowed_tp=[4])
        assert too_many.status_code == 409
        assert sqlite_server.client.get("/v1/topology").json()["free"] == 0
    finally:
        sqlite_server.client.delete("/v1/placements/multi")
    assert sqlite_server.client.get("/v1/topology").json()["free"] == 8


def test_same_fields_different_ids_each_answer_carries_its_own_id(sqlite_server: Server) -> None:
    # issue 12: the candidate cache is shared by requests with equal fields; it leaked the first one's id
    fields = {"model": "llama-3.1-8b", "replicas": 1, "allowed_tp": [2], "concurrent_seqs": 4}
    answers: dict[str, httpx.Response] = {}

    def post(rid: str) -> None:
        with httpx.Client(base_url=sqlite_server.url, headers=AUTH, timeout=30) as client:
            answers[rid] = client.post("/v1/placements", json={**fields, "id": rid})

    threads = [threading.Thread(target=post, args=(rid,)) for rid in ("twin-a", "twin-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for rid, answer in answers.items():
            assert answer.status_code == 201, answer.text
            data = answer.json()
            assert data["id"] == rid
            assert [i["request_id"] for i in data["instances"]] == [rid]
            assert [i["id"] for i in data["instances"]] == [rid]
            again = sqlite_server.client.get(f"/v1/placements/{rid}").json()
            assert again["instances"][0]["request_id"] == rid
    finally:
        for rid in ("twin-a", "twin-b"):
            sqlite_server.client.delete(f"/v1/placements/{rid}")


def test_a_client_that_goes_away_while_waiting_leaves_the_queue_and_books_nothing(sqlite_server: Server) -> None:
    whole = place(sqlite_server, id="whole-3", model="llama-3.1-70b", allowed_tp=[8])
    assert whole.status_code == 201
    try:
        body = {"model": "llama-3.1-8b", "id": "gone", "wait_s": 30}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.5 s and closes its connection
            url, headers = f"{sqlite_server.url}/v1/placements", sqlite_server.client.headers
            httpx.post(url, json=body, headers=headers, timeout=0.5)
        deadline = time.monotonic() + 10
        while sqlite_server.client.get("/v1/queue").json()["depth"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sqlite_server.client.get("/v1/queue").json()["depth"] == 0  # out of the queue, not waiting 30 s
        assert sqlite_server.client.delete("/v1/placements/whole-3").status_code == 200
        time.sleep(0.3)  # a request still queued would be placed by the release
        assert sqlite_server.client.get("/v1/placements/gone").status_code == 404
    finally:
        for pid in ("whole-3", "gone"):
            sqlite_server.client.delete(f"/v1/placements/{pid}")


def test_a_retry_of_a_placed_request_is_answered_at_once_while_others_wait(sqlite_server: Server) -> None:
    """Another request waits in the queue: a retry of one already placed (same id, same body, wait_s) gets
    its placement (200), and another body under that id a conflict (409), not a wait and a no-capacity."""
    mine = place(sqlite_server, id="mine", allowed_tp=[4])
    big = place(sqlite_server, id="big", model="llama-3.1-70b", allowed_tp=[4])
    assert (mine.status_code, big.status_code) == (201, 201)
    got: dict[str, httpx.Response] = {}
    wait = {"id": "w", "model": "llama-3.1-70b", "allowed_tp": [8], "wait_s": 20}  # waits longer than the retries
    waiter = threading.Thread(target=lambda: got.setdefault("r", place(sqlite_server, **wait)))
    waiter.start()
    try:
        deadline = time.monotonic() + 10
        while not sqlite_server.client.get("/v1/queue").json()["depth"] and time.monotonic() < deadline:
            time.sleep(0.05)
        again = place(sqlite_server, id="mine", allowed_tp=[4], wait_s=5)
        assert again.status_code == 200 and again.json()["id"] == "mine", again.text
        other = place(sqlite_server, id="mine", allowed_tp=[2], wait_s=5)
        assert other.status_code == 409 and other.json()["status"] == "conflict", other.text
    finally:
        for pid in ("mine", "big"):
            sqlite_server.client.delete(f"/v1/placements/{pid}")
        waiter.join(20)  # placed once both are gone
        sqlite_server.client.delete("/v1/placements/w")


def test_a_request_rate_books_the_replicas_that_serve_it_and_an_slo_miss_is_refused(sqlite_server: Server) -> None:
    """Issue 32: ``request_rate`` sizes the instances (each at its operating point); a required SLO that no
    option meets is a 422 with the change that would meet it, and books nothing."""
    body = {"model": "llama-3.1-8b", "slo_tpot_ms": 40, "request_rate": 15, "id": "rated"}
    made = sqlite_server.client.post("/v1/placements", json=body)
    assert made.status_code == 201, made.text
    group = made.json()
    served = sum(i["served_rps"] for i in group["instances"])
    assert served >= 15 and group["replicas"] == len(group["instances"]) >= 1
    assert all(i["max_num_seqs"] > 8 for i in group["instances"])
    again = sqlite_server.client.post("/v1/placements", json=body)  # the same body sizes the same: idempotent
    assert again.status_code == 200 and again.json()["id"] == "rated"
    assert sqlite_server.client.delete("/v1/placements/rated").status_code == 200
    missed = sqlite_server.client.post("/v1/placements", json={"model": "llama-3.1-70b", "slo_tpot_ms": 4})
    assert missed.status_code == 422, missed.text
    assert "misses the SLO" in " ".join(missed.json()["reasons"])
    bad = sqlite_server.client.post("/v1/placements", json={**body, "replicas": 2})
    assert bad.status_code == 422 and "request_rate" in bad.text
    assert sqlite_server.client.get("/v1/placements").json()["placements"] == []


def test_the_idempotency_key_carries_no_solver_only_field() -> None:
    """A body's key is what the client can send: the roles of pd are the service's own (``serving_role``)."""
    from toposched.service.request import ServiceRequest

    key = ServiceRequest(model="llama-3.1-8b").key()
    assert "serving_role" not in key and "request_rate" not in key and "slo_required" not in key
    assert "request_rate" in ServiceRequest(model="llama-3.1-8b", request_rate=3).key()
    with pytest.raises(ValueError, match="serving_role is set by the service"):
        ServiceRequest(model="llama-3.1-8b", serving_role="decode")
