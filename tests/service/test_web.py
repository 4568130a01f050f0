"""The web page in headless Chromium (Debian ``chromium``) at 8, 256 and 4,096 GPUs.

Each render is checked for what it shows, against the API's own answers: one tile per GPU in the state the
API gives (held, free, unavailable), the holding placement and its planned HBM in each held tile's hover
text, one colour per placement (the tiles' and the legend's), one box per NVLink domain, the nine signal
cards, no page error (the page's own error count and Chromium's console); and in the screenshot, the pixels
of each placement's colour and of the free tiles' green, so every tile is drawn inside the window. The 8-GPU
page also shows its node: GPUs grouped by NUMA node, HBM bars split as the placements plan them, and an alert
that marks the GPUs behind it; and two placements in two colours, each tile labelled with its HBM.

Hover, clicks, the signal history and the aggregated view at 16,384 GPUs: ``test_web_page.py``.

The screenshots stay in the pytest temporary folder, ``ui-shots/`` (each test prints the path).
Chromium missing fails the test with the fix (``make system-deps``); it never skips.
"""

from __future__ import annotations

import shutil
import subprocess
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest
from PIL import Image

from tests.service.conftest import TOKEN, Server, StartServer
from toposched.service.metrics import SIGNAL_NAMES

FREE = (180, 230, 190)  # .tile.free in style.css
SWATCH_PX = 12 * 12  # a swatch in the legends and the placements table
CARD_BORDER_PX = 5 * 150  # a node detail's GPU card: its left border in its placement's colour
GIB = 1024**3
MARKUP_NAME = '<img src=x onerror="document.body.dataset.injected=1">.yaml'
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def walk(self) -> Iterator[Element]:
        yield self
        for child in self.children:
            yield from child.walk()

    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def all_text(self) -> str:
        return "".join(self.text) + "".join(c.all_text() for c in self.children)

    def by_id(self, ident: str) -> Element:
        return next(e for e in self.walk() if e.attrs.get("id") == ident)


