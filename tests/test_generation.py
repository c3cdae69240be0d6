"""generate.py and what it is made of: batches, stop tokens and strings, streaming UTF-8, the
sliding window, the attention picture, the interactive loop and the summary."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
import torch
from matplotlib.image import imread

import generate
from generation import generate as generate_tokens
from generation import stream
from generation.attention_plot import save_attention_png
from generation.text import StopStrings, TextStream
from tests.common import ROOT, run_in_terminal

HEADER = re.compile(r"^-{20} sample (\d+) \(seed (\d+)\) -{20}\n", re.MULTILINE)


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = generate.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def samples_of(batch_output: str) -> list[str]:
    """The text of each sample in a batch's output (prompt included, closing newline removed)."""
    parts = HEADER.split(batch_output)[1:]  # seq, seed, text, seq, seed, text, ...
    return [text[:-1] for text in parts[2::3]]


# ---- batches and seeds ---------------------------------------------------------------------------------


def test_batched_rows_equal_single_runs_with_the_same_seeds(tiny_gpt):
    idx = torch.tensor([[5, 9, 14, 20]])
    settings = dict(temperature=0.9, top_k=40, top_p=0.95)
    batch = generate_tokens(
        tiny_gpt, idx.repeat(4, 1), 50, generator=[torch.Generator().manual_seed(7 + i) for i in range(4)], **settings
    )
    for i in range(4):
        single = generate_tokens(tiny_gpt, idx, 50, generator=[torch.Generator().manual_seed(7 + i)], **settings)
        assert torch.equal(batch[i], single[0])
    assert len({tuple(row.tolist()) for row in batch}) == 4  # different seeds, different samples


def test_num_samples_run_as_one_batch_through_one_cache(tiny_run, tiny_gpt, capsys, monkeypatch):
    batch_sizes = []
    real_set_kv_cache = type(tiny_gpt).set_kv_cache
    monkeypatch.setattr(
        type(tiny_gpt),
        "set_kv_cache",
        lambda self, b, *a, **k: (batch_sizes.append(b), real_set_kv_cache(self, b, *a, **k))[1],
    )
    code, out, _ = cli(
        capsys, "--ckpt", tiny_run, "--prompt", "ROMEO:", "--num-samples", 3, "--seed", 5, "--max-new-tokens", 40
    )
    assert code == 0 and batch_sizes == [3]  # one cache, for a batch of three
    texts = samples_of(out)
    assert len(texts) == 3 and len(set(texts)) == 3
    for i, text in enumerate(texts):
        code, single, _ = cli(capsys, "--ckpt", tiny_run, "--prompt", "ROMEO:", "--seed", 5 + i, "--max-new-tokens", 40)
        assert code == 0 and single == text + "\n"


def test_sampling_options_change_the_text_and_the_seed_repeats_it(tiny_run, capsys):
    base = ["--ckpt", tiny_run, "--prompt", "ROMEO:", "--max-new-tokens", 30]
    runs = {
        name: cli(capsys, *base, *extra)[1]
        for name, extra in {
            "default": [],
            "again": [],
            "seed": ["--seed", 99],
            "greedy": ["--temperature", 0],
            "greedy2": ["--temperature", 0, "--seed", 99],
            "top-k-1": ["--top-k", 1, "--temperature", 1.5],
            "combined": ["--top-k", 10, "--top-p", 0.8, "--temperature", 1.2],
        }.items()
    }
    assert runs["default"] == runs["again"] != runs["seed"]
    assert runs["greedy"] == runs["greedy2"] == runs["top-k-1"]  # top-k 1 is greedy at any temperature
    assert runs["combined"] not in (runs["default"], runs["greedy"])


# ---- stopping -------------------------------------------------------------------------------------------


def test_stop_tokens_end_each_row_and_the_stream(tiny_gpt):
    idx = torch.tensor([[5, 9, 14, 20]])
    free = generate_tokens(tiny_gpt, idx, 20, temperature=0)[0, 4:].tolist()
    stop = free[6]
    first = free.index(stop)
    out = generate_tokens(tiny_gpt, idx, 20, temperature=0, stop_tokens=[stop])
    assert out[0, 4:].tolist() == free[: first + 1]  # ends right after the stop token

    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    rows = generate_tokens(tiny_gpt, idx.repeat(3, 1), 60, temperature=1.0, generator=gens, stop_tokens=[stop, free[2]])
    for row in rows[:, 4:].tolist():
        hits = [i for i, t in enumerate(row) if t in (stop, free[2])]
        if hits:  # after its stop token a finished row only repeats it
            assert set(row[hits[0] :]) == {row[hits[0]]}


