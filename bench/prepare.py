"""Data preparation benchmark: tokenize a >= 200 MB corpus end to end, beside the library's own speed.

    python bench/prepare.py [--mb 200] [--shakespeare PATH]

Builds a corpus in a temporary folder from Tiny Shakespeare (found as train.py finds it: one file per
"edition", its speeches in a different order, its speakers renamed), then, in fresh processes with the
default config (`data=text` and the default tokenizer, a byte-level BPE with BPE-dropout, whose extra
encodings a corpus of 1.5M training characters or more does not get: data.prepare.DROPOUT_MAX_TRAIN_CHARS):

  first run    TextDataModule.prepare() from nothing: tokenizer training on a sample, then all tokens
               (and, for a corpus below that size, the training split's BPE-dropout encodings)
  second run   the same again, which must find the cache

and in this process `tokenizers`' own `encode_batch_fast` over the same text, with the tokenizer the
first run trained. Memory is sampled from /proc every 100 ms over the preparing process and its
workers: PSS (pages shared between processes counted once, so the sum is what they really hold)
and the largest RSS of any one of them. The machine's load average is printed beside each phase, since
other work on a shared machine slows whichever phase it overlaps. Everything made goes at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402

PIECE = 65_536
# Disk per byte of corpus at the peak: the corpus itself, and its token ids twice (the shards, and
# train.bin and val.bin joined from them), each about 0.83 bytes of uint16 ids per byte of text
DISK_PER_CORPUS_BYTE = 3


def build_corpus(source: Path, folder: Path, megabytes: int) -> int:
    """Editions of the play text until `megabytes` of it; returns the bytes written."""
    try:
        text = source.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        text = ""
    speeches = [s for s in text.split("\n\n") if ":\n" in s]
    if not speeches:  # editions of nothing would never add up to the size asked for
        raise SystemExit(
            f"error: --shakespeare {source} holds no speeches in UTF-8 text (a speaker's name and a colon on a "
            "line, the speech below it, a blank line between); give Tiny Shakespeare's input.txt"
        )
    speakers = sorted({s.split(":\n", 1)[0] for s in speeches})
    folder.mkdir(parents=True)
    written, edition = 0, 0
    while written < megabytes * 1_000_000:
        rng = random.Random(edition)
        renamed = dict(zip(speakers, rng.sample(speakers, len(speakers)), strict=True))
        order = rng.sample(speeches, len(speeches))
        body = "\n\n".join(renamed[s.split(":\n", 1)[0]] + ":\n" + s.split(":\n", 1)[1] for s in order)
        path = folder / f"edition-{edition:04d}.txt"
        path.write_text(body, encoding="utf-8")
        written += path.stat().st_size
        edition += 1
    return written


def check_room(megabytes: int, folder: str) -> None:
    """Refuse a corpus that the disk holding folder has no room to prepare, before anything is written."""
    need, free = megabytes * 1_000_000 * DISK_PER_CORPUS_BYTE, shutil.disk_usage(folder).free
    if need > free:
        raise SystemExit(
            f"error: --mb {megabytes} needs about {need / 1e9:,.1f} GB free in {folder} (the corpus and its token "
            f"ids, twice while they are joined) and it has {free / 1e9:,.1f} GB; use a smaller --mb, or set "
            "TMPDIR to a folder on a disk with room"
        )


SAID = 3  # the exit of a preparation that refused to go on and said why on stderr


def child(corpus: str, cache: str) -> None:
    """One preparation, as `python train.py data=text data.path=corpus` would do it; prints its timing.
    Stopped (Ctrl-C) by the benchmark that started it, which says so, it ends without a word."""
    from data.errors import DataError

    try:
        prepare(corpus, cache)
    except KeyboardInterrupt:
        sys.exit(130)
    except DataError as err:  # a full disk part way: said here, in one line, for the benchmark to end on
        print(f"error: {err}", file=sys.stderr)
        sys.exit(SAID)


def prepare(corpus: str, cache: str) -> None:
    import logging
    import resource

    from hydra import compose, initialize_config_dir

    from data.datamodule import TextDataModule

    logging.basicConfig(level=logging.INFO, format="  %(message)s", stream=sys.stderr)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["data=text", f"data.path={corpus}", f"data.cache_dir={cache}"])
    dm = TextDataModule(cfg.data, cfg.tokenizer, cfg.model.block_size, cfg.seed, num_batches=1)
    started, cpu = time.perf_counter(), cpu_seconds()
    entry = dm.prepare()
    seconds, cpu = time.perf_counter() - started, cpu_seconds() - cpu
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = {
        "seconds": seconds,
        "cpu": cpu,
        "folder": str(entry.folder),
        "meta": entry.meta,
        "self_maxrss_mb": peak_kb / 1024,
    }
    print(json.dumps(result))


def cpu_seconds() -> float:
    """CPU time of this process and of its children that have ended (the tokenizing workers, once joined)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class MemorySampler(threading.Thread):
    """Peak memory of a process and all its descendants, read from /proc every `interval` seconds."""

    def __init__(self, pid: int, interval: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_pss = self.peak_rss = 0
        self.peak_processes = 0
        self.stopped = threading.Event()

    def tree(self) -> list[int]:
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except OSError:
                    continue
        family, frontier = [self.pid], [self.pid]
        while frontier:
            frontier = [pid for pid, parent in parents.items() if parent in frontier]
            family += frontier
        return family

    @staticmethod
    def field(pid: int, file: str, name: str) -> int:
        try:
            with open(f"/proc/{pid}/{file}") as f:
                for line in f:
                    if line.startswith(name):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def run(self) -> None:
        while not self.stopped.is_set():
            family = self.tree()
            self.peak_pss = max(self.peak_pss, sum(self.field(p, "smaps_rollup", "Pss:") for p in family))
            self.peak_rss = max(self.peak_rss, max(self.field(p, "status", "VmRSS:") for p in family))
            self.peak_processes = max(self.peak_processes, len(family))
            self.stopped.wait(self.interval)


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def run_child(corpus: Path, cache: Path, env: dict) -> tuple[dict, MemorySampler, float]:
    started = time.perf_counter()
    command = [sys.executable, __file__, "--child", str(corpus), str(cache)]
    with common.started(command, stdout=subprocess.PIPE, env=env, text=True) as proc:
        sampler = MemorySampler(proc.pid)
        sampler.start()
        out, _ = proc.communicate()
        sampler.stopped.set()
        sampler.join()
    if proc.returncode == SAID:
        sys.exit(1)
    if proc.returncode != 0:
        sys.exit(f"error: the preparation failed (exit {proc.returncode})")
    return json.loads(out.strip().splitlines()[-1]), sampler, time.perf_counter() - started


def library_throughput(corpus: Path, tokenizer_json: str) -> tuple[float, float, int]:
    """Seconds (wall and CPU) spent in encode_batch_fast over the whole corpus, in 64 KiB pieces, 64
    pieces a call (so every core is busy); and the tokens it gave. Reading the files is not timed."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    seconds, cpu, tokens, batch = 0.0, 0.0, 0, []

    def encode(batch: list[str]) -> None:
        nonlocal seconds, cpu, tokens
        started, cpu_started = time.perf_counter(), cpu_seconds()
        encodings = tokenizer.encode_batch_fast(batch, add_special_tokens=False)
        seconds += time.perf_counter() - started
        cpu += cpu_seconds() - cpu_started
        tokens += sum(len(e.ids) for e in encodings)

    for path in sorted(corpus.iterdir()):
        text = path.read_text(encoding="utf-8")
        batch += [text[i : i + PIECE] for i in range(0, len(text), PIECE)]
        while len(batch) >= 64:
            encode(batch[:64])
            batch = batch[64:]
    if batch:
        encode(batch)
    return seconds, cpu, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="corpus size in megabytes (default 200)")
    parser.add_argument(
        "--shakespeare",
        type=Path,
        default=None,
        help="Tiny Shakespeare's input.txt (default: $TINYSHAKESPEARE, else found as train.py finds it)",
    )
    args = parser.parse_args()
    if args.mb < 1:
        raise SystemExit(f"error: --mb must be at least 1, got {args.mb}")
    if args.shakespeare is not None and not args.shakespeare.is_file():
        raise SystemExit(f"error: --shakespeare {args.shakespeare}: no such file; give Tiny Shakespeare's input.txt")
    check_room(args.mb, tempfile.gettempdir())
    source = args.shakespeare or common.shakespeare()

    work = Path(tempfile.mkdtemp(prefix="tinygpt2-bench-"))
    try:
        corpus, cache = work / "corpus", work / "cache"
        size = build_corpus(source, corpus, args.mb)
        mb = size / 1e6
        print(f"corpus: {mb:.1f} MB in {len(list(corpus.iterdir()))} files under {corpus}, from {source}", flush=True)
        env = {**os.environ, "HF_DATASETS_CACHE": str(work / "hf"), "TINYGPT2_CACHE": str(cache)}

        before = load()
        first, memory, first_wall = run_child(corpus, cache, env)
        print(
            f"first run: {first['seconds']:.1f} s ({first_wall:.1f} s with interpreter start and imports); "
            f"load average {before} -> {load()}",
            flush=True,
        )
        second, _, second_wall = run_child(corpus, cache, env)
        print(f"second run: {second['seconds'] * 1000:.1f} ms ({second_wall:.1f} s with start and imports)", flush=True)
        tokenizer_json = (Path(first["folder"]) / "tokenizer.json").read_text(encoding="utf-8")
        before = load()
        library_seconds, library_cpu, library_tokens = library_throughput(corpus, tokenizer_json)
        print(f"library: {library_seconds:.1f} s; load average {before} -> {load()}", flush=True)

        ours, library = mb / first["seconds"], mb / library_seconds
        tokens = first["meta"]["train_tokens"] + first["meta"]["val_tokens"]
        rows = [
            ("corpus", f"{mb:.1f} MB of text, {tokens:,} tokens ({library_tokens:,} by the library alone)"),
            ("ours: end-to-end prepare()", f"{ours:.2f} MB/s ({first['seconds']:.1f} s; {first['cpu']:.1f} CPU-s)"),
            ("library: encode_batch_fast", f"{library:.2f} MB/s ({library_seconds:.1f} s; {library_cpu:.1f} CPU-s)"),
            ("ratio (target >= 0.80)", f"{ours / library:.2f} (by CPU time: {library_cpu / first['cpu']:.2f})"),
            (
                "peak memory, PSS of all processes (target < 1.5 GB)",
                f"{memory.peak_pss / 2**30:.2f} GiB ({memory.peak_processes} processes)",
            ),
            (
                "peak RSS of one process",
                f"{memory.peak_rss / 2**30:.2f} GiB (getrusage of the main one: {first['self_maxrss_mb'] / 1024:.2f} GiB)",
            ),
            (
                "second run (target >= 50x faster)",
                f"{second['seconds'] * 1000:.1f} ms: {first['seconds'] / second['seconds']:.0f}x faster",
            ),
        ]
        common.print_table(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:  # run_child's process, with the corpus and the cache folder
        child(*sys.argv[2:])
    else:
        common.run_benchmark(main)
