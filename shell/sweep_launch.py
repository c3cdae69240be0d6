"""Where a sweep (`python train.py -m ...`, or a search: `-m hparams_search=optuna`) runs, chosen before
Hydra starts: a new sweep is checked whole (shell.sweep_checks) and given one new folder, unless
hydra.sweep.dir names one; `-m resume=SWEEP` continues a sweep in its own folder with the command line it
was started with, keeping the jobs that finished, and so does a launch its scheduler restarted. These are
the -m methods of shell.launch.Launch, which reads the command line they work on."""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from shell import resume
from shell.command_line import CommandLineError, Composer, parse_overrides
from shell.errors import USER_ERRORS
from shell.run_folder import (
    SWEEP_RECORD,
    SWEEPS_ROOT,
    Claim,
    RunFolder,
    RunFolderError,
    check_hydra_folder,
    claim_new_folder,
    claim_sweep,
    hydra_override,
    launcher_folder,
    launcher_restarted,
    run_where_started,
    sweep_continue_command,
    take_back_claims,
)
from shell.sweep import fail_abandoned_trials, is_search, summarize
from shell.sweep_checks import (
    check_direction,
    check_intervals,
    check_jobs,
    check_launch_sweep,
    check_search_sweeper,
    check_storage,
    check_subdir,
    check_trial_counts,
    refuse_swept_hydra_settings,
    searched_settings,
    sweep_combinations,
)
from shell.sweep_records import JOB_RECORD, SweepRecord, continue_command, sweep_record

SEARCH_RESULT = "optimization_results.yaml"  # the best trial, which the search writes as it ends
CONTINUED_SWEEP = "TINYGPT2_CONTINUED_SWEEP"  # the sweep folder a -m resume= launch continues


