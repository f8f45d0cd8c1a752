"""The package's import layers (issue 26, docs/design.md "Layers"): no import cycle among
megatron_ucp's modules; nothing outside `megatron_ucp/train/` imports the training
application; and every module sits in one of LAYERS (the package's folders) and imports only
its own layer or lower ones.

Imports are read with `ast` from the source, function-local ones included (a lazy import is
still a dependency: it only hides it from `import` time). Nothing is imported to do this.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = "megatron_ucp"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
TRAIN = f"{PACKAGE}.train"

# The layers, bottom up (docs/design.md): the package's folders. A module imports its own layer
# or lower ones; a new module must sit in one of them (the test names it otherwise).
LAYERS = [
    ("base", {"errors", "settings"}),
    ("on-disk format", {"format", "format.*"}),
    ("megatron glue", {"mcore", "mcore.*"}),
    ("engine", {"engine", "engine.*", "api", ""}),  # "": megatron_ucp itself (the public API)
    ("converters", {"convert", "convert.*"}),
    ("training application", {"train", "train.*"}),
    ("Megatron-LM trainer plug-in", {"megatron_lm", "megatron_lm.*"}),  # beside train/, not on it
    # Megatron-Bridge's checkpoint manager: the plug-in's engine calls and CPU mode, reused
    ("Megatron-Bridge checkpoint manager", {"bridge", "bridge.*"}),
    # the `megatron-ucp` command, and the training entry point, which chooses the trainer (the
    # own loop on megatron-core 0.16, Megatron-LM's with the plug-in on later releases)
    ("commands", {"cli", "__main__", "commands", "commands.*", "train.__main__"}),
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict:
    """{module name: path} for every module of the package."""
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: Path, name: str, modules) -> set:
    """The package modules `path` imports, anywhere in its body (function-local included)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule pkg.sub; `from mod import obj`, mod
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            # `import megatron_ucp.a.b` runs megatron_ucp.a.b: take the longest known prefix
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target.startswith(PACKAGE) and target != name:
                found.add(target)
    return found


def import_graph() -> dict:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _in_train(name: str) -> bool:
    return name == TRAIN or name.startswith(TRAIN + ".")


def layer_of(name: str):
    short = name[len(PACKAGE) + 1:] if name != PACKAGE else ""
    for i, (_, members) in enumerate(LAYERS):  # a module named in a layer, before its folder's
        if short in members:
            return i
    for i, (_, members) in enumerate(LAYERS):
        if f"{short.partition('.')[0]}.*" in members:
            return i
    return None


def layer_violations(graph) -> set:
    return {(src, dst) for src, dsts in graph.items() for dst in dsts
            if layer_of(dst) > layer_of(src)}


def upward_imports(graph) -> set:
    return {(src, dst) for src, dsts in graph.items() for dst in dsts
            if _in_train(dst) and not _in_train(src)}


def cycles(graph) -> list:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_walker_sees_the_package():
    graph = import_graph()
    assert f"{PACKAGE}.engine.save" in graph and f"{TRAIN}.loop" in graph
    # a function-local import is seen (train.checkpointing imports api inside load())
    assert f"{PACKAGE}.api" in graph[f"{TRAIN}.checkpointing"]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles among megatron_ucp modules:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_nothing_below_imports_the_training_application():
    found = sorted(upward_imports(import_graph()))
    assert not found, ("modules outside megatron_ucp/train/ import the training application "
                       "(move what they need below train/):\n" + "\n".join(f"{s} -> {d}" for s, d in found))


def test_every_module_has_a_layer():
    unplaced = sorted(n for n in import_graph() if layer_of(n) is None)
    assert not unplaced, f"place these modules in LAYERS (tests/test_imports.py): {unplaced}"


def test_imports_go_down_the_layers():
    graph = import_graph()
    if any(layer_of(n) is None for n in graph):
        pytest.skip("a module has no layer (test_every_module_has_a_layer)")
    found = sorted(layer_violations(graph))
    assert not found, "imports up the layers:\n" + "\n".join(
        f"{s} ({LAYERS[layer_of(s)][0]}) -> {d} ({LAYERS[layer_of(d)][0]})" for s, d in found)


@pytest.mark.parametrize("edge, caught", [
    (("megatron_ucp.format.layout", "megatron_ucp.engine.plan"), {"cycle", "layers"}),  # plan imports layout
    (("megatron_ucp.format.tensor_io", "megatron_ucp.train.loop"), {"cycle", "train", "layers"}),
    (("megatron_ucp.format.folder", "megatron_ucp.engine.save"), {"cycle", "layers"}),  # save imports folder
    (("megatron_ucp.mcore.model_map", "megatron_ucp.engine.save"), {"cycle", "layers"}),
    (("megatron_ucp.mcore.model_map", "megatron_ucp.train.data"), {"train", "layers"}),
    (("megatron_ucp.convert.legacy", "megatron_ucp.convert.to_universal"), {"cycle"}),  # one layer
])
def test_the_checks_catch_a_new_edge(edge, caught):
    """A cycle, an upward import of train/ or an import up the layers added to the graph is
    reported (the checks are not vacuous)."""
    graph = import_graph()
    src, dst = edge
    graph[src] = graph[src] | {dst}
    found = set()
    if any(src in c and dst in c for c in cycles(graph)):
        found.add("cycle")
    if edge in upward_imports(graph):
        found.add("train")
    if edge in layer_violations(graph):
        found.add("layers")
    assert found == caught
