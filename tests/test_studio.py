"""The studio's server (studio.py, web/): its API against a model trained here, checked against the
model's own functions; the OpenAI-format endpoint through the official client; every bad request; and
studio.py started as a user starts it."""

from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

import explain
from checkpoint import load_checkpoint, read_loss_history
from generation.lens import head_scores, induction_targets
from generation.session import Sampling, Session
from generation.text import BYTE_LEVEL_ALPHABET
from tests.common import TINY_OVERRIDES, one_error_line, run_script, start_script, train_here
from web.requests import Limits
from web.server import PICTURE_CELLS, make_app, pictures


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, small_text):
    """A run folder of a tiny model trained by train.py's command line (in this process), with its samples and
    loss curve."""
    run = tmp_path_factory.mktemp("studio") / "run"
    overrides = [*TINY_OVERRIDES, "data=text", f"data.path={small_text}", "trainer.max_steps=9"]
    done = train_here(*overrides, f"hydra.run.dir={run}", cwd=run.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    return run


@pytest.fixture(scope="module")
def loaded(tiny_run):
    """A tiny model fitted in this process (tests/tiny.py): seconds, where a train.py run takes longer."""
    return load_checkpoint(tiny_run)


@pytest.fixture(scope="module")
def client(loaded):
    with TestClient(make_app(loaded)) as client:
        yield client


def sse(body: str) -> list[tuple[str, dict]]:
    """Server-sent events as (name, data)."""
    found = []
    for block in body.strip().split("\n\n"):
        name = re.search(r"^event: (.*)$", block, re.M)
        data = re.search(r"^data: (.*)$", block, re.M).group(1)
        found.append((name.group(1) if name else "message", data if data == "[DONE]" else json.loads(data)))
    return found


def talk(client, **body) -> list[tuple[str, dict]]:
    response = client.post("/api/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    return sse(response.text)


# ---- talk -------------------------------------------------------------------------------------------


def test_tokens_stream_with_the_models_own_probabilities_and_alternatives(client, loaded):
    events = talk(client, prompt="ROMEO:", max_new_tokens=12, temperature=1.0, seed=5)
    names = [name for name, _ in events]
    assert names[0] == "prompt" and names[-1] == "done" and set(names[1:-1]) == {"token"}
    session = Session(loaded.model, loaded.tokenizer, loaded.eos_token_id)
    ids = [i for i, _ in events[0][1]["tokens"]]
    assert ids == session.encode("ROMEO:")
    for _, token in events[1:-1]:
        with torch.no_grad():
            logits = loaded.model.last_logits(torch.tensor([ids]))[0]  # no cache: the model's own forward
        probs = torch.softmax(logits, dim=-1)
        assert token["prob"] == pytest.approx(probs[token["id"]].item(), abs=1e-5)
        alternatives = token["alternatives"]
        assert len(alternatives) == 10 and token["id"] not in [i for i, _, _ in alternatives]
        expected = [i for i in torch.topk(probs, 11).indices.tolist() if i != token["id"]][:10]
        assert [i for i, _, _ in alternatives] == expected
        for i, _, p in alternatives:
            assert p == pytest.approx(probs[i].item(), abs=1e-5)
        assert token["prob"] + sum(p for _, _, p in alternatives) <= 1 + 1e-5
        ids.append(token["id"])
    done = events[-1][1]
    assert done["tokens"] == len(events) - 2 and done["finish_reason"] in ("length", "stop")


def test_the_streamed_text_is_what_generate_writes_with_the_same_seed(client, loaded):
    events = talk(client, prompt="ROMEO:", max_new_tokens=30, temperature=0.9, top_k=20, top_p=0.95, seed=11)
    streamed = "".join(data["text"] for name, data in events if name == "token")
    session = Session(loaded.model, loaded.tokenizer, loaded.eos_token_id)
    generator = torch.Generator().manual_seed(11)
    expected = session.complete("ROMEO:", Sampling(30, 0.9, 20, 0.95), 1, [generator]).texts[0]
    assert streamed == expected
    again = talk(client, prompt="ROMEO:", max_new_tokens=30, temperature=0.9, top_k=20, top_p=0.95, seed=11)
    assert [d for n, d in again if n == "token"] == [d for n, d in events if n == "token"]


def test_greedy_talk_ends_at_the_length_asked(client):
    events = talk(client, prompt="The", max_new_tokens=5, temperature=0, seed=0)
    tokens = [d for n, d in events if n == "token"]
    assert len(tokens) <= 5 and events[-1][1]["tokens"] == len(tokens)


# ---- attention, logit lens, walk-through --------------------------------------------------------------


def prompt_ids(loaded, text="ROMEO: what, ho! ROMEO: what"):
    return Session(loaded.model, loaded.tokenizer, loaded.eos_token_id).encode(text)


def test_attention_weights_are_the_models_own(client, loaded):
    ids = prompt_ids(loaded)
    weights = loaded.model.attention_weights(torch.tensor([ids]))
    for layer in range(loaded.model.config.n_layer):
        for head in range(loaded.model.config.n_head):
            data = client.post("/api/attention", json={"ids": ids, "layer": layer, "head": head}).json()
            assert data["ids"] == ids and len(data["labels"]) == len(ids)
            got = torch.tensor(data["weights"])  # (T, T)
            assert got.shape == weights[layer][0, head].shape
            assert torch.allclose(got, weights[layer][0, head], atol=1e-4)
            assert torch.allclose(torch.tensor(data["heads"]), weights[layer][0], atol=1e-4)  # T <= 96: in full
            assert len(data["scores"]) == loaded.model.config.n_layer
            assert len(data["scores"][layer]) == loaded.model.config.n_head


def test_the_pictures_of_a_long_text_s_heads_keep_each_block_s_largest_weight():
    weights = torch.rand(3, 250, 250).tril()  # (nh, T, T)
    weights[1] = torch.eye(250)  # a head that looks at its own token: one thin line
    small = pictures(weights)
    assert small.shape == (3, PICTURE_CELLS, PICTURE_CELLS)
    assert torch.equal(small[1].diagonal(), torch.ones(PICTURE_CELLS))  # the line is still drawn
    # a cell stands for the rows and columns floor(i * T / S) to ceil((i + 1) * T / S)
    i, j = 40, 17
    rows, cols = slice(i * 250 // 96, -(-(i + 1) * 250 // 96)), slice(j * 250 // 96, -(-(j + 1) * 250 // 96))
    assert small[0, i, j] == weights[0, rows, cols].max()
    assert torch.equal(pictures(weights[:, :96, :96]), weights[:, :96, :96])  # short texts are sent whole


def test_a_sequence_longer_than_the_context_is_seen_through_its_last_window(client, loaded):
    ids = (prompt_ids(loaded) * 20)[:70]
    block = loaded.model.config.block_size
    data = client.post("/api/attention", json={"ids": ids, "layer": 0}).json()
    assert data["ids"] == ids[-block:]
    assert torch.tensor(data["weights"]).shape == (block, block)


def test_heads_are_scored_and_labelled_by_where_they_look():
    T = 12
    ids = [
        5,
        6,
        7,
        8,
        9,
        10,
        5,
        6,
        7,
        8,
        9,
        10,
    ]  # a repeat: an induction head looks at the token after the earlier copy
    previous = torch.zeros(T, T)
    previous[0, 0] = 1
    previous[torch.arange(1, T), torch.arange(0, T - 1)] = 1
    first = torch.zeros(T, T)
    first[:, 0] = 1
    targets = induction_targets(ids).float()
    induction = torch.where(
        targets.sum(-1, keepdim=True) > 0, targets / targets.sum(-1, keepdim=True).clamp(min=1), first
    )
    uniform = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    scores = head_scores([torch.stack([previous, first, induction, uniform])], ids)[0]
    assert [s.kind for s in scores] == ["previous-token", "first-token", "induction", None]
    assert scores[0].previous == pytest.approx(1.0) and scores[1].first == pytest.approx(1.0)
    assert scores[2].induction == pytest.approx(1.0) and scores[3].induction < 0.4
    assert induction_targets([1, 2, 1])[2].tolist() == [False, True, False]  # token 1 came at 0: look at 1
    no_repeats = head_scores([torch.stack([previous])], list(range(T)))[0][0]
    assert no_repeats.induction is None and no_repeats.kind == "previous-token"


def test_the_logit_lens_ends_at_the_models_own_prediction(client, loaded):
    ids = prompt_ids(loaded)
    data = client.post("/api/lens", json={"ids": ids}).json()
    n_layer = loaded.model.config.n_layer
    assert len(data["top"]) == n_layer + 1 and all(len(layer) == len(ids) for layer in data["top"])
    with torch.no_grad():
        logits, _ = loaded.model(torch.tensor([ids]))
    probs = torch.softmax(logits[0], dim=-1)  # (T, vocab)
    for position, top in enumerate(data["top"][-1]):
        best = torch.topk(probs[position], 3)
        assert [t for t, _, _ in top] == best.indices.tolist()
        assert [p for _, _, p in top] == pytest.approx(best.values.tolist(), abs=1e-5)
    for position, layer in enumerate(data["first_layer"]):
        final = data["top"][-1][position][0][0]
        assert data["top"][layer][position][0][0] == final
        assert all(data["top"][earlier][position][0][0] != final for earlier in range(layer))


def test_the_walk_through_is_explain_py_json(client, loaded, tiny_run, capsys):
    ids = prompt_ids(loaded, "ROMEO:")
    page = client.post("/api/explain", json={"ids": ids, "layer": 1, "head": 1}).json()
    assert explain.main(["--json", "--ckpt", str(tiny_run), "--prompt", "ROMEO:", "--layer", "1", "--head", "1"]) == 0
    printed = json.loads(capsys.readouterr().out)
    for key in ("checkpoint", "prompt_tokens"):
        printed.pop(key)
    assert page == printed


# ---- how it learned ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_history_holds_the_runs_loss_curves_and_its_samples(trained_run):
    with TestClient(make_app(load_checkpoint(trained_run))) as client:
        data = client.get("/api/history").json()
    kept = read_loss_history(trained_run / "checkpoints" / "last.ckpt")
    assert data["train"] == kept["train"] and data["val"] == kept["val"]
    assert len(data["train"]) == 9 and len(data["val"]) == 3
    written = (trained_run / "samples.md").read_text(encoding="utf-8")
    assert [s["step"] for s in data["samples"]] == [int(s) for s in re.findall(r"^## step (\d+),", written, re.M)]
    for sample in data["samples"]:
        assert f"```\n{sample['text']}\n```" in written


# ---- what it copied -----------------------------------------------------------------------------------


def ready_copies(client) -> dict:
    for _ in range(600):
        state = client.get("/api/info").json()["copies"]
        if state["state"] != "building":
            return state
        time.sleep(0.1)
    raise AssertionError("the copy index was not built in a minute")


@pytest.mark.slow
def test_copied_text_is_found_where_it_is_in_the_training_text_however_the_model_spelled_it(trained_run, small_text):
    loaded = load_checkpoint(trained_run)
    text = small_text.read_text(encoding="utf-8")
    passage = text[1000:1300]
    with TestClient(make_app(loaded)) as client:
        assert ready_copies(client)["state"] == "ready"
        canonical = loaded.tokenizer.encode(passage).ids
        byte_tokens = {byte: char for char, byte in BYTE_LEVEL_ALPHABET.items()}
        letters = [loaded.tokenizer.token_to_id(byte_tokens[b]) for b in passage.encode()]  # one token a byte
        assert None not in letters and len(letters) > len(canonical)
        for ids in (canonical, letters):
            found = client.post("/api/copies", json={"ids": ids, "min_tokens": 8}).json()
            longest = max(found["spans"], key=lambda span: span["end"] - span["start"])
            assert len(longest["text"]) > 250 and longest["text"] in passage
            assert text[longest["char_offset"] :].startswith(longest["text"])
            assert longest["line"] == text[: longest["char_offset"]].count("\n") + 1
            assert Path(longest["file"]) == small_text.resolve() and longest["documents_in_file"] == 1
            assert longest["line_in_document"] == longest["line"]  # the file's line: it is one document
            shown = "".join(loaded.tokenizer.decode([i]) for i in ids[longest["start"] : longest["end"]])
            assert longest["text"] in shown
        nothing = client.post("/api/copies", json={"ids": canonical[::-1], "min_tokens": 30}).json()
        assert nothing["spans"] == []


def test_a_model_without_a_known_training_text_says_so(client):
    state = client.get("/api/info").json()["copies"]
    assert state["state"] == "none" and "no training text is known" in state["reason"]
    refused = client.post("/api/copies", json={"ids": [1, 2, 3]})
    assert refused.status_code == 409 and "no training text is known" in refused.json()["error"]["message"]


# ---- the OpenAI format --------------------------------------------------------------------------------


def test_the_openai_client_gets_completions_in_its_own_format(client, loaded):
    openai = pytest.importorskip("openai")
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    answer = api.completions.create(model="any", prompt="ROMEO:", max_tokens=8, temperature=0, logprobs=2)
    choice = answer.choices[0]
    assert answer.object == "text_completion" and choice.finish_reason in ("length", "stop")
    assert answer.usage.prompt_tokens == len(prompt_ids(loaded, "ROMEO:"))
    assert answer.usage.completion_tokens == len(choice.logprobs.tokens) <= 8
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    assert not any(token.startswith("bytes:") for token in choice.logprobs.tokens)  # greedy: whole characters
    chunks = api.completions.create(model="any", prompt="ROMEO:", max_tokens=8, temperature=0, stream=True)
    streamed = list(chunks)
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert streamed[-1].choices[0].finish_reason == choice.finish_reason


def test_text_offsets_point_into_the_text_where_a_token_holds_part_of_a_character(client, loaded):
    byte_tokens = {byte: char for char, byte in BYTE_LEVEL_ALPHABET.items()}
    text = "né🙂 ok"
    ids = [loaded.tokenizer.token_to_id(byte_tokens[b]) for b in text.encode()]  # a token a byte
    body = {"prompt": ids, "max_tokens": 6, "echo": True, "logprobs": 0, "temperature": 0}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    offsets = choice["logprobs"]["text_offset"]
    assert choice["text"].startswith(text) and len(offsets) == len(ids) + 6
    # a byte's token begins at the character it is part of: the characters whole before it
    assert offsets[: len(ids)] == [len(text.encode()[:k].decode("utf-8", "ignore")) for k in range(len(ids))]
    assert offsets[len(ids)] == len(text) and offsets == sorted(offsets) and offsets[-1] <= len(choice["text"])


def test_a_streamed_answer_carries_the_same_logprobs_chunk_by_chunk(client):
    body = {"prompt": ["ROMEO:", "JULIET:"], "n": 2, "max_tokens": 12, "temperature": 1.0, "seed": 5, "logprobs": 3}
    whole = client.post("/v1/completions", json=body).json()
    streamed = client.post("/v1/completions", json=body | {"stream": True}).text
    chunks = [json.loads(line[6:])["choices"][0] for line in streamed.splitlines() if line.startswith("data: {")]
    assert len(whole["choices"]) == 4
    for choice in whole["choices"]:
        mine = [c for c in chunks if c["index"] == choice["index"]]
        assert "".join(c["text"] for c in mine) == choice["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert sum((c["logprobs"][key] for c in mine), []) == choice["logprobs"][key], key
        assert [c["finish_reason"] for c in mine][-1] == choice["finish_reason"]
        assert all(c["finish_reason"] is None for c in mine[:-1])


def test_echo_with_logprobs_scores_the_prompt_as_the_model_does(client, loaded):
    ids = prompt_ids(loaded)
    body = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
    logprobs = body["choices"][0]["logprobs"]
    with torch.no_grad():
        logits, _ = loaded.model(torch.tensor([ids]))
    expected = torch.log_softmax(logits[0, :-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected.tolist(), abs=1e-5)
    assert body["choices"][0]["text"] == loaded.tokenizer.decode(ids)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}


def test_several_prompts_and_n_give_each_choice_its_index_and_seed(client):
    body = {"prompt": ["ROMEO:", "JULIET:"], "n": 2, "max_tokens": 6, "seed": 9, "temperature": 1.0}
    choices = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    again = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in again] == [c["text"] for c in choices]


def test_a_stop_string_ends_the_text_before_it(client):
    free = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 40, "seed": 2}).json()
    text = free["choices"][0]["text"]
    if len(text) < 4:
        pytest.skip("the sample is too short to cut")
    stop = text[2:4]
    cut = client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 40, "seed": 2, "stop": stop}).json()
    assert cut["choices"][0]["text"] == text[: text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


# The bodies lm-evaluation-harness 0.4.13's `local-completions` model sends, a batch of prompts at a time:
# to score a continuation it asks for one new token and sums token_logprobs[len(context):-1]; to generate,
# it sends a task's `until` strings and the tokenizer's <|endoftext|> as `stop`.
LM_EVAL_SCORE = {"model": "tinygpt2", "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
LM_EVAL_GENERATE = {"model": "tinygpt2", "max_tokens": 12, "temperature": 0, "seed": 1234}


def test_lm_eval_scores_a_continuation_as_the_model_does_even_where_the_model_would_end_the_text(loaded):
    ids, context = prompt_ids(loaded), 3
    with torch.no_grad():
        logprobs = torch.log_softmax(loaded.model(torch.tensor([ids]))[0][0], dim=-1)  # (T, vocab)
    expected = sum(logprobs[i - 1, ids[i]].item() for i in range(context, len(ids)))
    app = make_app(loaded)
    app.state.studio.session.eot = logprobs[-1].argmax().item()  # the token the model would write next ends the text
    with TestClient(app) as client:
        body = client.post("/v1/completions", json=LM_EVAL_SCORE | {"prompt": [ids, ids]}).json()
    for choice in body["choices"]:
        assert choice["finish_reason"] == "stop" and len(choice["logprobs"]["token_logprobs"]) == len(ids) + 1
        assert sum(choice["logprobs"]["token_logprobs"][context:-1]) == pytest.approx(expected, abs=1e-4)
        assert choice["text"] == loaded.tokenizer.decode(ids)
    assert body["usage"]["completion_tokens"] == 2


def test_lm_eval_generates_for_a_batch_of_prompts_with_its_stop_strings(client, loaded):
    stops = ["\n", ".", ",", ";", "!", "<|endoftext|>"]
    prompts = [prompt_ids(loaded)] * 16
    answer = client.post("/v1/completions", json=LM_EVAL_GENERATE | {"prompt": prompts, "stop": stops})
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert [c["index"] for c in choices] == list(range(16)) and len({c["text"] for c in choices}) == 1
    assert not any(stop in choices[0]["text"] for stop in stops)


BAD_REQUESTS = [
    ({"prompt": 3}, "prompt"),
    ({"prompt": [[1, 2], "x"]}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [-1]}, "prompt"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": 100}, "n"),
    ({"logprobs": 1000}, "logprobs"),
    ({"stop": ["", "a"]}, "stop"),
    ({"stop": [str(i) for i in range(Limits.max_stops + 1)]}, "stop"),
    ({"seed": -5}, "seed"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "x"}, "suffix"),
    ({"stream": True, "echo": True}, "echo"),
    ({"prompt": "x" * 100_001}, "prompt"),
    ({"prompt": ["a"] * (Limits.max_choices + 1)}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
def test_a_bad_completion_request_gets_a_4xx_naming_the_field(client, body, param):
    response = client.post("/v1/completions", json=body)
    assert 400 <= response.status_code < 500
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param) and "\n" not in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/api/generate", {"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ("/api/generate", {"prompt": "x", "top_k": 0}, "top_k"),
        ("/api/generate", {"prompt": "\udcff"}, "prompt"),  # bytes that are not UTF-8, sent raw
        ("/api/attention", {"ids": []}, "ids"),
        ("/api/attention", {"ids": [1], "layer": 99}, "layer"),
        ("/api/attention", {"ids": [1], "head": 99}, "head"),
        ("/api/attention", {"ids": [1], "head": -1}, "head"),
        ("/api/lens", {"ids": [1], "layer": 0}, "layer"),
        ("/api/attention", {"ids": [10**9]}, "ids"),
        ("/api/lens", {"ids": ["a"]}, "ids"),
        ("/api/explain", {"ids": [1, 2], "head": 99}, "head"),
        ("/api/copies", {"ids": [1], "min_tokens": 0}, "min_tokens"),
    ],
)
def test_a_bad_page_request_gets_a_4xx_naming_the_field(client, path, body, param):
    if path == "/api/generate" and param == "prompt":
        response = client.post(
            path,
            content=json.dumps(body).encode("utf-8", "surrogatepass"),
            headers={"content-type": "application/json"},
        )
    else:
        response = client.post(path, json=body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["param"] == param


def test_bodies_that_are_not_requests_are_refused_and_the_server_goes_on(client):
    headers = {"content-type": "application/json"}
    assert client.post("/v1/completions", content=b"{nope", headers=headers).status_code == 400
    assert client.post("/v1/completions", content=b"[1, 2]", headers=headers).status_code == 400
    assert (
        client.post("/v1/completions", content=b"x" * (Limits.max_body_bytes + 1), headers=headers).status_code == 413
    )
    assert client.post("/v1/completions", content=b"\xff\xfe", headers=headers).status_code == 400
    for path in (
        "/static/../checkpoint.py",
        "/static/%2e%2e/%2e%2e/checkpoint.py",
        "/etc/passwd",
        "/static/..%2fstudio.py",
    ):
        response = client.get(path)
        assert response.status_code == 404 and "import" not in response.text
    assert client.post("/v1/completions", json={"prompt": "ROMEO:", "max_tokens": 2}).status_code == 200


# ---- studio.py as a user runs it ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_studio_py_serves_the_page_and_the_api_until_ctrl_c(trained_run, tmp_path):
    studio = start_script(
        "studio.py",
        "--ckpt",
        str(trained_run),
        "--port",
        "0",
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        line = studio.stdout.readline()
        address = re.search(r"http://127\.0\.0\.1:\d+", line).group(0)
        page = urllib.request.urlopen(address + "/", timeout=30).read().decode()
        assert "tinygpt2 studio" in page and "/static/studio.js" in page
        for asset in ("/static/studio.js", "/static/studio.css"):
            assert urllib.request.urlopen(address + asset, timeout=30).status == 200
        request = urllib.request.Request(
            address + "/v1/completions", data=json.dumps({"prompt": "ROMEO:", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        body = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert body["object"] == "text_completion"
        # a client that leaves a long stream part way frees the model for the next one at once
        port = int(address.rsplit(":", 1)[1])
        leaving = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        leaving.request(
            "POST",
            "/api/generate",
            json.dumps({"prompt": "ROMEO:", "max_new_tokens": 2048}),
            {"Content-Type": "application/json"},
        )
        assert leaving.getresponse().read(500)
        leaving.close()
        started = time.monotonic()
        lens = urllib.request.Request(
            address + "/api/lens", data=b'{"ids": [1, 2, 3]}', headers={"Content-Type": "application/json"}
        )
        assert urllib.request.urlopen(lens, timeout=60).status == 200
        assert time.monotonic() - started < 10
    finally:
        studio.send_signal(signal.SIGINT)
        out, err = studio.communicate(timeout=60)
    assert studio.returncode == -signal.SIGINT, err  # stopped as Ctrl-C stops a program: a shell says 130
    assert "warning" not in err and "Traceback" not in err


@pytest.mark.slow
def test_studio_py_says_in_one_line_what_is_wrong(tiny_run, tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        done = run_script("studio.py", "--ckpt", str(tiny_run), "--port", str(port), cwd=tmp_path)
        assert done.returncode == 1 and f"127.0.0.1:{port}" in one_error_line(done.stderr)
    finally:
        taken.close()
    for args, words in [
        (["--ckpt", str(tmp_path / "nothing")], "does not exist"),
        (["--port", "70000"], "--port 70000"),
        (["--host", "no.such.host.invalid"], "--host"),
    ]:
        done = run_script("studio.py", *args, cwd=tmp_path)
        assert done.returncode == 1 and words in one_error_line(done.stderr), done.stderr


@pytest.mark.slow
def test_listening_beyond_this_machine_is_warned_of(tiny_run, tmp_path):
    studio = start_script(
        "studio.py", "--ckpt", str(tiny_run), "--host", "0.0.0.0", "--port", str(free_port()),
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert studio.stdout.readline().startswith("studio: http://0.0.0.0:")
    finally:
        studio.send_signal(signal.SIGINT)
        _, err = studio.communicate(timeout=60)
    assert "warning: listening on 0.0.0.0" in err and studio.returncode == -signal.SIGINT