class SweepLaunch:
    """Launch's methods for a command line with -m (see shell.launch.Launch for its attributes)."""

    args: list[str]
    flags: list[str]
    overrides: list[str]
    user: list[str]
    hydra_overrides: list[str]
    hydra: dict[str, str]
    first: bool
    claim_folders: bool
    shown: str | None

    def sweep(self, composer: Composer) -> list[str]:
        """-m: every value of every swept setting is checked (of the command line, and the choices of a
        search such as hparams_search=optuna), then the sweep gets one new folder, unless
        hydra.sweep.dir names one; -m resume=SWEEP continues a sweep in its own."""
        continued = self.continued_or_requeued(composer)
        if continued is not None:
            return continued
        sweeper = self.check_sweep(composer)
        args = self.sweep_folder()
        if self.claim_folders and "optuna" in str(sweeper.get("_target_", "")).lower():
            try:
                open_study_storage(sweeper.get("storage"))
            except CommandLineError:
                take_back_claims()  # the sweep folder just made
                raise
            if isinstance(sweeper.get("storage"), str):
                for line in fail_abandoned_trials(sweeper["storage"], str(sweeper.get("study_name"))):
                    print(line, file=sys.stderr)
        return args

    def continued_or_requeued(self, composer: Composer) -> list[str] | None:
        """-m continuing a sweep, in any process of a launch: the one resume= names, or the one a launch
        its scheduler restarted had begun (continued_sweep's arguments); None for a new sweep."""
        given = [o for o in self.user if "=" in o and resume.is_resume(o)]
        swept = next((o for o in parse_overrides(given) if o.is_sweep_override()), None)
        if swept is not None:  # (read as the name of one sweep, it was not found, or the rest was refused)
            raise CommandLineError(
                f"{swept.input_line}: resume= cannot be swept; with -m it names the one sweep to continue (python "
                "train.py -m resume=multirun/DATE/TIME), and a run continues alone (python train.py resume=RUN)"
            )
        named = resume.given(given)
        if named and named[-1] in ("", "null"):  # an unset shell variable: not a new sweep of the defaults
            raise CommandLineError(
                f"resume={named[-1]} with -m names no sweep to continue: give its folder (python train.py -m "
                "resume=multirun/DATE/TIME), or leave resume= out to start a new sweep"
            )
        if named:
            return self.continued_sweep(composer, named[-1])
        requeued = self.requeued_sweep()
        return None if requeued is None else self.continued_sweep(composer, str(requeued), requeued=True)

    def requeued_sweep(self) -> Path | None:
        """The folder of the sweep that this launch, restarted by its scheduler (a requeued SLURM job,
        workers torchrun started again), began before; None for any other launch."""
        shared = launcher_folder(SWEEPS_ROOT)
        if shared is None or self.hydra.get("hydra.sweep.dir") or not launcher_restarted():
            return None
        return shared.path if (shared.path / SWEEP_RECORD).is_file() else None

    def check_sweep(self, composer: Composer) -> dict:
        """Checks every job's settings before the first starts; returns the sweeper's settings."""
        parsed, hydra_parsed = parse_overrides(self.user), parse_overrides(self.hydra_overrides)
        refuse_swept_hydra_settings(hydra_parsed)
        fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
        composed = composer.compose(
            fixed + [o.input_line for o in hydra_parsed if not o.is_sweep_override()], with_hydra=True
        )
        if self.hydra.get("hydra.sweep.dir"):  # the folder it names now (multirun/${now:%H-%M}: this minute's)
            self.hydra["hydra.sweep.dir"] = str(composed["hydra"]["sweep"]["dir"])
        sweeper = composed["hydra"].get("sweeper") or {}
        searching = "optuna" in str(sweeper.get("_target_", "")).lower()
        if searching:
            check_search_sweeper(sweeper)
        check_trial_counts(sweeper)
        search = searched_settings(sweeper, parsed, hydra_parsed, composed, self.user)
        combinations = sweep_combinations(self.user + search)
        check_jobs(composer, combinations)
        check_direction(sweeper, searching)
        check_intervals(composer, self.user + search, combinations, searching)
        check_storage(sweeper.get("storage"))
        several = searching or any(o.is_sweep_override() for o in parsed)
        check_subdir(self.hydra.get("hydra.sweep.subdir"), several)
        return sweeper

    def sweep_folder(self) -> list[str]:
        if self.hydra.get("hydra.sweep.dir"):
            folder = Path(self.hydra["hydra.sweep.dir"]).expanduser()
            check_hydra_folder(folder.absolute())
            owner = RunFolder(folder).held_by() if folder.is_dir() else None
            if owner:
                raise RunFolderError(
                    f"hydra.sweep.dir={folder} is the folder of a sweep under way ({owner}); choose a new or "
                    "empty folder"
                )
            if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
                raise RunFolderError(
                    f"hydra.sweep.dir={folder} is not empty; a sweep writes numbered run folders and a "
                    "summary there, so choose a new or empty folder"
                )
            if self.claim_folders:
                claim_sweep(Claim.make(RunFolder(folder)))
            given = [a for a in self.args if a.lstrip("+").partition("=")[0] != "hydra.sweep.dir"]
            return [*given, hydra_override("hydra.sweep.dir", folder)]  # as it names a folder now
        check_hydra_folder(Path(SWEEPS_ROOT).absolute())
        if not self.claim_folders:
            return self.args
        shared = launcher_folder(SWEEPS_ROOT)  # torchrun, SLURM: every process derives the same folder
        if shared is not None:  # the launch's other processes may already be starting their jobs in it
            check_launch_sweep(shared.path)
            return [*self.args, hydra_override("hydra.sweep.dir", shared.path)]
        return [*self.args, hydra_override("hydra.sweep.dir", claim_sweep(claim_new_folder(SWEEPS_ROOT)).folder.path)]

    def continued_sweep(self, composer: Composer, given: str, requeued: bool = False) -> list[str]:
        """-m resume=SWEEP: the sweep's own command line again (from the folder it was started in), into
        its folder, checked as it was: jobs that finished are kept as they are, a stopped one continues
        from its checkpoint, one stopped before its first checkpoint starts again, and those that never
        ran run (run_job asks each job's folder which: RunFolder.continuation). `requeued`: the sweep's
        own command, which a scheduler started again (requeued_sweep)."""
        folder = self.sweep_to_continue(given, requeued)
        if requeued and is_search(folder) and (folder / SEARCH_RESULT).is_file():  # stopped as it ended
            self.shown = (
                f"this job was restarted by its scheduler, and its search had ended: {folder / SEARCH_RESULT}\n"
            )
            return self.args
        started = self.started_sweep(folder, given, requeued)
        if self.claim_folders:
            run_where_started(started.cwd)  # its relative paths (data.path=input.txt) name what they named
        args = self.continued_args(folder, started)
        jobs = self.jobs_of(composer, folder, args)
        if jobs and all(job.is_finished() for job in jobs):
            return self.every_job_finished(folder, requeued)
        if self.claim_folders:
            if self.first:
                claim_sweep(Claim.existing(RunFolder(folder)))  # another continue started at the same moment: refused
            os.environ[CONTINUED_SWEEP] = str(folder)
        return args

    def sweep_to_continue(self, given: str, requeued: bool) -> Path:
        """The folder of the sweep resume= names, with -m and no other setting beside it (but where a
        scheduler restarted the sweep's own command)."""
        if given == "auto":
            raise CommandLineError("resume=auto continues one run: run it without -m (python train.py resume=auto ...)")
        others = [o for o in self.overrides if not resume.is_resume(o)]
        if others and not requeued:
            raise CommandLineError(
                f"-m resume={given} continues the sweep with its own command line; leave out {others[0]} (a "
                "job of it continues with settings of its own as python train.py resume=SWEEP/N ...)"
            )
        return RunFolder(given).path

    def started_sweep(self, folder: Path, given: str, requeued: bool) -> SweepRecord:
        """How the sweep at folder was started, where it can continue: not under way in another process,
        the folder it was started in still there, and (`requeued`) the same command line again."""
        try:
            started = sweep_record(folder, given, requeued)
        except CommandLineError as err:
            if not requeued:
                raise
            raise RunFolderError(
                f"this job was restarted by its scheduler, and its sweep cannot continue: {err}"
            ) from None
        if requeued and self.user != started.task:
            raise RunFolderError(
                f"this job was restarted by its scheduler with another command line than its sweep, {folder}, was "
                f"started with; continue that sweep as it was with {sweep_continue_command(folder)}"
            )
        owner = RunFolder(folder).held_by()
        if owner and self.first:  # (the other processes of a launch find it held by the first)
            raise RunFolder(folder).under_way(owner)
        if requeued and self.first:
            print(f"this job was restarted by its scheduler: continuing the sweep {folder}", file=sys.stderr)
        if not Path(started.cwd).is_dir():
            raise RunFolderError(
                f"the sweep {folder} was started in {started.cwd}, which is gone, and what its command line names "
                f"there cannot be found; restore that folder, or continue its stopped jobs alone with "
                f"{continue_command(folder / 'N')}"
            )
        return started

    def continued_args(self, folder: Path, started: SweepRecord) -> list[str]:
        """The arguments to give Hydra: the sweep's command line as started, into its folder, each job
        recording this command as job_record decides."""
        recorded = [
            o
            for o in started.hydra
            if o.lstrip("+").partition("=")[0] not in ("hydra.sweep.dir", "hydra.mode", "hydra.output_subdir")
        ]
        return [
            *self.flags,
            *started.task,
            *recorded,
            hydra_override("hydra.sweep.dir", folder),
            f"hydra.output_subdir=${{{JOB_RECORD}:}}",
        ]

    def jobs_of(self, composer: Composer, folder: Path, args: list[str]) -> list[RunFolder]:
        """The folders of the jobs of the sweep at folder, which `args` continue (checked as it was
        started); [] where they cannot be told (a glob of choices, fewer runs found than jobs)."""
        again = type(self)(args, claim_folders=self.claim_folders)
        try:
            again.check_sweep(composer)
        except (*USER_ERRORS, CommandLineError) as err:
            raise CommandLineError(f"the sweep {folder} cannot continue as it was started: {err}") from None
        numbered = "hydra.sweep.subdir" not in again.hydra and not any("glob(" in o for o in again.user)
        wanted = len(sweep_combinations(again.user, limit=math.inf))
        if numbered:
            return [RunFolder(folder / str(n)) for n in range(wanted)]
        # folders named by hydra.sweep.subdir: the runs found under the sweep, when there are as many
        saved = RunFolder(folder).settings_file.name
        found = [RunFolder(p.parent) for p in sorted(folder.rglob(saved)) if p.parent.name != ".hydra"]
        found = [job for job in found if job.holds_run()]
        return found if len(found) == wanted and not any("glob(" in o for o in again.user) else []

    def every_job_finished(self, folder: Path, requeued: bool) -> list[str]:
        """A sweep to continue whose every job finished: nothing to do where a scheduler restarted it
        (stopped as it ended), refused where a command line asked."""
        if requeued:
            summarize(folder)
            summary = folder / "summary.csv"
            self.shown = (
                f"this job was restarted by its scheduler, and every job of its sweep had finished: {summary}\n"
            )
            return self.args
        raise CommandLineError(
            f"every job of the sweep {folder} finished (its summary: {folder / 'summary.csv'}); to train "
            f"one further, continue it alone: {continue_command(folder / 'N')} trainer.max_steps=..."
        )

    def sweep_of_launch(self, composer: Composer) -> list[str]:
        """-m in a process the first of a launch did not start: torchrun's and SLURM's derive the sweep
        folder the first chose, or continue the sweep it continues; Lightning's own launcher hands it
        over on the command line."""
        continued = self.continued_or_requeued(composer)
        if continued is not None:
            return continued
        shared = launcher_folder(SWEEPS_ROOT)
        if shared is None or self.hydra.get("hydra.sweep.dir"):
            return self.args
        return [*self.args, hydra_override("hydra.sweep.dir", shared.path)]


