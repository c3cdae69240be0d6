"""What the tests share: paths and settings, the text and data they make, the scripts run as a user
runs them, and what they read back from runs and checkpoints. Fixtures live in conftest.py and tiny.py."""

from __future__ import annotations

import csv
import functools
import io
import logging
import os
import re
import shlex
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
FAULTS = ROOT / "tests" / "faults"  # put on PYTHONPATH where a test injects a fault (failpoints.py there)
SHAKESPEARE_CHARS = 1_115_394  # the length of Tiny Shakespeare's input.txt

# The default data settings (data.cache_dir, data.local_copies), as train.py composes them
SHAKESPEARE_DEFAULTS = OmegaConf.load(ROOT / "configs" / "data" / "shakespeare.yaml")
# The user's own cache ($TINYGPT2_CACHE or ~/.cache/tinygpt2), read when the tests start, before
# conftest.py points TINYGPT2_CACHE at a folder of the session's own
USER_CACHE = Path(SHAKESPEARE_DEFAULTS.cache_dir).expanduser()
# A data.url that fails at once: the tests never download
NO_DOWNLOAD = "file:///nonexistent/input.txt"
PUT_SHAKESPEARE = "put it at ../shared/data/tinyshakespeare.txt beside the checkout, or set TINYSHAKESPEARE=/path/to/it"
NEEDS_SHAKESPEARE = f"needs Tiny Shakespeare: {PUT_SHAKESPEARE}"


@functools.cache
def find_tiny_shakespeare() -> Path | None:
    """Tiny Shakespeare found as `python train.py` run in the checkout finds it (data.sources):
    $TINYSHAKESPEARE in the place of data.path, then the user's cache, then data.local_copies; but
    never downloaded. None when this machine has no copy."""
    if os.environ.get("TINYSHAKESPEARE"):
        return Path(os.environ["TINYSHAKESPEARE"]).expanduser()
    from data.sources import find_shakespeare

    copies = [os.path.normpath(ROOT / Path(copy).expanduser()) for copy in SHAKESPEARE_DEFAULTS.local_copies]
    found = find_shakespeare(str(USER_CACHE), copies, NO_DOWNLOAD)
    return Path(found) if found else None


# Overrides that make any composed config a tiny, quick CPU run (a 2-layer, 32-wide model).
TINY_OVERRIDES = [
    "model.n_layer=2",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "tokenizer.vocab_size=300",
    "data.batch_size=8",
    "trainer.max_steps=6",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=4",
    "trainer.enable_progress_bar=false",
    "trainer.log_every_n_steps=1",
    "optim.warmup_steps=2",
    "logger=csv",
    "latest_link=null",
    "trainer.precision=32-true",  # (left to the machine, a CPU with bfloat16 would time both first)
]

# Only the model and tokenizer of TINY_OVERRIDES, for presets that set the rest themselves.
TINY_MODEL_OVERRIDES = TINY_OVERRIDES[:5]


def data_config(cache_dir, **values):
    """A data config as the yaml files give it, with the text source and a private cache."""
    base = dict(
        source="text",
        path=None,
        url=NO_DOWNLOAD,
        local_copies=[],
        cache_dir=str(cache_dir),
        val_fraction=0.1,
        batch_size=4,
        num_workers=0,
    )
    return OmegaConf.create({**base, **values})


def write_documents(folder: Path, text: str, count: int, chars: int = 25_000) -> Path:
    """folder holding `count` text files, the consecutive `chars`-character parts of text."""
    for i in range(count):
        (folder / f"part{i:02d}.txt").write_text(text[i * chars : (i + 1) * chars], encoding="utf-8")
    return folder


def stories(n: int, split: str = "train") -> list[str]:
    """n short numbered documents, each naming its split."""
    return [f"{split} story {i}: the cat sat on the mat, and the dog ran after a ball in the park." for i in range(n)]


def hub_folder(parent: Path, rows: dict[str, int]) -> Path:
    """A dataset folder as the Hugging Face Hub keeps one, a JSON Lines file of `rows[split]` stories a split."""
    import datasets

    folder = parent / "tiny_stories"
    folder.mkdir()
    for split, n in rows.items():
        datasets.Dataset.from_dict({"text": stories(n, split)}).to_json(folder / f"{split}.jsonl", lines=True)
    return folder


def bpe_config(vocab_size: int = 300, **values):
    return OmegaConf.create({"kind": "bpe", "vocab_size": vocab_size, "max_train_chars": 10_000_000, **values})


# The char tokenizer's settings: tokenizing with it is slow enough for a test to stop a preparation part way.
CHAR_TOKENIZER = {"kind": "char"}


