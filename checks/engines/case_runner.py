"""Runs engine cases one after another in this process, each in its own environment (engines venv side).

Used by ``check_vllm.py`` and ``check_sglang.py``, which run under the engines venv's Python (never
the project's): they import vLLM or SGLang, which the project venv does not have.

A cases file is JSON ``{"cases": [{"id", "argv", "env", "gpu", "model", "model_config"}]}`` (``run.py``
writes it). For each case the launch's own environment is set (``CUDA_VISIBLE_DEVICES`` gives the
device count), ``TOPOSCHED_GPU_STUB`` names its GPU, the engines' function caches are cleared (they
remember device answers), and the check function gets the argv after the ``numactl`` prefix and the
engine's command words; it returns what the engine resolved (degrees, context, dtypes) and a summary.
One JSON line per case goes to the results file as soon as it is known, so a crash loses only the
case it happened in.

Models are read from a Hugging Face cache this module writes (``HF_HOME``, ``HF_HUB_OFFLINE=1``):
for each model id of the corpus, a snapshot holding the ``config.json`` toposched ships for it. The
engines' own loaders read it as they would a downloaded model; nothing is fetched.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import logging
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

NUMACTL = re.compile(r"--(cpunodebind|membind)=\d+(,\d+)*")
STUB_ENV = "TOPOSCHED_GPU_STUB"
MAX_ERROR_LINES = 12
_CACHED = type(functools.lru_cache(maxsize=None)(lambda: None))
"""The type of a ``functools.cache`` / ``lru_cache`` wrapper."""


def numactl_rest(argv: list[str]) -> list[str]:
    """``argv`` after a ``numactl --cpunodebind=N --membind=N`` prefix (checked), or all of it."""
    if not argv or argv[0] != "numactl":
        return argv
    i = 1
    while i < len(argv) and argv[i].startswith("-"):
        if not NUMACTL.fullmatch(argv[i]):
            raise ValueError(f"numactl option {argv[i]!r} is not --cpunodebind=N or --membind=N")
        i += 1
    if i == 1:
        raise ValueError("numactl without --cpunodebind/--membind")
    return argv[i:]


def write_hf_cache(cases: list[dict[str, Any]], root: Path) -> None:
    """An offline Hugging Face cache under ``root`` holding each case's model config; sets ``HF_HOME``."""
    hub = root / "hub"
    for case in cases:
        model, config = case.get("model"), case.get("model_config")
        if not model or not config or "/" not in model or Path(model).exists():
            continue
        repo = hub / ("models--" + model.replace("/", "--"))
        revision = hashlib.sha1(model.encode()).hexdigest()
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
        (snapshot / "config.json").write_text(Path(config).read_text())
    os.environ["HF_HOME"] = str(root)
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"


def clear_caches(prefixes: tuple[str, ...]) -> None:
    """Empty every ``functools`` cache of the modules (and their classes) under ``prefixes``."""
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for value in list(vars(module).values()):
            members = [value]
            if isinstance(value, type) and value.__module__ == name:
                members = [getattr(m, "__func__", m) for m in list(vars(value).values())]
            for member in members:
                if isinstance(member, _CACHED):
                    member.cache_clear()


@contextlib.contextmanager
def case_env(env: dict[str, str], gpu: str) -> Iterator[None]:
    """The launch's environment and the stub GPU, for the duration of one case."""
    saved = dict(os.environ)
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    os.environ.update(env)
    os.environ[STUB_ENV] = gpu
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class _Records(logging.Handler):
    """The engine's own log lines of one case: errors (shown with a failure) and warnings (summarised)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = record.getMessage().splitlines()[0][:300]
        except Exception:  # a record whose arguments do not format: keep its template
            line = str(record.msg)[:300]
        target = self.errors if record.levelno >= logging.ERROR else self.warnings
        if line not in target:
            target.append(line)


_PYDANTIC_NOISE = re.compile(r" \[type=[a-z_]+, input_value=.*$|^\s*For further information visit .*$")


def _where(exc: BaseException, packages: tuple[str, ...]) -> str:
    """The innermost frame in the engine's own code (else the innermost frame)."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if any(f"/{p}/" in f.filename for p in packages)]
    if not (own or frames):
        return ""
    frame = (own or frames)[-1]
    return f"at {frame.filename.split('site-packages/')[-1]}:{frame.lineno}"


