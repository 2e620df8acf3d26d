"""The package's layering, checked from the source (docs/architecture.md draws it).

Every module sits in one layer of `LAYERS`; it may import modules of its own layer or of the layers
before it, never one after it (imports inside functions count: a lazy import is still a dependency),
and no chain of imports may come back to where it started. A new module must be placed in a layer
here, which is where its author decides what it may depend on. No file of the package, the tests or
the README is over 500 lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "headstart"
MAX_LINES = 500
ONLY_ITSELF = ("headstart", "headstart.engines")

# Lowest first. A name is a module or a package (a package covers its modules unless one of them is
# named on its own; the packages in ONLY_ITSELF, only their __init__: the root's version, engines/ whose
# modules sit in different layers); the longest name that matches a module places it. Imports written
# as strings (importlib.import_module, __import__) are not seen.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("headstart", "headstart.errors", "headstart.console", "headstart.fileio", "headstart.hardware",
              "headstart.config", "headstart.recipe_io", "headstart.launch", "headstart.assets",
              "headstart.eval_report", "headstart.sizing")),
    ("kernels", ("headstart.kernels",)),
    ("nn", ("headstart.nn",)),
    ("models", ("headstart.models",)),
    ("data", ("headstart.data",)),
    ("heads", ("headstart.heads",)),
    ("inference", ("headstart.inference",)),
    ("export", ("headstart.export",)),
    # vLLM in its own interpreter: running it, and a session regenerate drives (files and a pipe)
    ("engines", ("headstart.engines.vllm_runner", "headstart.engines.vllm_session", "headstart.engines.vllm_worker")),
    ("plan", ("headstart.plan",)),
    ("precompute", ("headstart.precompute",)),
    ("eval", ("headstart.evaluate", "headstart.engines.vllm_eval")),
    ("train", ("headstart.train",)),
    ("app", ("headstart.cli", "headstart.commands", "headstart.commands_engine", "headstart.quickstart_summary",
             "headstart.engines")),
]


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(importer, imported module of the package, line) for every import statement, lazy ones included."""
    edges = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.append((name, target, node.lineno))
    return edges


def layer_of(module: str) -> int | None:
    best, found = -1, None
    for rank, (_, names) in enumerate(LAYERS):
        for n in names:
            covers = module == n or (n not in ONLY_ITSELF and module.startswith(n + "."))
            if covers and len(n) > best:
                best, found = len(n), rank
    return found


def cycles(edges: list[tuple[str, str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b, _ in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(edges: list[tuple[str, str, int]], modules: dict[str, Path]) -> list[str]:
    bad = []
    for a, b, line in edges:
        la, lb = layer_of(a), layer_of(b)
        if la is not None and lb is not None and lb > la:
            bad.append(f"{modules[a].relative_to(ROOT)}:{line}: {a} ({LAYERS[la][0]}) imports {b} ({LAYERS[lb][0]})")
    return bad


def test_every_module_has_a_layer():
    missing = [m for m in module_names() if layer_of(m) is None]
    assert not missing, f"place these modules in a layer of tests/test_layering.py LAYERS: {missing}"


def test_no_module_imports_a_layer_above_its_own():
    modules = module_names()
    bad = upward(imports(modules), modules)
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


def test_no_import_circle():
    found = cycles(imports(module_names()))
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_file_over_500_lines():
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), ROOT / "README.md"]
    long = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them along a seam): {long}"


def test_the_checks_see_a_circle_and_an_upward_import(tmp_path):
    """The checker itself: a planted circle and a planted upward import are both reported."""
    pkg = tmp_path / "headstart"
    (pkg / "nn").mkdir(parents=True)
    (pkg / "train").mkdir()
    for f in ("__init__.py", "nn/__init__.py", "train/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "nn" / "a.py").write_text("from headstart.nn import b\nfrom headstart.train import loop\n")
    (pkg / "nn" / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "train" / "loop.py").write_text("import headstart.nn.a\n")
    modules = module_names(pkg)
    edges = imports(modules)
    assert ("headstart.nn.b", "headstart.nn.a", 2) in edges  # a relative, lazy import is seen
    assert ["headstart.nn.a", "headstart.nn.b", "headstart.train.loop"] in cycles(edges)
    bad = upward(edges, {m: ROOT / p.relative_to(tmp_path) for m, p in modules.items()})
    assert len(bad) == 1 and "headstart.nn.a (nn) imports headstart.train.loop (train)" in bad[0]
    assert layer_of("headstart.brand_new") is None and layer_of("headstart") == 0  # an unplaced module is named
    assert layer_of("headstart.engines.brand_new") is None


def test_no_benchmark_script_shadows_an_installed_package():
    """A benchmark script runs with benchmarks/ first on sys.path (and two tests load benchmarks/common.py):
    a script named like an installed package would be imported in its place (transformers 5.25 imports the
    `kernels` package, which benchmarks/kernels.py shadowed: every test after the first import failed)."""
    from importlib.metadata import packages_distributions

    installed = set(packages_distributions())
    clash = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem in installed)
    assert not clash, f"benchmarks/ scripts named like installed packages (rename them): {clash}"
