"""HTTP targets: the service's request bodies and the kube-scheduler extender, in-process.

One app (``create_app``, memory ledger, a two-node HGX H100 cluster) serves every case of a target
through Starlette's ``TestClient`` with ``raise_server_exceptions=True``: an exception inside a
handler escapes to the harness with its traceback, and any 5xx answer is a ``ServerError``. A
placement that succeeds is released again so the cluster stays free; ``fuzz-a`` (two replicas) is
kept placed so reports, renewals and the extender's placement label find something.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import quote

import yaml
from hypothesis import strategies as st

from tests.fuzz import seeds
from tests.fuzz.harness import Case, ServerError, Target
from tests.fuzz.mutate import HOSTILE_NAMES
from tests.fuzz.targets import Docs, doc_cases, doc_seeds, register

_STATE: dict[str, Any] = {}


def _start() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fastapi.testclient import TestClient

    from toposched.service.app import create_app
    from toposched.service.config import ServiceConfig
    from toposched.topology.sources import SourceRef

    tmp = tempfile.TemporaryDirectory()
    spec = Path(tmp.name) / "cluster.yaml"
    spec.write_text(yaml.safe_dump(seeds.TWO_NODE_SPEC))
    config = ServiceConfig(
        state="memory",
        source=SourceRef(kind="cluster", ref=str(spec)),
        auth=False,
        max_wait_s=0.2,
        follow_interval_s=60,
    )
    client = TestClient(create_app(config), raise_server_exceptions=True)
    client.__enter__()
    _STATE.update(tmp=tmp, client=client)


def _stop() -> None:
    client = _STATE.pop("client", None)
    if client is not None:
        client.__exit__(None, None, None)
    tmp = _STATE.pop("tmp", None)
    if tmp is not None:
        tmp.cleanup()


def _client() -> Any:
    if "client" not in _STATE:
        _start()
    return _STATE["client"]


def _judge(response: Any) -> None:
    if response.status_code >= 500:
        raise ServerError(response.status_code, response.text)


def _keep_fuzz_a(client: Any) -> None:
    if client.get("/v1/placements/fuzz-a").status_code == 404:
        _judge(client.post("/v1/placements", json=seeds.PLACE_BODIES[1]))


def _send(method: str, path: str, body: bytes | None) -> Any:
    client = _client()
    headers = {"content-type": "application/json"} if body is not None else {}
    try:
        response = client.request(method, path, content=body, headers=headers)
    except BaseException:
        _stop()  # a handler that blew up (or was interrupted) may hold the state lock: start afresh
        raise
    _judge(response)
    return response


def run_place(case: Case, folder: Path) -> None:
    response = _send("POST", "/v1/placements", case.data)
    if response.status_code in (200, 201):
        pid = response.json().get("id", "")
        if pid and pid != "fuzz-a":
            _send("DELETE", f"/v1/placements/{quote(str(pid), safe='')}", None)


def run_extender(case: Case, folder: Path) -> None:
    _keep_fuzz_a(_client())
    _send("POST", f"/v1/extender/{case.arg or 'filter'}", case.data)


def run_api(case: Case, folder: Path) -> None:
    _keep_fuzz_a(_client())
    method, path = json.loads(case.arg)
    _send(method, path, case.data if method == "POST" else None)


def _place_docs() -> Docs:
    return [(f"place-{i}", body, ()) for i, body in enumerate(seeds.PLACE_BODIES)]


def _extender_docs() -> Docs:
    return [(f"extender-{i}", body, ()) for i, body in enumerate(seeds.EXTENDER_BODIES)]


def _extender_cases() -> st.SearchStrategy[Case]:
    verbs = st.sampled_from(["filter", "prioritize"])
    return st.builds(
        lambda c, v: Case(c.data, c.name, c.extras, v, c.seed),
        doc_cases(_extender_docs, "json", lambda _: "body.json")(),
        verbs,
    )


API_PATHS: tuple[tuple[str, str], ...] = (
    ("POST", "/v1/reports"),
    ("POST", "/v1/placements/{}/renew"),
    ("GET", "/v1/placements/{}"),
    ("DELETE", "/v1/placements/{}"),
    ("POST", "/v1/defrag"),
    ("POST", "/v1/defrag/finish"),
)


def _api_cases() -> st.SearchStrategy[Case]:
    docs = [(f"report-{i}", b, ()) for i, b in enumerate(seeds.REPORT_BODIES)] + [("renew", {"ttl_s": 30}, ())]
    ids = st.one_of(st.sampled_from(["fuzz-a", "fuzz-a-0", "fuzz-a-1", "nobody", *HOSTILE_NAMES]), st.text(max_size=16))

    @st.composite
    def case(draw: Any) -> Case:
        body = draw(doc_cases(lambda: docs, "json", lambda _: "body.json")())
        method, template = draw(st.sampled_from(API_PATHS))
        path = template.format(quote(draw(ids), safe="")) if "{}" in template else template
        return Case(body.data, body.name, (), json.dumps([method, path]), body.seed)

    return case()


def _api_seeds() -> list[Case]:
    reports = [json.dumps(b).encode() for b in seeds.REPORT_BODIES]
    return [
        Case(reports[0], "body.json", (), json.dumps(["POST", "/v1/reports"])),
        Case(reports[1], "body.json", (), json.dumps(["POST", "/v1/reports"])),
        Case(b'{"ttl_s": 30}', "body.json", (), json.dumps(["POST", "/v1/placements/fuzz-a/renew"])),
        Case(b"", "body.json", (), json.dumps(["GET", "/v1/placements/fuzz-a-0"])),
    ]


register(
    Target(
        "service-place",
        "POST /v1/placements (PlaceBody)",
        cases=doc_cases(_place_docs, "json", lambda _: "body.json"),
        seeds=doc_seeds(_place_docs, lambda _: "body.json"),
        run=run_place,
        allowed=(),
        brief_examples=40,
        setup=_start,
        teardown=_stop,
    )
)
register(
    Target(
        "service-extender",
        "POST /v1/extender/filter, /prioritize (ExtenderArgs)",
        cases=_extender_cases,
        seeds=lambda: [
            Case(c.data, c.name, c.extras, v, c.seed)
            for c in doc_seeds(_extender_docs, lambda _: "body.json")()
            for v in ("filter", "prioritize")
        ],
        run=run_extender,
        allowed=(),
        brief_examples=40,
        setup=_start,
        teardown=_stop,
    )
)
register(
    Target(
        "service-api",
        "POST /v1/reports, renew, GET/DELETE /v1/placements/{id}",
        cases=_api_cases,
        seeds=_api_seeds,
        run=run_api,
        allowed=(),
        brief_examples=30,
        setup=_start,
        teardown=_stop,
    )
)
