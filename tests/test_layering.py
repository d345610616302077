"""The package layers point one way and no modules import each other in a circle.

kernels, parallel <- memory <- model <- tools <- engine <- server <- commands; `errors`, `units` and
`schemas` sit below everything and import nothing of ft (schemas: pydantic only); `ft.ctl` and
`ft.tui` import only each other, `schemas` and `units` (no torch: they run on a laptop). Every
import counts, function-level ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ft"

RANK = {"errors": 0, "units": 0, "schemas": 0, "kernels": 1, "parallel": 1, "memory": 2, "model": 3, "tools": 4, "engine": 5,
        "server": 6, "cli": 7, "serve_cmd": 7, "generate_cmd": 7, "engine_args": 7, "preflight": 7, "argparser": 0}
CLIENTS = {"ctl", "tui"}


def _modules() -> dict[str, Path]:
    mods = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(("ft",) + f.relative_to(ROOT).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = f
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for name, f in mods.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
                if node.level:
                    base = base[: len(base) - node.level + 1]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name and t != "ft":
                    out.add(t)
        edges[name] = out
    return edges


def _layer(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_layers_point_one_way():
    edges = _imports(_modules())
    wrong = []
    for src, dsts in edges.items():
        if src == "ft":
            continue
        a = _layer(src)
        for dst in dsts:
            b = _layer(dst)
            if a in CLIENTS:
                ok = b in CLIENTS | {"schemas", "units", "argparser"}  # argparser: stdlib only
            elif b in CLIENTS:
                ok = a in ("cli",)
            else:
                ok = RANK[b] <= RANK[a]
            if not ok:
                wrong.append(f"{src} -> {dst}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_circles():
    edges = _imports(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, f"modules that import each other: {circles}"


def test_kernels_import_nothing_above_them():
    edges = _imports(_modules())
    up = {f"{s} -> {d}" for s, ds in edges.items() if _layer(s) == "kernels" for d in ds
          if _layer(d) not in ("kernels",)}
    assert not up, up


ENGINE_RANK = {"text": 0, "base": 1, "sampling": 2, "cache": 2, "sched": 3, "worker": 4, "ranks": 5, "core": 6}
"""`ft.engine`'s sub-packages, lowest first: text <- base (options, a request, a step's inputs) <-
sampling, cache <- sched <- worker <- ranks <- core (the `Engine`). A module imports only from its
own sub-package or lower ones."""


def test_engine_subpackages_point_one_way():
    edges = _imports(_modules())
    sub = lambda m: m.split(".")[2] if m.startswith("ft.engine.") and len(m.split(".")) > 3 else None  # noqa: E731
    found = {s for m in edges if (s := sub(m))}
    assert found == set(ENGINE_RANK), f"engine sub-packages {sorted(found)} against the ranks {sorted(ENGINE_RANK)}"
    loose = sorted(m for m in edges if m.startswith("ft.engine.") and m.count(".") == 2 and sub(m) is None
                   and m.split(".")[2] not in ENGINE_RANK)
    assert not loose, f"modules directly in ft.engine (put them in a sub-package): {loose}"
    bad = sorted(f"{a} -> {b}" for a, outs in edges.items() if (sa := sub(a)) for b in outs
                 if (sb := sub(b)) and sb != sa and ENGINE_RANK[sb] >= ENGINE_RANK[sa])
    assert not bad, "engine imports that point up or sideways:\n" + "\n".join(bad)


def test_no_module_imports_another_modules_private_names():
    """A name another module needs is public (no leading underscore): `from ft.x import _y` reaches
    into x's privates, which x may then change without knowing who depends on them."""
    found = []
    for name, f in _modules().items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ft"):
                found += [f"{name}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, found
