"""The shell's shape, read from the code: it uses the libraries' public names only, keeps no mutable state at
module level, does not grow back to the size it once was, and Hydra composes a run's config once per job."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

from tests.common import ROOT, TINY_OVERRIDES, train_here

# Names with a leading underscore that are public all the same: os._exit, a named tuple's methods, and the keys
# Hydra's own configs are written with.
PUBLIC_ANYWAY = {"_exit", "_asdict", "_replace", "_fields", "_make", "_target_", "_recursive_", "_self_"}
MUTATING = ("append", "add", "update", "pop", "clear", "extend", "setdefault", "remove")
# The shell had 6,850 lines in 27 files before it leant on Hydra and Lightning; what is left is the project's
# own behaviour (one-line errors, resume bit for bit, sweeps that continue, locks, any folder name), and it
# is not to grow back.
SHELL_LINES = 4_300


def project_files() -> list[Path]:
    tops = ("model", "data", "training", "generation", "shell", "web", "hydra_plugins", "bench", "tests")
    return sorted([*ROOT.glob("*.py"), *(f for top in tops for f in (ROOT / top).glob("**/*.py"))])


def own_private_names(trees: dict[Path, ast.AST]) -> set[str]:
    """The names with a leading underscore that the project itself defines: its own to use."""
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.ClassDef):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
    return {name for name in own if name.startswith("_") and not name.startswith("__")}


def test_no_private_name_of_a_library_is_used_anywhere():
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in project_files()}
    own = own_private_names(trees) | PUBLIC_ANYWAY
    used = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names = [node.attr] if isinstance(node, ast.Attribute) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else []
            names += node.module.split(".") if isinstance(node, ast.ImportFrom) and node.module else []
            names += (
                [part for alias in node.names for part in alias.name.split(".")] if isinstance(node, ast.Import) else []
            )
            used += [
                f"{path.relative_to(ROOT)}:{node.lineno}: {name}"
                for name in names
                if name.startswith("_") and not name.startswith("__") and name not in own
            ]
    assert used == [], "private names of a library (use its public API): " + "; ".join(used)


def test_the_shell_keeps_no_mutable_state_at_module_level():
    found = []
    for path in sorted((ROOT / "shell").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        module_names = {t.id for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign) for t in targets(n)}
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Global):
                found.append(f"{where}: global {', '.join(node.names)}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value
                mutating = node.func.attr in MUTATING
                if mutating and isinstance(owner, ast.Name) and owner.id in module_names:
                    found.append(f"{where}: {owner.id}.{node.func.attr}(...)")
            elif isinstance(node, ast.Assign | ast.AugAssign):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                        if target.value.id in module_names:
                            found.append(f"{where}: {target.value.id}[...] =")
    assert found == []


def targets(node: ast.Assign | ast.AnnAssign) -> list[ast.Name]:
    return [t for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)]


def test_the_shell_does_not_grow_back():
    lines = {path.name: len(path.read_text(encoding="utf-8").splitlines()) for path in (ROOT / "shell").glob("*.py")}
    assert sum(lines.values()) <= SHELL_LINES, sorted(lines.items(), key=lambda item: -item[1])


def compositions(monkeypatch) -> list[str]:
    """Counts Hydra's compositions: each reads configs/train.yaml once."""
    opened, real_open = [], builtins.open

    def counting(file, *args, **kwargs):
        if str(file).endswith("configs/train.yaml"):
            opened.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", counting)
    return opened


def test_hydra_composes_a_runs_config_once_and_a_sweeps_once_a_job(small_text, monkeypatch):
    """Before it runs anything, hydra.main composes the config once to read its run mode; then it composes the
    run's config, or the sweep's and each job's (its sweeper once more a job, to check the batch before it
    launches it). All of them Hydra's: the shell composes none of its own."""
    args = [*TINY_OVERRIDES, f"data.path={small_text}", "trainer.max_steps=2", "checkpoint.every_n_steps=2"]
    opened = compositions(monkeypatch)
    assert train_here(*args).returncode == 0
    assert len(opened) == 1 + 1
    opened.clear()
    assert train_here("-m", *args, "optim.lr=1e-3,2e-3").returncode == 0
    assert len(opened) == 1 + 1 + 2 * 2