def compose_config(*overrides: str):
    """configs/train.yaml composed with these overrides, as Hydra composes it for python train.py."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


def script_command(args: tuple[str, ...], cwd: Path) -> list[str]:
    """The command line of a project script (train.py, ...) run from cwd: named by its full path from
    another folder than the project's."""
    script = args[0] if cwd.resolve() == ROOT else str(ROOT / args[0])
    return [sys.executable, script, *args[1:]]


def script_environment(env: dict | None, failpoint: str | None) -> dict:
    """env, or else this process's environment less any TINYGPT2_FAILPOINT of its own; with failpoint
    given, TINYGPT2_FAILPOINT set to it and tests/faults on PYTHONPATH, which installs the faults in the
    script's processes (tests/faults/failpoints.py)."""
    if env is None:
        env = {key: value for key, value in os.environ.items() if key != "TINYGPT2_FAILPOINT"}
    if not failpoint:
        return dict(env)
    path = os.pathsep.join(filter(None, [str(FAULTS), env.get("PYTHONPATH")]))
    return {**env, "TINYGPT2_FAILPOINT": failpoint, "PYTHONPATH": path}


def inject_faults(monkeypatch, failpoint: str) -> None:
    """TINYGPT2_FAILPOINT=failpoint for what this test runs in its own process (tests/faults/failpoints.py)."""
    from tests.faults import failpoints

    monkeypatch.setenv(failpoints.ENV, failpoint)
    failpoints.FIRED.clear()  # (each test's failpoints fire once in it, whatever fired in this process before)
    failpoints.install()


class Ran(NamedTuple):
    """How a command ended: its exit status and what it printed, as subprocess.run gives them."""

    returncode: int
    stdout: str
    stderr: str


def train_here(*args: str, cwd: Path | None = None, env: dict | None = None) -> Ran:
    """`python train.py ARGS` run in this process, as the command runs it (shell.command_line.run around
    train.py's Hydra entry point), in the current folder unless told, with `env` added to the environment:
    its exit status and what it printed. The process's folder, environment, arguments, signal handlers and
    standard streams are as they were after it. For what a process alone shows (a kill, DDP, a terminal),
    run_script."""
    import signal

    import train
    from shell import command_line

    out, err = io.StringIO(), io.StringIO()
    before = (Path.cwd(), dict(os.environ), sys.argv, sys.stdout, sys.stderr)
    root = logging.getLogger()
    logs = (root.level, list(root.handlers))  # (Hydra sets the root logger up for the job)
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    os.chdir(cwd or Path.cwd())
    os.environ.update(env or {})
    if os.environ.get("TINYGPT2_FAILPOINT"):  # each command's failpoints fire in it, as in a process of its own
        from tests.faults import failpoints

        failpoints.FIRED.clear()
        failpoints.install()
    sys.argv, sys.stdout, sys.stderr = ["train.py", *args], out, err
    try:
        command_line.run(train.main)
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else print(exit.code, file=err) or 1
    finally:
        cwd_before, environ, sys.argv, sys.stdout, sys.stderr = before
        os.chdir(cwd_before)
        os.environ.clear()
        os.environ.update(environ)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        for handler in [h for h in root.handlers if h not in logs[1]]:  # the run's console and train.log
            for logger in (root, *map(logging.getLogger, ("lightning.pytorch", "lightning.fabric", "py.warnings"))):
                logger.removeHandler(handler)
            handler.close()
        root.setLevel(logs[0])
    return Ran(code, out.getvalue(), err.getvalue())


