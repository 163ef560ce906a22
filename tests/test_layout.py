"""The code's shape: imports run one way (settings <- codec <- comm <- optim <- integrations <-
applications) with no circle between modules, lazy imports inside functions included."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Layer of each top-level piece; a module may import only from its own layer or below.
LAYERS = {
    "ds_lowcomm.settings": 0,
    "ds_lowcomm.checkpoint_io": 0,  # checkpoint files (atomic, digests, weights_only): used from optim up
    "ds_lowcomm.versions": 0,  # the supported framework versions (the package's pins) and the start-up gate
    "ds_lowcomm.reflect": 0,  # the private-internals checks (declared items against the live code): integrations
    "ds_lowcomm.codec": 1,
    "ds_lowcomm.comm": 2,
    "ds_lowcomm.optim": 3,
    "ds_lowcomm.config": 3,  # the documented import path of optim's LowcommConfig
    "ds_lowcomm.deepspeed": 4,
    "megatron_patches": 4,
    "lowcomm_task": 5,
    "lowcomm_task.workers": 5,
    "lowcomm_task.compare": 5,
    "ds_lowcomm.cli": 5,
    "ds_lowcomm.plan": 5,  # the planner: reads the codec, the methods' settings and the compare recipes
    "lowcomm_bench": 5,
    "launch": 6,
}
INTEGRATIONS = ("ds_lowcomm.deepspeed", "megatron_patches")


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("ds_lowcomm", "megatron_patches", "launch"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """ds_lowcomm modules imported anywhere in the file (resolved to the most specific module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _layer(module: str) -> tuple[str, int]:
    for prefix, layer in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if module == prefix or module.startswith(prefix + "."):
            return prefix, layer
    raise AssertionError(f"{module}: not placed in a layer; add it to LAYERS")


def _graph():
    mods = _modules()
    known = set(mods)
    return {name: _imports(name, path, known) for name, path in mods.items()}


def test_every_import_points_down():
    wrong = []
    for name, deps in _graph().items():
        if name == "ds_lowcomm":
            continue
        top, layer = _layer(name)
        for dep in deps:
            if dep == "ds_lowcomm":
                continue
            dep_top, dep_layer = _layer(dep)
            if dep_layer > layer or (top in INTEGRATIONS and dep_top in INTEGRATIONS and top != dep_top):
                wrong.append(f"{name} imports {dep}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_circle():
    graph = _graph()
    # a package's __init__ re-exports its modules: an edge into the package is an edge into them
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep.startswith(node + ".") or node.startswith(dep + "."):
                continue  # a package and its own modules
            if state.get(dep) == "open":
                cycles.append(stack[stack.index(dep):] + [dep])
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)
