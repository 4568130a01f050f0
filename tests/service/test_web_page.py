"""The web page under a real pointer: headless Chromium driven over the DevTools protocol (real mouse events,
screenshots), against real ``toposched serve`` processes.

* hover over a placement's tile highlights the NVLink domains it spans; a click pins them (and the GPUs);
  clicking it again, or anywhere that is not a control, unpins;
* the signal charts show what the service sampled before the page opened (``/v1/signals/history``);
* at 16,384 GPUs the overview draws one cell per NVLink domain, shaded by the share held, instead of tiles.

No wall-clock assertion: waits poll the page until what it must show is there (or fail after a minute).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from PIL import Image

from tests.service.conftest import TOKEN, Server, StartServer
from tests.service.test_web import FREE

HIGHLIGHT = (9, 105, 218)  # .domain.spanned's ring in style.css
HELD_ALL = (45, 51, 59)  # app.js: a domain cell with every GPU held
WAIT_S = 60.0


class Page:
    """One headless Chromium tab, driven over the DevTools protocol (aiohttp's websocket client)."""

    def __init__(self, profile: Path, size: tuple[int, int] = (1280, 1000)) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        if binary is None:
            pytest.fail("chromium is not installed: `make system-deps` or `apt-get install -y chromium`", pytrace=False)
        flags = [
            "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--hide-scrollbars", "--remote-debugging-port=0",
            f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
        ]  # fmt: skip
        self.proc = subprocess.Popen([binary, *flags, "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + WAIT_S
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                pytest.fail("chromium gave no DevTools port", pytrace=False)
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        self.loop = asyncio.new_event_loop()
        self.session = self.loop.run_until_complete(self._session())
        self.ws = self.loop.run_until_complete(self.session.ws_connect(url, max_msg_size=0))
        self.seq = 0

    async def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession()

    async def _call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.seq += 1
        await self.ws.send_str(json.dumps({"id": self.seq, "method": method, "params": params}))
        while True:
            message = json.loads((await self.ws.receive(timeout=WAIT_S)).data)
            if message.get("id") == self.seq:
                if "error" in message:
                    raise AssertionError(f"{method}: {message['error']}")
                result: dict[str, Any] = message["result"]
                return result

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self.loop.run_until_complete(self._call(method, params))

    def js(self, expression: str) -> Any:
        answer = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in answer, answer["exceptionDetails"]
        return answer["result"].get("value")

    def wait(self, expression: str) -> Any:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"the page never showed {expression}; status: {self.js(STATUS)}")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait("document.body && document.body.dataset.loaded === 'yes'")
        assert self.js("document.body.dataset.errors || ''") == ""

    def centre(self, selector: str) -> tuple[float, float]:
        """The centre of the first element ``selector`` finds, scrolled into the window."""
        found = self.js(
            f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
            " e.scrollIntoView({block: 'center', inline: 'center'}); const r = e.getBoundingClientRect();"
            " return [r.left + r.width / 2, r.top + r.height / 2]; })()"
        )
        assert found, f"nothing on the page matches {selector}"
        return float(found[0]), float(found[1])

    def hover(self, selector: str) -> None:
        x, y = self.centre(selector)
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def click(self, selector: str) -> None:
        x, y = self.centre(selector)
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def pixels(self, shot: Path) -> Counter[tuple[int, int, int]]:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        shot.write_bytes(base64.b64decode(data))
        print(f"web page screenshot: {shot}")
        return Counter({rgb: n for n, rgb in Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 22) or []})

    def close(self) -> None:
        self.loop.run_until_complete(self.ws.close())
        self.loop.run_until_complete(self.session.close())
        self.loop.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


STATUS = "document.getElementById('status').textContent"
SPANNED = "[...document.querySelectorAll('#grid .spanned')].map((e) => e.dataset.domain).sort()"
LIT = "[...document.querySelectorAll('#grid .tile.lit')].map((e) => e.dataset.gpu).sort()"
GRID = "document.getElementById('grid').dataset"


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    browser = Page(tmp_path / "profile")
    yield browser
    browser.close()


def link(server: Server) -> str:
    return f"{server.url}/ui/#token={TOKEN}"


def domains_of(server: Server, pid: str) -> list[str]:
    topo = server.client.get("/v1/topology").json()
    return sorted({g["domain"] for n in topo["nodes"] for g in n["gpus"] if g["request"] == pid})


def gpus_of(server: Server, pid: str) -> list[str]:
    return sorted(f"{r['node']}/{r['gpu']}" for r in server.client.get(f"/v1/placements/{pid}").json()["ranks"])


def test_hover_and_click_highlight_the_nvlink_domains_a_placement_spans(
    serve: StartServer, tmp_path: Path, page: Page
) -> None:
    server = serve("--preset", "cluster-32x-hgx-h100", "--state", f"sqlite:{tmp_path / 'state.sqlite3'}")
    two = {"model": "llama-3.1-8b", "id": "two", "allowed_tp": [8], "replicas": 2, "spread_replicas": True}
    assert server.client.post("/v1/placements", json=two).status_code == 201
    assert server.client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "one"}).status_code == 201
    spans_two, spans_one = domains_of(server, "two"), domains_of(server, "one")
    assert len(spans_two) == 2 and len(spans_one) == 1 and not set(spans_one) & set(spans_two)
    page.open(link(server))
    assert page.js(SPANNED) == [] and page.js(f"{GRID}.highlight") == ""
    calm = page.pixels(tmp_path / "calm.png")

    # hover: the two domains of "two" ringed, its GPUs outlined; the ring is in the screenshot
    page.hover("#grid .tile[data-request='two']")
    assert page.wait(f"{GRID}.highlight === 'two'")
    assert page.js(SPANNED) == spans_two and page.js(LIT) == gpus_of(server, "two")
    hovered = page.pixels(tmp_path / "hover-two.png")
    box = page.js("(() => { const r = document.querySelector('#grid .domain').getBoundingClientRect();"
                  " return [r.width, r.height]; })()")  # fmt: skip
    ring = 2 * 3 * 2 * (box[0] + box[1])  # two boxes, a 3 px ring around each
    assert hovered[HIGHLIGHT] - calm[HIGHLIGHT] >= 0.8 * ring, (hovered[HIGHLIGHT], calm[HIGHLIGHT], ring)
    page.hover("#cluster")  # the pointer leaves the grid: nothing pinned, nothing highlighted
    assert page.wait(f"{GRID}.highlight === ''") and page.js(SPANNED) == []

    # click: "one" pinned (its domain, its GPUs marked, its node opened), and it stays when the pointer leaves
    page.click("#grid .tile[data-request='one']")
    assert page.wait(f"{GRID}.pinned === 'one'")
    page.hover("#cluster")
    assert page.wait(f"{GRID}.highlight === 'one'") and page.js(SPANNED) == spans_one
    marked = page.js("[...document.querySelectorAll('#grid .tile.marked')].map((e) => e.dataset.gpu).sort()")
    assert marked == gpus_of(server, "one")
    assert page.js("document.getElementById('node').hidden") is False
    # hovering another placement shows its domains meanwhile; leaving it, the pinned one's again
    page.hover("#grid .tile[data-request='two']")
    assert page.wait(f"{GRID}.highlight === 'two'") and page.js(SPANNED) == spans_two
    page.hover("#cluster")
    assert page.wait(f"{GRID}.highlight === 'one'") and page.js(SPANNED) == spans_one
    assert "placement=one" in page.js("location.hash")

    # clicking it again unpins
    page.click("#grid .tile[data-request='one']")
    page.hover("#cluster")
    assert page.wait(f"{GRID}.pinned === '' && {GRID}.highlight === ''") and page.js(SPANNED) == []
    # pinned from the legend, then a click elsewhere (a heading, no control) unpins
    page.click("#placement-legend li[data-request='two']")
    assert page.wait(f"{GRID}.pinned === 'two'") and page.js(SPANNED) == spans_two
    page.click("#signals")
    assert page.wait(f"{GRID}.pinned === ''")
    page.hover("#cluster")
    assert page.wait(f"{GRID}.highlight === ''") and page.js(SPANNED) == []
    assert page.js("document.body.dataset.errors || ''") == ""


