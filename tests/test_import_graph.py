"""The house's imports run one way: layouts -> ops core -> units -> transfer -> adapters ->
the package face. Read from the sources (``ast``), so a circle or an upward import is found
whether or not a test happens to import that path: no cycle among the package's modules, no
module importing from the ``canonical_ops`` face (``from .. import X``: the face is lazy,
imports the standalone engine, and is for users), each import into the same or a lower layer.
Imports under ``if TYPE_CHECKING:`` do not run and are not counted; imports inside functions
do (they run on first use)."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("layouts", "canonical_ops")
FACE = "canonical_ops"  # canonical_ops/__init__.py: the public face, above every adapter
NATIVE = ("canonical_ops._C", "canonical_ops._unitio")  # setup.py's extension modules

# Lowest first; a module's layer is that of its longest listed prefix (every module must
# have one). An import may go to the module's own layer or a lower one.
LAYERS = {
    "layouts": 0,
    "canonical_ops._lazy": 1,  # ops core
    "canonical_ops._C": 1,
    "canonical_ops._extension": 1,
    "canonical_ops.checks": 1,
    "canonical_ops.ops": 1,
    "canonical_ops.plan": 1,
    "canonical_ops._unitio": 2,  # units (its native I/O)
    "canonical_ops.units": 2,
    "canonical_ops.transfer": 3,
    "canonical_ops.engine": 4,  # adapters
    "canonical_ops.vllm": 4,
    "canonical_ops.sglang": 4,
    "canonical_ops.demo": 4,
    "canonical_ops.frontend": 4,
    "canonical_ops.__main__": 4,
    FACE: 5,
}
LAYER_NAMES = ("layouts", "ops core", "units", "transfer", "adapters", "package face")


def modules() -> dict[str, tuple[str, bool]]:
    """Module name -> (source path, is a package ``__init__``)."""
    found = {}
    for package in PACKAGES:
        for folder, dirs, files in os.walk(os.path.join(REPO, package)):
            dirs[:] = [d for d in dirs if not d.startswith((".", "__pycache__"))]
            for name in (f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                is_package = dotted.endswith(".__init__")
                found[dotted.removesuffix(".__init__")] = (path, is_package)
    return found


def _type_checking_only(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif _type_checking_only(node):  # its body never runs; an ``else:`` always does
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
        else:
            yield from _imports(node)


def imports(found: dict[str, tuple[str, bool]]) -> Iterator[tuple[str, str, str, int]]:
    """``(importer, imported module, the package a from-import reads, line)`` for every
    import of the project's packages (an attribute import counts as one of its module)."""
    known = set(found) | set(NATIVE)
    for name, (path, is_package) in sorted(found.items()):
        package = name if is_package else name.rpartition(".")[0]
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PACKAGES:
                        yield name, alias.name, "", node.lineno
                continue
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if source.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield name, sub if sub in known else source, source, node.lineno


def layer(name: str) -> int:
    prefixes = [p for p in LAYERS if name == p or name.startswith(p + ".")]
    assert prefixes, f"{name}: in no layer of LAYERS (place the new module there)"
    return LAYERS[max(prefixes, key=len)]


def test_every_module_has_a_layer() -> None:
    for name in modules():
        layer(name)


def test_no_module_imports_the_package_face() -> None:
    """``from .. import ops`` / ``import canonical_ops`` inside the package: the name comes
    through the lazy face; take it from the module that owns it (``from ..ops import load``)."""
    found = modules()
    bad = [
        f"{importer}:{line} imports from the {FACE} face ({target})"
        for importer, target, source, line in imports(found)
        if importer != FACE and FACE in (source, target)
    ]
    assert not bad, "\n".join(bad)


def test_imports_run_one_way() -> None:
    bad = []
    for importer, target, _, line in imports(modules()):
        if layer(target) > layer(importer):
            bad.append(
                f"{importer}:{line} ({LAYER_NAMES[layer(importer)]}) imports {target} "
                f"({LAYER_NAMES[layer(target)]})"
            )
    assert not bad, "\n".join(bad)


