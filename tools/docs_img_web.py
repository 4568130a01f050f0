"""Screenshots of the web page for docs/service.md: docs/img/web-8.png and docs/img/web-4096.png.

Starts ``toposched serve`` itself (as tests/service/conftest.py does: a free loopback port, a SQLite state in a
temporary folder, a token in the environment), places a few placements in rounds 10 s apart (so the signal
charts, which read the service's history when the page opens, have a past), and takes each screenshot with
headless Chromium (Debian ``chromium``).

    .venv/bin/python tools/docs_img_web.py [--out docs/img] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOKEN = "docs-token-0123456789"
HISTORY_STEP_S = 10.5  # a little over the service's sampling step (service/history.py STEP_S)
SHORT = {"llama-3.1-8b": "chat8b", "llama-3.1-70b": "chat70b", "mixtral-8x7b": "moe"}
MIX_8 = [("llama-3.1-8b", [2]), ("mixtral-8x7b", [4]), ("llama-3.1-8b", [1])]
MIX_4096 = [("llama-3.1-70b", [8]), ("llama-3.1-8b", [1]), ("mixtral-8x7b", [4]), ("llama-3.1-70b", [4])]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    def __init__(self, args: list[str], folder: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        port = self.url.rsplit(":", 1)[1]
        self.log = open(folder / "serve.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "toposched.cli.main", "serve", "--port", port, *args],
            env={**os.environ, "TOPOSCHED_API_TOKEN": TOKEN},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.client = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"toposched serve exited with {self.proc.returncode}; see {folder / 'serve.log'}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit("toposched serve did not become ready in 120 s")

    def place(self, pid: str, model: str, tp: list[int]) -> None:
        made = self.client.post("/v1/placements", json={"model": model, "id": pid, "allowed_tp": tp})
        if made.status_code != 201:
            raise SystemExit(f"placing {pid}: HTTP {made.status_code} {made.text[:300]}")

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)
        self.log.close()


def screenshot(url: str, shot: Path, profile: Path, size: str) -> None:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        raise SystemExit("chromium is not installed (apt-get install -y chromium)")
    flags = [
        "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
        f"--user-data-dir={profile}", f"--window-size={size}", "--virtual-time-budget=8000",
    ]  # fmt: skip
    subprocess.run([binary, *flags, f"--screenshot={shot}", f"{url}/ui/#token={TOKEN}"], check=True, timeout=180)
    print(f"wrote {shot}")


def spec_4096(folder: Path) -> Path:
    """512 HGX H100 nodes (4,096 GPUs), 32 to a rack, as tests/service/test_web.py builds them."""
    entries = "".join(
        f'  - {{name: "h100-r{r:02d}-{{i:02d}}", count: 32, preset: hgx-h100, rack: rack{r:02d}}}\n' for r in range(16)
    )
    spec = folder / "hgx-h100-x512.yaml"
    spec.write_text(f"name: hgx-h100-x512\nfabric: {{kind: IB, nic_gbit_per_s: 400}}\nnodes:\n{entries}")
    return spec


def run(out: Path, rounds: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="docs-img-web-") as tmp:
        folder = Path(tmp)
        cases = [
            ("web-8.png", ["--preset", "hgx-h100"], MIX_8, 1, "1280,1150"),
            ("web-4096.png", ["--cluster", str(spec_4096(folder))], MIX_4096, 4, "1280,1000"),
        ]
        for i, (name, source, mix, per_round, size) in enumerate(cases):
            where = folder / str(i)
            where.mkdir()
            service = Service([*source, "--state", f"sqlite:{where / 'state.sqlite3'}"], where)
            try:
                placed = 0
                for r in range(rounds):
                    if r:
                        time.sleep(HISTORY_STEP_S)  # one history sample per round
                    for _ in range(per_round):
                        model, tp = mix[placed % len(mix)]
                        service.place(f"{SHORT[model]}-{placed}", model, tp)
                        placed += 1
                screenshot(service.url, out / name, where / "profile", size)
            finally:
                service.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "docs" / "img")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of placements, 10 s apart")
    args = parser.parse_args()
    run(args.out, args.rounds)


if __name__ == "__main__":
    main()
