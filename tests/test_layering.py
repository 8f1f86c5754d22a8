"""The package's layering (see ``tl_connwalk/__init__.py``): no import cycle, no import upwards.

Every ``import`` of every module is read from its source (``ast``), those inside functions and
``if TYPE_CHECKING:`` blocks included, so a type-only import counts as much as any other.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "tl_connwalk"

#: Bottom to top; a module may import its own layer and those below. The first prefix that
#: matches a module's dotted name (without ``tl_connwalk.``) gives its layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "debug"),
    ("core",),
    ("views",),
    ("walk",),
    ("adapters", "hooks"),
    ("cache", "analysis", "plugin", "ablations", "attribution", "distributed"),
    ("", "__main__", "cli", "report", "zoo", "corpus", "toy"),
)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The package's modules that ``name`` imports (a package: its ``__init__``)."""
    path = MODULES[name]
    own_package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = own_package.split(".")[: len(own_package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        found |= {target for target in targets if target in MODULES and target != name}
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def layer_of(name: str) -> int:
    local = name.removeprefix("tl_connwalk").removeprefix(".")
    matches = [
        (len(prefix), index)
        for index, layer in enumerate(LAYERS)
        for prefix in layer
        if local == prefix or (prefix and local.startswith(prefix + "."))
    ]
    if not matches:
        raise AssertionError(f"{name} is in no layer: add it to LAYERS")
    return max(matches)[1]


def test_the_graph_is_read() -> None:
    assert "tl_connwalk.core.walk" in GRAPH["tl_connwalk.walk.connection"]
    assert "tl_connwalk.errors" in GRAPH["tl_connwalk.core.markov"]
    assert len(GRAPH) > 40


def test_a_cycle_is_found_when_there_is_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as a path ``[a, b, ..., a]``, or None (depth-first)."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        path.append(node)
        for target in sorted(graph[node]):
            cycle = visit(target)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        cycle = visit(node)
        if cycle is not None:
            return cycle
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_every_module_has_a_layer() -> None:
    for name in MODULES:
        layer_of(name)


def test_no_import_from_a_lower_layer_to_a_higher_one() -> None:
    upwards = [
        f"{name} (layer {layer_of(name)}) imports {target} (layer {layer_of(target)})"
        for name, targets in GRAPH.items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(name)
    ]
    assert not upwards, "\n".join(upwards)


def test_fast_code_is_private_to_core() -> None:
    """``core/_fast`` is imported only from inside ``core``."""
    outside = [
        f"{name} imports {target}"
        for name, targets in GRAPH.items()
        for target in targets
        if ".core._fast" in target and not name.startswith("tl_connwalk.core")
    ]
    assert not outside, "\n".join(outside)
