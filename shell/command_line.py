"""The command line, read as Hydra will read it, before Hydra starts: `Composer` composes configs/ for
a list of overrides as Hydra would, and turns each way Hydra refuses one (a misspelled setting, a choice
that is not there, a value its grammar cannot read, a comma that starts a sweep) into a CommandLineError
of one line that says what to write instead; `parse_overrides` reads them with Hydra's grammar alike."""

from __future__ import annotations

import contextlib
import re
import shlex
from typing import Any

from omegaconf import OmegaConf, open_dict

from shell import resume
from shell.checks import ABSENT, lookup, trainer_parameters
from shell.config_groups import (
    CONFIG_DIR,
    TRAINER_DEFAULTS,
    choices_with,
    is_group,
    no_group_choice,
    not_a_name,
    unknown_setting,
)

SEARCH_GROUPS = ("hparams_search",)  # config groups that make a command a search (-m needed)
KIND_SETTINGS = ("data.source", "tokenizer.kind")  # what each choice of their group is


class CommandLineError(ValueError):
    """A command line that cannot be read; the message says what to write instead."""


def as_trainer_argument(arg: str) -> str:
    """`trainer.deterministic=true` for any Lightning Trainer argument configs/trainer/default.yaml does
    not list: given to Hydra as ++trainer.deterministic=true (add, or set where an experiment added it),
    so that trainer.* takes them all while a misspelled key stays unknown."""
    key = arg.split("=", 1)[0]
    name = key.split(".", 1)[1] if key.startswith("trainer.") and key.count(".") == 1 else None
    if name and "=" in arg and name not in TRAINER_DEFAULTS and name in trainer_parameters():
        return "++" + arg
    return arg


