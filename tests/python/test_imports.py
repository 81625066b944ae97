"""The package's imports point one way: no import loop between its modules, and the library
never imports the experiments (kvbridge.experiments). docs/architecture.md draws the order.

Imports are read from the source with ast, every one of them: at module level, inside functions
and under ``if TYPE_CHECKING``, so that a lazy import cannot hide a loop. The command-line entry
points (kvbridge.cli, kvbridge.__main__) are the only modules outside the experiments that may
name them: ``kvbridge eval`` and ``kvbridge demo`` run them.
"""
import ast
import pathlib
from typing import Dict, List, Set

import pytest

PACKAGE_DIR = pathlib.Path(__file__).resolve().parents[2] / "python" / "kvbridge"


def module_files(root: pathlib.Path, package: str) -> Dict[str, pathlib.Path]:
    """Module name -> source file of every .py file under `root` (a package named `package`)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package] + parts)] = path
    return out


def _is_module(root: pathlib.Path, package: str, name: str) -> bool:
    """Whether dotted `name` (inside `package`) is a module of the package: a .py file, a
    package folder, or a compiled module with its .pyi stub (kvbridge._core)."""
    rel = pathlib.Path(*name.split(".")[1:]) if name != package else pathlib.Path()
    base = root / rel
    return (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
            or base.with_suffix(".pyi").is_file())


def import_graph(root: pathlib.Path, package: str) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (anywhere in its source). ``from p import x``
    counts as importing p.x when x is a module, else as importing p."""
    modules = module_files(root, package)
    graph: Dict[str, Set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        targets: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    sub = f"{source}.{alias.name}"
                    targets.add(sub if _is_module(root, package, sub) else source)
        graph[name] = {t for t in targets
                       if (t == package or t.startswith(package + ".")) and t != name}
    return graph


def import_loops(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    loops: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return loops


def library_to_experiments(graph: Dict[str, Set[str]], package: str) -> List[str]:
    """"module -> experiment module" for every library module that imports the experiments."""
    experiments = f"{package}.experiments"
    inside = lambda m: m == experiments or m.startswith(experiments + ".")
    entry_points = {f"{package}.cli", f"{package}.__main__"}
    return sorted(f"{m} -> {t}" for m, targets in graph.items()
                  if not inside(m) and m not in entry_points for t in targets if inside(t))


def test_the_package_has_no_import_loop():
    graph = import_graph(PACKAGE_DIR, "kvbridge")
    assert "kvbridge.hf" in graph and "kvbridge.experiments.eval" in graph
    assert import_loops(graph) == []


def test_the_library_never_imports_the_experiments():
    assert library_to_experiments(import_graph(PACKAGE_DIR, "kvbridge"), "kvbridge") == []


def test_model_calls_come_from_the_library():
    """The serving path's model calls are the library's: monitor and quality import them from
    kvbridge.hf, and the experiments use the same."""
    graph = import_graph(PACKAGE_DIR, "kvbridge")
    assert "kvbridge.hf" in graph["kvbridge.quality"]
    assert "kvbridge.hf" in graph["kvbridge.experiments.eval"]


def _write(root: pathlib.Path, files: Dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("a_imports_b", [
    "from pkg import b\n",
    "def later():\n    from pkg.b import thing\n    return thing\n",   # inside a function
    "from . import b\n",                                              # relative
    "import pkg.b as bee\n",
])
def test_a_planted_loop_is_found(tmp_path, a_imports_b):
    root = _write(tmp_path, {"__init__.py": "", "a.py": a_imports_b,
                             "b.py": "from pkg.c import x\n",
                             "c.py": "def f():\n    import pkg.a\n",
                             "d.py": "from pkg import a\n"})
    graph = import_graph(root, "pkg")
    assert import_loops(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_no_loop_is_found_where_imports_point_one_way(tmp_path):
    root = _write(tmp_path, {"__init__.py": "from pkg import b\n", "a.py": "from pkg import b\n",
                             "b.py": "import os\nfrom pkg.c import x\n", "c.py": "x = 1\n"})
    assert import_loops(import_graph(root, "pkg")) == []


def test_a_planted_library_import_of_the_experiments_is_found(tmp_path):
    root = _write(tmp_path, {"__init__.py": "", "cli.py": "from pkg.experiments import run\n",
                             "lib.py": "def f():\n    from pkg.experiments.run import main\n",
                             "ok.py": "from pkg import lib\n",
                             "experiments/__init__.py": "",
                             "experiments/run.py": "from pkg import lib\n"})
    assert library_to_experiments(import_graph(root, "pkg"), "pkg") == [
        "pkg.lib -> pkg.experiments.run"]
