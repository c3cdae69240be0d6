"""What a run shows while it runs and leaves behind: loggers, metrics, samples, the loss curve."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import wandb  # (imported as the tests are collected: see test_wandb_keeps_the_console_output_in_the_run_folder)
import yaml
from omegaconf import OmegaConf
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from checkpoint import load_checkpoint
from shell.checks import SettingError, check_values, wandb_credentials_present, wandb_mode
from shell.folders import RunFolder
from shell.loggers import RunCSVLogger, flat_settings, wandb_run_id
from tests.common import (
    TINY_OVERRIDES,
    compose_config,
    one_error_line,
    passes_the_checks,
    refused,
    run_script,
    train_here,
)

METRICS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "train/tokens_per_sec",
    "train/tokens_seen",
    "train/mfu",
    "val/loss",
    "val/perplexity",
    "val/bpc",
}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, small_text) -> Path:
    """One tiny run with every logger on, trained by train.py's command line in this process: its folder."""
    run = tmp_path_factory.mktemp("tracked") / "run"
    ran = train_here(
        *TINY_OVERRIDES,
        f"data.path={small_text}",
        "logger=[wandb,tensorboard,csv]",
        "trainer.max_steps=8",
        "trainer.val_check_interval=4",
        "samples.max_new_tokens=12",
        "samples.prompts=[ROMEO:,'']",
        "logger.wandb.log_model=true",
        f"hydra.run.dir={run}",
        cwd=run.parent,
    )
    assert ran.returncode == 0, ran.stderr[-3000:]
    wandb.teardown()  # wandb's service done writing and ended, as it is once the process that started it ends
    return run


def test_tensorboard_holds_every_metric_and_the_samples(tracked_run):
    run = tracked_run
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    assert METRICS <= set(events.Tags()["scalars"])
    val_steps = [e.step for e in events.Scalars("val/loss")]
    assert val_steps == [3, 7]  # after steps 4 and 8
    assert len(events.Scalars("train/loss")) == 8
    assert all(0 < e.value < 1 for e in events.Scalars("train/mfu"))
    seen = [e.value for e in events.Scalars("train/tokens_seen")]
    assert seen[-1] == 8 * 8 * 32  # steps x sequences x tokens
    assert {"samples/0/text_summary", "samples/1/text_summary"} <= set(events.Tags()["tensors"])