def test_no_import_cycle() -> None:
    found = modules()
    graph: dict[str, set[str]] = {name: set() for name in found}
    for importer, target, _, _ in imports(found):
        if target in graph and target != importer:
            graph[importer].add(target)
    # Tarjan's strongly connected components: a component of more than one module is a cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checks_find_what_they_forbid(tmp_path, monkeypatch) -> None:
    """The checks themselves: a circle, a face import and an upward import in a small tree."""
    package = tmp_path / "canonical_ops"
    (package / "units").mkdir(parents=True)
    (package / "__init__.py").write_text("from . import ops\n")
    (package / "ops.py").write_text("from .units import a\n")  # ops core -> units: upward
    (package / "units" / "__init__.py").write_text("")
    (package / "units" / "a.py").write_text("from .b import x\nfrom .. import ops\n")
    (package / "units" / "b.py").write_text("def f():\n    from .a import y\n")
    (tmp_path / "layouts").mkdir()
    (tmp_path / "layouts" / "__init__.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import canonical_ops\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    edges = {(i, t) for i, t, _, _ in imports(modules())}
    assert ("canonical_ops.ops", "canonical_ops.units.a") in edges
    assert ("canonical_ops.units.a", "canonical_ops.ops") in edges
    assert ("canonical_ops.units.b", "canonical_ops.units.a") in edges  # inside a function
    assert not any(i == "layouts" for i, _ in edges)  # TYPE_CHECKING only
    for check in (test_no_module_imports_the_package_face, test_imports_run_one_way):
        try:
            check()
        except AssertionError as error:
            assert "canonical_ops.units.a:2" in str(error) or "canonical_ops.ops:1" in str(error)
        else:
            raise AssertionError(f"{check.__name__} passed a tree that breaks it")
    try:
        test_no_import_cycle()
    except AssertionError as error:
        assert "canonical_ops.units.a <-> canonical_ops.units.b" in str(error)
    else:
        raise AssertionError("test_no_import_cycle passed a tree with a cycle")


# Lazy re-exports (``_lazy.lazy_exports``) are imports too, run on first access of a name: a
# child process records every package's map as the package is imported (nothing of this
# test process is re-imported).
_RECORD_LAZY = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("canonical_ops._lazy", sys.argv[1])
lazy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lazy)
found, real = [], lazy.lazy_exports
def recording(package, namespace, exports):
    found.extend((package, module) for module in sorted(set(exports.values())))
    return real(package, namespace, exports)
lazy.lazy_exports = recording
sys.modules["canonical_ops._lazy"] = lazy
for name in sys.argv[2:]:
    __import__(name)
print(json.dumps(found))
"""


def lazy_imports(packages: list[str]) -> list[tuple[str, str]]:
    """``(package, module it re-exports from)`` for every lazy map of ``packages``."""
    lazy = os.path.join(REPO, "canonical_ops", "_lazy.py")
    argv = [sys.executable, "-c", _RECORD_LAZY, lazy, *packages]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [
        (package, importlib.util.resolve_name(module, package))
        for package, module in json.loads(done.stdout)
    ]


def test_lazy_re_exports_run_one_way() -> None:
    """``engine/__init__`` maps names to ``..units``, ``frontend`` to ``..engine``: a map from
    a lower layer to a higher one (or to the face) is an upward import run on first use."""
    found = modules()
    packages = sorted(name for name, (_, is_package) in found.items() if is_package)
    lazy = lazy_imports([p for p in packages if not p.startswith("canonical_ops.vllm.")])
    assert ("canonical_ops.engine", "canonical_ops.units") in lazy  # the recorder sees them
    bad = [
        f"{package} re-exports lazily from {target} ({LAYER_NAMES[layer(target)]})"
        for package, target in lazy
        if layer(target) > layer(package) or (package != FACE and target == FACE)
    ]
    assert not bad, "\n".join(bad)


def test_an_import_in_the_else_of_type_checking_counts(tmp_path, monkeypatch) -> None:
    """``if TYPE_CHECKING: ... else: from ..engine import x``: the ``else`` runs; the check
    used to skip the whole ``if``."""
    package = tmp_path / "canonical_ops"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "engine.py").write_text("")
    (package / "ops.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import engine\n"
        "else:\n    from .engine import x\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", str(tmp_path))
    edges = {(i, t, line) for i, t, _, line in imports(modules())}
    assert edges == {("canonical_ops.ops", "canonical_ops.engine", 5)}
