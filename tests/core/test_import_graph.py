"""The package's imports run one way (ADR 0017): no import circle, no import back up a layer.

Every module of nemo_msa is parsed with ``ast`` (nothing is imported); each import of a module of
the package is an edge, wherever it stands (an import inside a function is a dependency all the
same). The checks:

- no cycle in the graph (the cycle is named if there is one); importing a module of a subpackage
  also depends on the subpackage's ``__init__`` where it imports anything (Python runs it first);
- no edge from a module to a higher layer of :data:`LAYERS`, and every module has a layer;
- imports stand at the top of a module; one inside a function only for an optional heavy
  dependency of :data:`DEFERRED_ALLOWED` (the module must import without it);
- a package's ``__init__`` only re-exports (imports, ``__all__``, ``__version__``), from inside
  its own package.

Run it as a script for the graph's summary and details: ``python tests/core/test_import_graph.py``.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGE = "nemo_msa"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / PACKAGE

#: The layers, lowest first: a module may import its own layer (acyclically) and those below.
#: An entry names a module or a package (then every module under it); the longest entry wins.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # What every layer reads: the contract's limits, the document map and the layout built from
    # it, the canonical q2k and the selection, the query view, the count of choices made per
    # call without a plan. The kernels take the layout as their input, so it sits below them.
    # The kernels' typed view of the layout (device index tensors, torch only) sits with it, and
    # the backends' capability records (data read by the kernels' asserts and the plan): the one
    # module of the nemo_msa.backends package below the core.
    ("layout", ("nemo_msa.limits", "nemo_msa.backends.capabilities", "nemo_msa.tensor_memo",
                "nemo_msa.document_map", "nemo_msa.layout", "nemo_msa.q2k",
                "nemo_msa.query_view", "nemo_msa.unplanned", "nemo_msa.triton.kernel_layout")),
    # Kernels and references: attention (naive, dense, Triton, flashinfer adapter), selection,
    # the indexer loss (reference, by-products, fused dense).
    # The Triton pieces they share (launch settings, tile helpers) live in nemo_msa.triton.
    ("kernels", ("nemo_msa.attention", "nemo_msa.selection", "nemo_msa.indexer_loss",
                 "nemo_msa.triton")),
    # The core: the backends package (backend record, backend modules, registry), ops, support
    # gate, the layer plan, the public facade.
    ("core", (
        "nemo_msa.backends",
        "nemo_msa.ops",
        "nemo_msa.support",
        "nemo_msa.plan",
        "nemo_msa.context_parallel",
        "nemo_msa",
    )),
    ("megatron", ("nemo_msa.megatron",)),
    # The layer specs assemble the MSA modules with Megatron's backend spec providers.
    ("specs", ("nemo_msa.megatron.layer_specs",)),
    ("training", ("nemo_msa.training",)),
    # Megatron-Bridge support builds on the YAML recipes and the training data helpers.
    ("bridge", ("nemo_msa.bridge",)),
)

#: Top-level names an import inside a function may name, and why: optional heavy dependencies
#: that the importing module must import without.
DEFERRED_ALLOWED = {
    "megatron": "Megatron-Core: the training modules' config and data helpers import without it",
    "flashinfer": "optional (the flashinfer extra); the adapter imports without it",
    "triton": "optional kernels' dependency",
    "matplotlib": "optional: the loss-curve PNG only",
    "tqdm": "optional: the progress bar only",
    "transformer_engine": "optional: the layer specs' TE implementation only",
}
#: Package modules a layer may import inside a function: training falls back to a dense GPT
#: where the MSA extension (nemo_msa.megatron, hence Megatron-Core) does not import
#: (``msa_hooks.is_msa_config``, ``recipe.transformer_config_class``: try/except ImportError).
DEFERRED_ALLOWED_INTERNAL = {"nemo_msa.training": ("nemo_msa.megatron", "nemo_msa")}


@dataclass
class Graph:
    modules: dict[str, Path]
    edges: dict[str, set[str]] = field(default_factory=dict)
    # (importer, line, imported name): imports inside functions, allowed or not.
    deferred: list[tuple[str, int, str]] = field(default_factory=list)
    late: list[tuple[str, int]] = field(default_factory=list)  # module-level imports below code
    init_problems: list[str] = field(default_factory=list)

    @property
    def num_edges(self) -> int:
        return sum(len(targets) for targets in self.edges.values())


def module_names(package_dir: Path, package: str = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file of every module under ``package_dir`` (a package is its __init__)."""
    names = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_package(name: str, modules: dict[str, Path]) -> bool:
    path = modules.get(name)
    return (path is not None and path.name == "__init__.py") or any(
        other.startswith(name + ".") for other in modules
    )


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The package module an imported dotted name executes: itself, or its longest module prefix."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def imported_modules(
    node: ast.Import | ast.ImportFrom, importer: str, modules: dict[str, Path]
) -> list[str]:
    """The dotted names an import statement brings in (package modules resolved to the module
    that runs: ``from nemo_msa.attention import naive`` is nemo_msa.attention.naive,
    ``from nemo_msa import MSAMicrobatch`` the package nemo_msa)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        here = importer.split(".")
        if not _is_package(importer, modules):
            here = here[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join([*here, base] if base else here)
    out = []
    for alias in node.names:
        full = f"{base}.{alias.name}"
        out.append(full if full in modules else base)
    return out


def _function_bodies(tree: ast.Module):
    """Import statements inside a function (at any depth), with nothing else."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                if isinstance(inner, (ast.Import, ast.ImportFrom)):
                    yield inner