def passes_the_checks(*args: str) -> None:
    """What train.py checks of a command line before it makes anything, in this process and making nothing: the
    command line read as train.py reads it, composed by Hydra (each swept setting at its first value), and the
    settings checked as a run checks them first (shell.settings.check); the run resume= names looked up."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from shell.checks import plain
    from shell.command_line import as_trainer_argument, whole_path
    from shell.folders import folder_of
    from shell.settings import check

    overrides = [whole_path(as_trainer_argument(a)) for a in args if not a.startswith("-")]
    first = [o.input_line if not o.is_sweep_override() else f"{o.key_or_group}={next(iter(o.sweep_string_iterator()), '')}"
             for o in OverridesParser.create().parse_overrides(overrides) if "glob(" not in o.input_line]  # fmt: skip
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=[o for o in first if not o.startswith("hydra.")], return_hydra_config=True)
    if cfg.get("resume") and cfg.resume != "auto":
        folder_of(cfg.resume)
    elif not any(a in ("--cfg", "-c", "--help", "--info") for a in args):
        check(plain(cfg), dict(cfg.hydra.runtime.choices))


def refused(*args: str, cwd: Path | None = None, env: dict | None = None) -> str:
    """train.py's refusal of a command line, run in this process: exit status 1, one `error:` line on stderr
    (no traceback), and nothing left in the folder it ran in. Returns the line without its `error: `."""
    where = Path(cwd or Path.cwd())
    before = snapshot(where, itself=False)
    ran = train_here(*args, cwd=where, env=env)
    assert ran.returncode == 1, f"{args} was not refused: {ran.returncode}\n{ran.stderr[-3000:]}"
    line = one_error_line(ran.stderr)
    assert snapshot(where, itself=False) == before, f"{args} left {set(snapshot(where, itself=False)) - set(before)}"
    return line.removeprefix("error: ")


def run_printed(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """A command a script printed, run verbatim from cwd ("python" being this interpreter)."""
    words = shlex.split(command)
    assert words[0] == "python"
    return subprocess.run(
        [sys.executable, *words[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=script_environment(None, None),
    )


def printed_after(marker: str, said: str) -> str:
    """The one command printed after marker (e.g. "Continue with: ", "sample from it: ")."""
    (line,) = [line for line in said.splitlines() if marker in line]
    return line.split(marker, 1)[1]


def train_as_printed(command: str, cwd: Path) -> Ran:
    """A train.py command the program printed, run in this process (train_here) as a shell would split it."""
    words = shlex.split(command)
    assert words[:2] == ["python", str(ROOT / "train.py")], command
    return train_here(*words[2:], cwd=cwd)


def paste_into_bash(command: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """A command pasted into bash as it is, `python` being this interpreter."""
    python = f'python() {{ {shlex.quote(sys.executable)} "$@"; }}\n'
    return subprocess.run(
        ["bash", "-c", python + command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env=env or script_environment(None, None),
    )


SLURM_JOB = {  # the environment of a one-task SLURM job
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NAME": "tinygpt2",
    "SLURM_NTASKS": "1",
    "SLURM_NTASKS_PER_NODE": "1",
    "SLURM_NODELIST": "localhost",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
}


def run_script(
    *args: str, cwd: Path | None = None, timeout: int = 600, env: dict | None = None, failpoint: str | None = None
) -> subprocess.CompletedProcess:
    """A script of the project (train.py, generate.py, ...) run as a user runs it, in a subprocess, in
    the current folder unless told: a test's own temporary folder (conftest.py), so that relative
    paths such as outputs/ and outputs/latest land there, never in the checkout."""
    cwd = Path(cwd or Path.cwd())
    return subprocess.run(
        script_command(args, cwd),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=script_environment(env, failpoint),
    )


def start_script(
    *args: str, cwd: Path | None = None, env: dict | None = None, failpoint: str | None = None, **popen
) -> subprocess.Popen:
    """A script of the project started as run_script runs it, left running: for tests that stop it."""
    cwd = Path(cwd or Path.cwd())
    return subprocess.Popen(
        script_command(args, cwd), cwd=cwd, env=script_environment(env, failpoint), text=True, **popen
    )


# The sitecustomize.py of stop_at: Python imports it as it starts, before the script.
STOP_HOOK = """\
import importlib.abc
import importlib.util
import os
import sys

MODULE, NAME, SIGNUM = {module!r}, {name!r}, {signum}


def wrap(module):
    *path, attr = NAME.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    original, fired = getattr(owner, attr), []

    def stopped(*args, **kwargs):
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), SIGNUM)
        return original(*args, **kwargs)

    setattr(owner, attr, stopped)


class WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def run_and_wrap(module):
            run(module)
            wrap(module)

        spec.loader.exec_module = run_and_wrap
        return spec


if MODULE in sys.modules:
    wrap(sys.modules[MODULE])
else:
    sys.meta_path.insert(0, WrapOnImport())