def test_the_charts_show_what_the_service_sampled_before_the_page_opened(
    serve: StartServer, tmp_path: Path, page: Page
) -> None:
    server = serve("--preset", "hgx-h100", "--state", f"sqlite:{tmp_path / 'state.sqlite3'}")
    hbm = "toposched_hbm_utilization_ratio"

    def history() -> list[dict[str, Any]]:
        samples: list[dict[str, Any]] = server.client.get("/v1/signals/history").json()["samples"]
        return samples

    deadline = time.monotonic() + WAIT_S
    while not history() and time.monotonic() < deadline:  # the sample taken as the service starts
        time.sleep(0.2)
    assert [s["signals"][hbm] for s in history()] == [0.0]
    for i, tp in enumerate((4, 2)):
        made = {"model": "llama-3.1-8b", "id": f"h{i}", "allowed_tp": [tp]}
        assert server.client.post("/v1/placements", json=made).status_code == 201
    while len(history()) < 2 and time.monotonic() < deadline:  # the next sample, 10 s after the first
        time.sleep(0.5)
    recorded = history()
    assert len(recorded) >= 2 and recorded[-1]["signals"][hbm] > 0

    page.open(link(server))
    card = f"document.querySelector('[data-signal={hbm}]')"
    assert int(page.js(f"{card}.dataset.recorded")) >= len(recorded)
    points = page.js(f"{card}.querySelector('polyline').getAttribute('points')")
    xy = [tuple(map(float, p.split(","))) for p in points.split()]
    # the service's samples, then the page's own: the first at 0 (the chart's floor, y = 38), later ones above
    assert len(xy) == int(page.js(f"{card}.querySelector('svg').dataset.points")) >= len(recorded) + 1
    assert xy[0][1] == 38.0 and xy[-1][1] < 38.0
    # on a time axis whose right edge is now: the page's own sample there, the service's at their times
    span_s = 60 * int(page.js(f"{card}.querySelector('svg').dataset.spanMin"))
    assert span_s == 300 and 199.0 <= xy[-1][0] <= 200.0  # (the history covers under 5 minutes: the shortest span)
    gap = (recorded[1]["t"] - recorded[0]["t"]) / span_s * 200
    assert xy[1][0] - xy[0][0] == pytest.approx(gap, abs=0.15) and gap > 6
    assert [x for x, _ in xy] == sorted(x for x, _ in xy) and 0 < xy[0][0] < xy[-1][0] - gap
    # placements by TP: the sample before the placements had none (0), the page's latest two
    tp_points = page.js("document.querySelector('[data-signal=toposched_placements_by_tp] polyline')"
                        ".getAttribute('points')")  # fmt: skip
    assert tp_points.split()[0].endswith(",38.0") and not tp_points.split()[-1].endswith(",38.0")


