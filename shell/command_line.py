"""train.py as a process: its command line made what Hydra's grammar reads as meant (a folder taken whole,
any Lightning Trainer argument accepted), Hydra run, and how the process ends: an error of the user's
input in one `error:` line per problem (Hydra's own errors translated), a stop before training with 130."""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Callable
from typing import Any

from shell.checks import CONFIG_DIR, SPEC, choices_of, settings_of, trainer_parameters, unknown_setting
from shell.errors import USER_ERRORS
from shell.stops import Stopped, stops_raised

# Settings whose value names one folder (or the run to continue): taken whole as typed, a comma, =, spaces,
# quotes, brackets or letters beyond ASCII included, which Hydra's grammar reads otherwise or not at all.
WHOLE_PATH_KEYS = ("runs_root", "latest_link", "hydra.run.dir", "hydra.sweep.dir", "resume")
OPTIONAL_GROUPS = ("experiment", "debug", "hparams_search")  # recipes that choose other groups' choices


def run(main: Callable[[], Any]) -> None:
    """Run train.py's Hydra entry point as a process: exit 0 when it ends, 1 with one line per problem of
    the command line, settings or data, 130 for a Ctrl-C before a run could start."""
    sys.argv = [sys.argv[0], *(whole_path(as_trainer_argument(arg)) for arg in sys.argv[1:])]
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra's errors come here whole, to be said in one line
    try:
        with stops_raised():  # (the libraries loaded with the signals' default actions: shell.startup)
            main()
    except USER_ERRORS as err:
        sys.exit(f"error: {err}")
    except Stopped as stop:  # before a job began: nothing was made
        sys.exit(stopped("before training began; nothing was written", stop.status))
    except Exception as err:
        said = hydras_error(err, sys.argv[1:])
        if said is None:
            raise
        sys.exit(f"error: {said}")


def stopped(words: str, status: int) -> int:
    print(f"\nstopped {words}", file=sys.stderr)
    return status


# ---- the command line as Hydra reads it -------------------------------------------------------------------


