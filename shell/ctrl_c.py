"""Ctrl-C (and SIGTERM) outside the training loop, which stops after a micro-batch of its own
(shell.stop.GracefulStop). train.py holds them while Hydra's code and the command line's checks run
(hold_ctrl_c), and takes them as KeyboardInterrupt in between (release_ctrl_c); a stop then takes back
what the process made, unless the run has a checkpoint to continue from, and says which
(stopped_by_ctrl_c).

Ctrl-C in the first process of a launch that started the others itself (trainer.strategy=ddp with
trainer.devices above 1 on one machine: Lightning starts each further process as a child running
train.py again).

Until the training loop takes Ctrl-C over (shell.stop.GracefulStop), that process may wait inside
a rendezvous or a collective, which a signal does not interrupt: Python raises KeyboardInterrupt only
when the wait ends. Its children stop at the same Ctrl-C, and Lightning, seeing one of them end, kills
the first process (SIGKILL) within seconds, before it could take back its new run folder. There a
thread of its own takes the Ctrl-C: it says how the launch stopped (taking back what it made), ends the
children and the process. A process that started none gets KeyboardInterrupt, as any Python program.

While Lightning starts the children, the main thread blocks SIGINT (block_for_children; the watch's
thread receives it, and Python still runs the handler on the main thread): they inherit it blocked, so
a Ctrl-C as they start waits until their train.py takes it (hold_ctrl_c unblocks it), where it would
break Python's own start-up.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from shell.run_folder import RunFolder, is_sweep, process_rank, take_back_claims
from shell.sweep import how_to_continue_sweep


class CtrlCWatch:
    """Ctrl-C while a job starts: train.py's main arms it; the training loop's own stop takes over from
    its first step (GracefulStop). Which takes a Ctrl-C, the main thread (KeyboardInterrupt) or the
    watch's thread, is decided once for it: the thread where this process's Trainer has started the
    launch's other processes (see block_for_children)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.taker: str | None = None  # "thread" or "main", for the Ctrl-C under way
        self.report: Callable[[], None] = lambda: None
        self.launcher: Any = None  # Lightning's launcher that started the other processes (they run a sweep's
        # every job beside this process's, so it stays)
        self.training = False  # the training loop takes Ctrl-C (until the next job is armed)
        self.reading: int | None = None

    def arm(self, report: Callable[[], None]) -> None:
        """From here Ctrl-C is this watch's, until train.py holds it again or the training loop takes it.
        `report`: says how the launch stopped, taking back what it made (stopped_by_ctrl_c,
        without its exit). Called on the main thread."""
        self.report, self.taker, self.training = report, None, False
        if not hasattr(signal, "pthread_sigmask"):  # (Windows: Ctrl-C is KeyboardInterrupt throughout)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            return
        if self.reading is None:
            self.reading, writing = os.pipe()
            os.set_blocking(writing, False)
            signal.set_wakeup_fd(writing, warn_on_full_buffer=False)  # each signal's number, as it arrives
            threading.Thread(target=self.watch, daemon=True, name="ctrl-c-watch").start()
        signal.signal(signal.SIGINT, self.handle)

    def children(self) -> list:
        """The launch's processes this one started (Popen objects), those that ended too."""
        return list(getattr(self.launcher, "procs", None) or [])

    def take(self) -> str:
        with self.lock:
            if self.taker is None:
                self.taker = "thread" if self.children() and not self.training else "main"
            return self.taker

    def handle(self, signum, frame) -> None:
        if self.take() == "main":
            raise KeyboardInterrupt
        threading.Event().wait(10)  # the thread ends the process; the main thread goes no further meanwhile

    def watch(self) -> None:
        unblock_ctrl_c()  # the thread that the process's SIGINT reaches while the main thread blocks it
        while True:
            arrived = os.read(self.reading, 512)
            if signal.SIGINT not in arrived or signal.getsignal(signal.SIGINT) != self.handle:
                continue  # another signal; or Ctrl-C while it is held or the training loop's own
            if self.take() != "thread":
                continue
            try:
                self.end_children()
                self.report()
                for stream in (sys.stdout, sys.stderr):
                    stream.flush()
            except BaseException:
                pass  # (the exit below comes whatever happened)
            finally:
                os._exit(130)

    def end_children(self) -> None:
        """Kill the launch's processes this one started (as Lightning ends them; they hold nothing of the
        run), taken out of Lightning's list first: its watch over them would kill this process too, on
        seeing one of them killed."""
        children = self.children()
        if self.launcher is not None:
            self.launcher.procs.clear()  # (the list Lightning's watch reads)
        for child in children:
            try:
                child.kill()
                child.wait(timeout=30)
            except Exception:
                pass

    def training_started(self) -> None:
        """The training loop takes Ctrl-C from here (GracefulStop), every process of the launch alike."""
        self.training = True
        unblock_ctrl_c()


WATCH = CtrlCWatch()


def block_for_children(trainer) -> None:
    """Before `trainer.fit` of a process whose Trainer starts the launch's other processes: the watch's
    thread takes a Ctrl-C from here, and SIGINT is blocked on the main thread until training starts, so
    that they inherit it blocked. Nothing for any other process, or without an armed watch."""
    environment = getattr(trainer.strategy, "cluster_environment", None)
    starts_them = environment is not None and not environment.creates_processes_externally
    if trainer.world_size > 1 and starts_them and WATCH.reading is not None and trainer.global_rank == 0:
        WATCH.launcher = trainer.strategy.launcher
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


