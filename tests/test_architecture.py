"""The package's shape: one runner, one body per loss, layers that only look down."""

from __future__ import annotations

import ast
import pathlib
from typing import Callable, Dict, List, Set

import flashcl

ROOT = pathlib.Path(flashcl.__file__).parent
FILES = {p: p.read_text() for p in ROOT.rglob("*.py")}


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in FILES}


def _imports(name: str) -> Set[str]:
    """The flashcl modules ``name`` imports, at any depth of its source (inside
    functions and ``TYPE_CHECKING`` blocks too); ``from pkg import a`` counts as an
    import of the module ``pkg.a`` when ``a`` is one, else of ``pkg``."""
    path = MODULES[name]
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(FILES[path])):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "flashcl")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "flashcl":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(target)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _reach(name: str) -> Set[str]:
    seen, todo = set(), [name]
    while todo:
        for m in GRAPH[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen - {name}


def _cycles() -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_counting_imports_inside_functions() -> None:
    assert _cycles() == []
    # the walk does see what it looks for: the runner reaches the engine, a loss the runner
    assert "flashcl.engine.engine" in _reach("flashcl.runner")
    assert "flashcl.runner" in GRAPH["flashcl.losses.supcon"]


def test_layers_only_look_down() -> None:
    above_engine = {"flashcl.runner", "flashcl.backends", "flashcl.compiled", "flashcl.checks", "flashcl.distributed"}
    for name in MODULES:
        if name.startswith("flashcl.engine"):
            reached = _reach(name)
            assert not reached & above_engine, (name, reached & above_engine)
            assert not any(m.startswith(("flashcl.losses", "flashcl.parallel")) for m in reached), name
    # the column source and the runner know no loss; where a problem runs (backends) knows
    # neither the runner nor the processes: the walk of a call goes down, never back up
    for name in ("flashcl.runner", "flashcl.parallel.collectives", "flashcl.backends"):
        assert not any(m.startswith("flashcl.losses") for m in _reach(name)), name
    assert not any(m.startswith(("flashcl.runner", "flashcl.parallel")) for m in _reach("flashcl.backends"))


def test_the_oracles_import_nothing_of_the_engine() -> None:
    # the reference backend checks every other backend: sharing their preparation,
    # heads or lowering would let one mistake agree with itself; the families' oracles
    # (flashcl.reference.families) live beside it under the same rule
    oracles = {n for n in MODULES if n == "flashcl.reference" or n.startswith("flashcl.reference.")}
    assert {"flashcl.reference", "flashcl.reference.families"} <= oracles
    for name in oracles:
        assert _reach(name) - oracles <= {"flashcl.core"}, (name, _reach(name))
    assert _reach("flashcl.core") == set()


def _writes_to_self(node: ast.AST) -> bool:
    """An assignment to ``self.x``, ``self.x[...]`` or ``self.x.y`` (augmented too)."""
    targets: List[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    for target in targets:
        for t in target.elts if isinstance(target, ast.Tuple) else [target]:
            while isinstance(t, (ast.Attribute, ast.Subscript)):
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    return True
                t = t.value
    return False


def test_heads_return_results_through_their_state() -> None:
    # a head is built once per call and may be run again (a second backward, the
    # dense formula of a create-graph backward): what a run forms lives in the state
    # it returns from ``state``, never on the head (a head's class: its name ends in
    # "Head", or a base's does)
    writing = set()
    heads = 0
    for path, text in FILES.items():
        for cls in ast.walk(ast.parse(text)):
            if not isinstance(cls, ast.ClassDef):
                continue
            bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases]
            if not any(name.endswith("Head") for name in [cls.name, *bases]):
                continue
            heads += 1
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef) and fn.name != "__init__":
                    if any(_writes_to_self(n) for n in ast.walk(fn)):
                        writing.add(f"{_name(path)}.{cls.name}.{fn.name}")
    assert heads >= 15
    assert writing == set()
    assert _writes_to_self(ast.parse("self.rows[name][r] = v").body[0])


def test_drop_ins_call_losses_not_the_engine() -> None:
    # a drop-in maps a peer's call onto flashcl's losses (or onto the core's formula,
    # flashcl.core.CoreSpec, through the one road: runner.run_core); the engine's heads,
    # problems, drivers and autograd Functions are the losses' business
    direct = {
        name
        for name in MODULES
        if name.startswith("flashcl.integrations.") and any(m.startswith("flashcl.engine") for m in GRAPH[name])
    }
    assert direct == set(), direct
    assert any(m.startswith("flashcl.losses") for m in GRAPH["flashcl.integrations.pytorch_metric_learning"])


