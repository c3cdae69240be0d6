"""The project's two layers, read from every module's imports (all of them: at the top, inside functions,
under TYPE_CHECKING). The core (model/, data/, training/, generation/, checkpoint.py) never imports the
shell (shell/, and the search's Hydra sweeper in hydra_plugins/) or an entry script; model/ imports nothing of the project; no modules import each other
in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.common import ROOT

CORE = ("model", "data", "training", "generation", "checkpoint")
SHELL = ("shell", "hydra_plugins", "web")
SCRIPTS = ("train", "generate", "explain", "export", "studio")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    files = [*ROOT.glob("*.py"), *(f for top in (*CORE, *SHELL) for f in (ROOT / top).glob("**/*.py"))]
    return {module_name(f): f for f in files if f.is_file()}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules a file imports, each by the most precise name that is a module of ours."""
    found = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the file's package
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module_name(path):
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {name: imports_of(path, modules) for name, path in modules.items()}


def layer(name: str) -> str:
    top = name.split(".")[0]
    return "core" if top in CORE else "shell" if top in SHELL else "script"


def test_the_core_imports_neither_the_shell_nor_an_entry_script():
    wrong = [(name, to) for name, tos in graph().items() for to in tos if layer(name) == "core" and layer(to) != "core"]
    assert wrong == []


def test_the_model_imports_nothing_of_the_project():
    wrong = [(name, to) for name, tos in graph().items() if name.split(".")[0] == "model" for to in tos]
    assert [(name, to) for name, to in wrong if to.split(".")[0] != "model"] == []


def test_no_modules_import_each_other_in_a_circle():
    edges = graph()
    circles, state = [], {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for to in sorted(edges.get(name, ())):
            if state.get(to) == "open":
                circles.append([*path[path.index(to) :], to])
            elif to not in state:
                visit(to, [*path, to])
        state[name] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert circles == []


def test_the_check_reads_the_imports_it_should():
    """The checks above see what they check: a core module's imports, a package's, a relative one."""
    edges = graph()
    assert "model" in edges["training.module"] and "checkpoint" in edges["training.module"]
    assert "training.fit" in edges["shell.run"] and "shell.job" in edges["train"]
    assert {"model.config", "model.gpt"} <= edges["model"]


def test_no_function_of_the_core_is_longer_than_a_screen():
    """The core reads like teaching code: no function longer than 40 lines, its docstring included."""
    modules = project_modules()
    long = []
    for name, path in modules.items():
        if layer(name) != "core":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 40:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []
