"""The import graph of the packages: no cycles, and the layers import one way (DESIGN.md section 1).

Read from the source (``ast``), nothing imported: every ``import`` and ``from ... import`` of every
module of ``titan_kernels``, ``trainer`` and ``bench``, at any depth (an import inside a function
or under ``TYPE_CHECKING`` is a dependency all the same: deferring it hides a cycle, it does not
remove it), plus ``__import__("x")`` / ``importlib.import_module("x")`` with a literal name.
``from package import name`` depends on ``package.name`` when that is a module, else on the package.

Layers, highest first: ``bench`` -> ``trainer`` -> ``titan_kernels`` (its public surface: the
package itself, ``nn``, ``patch``) -> ``titan_kernels.ops`` ->
the kernels and what they stand on (``triton``, ``reference``, the native extension, ``backend``,
``attention_mask``, any other module of ``titan_kernels``). A module may import its own layer
or any below it, never one above.

The trainer uses the kernel library through its public modules alone (``PUBLIC_KERNEL_MODULES``):
no import of any other module of ``titan_kernels``, and no attribute path through one
(``titan_kernels.ops.x`` after ``import titan_kernels``). What it needs is exported there.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("titan_kernels", "trainer", "bench")
# Built from csrc/, not a .py file: a module all the same (``from titan_kernels import _C``).
NATIVE_MODULES = ("titan_kernels._C",)

_SURFACE = {"titan_kernels", "titan_kernels.nn", "titan_kernels.patch"}
# The modules of the kernel library the trainer may import (their own names, not their submodules).
PUBLIC_KERNEL_MODULES = frozenset(_SURFACE)


def layer(module: str) -> tuple[int, str]:
    """(rank, name) of the layer ``module`` belongs to; a higher rank may import a lower one."""
    top = module.split(".")[0]
    if top == "bench":
        return 4, "bench"
    if top == "trainer":
        return 3, "trainer"
    if module in _SURFACE or any(module.startswith(s + ".") for s in _SURFACE - {"titan_kernels"}):
        return 2, "titan_kernels (nn, public surface)"
    if module == "titan_kernels.ops" or module.startswith("titan_kernels.ops."):
        return 1, "titan_kernels.ops"
    return 0, "kernels (triton, reference, native, backend)"


def modules(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path | None]:
    """Dotted name -> source file of every module of ``PACKAGES`` (None: a native extension)."""
    out: dict[str, pathlib.Path | None] = dict.fromkeys(NATIVE_MODULES)
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imported_names(tree: ast.AST, package: str):
    """Every dotted name the module imports, as written (relative imports resolved against ``package``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            # ``source.name``: the longest prefix that is a module is what the import depends on.
            yield from (source if alias.name == "*" else f"{source}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in ("__import__", "import_module") and isinstance(node.args[0].value, str):
                yield node.args[0].value


def _attribute_paths(tree: ast.AST, root_name: str):
    """Every dotted attribute path rooted at the name ``root_name`` (``titan_kernels.ops.x.y``), longest only."""
    inner = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            inner.add(id(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == root_name:
                yield ".".join([root_name, *reversed(parts)])


def _longest_module(name: str, mods) -> str:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name


def private_kernel_uses(root: pathlib.Path = ROOT) -> list[str]:
    """'module: kernel module' for every use from ``trainer`` of a ``titan_kernels`` module outside
    ``PUBLIC_KERNEL_MODULES``: imported (at any depth, as ``import_graph`` reads them) or reached by
    an attribute path from the package name."""
    mods = modules(root)
    found = []
    for name, path in sorted(mods.items()):
        if path is None or not name.startswith("trainer"):
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        used = {_longest_module(i, mods) for i in _imported_names(tree, package) if i.split(".")[0] == "titan_kernels"}
        used |= {_longest_module(p, mods) for p in _attribute_paths(tree, "titan_kernels")}
        found += [f"{name}: {m}" for m in sorted(used) if m and m not in PUBLIC_KERNEL_MODULES]
    return found


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package modules it imports (see the module docstring)."""
    mods = modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        graph[name] = set()
        if path is None:
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for imported in _imported_names(ast.parse(path.read_text(encoding="utf-8"), str(path)), package):
            # The longest prefix that is a module: ``from pkg import fn`` names pkg, ``from pkg import mod`` pkg.mod.
            target = imported
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _describe(component: set[str], graph: dict[str, set[str]]) -> str:
    return "; ".join(f"{m} -> {', '.join(sorted(graph[m] & component))}" for m in sorted(component))


def test_the_graph_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "trainer"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "b.py", "c.py", "d.py", "sub/__init__.py", "sub/e.py"):
        (pkg / name).write_text("")
    (pkg / "a.py").write_text("import trainer.b\ndef f():\n    from trainer import c\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from trainer.d import X\n")
    (pkg / "c.py").write_text("x = __import__('trainer.sub.e', fromlist=['y'])\n")
    (pkg / "sub" / "e.py").write_text("from .. import a\nfrom . import missing_name\n")
    graph = import_graph(tmp_path)
    assert graph["trainer.a"] == {"trainer.b", "trainer.c"}
    assert graph["trainer.b"] == {"trainer.d"}
    assert graph["trainer.c"] == {"trainer.sub.e"}
    assert graph["trainer.sub.e"] == {"trainer.a", "trainer.sub"}
    assert cycles(graph) == [{"trainer.a", "trainer.c", "trainer.sub.e"}]


def test_no_import_cycles():
    graph = import_graph()
    assert "trainer.train" in graph and "titan_kernels.ops.rms_norm" in graph and "bench.common" in graph
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(_describe(c, graph) for c in found)


def test_imports_flow_down_the_layers():
    graph = import_graph()
    upward = [f"{a} ({layer(a)[1]}) imports {b} ({layer(b)[1]})"
              for a in sorted(graph) for b in sorted(graph[a]) if layer(b)[0] > layer(a)[0]]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)
    # The layers as the trainer uses them: through the public surface and the ops, never bench.
    assert any(layer(b)[0] == 2 for a in graph if a.startswith("trainer.") for b in graph[a])


# The trainer's floors, lowest first (DESIGN.md section 1): a unit (a top-level module, a package, or
# one family's folder) may import its own floor or any below. The registry sits low: families import
# ModelSpec from it and it loads them by name, so nothing climbs to find a family. A new unit gets a
# floor here; the test fails on a unit without one.
TRAINER_FLOORS = {
    "errors": 0,
    "registry": 1,
    "config": 2, "data": 2, "environment": 2,
    "models": 3, "models.common": 3, "observe": 3,
    "hf": 4, "parallel": 4, "optim": 4, "run": 4,
    "models.*": 5, "estimate": 5, "float8": 5, "checkpoint": 5,
    "step": 6, "evaluate": 6, "task": 6,
    "train": 7, "convert": 7, "plan": 7, "plot": 7, "__main__": 7, "generate": 7, "eval": 7,
}


def trainer_unit(module: str) -> str | None:
    """The unit of a ``trainer`` module (``trainer.checkpoint.folder`` -> ``checkpoint``,
    ``trainer.models.llama3.hf`` -> ``models.llama3``), None outside the trainer or for the package itself."""
    parts = module.split(".")
    if parts[0] != "trainer" or len(parts) == 1:
        return None
    if parts[1] == "models" and len(parts) > 2:
        return f"models.{parts[2]}"
    return parts[1]


def trainer_floor(unit: str) -> int | None:
    if unit in TRAINER_FLOORS:
        return TRAINER_FLOORS[unit]
    return TRAINER_FLOORS["models.*"] if unit.startswith("models.") and unit != "models.common" else None


def test_trainer_imports_flow_down_its_floors():
    graph = import_graph()
    units = {u for m in graph if (u := trainer_unit(m))}
    assert {"registry", "errors", "checkpoint", "models.common", "models.llama3"} <= units
    unassigned = sorted(u for u in units if trainer_floor(u) is None)
    assert not unassigned, f"trainer units without a floor in TRAINER_FLOORS: {unassigned}"
    upward = sorted({f"{a} (floor {trainer_floor(trainer_unit(a))}) imports {b} (floor {trainer_floor(trainer_unit(b))})"
                     for a in graph for b in graph[a]
                     if trainer_unit(a) and trainer_unit(b) and trainer_unit(a) != trainer_unit(b)
                     and trainer_floor(trainer_unit(b)) > trainer_floor(trainer_unit(a))})
    assert not upward, "trainer imports against its floors:\n" + "\n".join(upward)


def test_the_private_kernel_check_sees_imports_and_attribute_paths(tmp_path):
    for name in ("titan_kernels/__init__.py", "titan_kernels/nn/__init__.py", "titan_kernels/ops/__init__.py",
                 "titan_kernels/ops/x.py", "trainer/__init__.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "trainer" / "a.py").write_text("import titan_kernels\nfrom titan_kernels.nn import RMSNorm\n"
                                               "y = titan_kernels.rms_norm\n")
    assert private_kernel_uses(tmp_path) == []
    (tmp_path / "trainer" / "b.py").write_text("def f():\n    from titan_kernels.ops.x import g\n")
    (tmp_path / "trainer" / "c.py").write_text("import titan_kernels\nh = titan_kernels.ops.x.h\n")
    assert private_kernel_uses(tmp_path) == ["trainer.b: titan_kernels.ops.x", "trainer.c: titan_kernels.ops.x"]


def test_the_trainer_uses_only_the_public_kernel_api():
    found = private_kernel_uses()
    assert not found, ("the trainer uses private modules of titan_kernels (export what it needs from "
                       f"{sorted(PUBLIC_KERNEL_MODULES)}):\n" + "\n".join(found))
