"""The search behind `python train.py -m hparams_search=optuna`: a Hydra sweeper (hydra/sweeper=optuna)
that asks an Optuna study for each trial's settings, has Hydra's launcher run the trial as one job of the
sweep, and tells the study the value the job returned (its final val/bpc).

The settings are those of configs/hparams_search/optuna.yaml: `params` is the search space, one sweep per
setting in Hydra's syntax (choice(a, b), range(start, stop, step), interval(low, high), a range or an
interval in tag(log, ...) to sample it on a log scale); a sweep given on the command line joins it, and a
value given there fixes its setting. `storage` is a database URL that keeps the study, so that a later search with the
same `study_name` adds trials to it; `n_jobs` trials are asked at a time and launched together.

Hydra imports this module at every start, looking for plugins; Optuna and the project's own modules are
imported only once a search begins. (No `from __future__ import annotations` here: Hydra runs the module
before it is in sys.modules, where dataclasses looks string annotations up.)
"""

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import MISSING, DictConfig, OmegaConf

log = logging.getLogger(__name__)

RESULT = "optimization_results.yaml"  # the study's best trial, written in the sweep folder as the search ends


@dataclass
class OptunaSweeperConf:
    _target_: str = "hydra_plugins.tinygpt2_optuna.optuna_sweeper.OptunaSweeper"
    _recursive_: bool = False  # the sampler is made once the study is open (OptunaSweeper.open_study)
    defaults: list[Any] = field(default_factory=lambda: [{"sampler": "tpe"}])
    sampler: Any = MISSING  # hydra/sweeper/sampler: tpe or random, and its settings (seed)
    direction: str = "minimize"
    storage: str | None = None  # a database URL (sqlite:///search.db); None keeps the study in memory
    study_name: str | None = None
    n_trials: int = 20  # trials this search adds to the study
    n_jobs: int = 1  # trials asked at a time, and launched together
    params: dict[str, str] | None = None  # the search space: setting -> choice(...), range(...), interval(...)


store = ConfigStore.instance()
store.store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="tinygpt2")
for name, sampler in (("tpe", "TPESampler"), ("random", "RandomSampler")):
    node = {"_target_": f"optuna.samplers.{sampler}", "seed": None}
    store.store(group="hydra/sweeper/sampler", name=name, node=node, provider="tinygpt2")


class OptunaSweeper(Sweeper):
    def __init__(
        self,
        sampler: DictConfig,
        direction: str,
        storage: str | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        params: DictConfig | None,
    ) -> None:
        self.sampler = OmegaConf.to_container(sampler, resolve=True)
        self.direction, self.storage, self.study_name = direction, storage, study_name
        self.n_trials, self.n_jobs = n_trials, n_jobs
        self.params = {str(key): str(value) for key, value in (params or {}).items()}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.sweep_dir = Path(config.hydra.sweep.dir)
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

    def sweep(self, arguments: list[str]) -> None:
        """Run n_trials trials, n_jobs at a time: each asked of the study, run, and told how it ended. A
        trial still running when the search ends part way (a stop, Ctrl-C, an error) is told it failed,
        as Optuna's own optimize() does, rather than left running in a stored study for ever."""
        from shell.sweeps import SEARCH_OF_TRIAL

        space, fixed = search_space([*(f"{key}={value}" for key, value in self.params.items()), *arguments])
        study = self.open_study()
        asked = []
        try:
            while len(asked) < self.n_trials:
                trials = [study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - len(asked)))]
                for trial in trials:  # for a later search to tell whether its search still runs
                    trial.set_user_attr(SEARCH_OF_TRIAL, str(self.sweep_dir.absolute()))
                jobs = [[*(f"{key}={value}" for key, value in trial.params.items()), *fixed] for trial in trials]
                asked += trials
                returns = self.launcher.launch(jobs, initial_job_idx=len(asked) - len(trials))
                for trial, job in zip(trials, returns, strict=True):
                    tell(study, trial.number, job)
        finally:
            fail_unfinished(study, [trial.number for trial in asked])
        self.save_best(study)

    def open_study(self) -> Any:
        """The study (loaded where the storage holds it), with its sampler. Continuing a study, the sampler's
        seed is moved past the trials it holds: with the seed the study began with, it proposed the same
        settings again, trial for trial."""
        import optuna
        from hydra.utils import instantiate

        study = optuna.create_study(
            study_name=self.study_name, storage=self.storage, direction=self.direction, load_if_exists=True
        )
        held = len(study.get_trials(deepcopy=False))
        sampler = dict(self.sampler)
        if held and isinstance(sampler.get("seed"), int):
            sampler["seed"] += held
        study.sampler = instantiate(sampler)
        where, trials = self.storage or "in memory", f"{held} trial{'' if held == 1 else 's'}"
        log.info("Optuna study %s (%s) holds %s; this search adds %d", study.study_name, where, trials, self.n_trials)
        return study

    def save_best(self, study: Any) -> None:
        from optuna.trial import TrialState

        if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            return
        best = study.best_trial
        result = {"name": "optuna", "best_params": best.params, "best_value": best.value}
        OmegaConf.save(OmegaConf.create(result), self.sweep_dir / RESULT)


def search_space(overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """Optuna's distribution of each swept override, by key, and the other overrides, which every trial
    takes as given. An override of a key replaces any before it (the command line's, the config's)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        space.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            space[key] = distribution(override)
        else:
            fixed[key] = override.input_line
    return space, list(fixed.values())


def distribution(override: Any) -> Any:
    """choice(...) (and a shuffled range) is categorical; range(...) a number in steps from its first
    value to its last; interval(low, high) any number between; tag(log, ...) samples on a log scale."""
    from hydra.core.override_parser.types import Transformer
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    sweep = override.value()
    log_scale = "log" in sweep.tags
    if override.is_interval_sweep():
        return FloatDistribution(sweep.start, sweep.end, log=log_scale)
    values = list(override.sweep_iterator(transformer=Transformer.encode))
    if not override.is_range_sweep() or sweep.shuffle:
        return CategoricalDistribution(values)
    kind = IntDistribution if all(isinstance(value, int) for value in values) else FloatDistribution
    if log_scale:
        return kind(min(values), max(values), log=True)
    return kind(min(values), max(values), step=abs(sweep.step))


def tell(study: Any, number: int, job: JobReturn) -> None:
    """The value the trial's job returned, told to the study; a job with no value to tell (one that
    returned none, or raised) failed. A job's exception ends the search, as it ends Hydra's own sweeps."""
    from optuna.trial import TrialState

    value = job.return_value if job.status == JobStatus.COMPLETED else None
    if isinstance(value, int | float) and not math.isnan(value):
        study.tell(number, float(value))
        return
    study.tell(number, state=TrialState.FAIL)
    _ = job.return_value  # raises the job's exception, where it raised one


def fail_unfinished(study: Any, numbers: list[int]) -> None:
    from optuna.trial import TrialState

    try:
        running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
        for number in sorted(running & set(numbers)):
            study.tell(number, state=TrialState.FAIL)
    except Exception as err:  # a storage gone out of reach: its trials stay as they were
        log.warning("the search's unfinished trials could not be marked failed in its storage: %s", err)
