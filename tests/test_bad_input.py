"""Every row of the README's "Bad input" table has a test here (or names the test that covers it
elsewhere); the last test reads the table and checks that no row is left without one."""

from __future__ import annotations

import json
import re

import pytest
import torch

import generate
from checkpoint import CheckpointError, read_weights
from data.tokenizer import train_char
from tests.common import (
    ROOT,
    TINY_OVERRIDES,
    damaged_copy,
    one_error_line,
    passes_the_checks,
    refused,
    train_here,
)
from tests.tiny import train_tiny_gpt, write_checkpoint

NO_GPU = not torch.cuda.is_available()


@pytest.fixture
def refused_by_the_checks(monkeypatch):
    """A command line train.py must refuse from its settings alone: should it get as far as preparing the
    data (or training), the test fails there, at once, rather than train a run."""

    def tripped(*args, **kwargs):
        raise AssertionError("the command line passed the checks: train.py went on to prepare the data")

    monkeypatch.setattr("shell.settings.prepare", tripped)
    monkeypatch.setattr("shell.settings.start_from", tripped)


# README rows for train.py: the command line, and the line it must get (exactly, or its start with "...").
README_ROWS = {
    "an unknown setting (`trainer.max_step=10`)": (
        ["trainer.max_step=10"],
        "unknown setting 'trainer.max_step' (did you mean trainer.max_steps?); check the spelling "
        "(python train.py --cfg job lists every setting)",
    ),
    "an unknown choice (`model=huge`)": (["model=huge"], "model=huge is not a choice; choose one of: baby, gpt2, ..."),
    "a setting of another choice of its group (`optim.momentum=0.9`)": (
        ["optim.momentum=0.9"],
        "unknown setting 'optim.momentum': optim=adamw has no such setting, optim=muon has; choose optim=muon to "
        "use it, or leave it out",
    ),
    "a value of the wrong kind (`optim.lr=fast`)": (["optim.lr=fast"], "optim.lr must be a number, got 'fast'"),
    "an empty path (`data.path=$DATA`, `DATA` unset)": (
        ["data.path="],
        "data.path is empty (an unset shell variable?): give a path, or leave it out",
    ),
    "what a group's choice is, changed alone (`tokenizer.kind=char`)": (
        ["tokenizer.kind=char", "tokenizer.vocab_size=100"],
        "tokenizer.kind=char would change the kind of tokenizer=bpe and keep its settings; choose the tokenizer "
        "itself instead: tokenizer=char",
    ),
    "a number that is not finite (`optim.lr=nan`)": (["optim.lr=nan"], "optim.lr must be a finite number, got nan"),
    "a list of the wrong length or kind (`optim.betas=[0.9]`)": (
        ["optim.betas=[0.9]"],
        "optim.betas must be a list of 2 values, e.g. optim.betas=[...], got [0.9]",
    ),
    "a value that is not one of the choices (`optim.schedule=cosin`)": (
        ["optim.schedule=cosin"],
        "optim.schedule must be one of cosine, linear, constant, got 'cosin'",
    ),
    "a Lightning Trainer argument of the wrong kind (`trainer.deterministic=yes`)": (
        ["trainer.deterministic=yes"],
        "trainer.deterministic must be true, false, 'warn' or null, got 'yes'",
    ),
    "`model.n_embd` not divisible by `model.n_head`": (
        ["model.n_embd=100", "model.n_head=3"],
        "model.n_embd (100) must be divisible by model.n_head (3); pick n_embd as a multiple of n_head, e.g. n_embd=99",
    ),
    "`model.block_size=0`": (["model.block_size=0"], "model.block_size must be a whole number of at least 1, got 0"),
    "`trainer.max_steps=0` (or below)": (
        ["trainer.max_steps=0"],
        "trainer.max_steps must be at least 1 (or -1 with trainer.max_time), got 0",
    ),
    "`optim.lr=0` (or below)": (["optim.lr=0"], "optim.lr must be above 0, got 0"),
    "`tokens_per_step` that does not divide": (
        ["tokens_per_step=1000"],
        "tokens_per_step=1000 is not a multiple of data.batch_size x model.block_size x devices = 32 x 32 x 1 = 1024; "
        "use e.g. 1024",
    ),
    "a global batch of more than 65,536 micro-batches (`tokens_per_step=1073741824`)": (
        ["tokens_per_step=1073741824"],
        "tokens_per_step=1073741824 is 1,048,576 micro-batches of data.batch_size x model.block_size x devices = "
        "32 x 32 x 1 = 1,024 tokens per optimizer step, more than the 65,536 any sensible run takes (a step would "
        "seem to hang); use tokens_per_step=67108864 or less (the global batch in tokens), or a larger data.batch_size",
    ),
    "a missing run to resume": (
        ["resume=outputs/nope"],
        "resume=outputs/nope does not exist; give a run folder, a checkpoint in one, or resume=auto",
    ),
    "a missing checkpoint to start from (`init_from=`)": (
        ["init_from=runs/x.ckpt"],
        "init_from=runs/x.ckpt does not exist; pass a .ckpt file, a run folder or a Hugging Face folder",
    ),
    "a Hugging Face Hub name never downloaded (`init_from=gpt2`)": (  # HF_HOME: an empty folder (conftest.py)
        ["init_from=gpt2"],
        (
            "init_from=gpt2 does not exist; pass a .ckpt file, a run folder or a Hugging Face folder. If gpt2 is "
            "a Hugging Face Hub model: init_from reads only local files, and it was never downloaded here (the "
            "Hugging Face cache has no copy); download it once where there is a network (hf download gpt2 "
            "config.json model.safetensors tokenizer.json --local-dir hf/gpt2), then pass init_from=hf/gpt2"
        ),
    ),
    "`trainer.accelerator=gpu` without a GPU": (
        ["trainer.accelerator=gpu"],
        "trainer.accelerator=gpu: this machine has no CUDA GPU; use trainer.accelerator=cpu or auto",
    ),
    "`trainer.num_nodes=2` with no launcher": (
        ["trainer.num_nodes=2"],
        "trainer.num_nodes=2 trains on 2 machines, but nothing started this process as one of them: run the same "
        "command on each machine under torchrun --nnodes or srun (README: More than one device or machine), or set "
        "NODE_RANK, MASTER_ADDR and MASTER_PORT on each; on one machine, leave trainer.num_nodes at 1",
    ),
}


