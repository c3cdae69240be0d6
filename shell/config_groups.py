"""What configs/ offers, read from its files: the config groups, the choices of each (one YAML file a
choice) and the settings a choice has, so that a setting or choice the command line gets wrong is
answered with what it could have said instead (`unknown_setting`, `no_group_choice`), and the settings a
command line names are known, those its experiment= or debug= recipe sets included (`named_settings`)."""

from __future__ import annotations

import re
from pathlib import Path

from omegaconf import OmegaConf

from shell.checks import ABSENT, lookup, trainer_parameters
from shell.settings import differing_leaves, expand, named_leaves

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def trainer_defaults() -> set[str]:
    """The trainer settings configs/trainer/default.yaml lists."""
    return set(OmegaConf.load(CONFIG_DIR / "trainer" / "default.yaml"))


TRAINER_DEFAULTS = trainer_defaults()


def is_group(name: str) -> bool:
    return bool(re.fullmatch(r"\w+", name)) and (CONFIG_DIR / name).is_dir()


def group_choices(overrides: list[str]) -> dict[str, str | None]:
    """The settings a command line sets through a group's file (data=pydoc) and not by their own key
    (data.batch_size=16), by the group: what a refusal names for them, a choice typed instead of the
    settings it expands to. Keys: groups, or dotted settings set by their own key (their value None)."""
    given = [o.lstrip("+").split("=", 1) for o in overrides if "=" in o and not o.startswith("~")]
    chosen = {group: choice for group, choice in given if is_group(group)}
    return {**chosen, **{key: None for key, _ in given if "." in key and key.split(".")[0] in chosen}}


def not_a_name(override: str) -> bool:
    """An override whose value Hydra reads as null, a truth value or a number: no choice of a group."""
    value = override.split("=", 1)[1].strip() if "=" in override else ""
    return bool(re.fullmatch(r"(?i)null|none|~|true|false|[-+]?[\d.]+(e[-+]?\d+)?", value))


def no_group_choice(group: str, given: str) -> str:
    """What to say to a group given no choice (model=null, ~logger): how to ask for what was meant."""
    options = ", ".join(sorted(p.stem for p in (CONFIG_DIR / group).glob("*.yaml")))
    if group == "logger":
        said = "cannot remove the loggers" if given.startswith("~") else "is not a choice of logger"
        return f"{given} {said}; for a run with no loggers use logger=none (or one of: {options})"
    if default_choice(group) is None:  # an optional group: leaving it out is its default
        return f"{given} is not a choice of {group}; leave {group} out for none, or choose one of: {options}"
    return f"{given} is not a choice of {group}, which a run needs; choose one of: {options}"


def choices_with(key: str) -> list[str]:
    """The choices of key's group (configs/<group>/*.yaml) that have the setting key."""
    group, _, rest = key.partition(".")
    found = []
    for recipe in sorted((CONFIG_DIR / group).glob("*.yaml")) if rest else []:
        values = OmegaConf.to_container(OmegaConf.load(recipe))
        if (
            isinstance(values, dict)
            and "# @package" not in recipe.read_text()[:200]
            and lookup(values, rest) is not ABSENT
        ):
            found.append(recipe.stem)
    return found


def default_choice(group: str) -> str | None:
    """The choice configs/train.yaml makes for group, when it makes one."""
    for entry in OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "train.yaml")).get("defaults", []):
        if isinstance(entry, dict) and isinstance(entry.get(group), str):
            return entry[group]
    return None


def unknown_setting(key: str, defaults: dict, overrides: list[str], chosen: dict | None = None) -> str:
    """Why key is not a setting, and what to type instead. `chosen`: the choice of each group."""
    import difflib

    group = key.split(".")[0]
    name = key.split(".")[1] if key.count(".") == 1 else None
    if group == "logger" and name and (CONFIG_DIR / "logger" / f"{name}.yaml").is_file():  # not among those chosen
        return (
            f"unknown setting '{key}': the loggers chosen do not include {name}; choose loggers with "
            f"logger=NAME or a list, e.g. logger=[csv,{name}]"
        )
    if group == "logger" and name:
        loggers = ", ".join(sorted(p.stem for p in (CONFIG_DIR / "logger").glob("*.yaml")))
        return f"unknown setting '{key}': {name} is no logger; choose loggers with logger=NAME or a list of: {loggers}"
    choice = next((o.split("=", 1)[1] for o in overrides if "=" in o and o.lstrip("+").split("=")[0] == group), None)
    choice = choice or (chosen or {}).get(group)
    close = difflib.get_close_matches(key, differing_leaves(defaults, {}), n=1, cutoff=0.75)
    if not close and group == "trainer":  # Lightning's other arguments (loading Lightning takes seconds)
        close = difflib.get_close_matches(key, [f"trainer.{name}" for name in trainer_parameters()], n=1, cutoff=0.75)
    if close and close[0] == key and choice:  # a setting of the default choice, not of the one given
        return f"unknown setting '{key}': {group}={choice} has no such setting (python train.py {group}={choice} --cfg job lists its settings)"
    made = choice or default_choice(group)
    others = [other for other in choices_with(key) if other != made]
    if others and isinstance(made, str):  # a setting of another choice of the group (optim.momentum is Muon's)
        names = " or ".join(f"{group}={other}" for other in others)
        return (
            f"unknown setting '{key}': {group}={made} has no such setting, {names} has; "
            f"choose {names} to use it, or leave it out"
        )
    hint = f" (did you mean {close[0]}?)" if close and close[0] != key else ""
    return f"unknown setting '{key}'{hint}; check the spelling (python train.py --cfg job lists every setting)"


def named_settings(overrides: list[str], requested: dict, defaults: dict) -> list[str]:
    """The settings a command line gives, as dotted keys (shell.settings.named_leaves), and every
    setting a recipe it chooses sets (experiment=..., debug=...), even one it sets to its default."""
    named = set(named_leaves(overrides, requested, defaults))
    for override in overrides:
        group, _, choice = override.lstrip("+").partition("=")
        recipe = CONFIG_DIR / group / f"{choice}.yaml"
        if group in ("experiment", "debug") and recipe.is_file():
            settings = OmegaConf.to_container(OmegaConf.load(recipe))
            chosen = [next(iter(d)).split("/")[-1] for d in settings.pop("defaults", []) if isinstance(d, dict)]
            named |= set(expand([*chosen, *differing_leaves(settings, {})], requested, defaults))
    return sorted(named)
