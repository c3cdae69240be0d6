"""Every command the README and docs/ show still works as written.

The commands are read from the ```bash blocks themselves. generate.py, explain.py, export.py and studio.py run for
real, in a fresh folder whose outputs/latest is a small run stopped part way; each train.py command line
goes through what train.py checks before it makes anything (tests/common.py's passes_the_checks: the
composition, every setting, what resume= and init_from= name; a --cfg command runs as written), with the
run and Hugging Face folders the docs name made real. The commands that need what a test cannot have (the
network, several GPUs or machines, an installation) are named below, each with the reason."""

from __future__ import annotations

import json
import re
import shlex
import signal
import urllib.request
from pathlib import Path

import pytest

from tests.common import (
    ROOT,
    TINY_OVERRIDES,
    inject_faults,
    passes_the_checks,
    run_script,
    snapshot,
    start_script,
    train_here,
)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN = "outputs/2026-11-21/09-46-02"  # the run folder the docs name
SWEEP = "multirun/2026-11-21/10-14-06"

# Commands not run here, by their start, and why.
NOT_RUN = {
    "pip install": "installs the project (.ci/run does it)",
    "pytest": "the test suite itself",
    "tensorboard": "a server that runs until stopped",
    "torchrun": "starts processes on several GPUs or machines",
    "wandb sync": "uploads to wandb's servers",
    "lm_eval": "needs lm-evaluation-harness installed and studio.py serving; checked by hand (docs/studio.md)",
    f"python train.py -m resume={SWEEP}": "continues a sweep folder, which tests/test_sweeps.py makes and continues",
}


def commands() -> list[str]:
    found = []
    for page in DOCS:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                command = re.split(r"(?:^|\s+)#(?:\s|$)", line)[0].strip()  # (a comment after it, or a line of one)
                if command and command not in found:
                    found.append(command)
    return found


def runs_as_program(command: str) -> bool:
    return command.startswith(("python generate.py", "python explain.py", "python export.py", "python studio.py"))


def test_every_command_is_run_or_named_with_its_reason():
    shown = commands()
    assert len(shown) >= 60
    left = [c for c in shown if not c.startswith("python train.py") and not runs_as_program(c)]
    assert [c for c in left if not c.startswith(tuple(NOT_RUN))] == []


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory, small_text) -> Path:
    """A fresh folder as a user has it after a first run: RUN stopped by a Ctrl-C at step 4 with the tiny
    model (trained in this process), outputs/latest linking it; and the texts the data commands name."""
    from tests.faults import failpoints

    folder = tmp_path_factory.mktemp("user")
    args = [*TINY_OVERRIDES, "model.n_layer=4", f"data.path={small_text}", "checkpoint.every_n_steps=2"]
    args.append(f"hydra.run.dir={RUN}")
    with pytest.MonkeyPatch.context() as patch:
        failpoints.FIRED.discard(("sigint", 4))  # (a failpoint fires once a process: another test's may have)
        inject_faults(patch, "sigint:4")
        stopped = train_here(*args, "latest_link=outputs/latest", cwd=folder)
    assert stopped.returncode == 130, stopped.stderr[-2000:]
    if not (folder / "outputs" / "latest").is_symlink():
        (folder / "outputs" / "latest").symlink_to(folder / RUN)
    for name in ("my_copy_of_input.txt", "my_text.txt", "notes.txt", "quotes.txt"):
        (folder / name).write_text(small_text.read_text(encoding="utf-8"), encoding="utf-8")
    for export in [c for c in commands() if c.startswith("python export.py")]:  # what the other commands read
        exported = run_script(*shlex.split(export)[1:], cwd=folder, timeout=600)
        assert exported.returncode == 0, f"{export}\n{exported.stderr[-2000:]}"
    return folder


PROGRAM_COMMANDS = [
    c for c in commands() if runs_as_program(c) and not c.startswith(("python export.py", "python studio.py"))
]
SERVER_COMMANDS = [c for c in commands() if c.startswith("python studio.py")]


@pytest.mark.slow
@pytest.mark.parametrize("command", PROGRAM_COMMANDS)
def test_each_program_command_runs_as_written(command, user_folder):
    """(The export commands run as the folder is made: the others read what they write.)"""
    args = shlex.split(command)[1:]
    if "--interactive" in args:
        proc = start_script(*args, cwd=user_folder, stdin=-1, stdout=-1, stderr=-1)
        out, err = proc.communicate("ROMEO:\n", timeout=300)
        assert proc.returncode == 0, err[-2000:]
        return
    if "--attention-png" in args:
        (user_folder / args[args.index("--attention-png") + 1]).unlink(missing_ok=True)
    proc = run_script(*args, cwd=user_folder, timeout=600)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("command", SERVER_COMMANDS)
def test_each_studio_command_serves_its_page_until_ctrl_c(command, user_folder):
    server = start_script(*shlex.split(command)[1:], cwd=user_folder, stdout=-1, stderr=-1)
    try:
        line = server.stdout.readline()
        address = re.search(r"http://\S+", line)
        assert address, line + server.stderr.read()[-2000:]
        with urllib.request.urlopen(address.group(0) + "/api/info", timeout=60) as answer:
            assert json.load(answer)["config"]["n_layer"] == 4
    finally:
        server.send_signal(signal.SIGINT)
        _, err = server.communicate(timeout=60)
    assert "Traceback" not in err


TRAIN_COMMANDS = [c for c in commands() if c.startswith("python train.py") and not c.startswith(tuple(NOT_RUN))]


@pytest.mark.slow
def test_each_train_py_command_line_passes_what_train_py_checks_before_it_trains(user_folder, monkeypatch):
    """As train.py reads it before it makes anything (passes_the_checks), nothing made: every setting is known
    and fits, the run resume= names is a run, the folder init_from= names is a model."""
    import export

    monkeypatch.chdir(user_folder)
    if not (user_folder / "hf" / "gpt2").exists():
        assert export.main(["--ckpt", RUN, "--out", "hf/gpt2"]) == 0
    refused = {}
    for command in TRAIN_COMMANDS:
        args = shlex.split(command)[2:]
        if "--cfg" in args:  # Hydra prints the config and ends: run as written, in this process
            before = snapshot(user_folder)
            ran = train_here(*args)
            if ran.returncode != 0 or snapshot(user_folder) != before:
                refused[command] = f"exit {ran.returncode}: {ran.stderr[-1000:]}"
            continue
        try:
            passes_the_checks(*args)
        except Exception as err:  # noqa: BLE001 (each refusal is reported below, with its command)
            refused[command] = f"{type(err).__name__}: {err}"
    assert refused == {}