def unblock_ctrl_c() -> None:
    """SIGINT delivered to this thread again (see block_for_children): the launch's processes have
    started, or this one's train.py is ready to take a Ctrl-C it was started with blocked."""
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def stopped_by_ctrl_c(run_dir: Path | None = None, resume_record: Path | None = None) -> NoReturn:
    """Ctrl-C (or SIGTERM) outside the training loop's own graceful stop (start-up, data preparation, a
    second Ctrl-C): what this process made is taken back, unless the run has a checkpoint to continue
    from; one line says which. Exits with 128 + the signal's number, as the shell reports a process the
    signal ended. `run_dir`: the run's folder, once Hydra runs it."""
    report_ctrl_c(run_dir, resume_record)
    sys.exit(128 + (_STOPPED_BY[-1] if _STOPPED_BY else signal.SIGINT))


def report_ctrl_c(run_dir: Path | None = None, resume_record: Path | None = None) -> None:
    """stopped_by_ctrl_c's work but for the exit. The processes a launch's first started say nothing:
    they made nothing, and the first says how the launch stopped."""
    if process_rank() != 0:
        return
    WATCH.end_children()  # those a ddp launch started, still in a job of its sweep: they would wait for this one
    kept = take_back_claims()
    if resume_record is not None:
        shutil.rmtree(resume_record, ignore_errors=True)  # a resume that never started leaves its run as it was
    if run_dir is not None and RunFolder(run_dir).has_checkpoint():
        kept.append(RunFolder(run_dir))
    runs = [folder for folder in kept if folder.has_checkpoint()]
    sweeps = [folder.sweep() for folder in runs if folder.sweep()] or [
        folder.path for folder in kept if is_sweep(folder.path)
    ]
    if runs:
        print(f"\nstopped; continue with: {runs[0].continue_command()}", file=sys.stderr)
    if sweeps:  # a stop between two jobs of a sweep too
        print(("" if runs else "\nstopped; ") + how_to_continue_sweep(sweeps[0]), file=sys.stderr)
    elif not runs:
        said = (
            "before training began; nothing was written"
            if run_dir is None
            else "before the run's first checkpoint; nothing was kept"
        )
        print(f"\nstopped {said}", file=sys.stderr)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # Ctrl-C, and `kill`'s or a scheduler's stop: taken alike
_HELD_CTRL_C: list[int] = []  # a stop signal received while they were held
_STOPPED_BY: list[int] = []  # the stop signal that raised KeyboardInterrupt
_DEFERRED_STOP: list[int] = []  # a stop signal a job of a sweep took at its last step (defer_stop)


def hold_ctrl_c() -> None:
    """From here until release_ctrl_c, Ctrl-C (and SIGTERM) is held: Hydra composes each job's config in
    OmegaConf state changes that a KeyboardInterrupt would leave half done (Hydra then prints a
    traceback), and the command line's checks import libraries that one would break."""
    for stop in STOP_SIGNALS:
        signal.signal(stop, held_ctrl_c)
    unblock_ctrl_c()  # a process a ddp launch started has it blocked from its start (block_for_children)


def held_ctrl_c(signum, frame) -> None:
    """A Ctrl-C while held is kept for release_ctrl_c. Pressed again before that (a check that waits on
    a slow disk), the process ends at once, as while its libraries load."""
    if _HELD_CTRL_C:
        signal.signal(signum, signal.SIG_DFL)
        if process_rank() == 0:
            twice = "Ctrl-C twice" if signum == signal.SIGINT else f"{signal.Signals(signum).name} after a stop"
            os.write(2, f"\nstopped at once ({twice})\n".encode())  # (not print: the handler may run inside one)
            WATCH.end_children()
        os.kill(os.getpid(), signum)
    _HELD_CTRL_C.append(signum)


def interrupt(signum, frame) -> NoReturn:
    """Ctrl-C, or SIGTERM, outside the training loop (which stops after a micro-batch, GracefulStop): a
    KeyboardInterrupt, which takes back what the run made as for Ctrl-C."""
    _STOPPED_BY.append(signum)
    raise KeyboardInterrupt


def defer_stop(signal_name: str) -> None:
    """A stop signal the training loop took at a job's last step, which ended the job as it would have
    ended anyway: the sweep stops as its next job begins (raise_deferred_stop), as at a Ctrl-C between
    two jobs; after the last job there is nothing left to stop."""
    _DEFERRED_STOP.append(signal.Signals[signal_name])


def raise_deferred_stop() -> None:
    """The stop that the job before this one took at its end (defer_stop), as a KeyboardInterrupt."""
    if _DEFERRED_STOP:
        _STOPPED_BY.append(_DEFERRED_STOP.pop())
        _DEFERRED_STOP.clear()
        raise KeyboardInterrupt


def release_ctrl_c() -> None:
    """Ctrl-C and SIGTERM are handled again (KeyboardInterrupt); one received while held is raised now."""
    for stop in STOP_SIGNALS:
        signal.signal(stop, interrupt)
    if _HELD_CTRL_C:
        _STOPPED_BY.append(_HELD_CTRL_C[-1])
        _HELD_CTRL_C.clear()
        raise KeyboardInterrupt
