"""The code's shape: imports run one way (settings <- codec <- comm <- optim <- integrations <-
applications <- the laboratory) with no circle between modules, lazy imports inside functions
included; the package holds the library only, and importing it loads nothing of the laboratory
(lab/: the reference task and the benchmarks, beside the package)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAB = ROOT / "lab"

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
    "ds_lowcomm.cli": 5,  # finds the laboratory's commands by entry point, never by import
    "ds_lowcomm.plan": 5,  # the planner: prices the methods' declarations, reads the recipes and measured.json
    # the laboratory (lab/, its own distribution): nothing of the library imports it
    "lowcomm_task": 6,
    "lowcomm_bench": 7,
    "launch": 7,
}
INTEGRATIONS = ("ds_lowcomm.deepspeed", "megatron_patches")


def _modules() -> dict[str, Path]:
    out = {}
    for base, top in ((ROOT, "ds_lowcomm"), (ROOT, "megatron_patches"), (ROOT, "launch"),
                      (LAB, "lowcomm_task"), (LAB, "lowcomm_bench")):
        for path in sorted((base / top).rglob("*.py")):
            parts = list(path.relative_to(base).with_suffix("").parts)
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


def _find(pyproject: Path) -> set[str]:
    """The packages setuptools puts in the distribution of ``pyproject`` (its packages.find)."""
    tomllib = pytest.importorskip("tomllib")
    from setuptools import find_packages

    find = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["packages"]["find"]
    return set(find_packages(str(pyproject.parent), include=find["include"], exclude=find.get("exclude", ())))


def test_the_package_holds_the_library_only():
    """The wheel: codec, comm, optim, the integrations, planner, CLI and settings, with the
    planner's measured defaults as package data; the laboratory is its own distribution."""
    tomllib = pytest.importorskip("tomllib")

    assert _find(ROOT / "pyproject.toml") == {"ds_lowcomm", "ds_lowcomm.codec", "ds_lowcomm.comm", "ds_lowcomm.optim",
                                              "ds_lowcomm.deepspeed", "ds_lowcomm.plan", "megatron_patches"}
    assert _find(LAB / "pyproject.toml") == {"lowcomm_task", "lowcomm_bench"}
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert data == {"ds_lowcomm": ["measured.json"]} and (ROOT / "ds_lowcomm" / "measured.json").is_file()


def test_the_library_loads_no_laboratory():
    """``import ds_lowcomm.plan`` (and the package, the CLI, ``ds-lowcomm plan`` itself) in a fresh
    interpreter where the laboratory is importable: neither the training loop nor a benchmark loads."""
    code = ("import importlib.util, io, contextlib, sys\n"
            "assert importlib.util.find_spec('lowcomm_task') and importlib.util.find_spec('lowcomm_bench')\n"
            "import ds_lowcomm, ds_lowcomm.plan, ds_lowcomm.cli\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert ds_lowcomm.cli.main(['plan', '--model', 'reference']) == 0\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lowcomm_task', 'lowcomm_bench')))\n"
            "print('ds_lowcomm.plan' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["[]", "True"]


def test_compare_is_the_laboratorys_command(monkeypatch, capsys):
    """``ds-lowcomm compare`` comes from the laboratory's ``ds_lowcomm.commands`` entry point (lab/pyproject.toml,
    installed by launch/env.sh); without the laboratory the CLI says how to install it."""
    from ds_lowcomm import cli

    assert cli.plugin_commands()["compare"].load().__name__ == "lowcomm_task.compare"
    monkeypatch.setattr(cli, "plugin_commands", dict)  # as in an environment without the laboratory
    assert cli.main(["compare", "--methods", "adamw"]) == 2
    assert "pip install -e lab" in capsys.readouterr().err