def _compares_backend(node: ast.AST) -> bool:
    """``name == "reference"`` (also ``!=``, ``backend``, ``in (...)``): a branch on a backend."""
    if not isinstance(node, ast.Compare) or len(node.comparators) != 1:
        return False
    left, right = node.left, node.comparators[0]
    named = isinstance(left, ast.Name) and left.id in ("name", "backend")
    values = [right] if isinstance(right, ast.Constant) else getattr(right, "elts", [])
    backends = {"reference", "dense", "tiled", "triton"}
    return named and any(isinstance(v, ast.Constant) and v.value in backends for v in values)


def test_loss_modules_hand_their_backends_to_one_place() -> None:
    # a family hands its problem and its oracle (backends.solve) or a table of its
    # implementations (backends.pick, flex's roads) over: none branches on a backend name
    branching = {
        _name(p)
        for p in ROOT.joinpath("losses").glob("*.py")
        if any(_compares_backend(n) for n in ast.walk(ast.parse(FILES[p])))
    }
    assert branching == set()
    assert _compares_backend(ast.parse('name == "reference"').body[0].value)  # type: ignore[attr-defined]


def test_at_most_15_modules_at_the_top() -> None:
    # (a module's length is a review question, not a failure: files go by concern, not by a count)
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(top) <= 15, top


def _calls(predicate: Callable[[ast.Call], bool]) -> Set[str]:
    """The modules with a call that ``predicate`` picks."""
    return {
        _name(p)
        for p, text in FILES.items()
        if any(isinstance(n, ast.Call) and predicate(n) for n in ast.walk(ast.parse(text)))
    }


def _called(node: ast.Call, name: str) -> bool:
    f = node.func
    return (isinstance(f, ast.Name) and f.id == name) or (isinstance(f, ast.Attribute) and f.attr == name)


def test_backends_are_resolved_in_one_module() -> None:
    # resolve(backend, entries, device, dtype, ...): not a path's resolve()
    assert _calls(lambda n: _called(n, "resolve") and len(n.args) >= 4) == {"flashcl.backends"}
    # the driver for a backend name, too (the others ask backends.pick_name / runner.run)
    assert _calls(lambda n: _called(n, "driver") and len(n.args) >= 3) == {"flashcl.backends"}


def test_drivers_are_built_in_one_place() -> None:
    # a family hands over its backend's name (backends.driver) or its tile layout
    # (backends.layout_driver); the distributed column source builds the ring's driver
    classes = [n for text in FILES.values() for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ClassDef)]
    drivers, grew = {"Driver"}, True
    while grew:  # every subclass, at any depth
        found = {c.name for c in classes if any(getattr(b, "id", getattr(b, "attr", "")) in drivers for b in c.bases)}
        grew, drivers = not found <= drivers, drivers | found
    assert {"RowBlocks", "ColumnBlocks", "UpperPanels", "Stripes", "RingDriver", "TritonDriver"} <= drivers
    built = _calls(lambda n: any(_called(n, name) for name in drivers - {"Driver"}))
    assert built == {"flashcl.backends", "flashcl.parallel.collectives"}, built


def _compares_reduction(node: ast.AST) -> bool:
    """``reduction == "mean"`` / ``"sum"`` (also ``!=``, ``opts.reduction``): a
    reduction formed by hand; ``"none"`` (the shape of a per-row output) is not."""
    if not isinstance(node, ast.Compare) or len(node.comparators) != 1:
        return False
    left, right = node.left, node.comparators[0]
    named = (isinstance(left, ast.Name) and left.id == "reduction") or (
        isinstance(left, ast.Attribute) and left.attr == "reduction"
    )
    return named and isinstance(right, ast.Constant) and right.value in ("mean", "sum")


def test_every_reduction_is_formed_in_one_module() -> None:
    forming = {
        _name(p)
        for p, text in FILES.items()
        if "/bench/" not in str(p) and any(_compares_reduction(n) for n in ast.walk(ast.parse(text)))
    }
    assert forming == {"flashcl.runner"}
    # the grad_scale factor and the global count of a source: the runner's too
    uses = _calls(
        lambda n: isinstance(n.func, ast.Attribute) and n.func.attr in ("factor", "count") and len(n.args) == 1
    )
    assert uses <= {"flashcl.runner", "flashcl.parallel.collectives"}, uses


def test_one_body_per_loss_and_no_across_copy() -> None:
    for p in ROOT.joinpath("losses").glob("*.py"):
        tree = ast.parse(FILES[p])
        names = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not [n for n in names if "across" in n], (p.name, names)


def test_import_loads_no_compiler() -> None:
    """``import flashcl`` stays light: torch's compiler (dynamo, and with it sympy and
    triton) loads when something first compiles, not at import (it cost 1.8 s and 150 MB)."""
    import subprocess
    import sys

    code = (
        "import sys, torch, flashcl; "
        "print(' '.join(m for m in ('torch._dynamo', 'torch._inductor', 'sympy', 'triton') if m in sys.modules))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert loaded == [], f"import flashcl loaded {loaded}"