def open_study_storage(storage) -> None:
    """A search's storage, opened once before its sweep starts, so that it holds Optuna's tables before
    the sweeper opens it: two searches started at once on a new SQLite file each made them, and the
    second failed with a traceback (UNIQUE constraint failed: alembic_version), its sweep folder left.
    For SQLite, the searches take turns under a lock on the file's folder."""
    if not isinstance(storage, str):
        return  # in memory
    import optuna

    try:
        with storage_lock(storage):
            optuna.storages.RDBStorage(storage).engine.dispose()
    except Exception as err:
        problem = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CommandLineError(
            f"hydra.sweeper.storage={storage} cannot be opened ({problem}); check that the database can be "
            "reached and written, or give another storage"
        ) from None


def storage_lock(storage: str) -> contextlib.AbstractContextManager:
    """For a SQLite storage, a lock on its file's folder that every search of this project takes to open
    the file, one search at a time; for other databases, nothing (they make their tables safely)."""
    from sqlalchemy.engine import make_url

    url = make_url(storage)
    if url.get_backend_name() != "sqlite":
        return contextlib.nullcontext()
    return folder_lock(Path(url.database).expanduser().absolute().parent)


@contextlib.contextmanager
def folder_lock(folder: Path) -> Iterator[None]:
    """An exclusive lock on folder while the block runs, waited for (none without flock: Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    held = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield
    finally:
        os.close(held)  # (and its lock)
