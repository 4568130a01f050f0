"""The web page in headless Chromium (Debian ``chromium``): the NVLink-domain grid shows who holds what.

Chromium missing fails the test with the fix (``make system-deps``); it never skips.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from tests.service.conftest import TOKEN, Server

FREE = (46, 160, 67)  # .cell.free in style.css
USED = (207, 34, 46)  # .cell.used
CELL_PX = 40 * 40


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
        "--window-size=1000,800", "--virtual-time-budget=5000",
    ]  # fmt: skip
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=90)


def test_the_page_draws_the_domain_grid_with_held_and_free_gpus(sqlite_server: Server, tmp_path: Path) -> None:
    made = sqlite_server.client.post("/v1/placements", json={"model": "llama-3.1-8b", "id": "web", "allowed_tp": [4]})
    assert made.status_code == 201
    held = {f"{r['node']}/{r['gpu']}" for r in made.json()["ranks"]}
    page = f"{sqlite_server.url}/ui/#token={TOKEN}"
    try:
        shot = tmp_path / "page.png"
        done = chromium(tmp_path, f"--screenshot={shot}", page)
        assert shot.exists(), done.stderr[-2000:]
        dom = chromium(tmp_path, "--dump-dom", page).stdout
    finally:
        sqlite_server.client.delete("/v1/placements/web")

    # the DOM: one domain box with all 8 GPUs, the held ones marked used
    assert 'data-loaded="yes"' in dom
    assert dom.count('class="domain"') == 1
    cells = {ref: state for state, ref in re.findall(r'class="cell (free|used|down)" data-gpu="([^"]+)"', dom)}
    assert len(cells) == 8
    assert {ref for ref, state in cells.items() if state == "used"} == held
    assert {ref for ref, state in cells.items() if state == "free"} == {f"hgx-h100/{i}" for i in range(8)} - held
    assert "web" in dom  # the placements table

    # the screenshot: four red and four green 40x40 cells (less their white index digits), plus a legend swatch
    image = Image.open(shot).convert("RGB")
    counts: dict[object, int] = {}  # colour (an RGB tuple) -> pixels
    for count, colour in image.getcolors(maxcolors=1 << 20) or []:
        counts[colour] = count
    legend = 14 * 14
    for colour in (USED, FREE):
        assert 3.5 * CELL_PX + legend < counts.get(colour, 0) <= 4 * CELL_PX + legend, (colour, counts.get(colour))