def hydra_reading(override: str) -> Any:
    """An override as Hydra's grammar reads it (its Override); the grammar's exception where it cannot."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_override(override)


def hydra_quoted(value: str, interpolations: bool = False) -> str:
    """value as a quoted string of Hydra's grammar, which reads back as value: ' and the backslashes before
    it escaped, as are backslashes at its end; ${ kept as an interpolation (`interpolations`) or escaped."""
    if not interpolations:
        value = re.sub(r"(\\*)\$\{", lambda found: found[1] * 2 + "\\${", value)
    value = re.sub(r"(\\*)'", lambda found: found[1] * 2 + "\\'", value)
    return "'" + value + "\\" * (len(value) - len(value.rstrip("\\"))) + "'"


def whole_path(override: str) -> str:
    """An override of a folder (WHOLE_PATH_KEYS) as typed, made what Hydra reads as the one path it names:
    quoted where Hydra's grammar reads several values (a comma) or cannot read it. Interpolations
    (${now:...}) stay; resume= reads a comma so only where that path exists (resume=a,b is two runs).
    Other overrides are returned as they are."""
    key, equals, value = override.partition("=")
    if not equals or key.lstrip("+") not in WHOLE_PATH_KEYS or value.startswith("~"):
        return override
    try:
        parsed = hydra_reading(override)
        one = not parsed.is_sweep_override() and not isinstance(parsed.value(), list | dict)
        if one or key.lstrip("+") == "resume" and not os.path.lexists(os.path.expanduser(value)):
            return override
    except Exception:  # Hydra's grammar error: read whole
        pass
    return f"{key}={hydra_quoted(value, interpolations=True)}"


def typed_override(key: str, path: Any) -> str:
    """key=path as one types it to train.py before the shell's quotes: plain where train.py reads it back as
    path (whole_path), Hydra's quoted form where not (${, a backslash Hydra reads as an escape)."""
    plain = f"{key}={path}"
    if "${" not in str(path) and whole_path(plain) != plain:  # taken whole: exactly path
        return plain
    try:
        if "\\" not in str(path) and hydra_reading(plain).value() == str(path):
            return plain
    except Exception:  # Hydra's grammar error
        pass
    return f"{key}={hydra_quoted(str(path))}"


def as_trainer_argument(arg: str) -> str:
    """`trainer.deterministic=true` for any Lightning Trainer argument configs/trainer/default.yaml does not
    list: given to Hydra as ++trainer.deterministic=true, so that trainer.* takes them all while a misspelled
    key stays unknown."""
    key, equals, _ = arg.partition("=")
    name = key.removeprefix("trainer.") if key.startswith("trainer.") and key.count(".") == 1 else None
    if name and equals and name not in settings_of("trainer", "default") and name in trainer_parameters():
        return "++" + arg
    return arg


# ---- Hydra's errors, in one line -------------------------------------------------------------------------


def hydras_error(err: Exception, args: list[str]) -> str | None:
    """What an error Hydra raised as it read the command line and composed the config says, in one line that
    says what to type instead; None for any other error."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    overrides = [a for a in args if not a.startswith("-")]
    lines = str(err).splitlines() or [type(err).__name__]
    if isinstance(err, MissingConfigException):
        return missing_choice(lines[0])
    if isinstance(err, OverrideParseException):
        return (
            unreadable(overrides, "-m" in args or "--multirun" in args) or f"cannot read the command line ({lines[0]})"
        )
    if "Config group override must be" in lines[0]:  # model=null: no choice
        given = next((o for o in overrides if (CONFIG_DIR / o.lstrip("+").split("=")[0]).is_dir()), "the group=")
        group = given.lstrip("+").split("=")[0]
        needed = f"; leave {group} out for none, or" if group in OPTIONAL_GROUPS else ", which a run needs;"
        return f"{given} is not a choice of {group}{needed} choose one of: {', '.join(choices_of(group))}"
    if lines[0].startswith("Only one of --run, --multirun, --cfg, --info"):  # -m --cfg job
        flag = next((a for a in args if a in ("--cfg", "-c", "--info", "-i")), "--cfg")
        return f"{flag} shows what one run would use and -m starts a sweep of several: leave -m out"
    if not isinstance(err, HydraException):
        return None
    if several := re.match(r"Ambiguous value for argument '(([^=']+)=[^']*)'", lines[0]):
        given, key = several.groups()
        quoted = quoted_override(key, given.split("=", 1)[1])
        if key == "resume":
            return (f"{given} names several runs, and resume= continues one: continue each alone; if the comma is part "
                    f"of the folder's name, quote it: {quoted}")  # fmt: skip
        return (
            f"{given} gives several values: to train one run for each, add -m (python train.py -m {given} ...); for a "
            f"list, write {key}=[...]; if the comma is part of one value (a file name), quote it: {quoted}"
        )
    if unknown := re.match(r"Could not (override|delete from config\.) '([^']+)'", lines[0]):
        key = unknown[2]
        if unknown[1] != "override" and (key in SPEC or key.removeprefix("trainer.") in trainer_parameters()):
            return f"~{key}: {key} is already unset (null): leave ~{key} out"
        said = unknown_setting(key, choices_given(overrides))
        return f"~{key}: {said}" if unknown[1] != "override" else said
    below = lines[1:] or (str(err.__cause__).splitlines() if err.__cause__ else [])  # OmegaConf's reason
    where = next((line.split(":", 1)[1].strip() for line in below if line.strip().startswith("full_key:")), None)
    return f"{lines[0].rstrip(':')}: {below[0].strip()}" + (f" ({where})" if where else "") if below else lines[0]


def missing_choice(line: str) -> str:
    """A choice of a config group that configs/ has not, with the choices it has; a sweeper not installed."""
    found = re.search(r"Could not (?:find|load) '([^']+)/([^']*)'", line)
    if found is None:
        return line
    group, name = found.groups()
    if group == "hydra/sweeper":
        return (
            f"the {name} sweeper is not installed; an Optuna search uses the project's own, override "
            "/hydra/sweeper: optuna (as configs/hparams_search/optuna.yaml does)"
        )
    said = f"{group}={name} is not a choice" if name else f"{group}= needs a choice"
    return f"{said}; choose one of: {', '.join(choices_of(group))}"


def choices_given(overrides: list[str]) -> dict[str, str]:
    """The choice of each config group on the command line, else the recipe's it chooses (experiment=...,
    debug=...), else configs/train.yaml's."""
    made = {
        next(iter(d)): d[next(iter(d))] for d in settings_of(".", "train").get("defaults", []) if isinstance(d, dict)
    }
    given = {o.lstrip("+").split("=")[0]: o.split("=", 1)[1] for o in overrides if "=" in o}
    for recipe in (r for r in OPTIONAL_GROUPS if isinstance(given.get(r), str)):
        chosen = [d for d in settings_of(recipe, given[recipe]).get("defaults", []) if isinstance(d, dict)]
        made |= {k.split("/")[-1].split(" ")[-1]: v for d in chosen for k, v in d.items()}
    return {group: given.get(group, made.get(group)) for group in made}


def quoted_override(key: str, value: str) -> str:
    """key=value as the shell and Hydra's grammar both pass it on whole: the value in Hydra's quotes, the
    whole in the shell's."""
    return shlex.quote(f'{key}="{value}"') if "'" in value else f"\"{key}='{value}'\""


def unreadable(overrides: list[str], sweep: bool) -> str | None:
    """The first override Hydra's grammar cannot read, named with how to write it."""
    for override in overrides:
        key, equals, value = override.partition("=")
        if value.startswith("~/"):
            return f"{override}: a value cannot start with ~ on this command line; write {key}=$HOME/{value[2:]}"
        try:
            hydra_reading(override)
            continue
        except Exception as err:  # the grammar's own exception
            problem = str(err).splitlines()[0]
        if not equals or not re.fullmatch(r"[+~]{0,2}[\w.\-/@]+", key):
            return f"cannot read {override} ({problem}); write overrides as key=value"
        if sweep:  # a list of values to sweep, written wrong, as likely as a value to quote
            return (
                f"cannot read {override} ({problem}); write swept values as key=a,b,c, and quote a value that holds "
                f"= , spaces or quotes: {quoted_override(key, value)}"
            )
        return (
            f"cannot read {override}: its value has characters the command line gives a meaning to (such as = , "
            f"spaces, brackets, quotes or letters beyond ASCII); quote the value: {quoted_override(key, value)}"
        )
    return None
