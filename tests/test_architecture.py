"""dynmo's imports must follow the layer table in docs/architecture.md and contain no cycles.

The checker is plain functions of (package folder, doc text), so the synthetic tests at the bottom
can show that each rule really fires.
"""
import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = "docs/architecture.md"


def find_modules(pkg_dir: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package folder."""
    modules = {}
    for path in sorted(pkg_dir.rglob("*.py")):
        parts = path.relative_to(pkg_dir.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def parse_layers(doc_text: str) -> dict[str, int]:
    """Table entry (dotted name) -> layer number, from the markdown table under '## Layers'."""
    lines = doc_text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "## Layers"), None)
    if start is None:
        raise ValueError(f"{DOC} has no '## Layers' section")
    table: dict[str, int] = {}
    for line in lines[start + 1:]:
        if line.startswith("## "):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        # The header and |---| rows have no integer in the first cell, so they drop out here.
        if not line.lstrip().startswith("|") or len(cells) < 2 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`([\w.]+)`", cells[1]):
            if table.setdefault(name, int(cells[0])) != int(cells[0]):
                raise ValueError(f"{DOC}: `{name}` is listed in layers {table[name]} and {cells[0]}")
    if not table:
        raise ValueError(f"{DOC}: the '## Layers' section has no table rows")
    return table


def layer_of(module: str, table: dict[str, int]) -> int | None:
    """Layer of the most specific table entry that is the module or a package containing it."""
    parts = module.split(".")
    prefixes = (".".join(parts[:n]) for n in range(len(parts), 0, -1))
    return next((table[p] for p in prefixes if p in table), None)


def import_edges(modules: dict[str, Path]) -> list[tuple[str, str, Path, int]]:
    """(importer, imported, file, line) for every import of a package module, wherever it sits.

    ast.walk visits function bodies, `if TYPE_CHECKING:` blocks and try/except alike: a deferred or
    type-only import still couples the two modules, which is what the layering is about.
    """
    edges = []
    for importer, path in modules.items():
        package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module
                if node.level:
                    up = package.rsplit(".", node.level - 1)[0]
                    base = f"{up}.{base}" if base else up
                # `from a import b` names submodule a.b when it exists, else an attribute of a.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                # Importing a.b.missing still runs a.b, so charge the edge to the nearest real module.
                while target not in modules and "." in target:
                    target = target.rpartition(".")[0]
                if target in modules and target != importer:
                    edges.append((importer, target, path, node.lineno))
    return list(dict.fromkeys(edges))  # `from a import x, y` is one edge


def unlayered(modules: dict[str, Path], table: dict[str, int]) -> list[str]:
    missing = [m for m in modules if layer_of(m, table) is None]
    hint = f"modules with no layer (add them, or a package containing them, to the table in {DOC}): "
    return [hint + ", ".join(missing)] if missing else []


def upward_imports(edges, table: dict[str, int], base: Path) -> list[str]:
    bad = []
    for importer, imported, path, line in edges:
        low, high = layer_of(importer, table), layer_of(imported, table)
        if low is not None and high is not None and low < high:
            bad.append(f"  {path.relative_to(base)}:{line}: {importer} (layer {low}) -> {imported} (layer {high})")
    hint = f"lower layers import higher ones (move the code down, or change the table in {DOC}):\n"
    return [hint + "\n".join(bad)] if bad else []


def shortest_paths(start: str, graph: dict[str, set[str]]) -> dict[str, str]:
    """Module -> its predecessor on a shortest import path from start (start is a key only on a cycle)."""
    prev, todo = {}, [start]
    for node in todo:  # todo grows while we walk it, which makes this a breadth-first search
        for nxt in sorted(graph[node]):
            if nxt not in prev:
                prev[nxt] = node
                todo.append(nxt)
    return prev


def cycles(edges, modules: dict[str, Path], base: Path) -> list[str]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    where: dict[tuple[str, str], str] = {}
    for importer, imported, path, line in edges:
        graph[importer].add(imported)
        where.setdefault((importer, imported), f"{path.relative_to(base)}:{line}")
    # Strongly connected components as mutually reachable sets: quadratic, but a package has only
    # dozens of modules, and the same search yields a shortest cycle to show for each component.
    paths = {m: shortest_paths(m, graph) for m in graph}
    found, seen = [], set()
    for module in sorted(graph):
        if module in paths[module] and module not in seen:
            component = sorted(m for m in paths[module] if module in paths[m])
            seen.update(component)
            chain = [module]
            while len(chain) == 1 or chain[-1] != module:
                chain.append(paths[module][chain[-1]])
            chain.reverse()
            steps = "\n".join(f"    {where[a, b]}: {a} imports {b}" for a, b in zip(chain, chain[1:]))
            found.append(f"import cycle among {component}:\n  {' -> '.join(chain)}\n{steps}")
    return found


def check(pkg_dir: Path, doc_text: str) -> list[str]:
    """Every broken rule as a readable message; empty when the package matches the table."""
    try:
        table = parse_layers(doc_text)
    except ValueError as err:
        return [str(err)]
    modules = find_modules(pkg_dir)
    edges = import_edges(modules)
    base = pkg_dir.parent
    return unlayered(modules, table) + upward_imports(edges, table, base) + cycles(edges, modules, base)


def test_real_package_follows_layer_table():
    doc = ROOT / DOC
    if not doc.exists():
        pytest.fail(f"{DOC} is missing; it must hold the '## Layers' table this test checks", pytrace=False)
    problems = check(ROOT / "dynmo", doc.read_text())
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


@pytest.mark.parametrize("module", ["dynmo.engine", "dynmo.controller"])
def test_below_the_simulator_nothing_of_it_is_imported(module):
    # The import graph above charges `import a.b.c` to a.b.c alone, but Python also runs the
    # packages a and a.b first: a fresh interpreter shows what an import really runs.
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[:2] == ['dynmo', 'sim']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", f"importing {module} imports {out.stdout.strip()}"


def make_package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(source))
    return tmp_path / "pkg"


def table(*rows: str) -> str:
    # The table under the following heading must be ignored: it would give every module layer 9.
    return ("## Layers\n\n| Layer | Modules | Notes |\n|---|---|---|\n" + "\n".join(rows)
            + "\n\n## Other\n| 9 | `pkg` | |\n")


def test_synthetic_reports_cycle_through_type_checking_import(tmp_path):
    pkg = make_package(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import B\n", "pkg/b.py": """\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from pkg.a import A
        """})
    [problem] = check(pkg, table("| 0 | `pkg` | everything |"))
    assert "pkg.a -> pkg.b -> pkg.a" in problem and "pkg/b.py:3" in problem


def test_synthetic_reports_upward_import_inside_function(tmp_path):
    pkg = make_package(tmp_path, {"pkg/__init__.py": "", "pkg/high.py": "",
                                  "pkg/low.py": "def f():\n    from pkg import high\n"})
    [problem] = check(pkg, table("| 0 | `pkg`, `pkg.low` | |", "| 1 | `pkg.high` | |"))
    assert "pkg/low.py:2: pkg.low (layer 0) -> pkg.high (layer 1)" in problem


def test_synthetic_reports_module_missing_from_table(tmp_path):
    pkg = make_package(tmp_path, {"pkg/__init__.py": "", "pkg/known.py": "", "pkg/extra.py": ""})
    [problem] = check(pkg, table("| 0 | `pkg.known` | |"))
    assert "pkg, pkg.extra" in problem and DOC in problem


@pytest.mark.parametrize("files, chain", [
    # A package __init__ re-exporting from a submodule that reaches back into the package.
    ({"pkg/__init__.py": "", "pkg/sub/__init__.py": "from .x import thing\nhelper = 1\n",
      "pkg/sub/x.py": "from . import helper\nthing = helper\n"}, "pkg.sub -> pkg.sub.x -> pkg.sub"),
    # Two dots climb out of the subpackage; the try/except must not hide the import.
    ({"pkg/__init__.py": "", "pkg/top.py": "from .sub.deep import d\n", "pkg/sub/__init__.py": "",
      "pkg/sub/deep.py": "try:\n    from ..top import t\nexcept ImportError:\n    t = None\n"},
     "pkg.sub.deep -> pkg.top -> pkg.sub.deep"),
])
def test_synthetic_reports_relative_import_cycle(tmp_path, files, chain):
    [problem] = check(make_package(tmp_path, files), table("| 0 | `pkg` | |"))
    assert chain in problem


def test_synthetic_clean_package_reports_nothing(tmp_path):
    pkg = make_package(tmp_path, {
        "pkg/__init__.py": "from .sim.cli import main\n",
        "pkg/base.py": "try:\n    import json\nexcept ImportError:\n    json = None\n",
        "pkg/report.py": "import pkg.base\n",
        "pkg/sim/__init__.py": "from .engine import run\n",
        "pkg/sim/engine.py": "from typing import TYPE_CHECKING\nfrom ..base import json\n"
                             "if TYPE_CHECKING:\n    from pkg import base\n",
        # Only the more specific `pkg.sim.cli` entry lets this module import a layer-2 one.
        "pkg/sim/cli.py": "from pkg import report\n\ndef main():\n    from pkg.sim import run\n",
    })
    doc = table("| 0 | `pkg.base` | |", "| 1 | `pkg.sim` | |", "| 2 | `pkg.sim.cli`, `pkg.report` | |",
                "| 3 | `pkg` | |")
    assert check(pkg, doc) == []
