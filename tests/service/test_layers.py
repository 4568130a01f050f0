"""The service's domain layer never depends on its HTTP layer (issue 19): checked on the import statements."""

from __future__ import annotations

import ast
from pathlib import Path

import toposched.service.state

SERVICE = Path(toposched.service.state.__file__).parent
HTTP = {"app", "api", "schemas", "extender", "guards", "hot"}
HTTP_LIBRARIES = ("fastapi", "starlette", "uvicorn")


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at any level (type-checking imports included)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_domain_module_imports_the_http_layer_or_an_http_library() -> None:
    domain = sorted(p for p in SERVICE.glob("*.py") if p.stem not in HTTP | {"__init__"})
    assert {p.stem for p in domain} >= {"state", "replica", "following", "deciding", "admission", "views"}
    wrong = {
        p.stem: sorted(
            name
            for name in imported(p)
            if name.startswith(HTTP_LIBRARIES) or name in {f"toposched.service.{m}" for m in HTTP}
        )
        for p in domain
    }
    assert {stem: names for stem, names in wrong.items() if names} == {}