class _TreeBuilder(HTMLParser):
    """Chromium's ``--dump-dom`` (serialised HTML, every non-void element closed) as an ``Element`` tree."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(element)
        if tag not in VOID:
            self.stack.append(element)

    def handle_endtag(self, tag: str) -> None:
        if tag not in VOID and len(self.stack) > 1 and self.stack[-1].tag == tag:
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        self.stack[-1].text.append(data)


def parse(html: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(html)
    return builder.root


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail(
            "chromium is not installed; install Debian's chromium: `make system-deps` or `apt-get install -y chromium`",
            pytrace=False,
        )
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
        "--window-size=1280,1000", "--virtual-time-budget=5000", "--enable-logging=stderr", "--v=0",
    ]  # fmt: skip
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120)


@dataclass
class Render:
    dom: Element
    shot: Path
    tiles: dict[str, Element]  # GPU ref -> its tile in the overview
    colours: dict[str, tuple[int, int, int]]  # placement id -> its colour, as the colour legend lists them


def colour(element: Element, prop: str = "background-color") -> tuple[int, int, int]:
    """The ``rgb(r, g, b)`` an inline style gives ``prop`` (Chromium serialises colours so)."""
    styles = dict(p.strip().split(":", 1) for p in element.attrs.get("style", "").split(";") if ":" in p)
    r, g, b = styles[prop].strip().removeprefix("rgb(").removesuffix(")").split(",")
    return int(r), int(g), int(b)


def legend_colours(dom: Element) -> dict[str, tuple[int, int, int]]:
    items = [e for e in dom.by_id("placement-legend").walk() if e.tag == "li" and "data-request" in e.attrs]
    return {li.attrs["data-request"]: colour(next(e for e in li.walk() if "swatch" in e.classes())) for li in items}


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ui-shots", numbered=False)


def render(server: Server, tmp_path: Path, shot: Path, link: str = "") -> Render:
    """Load the page twice (screenshot, then DOM) and check what every render must show.

    ``link``: more of the address after the token (``&node=NAME&placement=ID``), as a shared link gives it.
    """
    page = f"{server.url}/ui/#token={TOKEN}{link}"
    drawn = chromium(tmp_path, f"--screenshot={shot}", page)
    assert shot.exists(), drawn.stderr[-2000:]
    dumped = chromium(tmp_path, "--dump-dom", page)
    print(f"web page screenshot: {shot}")
    for log in (drawn.stderr, dumped.stderr):
        assert "Uncaught" not in log, [line for line in log.splitlines() if "CONSOLE" in line]
    dom = parse(dumped.stdout)
    body = next(e for e in dom.walk() if e.tag == "body")
    assert body.attrs.get("data-loaded") == "yes", dom.by_id("status").all_text()
    assert "data-errors" not in body.attrs, dom.by_id("status").all_text()

    topo = server.client.get("/v1/topology").json()
    gpus = {g["ref"]: g for n in topo["nodes"] for g in n["gpus"]}
    grid = dom.by_id("grid")
    tiles = {e.attrs["data-gpu"]: e for e in grid.walk() if "tile" in e.classes()}
    assert len(tiles) == topo["gpus"] == len(gpus) and set(tiles) == set(gpus)
    listed = legend_colours(dom)  # (the first placements; the table lists them all)
    colours: dict[str, tuple[int, int, int]] = {}
    for ref, g in gpus.items():
        state = "used" if g["placement"] else "free" if g["free"] else "down"
        assert state in tiles[ref].classes(), (ref, tiles[ref].classes())
        if g["placement"]:  # the hover text names the holder and its plan's HBM; the tile has the legend's colour
            title = tiles[ref].attrs["title"]
            assert f"held by placement {g['request']} " in title
            hbm = g["hbm"]
            used = hbm["weights"] + hbm["kv"] + hbm["other"]
            assert f"HBM {used / GIB:.1f} of {hbm['capacity'] / GIB:.1f} GiB planned" in title
            assert tiles[ref].attrs["data-request"] == g["request"]
            assert colour(tiles[ref]) == colours.setdefault(g["request"], colour(tiles[ref])) != FREE
    assert {pid: colours[pid] for pid in listed} == listed
    boxes = [e for e in grid.walk() if "domain" in e.classes()]
    assert {b.attrs["data-domain"] for b in boxes} >= {d["id"] for d in topo["domains"]}
    cards = [e.attrs["data-signal"] for e in dom.by_id("signals").walk() if "signal" in e.classes()]
    assert cards == list(SIGNAL_NAMES)

    # the screenshot: every tile in the window, each placement's in its colour (placements beyond the palette
    # share one) and free ones green, less digits and HBM bars; plus the swatches of that colour
    px = int(grid.attrs["data-tile"])
    counts = {rgb: n for n, rgb in Image.open(shot).convert("RGB").getcolors(maxcolors=1 << 22) or []}
    tiles_of: Counter[tuple[int, int, int]] = Counter()
    swatches = Counter(colour(e) for e in dom.walk() if "swatch" in e.classes() and "style" in e.attrs)
    for g in gpus.values():
        if g["placement"]:
            tiles_of[colours[g["request"]]] += 1
        elif g["free"]:
            tiles_of[FREE] += 1
    swatches[FREE] += 1
    node = dom.by_id("node")
    shown = "hidden" not in node.attrs
    cards = [e for e in node.walk() if {"gpu", "used"} <= e.classes()] if shown else []
    borders = Counter(colour(card, "border-left-color") for card in cards)  # a node's held GPU cards
    for rgb, n in tiles_of.items():
        bound = n * px * px + swatches[rgb] * SWATCH_PX + borders[rgb] * CARD_BORDER_PX
        assert 0.6 * n * px * px <= counts.get(rgb, 0) <= bound, (rgb, n, px, counts.get(rgb))
    return Render(dom, shot, tiles, listed)


def place_mix(server: Server, count: int) -> None:
    """``count`` placements of three model sizes (TP 1 to 8), all placed."""
    mix = [("llama-3.1-8b", [1]), ("llama-3.1-70b", [4, 8]), ("mixtral-8x7b", [2, 4]), ("llama-3.1-8b", [2])]
    for i in range(count):
        model, tp = mix[i % len(mix)]
        made = server.client.post("/v1/placements", json={"model": model, "id": f"mix-{i}", "allowed_tp": tp})
        assert made.status_code == 201, made.text


def test_the_page_shows_holders_hbm_numa_and_the_gpus_an_alert_names(
    sqlite_server: Server, tmp_path: Path, shots: Path
) -> None:
    client = sqlite_server.client
    made = client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "web", "allowed_tp": [4]})
    assert made.status_code == 201
    drifted = client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "drift", "allowed_tp": [2]})
    assert drifted.status_code == 201
    drift_gpus = {f"{r['node']}/{r['gpu']}" for r in drifted.json()["ranks"]}
    alert = {"kind": "TOPOLOGY_DRIFT", "gpu": min(drift_gpus), "subject": "nvlink", "observed": 0, "expected": 18}
    report = {"placement": "drift", "node": "hgx-h100", "cycle": 1, "active_alerts": [alert]}
    assert client.post("/v1/reports", json=report).status_code == 200
    try:
        topo = client.get("/v1/topology").json()
        page = render(sqlite_server, tmp_path, shots / "gpus-8.png")
    finally:
        client.delete("/v1/placements/web")
        client.delete("/v1/placements/drift")

    dom = page.dom
    # the alert names the drifted placement's GPUs: their tiles carry the alert mark, no other tile does
    firing = [e for e in dom.by_id("alerts").walk() if e.tag == "li" and e.attrs.get("data-alert")]
    assert "SidecarTopologyDrift" in {e.attrs["data-alert"] for e in firing}
    assert {ref for ref, tile in page.tiles.items() if "alerted" in tile.classes()} == drift_gpus
    assert "mark its 2 GPUs" in dom.by_id("alerts").all_text()

    # one node: its detail is open, GPUs grouped by NUMA node as the DomainMap says, HBM bars as planned
    node = dom.by_id("node")
    assert "hidden" not in node.attrs
    gpus = {g["ref"]: g for g in topo["nodes"][0]["gpus"]}
    for group in (e for e in node.walk() if "numa" in e.classes()):
        refs = {e.attrs["data-gpu"] for e in group.walk() if "gpu" in e.classes()}
        numa = {gpus[ref]["numa"].split("/")[-1] for ref in refs}
        assert len(refs) == 4 and numa == {group.attrs["data-numa"].removeprefix("NUMA ")}
    cards = {e.attrs["data-gpu"]: e for e in node.walk() if "gpu" in e.classes()}
    assert set(cards) == set(gpus)
    for ref, g in gpus.items():
        segments = {s.attrs["class"].split()[1]: s for s in cards[ref].walk() if "seg" in s.classes()}
        if g["placement"] is None:
            assert not segments
            continue
        hbm = g["hbm"]
        for part in ("weights", "kv", "other"):
            assert int(segments[part].attrs["data-bytes"]) == hbm[part] > 0
            width = float(segments[part].attrs["style"].removeprefix("width: ").removesuffix("%;"))
            assert width == pytest.approx(100 * hbm[part] / hbm["capacity"], abs=0.01)
        holder = [e for e in cards[ref].walk() if e.tag == "button"]
        assert [b.attrs["data-request"] for b in holder] == [g["request"]]
    rows = [e for e in dom.by_id("placements").walk() if e.tag == "tr" and "data-request" in e.attrs]
    assert {row.attrs["data-request"] for row in rows} == {"web", "drift"}

    # two placements, two colours: in the legend (with model, TP x PP and SLO state), on the tiles, and as
    # pixels in the screenshot (render checks each colour's count against its tiles)
    assert set(page.colours) == {"web", "drift"} and page.colours["web"] != page.colours["drift"]
    legend = dom.by_id("placement-legend").all_text()
    assert "web: llama-3.1-8b, TP4 x PP1, interactive, SLO met" in legend
    assert "drift: llama-3.1-8b, TP2 x PP1, interactive, degraded" in legend
    pixels = dict((rgb, n) for n, rgb in Image.open(page.shot).convert("RGB").getcolors(maxcolors=1 << 22) or [])
    assert min(pixels.get(page.colours["web"], 0), pixels.get(page.colours["drift"], 0)) >= 2 * 40 * 40 * 0.6
    # each held tile at 40 px says how much of its HBM the plan uses (GiB planned / capacity)
    for ref, g in gpus.items():
        label = [e.all_text() for e in page.tiles[ref].walk() if "gib" in e.classes()]
        if g["placement"]:
            hbm = g["hbm"]
            used = round((hbm["weights"] + hbm["kv"] + hbm["other"]) / GIB)
            assert label == [f"{used}/{round(hbm['capacity'] / GIB)}"]
        else:
            assert label == []


@pytest.mark.parametrize("size", [256, 4096])
def test_the_overview_stays_whole_and_readable_at_scale(
    size: int, serve: StartServer, tmp_path: Path, shots: Path
) -> None:
    state = f"sqlite:{tmp_path / 'state.sqlite3'}"
    if size == 256:
        server = serve("--preset", "cluster-32x-hgx-h100", "--state", state)
        racks, placements = 8, 40
    else:  # 512 HGX H100 nodes, 32 to a rack, in a spec whose file name is markup the page must show as text
        spec = tmp_path / MARKUP_NAME
        entries = "".join(
            f'  - {{name: "h100-r{r:02d}-{{i:02d}}", count: 32, preset: hgx-h100, rack: rack{r:02d}}}\n'
            for r in range(16)
        )
        spec.write_text(f"name: hgx-h100-x512\nfabric: {{kind: IB, nic_gbit_per_s: 400}}\nnodes:\n{entries}")
        server = serve("--cluster", str(spec), "--state", state)
        racks, placements = 16, 300
    place_mix(server, placements)
    # at 256 GPUs, a shared link to a node and a placement on it: the node detail opens, its GPUs marked
    linked = server.client.get("/v1/placements/mix-1").json()
    linked_gpus = {f"{r['node']}/{r['gpu']}" for r in linked["ranks"]}
    (linked_node,) = {r["node"] for r in linked["ranks"]}
    link = f"&node={linked_node}&placement=mix-1" if size == 256 else ""
    page = render(server, tmp_path, shots / f"gpus-{size}.png", link)

    assert len(page.tiles) == size
    grid = page.dom.by_id("grid")
    headings = [e.all_text() for e in grid.walk() if e.tag == "h3"]
    assert len(headings) == racks and all(h.startswith("rack ") for h in headings)
    # readable: the whole cluster in one window needs smaller tiles than the 8-GPU page's 40 px
    assert int(grid.attrs["data-tile"]) <= (16 if size == 256 else 6)
    if size == 4096:  # the source names the spec file: shown as text, never parsed as markup
        assert MARKUP_NAME in page.dom.by_id("cluster").all_text()
        assert not [e for e in page.dom.walk() if e.tag == "img"]
        assert "data-injected" not in next(e for e in page.dom.walk() if e.tag == "body").attrs
    node = page.dom.by_id("node")
    marked = {ref for ref, tile in page.tiles.items() if "marked" in tile.classes()}
    rows = [e for e in page.dom.by_id("placements").walk() if e.tag == "tr" and "data-request" in e.attrs]
    assert len(rows) == placements
    selected = [row.attrs["data-request"] for row in rows if "selected" in row.classes()]
    if not link:  # the overview alone, until a tile is clicked
        assert "hidden" in node.attrs and not marked and not selected
        return
    assert "hidden" not in node.attrs and node.by_id("node-name").all_text().startswith(f"{linked_node} (rack ")
    cards = {e.attrs["data-gpu"] for e in node.walk() if "gpu" in e.classes()}
    assert cards == {f"{linked_node}/{i}" for i in range(8)}
    assert marked == linked_gpus and selected == ["mix-1"]