"""


def stop_at(folder: Path, target: str, signum: int) -> dict:
    """The environment of a script run (for run_script's env) in which the process sends itself signum
    the first time `target` is called ("module:function" or "module:Class.method"): a Ctrl-C or SIGTERM
    that lands at that named moment, however fast the machine. A sitecustomize.py in folder, put first
    on PYTHONPATH, wraps the function once its module is imported; the function itself runs unchanged."""
    module, name = target.split(":")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(STOP_HOOK.format(module=module, name=name, signum=int(signum)))
    env = script_environment(None, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    return env


def run_in_terminal(*args: str, cwd: Path | None = None, columns: int = 120, timeout: float = 600) -> tuple[int, str]:
    """A script of the project run in a pseudo-terminal `columns` wide: its exit status and all it printed."""
    import fcntl
    import pty
    import select
    import struct
    import termios

    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    cwd = Path(cwd or Path.cwd())
    proc = subprocess.Popen(
        script_command(args, cwd),
        cwd=cwd,
        env=script_environment(None, None),
        stdin=child,
        stdout=child,
        stderr=child,
        close_fds=True,
    )
    os.close(child)
    printed, deadline = bytearray(), time.time() + timeout
    try:
        while time.time() < deadline:
            if select.select([main], [], [], 1.0)[0]:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the terminal's other end closed: the process is done
                    break
                if not chunk:
                    break
                printed += chunk
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
    return proc.wait(timeout=60), printed.decode("utf-8", errors="replace")


def one_error_line(err: str) -> str:
    """The one `error:` line a refused command prints on stderr, and nothing else (no traceback)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def damaged_copy(source: Path, folder: Path, how: str) -> Path:
    """A copy of a checkpoint cut in half, overwritten at its start, emptied, or replaced by text."""
    target = folder / f"{how}.ckpt"
    data = source.read_bytes()
    if how == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif how == "corrupted":
        target.write_bytes(b"\x00garbage" * 16 + data[128:])
    elif how == "empty":
        target.write_bytes(b"")
    else:
        target.write_text("this is not a checkpoint\n")
    return target


# ---- what runs leave ------------------------------------------------------------------------------------


def runs_under(runs_root: Path) -> list[Path]:
    """The run folders under a runs_root (runs_root/<date>/<time>), each from the moment Hydra starts it."""
    return sorted(p.parent.parent for p in runs_root.glob("*/*/.hydra/config.yaml"))


def only_run(runs_root: Path) -> Path:
    runs = runs_under(runs_root)
    assert len(runs) == 1, f"expected one run folder under {runs_root}, found {runs}"
    return runs[0]


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, weights_only=True)["state_dict"]


def assert_same(a, b, where: str = "") -> None:
    """Two nested dicts, lists or tensors are equal, tensors bit for bit."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), f"{where} differs"
    else:
        assert a == b, where


def per_parameter_state(optimizer_state: dict) -> dict:
    """An optimizer's state_dict without its param_groups (whose lr the schedule moves on every step):
    AdamW's moments, or for optim=muon its two optimizers' states."""
    if "state" in optimizer_state:
        return optimizer_state["state"]
    return {part: per_parameter_state(inner) for part, inner in optimizer_state.items()}


def assert_bit_equal(a: Path, b: Path) -> None:
    """Two checkpoints hold the very same weights and optimizer state (AdamW's moments, or Muon's)."""
    first, second = (torch.load(path, weights_only=True) for path in (a, b))
    assert_same(first["state_dict"], second["state_dict"], "state_dict")
    for i, (mine, theirs) in enumerate(zip(first["optimizer_states"], second["optimizer_states"], strict=True)):
        assert_same(per_parameter_state(mine), per_parameter_state(theirs), f"optimizer_states[{i}]")


def train_losses(run: Path) -> dict[int, str]:
    """The training loss logged at each step of a run's metrics.csv, as written; each step logged once."""
    with open(run / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("train/loss")]
    steps = [int(row["step"]) for row in rows]
    assert len(steps) == len(set(steps)), "a step was logged twice"
    return {int(row["step"]): row["train/loss"] for row in rows}


def validations(run: Path) -> dict[int, str]:
    """The validation loss logged at each step of a run's metrics.csv, as written; each step logged once."""
    with open(run / "metrics.csv") as file:
        steps = [(int(row["step"]), row["val/loss"]) for row in csv.DictReader(file) if row.get("val/loss")]
    assert len(steps) == len(dict(steps)), "a validation was logged twice"
    return dict(steps)


def sample_steps(run: Path) -> list[int]:
    """The step of every section of a run's samples.md, in order."""
    return [int(step) for step in re.findall(r"^## step (\d+), ", (run / "samples.md").read_text(), re.MULTILINE)]


def snapshot(folder: Path, itself: bool = True) -> dict[str, tuple]:
    """Every path under a folder, and the folder itself unless told, with what it is: a link and its
    target, or its mode, size and time."""
    if not folder.exists() and not folder.is_symlink():
        return {}
    paths = [folder] if folder.is_symlink() else [*([folder] if itself else []), *folder.rglob("*")]
    seen = {}
    for path in paths:
        stat = path.lstat()
        is_link = path.is_symlink()
        seen[str(path)] = ("link", os.readlink(path)) if is_link else (stat.st_mode, stat.st_size, stat.st_mtime_ns)
    return seen


def flipped_copy(source: Path, target: Path, entry: str) -> Path:
    """A copy of a checkpoint (a zip archive) with 64 bytes inverted inside one entry's data: damaged the way
    a failing disk damages a file, every length and record of the archive as it was."""
    with zipfile.ZipFile(source) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith(entry))
    data = bytearray(source.read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length  # past the entry's local header
    assert info.file_size >= 96
    data[start + 32 : start + 96] = bytes(b ^ 0xFF for b in data[start + 32 : start + 96])
    target.write_bytes(data)
    return target
