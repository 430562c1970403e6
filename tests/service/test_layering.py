"""The direction of imports, enforced: each failure names the file, the line and the import.

- `common` imports no engine, worker or service package; the engine imports no grpc, stubs,
  UCX, worker or service package; `worker` (plumbing between engine and gRPC) imports no
  service package; kvtransfer never imports the engine or the worker plumbing.
- No package that runs in production imports `bench` (benchmarks, their rigs, loadgen): only
  the CLI (lazily, for `pdserve bench`) and tests do; `bench` itself may import anything.
- Service packages (router, prefill, decode, kvtransfer, colocated) never import each other.
- The router imports no torch, engine or worker code, so it starts fast from a small image.

Static rules read every module's imports (also those inside functions); third-party rules
import each package's modules in a fresh interpreter and name the pdserve module whose import
first pulled the forbidden one in.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.service

SERVICES_DIR = Path(__file__).resolve().parents[2] / "services"
SERVICES = ("router", "prefill", "decode", "kvtransfer", "colocated")
FORBIDDEN = {  # package -> pdserve packages it must not import
    "common": {"engine", "worker", "bench", *SERVICES},
    "engine": {"worker", "v1", "bench", *SERVICES},
    "worker": {"bench", *SERVICES},
    "kvtransfer": {"engine", "worker", "bench", *(set(SERVICES) - {"kvtransfer"})},
    "router": {"engine", "worker", "bench", *(set(SERVICES) - {"router"})},
    "prefill": {"bench", *(set(SERVICES) - {"prefill"})},
    "decode": {"bench", *(set(SERVICES) - {"decode"})},
    "colocated": {"bench", *(set(SERVICES) - {"colocated"})},
}
THIRD_PARTY = {  # package -> third-party modules it must not load, even indirectly
    "engine": ("grpc", "ucxx"),
    "router": ("torch",),
    "common": ("torch",),
}


def pdserve_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every `pdserve.*` import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("pdserve.")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "pdserve":
                found += [(node.lineno, f"pdserve.{a.name}") for a in node.names]
            elif node.module.startswith("pdserve."):
                found.append((node.lineno, node.module))
    return found


def violations(package: str) -> list[str]:
    out = []
    for path in sorted((SERVICES_DIR / package).rglob("*.py")):
        for line, module in pdserve_imports(path):
            target = module.split(".")[1]
            if target in FORBIDDEN[package]:
                out.append(f"services/{path.relative_to(SERVICES_DIR)}:{line} imports {module} "
                           f"({package} must not import pdserve.{target})")
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_pdserve_imports_follow_the_layers(package: str) -> None:
    assert violations(package) == []


def test_the_checker_names_an_offending_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from pdserve.engine.model import load_model\n")
    assert pdserve_imports(bad) == [(2, "pdserve.engine.model")]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_the_checker_names_a_benchmark_import(package: str, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / package).mkdir()
    (tmp_path / package / "bad.py").write_text(
        "import os\n\n\ndef f():\n    from pdserve.bench.kv_baselines import RawTcp\n")
    monkeypatch.setitem(globals(), "SERVICES_DIR", tmp_path)
    assert violations(package) == [f"services/{package}/bad.py:5 imports pdserve.bench."
                                   f"kv_baselines ({package} must not import pdserve.bench)"]


PROBE = textwrap.dedent("""
    import importlib, pkgutil, sys, traceback
    package, forbidden = sys.argv[1], set(sys.argv[2:])
    culprits = {}

    class Watch:
        def find_spec(self, name, path=None, target=None):
            root = name.split(".")[0]
            if root in forbidden and root not in culprits:
                frames = [f for f in traceback.extract_stack()
                          if "/services/" in f.filename and "/v1/" not in f.filename]
                where = frames[-1] if frames else None
                culprits[root] = (f"{where.filename.split('/services/')[-1]}:{where.lineno}"
                                  if where else "?")
            return None

    sys.meta_path.insert(0, Watch())
    pkg = importlib.import_module(f"pdserve.{package}")
    for info in pkgutil.walk_packages(pkg.__path__, f"pdserve.{package}."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    bad = sorted(m for m in forbidden if m in sys.modules)
    print("; ".join(f"{m} (first imported at services/{culprits.get(m, '?')})" for m in bad))
""")


@pytest.mark.parametrize("package", sorted(THIRD_PARTY))
def test_no_forbidden_third_party_module_is_loaded(package: str) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, package, *THIRD_PARTY[package]],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", f"pdserve.{package} loads {done.stdout.strip()}"


def all_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every absolute import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def test_http_and_protobuf_stay_apart() -> None:
    """The router's HTTP front door never touches protobuf (it talks to the lifecycle's plain
    types), and the lifecycle never sees HTTP: both APIs share it, neither wraps the other."""
    router = SERVICES_DIR / "router"
    rules = [(sorted(router.glob("http_*.py")),
              ("pdserve.v1", "google.protobuf", "pdserve.router.servicer", "grpc.")),
             ([p for p in sorted(router.glob("*.py")) if not p.name.startswith("http_")
               and p.name != "main.py"], ("starlette", "uvicorn", "pdserve.router.http_"))]
    bad = [f"services/router/{path.name}:{line} imports {module}"
           for paths, forbidden in rules for path in paths
           for line, module in all_imports(path) if module.startswith(forbidden)]
    assert rules[0][0] and bad == []


# --- No import cycles: no module imports a module that imports it back, at any distance. ---
# Imports inside functions and under `if TYPE_CHECKING:` count too: when two modules need
# each other, one receives what it needs as a callable or a small Protocol (declared in its own
# module or a third one), as kvtransfer's sender and sinks hold their agent (owner.py).


def module_name(path: Path, root: Path) -> str:
    """`pdserve.x.y` for root/x/y.py, `pdserve.x` for root/x/__init__.py."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(("pdserve", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def import_graph(root: Path) -> dict[str, dict[str, list[int]]]:
    """module -> {pdserve module it imports: [lines]}, for every module under `root` (the
    `pdserve` package), counting imports at any depth (inside functions and under
    `if TYPE_CHECKING:` too). `from pdserve.x import y` counts as importing `pdserve.x.y`
    when y is a module, else `pdserve.x`."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, dict[str, list[int]]] = {}
    for module, path in paths.items():
        edges: dict[str, list[int]] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [(node.lineno, f"{node.module}.{a.name}"
                            if f"{node.module}.{a.name}" in paths else node.module)
                           for a in node.names]
            else:
                continue
            for line, target in targets:
                if target in paths and target != module:
                    edges.setdefault(target, [])
                    if line not in edges[target]:
                        edges[target].append(line)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, {}):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def describe_cycles(root: Path) -> list[str]:
    """One line per cycle: its modules, then each import inside it as file:line."""
    graph = import_graph(root)
    files = {module_name(p, root): p.relative_to(root.parent) for p in root.rglob("*.py")}
    out = []
    for component in cycles(graph):
        inside = [f"{files[source]}:{line} imports {target}"
                  for source in component
                  for target, lines in sorted(graph[source].items()) if target in component
                  for line in lines]
        out.append(f"{' <-> '.join(component)}: {'; '.join(inside)}")
    return out


def test_no_import_cycles() -> None:
    found = describe_cycles(SERVICES_DIR)
    assert not found, "import cycles under services/:\n" + "\n".join(found)


def test_the_checker_names_a_cycle(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "__init__.py").write_text("")
    (tmp_path / "a" / "one.py").write_text("from pdserve.a import two\n")
    (tmp_path / "a" / "two.py").write_text("import os\n\n\ndef f():\n"
                                            "    from pdserve.a.three import g\n")
    (tmp_path / "a" / "three.py").write_text("from typing import TYPE_CHECKING\n"
                                              "if TYPE_CHECKING:\n    import pdserve.a.one\n")
    (tmp_path / "a" / "alone.py").write_text("from pdserve.a import one\n")
    root = tmp_path.name
    assert describe_cycles(tmp_path) == [
        "pdserve.a.one <-> pdserve.a.three <-> pdserve.a.two: "
        f"{root}/a/one.py:1 imports pdserve.a.two; {root}/a/three.py:3 imports pdserve.a.one; "
        f"{root}/a/two.py:5 imports pdserve.a.three"]


# --- Files that fit on a few screens: no module over MAX_MODULE_LINES (generated stubs aside).

MAX_MODULE_LINES = 400


def long_modules(root: Path, limit: int = MAX_MODULE_LINES) -> list[str]:
    """`services/x/y.py: N lines` for every module under `root` longer than `limit`, except the
    generated stubs in v1/."""
    return [f"{path.relative_to(root.parent)}: {n} lines (limit {limit})"
            for path in sorted(root.rglob("*.py"))
            if path.relative_to(root).parts[0] != "v1"
            and (n := len(path.read_text().splitlines())) > limit]


def test_modules_fit_in_400_lines() -> None:
    assert long_modules(SERVICES_DIR) == []


def test_the_size_check_names_a_long_module(tmp_path: Path) -> None:
    root = tmp_path / "services"
    (root / "v1").mkdir(parents=True)
    (root / "v1" / "big_pb2.py").write_text("x = 1\n" * 500)
    (root / "short.py").write_text("x = 1\n" * 400)
    (root / "long.py").write_text("x = 1\n" * 401)
    assert long_modules(root) == ["services/long.py: 401 lines (limit 400)"]
