"""Nothing in the tree turns bytes into objects with pickle, marshal, eval or exec.

Every Python file git knows (services, tests, tools) is parsed and its syntax tree searched
for: imports of pickle-family modules (pickle, cPickle, _pickle, marshal, shelve, dill,
cloudpickle, joblib, jsonpickle), calls of the builtins eval / exec / compile /
__import__, torch.load without weights_only=True, numpy.load with allow_pickle=True, and
yaml.load / yaml.unsafe_load. The data path and the control plane parse only protobuf, JSON
and fixed binary headers (struct), so none of these has a reason to exist here. The checker
is itself checked against snippets that must be caught.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "shelve", "dill", "cloudpickle",
                  "joblib", "jsonpickle"}
UNSAFE_BUILTINS = {"eval", "exec", "compile", "__import__"}


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def findings(source: str, name: str = "<snippet>") -> list[str]:
    """Every unsafe deserialisation in `source`, as 'name:line: what'."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found += [f"{name}:{node.lineno}: import {a.name}" for a in node.names
                      if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UNSAFE_MODULES:
                found.append(f"{name}:{node.lineno}: from {node.module} import")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in UNSAFE_BUILTINS:
                found.append(f"{name}:{node.lineno}: {func.id}()")
            elif isinstance(func, ast.Attribute):
                owner = func.value.id if isinstance(func.value, ast.Name) else ""
                what = f"{owner}.{func.attr}"
                if what == "torch.load" and not _is_true(_keyword(node, "weights_only")):
                    found.append(f"{name}:{node.lineno}: torch.load without weights_only=True")
                elif what in ("np.load", "numpy.load") and _is_true(
                        _keyword(node, "allow_pickle")):
                    found.append(f"{name}:{node.lineno}: {what}(allow_pickle=True)")
                elif what in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
                    found.append(f"{name}:{node.lineno}: {what}")
                elif func.attr in ("loads", "load") and owner in UNSAFE_MODULES:
                    found.append(f"{name}:{node.lineno}: {what}")
    return found


def python_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard", "*.py"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    return [ROOT / p for p in listed if p and (ROOT / p).is_file()]


@pytest.mark.parametrize("snippet", [
    "import pickle\npickle.loads(b'')",
    "from marshal import loads",
    "import cloudpickle as cp",
    "eval(request.text)",
    "exec(code)",
    "obj = torch.load(path)",
    "obj = torch.load(path, weights_only=False)",
    "arr = np.load(f, allow_pickle=True)",
    "cfg = yaml.load(text)",
])
def test_the_checker_catches(snippet: str) -> None:
    assert findings(snippet), snippet


@pytest.mark.parametrize("snippet", [
    "model.eval()",
    "torch.load(path, weights_only=True)",
    "np.load(f)",
    "json.loads(body)",
    "yaml.safe_load(text)",
    "re.compile('x')",
])
def test_the_checker_lets_safe_code_be(snippet: str) -> None:
    assert findings(snippet) == []


def test_nothing_in_the_tree_deserialises_with_pickle_marshal_or_eval() -> None:
    files = python_files()
    assert any(p.name == "tcp.py" for p in files) and len(files) > 50  # really the tree
    found = [f for p in files for f in findings(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []
