"""Start-up: the scripts import only the libraries a run uses, and leave the garbage collector off
while they import. A script runs as a user runs it, with PYTHONPROFILEIMPORTTIME=1 (what `python -X
importtime` sets), and the modules it reports are checked; the same process runs under a watch on the
collector."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.common import ROOT, TINY_OVERRIDES, run_script, script_environment, train_here

# What generate.py never needs: the training stack, the trackers, Hugging Face's libraries, plotting
NOT_FOR_GENERATING = {
    "lightning",
    "hydra",
    "omegaconf",
    "datasets",
    "pandas",
    "wandb",
    "tensorboard",
    "transformers",
    "matplotlib",
}


def profiled_env() -> dict[str, str]:
    return {**script_environment(None, None), "PYTHONPROFILEIMPORTTIME": "1"}


def import_tree(stderr: str) -> list[tuple[int, str]]:
    """(depth, module) for every module the process imported, in the order `-X importtime` reports
    them: a module after the modules its own import brought in, which are one level deeper."""
    tree = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or line.count("|") != 2:
            continue
        name = line.rsplit("|", 1)[1]
        if name.strip() != "imported package":  # the header
            tree.append(((len(name) - len(name.lstrip()) - 1) // 2, name.strip()))
    return tree


def packages(tree: list[tuple[int, str]]) -> set[str]:
    return {name.split(".")[0] for _, name in tree}


def importer(tree: list[tuple[int, str]], package: str) -> str | None:
    """The module whose import first brought `package` in; None when the script itself or a function
    running after start-up imported it."""
    first = next(i for i, (_, name) in enumerate(tree) if name.split(".")[0] == package)
    depth = tree[first][0]
    for later_depth, name in tree[first + 1 :]:
        if later_depth < depth:
            if name.split(".")[0] != package:
                return name
            depth = later_depth
    return None


def test_a_refused_command_line_says_every_problem_in_order():
    """The checks report all the problems of a command line, not only the first. (They run inside Hydra's
    job now, so a refused command line has imported Lightning by then: no import profile to check.)"""
    ran = train_here("optim.lr=0", "model.n_layer=0")
    assert ran.returncode == 1
    assert [line for line in ran.stderr.splitlines() if line.startswith("error:")] == [
        "error: optim.lr must be above 0, got 0",
        "error: model.n_layer must be a whole number of at least 1, got 0",
    ]


def test_generating_imports_no_training_tracking_or_plotting_library(tiny_run):
    proc = run_script(
        "generate.py", "--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "4", env=profiled_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = packages(import_tree(proc.stderr))
    assert {"torch", "tokenizers", "generation", "shell"} <= imported  # the profile was read
    assert not imported & NOT_FOR_GENERATING


def test_generating_from_a_hugging_face_folder_reads_it_without_transformers(transformers_folder):
    proc = run_script(
        "generate.py",
        "--ckpt",
        str(transformers_folder),
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        "4",
        env=profiled_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = packages(import_tree(proc.stderr))
    assert "safetensors" in imported  # the folder's weights were read
    assert not imported & NOT_FOR_GENERATING


# Runs a script as `python script.py` does (as __main__, its own folder first on sys.path), counting the
# collector's passes once torch is being imported, before and after the script froze its start-up (the
# script's own compilation comes before it can turn the collector off), and reports the collector's
# state at exit, after the script's own work.
GC_WATCH = """
import atexit, gc, json, runpy, sys
passes = {"before": 0, "after": 0}
def count(phase, info):
    if phase == "start" and "torch" in sys.modules:
        passes["after" if gc.get_freeze_count() else "before"] += 1
gc.callbacks.append(count)
@atexit.register
def report():
    print("GC " + json.dumps({**passes, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}), file=sys.stderr)
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rpartition("/")[0] or ".")
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def collector_watch(tmp_path, *args: str, env: dict | None = None) -> tuple[dict, subprocess.CompletedProcess]:
    """A script run under the collector's watch (GC_WATCH): what it saw, and the finished process."""
    watch = tmp_path / "gc_watch.py"
    watch.write_text(GC_WATCH)
    proc = subprocess.run(
        [sys.executable, str(watch), str(ROOT / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=600,
        env=env or script_environment(None, None),  # as run_script gives a script
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stderr.rsplit("GC ", 1)[1].splitlines()[0]), proc


def test_a_run_imports_no_wandb_nor_datasets_on_cached_tokens_and_collects_only_after_start_up(small_text, tmp_path):
    """One train.py process, the only one of this file: a logger=csv run whose tokens an earlier run (here, in
    this process) cached. It never imports wandb, nor HF datasets, which only reads text; transformers and
    matplotlib come in only through Lightning's torchmetrics (since shell/startup.py no longer keeps them out
    through torchmetrics' private names), else after start-up (loss.png drawn at the end). The objects start-up
    makes live as long as the process: frozen, never swept while importing, and the collector is on for what
    training makes (a sweep's jobs, a long run)."""
    args = [*TINY_OVERRIDES, f"data.path={small_text}", "data.num_proc=1"]
    assert train_here(*args, "hydra.run.dir=first").returncode == 0  # the tokens cached

    seen, proc = collector_watch(tmp_path, "train.py", *args, "hydra.run.dir=second", env=profiled_env())
    assert "using cached tokens" in proc.stdout + proc.stderr
    tree = import_tree(proc.stderr)
    imported = packages(tree)
    assert {"torch", "lightning", "hydra", "shell", "training"} <= imported  # the profile was read
    assert "wandb" not in imported and "datasets" not in imported
    for package in ("transformers", "matplotlib"):
        if package in imported:
            brought_by = importer(tree, package)
            assert brought_by is None or brought_by.startswith("torchmetrics."), (package, brought_by)

    assert seen["before"] == 0, seen
    assert seen["frozen"] > 100_000, seen  # torch, Lightning and Hydra's objects
    assert seen["enabled"] and seen["after"] > 0, seen


def test_generating_imports_with_the_collector_off_and_collects_while_sampling(tiny_run, tmp_path):
    seen, _ = collector_watch(
        tmp_path, "generate.py", "--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "4"
    )
    assert seen["before"] == 0, seen
    assert seen["frozen"] > 50_000, seen
    assert seen["enabled"], seen
