"""The source tree's shape (issue 33): no module over 500 lines, and no import circle inside a package (a
package's lower module never imports a higher one, not even inside a function; imports made only for type
checking do not count). Generated code (``ledger/etcdrpc``) is left out."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "toposched"
GENERATED = PACKAGE / "ledger" / "etcdrpc"
MAX_LINES = 500


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if GENERATED in path.parents:
            continue
        parts = path.relative_to(SRC).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The toposched modules ``path`` imports at run time (``from a import b`` counts ``a.b`` when b is a module)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {name for name in found if name in modules}


def _circles(modules: dict[str, Path]) -> list[list[str]]:
    """Strongly connected components of more than one module among each package's direct modules."""
    edges: dict[str, list[str]] = {}
    for name, path in modules.items():
        package = name.rpartition(".")[0]
        edges[name] = sorted(
            other for other in _imports(path, modules) if other != name and other.rpartition(".")[0] == package
        )
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in edges[node]:
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for name in sorted(edges):
        if name not in index:
            connect(name)
    return circles


def test_no_module_is_over_the_line_limit() -> None:
    long = {
        str(path.relative_to(SRC)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"modules over {MAX_LINES} lines: split them by job"


def test_no_import_circle_inside_a_package() -> None:
    assert _circles(_modules()) == []


def test_the_circle_finder_finds_a_circle(tmp_path: Path) -> None:
    """The checker itself: two modules importing each other (one inside a function) are a circle; an import
    under ``if TYPE_CHECKING`` is not."""
    for name, text in {
        "a": "from pkg import b\n",
        "b": "def f():\n    from pkg.a import x\n",
        "c": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n",
        "d": "import pkg.c\n",
    }.items():
        (tmp_path / f"{name}.py").write_text(text)
    modules = {f"pkg.{name}": tmp_path / f"{name}.py" for name in "abcd"}
    assert _circles(modules) == [["pkg.a", "pkg.b"]]
    modules["pkg.c"].write_text("from pkg import d\n")
    assert sorted(_circles(modules)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


def _readme_layout() -> str:
    text = (SRC.parent / "README.md").read_text(encoding="utf-8")
    start = text.index("## Layout\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def test_the_readme_layout_names_real_modules_and_every_package() -> None:
    """The README's concept -> module map points at modules that exist, and names every package."""
    import re

    layout = _readme_layout()
    named = set(re.findall(r"`([a-z_]+(?:/[a-z_<>]+)*\.py)`", layout))
    missing = sorted(
        n for n in named if "<" not in n and not (SRC.parent / n if n.startswith("tests/") else PACKAGE / n).is_file()
    )
    assert missing == [], f"README's Layout names modules that do not exist: {missing}"
    packages = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.glob("*.py")))
    unnamed = [p for p in packages if f"{p}/" not in layout]
    assert unnamed == [], f"README's Layout does not name the packages {unnamed}"