def _error_text(exc: BaseException, stderr: str, errors: list[str], packages: tuple[str, ...]) -> str:
    """The first lines of what the engine said: argparse's ``error:`` line, or the exception and its cause."""
    if isinstance(exc, SystemExit):
        said = [line for line in stderr.splitlines() if " error: " in line or line.startswith("error:")]
        return "\n".join(said[-3:] or stderr.strip().splitlines()[-3:] or [f"exit {exc.code}"])
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and str(cause) not in text:
        text += f"\ncaused by {type(cause).__name__}: {cause}"
    lines = [_PYDANTIC_NOISE.sub("", line) for line in text.splitlines()]
    lines = [line for line in lines if line.strip()][:MAX_ERROR_LINES]
    lines.append(_where(exc, packages))
    lines += [f"log: {r}" for r in errors[:3]]
    return "\n".join(line for line in lines if line)


def prepare() -> tuple[list[dict[str, Any]], Path]:
    """Read ``CASES.json RESULTS.jsonl WORKDIR`` from the command line and write the offline model cache.

    Call before importing the engine: Hugging Face reads ``HF_HOME`` and ``HF_HUB_OFFLINE`` at import.
    """
    if len(sys.argv) != 4:
        sys.exit(f"usage: {Path(sys.argv[0]).name} CASES.json RESULTS.jsonl WORKDIR")
    cases_path, results_path, work = (Path(a) for a in sys.argv[1:4])
    cases: list[dict[str, Any]] = json.loads(cases_path.read_text())["cases"]
    write_hf_cache(cases, work / "hf")
    return cases, results_path


def run(
    engine: str,
    cases: list[dict[str, Any]],
    results_path: Path,
    command: tuple[str, ...],
    check: Callable[[list[str]], dict[str, Any]],
    cache_prefixes: tuple[str, ...],
    others: dict[tuple[str, ...], Callable[[list[str]], dict[str, Any]]] | None = None,
) -> int:
    """Run every case through ``check`` (a case whose argv starts with a command of ``others``, through that
    command's check); one result line each in ``results_path``."""
    checks = {command: check, **(others or {})}
    with results_path.open("w", encoding="utf-8") as results:
        for case in cases:
            started = time.monotonic()
            result: dict[str, Any] = {"id": case["id"], "ok": False}
            records = _Records()
            for name in cache_prefixes:
                logging.getLogger(name).addHandler(records)
            stderr = io.StringIO()
            try:
                with case_env(case["env"], case["gpu"]), contextlib.redirect_stderr(stderr):
                    clear_caches(cache_prefixes)
                    argv = numactl_rest(case["argv"])
                    words = next((c for c in checks if tuple(argv[: len(c)]) == c), None)
                    if words is None:
                        raise ValueError(f"the command is {' '.join(argv[:3])!r}, not {' '.join(command)!r}")
                    resolved = checks[words](argv[len(words) :])
                    result["detail"] = resolved.pop("summary", "")
                    result["resolved"] = resolved
                    result["ok"] = True
            except BaseException as exc:  # the engine's own error, whatever it is, is the finding
                if isinstance(exc, KeyboardInterrupt):
                    raise
                result["error"] = _error_text(exc, stderr.getvalue(), records.errors, cache_prefixes)
            finally:
                for name in cache_prefixes:
                    logging.getLogger(name).removeHandler(records)
            result["warnings"] = records.warnings[:10]
            result["seconds"] = round(time.monotonic() - started, 2)
            results.write(json.dumps(result) + "\n")
            results.flush()
            print(f"[{engine}] {'ok  ' if result['ok'] else 'FAIL'} {case['id']}", flush=True)
    return 0
