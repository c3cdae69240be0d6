"""Sampling: which tokens each option keeps, temperature, seeds, and per-row generators."""

from __future__ import annotations

import math

import pytest
import torch

from generation.sampling import check_sampling, draw, keep_top_k, keep_top_p, probabilities, sample


def kept(logits: torch.Tensor) -> set[int]:
    return set(torch.isfinite(logits[0]).nonzero().flatten().tolist())


def log_probs(*probs: float) -> torch.Tensor:
    return torch.tensor([[math.log(p) for p in probs]])


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    assert kept(keep_top_k(logits, 1)) == {1}
    assert kept(keep_top_k(logits, 2)) == {1, 3}
    assert kept(keep_top_k(logits, 3)) == {1, 2, 3}
    assert kept(keep_top_k(logits, 99)) == {0, 1, 2, 3, 4}  # k beyond the vocabulary keeps all
    kept_values = keep_top_k(logits, 2)[0, [1, 3]]
    assert torch.equal(kept_values, torch.tensor([5.0, 4.0]))  # kept logits are unchanged


def test_top_k_works_per_row():
    logits = torch.tensor([[0.0, 1.0, 2.0], [2.0, 1.0, 0.0]])
    out = keep_top_k(logits, 1)
    assert torch.isfinite(out).tolist() == [[False, False, True], [True, False, False]]


@pytest.mark.parametrize(
    "p, expected",
    [
        (0.3, {0}),
        (0.45, {0}),
        (0.6, {0, 1}),
        (0.75, {0, 1}),
        (0.85, {0, 1, 2}),
        (0.99, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    # probabilities 0.5, 0.3, 0.15, 0.05 (shuffled, so order in the vocabulary does not matter)
    logits = log_probs(0.15, 0.5, 0.05, 0.3)
    order = [1, 3, 0, 2]  # the same tokens, most likely first
    assert kept(keep_top_p(logits, p)) == {order[i] for i in expected}


def test_combined_top_k_then_top_p_on_what_is_left():
    logits = log_probs(0.4, 0.3, 0.2, 0.1)
    # top-p alone with 0.75: 0.4 + 0.3 = 0.7 is short of 0.75, so the third token stays
    assert (probabilities(logits, 1.0, top_p=0.75)[0] > 0).tolist() == [True, True, True, False]
    # top-k 3 first renormalises to 4/9, 3/9, 2/9: 7/9 already reaches 0.75, so only two stay
    probs = probabilities(logits, 1.0, top_k=3, top_p=0.75)[0]
    assert (probs > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(probs[:2], torch.tensor([4 / 7, 3 / 7]))


def test_temperature_scales_the_logits():
    logits = torch.tensor([[1.0, 2.0, 4.0]])
    for t in (0.5, 1.0, 2.0):
        torch.testing.assert_close(probabilities(logits, t), torch.softmax(logits / t, dim=-1))
    assert probabilities(logits, 0.1)[0, 2] > 0.99  # cold: nearly greedy
    flat = probabilities(logits, 1000.0)[0]
    assert flat.max() - flat.min() < 0.01  # hot: nearly uniform


def test_temperature_zero_is_argmax_and_ignores_the_generator():
    logits = torch.randn(4, 30)
    for seed in range(3):
        assert torch.equal(sample(logits, 0.0, generator=torch.Generator().manual_seed(seed)), logits.argmax(-1))


def test_draws_only_among_the_kept_tokens():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]]).repeat(400, 1)
    g = torch.Generator().manual_seed(0)
    assert set(sample(logits, 1.0, top_k=2, generator=g).tolist()) == {1, 3}
    # temperature 5 flattens to about 0.29, 0.24, 0.19, ...: the top 0.5 is the first two
    assert set(sample(logits, 5.0, top_p=0.5, generator=g).tolist()) == {1, 3}
    assert set(sample(logits, 1.0, top_k=3, top_p=0.8, generator=g).tolist()) == {1, 3}


def test_same_seed_same_draws_and_rows_draw_independently():
    probs = torch.softmax(torch.randn(3, 50), dim=-1)
    first = [draw(probs, [torch.Generator().manual_seed(10 + i) for i in range(3)]) for _ in range(2)]
    assert torch.equal(first[0], first[1])
    # row i with generator 10 + i draws what it draws alone with that generator
    for i in range(3):
        alone = draw(probs[i : i + 1], [torch.Generator().manual_seed(10 + i)])
        assert alone.item() == first[0][i].item()
    with pytest.raises(ValueError, match="generators"):
        draw(probs, [torch.Generator()])


@pytest.mark.parametrize(
    "args, message",
    [
        ((-0.1, None, None), "temperature"),
        ((float("nan"), None, None), "temperature"),
        ((1.0, 0, None), "top_k"),
        ((1.0, None, 0.0), "top_p"),
        ((1.0, None, 1.5), "top_p"),
    ],
)
def test_bad_sampling_settings_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        check_sampling(*args)


@pytest.mark.parametrize("temperature", [1e-300, 1e-46, 1e-39])
def test_a_temperature_too_small_for_float32_samples_greedily(temperature):
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9]])
    probs = probabilities(logits, temperature)
    assert torch.isfinite(probs).all() and probs.argmax().item() == 1 and probs.max().item() == 1.0
    assert sample(logits, temperature, generator=torch.Generator().manual_seed(0)).item() == 1


def test_token_labels_show_control_characters_escaped():
    from tokenizers import Tokenizer, models, pre_tokenizers

    from generation.text import token_label

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "\x1b[31m": 1, "\r": 2}, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    labels = [token_label(tokenizer, token) for token in range(3)]
    assert all(label.isprintable() for label in labels), labels
    assert labels[1] == "\\x1b[31m"