def tensorboard_events(run: Path) -> EventAccumulator:
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def hparams_session_groups(logdir: Path) -> list:
    """The rows of TensorBoard's HParams tab for the runs under logdir, as its plugin computes them."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, list_session_groups

    runs = plugin_event_multiplexer.EventMultiplexer()
    runs.AddRunsFromDirectory(str(logdir))
    runs.Reload()
    tb = base_plugin.TBContext(
        data_provider=data_provider.MultiplexerDataProvider(runs, str(logdir)), logdir=str(logdir), multiplexer=runs
    )
    # the tab's default: runs of every status
    shown = [api_pb2.STATUS_UNKNOWN, api_pb2.STATUS_SUCCESS, api_pb2.STATUS_FAILURE, api_pb2.STATUS_RUNNING]
    request = api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=100, allowed_statuses=shown)
    handler = list_session_groups.Handler(context.RequestContext(), backend_context.Context(tb), "", request)
    return list(handler.run().session_groups)


def test_tensorboard_hparams_tab_shows_the_settings_and_the_final_validation(tracked_run):
    run = tracked_run
    (group,) = hparams_session_groups(run / "tensorboard")
    settings = {name: getattr(value, value.WhichOneof("kind")) for name, value in group.hparams.items()}
    assert settings == flat_settings(yaml.safe_load(RunFolder(run).settings_file.read_text()))  # every setting
    assert settings["model.n_layer"] == 2 and settings["trainer.max_steps"] == 8
    assert settings["samples.prompts"] == '["ROMEO:", ""]' and settings["trainer.max_time"] == "null"
    assert settings["logger.wandb.log_model"] == "true" and settings["logger.csv"] == "{}"
    events = tensorboard_events(run)
    final = {tag: (events.Scalars(tag)[-1].value, events.Scalars(tag)[-1].step) for tag in ("val/loss", "val/bpc")}
    assert {m.name.tag: (m.value, m.training_step) for m in group.metric_values} == final
    assert final["val/loss"][1] == 7  # the validation after the last step
    assert [e.step for e in events.Scalars("val/loss")] == [3, 7]  # no placeholder point from the hparams


def test_samples_are_logged_at_the_step_of_the_validation_they_follow(tracked_run):
    run = tracked_run
    events = tensorboard_events(run)
    validations = [e.step for e in events.Scalars("val/loss")]
    assert validations == [3, 7]
    for prompt in (0, 1):
        assert [e.step for e in events.Tensors(f"samples/{prompt}/text_summary")] == validations
    written = re.findall(r"^## step (\d+), prompt", (run / "samples.md").read_text(), flags=re.M)
    assert [int(step) for step in written] == [3, 3, 7, 7]
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    assert [int(row["step"]) for row in rows if row["val/loss"]] == validations


def test_csv_holds_every_metric(tracked_run):
    run = tracked_run
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    logged = {key for row in rows for key, value in row.items() if value}
    assert METRICS <= logged


def test_a_resumed_metrics_csv_drops_a_row_cut_short_and_is_rewritten_by_a_rename(tmp_path):
    """metrics.csv as a kill while it was appended to leaves it, its last row cut short ("1" of "12,...";
    kept as a second step 1, or a traceback where the cut left no number). A new column rewrites the file
    beside itself and renames it into place: a stop then leaves the records whole, where they were truncated."""
    path = tmp_path / "metrics.csv"
    path.write_text("step,train/loss\r\n0,6.9\r\n1,6.8\r\n2,6.7\r\n1", newline="")
    logger = RunCSVLogger(str(tmp_path), resume_step=2)  # resumed from step 2's checkpoint: its row goes too
    logger.log_metrics({"train/loss": 6.75}, step=2)
    logger.save()
    assert path.read_bytes() == b"step,train/loss\r\n0,6.9\r\n1,6.8\r\n2,6.75\r\n"
    appended_to = path.stat().st_ino
    logger.log_metrics({"val/loss": 6.6}, step=2)
    logger.save()
    assert path.stat().st_ino != appended_to and [p.name for p in tmp_path.iterdir()] == ["metrics.csv"]
    rows = list(csv.DictReader(path.open(newline="")))
    assert [(row["step"], row["train/loss"], row["val/loss"]) for row in rows] == [
        ("0", "6.9", ""),
        ("1", "6.8", ""),
        ("2", "6.75", ""),
        ("2", "", "6.6"),
    ]


def test_wandb_logs_offline_with_the_config_and_sample_tables(tracked_run):
    run = tracked_run
    (offline,) = (run / "wandb").glob("offline-run-*")
    records = next(offline.glob("run-*.wandb")).read_bytes()
    assert b"tokens_per_step" in records and b"n_layer" in records  # the whole resolved config
    assert list((offline / "files" / "media" / "table").glob("samples_*.table.json"))


def wandb_records(run: Path):
    """The records of an offline run's .wandb file, as wandb's protobuf Records. The file is a log of
    32 KiB blocks after a 7-byte header; each piece of a record has a header of a checksum, a length and
    a kind (1 whole, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = (run / "wandb").glob("offline-run-*/run-*.wandb")
    data, pos, pieces = path.read_bytes(), 7, []
    assert data.startswith(b":W&B")
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # too little room left in the block for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        if kind == 0:
            break
        pieces.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces.clear()
            yield record


def wandb_history(run: Path) -> list[dict]:
    rows = []
    for record in wandb_records(run):
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def test_wandb_logs_the_samples_at_the_step_of_their_validation(tracked_run):
    run = tracked_run
    rows = wandb_history(run)
    validations = [row["trainer/global_step"] for row in rows if "val/loss" in row]
    samples = [row for row in rows if "samples/path" in row]
    assert validations == [3, 7] and [row["trainer/global_step"] for row in samples] == validations
    (offline,) = (run / "wandb").glob("offline-run-*")
    for row in samples:
        table = json.loads((offline / "files" / row["samples/path"]).read_text())
        assert table["columns"][0] == "step" and {line[0] for line in table["data"]} == {row["trainer/global_step"]}


def test_wandb_offline_stages_the_best_checkpoint_as_a_model_artifact_in_the_run_folder(tracked_run):
    run = tracked_run
    folder = RunFolder(run)
    staging = run / "wandb" / "data"  # WANDB_DATA_DIR, where wandb stages what a sync uploads
    artifacts = [record.artifact for record in wandb_records(run) if record.WhichOneof("record_type") == "artifact"]
    (model,) = [artifact for artifact in artifacts if artifact.type == "model"]
    assert model.name == f"model-{folder.wandb_id_file.read_text().strip()}"
    assert set(model.aliases) == {"best", "latest"}
    (entry,) = model.manifest.contents
    staged = Path(entry.local_path)
    assert entry.path == "model.ckpt" and staged.is_relative_to(staging)
    assert staged.read_bytes() == folder.best.read_bytes()
    assert load_checkpoint(staged).model.config == load_checkpoint(folder.best).model.config  # it describes itself
    for artifact in artifacts:  # the samples tables too: everything a sync needs is in the run folder
        assert all(Path(e.local_path).is_relative_to(staging) for e in artifact.manifest.contents)


def test_wandb_keeps_the_console_output_in_the_run_folder(tracked_run):
    # wandb keeps the console of a run in this process (train_here, which swaps sys.stdout for a buffer of its
    # own) only where wandb was first imported outside train_here: here, as this file is collected
    run = tracked_run
    (output,) = (run / "wandb").glob("offline-run-*/files/output.log")
    assert "max_steps=8" in output.read_text()  # Lightning's last line: "`Trainer.fit` stopped: `max_steps=8` reached."


def test_a_resumed_run_whose_wandb_id_file_was_lost_or_damaged_logs_to_the_same_wandb_run(tracked_run, tmp_path):
    """.wandb_id emptied (a stop as it was written), edited or deleted: the id comes from the wandb run
    the folder holds, and is kept again, where wandb refused the run (empty, or a / in it) or began another."""
    run = tracked_run
    (offline,) = (run / "wandb").glob("offline-run-*")
    logged_id = offline.name.rsplit("-", 1)[1]
    copy = tmp_path / "run"
    shutil.copytree(run / "wandb", copy / "wandb", symlinks=True)
    folder = RunFolder(copy)
    for damage in ("", "a b/c", None):
        if damage is None:
            folder.wandb_id_file.unlink()
        else:
            folder.wandb_id_file.write_text(damage)
        assert wandb_run_id(folder) == logged_id and folder.wandb_id_file.read_text() == logged_id
    assert wandb_run_id(RunFolder(tmp_path)) != logged_id  # a run with no wandb run yet gets a new id


def test_wandb_log_model_is_off_by_default_and_checked():
    assert compose_config().logger.wandb.log_model is False
    given = OmegaConf.to_container(compose_config("logger.wandb.log_model=sometimes"), resolve=True)
    with pytest.raises(SettingError, match="logger.wandb.log_model must be true or false, got 'sometimes'"):
        check_values(given)


def test_samples_are_written_after_every_validation(tracked_run):
    run = tracked_run
    text = (run / "samples.md").read_text()
    assert text.count("## step") == 4  # 2 validations x 2 prompts
    assert "prompt 'ROMEO:'" in text and "prompt ''" in text
    assert "```\nROMEO:" in text


def test_loss_curve_is_drawn_at_the_end(tracked_run):
    run = tracked_run
    png = (run / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


def test_wandb_never_prompts(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    assert not wandb_credentials_present() and wandb_mode("auto") == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_credentials_present() and wandb_mode("auto") == "online"
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_mode("auto") == "offline"  # the user's own setting wins
    assert wandb_mode("disabled") == "disabled"
    given = OmegaConf.to_container(compose_config("logger=wandb", "logger.wandb.mode=sometimes"), resolve=True)
    with pytest.raises(SettingError, match="logger.wandb.mode"):  # refused with the settings, never asked
        check_values(given)


def test_wandb_online_with_no_account_is_refused_before_anything_is_made(monkeypatch, tmp_path, small_text):
    """Online with no login would fail inside wandb.init, after the run folder was made: refused with
    the settings, in one line that says how to log in or to log offline."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    tiny = [*TINY_OVERRIDES, f"data.path={small_text}"]
    line = refused(*tiny, "logger=wandb", "logger.wandb.mode=online")  # train.py's own refusal, in one line
    assert line.startswith("wandb logs online only with an account on this machine")
    assert "wandb login" in line and "logger.wandb.mode=offline" in line
    with pytest.raises(SettingError, match="wandb logs online only.*logger.wandb.mode=offline"):
        passes_the_checks(*tiny, "logger=[csv,wandb]", "logger.wandb.mode=online")
    monkeypatch.setenv("WANDB_MODE", "online")  # the same, asked for by wandb's own setting
    with pytest.raises(SettingError, match="wandb logs online only.*or log offline by unsetting WANDB_MODE"):
        passes_the_checks(*tiny, "logger=wandb")
    passes_the_checks(*tiny, "logger=wandb", "logger.wandb.mode=offline")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    passes_the_checks(*tiny, "logger=wandb", "logger.wandb.mode=online")


def test_a_wandb_mode_wandb_cannot_read_is_refused_in_one_line_before_anything_is_made(small_text, tmp_path):
    """wandb.init reads WANDB_MODE whatever mode it is given, and a value it does not know stopped the
    run with its traceback, after the run folder was made."""
    for value in ("onlinee", ""):
        line = refused(*TINY_OVERRIDES, f"data.path={small_text}", "logger=wandb", env={"WANDB_MODE": value})
        assert line == (
            f"WANDB_MODE={value!r} is not a wandb mode, and wandb reads it whatever logger.wandb.mode says; "
            "set WANDB_MODE to online, offline or disabled, or unset it"
        )
        assert not (tmp_path / "outputs").exists()


def test_wandb_mode_follows_wandbs_old_names_for_its_modes(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    monkeypatch.setenv("WANDB_MODE", "dryrun")  # wandb's old name for offline: an account does not make it online
    assert wandb_mode("auto") == "offline"
    monkeypatch.setenv("WANDB_MODE", "run")
    assert wandb_mode("auto") == "online"


@pytest.mark.slow
def test_wandb_that_cannot_reach_its_server_stops_the_run_in_one_line_and_leaves_nothing(small_text, tmp_path):
    """A process of its own: wandb reads its settings from the environment once a process (here: a server that
    is not there, and a short wait for it), where a run in this process would find them as an earlier run left
    them."""
    env = {
        **os.environ,
        "WANDB_API_KEY": "k" * 40,  # an account, as far as this machine knows
        "WANDB_BASE_URL": "http://127.0.0.1:9",  # a server that is not there
        "WANDB_INIT_TIMEOUT": "10",
    }
    env.pop("WANDB_MODE", None)
    proc = run_script(
        "train.py", *TINY_OVERRIDES, f"data.path={small_text}", "logger=wandb", cwd=tmp_path, env=env, timeout=300
    )
    assert proc.returncode == 1
    line = one_error_line(proc.stderr)
    assert line.startswith("error: wandb could not start the run's log") and "logger.wandb.mode=offline" in line
    assert not (tmp_path / "outputs").exists()  # the new run is taken back: nothing was trained