def test_a_stream_runs_its_steps_in_inference_mode_and_leaves_the_callers_code_out_of_it(tiny_gpt):
    tokens = stream(tiny_gpt, torch.tensor([[5, 9]]), 3, temperature=0)
    for token in tokens:
        assert token.is_inference()
        assert not torch.is_inference_mode_enabled()  # between two steps, the caller's own code runs


def test_a_stream_left_unfinished_until_the_program_ends_says_nothing_at_exit(tmp_path):
    """Python closes a generator still open at exit while torch's modules are being torn down: the
    stream's cleanup then raised there, printed as 'Exception ignored in: <generator object stream>'."""
    script = (
        "import torch\n"
        "from model import GPT, GPTConfig\n"
        "gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=50)).eval()\n"
        "from generation import stream\n"
        "tokens = stream(gpt, torch.zeros(1, 1, dtype=torch.long), 10)\n"
        "print(next(tokens).shape)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300, env=os.environ
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "torch.Size([1])\n"
    assert proc.stderr == ""


def test_stop_strings_cut_before_the_string_even_across_pieces():
    stops = StopStrings(["\n\n", "END"])
    pieces = ["Hello", " wor", "ld\n", "\nmore text"]
    assert "".join(stops.feed(p) for p in pieces) == "Hello world"
    assert stops.stopped and stops.feed("anything") == "" and stops.flush() == ""

    stops = StopStrings(["END"])
    assert stops.feed("the EN") == "the "  # "EN" may become "END": held back
    assert stops.feed("D is near") == "" and stops.stopped

    stops = StopStrings(["END"])
    assert stops.feed("E") == "" and stops.feed("NTER") == "ENTER"  # it did not become a stop string
    assert stops.feed("ing E") == "ing " and stops.flush() == "E"  # held text comes out at the end

    stops = StopStrings(["c", "ab"])
    assert stops.feed("xxabc") == "xx"  # the earliest stop string in the text wins, whatever the order given


def test_generate_py_stops_at_a_stop_string(tiny_run, capsys):
    code, free, _ = cli(capsys, "--ckpt", tiny_run, "--prompt", "ROMEO:", "--max-new-tokens", 60, "--temperature", 0)
    generated = free[len("ROMEO:") : -1]
    stop = generated.strip()[5:8]  # from the words, not the blanks a model may begin with
    assert code == 0 and len(generated) > 12 and stop.strip()
    code, out, err = cli(
        capsys, "--ckpt", tiny_run, "--prompt", "ROMEO:", "--max-new-tokens", 60, "--temperature", 0, "--stop", stop
    )
    assert out == "ROMEO:" + generated[: generated.index(stop)] + "\n"
    tokens = int(re.search(r"\[(\d+) tokens generated", err).group(1))
    assert tokens < 60  # generation ended there, not at --max-new-tokens


# ---- streaming text -------------------------------------------------------------------------------------


def test_streaming_gives_whole_characters_when_one_spans_several_tokens(tiny_tokenizer):
    text = "Café → 🙂 naïve ROMEO"
    ids = tiny_tokenizer.encode(text).ids
    assert len(ids) > len(text.split())  # the accented letters and symbols take several byte tokens each
    stream = TextStream(tiny_tokenizer)
    pieces = [stream.add(token) for token in ids]
    assert "".join(pieces) + stream.finish() == text == stream.text
    assert "" in pieces  # at least one token completed no character by itself ...
    assert all("\ufffd" not in piece for piece in pieces)  # ... and no broken character was ever given out
    assert "🙂" in pieces  # the 4-byte character came out whole, in one piece


def test_streaming_with_a_multibyte_stop_string(tiny_tokenizer):
    stream = TextStream(tiny_tokenizer, stop_strings=["→"])
    for token in tiny_tokenizer.encode("Café → 🙂").ids:
        stream.add(token)
    assert stream.stopped and stream.text + stream.finish() == "Café "


def test_generate_py_prints_a_multibyte_prompt_and_text_that_decodes(tiny_run, capsys):
    code, out, _ = cli(capsys, "--ckpt", tiny_run, "--prompt", "Café → ", "--max-new-tokens", 40, "--seed", 3)
    assert code == 0 and out.startswith("Café → ") and "\ufffd" not in out[:7]


# ---- the window slides ----------------------------------------------------------------------------------


def test_generation_goes_on_past_the_context_window(tiny_gpt):
    block = tiny_gpt.config.block_size
    idx = torch.tensor([[5, 9, 14, 20]])
    lengths = []
    for _ in stream(tiny_gpt, idx, 3 * block, temperature=1.0, generator=torch.Generator().manual_seed(0)):
        lengths.append(tiny_gpt.cache_length())
    assert len(lengths) == 3 * block
    assert max(lengths) == block and min(lengths[block:]) == block // 2  # full, then restarted from half
    cached = generate_tokens(tiny_gpt, idx, 3 * block, temperature=0)
    assert torch.equal(cached, generate_tokens(tiny_gpt, idx, 3 * block, temperature=0, use_cache=False))


def test_a_prompt_longer_than_the_context_is_seen_through_its_last_block_size_tokens(tiny_gpt):
    """The first token follows from the prompt's last block_size tokens, the most the model can see
    (not from half of them, as a slide of the window would keep), with and without the cache."""
    block = tiny_gpt.config.block_size
    idx = torch.arange(3 * block + 5).remainder(tiny_gpt.config.vocab_size).unsqueeze(0)
    with torch.no_grad():
        expected = tiny_gpt.last_logits(idx[:, -block:]).argmax(-1)
    for use_cache in (True, False):
        first = next(stream(tiny_gpt, idx, 1, temperature=0, use_cache=use_cache))
        assert torch.equal(first, expected)
    assert generate_tokens(tiny_gpt, idx, 2, temperature=0).shape == (1, 3 * block + 7)
    cached = generate_tokens(tiny_gpt, idx, 2 * block, temperature=0)
    assert torch.equal(cached, generate_tokens(tiny_gpt, idx, 2 * block, temperature=0, use_cache=False))


def test_generate_py_says_how_much_of_a_long_prompt_the_context_holds(tiny_run, capsys):
    code, _, err = cli(capsys, "--ckpt", tiny_run, "--prompt", "ROMEO: " * 60, "--max-new-tokens", 2)
    assert code == 0 and "tokens, of which the context holds the last 32; KV cache" in err


def test_generate_py_runs_past_the_window_with_and_without_cache(tiny_run, capsys):
    args = ["--ckpt", tiny_run, "--prompt", "ROMEO:", "--max-new-tokens", 100, "--temperature", 0]
    code, cached, err = cli(capsys, *args)
    assert code == 0 and "[100 tokens generated" in err and "KV cache" in err
    code, uncached, err = cli(capsys, *args, "--no-cache")
    assert code == 0 and cached == uncached and "no cache" in err


def test_summary_names_tokens_speed_prompt_and_cache(tiny_run, capsys):
    code, _, err = cli(capsys, "--ckpt", tiny_run, "--prompt", "ROMEO:", "--max-new-tokens", 10)
    summary = err.strip().splitlines()[-1]
    match = re.fullmatch(
        r"\[(\d+) tokens generated \(1 sample\(s\)\) in [\d.]+s, [\d.]+ tokens/s; prompt (\d+) tokens; "
        r"KV cache (\d+)/32 positions; .*last\.ckpt\]",
        summary,
    )
    assert code == 0 and match, summary
    prompt_tokens = int(match.group(2))
    assert int(match.group(1)) == 10 and prompt_tokens >= 2
    assert int(match.group(3)) == prompt_tokens + 9  # the prompt and every token fed back so far


# ---- the attention picture ------------------------------------------------------------------------------


def test_attention_png_is_written_with_one_heatmap_per_head(tiny_run, tmp_path, capsys):
    png = tmp_path / "pictures" / "attention.png"
    code, _, err = cli(
        capsys, "--ckpt", tiny_run, "--prompt", "ROMEO: my $5", "--max-new-tokens", 12, "--attention-png", png
    )
    assert code == 0 and "attention of the last layer written to" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(png)
    assert image.shape[0] > 500 and image.shape[1] > 500
    assert image[..., :3].std() > 0.05  # a picture, not a blank canvas
    assert not list(png.parent.glob(".*partial"))  # no half-written file left beside it


def test_attention_png_crops_to_the_context_window(tiny_run, tmp_path, capsys):
    png = tmp_path / "long.png"
    code, _, err = cli(capsys, "--ckpt", tiny_run, "--prompt", "ROMEO:", "--max-new-tokens", 50, "--attention-png", png)
    assert code == 0 and png.stat().st_size > 10_000 and "the last 32 of" in err


def test_attention_png_is_never_drawn_over_an_existing_file(tiny_run, tmp_path):
    """The same command twice: the second is refused before any work, and the first picture is kept."""
    png = tmp_path / "attention.png"
    args = ["--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "5", "--attention-png", str(png)]
    assert generate.main(args) == 0
    drawn = png.read_bytes()
    proc = generate_process(*args, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == b""
    assert proc.stderr.decode() == (
        f"error: --attention-png {png} already exists, and a picture is never drawn over a file; give another "
        "name, or remove it first to draw it again\n"
    )
    assert png.read_bytes() == drawn


def test_interactive_redraws_its_own_attention_png_for_each_prompt(tiny_run, tmp_path, capsys, monkeypatch):
    png = tmp_path / "session.png"
    monkeypatch.setattr(sys, "stdin", io.StringIO("JULIET:\n"))
    code, _, err = cli(capsys, "--ckpt", tiny_run, "--interactive", "--prompt", "ROMEO:", "--attention-png", png)
    assert code == 0 and err.count(f"attention of the last layer written to {png}") == 2


def test_attention_plot_draws_what_it_is_given(tmp_path):
    weights = torch.softmax(torch.randn(3, 5, 5).tril() * 4, dim=-1)
    path = save_attention_png(weights, ["a", "b", "c", "d", "e"], tmp_path / "w.png", prompt_len=2)
    assert path.stat().st_size > 5_000
    with pytest.raises(ValueError, match="labels"):
        save_attention_png(weights, ["a"], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# ---- interactive ----------------------------------------------------------------------------------------


def test_interactive_answers_each_prompt_with_the_model_loaded_once(tiny_run, capsys, monkeypatch):
    loads = []
    real_load = generate.load_checkpoint
    monkeypatch.setattr(generate, "load_checkpoint", lambda path: (loads.append(path), real_load(path))[1])
    typed = "ROMEO:\n\nJULIET:\\nO\n"
    args = ["--ckpt", tiny_run, "--max-new-tokens", 15, "--seed", 4]
    monkeypatch.setattr(sys, "stdin", io.StringIO(typed))
    code, out, err = cli(capsys, *args, "--interactive", "--prompt", "ROMEO:")
    assert code == 0 and len(loads) == 1
    assert err.count("tokens generated") == 3  # --prompt, then two lines; the empty line was skipped

    first = cli(capsys, *args, "--prompt", "ROMEO:")[1]
    assert out.startswith(first)  # the first answer is what a one-off run prints
    second, third = out[len(first) :].split("JULIET:\nO")  # `\n` typed is a line break
    assert second.startswith("ROMEO:") and second != first  # the same prompt again: a new sample
    assert third

    monkeypatch.setattr(sys, "stdin", io.StringIO(typed))
    assert cli(capsys, *args, "--interactive", "--prompt", "ROMEO:")[1] == out  # the session repeats


# ---- prompts that are not text, and what a terminal shows ------------------------------------------------


def generate_process(*args, stdin: bytes | None = None, cwd=None):
    """generate.py run as a user runs it, with bytes in and out (prompts may be any bytes)."""
    return subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), *args], input=stdin, capture_output=True, cwd=cwd, timeout=300
    )


def test_generate_py_refuses_a_prompt_that_is_not_utf8_in_one_line(tiny_run, tmp_path):
    proc = generate_process("--ckpt", str(tiny_run), "--prompt", b"ROMEO\xff:", cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == b""
    assert proc.stderr.decode() == (
        "error: the prompt is not valid UTF-8: byte(s) 0xff at character 6; save or type it as UTF-8 text\n"
    )


def test_interactive_refuses_a_line_that_is_not_utf8_and_answers_the_next(tiny_run, tmp_path):
    typed = b"ROM\xe9O:\nJULIET:\n"  # the first line is Latin-1, not UTF-8
    proc = generate_process(
        "--ckpt", str(tiny_run), "--interactive", "--max-new-tokens", "8", stdin=typed, cwd=tmp_path
    )
    assert proc.returncode == 0
    err = proc.stderr.decode().splitlines()
    assert err[0] == "error: the prompt is not valid UTF-8: byte(s) 0xe9 at character 4; save or type it as UTF-8 text"
    assert len(err) == 2 and "tokens generated" in err[1]
    assert proc.stdout.decode().startswith("JULIET:")


def test_interactive_batch_after_a_refused_line_names_the_seeds_it_repeats(tiny_run, tmp_path):
    """A refused line draws nothing: the first batch answered is a one-off run's, headers and all."""
    args = ["--ckpt", str(tiny_run), "--num-samples", "2", "--max-new-tokens", "8"]
    one_off = generate_process(*args, "--prompt", "ROMEO:", cwd=tmp_path)
    session = generate_process(*args, "--interactive", stdin=b"ROM\xe9O:\nROMEO:\n", cwd=tmp_path)
    assert session.returncode == one_off.returncode == 0
    assert session.stdout == one_off.stdout and b"(seed 1338)" in one_off.stdout


def test_interactive_prompts_from_a_file_that_starts_with_a_byte_order_mark(tiny_run, tmp_path):
    """A file saved as "UTF-8 with BOM" (Windows editors): the mark is not part of the first prompt."""
    args = ["--ckpt", str(tiny_run), "--max-new-tokens", "8"]
    one_off = generate_process(*args, "--prompt", "ROMEO:", cwd=tmp_path)
    session = generate_process(*args, "--interactive", stdin="\ufeffROMEO:\r\n".encode(), cwd=tmp_path)
    assert session.returncode == one_off.returncode == 0
    assert session.stdout == one_off.stdout


def test_interactive_with_stdin_closed_answers_the_prompt_and_ends(tiny_run, tmp_path):
    """As `<&-` starts it: Python has no sys.stdin at all, which reads as an empty input."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "generate.py"), "--ckpt", str(tiny_run), "--interactive", "--prompt", "ROMEO:"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        preexec_fn=lambda: os.close(0),
    )
    assert proc.returncode == 0 and proc.stdout.startswith("ROMEO:"), proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("tokens generated") == 1


def test_the_summary_starts_a_line_of_its_own_in_a_terminal(tiny_run, tmp_path):
    """In a terminal stdout and stderr share the screen: the summary must not follow the last word."""
    for stop in ([], ["--stop", "e"]):  # a sample that runs to its length, and one cut by a stop string
        args = ["--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--max-new-tokens", "12", *stop]
        status, screen = run_in_terminal("generate.py", *args, cwd=tmp_path, timeout=300)
        assert status == 0, screen
        lines = screen.replace("\r\n", "\n").split("\n")
        summary = [line for line in lines if "tokens generated" in line]
        assert len(summary) == 1 and summary[0].startswith("["), screen


def test_control_characters_are_shown_escaped_in_a_terminal_and_kept_in_a_pipe(tiny_run, tmp_path):
    """A byte-level model may write ESC or backspace as any other byte: a terminal shows them as
    \\x1b, \\x08 rather than obeying them; a file or a pipe gets the text as it is."""
    args = ["--ckpt", str(tiny_run), "--prompt", "ROMEO:\x1b[2J\x08\tO", "--max-new-tokens", "30"]
    status, screen = run_in_terminal("generate.py", *args, cwd=tmp_path, timeout=300)
    assert status == 0 and screen.startswith("ROMEO:\\x1b[2J\\x08\tO"), screen
    assert not any(c in screen for c in "\x1b\x08"), screen
    assert generate_process(*args, cwd=tmp_path).stdout.startswith(b"ROMEO:\x1b[2J\x08\tO")


def test_training_samples_are_what_generate_py_writes_with_the_same_settings(tiny_run, tiny_gpt, capsys):
    """The samples written during training and generate.py go through one session: same encoding,
    same stop at <|endoftext|>, same text for the same seed."""
    from checkpoint import load_checkpoint
    from training.callbacks import TextSamples

    loaded = load_checkpoint(tiny_run)
    samples = TextSamples(
        tiny_run / "unused.md", loaded.tokenizer_json, ["ROMEO:"], max_new_tokens=30, temperature=0.9, top_k=20, seed=11
    )
    written = samples.generate(loaded.model, "ROMEO:")
    code, out, _ = cli(
        capsys,
        "--ckpt",
        tiny_run,
        "--prompt",
        "ROMEO:",
        "--max-new-tokens",
        30,
        "--temperature",
        0.9,
        "--top-k",
        20,
        "--seed",
        11,
    )
    assert code == 0 and out == written + "\n"