class Composer:
    """Hydra's composition of configs/ for a list of overrides, as plain dicts; bad overrides become
    CommandLineError with one line."""

    def __enter__(self) -> Composer:
        from hydra import initialize_config_dir

        self.context = initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3")
        self.context.__enter__()
        self.defaults = self.compose([])
        return self

    def __exit__(self, *exc) -> None:
        self.context.__exit__(*exc)

    def choices(self, overrides: list[str]) -> dict:
        """The choice of each config group that overrides make (an experiment's too); {} if they cannot compose."""
        from hydra import compose

        try:
            return OmegaConf.to_container(compose("train", overrides, return_hydra_config=True).hydra.runtime.choices)
        except Exception:
            return {}

    def value_of(self, key: str, overrides: list[str]) -> Any:
        """key's value in the config overrides compose (unresolved); ABSENT where it has no such key."""
        from hydra import compose

        try:
            return lookup(OmegaConf.to_container(compose("train", overrides), resolve=False), key)
        except Exception:
            return ABSENT

    def check_added(self, overrides: list[str]) -> None:
        """+data.split=train adds a setting the chosen data has not (data=hub has it), which nothing would
        read: refused as the same setting without + is."""
        for override in overrides:
            key = override.lstrip("+").split("=")[0]
            if override.startswith("+") and is_group(key.split(".")[0]) and (others := choices_with(key)):
                chosen = self.choices(overrides)
                if chosen.get(key.split(".")[0]) not in others:
                    raise CommandLineError(unknown_setting(key, self.defaults, overrides, chosen))

    def compose(self, overrides: list[str], with_hydra: bool = False) -> dict:
        """The composed config; `with_hydra`: Hydra's own settings too (under "hydra", unresolved but for
        the run and sweep folders: hydra.run.dir=outputs/${now:%H-%M} as it names a folder now)."""
        from hydra import compose
        from hydra.errors import HydraException, MissingConfigException, OverrideParseException

        try:
            cfg = compose("train", overrides=overrides, return_hydra_config=with_hydra)
            hydra_cfg = OmegaConf.to_container(cfg.hydra, resolve=False) if with_hydra else None
            if with_hydra:
                for mode in ("run", "sweep"):
                    with contextlib.suppress(Exception):  # (one Hydra can resolve only as it runs: left as it is)
                        hydra_cfg[mode]["dir"] = OmegaConf.select(cfg, f"hydra.{mode}.dir")
                with open_dict(cfg):
                    del cfg["hydra"]
            values = OmegaConf.to_container(cfg, resolve=True)
        except MissingConfigException as err:
            raise missing_config(err) from None
        except OverrideParseException as err:
            raise unparsed(err, overrides) from None
        except HydraException as err:
            raise self.refused(err, overrides) from None
        except Exception as err:  # an interpolation or resolver that fails on the given values
            raise not_composed(err, overrides) from None
        self.check_added(overrides)
        self.check_kinds(overrides)
        check_logger_list(overrides)
        return {**values, "hydra": hydra_cfg} if with_hydra else values

    def refused(self, err: Exception, overrides: list[str]) -> CommandLineError:
        """Hydra's refusal of an override (HydraException) in one line: a comma that would start a sweep,
        ~group or ~key that cannot be removed, a setting the config has not."""
        several = re.match(r"Ambiguous value for argument '(([^=']+)=[^']*)'", str(err))
        if several:
            key, value = several.group(2), several.group(1).split("=", 1)[1]
            if resume.is_resume(key):  # one run, which -m would not sweep either
                return CommandLineError(
                    f"{several.group(1)} gives several values, and resume= continues one run: continue each alone "
                    f"(python train.py resume=RUN); if the comma is part of the folder's name, quote it: "
                    f"{quoted_override(key, value)}"
                )
            return CommandLineError(
                f"{several.group(1)} gives several values: to train one run for each, add -m "
                f"(python train.py -m {several.group(1)} ...); for a list, write {key}=[...]; if the comma is "
                f"part of one value (a file name), quote it: {quoted_override(key, value)}"
            )
        removed = re.match(r"Could not delete '([^']+)'", str(err))
        if removed and (CONFIG_DIR / removed.group(1)).is_dir():
            return CommandLineError(no_group_choice(removed.group(1), f"~{removed.group(1)}"))
        absent = re.match(r"Could not delete from config\. '([^']+)' does not exist", str(err))  # ~key
        cause = err.__cause__
        unknown = (cause is not None and "not in struct" in str(cause)) or str(err).startswith("Could not override")
        if absent or unknown:
            key = absent.group(1) if absent else str(err).split("'")[1]
            others = [o for o in overrides if o.lstrip("+~").split("=")[0] != key]
            if absent and self.value_of(key, others) is None:  # Hydra cannot delete a null value
                return CommandLineError(f"~{key}: {key} is already unset (null): leave ~{key} out")
            chosen = self.choices(others)
            said = unknown_setting(key, self.defaults, overrides, chosen)
            return CommandLineError(f"~{key}: {said}" if absent else said)
        return CommandLineError(with_reason(err))

    def check_kinds(self, overrides: list[str]) -> None:
        """data.source=pydoc, tokenizer.kind=char: what a group's choice is, changed under the settings of
        another choice (a data.path pydoc would not read, a vocab_size no character tokenizer has):
        refused for the group's choice, which brings its own settings."""
        for override in overrides:
            key, _, value = override.lstrip("+").partition("=")
            if key not in KIND_SETTINGS:
                continue
            group, field = key.split(".")
            chosen = self.choices(overrides).get(group)
            recipe = CONFIG_DIR / group / f"{chosen}.yaml"
            made = OmegaConf.load(recipe).get(field) if recipe.is_file() else None
            if value != str(made):
                instead = f"{group}={value}" if (CONFIG_DIR / group / f"{value}.yaml").is_file() else f"{group}=NAME"
                raise CommandLineError(
                    f"{override} would change the kind of {group}={chosen} and keep its settings; choose the "
                    f"{group} itself instead: {instead}"
                )


def missing_config(err: Exception) -> CommandLineError:
    """A choice of a config group that configs/ has not (MissingConfigException), with the choices it
    has; a sweeper that is not installed."""
    lines = str(err).splitlines()
    options = [line.strip() for line in lines if line.startswith("\t") and "provider=" not in line]
    missing = re.search(r"Could not find '([^']+)/([^']+)'", lines[0])
    if missing and missing.group(1) == "hydra/sweeper":
        return CommandLineError(
            f"the {missing.group(2)} sweeper is not installed; an Optuna search uses the project's own, "
            "override /hydra/sweeper: optuna (as configs/hparams_search/optuna.yaml does)"
        )
    missing = missing or re.search(r"Could not (?:find|load) '([^']+)/([^']*)'", lines[0])
    if missing:
        group, choice = missing.groups()
        options = options or sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml"))
        said = f"{group}={choice} is not a choice" if choice else f"{group}= needs a choice"
        return CommandLineError(f"{said}; choose one of: {', '.join(options)}")
    return CommandLineError(lines[0])


def unparsed(err: Exception, overrides: list[str]) -> CommandLineError:
    """A command line Hydra's grammar cannot read (OverrideParseException): the override, named."""
    if (unread := unreadable_override(overrides)) is not None:
        return unread
    return CommandLineError(f"cannot read the command line ({str(err).splitlines()[0]}); write overrides as key=value")