def hgx_racks(tmp_path: Path, racks: int) -> Path:
    """HGX H100 nodes, 32 to a rack (8 GPUs each, one NVLink domain each)."""
    entries = "".join(
        f'  - {{name: "h100-r{r:02d}-{{i:02d}}", count: 32, preset: hgx-h100, rack: rack{r:02d}}}\n'
        for r in range(racks)
    )
    spec = tmp_path / f"hgx-h100-x{racks * 32}.yaml"
    spec.write_text(f"name: hgx-h100-x{racks * 32}\nfabric: {{kind: IB, nic_gbit_per_s: 400}}\nnodes:\n{entries}")
    return spec


def share_colour(share: float) -> tuple[int, int, int]:
    r, g, b = (math.floor(f + (h - f) * share + 0.5) for f, h in zip(FREE, HELD_ALL, strict=True))
    return r, g, b


def test_sixteen_thousand_gpus_show_one_cell_per_nvlink_domain(serve: StartServer, tmp_path: Path, page: Page) -> None:
    server = serve("--cluster", str(hgx_racks(tmp_path, 64)), "--state", f"sqlite:{tmp_path / 'state.sqlite3'}")
    for i, (tp, replicas) in enumerate([(8, 3), (4, 1), (1, 1), (2, 1), (8, 1)]):
        made = {"model": "llama-3.1-8b", "id": f"big-{i}", "allowed_tp": [tp], "replicas": replicas}
        assert server.client.post("/v1/placements", json=made).status_code == 201, made
    topo = server.client.get("/v1/topology").json()
    assert topo["gpus"] == 16384
    gpus = {g["ref"]: g for n in topo["nodes"] for g in n["gpus"]}
    page.open(link(server))

    assert page.js(f"{GRID}.view") == "domains" and page.js("document.querySelectorAll('#grid .tile').length") == 0
    cells = page.js(
        "[...document.querySelectorAll('#grid .dcell')].map((e) => ({domain: e.dataset.domain, held: +e.dataset.held,"
        " free: +e.dataset.free, gpus: +e.dataset.gpus, colour: e.style.backgroundColor, title: e.title}))"
    )
    assert sorted(c["domain"] for c in cells) == sorted(d["id"] for d in topo["domains"])
    assert len(cells) == 2048
    shaded: Counter[tuple[int, int, int]] = Counter()
    by_id = {d["id"]: d for d in topo["domains"]}
    for cell in cells:
        refs = by_id[cell["domain"]]["gpus"]
        held = sum(1 for ref in refs if gpus[ref]["placement"])
        assert (cell["gpus"], cell["held"], cell["free"]) == (len(refs), held, len(refs) - held)
        assert f"{len(refs)} GPUs, {held} held, {len(refs) - held} free, 0 unavailable" in cell["title"]
        expected = share_colour(held / len(refs))
        assert cell["colour"] == "rgb({}, {}, {})".format(*expected)
        shaded[expected] += 1
        holders = {gpus[ref]["request"] for ref in refs} - {None}
        for pid in holders:
            assert pid in cell["title"]
    assert shaded[share_colour(1.0)] >= 4 and shaded[FREE] > 2000  # TP8 groups fill domains; most are free

    # the screenshot: every cell in the window, in its shade (10 px cells)
    counts = page.pixels(tmp_path / "gpus-16384.png")
    for rgb, n in shaded.items():
        assert 0.8 * n * 100 <= counts[rgb] <= n * 100 + 48 * 12, (rgb, n, counts[rgb])

    # a placement picked in the legend: the cells of the domains it spans are ringed
    page.click("#placement-legend li[data-request='big-0']")
    assert page.wait(f"{GRID}.pinned === 'big-0'")
    assert page.js(SPANNED) == domains_of(server, "big-0") and len(domains_of(server, "big-0")) == 3
    # zooming in draws every GPU again (4 px tiles)
    page.click("#zoom-in")
    assert page.wait(f"{GRID}.view === 'gpus'") and page.js(f"{GRID}.tile") == "4"
    assert page.js("document.querySelectorAll('#grid .tile').length") == 16384
