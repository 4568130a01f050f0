"""Launch-script injection: hostile names in a plan must never run, move a file or add YAML.

A case is a real plan document (``toposched plan --json``) with hostile values put into names
(a node renamed everywhere it appears, a placement or request id, any other string), plus hostile
``--model-path`` / ``--master-addr`` flags. For each engine the CLI writes its scripts with
``launch ENGINE --plan --out``; then:

* every file written must be inside ``--out`` (``out`` sits five folders deep in the case folder, so
  ``../`` in a name that escapes lands where it is seen);
* every script must pass ``bash -n``, then runs under ``bash`` with ``vllm``, ``numactl``,
  ``python3``, ``sglang`` and ``ray`` replaced by stubs that record their argv and environment; the
  marker file a payload would create must not exist afterwards, and the recorded command must be
  one of the plan's ``argv`` exactly;
* ``launch k8s`` and ``launch k8s --kubelet`` output must parse as YAML, and no name may add a key.

Any breach raises ``Injection``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml
from hypothesis import strategies as st

from tests.fuzz import seeds
from tests.fuzz.harness import Case, Injection, Target
from tests.fuzz.mutate import INJECTIONS, MARK, node_paths
from tests.fuzz.targets import CLI_OK, register

PAYLOADS: tuple[str, ...] = (
    *INJECTIONS,
    "../../escape",
    "../../../../../../../../x",
    "a:b",
    "n" * 10_000,
    "-rf",
    "a b",
    "x\x00y",
    "\u2028",
    "x\u0085y",
    "$HOME",
    "~root",
    "*",
)
STUBS = ("vllm", "numactl", "python3", "sglang", "ray")
STUB = '#!/bin/bash\nprintf "%s\\0" "$(basename "$0")" "$@" > "$FUZZ_RECORD"\nenv -0 > "$FUZZ_RECORD.env"\n'
OUT_DEPTH = ("a", "b", "c", "d", "e")


def _rename(value: Any, old: str, new: str) -> Any:
    """``value`` with the node name ``old`` replaced by ``new`` everywhere (also in ``node/gpu`` refs)."""
    if isinstance(value, str):
        if value == old:
            return new
        return new + value[len(old) :] if value.startswith(old + "/") else value
    if isinstance(value, list):
        return [_rename(v, old, new) for v in value]
    if isinstance(value, dict):
        return {_rename(k, old, new): _rename(v, old, new) for k, v in value.items()}
    return value


def _apply(text: str, payload: str, style: str) -> str:
    return payload if style == "replace" else payload + text if style == "prefix" else text + payload


@st.composite
def _inject_case(draw: Any) -> Case:
    plans = seeds.plans()
    label, doc = plans[draw(st.integers(0, len(plans) - 1))]
    doc = copy.deepcopy(doc)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["node", "node", "id", "leaf", "leaf"]))
        payload = draw(st.one_of(st.sampled_from(PAYLOADS), st.text(min_size=1, max_size=12)))
        style = draw(st.sampled_from(["replace", "suffix", "prefix"]))
        if how == "node":
            names = [n["name"] for n in doc["cluster"]["nodes"]]
            old = names[draw(st.integers(0, len(names) - 1))]
            doc = _rename(doc, old, _apply(old, payload, style))
        elif how == "id":
            p = doc["placements"][draw(st.integers(0, len(doc["placements"]) - 1))]
            p["id"] = _apply(p["id"], payload, style)
            if draw(st.booleans()):
                doc["request"]["id"] = _apply(doc["request"]["id"], payload, style)
        else:
            strings = [path for path in node_paths(doc) if isinstance(_leaf(doc, path), str)]
            path = strings[draw(st.integers(0, len(strings) - 1))]
            parent = _leaf(doc, path[:-1])
            parent[path[-1]] = _apply(parent[path[-1]], payload, style)
    flags = {
        "model_path": draw(st.one_of(st.none(), st.sampled_from(PAYLOADS))),
        "master_addr": draw(st.one_of(st.none(), st.sampled_from(PAYLOADS))),
    }
    return Case(json.dumps(doc).encode("utf-8", "surrogatepass"), "plan.json", (), json.dumps(flags), seed=label)


def _leaf(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _inject_cases() -> st.SearchStrategy[Case]:
    return _inject_case()


def _inject_seeds() -> list[Case]:
    flags = json.dumps({"model_path": None, "master_addr": None})
    return [Case(json.dumps(doc).encode(), "plan.json", (), flags, seed=label) for label, doc in seeds.plans()]


def _stdout_of(*args: str | Path) -> str:
    """stdout of ``toposched ARGS`` in-process ("" when it exits non-zero)."""
    from toposched.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        try:
            main([str(a) for a in args])
        except SystemExit as exc:
            if exc.code not in (0, None):
                return ""
    return out.getvalue()


def _write_stubs(folder: Path) -> Path:
    bin_dir = folder / "stub-bin"
    bin_dir.mkdir()
    for name in STUBS:
        (bin_dir / name).write_text(STUB)
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _run_script(script: Path, folder: Path, bin_dir: Path, marker: Path) -> tuple[list[str], dict[str, str]]:
    """Check and run one script with the stubs; the argv and environment its exec'd command got."""
    syntax = subprocess.run(["bash", "-n", str(script)], capture_output=True, timeout=10, check=False)
    if syntax.returncode != 0:
        raise Injection("script does not parse", f"{script.name}: {syntax.stderr.decode(errors='replace')[:200]}")
    record = folder / f"record-{script.stem[:40]}"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(folder), "FUZZ_RECORD": str(record)}
    run_dir = folder / "run"
    run_dir.mkdir(exist_ok=True)
    subprocess.run(["bash", str(script)], cwd=run_dir, env=env, capture_output=True, timeout=10, check=False)
    if marker.exists():
        raise Injection("injected command ran", f"{script.name}: the marker file exists")
    if not record.exists():
        raise Injection("script did not reach its command", script.name)
    argv = record.read_bytes().decode("utf-8", "surrogateescape").split("\0")[:-1]
    raw_env = Path(f"{record}.env").read_bytes().decode("utf-8", "surrogateescape")
    environ = dict(item.split("=", 1) for item in raw_env.split("\0") if "=" in item)
    return argv, environ


