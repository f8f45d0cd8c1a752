"""The package's import layers (issue 26, docs/design.md "Layers"): no import cycle among
megatron_ucp's modules; nothing outside `megatron_ucp/train/` imports the training
application, except the few upward imports listed in ALLOWED_UPWARD below, each with its
reason; and every module sits in one of LAYERS and imports only its own layer or lower ones.

Imports are read with `ast` from the source, function-local ones included (a lazy import is
still a dependency: it only hides it from `import` time). Nothing is imported to do this.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = "megatron_ucp"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
TRAIN = f"{PACKAGE}.train"

# The layers, bottom up (docs/design.md). A module imports its own layer or lower ones; a new
# module must be placed here (the test names it otherwise).
LAYERS = [
    ("base", {"errors", "settings"}),
    ("layout math", {"layout", "plan", "read_plan", "model_shapes"}),
    ("on-disk format", {"safe_files", "durability", "checksums", "tensor_file", "tensor_io", "format_v1",
                        "manifest", "folder", "inspection", "safe_pickle"}),
    ("engine and megatron glue", {"collective", "ownership", "host_memory", "rng", "launch", "elastic",
                                  "compat", "cpu_mode", "fused_adam_standin", "optimizer_state",
                                  "model_map", "replicas", "save", "load", "api", ""}),  # "": megatron_ucp itself
    ("converters", {"source_model", "stream_write", "legacy_convert", "dist_convert", "convert",
                    "hf_map", "hf_convert", "export_torch_dist"}),
    ("training application", {"train", "train.*"}),
]

# Upward imports (module outside train/ -> module inside train/) that remain. This list only
# shrinks: a new upward import fails the test; moving one of these out of the way means
# deleting its entry (the test also fails on an entry that no longer happens).
ALLOWED_UPWARD = {
    # The converters rebuild the source run's model from its stored arguments with
    # pretrain_gpt_ucp.py's own parser (build_parser/validate: the definition of the model
    # flags) and its model builder (transformer_config/layer_spec on the meta device).
    # source_model.py is the one place they do; it goes when the model's flags and builder
    # move below train/ (megatron glue).
    ("megatron_ucp.source_model", "megatron_ucp.train.args"):
        "converters parse the stored training arguments with the training parser",
    ("megatron_ucp.source_model", "megatron_ucp.train.model"):
        "converters build the source model with the training model builder",
    # The torch_dist export carries and refuses flags by the training parser's argument groups.
    ("megatron_ucp.export_torch_dist", "megatron_ucp.train.args"): "flags carried/refused by parser group",
}


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
    for i, (_, members) in enumerate(LAYERS):
        if short in members or (_in_train(name) and "train.*" in members):
            return i
    return None


def layer_violations(graph) -> set:
    return {(src, dst) for src, dsts in graph.items() for dst in dsts
            if layer_of(dst) > layer_of(src)} - set(ALLOWED_UPWARD)


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
    assert f"{PACKAGE}.save" in graph and f"{TRAIN}.loop" in graph
    # a function-local import is seen (train.checkpointing imports api inside load())
    assert f"{PACKAGE}.api" in graph[f"{TRAIN}.checkpointing"]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles among megatron_ucp modules:\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_no_new_upward_import_of_train():
    found = upward_imports(import_graph())
    new = sorted(found - set(ALLOWED_UPWARD))
    assert not new, ("modules outside megatron_ucp/train/ import the training application "
                     "(move what they need below train/):\n" + "\n".join(f"{s} -> {d}" for s, d in new))


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


def test_allow_list_only_shrinks():
    gone = sorted(set(ALLOWED_UPWARD) - upward_imports(import_graph()))
    assert not gone, "these upward imports are gone; delete their ALLOWED_UPWARD entries:\n" + "\n".join(
        f"{s} -> {d}" for s, d in gone)


@pytest.mark.parametrize("edge, caught", [
    (("megatron_ucp.layout", "megatron_ucp.plan"), {"cycle"}),  # plan imports layout
    (("megatron_ucp.tensor_io", "megatron_ucp.train.loop"), {"cycle", "train", "layers"}),
    (("megatron_ucp.folder", "megatron_ucp.save"), {"cycle", "layers"}),  # save imports folder
    (("megatron_ucp.stream_write", "megatron_ucp.train.args"), {"train", "layers"}),
    (("megatron_ucp.legacy_convert", "megatron_ucp.convert"), {"cycle"}),  # as before issue 26
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
    if edge in upward_imports(graph) - set(ALLOWED_UPWARD):
        found.add("train")
    if edge in layer_violations(graph):
        found.add("layers")
    assert found == caught