def _module_level_imports(body: list[ast.stmt]):
    """Module-level import statements (including inside top-level try/if blocks)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.Try, ast.If)):
            blocks = [node.body, node.orelse]
            if isinstance(node, ast.Try):
                blocks += [handler.body for handler in node.handlers] + [node.finalbody]
            for block in blocks:
                yield from _module_level_imports(block)


def _only_imports(node: ast.stmt) -> bool:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return True
    if isinstance(node, ast.Try):
        inner = node.body + [s for h in node.handlers for s in h.body] + node.orelse
        return all(_only_imports(s) or isinstance(s, (ast.Assign, ast.Pass)) for s in inner)
    return False


def _is_docstring(node: ast.stmt) -> bool:
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(
        node.value.value, str
    )


def _check_init(name: str, tree: ast.Module, graph: Graph) -> None:
    """A package __init__ only re-exports, from inside its own package."""
    for node in tree.body:
        if _is_docstring(node) or isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        targets = node.targets if isinstance(node, ast.Assign) else []
        if targets and all(isinstance(t, ast.Name) and t.id in ("__all__", "__version__")
                           for t in targets):
            continue
        graph.init_problems.append(
            f"{name} (__init__) line {node.lineno}: {type(node).__name__}; an __init__ only "
            "re-exports"
        )
    if name == PACKAGE:
        return
    for target in graph.edges.get(name, ()):
        if not target.startswith(name + "."):
            graph.init_problems.append(
                f"{name} (__init__) imports {target}: a subpackage re-exports its own modules only"
            )


def build_graph(package_dir: Path = PACKAGE_DIR, package: str = PACKAGE) -> Graph:
    """Parses every module under ``package_dir``; the intra-package import graph."""
    graph = Graph(module_names(package_dir, package))
    modules = graph.modules
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        targets = graph.edges.setdefault(name, set())
        deferred = list(_function_bodies(tree))
        for node in [*_module_level_imports(tree.body), *deferred]:
            for imported in imported_modules(node, name, modules):
                if imported.split(".")[0] != package:
                    continue
                resolved = _resolve(imported, modules)
                if resolved is not None and resolved != name:
                    targets.add(resolved)
        for node in deferred:
            for imported in imported_modules(node, name, modules):
                graph.deferred.append((name, node.lineno, imported))
        seen_code = False
        for node in tree.body:
            if _is_docstring(node) and not seen_code:
                continue
            if _only_imports(node) or isinstance(node, ast.If) and all(
                _only_imports(s) for s in node.body + node.orelse
            ):
                if seen_code:
                    graph.late.append((name, node.lineno))
            else:
                seen_code = True
        if path.name == "__init__.py":
            _check_init(name, tree, graph)
    _add_package_init_edges(graph)
    return graph


def _add_package_init_edges(graph: Graph) -> None:
    """Importing ``p.q.m`` runs ``p.q``'s ``__init__`` first: where that ``__init__`` imports
    something, the importer depends on it too (an edge to ``p.q``). Not for the root package
    (the facade, which Python runs before any of its modules) nor for a module inside ``p.q``
    (Python has begun its ``__init__`` already)."""
    modules = graph.modules
    inits = {name for name, path in modules.items()
             if path.name == "__init__.py" and name != PACKAGE and graph.edges.get(name)}
    for importer, targets in graph.edges.items():
        for target in list(targets):
            parts = target.split(".")
            for depth in range(2, len(parts)):
                package = ".".join(parts[:depth])
                if (package in inits and importer != package
                        and not importer.startswith(package + ".")):
                    targets.add(package)


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as ``[a, b, ..., a]``, or None when it is acyclic."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    for start in sorted(edges):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(edges.get(start, ()))))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(edges.get(child, ())))))
    return None


def count_cycles(edges: dict[str, set[str]]) -> int:
    """Strongly connected components with a cycle (Tarjan): 0 for an acyclic graph."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    count = 0

    def visit(node: str) -> None:
        nonlocal count
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in edges.get(node, ()):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                count += 1

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return count


def layer_of(module: str, layers=LAYERS) -> int | None:
    """Index in ``layers`` of the longest entry that is ``module`` or a package above it."""
    best, best_len = None, -1
    for rank, (_, entries) in enumerate(layers):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best_len:
                best, best_len = rank, len(entry)
    return best