@pytest.mark.usefixtures("refused_by_the_checks")
@pytest.mark.parametrize("label", list(README_ROWS))
def test_each_readme_row_for_train_py(label, tmp_path, monkeypatch):
    if "GPU" in label and not NO_GPU:
        pytest.skip("this machine has a GPU")
    monkeypatch.chdir(tmp_path)  # relative paths (outputs/nope) are the user's, in a fresh folder
    args, expected = README_ROWS[label]
    line = refused(*[a.replace("train.py", str(ROOT / "train.py")) for a in args])
    if expected.endswith("..."):
        assert line.startswith(expected[:-3])
    else:
        assert line == expected
    assert not any(tmp_path.iterdir())  # checking made nothing


# More bad settings of every kind: nested lists, enumerations, numbers as words, NaN, infinities,
# negatives, values that would silently train wrongly, and Lightning Trainer arguments.
BAD_SETTINGS = [
    (["optim.lr=inf"], "optim.lr must be a finite number, got inf"),
    (["optim.lr=-0.001"], "optim.lr must be above 0, got -0.001"),
    (["optim.weight_decay=nan"], "optim.weight_decay must be a finite number, got nan"),
    (["optim.weight_decay=-0.1"], "optim.weight_decay must be at least 0, got -0.1"),
    (["optim.betas=[0.9,1.5]"], "optim.betas[1] must be below 1, got 1.5"),
    (["optim.betas=[0.9,x]"], "optim.betas[1] must be a number, got 'x'"),
    (["optim.betas=0.9"], "optim.betas must be a list of 2 values"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio must be at most 1, got 2"),
    (["optim.warmup_steps=-1"], "optim.warmup_steps must be at least 0, got -1"),
    (["optim.max_nonfinite_in_a_row=0"], "optim.max_nonfinite_in_a_row must be at least 1, got 0"),
    (["seed=one"], "seed must be a whole number, got 'one'"),
    (["seed=1.5"], "seed must be a whole number, got 1.5"),
    (["seed=-1"], "seed must be at least 0, got -1"),
    (["trainer.max_steps=ten"], "trainer.max_steps must be a whole number, got 'ten'"),
    (["trainer.max_steps=-1"], "trainer.max_steps=-1 needs a time limit"),
    (["trainer.max_time=75"], "trainer.max_time must be dd:hh:mm:ss (e.g. 00:00:01:15 for 75 seconds), got 75"),
    (
        ["trainer.val_check_interval=0"],
        "trainer.val_check_interval must be a whole number of steps (at least 1) or a time (dd:hh:mm:ss), got 0",
    ),
    (["trainer.val_check_interval=0.5"], "trainer.val_check_interval must be a whole number of steps"),
    (["trainer.val_check_interval=soon"], "trainer.val_check_interval must be dd:hh:mm:ss"),
    (["trainer.limit_val_batches=0"], "trainer.limit_val_batches=0 turns validation off"),
    (
        ["trainer.limit_val_batches=1.5"],
        "trainer.limit_val_batches must be a whole number of batches (at least 1), a fraction in (0, 1], or null, got 1.5",
    ),
    (["trainer.log_every_n_steps=0"], "trainer.log_every_n_steps must be at least 1, got 0"),
    (["trainer.gradient_clip_val=-1"], "trainer.gradient_clip_val must be at least 0, got -1"),
    (["trainer.devices=0"], "trainer settings: `Trainer(devices=0)` value is not a valid input using cpu accelerator"),
    (["trainer.devices=1.5"], "trainer.devices must be a list, text or a whole number, got 1.5"),
    *(
        ([f"trainer.devices={devices}", "trainer.accelerator=cpu"], f"trainer.devices={shown} is for GPUs")
        for devices, shown in (("-1", "-1"), ("[0,1]", "[0, 1]"))
    ),
    # Lightning's own list of its precisions
    (["trainer.precision=bf17"], "trainer.precision must be 64, 32, 16, 'transformer-engine', "),
    (
        ["trainer.precision=[32]"],
        "'16-mixed', 'bf16-true', 'bf16-mixed', '32-true', '64-true', '64', '32', '16', 'bf16' or null, got [32]",
    ),
    (["trainer.strategy=dpp"], "trainer settings: You selected an invalid strategy name"),
    # processes made from the first by Python's multiprocessing: what they train never comes back to it
    (["trainer.strategy=ddp_spawn", "trainer.devices=2"], "trainer.strategy=ddp_spawn trains in processes made from"),
    # removing a setting that is already unset, which Hydra cannot delete, is not an unknown setting
    (["~init_from"], "~init_from: init_from is already unset (null): leave ~init_from out"),
    (["~trainer.max_time"], "~trainer.max_time: trainer.max_time is already unset (null): leave ~trainer.max_time out"),
    (["~trainer.max_tim"], "~trainer.max_tim: unknown setting 'trainer.max_tim' (did you mean trainer.max_time?)"),
    # several machines asked for in a process no launcher started as one of them: it would wait for ever
    (
        ["trainer.num_nodes=2", "trainer.strategy=ddp", "trainer.devices=2"],
        "run the same command on each machine under torchrun --nnodes or srun",
    ),
    (["trainer.profiler=fancy"], "trainer settings: When passing string value for the `profiler` parameter"),
    (
        ["trainer.reload_dataloaders_every_n_epochs=few"],
        "trainer.reload_dataloaders_every_n_epochs must be a whole number, got 'few'",
    ),
    (["trainer.logger=true"], "trainer.logger cannot be set: choose trackers with logger=wandb|tensorboard|csv|none"),
    (["trainer.limit_train_batches=10"], "trainer.limit_train_batches cannot be set: it would end training before"),
    (
        ["tokens_per_step=2048", "trainer.accumulate_grad_batches=2"],
        "set either tokens_per_step or trainer.accumulate_grad_batches, not both",
    ),
    (["tokens_per_step=0"], "tokens_per_step must be at least 1, got 0"),
    (["checkpoint.keep=0"], "checkpoint.keep must be at least 1, got 0"),
    (["checkpoint.every_n_steps=2.5"], "checkpoint.every_n_steps must be a whole number, got 2.5"),
    (["samples.max_new_tokens=-1"], "samples.max_new_tokens must be at least 1, got -1"),
    (["samples.temperature=-1"], "samples.temperature must be at least 0, got -1"),
    (["samples.top_k=0"], "samples.top_k must be at least 1, got 0"),
    (["samples.prompts=5"], "samples.prompts must be a list of values"),
    (["samples.prompts=[1,2]"], "samples.prompts[0] must be text, got 1"),
    (["compile=yes"], "compile must be true, false or null, got 'yes'"),
    (["model.n_layer=two"], "model.n_layer must be a whole number of at least 1, got 'two'"),
    (["model.n_embd=128.5"], "model.n_embd must be a whole number of at least 1, got 128.5"),
    (["model.dropout=nan"], "model.dropout must be a number in [0, 1), got nan"),
    (["model.dropout=1.5"], "model.dropout must be a number in [0, 1), got 1.5"),
    (["model.dropout=high"], "model.dropout must be a number in [0, 1), got 'high'"),
    (["model.bias=maybe"], "model.bias must be true or false, got 'maybe'"),
    (["model.attention=flash"], "model.attention must be one of"),
    (["data.batch_size=0"], "data.batch_size must be at least 1, got 0"),
    (["data.val_fraction=1.5"], "data.val_fraction must be below 1, got 1.5"),
    (["data.val_fraction=-0.1"], "data.val_fraction must be above 0, got -0.1"),
    (["data.num_workers=-1"], "data.num_workers must be at least 0, got -1"),
    (["data.num_proc=0"], "data.num_proc must be at least 1, got 0"),
    (["data.local_copies=x.txt"], "data.local_copies must be a list of values"),
    (["data=text"], "data=text needs data.path"),
    (
        ["data=text", "data.path=x.txt", "data.format=docx"],
        "data.format must be one of auto, txt, json, csv, parquet, got 'docx'",
    ),
    (["data=hub"], "data=hub needs data.name"),
    (["tokenizer=pretrained"], "tokenizer=pretrained needs tokenizer.path"),
    (["tokenizer.vocab_size=-5"], "tokenizer.vocab_size=-5 is too small: byte-level BPE needs 256 byte tokens"),
    (["tokenizer.vocab_size=10"], "tokenizer.vocab_size=10 is too small: byte-level BPE needs 256 byte tokens"),
    (
        ["logger.wandb.mode=sometimes"],
        "logger.wandb.mode must be one of auto, online, offline, disabled, got 'sometimes'",
    ),
    (["logger.wandb.tags=5"], "logger.wandb.tags must be a list of values"),
    # wandb's own rules for names, which it checks only as its run is created
    (["logger.wandb.tags=[ok,'']"], "logger.wandb.tags[1] must be 1 to 64 characters, got ''"),
    ([f"logger.wandb.tags=[{'x' * 65}]"], "logger.wandb.tags[0] must be 1 to 64 characters"),
    (["logger.wandb.project="], "logger.wandb.project must be 1 to 128 characters, got ''"),
    (["logger.wandb.project=me/shakespeare"], "logger.wandb.project cannot hold /, got 'me/shakespeare'"),
    (["+optim.foo=1"], "unknown setting 'optim.foo'"),
    (["optim.lrr=1"], "unknown setting 'optim.lrr' (did you mean optim.lr?)"),
    (
        ["logger.wandb=offline"],  # meant logger.wandb.mode=offline, or logger=wandb
        "logger.wandb holds settings (logger.wandb.project, logger.wandb.name, logger.wandb.group, ...), not one "
        "value; set one of them (loggers are chosen with logger=NAME, a list, or logger=none)",
    ),
    (["logger.wandb=false"], "logger.wandb holds settings (logger.wandb.project,"),  # meant no wandb: logger=csv
    (
        ["logger.tensorboard=x"],  # a logger not among those chosen
        "unknown setting 'logger.tensorboard': the loggers chosen do not include tensorboard; choose loggers with "
        "logger=NAME or a list, e.g. logger=[csv,tensorboard]",
    ),
    (  # no logger at all: not suggested in a list, which would be refused in turn
        ["logger.tensorbord=x"],
        "unknown setting 'logger.tensorbord': tensorbord is no logger; choose loggers with logger=NAME or a list "
        "of: csv, none, tensorboard, wandb",
    ),
    (["model=true"], "model=true is not a choice of model, which a run needs; choose one of: baby,"),
    (["+model=null"], "+model=null is not a choice of model, which a run needs"),
    (
        ["seed=null", "logger=false"],
        "logger=false is not a choice of logger, which a run needs; choose one of: csv, none, tensorboard, wandb",
    ),
    (  # added with +, where nothing would read it
        ["+data.split=train"],
        "unknown setting 'data.split': data=shakespeare has no such setting, data=hub has; choose data=hub to use it",
    ),
    (  # the groups an experiment chooses are the ones named
        ["experiment=gpt2_owt", "data.path=x"],
        "unknown setting 'data.path': data=hub has no such setting",
    ),
    (
        ["experiment=shakespeare_baby", "tokenizer.path=x"],
        "unknown setting 'tokenizer.path': tokenizer=char has no such setting, tokenizer=pretrained has",
    ),
    # what Hydra shows without training is composed from the same overrides, refused the same way
    (["optim.lrr=1", "--cfg", "job"], "unknown setting 'optim.lrr' (did you mean optim.lr?)"),
    (["--cfg=job", "model=nanoo"], "model=nanoo is not a choice; choose one of: baby, gpt2,"),
    (["logger=null"], "logger=null is not a choice of logger, which a run needs; choose one of: csv, none,"),
    (["model=null"], "model=null is not a choice of model, which a run needs; choose one of: baby, gpt2,"),
    (["experiment=null"], "experiment=null is not a choice of experiment; leave experiment out for none"),
    (  # a setting another choice of the group has
        ["data.split=train"],
        "unknown setting 'data.split': data=shakespeare has no such setting, data=hub has; choose data=hub to use it",
    ),
    (["hparams_search=optuna"], "hparams_search is a search over many runs: add -m"),
    (["-m", "optim.lr=1e-3,0"], "optim.lr must be above 0, got 0"),  # every value of a sweep is checked first
    (["-m", "resume=auto"], "resume=auto continues one run: run it without -m"),
    (["-m", "resume="], "resume= with -m names no sweep to continue: give its folder"),  # an unset $SWEEP
    (  # (a folder setting is taken whole: a,b is the one sweep's folder)
        ["-m", "resume=a,b", "optim.lr=1"],
        "-m resume=a,b continues the sweep with its own command line; leave out optim.lr=1",
    ),
    (["resume=a,b"], "resume=a,b names several runs, and resume= continues one: continue each alone"),
    (["resume="], "resume= is empty: give the run to continue (resume=outputs/DATE/TIME), or leave resume= out"),
    (["-m", "--cfg", "job", "optim.lr=1e-3,2e-3"], "--cfg shows what one run would use and -m starts a sweep"),
    (["--info", "-m"], "--info shows what one run would use and -m starts a sweep of several: leave -m out"),
    (["-m", "hydra.sweep.dir=~/s", "optim.lr=1e-3,2e-3"], "hydra.sweep.dir=~/s: a value cannot start with ~ on this"),
    (["-m", "resume", "optim.lr=1e-3,2e-3"], "cannot read resume (missing EQUAL at '<EOF>'); write overrides as"),
    (  # a setting of the search space that a chosen group has not: the fix is a space of the user's own
        ["-m", "hparams_search=optuna", "tokenizer=char"],
        "hparams_search=optuna searches tokenizer.vocab_size, which tokenizer=char does not have; search with a "
        "space of your own: a copy of configs/hparams_search/optuna.yaml without tokenizer.vocab_size",
    ),
    # the files of every job are there before the first job starts
    (["-m", "optim.lr=1e-3,2e-3", "data.path=/no/such.txt"], "data.path /no/such.txt does not exist"),
    (["-m", "data=text", "data.path=/no/such/*.txt"], "data.path glob '/no/such/*.txt' matches no files"),
    (["-m", "data=text"], "data=text needs data.path"),
    (["-m", "optim.lr=1e-3,,2e-3"], "cannot read optim.lr=1e-3,,2e-3 (extraneous input ',' expecting"),
    (["-m", "model.n_layer=range(1,3),x"], "model.n_layer=range(1,3),x: a range() or choice() inside a list of values"),
    (["-m", "model.n_layer=range(3,1)"], "model.n_layer=range(3,1) gives no values to sweep"),  # no job, said nothing
    (
        ["-m", "optim.lr=interval(0.1,1)"],
        "optim.lr=interval(0.1,1) is a range to search, which only a search samples: add hparams_search=optuna",
    ),
    (
        ["-m", "hparams_search=optuna", "hydra.sweeper.params.optim.lr=interval(1e-3,2e-3)"],
        "Sweeping over Hydra's configuration is not supported : 'hydra.sweeper.params.optim.lr=interval(1e-3,2e-3)'",
    ),
    (
        ["-m", "hparams_search=optuna", "model.n_layer=interval(2,4)"],
        "model.n_layer=interval(2,4): the search would draw values such as 2.764, refused: model.n_layer must be a "
        "whole number",
    ),
    (["-m", "hparams_search=optuna", "optim.lr=interval(-1,1)"], "optim.lr must be above 0, got -1"),
    (
        ["-m", "hparams_search=optuna", "hydra.sweeper.storage=sqlite:////no/such/folder/s.db"],
        "hydra.sweeper.storage=sqlite:////no/such/folder/s.db cannot be opened ([Errno 2] No such file or directory: "
        "'/no/such/folder'); give a database URL that can be reached and written, such as sqlite:///search.db",
    ),
    (
        ["-m", "hparams_search=optuna", "hydra.sweeper.storage=search.db"],
        "hydra.sweeper.storage=search.db cannot be opened (Could not parse SQLAlchemy URL from given URL string); "
        "give a database URL that can be reached and written, such as sqlite:///search.db",
    ),
    (
        ["-m", "hparams_search=optuna", "hydra.sweeper.storage=sqlite://search.db"],
        "hydra.sweeper.storage=sqlite://search.db cannot be opened (Invalid SQLite URL: sqlite://search.db); give a "
        "database URL that can be reached and written, such as sqlite:///search.db",
    ),
    (
        ["-m", "hparams_search=optuna", f"hydra.sweeper.storage=sqlite:///{ROOT / 'README.md'}"],
        f"hydra.sweeper.storage=sqlite:///{ROOT / 'README.md'} cannot be opened ((sqlite3.DatabaseError) file is not "
        "a database); give a database URL that can be reached and written, such as sqlite:///search.db",
    ),
    (
        ["-m", "hparams_search=optuna", "hydra.sweeper.direction=maximize"],
        "hydra.sweeper.direction must be minimize, got maximize: each trial returns its final val/bpc",
    ),
    (
        ["-m", "optim.lr=1e-3,2e-3", "hydra.sweep.subdir=same"],
        "hydra.sweep.subdir=same would put every job of the sweep in one folder",
    ),
    (["-m", "hparams_search=optuna", "hydra.sweeper.n_jobs=0"], "hydra.sweeper.n_jobs must be at least 1, got 0"),
    (  # the reason was on a line Hydra's error gives below its first
        ["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=twenty"],
        "Error merging override hydra.sweeper.n_trials=twenty: Value 'twenty' of type 'str' could not be converted to "
        "Integer (hydra.sweeper.n_trials)",
    ),
    (
        ["-m", "hparams_search=optuna", "model.n_head=3"],
        "model.n_embd (64) must be divisible by model.n_head (3)",
    ),  # the search's choices too
    (["hydra.job.chdirr=true"], "unknown setting 'hydra.job.chdirr'"),
    (["runs_root="], "runs_root is empty; give a folder, e.g. runs_root=outputs"),
    # an empty path is an unset shell variable (data.path=$DATA), not the current folder nor "no path"
    (["data.val_fraction=0"], "data.val_fraction must be above 0, got 0"),  # at once, not as the data is read
    (["data.path="], "data.path is empty (an unset shell variable?): give a path, or leave it out"),
    (["data=text", "data.path=''"], "data.path is empty (an unset shell variable?): give a path, or leave it out"),
    (["data.cache_dir="], "data.cache_dir is empty (an unset shell variable?): give a folder (TINYGPT2_CACHE, when"),
    (["latest_link="], "latest_link is empty (an unset shell variable?): give a path, or latest_link=null for no"),
    (["tokenizer=pretrained", "tokenizer.path="], "tokenizer.path is empty (an unset shell variable?): give a path"),
    (["-m", "init_from=", "optim.lr=1e-3,2e-3"], "init_from is empty (an unset shell variable?): give a path, or"),
    # what a group's choice is, changed under another choice's settings (pydoc would drop data.path)
    (
        ["data.source=pydoc", "data.path=/no/such.txt"],
        "data.source=pydoc would change the kind of data=shakespeare and keep its settings; choose the data itself "
        "instead: data=pydoc",
    ),
    (
        ["tokenizer.kind=char", "tokenizer.vocab_size=100"],
        "tokenizer.kind=char would change the kind of tokenizer=bpe and keep its settings; choose the tokenizer "
        "itself instead: tokenizer=char",
    ),
    (["-m", "tokenizer.kind=bpe,char"], "tokenizer.kind=char would change the kind of tokenizer=bpe"),
    (
        ["data.path=~/x.txt"],
        "data.path=~/x.txt: a value cannot start with ~ on this command line; write data.path=$HOME/x.txt",
    ),
    (["model="], "model= needs a choice; choose one of: baby, gpt2, gpt2-large, gpt2-medium, gpt2-xl, nano"),
    (["logger=[csv,bogus]"], "logger=bogus is not a choice; choose one of: csv, none, tensorboard, wandb"),
    (["optim.lr=1e-3,2e-3"], "optim.lr=1e-3,2e-3 gives several values: to train one run for each, add -m"),
    (["~model.n_layer"], "model.n_layer is missing, and a run needs it"),
    (["~samples.seed"], "samples.seed is missing, and a run needs it"),  # each was a traceback after the folder
    (["~tokenizer.vocab_size"], "tokenizer.vocab_size is missing, and a run needs it"),
    (["~data.val_fraction"], "data.val_fraction is missing, and a run needs it"),
    (["samples.max_new_tokens=2147483647"], "samples.max_new_tokens must be at most 10000, got 2147483647"),
    (["~optim.lrr"], "~optim.lrr: unknown setting 'optim.lrr' (did you mean optim.lr?); check the spelling"),
    # Lightning settings that would end a run without a step, or train past its schedule without validating
    (["trainer.max_epochs=0"], "trainer.max_epochs must be at least 1 (or -1 for no limit), got 0"),
    (["trainer.min_steps=100"], "trainer.min_steps cannot be set: a run trains exactly trainer.max_steps steps"),
    (["trainer.min_epochs=2"], "trainer.min_epochs cannot be set"),
    (["trainer.check_val_every_n_epoch=1"], "trainer.check_val_every_n_epoch cannot be set"),
]


@pytest.mark.usefixtures("refused_by_the_checks")
@pytest.mark.parametrize("args, message", BAD_SETTINGS, ids=[" ".join(a) for a, _ in BAD_SETTINGS])
def test_bad_settings_of_every_kind_are_refused_in_one_line(args, message):
    assert message in refused(*args)


@pytest.mark.usefixtures("refused_by_the_checks")
def test_devices_that_do_not_count_the_processes_torchrun_started_are_refused(monkeypatch):
    # what torchrun --standalone --nproc_per_node=2 gives each process it starts (here, its first)
    torchrun = {"RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    for key, value in {
        **torchrun,
        "TORCHELASTIC_RUN_ID": "test",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",
    }.items():
        monkeypatch.setenv(key, value)
    assert refused("trainer.strategy=ddp", "trainer.devices=3") == (
        "trainer.devices=3 x trainer.num_nodes=1 asks for 3 processes, but torchrun started 2; give trainer.devices "
        "as the processes it starts on each machine (trainer.devices=2)"
    )


def test_good_settings_of_the_same_kinds_are_accepted():
    for args in (
        ["optim.betas=[0.8,0.9]", "optim.schedule=linear", "seed=1e3", "trainer.max_steps=2e3"],
        ["model.n_embd=1.28e2", "model.n_layer=2.0", "model.n_head=4"],
        [
            "trainer.deterministic=true",
            "trainer.profiler=simple",
            "trainer.max_time=00:00:00:30",
            "trainer.max_steps=-1",
        ],
        ["trainer.precision=32", "trainer.gradient_clip_algorithm=value", "trainer.benchmark=false"],
        [
            "trainer.val_check_interval=00:00:01:00",
            "trainer.limit_val_batches=0.5",
            "samples.prompts=[ROMEO:,'']",
            "logger=[csv,tensorboard]",
        ],
        ["logger=[none]"],
        ["-m", "optim.lr=1e-3,2e-3", "model.n_layer=range(1,3)"],
        ["data=pydoc", "data.source=pydoc", "tokenizer=char", "tokenizer.kind=char"],  # the kind each choice is
    ):
        passes_the_checks(*args)


@pytest.mark.parametrize(
    "args",
    [
        ["model=baby", "--cfg", "job", "--package", "model"],  # the words the flags take are not overrides
        ["--info", "defaults", "optim=muon"],
        ["-sc", "install=bash"],
        ["--cfg", "job", "-cn", "train"],  # the config flags' words too
    ],
)
def test_hydras_own_flags_show_what_they_show_and_make_nothing(args, tmp_path):
    ran = train_here(*args)
    assert ran.returncode == 0 and ran.stdout and not ran.stderr, ran.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []


def test_block_size_above_what_the_checkpoint_has(tiny_run, small_text, tmp_path):
    tiny = [a for a in TINY_OVERRIDES if not a.startswith("model.")]
    cache = {"TINYGPT2_CACHE": str(tmp_path / "cache")}  # (in the folder refused() checks: nothing left there)
    line = refused(*tiny, f"data.path={small_text}", f"init_from={tiny_run}", "model.block_size=4096", env=cache)
    assert line.startswith("model.block_size=4096 is more than the 32 positions init_from=")


@pytest.mark.usefixtures("refused_by_the_checks")
def test_run_folder_that_cannot_be_written(tmp_path):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    assert refused(f"hydra.run.dir={blocker}/run") == (
        f"hydra.run.dir={blocker}/run: {blocker} is a file, not a folder; choose a folder you can write to"
    )


@pytest.mark.usefixtures("refused_by_the_checks")
def test_a_token_cache_that_cannot_be_written_is_named_as_it_was_given(tmp_path, monkeypatch):
    """The cache folder comes from TINYGPT2_CACHE unless data.cache_dir is given: the line names the one
    the user set."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    monkeypatch.setenv("TINYGPT2_CACHE", str(blocker))
    assert refused() == (
        f"TINYGPT2_CACHE={blocker} (data.cache_dir): {blocker} is a file, not a folder; choose a folder you can "
        "write to"
    )
    assert refused(f"data.cache_dir={blocker}/cache") == (
        f"data.cache_dir={blocker}/cache: {blocker} is a file, not a folder; choose a folder you can write to"
    )


@pytest.mark.usefixtures("refused_by_the_checks")
def test_the_latest_link_never_takes_the_place_of_a_users_file_or_folder(tmp_path):
    notes, folder = tmp_path / "notes.txt", tmp_path / "mine"
    notes.write_text("important")
    folder.mkdir()
    assert refused(f"latest_link={notes}") == (
        f"latest_link={notes} is a file, which the run's link to itself would replace; choose another path, "
        "or latest_link=null for no link"
    )
    assert "is a folder, which the run's link" in refused(f"latest_link={folder}")
    assert "is a file, not a folder" in refused(f"latest_link={notes}/latest")
    assert notes.read_text() == "important" and list(folder.iterdir()) == []
    (tmp_path / "link").symlink_to(folder)  # a link, as an earlier run made it, is replaced
    passes_the_checks(f"latest_link={tmp_path / 'link'}")


@pytest.mark.usefixtures("refused_by_the_checks")
def test_resume_of_a_latest_link_whose_run_was_deleted_says_so(tmp_path):
    latest = tmp_path / "outputs" / "latest"
    latest.parent.mkdir()
    latest.symlink_to(tmp_path / "outputs" / "gone")
    assert refused(f"resume={latest}") == (
        f"resume={latest} links to {tmp_path / 'outputs' / 'gone'}, which no longer exists; give a run folder that "
        "does, a checkpoint in one, or resume=auto"
    )


@pytest.mark.usefixtures("refused_by_the_checks")
@pytest.mark.skipif(not NO_GPU, reason="float16 trains on a GPU")
def test_float16_on_a_cpu_is_refused_rather_than_trained_as_bfloat16():
    assert refused("trainer.precision=16-mixed") == (
        "trainer.precision=16-mixed needs a CUDA GPU (float16 has no CPU support); use trainer.precision=bf16-mixed "
        "or 32-true on a CPU"
    )


@pytest.mark.usefixtures("refused_by_the_checks")
def test_run_folder_of_the_users_own_files(tmp_path):
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (mine / "config.yaml").write_text("my: own\n")
    ran = train_here(f"hydra.run.dir={mine}")  # (not refused(): trying whether it can write there moves its time)
    assert ran.returncode == 1
    assert one_error_line(ran.stderr) == (
        f"error: hydra.run.dir={mine} holds files that are not a run's (config.yaml, notes.txt); a run writes "
        "config.yaml, metrics.csv, checkpoints/ and more there, so choose a new or empty folder"
    )
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml", "notes.txt"]
    assert (mine / "notes.txt").read_text() == "mine" and (mine / "config.yaml").read_text() == "my: own\n"


@pytest.mark.parametrize(
    "args",
    [
        ["optim.lr=nan"],
        ["trainer.deterministic=yes"],
        ["tokens_per_step=1000"],
        ["trainer.max_step=10"],
        ["data=text", "data.path=no_such_file.txt"],
        ["-m", "optim.lr=interval(0.1,1)"],
        ["-m", "optim.lr=1e-3,,2e-3"],
        ["-m", "model.n_layer=range(3,1)"],  # Hydra launched no job, said nothing and left a sweep folder
        ["-m", "hparams_search=optuna", "hydra.sweeper.storage=sqlite:////no/such/folder/s.db"],
        ["-m", "hparams_search=optuna", "hydra.sweeper.n_jobs=0"],  # the sweeper divided by zero trials
        ["-m", "hparams_search=optuna", "hydra.sweeper.storage=search.db"],  # SQLAlchemy's traceback, a sweep folder
    ],
)
def test_train_py_refuses_in_one_line_and_makes_nothing(args, small_text, tmp_path):
    """refused(): one line, and no run folder, cache entry, latest link or sweep folder in the folder it ran in,
    the token cache's included."""
    flags = [a for a in args if a == "-m"]
    data = [] if "data=text" in args else [f"data.path={small_text}"]
    overrides = [*TINY_OVERRIDES, *data, *(a for a in args if a != "-m")]
    refused(*flags, *overrides, env={"TINYGPT2_CACHE": str(tmp_path / "cache")})


# Settings refused once the data is known (the tokenizer's vocabulary): the cache entry made for them goes too.
BAD_WITH_THE_DATA = [
    (
        ["model.vocab_size=0"],
        "model.vocab_size=0 is smaller than the tokenizer's 300 tokens; leave model.vocab_size unset (null) to take "
        "the tokenizer's",
    ),
]


@pytest.mark.parametrize("args, message", BAD_WITH_THE_DATA, ids=[" ".join(a) for a, _ in BAD_WITH_THE_DATA])
def test_bad_settings_refused_once_the_data_is_known_leave_no_cache_entry(args, message, small_text, tmp_path):
    cache = {"TINYGPT2_CACHE": str(tmp_path / "cache")}
    assert refused(*TINY_OVERRIDES, f"data.path={small_text}", *args, env=cache) == message


# ---- generate.py ----------------------------------------------------------------------------------------


def test_prompt_with_characters_the_char_tokenizer_never_saw(tiny_text, tmp_path, capsys):
    tokenizer = train_char([tiny_text])
    ckpt = write_checkpoint(tmp_path / "char.ckpt", train_tiny_gpt(tokenizer, tiny_text, steps=1), tokenizer)
    assert generate.main(["--ckpt", str(ckpt), "--prompt", "ROMEO: café ☕ café", "--max-new-tokens", "5"]) == 1
    out, err = capsys.readouterr()
    assert one_error_line(err) == (
        "error: the prompt has characters this model's tokenizer never saw in training: 'é', '☕'; "
        "leave them out or replace them"
    )
    assert out == ""


def test_damaged_checkpoint_to_generate_from(tiny_run, tmp_path, capsys):
    broken = damaged_copy(tiny_run / "checkpoints" / "last.ckpt", tmp_path, "truncated")
    assert generate.main(["--ckpt", str(broken), "--prompt", "x"]) == 1
    assert "truncated or corrupted" in one_error_line(capsys.readouterr().err)


def test_a_file_that_is_no_checkpoint_is_named_so(tiny_run, tmp_path, capsys, monkeypatch):
    """A text or config file given as a checkpoint is said not to be one (not "damaged"); a checkpoint
    file, however named, that lost its bytes is still said to be damaged."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("ROMEO: my notes\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("model:\n  n_layer: 2\n")
    for given in ("notes.txt", str(tmp_path / "run" / "config.yaml")):
        assert generate.main(["--ckpt", given, "--prompt", "x"]) == 1
        assert one_error_line(capsys.readouterr().err) == (
            f"error: {given} is not a checkpoint; pass a .ckpt file that train.py wrote, a run folder or a "
            "Hugging Face folder"
        )
    with pytest.raises(CheckpointError, match="notes.txt is not a checkpoint"):  # as init_from= reads it
        read_weights(tmp_path / "notes.txt")
    for name, saved in (("other.ckpt", {"epoch": 3}), ("listed.ckpt", {"state_dict": [torch.zeros(2)]})):
        torch.save(saved, tmp_path / name)  # another program's checkpoint
        assert generate.main(["--ckpt", name, "--prompt", "x"]) == 1
        assert one_error_line(capsys.readouterr().err) == (
            f"error: {name} is not a tinygpt2 checkpoint (it has no state_dict of weights)"
        )
    renamed = tmp_path / "weights.bak"
    renamed.write_bytes((tiny_run / "checkpoints" / "last.ckpt").read_bytes()[:2000])
    assert generate.main(["--ckpt", str(renamed), "--prompt", "x"]) == 1
    assert "truncated or corrupted" in one_error_line(capsys.readouterr().err)


# The generate.py and export.py rows are tested in tests/test_cli_errors.py, one test per row:
COVERED_ELSEWHERE = {
    "`--max-new-tokens 0`": "test_cli_errors.py::test_generate_py_refuses_bad_settings",
    "`--temperature -1`": "test_cli_errors.py::test_generate_py_refuses_bad_settings",
    "`--top-p 0` or `--top-p 1.5`": "test_cli_errors.py::test_generate_py_refuses_bad_settings",
    "`--top-k 0`": "test_cli_errors.py::test_generate_py_refuses_bad_settings",
    "an empty prompt, tokenizer without `<\\|endoftext\\|>`": "test_cli_errors.py::test_generate_py_empty_prompt_without_a_start_token",
    "`--attention-png` where nothing can be written": "test_cli_errors.py::test_generate_py_attention_png_in_a_folder_that_cannot_be_written",
    "`--attention-png` at a file that exists": "test_generation.py::test_attention_png_is_never_drawn_over_an_existing_file",
    "`export.py --out` where nothing can be written": "test_cli_errors.py::test_export_py_output_folder_that_cannot_be_written",
    "a full disk (`export.py --out`, `--attention-png`, stdout)": "test_cli_errors.py::test_output_to_a_full_device_is_one_error_line and the two tests after it",
    "stdout in an encoding without the text's characters (`PYTHONIOENCODING=ascii`)": "test_cli_errors.py::test_output_in_an_encoding_without_its_characters_is_one_error_line",
    "a run whose `checkpoints/last.ckpt` link points at a deleted file": "test_cli_errors.py::test_a_run_whose_last_checkpoint_link_is_broken_says_so",
    "`--device cuda` without a GPU": "test_cli_errors.py::test_generate_py_device_cuda_without_a_gpu",
    "a missing checkpoint (`--ckpt`)": "test_cli_errors.py::test_generate_py_missing_checkpoint",
    "a checkpoint carrying pickled code": "test_hf.py (malicious checkpoint)",
    "a Hugging Face folder whose shard index names a file outside it (`--ckpt`, `init_from=`, `export.py`)": "test_input_safety.py::test_generate_py_refuses_an_index_that_names_a_file_outside_the_folder and the test after it",
    "a Hugging Face folder whose weight file is a link out of it (not into the Hugging Face cache's blobs of the same model)": "test_input_safety.py::test_train_py_init_from_refuses_weights_that_are_a_link_out_of_the_folder",
    "a truncated or corrupted checkpoint (`resume=`)": "test_resume.py::test_resuming_from_a_truncated_checkpoint_says_so",
    "`init_from=` with a contradicting shape (`model.n_layer=6`)": "test_init_from.py",
    "a tokenizer setting with `init_from=` (`tokenizer=char`)": "test_init_from.py::test_train_py_refuses_a_tokenizer_override_with_init_from_in_one_line",
    "a setting that contradicts the run being resumed (`resume=RUN model.n_layer=4`)": "test_resume.py::test_a_contradicting_setting_beside_resume_is_refused",
    "a run that another process is training": "test_resume.py::test_a_second_process_on_a_running_run_is_refused",
    "a setting beside a sweep being continued (`-m resume=SWEEP optim.lr=1`)": "test_stops.py::test_a_killed_sweep_continues_in_its_folder_each_job_from_where_it_stood",
    "a time-limited run that reached its limit (`resume=RUN`)": "test_resume.py::test_a_run_that_ended_at_its_time_limit_is_finished_until_given_a_longer_one",
    "a micro-batch the CPU machine's memory cannot hold (`data.batch_size=20000`)": "test_memory_estimate.py::test_train_py_refuses_a_batch_this_machine_cannot_hold_in_one_line_and_makes_nothing",
}

TESTED_HERE = {
    **{label: test_each_readme_row_for_train_py for label in README_ROWS},
    "`model.block_size` above what `init_from=` has": test_block_size_above_what_the_checkpoint_has,
    "a run folder that cannot be written": test_run_folder_that_cannot_be_written,
    "`latest_link` at a file or folder of yours": test_the_latest_link_never_takes_the_place_of_a_users_file_or_folder,
    "`trainer.precision=16-mixed` on a CPU": test_float16_on_a_cpu_is_refused_rather_than_trained_as_bfloat16,
    "`hydra.run.dir` at a folder of your own files": test_run_folder_of_the_users_own_files,
    "a prompt with characters a char tokenizer never saw": test_prompt_with_characters_the_char_tokenizer_never_saw,
    "a truncated or corrupted checkpoint (`--ckpt`)": test_damaged_checkpoint_to_generate_from,
}


def test_every_row_of_the_readme_table_has_a_test():
    readme = (ROOT / "docs" / "errors.md").read_text()
    section = readme.split("### Bad input", 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| input")]
    labels = [re.match(r"\| (.+?) \| ", row).group(1) for row in rows if not set(row) <= set("|- ")]
    assert len(labels) >= 20
    missing = [label for label in labels if label not in TESTED_HERE and label not in COVERED_ELSEWHERE]
    assert not missing, f"README rows without a test: {missing}"
    shown = {re.match(r"\| (.+?) \| `(.+)` \|$", row).groups() for row in rows if row.count("`error: ")}
    for label, line in shown:  # the README shows what train.py prints
        if label in README_ROWS:
            expected = "error: " + README_ROWS[label][1]
            assert line.startswith(expected[:-3]) if expected.endswith("...") else line == expected, label


def test_a_sample_prompt_the_tokenizer_cannot_take_is_refused_before_training(small_text, tmp_path):
    """generate.py refuses a prompt with characters a char tokenizer never saw; the samples written
    during training use the same encoding, so train.py refuses such a samples.prompts at once, and the
    token cache entry made for it goes too (refused(): nothing left in the folder, the cache's included)."""
    tiny = [a for a in TINY_OVERRIDES if not a.startswith("tokenizer.")]
    args = [*tiny, f"data.path={small_text}", "tokenizer=char", "samples.prompts=['ROMEO:','café']"]
    assert refused(*args, env={"TINYGPT2_CACHE": str(tmp_path / "cache")}) == (
        "samples.prompts: 'café' cannot be a sample prompt: the prompt has characters this model's tokenizer "
        "never saw in training: 'é'; leave them out or replace them"
    )


def test_a_pretrained_tokenizer_path_that_names_nothing_is_said_before_the_data_is_looked_up(tmp_path):
    """With a Hub dataset, a tokenizer.path that does not exist is the error, not whatever looking the
    dataset up (offline here) says, and nothing is tokenized first."""
    tiny = [a for a in TINY_OVERRIDES if not a.startswith("tokenizer.")]
    args = ["data=hub", "data.name=roneneldan/TinyStories", "tokenizer=pretrained", "tokenizer.path=gpt2-files/"]
    ran = train_here(*tiny, *args, env={"TINYGPT2_CACHE": str(tmp_path / "cache")})
    assert ran.returncode == 1
    assert one_error_line(ran.stderr) == (
        f"error: tokenizer.path {tmp_path / 'gpt2-files'} does not exist; give a tokenizer.json or a Hugging Face "
        "tokenizer folder"
    )
    assert "tokenizing" not in ran.stdout + ran.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["eq=x.txt", "ünïcödé.txt", "c,omma.txt", "it's.txt"])
def test_a_path_the_command_line_grammar_misreads_gets_the_quoted_form_that_works(name, small_text, tmp_path):
    """A file name with =, a comma, letters beyond ASCII or a quote is read by Hydra's grammar, not
    passed on: the one line names the override and gives it quoted, and that form, pasted into a shell,
    trains on the file."""
    import shlex

    text = tmp_path / "texts" / name
    text.parent.mkdir()
    text.write_text(small_text.read_text(encoding="utf-8")[:5000], encoding="utf-8")
    cache = {"TINYGPT2_CACHE": str(tmp_path / "cache")}
    tiny = [a for a in TINY_OVERRIDES if not a.startswith("tokenizer.")]
    line = refused(*tiny, "tokenizer=char", "data=text", f"data.path={text}", env=cache)
    assert f"data.path={text}" in line and "quote" in line
    suggested = line.rsplit(": ", 1)[1]
    (override,) = shlex.split(suggested)  # one word for the shell
    ran = train_here(*tiny, "tokenizer=char", "data=text", override, env=cache)
    assert ran.returncode == 0, ran.stderr[-2000:]
    (result,) = tmp_path.glob("outputs/*/*/result.json")
    assert json.loads(result.read_text())["config"]["data"]["path"] == str(text)