def run_inject(case: Case, folder: Path) -> None:
    from toposched.binding.engines import build_launches
    from toposched.binding.plan_doc import load_plan

    marker = folder / "MARK"
    plan = folder / case.name
    plan.write_bytes(case.data.replace(MARK.encode(), str(marker).encode()))
    flags = {k: (v.replace(MARK, str(marker)) if isinstance(v, str) else None) for k, v in json.loads(case.arg).items()}
    doc = load_plan(plan)  # a refused plan is the right answer; InputError ends the case
    bin_dir = _write_stubs(folder)
    deep = folder.joinpath(*OUT_DEPTH)
    for engine in ("vllm", "sglang"):
        out = deep / f"out-{engine}"
        extra: list[str] = []
        if flags["model_path"] is not None:
            extra += ["--model-path", flags["model_path"]]
        if flags["master_addr"] is not None:
            extra += ["--master-addr", flags["master_addr"]]
        if not _stdout_of("launch", engine, "--plan", plan, "--out", out, *extra) and not out.exists():
            continue
        try:
            launches = build_launches(
                doc.placements,
                doc.request,
                doc.cluster,
                engine,
                model_path=flags["model_path"],
                master_addr=flags["master_addr"],
            )
        except Exception:
            launches = []
        expected = {tuple(launch.argv): launch.env for launch in launches}
        for script in sorted(out.glob("*.sh")):
            argv, environ = _run_script(script, folder, bin_dir, marker)
            if expected and tuple(argv) not in expected:
                raise Injection("command differs from the plan", f"{script.name}: ran {argv[:3]}...")
            env = expected.get(tuple(argv), {})
            changed = [k for k, v in env.items() if environ.get(k) != v]
            if changed:
                raise Injection("environment differs from the plan", f"{script.name}: {changed[0]}")
    _check_files(folder, case)
    if marker.exists():
        raise Injection("injected command ran", "while writing the scripts")
    _check_yaml(_stdout_of("launch", "k8s", "--plan", plan), "launch k8s")
    _check_yaml(_stdout_of("launch", "k8s", "--plan", plan, "--kubelet"), "launch k8s --kubelet")


def _check_files(folder: Path, case: Case) -> None:
    """Every file is an input, a stub/record/run file, or a script directly inside an ``out-*`` folder."""
    deep = folder.joinpath(*OUT_DEPTH)
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(root) / name
            rel = path.relative_to(folder)
            if rel.parts[0] in ("stub-bin", "run") or name.startswith("record-") or rel == Path(case.name):
                continue
            if path.parent.parent == deep and path.parent.name.startswith("out-") and name.endswith(".sh"):
                continue
            raise Injection("file written outside --out", repr(str(rel)[:120]))


def _has_key(value: Any, key: str) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if key in item:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _check_yaml(text: str, what: str) -> None:
    """The YAML parses, and no name added a key (the payloads add ``injected:``)."""
    if not text:
        return
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise Injection(f"{what} output is not YAML", str(exc).splitlines()[0]) from None
    if _has_key(docs, "injected"):
        raise Injection(f"{what} YAML grew a key from a name")


register(
    Target(
        "launch-inject",
        "launch vllm/sglang --out, k8s, k8s --kubelet with hostile names; scripts run",
        cases=_inject_cases,
        seeds=_inject_seeds,
        run=run_inject,
        allowed=CLI_OK,
        brief_examples=20,
    )
)
