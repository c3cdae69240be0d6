"""Copy index benchmark: building data/copies.py's index of a 200 MB corpus's tokens, and looking up a
256-token generation in it.

    python bench/copies.py [--mb 200] [--tokens 100000000] [--lookups 200] [--shakespeare PATH]

Builds bench/prepare.py's corpus (editions of Tiny Shakespeare, one file each) in a temporary folder and
prepares its tokens as `python train.py data=text` does (default tokenizer), then, each in a fresh
process, builds the copy index of its training split, timed, with the process's peak memory
(getrusage's ru_maxrss; its resident memory before the build, imports and the opened entry, is taken
off for the figure per token). Then a second entry of --tokens tokens: the corpus's own training
tokens repeated until there are that many (every span then occurs at least twice, the index's hardest
case), indexed the same way. In each index it looks up --lookups generations of 256 tokens, each 128
random ids then 128 copied from a random place of train.bin, timed one by one (the first, on a cold
index, apart). The machine's load average is printed beside each phase. Everything made goes at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import common  # noqa: E402
from bench.prepare import build_corpus, check_room, load, run_child  # noqa: E402

GENERATED, COPIED = 256, 128


def build_child(cache: str, key: str) -> None:
    """Build the index of an entry in this fresh process; print its time and memory."""
    from data.copies import open_copy_index

    before_kb = resident_kb()
    started = time.perf_counter()
    index = open_copy_index(cache, key)
    seconds = time.perf_counter() - started
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    disk = sum(f.stat().st_size for f in index.folder.iterdir())
    print(json.dumps({"seconds": seconds, "peak_kb": peak_kb, "before_kb": before_kb, "tokens": index.n, "disk": disk}))


def resident_kb() -> int:
    """This process's resident memory now, after its imports."""
    import data.cache  # noqa: F401  (what the build imports, counted before it)
    import data.copies  # noqa: F401

    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def build(cache: Path, key: str) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--build-child", str(cache), key]
    done = common.run(command)
    if done.returncode != 0:
        raise SystemExit(f"error: building the copy index failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def repeated_entry(cache: Path, key: str, tokens: int) -> str:
    """An entry beside `key` whose train.bin is key's repeated to `tokens` tokens; its key."""
    import numpy as np

    from data.cache import open_cache

    source = open_cache(cache / "tokens" / key)
    folder = cache / "tokens" / f"repeated-{tokens}"
    folder.mkdir()
    shutil.copy(source.folder / "tokenizer.json", folder)
    shutil.copy(source.folder / "val.bin", folder)
    train = np.asarray(source.ids("train"))
    np.resize(train, tokens).tofile(folder / "train.bin")  # repeats it
    (folder / "meta.json").write_text(json.dumps({**source.meta, "train_tokens": tokens, "train_copies": []}))
    return folder.name


def lookups(cache: Path, key: str, count: int) -> tuple[float, list[float], int]:
    """(first lookup's seconds, the others', spans found in all) for generations half random, half copied."""
    import numpy as np

    from data.copies import open_copy_index

    index = open_copy_index(cache, key)
    rng = np.random.default_rng(0)
    times, found = [], 0
    for _ in range(count + 1):
        at = int(rng.integers(0, index.n - COPIED))
        random_ids = rng.integers(0, len(index.table), GENERATED - COPIED)
        ids = [*random_ids.tolist(), *np.asarray(index.tokens[at : at + COPIED]).tolist()]
        started = time.perf_counter()
        found += len(index.find(ids, 8))
        times.append(time.perf_counter() - started)
    return times[0], times[1:], found


def measure(cache: Path, key: str, count: int, what: str) -> list[tuple[str, str]]:
    before = load()
    built = build(cache, key)
    print(f"{what}: built in {built['seconds']:.1f} s; load average {before} -> {load()}", flush=True)
    before = load()
    first, times, found = lookups(cache, key, count)
    print(f"{what}: {count} lookups; load average {before} -> {load()}", flush=True)
    times_ms = sorted(1000 * t for t in times)
    extra_mb = (built["peak_kb"] - built["before_kb"]) / 1024
    return [
        (f"{what}: tokens", f"{built['tokens']:,}"),
        (f"{what}: build", f"{built['seconds']:.1f} s ({built['tokens'] / built['seconds'] / 1e6:.2f}M tokens/s)"),
        (
            f"{what}: build's peak memory",
            f"{built['peak_kb'] / 2**20:.2f} GiB ru_maxrss; {extra_mb * 2**20 / built['tokens']:.1f} bytes a token "
            f"above the {built['before_kb'] / 1024:.0f} MB before it",
        ),
        (
            f"{what}: index on disk",
            f"{built['disk'] / 2**20:.0f} MiB ({built['disk'] / built['tokens']:.2f} bytes a token)",
        ),
        (
            f"{what}: 256-token lookup (target < 50 ms)",
            f"median {times_ms[len(times_ms) // 2]:.1f} ms, 90th percentile {times_ms[int(len(times_ms) * 0.9)]:.1f} ms, "
            f"slowest {times_ms[-1]:.1f} ms; first (cold) {first * 1000:.1f} ms; {found / (count + 1):.1f} spans each",
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=200, help="corpus size in megabytes (default 200)")
    parser.add_argument("--tokens", type=int, default=100_000_000, help="the repeated entry's tokens (0: none)")
    parser.add_argument("--lookups", type=int, default=200, help="lookups timed in each index (default 200)")
    parser.add_argument("--shakespeare", type=Path, default=None, help="Tiny Shakespeare's input.txt")
    args = parser.parse_args()
    if args.mb < 1 or args.tokens < 0 or args.lookups < 1:
        raise SystemExit("error: --mb and --lookups must be at least 1, --tokens at least 0")
    check_room(args.mb, tempfile.gettempdir())
    source = args.shakespeare or common.shakespeare()
    work = Path(tempfile.mkdtemp(prefix="tinygpt2-bench-"))
    try:
        corpus, cache = work / "corpus", work / "cache"
        size = build_corpus(source, corpus, args.mb)
        print(f"corpus: {size / 1e6:.1f} MB in {len(list(corpus.iterdir()))} files under {corpus}", flush=True)
        env = {**os.environ, "HF_DATASETS_CACHE": str(work / "hf"), "TINYGPT2_CACHE": str(cache)}
        prepared, _, wall = run_child(corpus, cache, env)
        print(f"tokens prepared in {wall:.1f} s", flush=True)
        key = Path(prepared["folder"]).name
        rows = measure(cache, key, args.lookups, f"{size / 1e6:.0f} MB corpus")
        if args.tokens:
            rows += measure(cache, repeated_entry(cache, key, args.tokens), args.lookups, "repeated")
        common.print_table(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build-child"]:
        build_child(*sys.argv[2:])
    else:
        common.run_benchmark(main)