def upward_imports(edges: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Edges from a module to a higher layer, as readable lines."""
    out = []
    for source in sorted(edges):
        for target in sorted(edges[source]):
            low, high = layer_of(source, layers), layer_of(target, layers)
            if low is not None and high is not None and high > low:
                out.append(f"{source} ({layers[low][0]}) imports {target} ({layers[high][0]})")
    return out


def disallowed_deferred(graph: Graph) -> list[str]:
    out = []
    for importer, line, imported in graph.deferred:
        top = imported.split(".")[0]
        if top in DEFERRED_ALLOWED:
            continue
        allowed_internal = next(
            (targets for prefix, targets in DEFERRED_ALLOWED_INTERNAL.items()
             if importer.startswith(prefix + ".")), (),
        )
        # The package itself only by name (``from nemo_msa import X``), not all of it.
        if any(imported == t or (t != PACKAGE and imported.startswith(t + "."))
               for t in allowed_internal):
            continue
        out.append(f"{importer}:{line} imports {imported} inside a function")
    return out


def summary(graph: Graph) -> str:
    return (
        f"import graph: {len(graph.modules)} modules, {graph.num_edges} edges, "
        f"{count_cycles(graph.edges)} cycles, {len(upward_imports(graph.edges))} upward, "
        f"{len(graph.deferred)} imports inside functions "
        f"({len(disallowed_deferred(graph))} not allowed)"
    )


@pytest.fixture(scope="module")
def graph() -> Graph:
    return build_graph()


# ---------------------------------------------------------------- the package's graph


def test_the_package_has_no_import_cycle(graph):
    print(summary(graph))
    assert graph.num_edges > 20, "the parser found almost no imports: is it reading the package?"
    cycle = find_cycle(graph.edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    assert count_cycles(graph.edges) == 0


def test_every_module_has_a_layer_and_no_import_runs_up(graph):
    unplaced = [m for m in graph.modules if layer_of(m) is None]
    assert not unplaced, f"modules without a layer in LAYERS (place them): {unplaced}"
    upward = upward_imports(graph.edges)
    assert not upward, "imports that run back up a layer:\n" + "\n".join(upward)


def test_imports_stand_at_the_top(graph):
    bad = disallowed_deferred(graph)
    assert not bad, (
        "imports inside functions (only the optional dependencies of DEFERRED_ALLOWED may be "
        "deferred):\n" + "\n".join(bad)
    )
    assert not graph.late, f"module-level imports below code: {graph.late}"


def test_package_inits_only_reexport(graph):
    assert not graph.init_problems, "\n".join(graph.init_problems)


def test_layout_no_longer_calls_up_into_selection():
    from nemo_msa import MSAMicrobatch

    assert not hasattr(MSAMicrobatch, "select_blocks"), "use nemo_msa.select_blocks(..., msa)"


# ---------------------------------------------------------------- the checks can fail


def test_cycle_finder_finds_a_cycle_and_accepts_a_dag():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert count_cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}, "e": {"a"}}) == 2
    assert count_cycles({"a": {"b"}, "b": set()}) == 0


def test_upward_finder_uses_the_layer_table():
    layers = (("low", ("p.low",)), ("high", ("p.high", "p")))
    edges = {"p.low.x": {"p.high.y", "p.low.z"}, "p.high.y": {"p.low.x"}, "p": {"p.low.z"}}
    assert upward_imports(edges, layers) == ["p.low.x (low) imports p.high.y (high)"]
    assert layer_of("p.lower", layers) == 1  # "p.low" is not a package prefix of "p.lower"


def test_the_parser_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "fake"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from fake.a import f\n__all__ = ['f']\n")
    (pkg / "a.py").write_text(
        "import os\nfrom fake.sub import b\n\n\ndef f():\n    from fake import c\n"
        "    import megatron.core\n"
    )
    (pkg / "sub" / "__init__.py").write_text("from fake.a import f\n\n\ndef g():\n    pass\n")
    (pkg / "sub" / "b.py").write_text("from . import d\nfrom ..a import f\n")
    (pkg / "sub" / "d.py").write_text("x = 1\nimport fake.c\n")
    (pkg / "c.py").write_text("")
    graph = build_graph(pkg, "fake")
    # fake.sub's __init__ imports fake.a: importing fake.sub.b runs it (an edge to fake.sub).
    assert graph.edges["fake.a"] == {"fake.sub.b", "fake.sub", "fake.c"}
    assert graph.edges["fake.sub.b"] == {"fake.sub.d", "fake.a"}
    assert graph.edges["fake"] == {"fake.a"}
    assert find_cycle(graph.edges) == ["fake.a", "fake.sub", "fake.a"]
    deferred = [(module, name) for module, _, name in graph.deferred]
    assert deferred == [("fake.a", "fake.c"), ("fake.a", "megatron.core")]
    assert graph.late == [("fake.sub.d", 2)]
    assert any("fake.sub (__init__) line 4: FunctionDef" in p for p in graph.init_problems)
    assert any("fake.sub (__init__) imports fake.a" in p for p in graph.init_problems)


if __name__ == "__main__":
    built = build_graph()
    print(summary(built))
    for problem in (upward_imports(built.edges) + disallowed_deferred(built)
                    + built.init_problems):
        print("  " + problem)
    cycle = find_cycle(built.edges)
    if cycle:
        print("  cycle: " + " -> ".join(cycle))
    sys.exit(1 if cycle or upward_imports(built.edges) or disallowed_deferred(built) else 0)