def not_composed(err: Exception, overrides: list[str]) -> CommandLineError:
    """Any other failure to compose: a group given no name (model=null), an interpolation or resolver
    that fails on the given values."""
    if "Config group override must be" in str(err):  # model=null, logger=false: not a name
        given = next((o for o in overrides if is_group(o.lstrip("+").split("=")[0]) and not_a_name(o)), None)
        if given is not None:
            return CommandLineError(no_group_choice(given.lstrip("+").split("=")[0], given))
    return CommandLineError(f"cannot compose the config: {str(err).splitlines()[0]}")


def with_reason(err: Exception) -> str:
    """Hydra's error in one line: its first, and the reason it gives below it or in its cause (OmegaConf's
    "Value 'x' of type 'str' could not be converted to Integer", for a value of the wrong kind in a config
    file or on the command line), with the setting it names."""
    lines = str(err).splitlines()
    below = lines[1:] or (str(err.__cause__).splitlines() if err.__cause__ else [])
    if not below:
        return lines[0]
    key = next((line.split(":", 1)[1].strip() for line in below if line.strip().startswith("full_key:")), None)
    return f"{lines[0].rstrip(':')}: {below[0].strip()}" + (f" ({key})" if key else "")


def check_logger_list(overrides: list[str]) -> None:
    """logger=[...] lists trackers: at least one (a run with none is logger=none, as ~logger and logger=null
    are told), each once, and none alone. Hydra would give [] no logger setting at all, merge [csv,csv]
    into csv, and [csv,none] into csv."""
    for override in parse_overrides([o for o in overrides if o.lstrip("+").startswith("logger=")]):
        names = override.value()
        if not isinstance(names, list):
            continue
        given, once = override.input_line, list(dict.fromkeys(str(name) for name in names))
        if not names:
            raise CommandLineError(f"{given} lists no logger; for a run with no loggers use logger=none")
        if len(once) < len(names):
            twice = next(name for name in once if [str(n) for n in names].count(name) > 1)
            raise CommandLineError(f"{given} names {twice} twice; list each logger once: logger=[{','.join(once)}]")
        if "none" in once and len(once) > 1:
            others = ",".join(name for name in once if name != "none")
            raise CommandLineError(
                f"{given}: none is no tracker and cannot be listed with others; leave it out (logger=[{others}]), "
                "or use logger=none alone for a run with no loggers"
            )


def tilde_error(overrides: list[str]) -> CommandLineError | None:
    """Hydra's grammar reads a leading ~ of a value as an operator, where the shell left it (key=~/x)."""
    home = next((o for o in overrides if re.fullmatch(r"[\w.+]+=~/.*", o)), None)
    if home is None:
        return None
    key, value = home.split("=", 1)
    return CommandLineError(f"{home}: a value cannot start with ~ on this command line; write {key}=$HOME/{value[2:]}")


def quoted_override(key: str, value: str) -> str:
    """key=value as the shell and Hydra's grammar both pass it on whole: a quoted value, the whole in
    the shell's quotes."""
    return shlex.quote(f'{key}="{value}"') if "'" in value else f"\"{key}='{value}'\""


def unreadable_override(overrides: list[str], sweep: bool = False) -> CommandLineError | None:
    """The first override Hydra's grammar cannot read, named, with how to write it: a value with
    characters the grammar gives a meaning to (= , [ ] { } ( ) spaces, quotes, letters beyond ASCII) is
    read whole when quoted. None when each reads alone."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if (home := tilde_error(overrides)) is not None:
        return home
    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_overrides([override])
        except Exception as err:  # the grammar's own exception
            key, equals, value = override.partition("=")
            if not equals or not re.fullmatch(r"[+~]{0,2}[\w.\-/@]+", key):
                return CommandLineError(
                    f"cannot read {override} ({str(err).splitlines()[0]}); write overrides as key=value"
                )
            if sweep:  # a list of values to sweep, written wrong, as likely as a value to quote
                return CommandLineError(
                    f"cannot read {override} ({str(err).splitlines()[0]}); write swept values as key=a,b,c, and quote "
                    f"a value that holds = , spaces or quotes: {quoted_override(key, value)}"
                )
            return CommandLineError(
                f"cannot read {override}: its value has characters the command line gives a meaning to (such as = , "
                f"spaces, brackets, quotes or letters beyond ASCII); quote the value: {quoted_override(key, value)}"
            )
    return None


def parse_overrides(overrides: list[str]):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # Hydra's OverrideParseException, or a value its grammar reads but cannot type
        if (unread := unreadable_override(overrides, sweep=True)) is not None:
            raise unread from None
        raise CommandLineError(
            f"cannot read the command line ({str(err).splitlines()[0]}); write overrides as key=value, "
            "and swept values as key=a,b,c"
        ) from None
