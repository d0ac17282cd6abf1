"""The processed distributions of flywheel.sampling against hand-computed values, one knob at a time
and in vLLM's order; the applied parameters (client, model defaults, OpenAI) and the knobs refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from flywheel.logprobs import history, processed_logprobs
from flywheel.sampling import Processing, applied, generation_defaults, unsupported_knobs

LN = math.log


def lp(logits: list[float], p: Processing, **kw) -> list[float]:
    return processed_logprobs(torch.tensor([logits]), p, **kw)[0].tolist()


def softmax_log(xs: list[float]) -> list[float]:
    finite = [x for x in xs if x != -math.inf]
    z = LN(sum(math.exp(x) for x in finite))
    return [x - z if x != -math.inf else -math.inf for x in xs]


def close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w == -math.inf:
            assert g == -math.inf
        else:
            assert g == pytest.approx(w, abs=1e-6)


# Probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1.
BASE = [LN(4), LN(2), 0.0, 0.0]


def test_neutral_is_the_model_distribution() -> None:
    close(lp(BASE, Processing()), [LN(0.5), LN(0.25), LN(0.125), LN(0.125)])


def test_temperature_divides_the_logits() -> None:
    # At T = 0.5 the logits double: 4 ln 2, 2 ln 2, 0, 0 -> weights 16, 4, 1, 1 out of 22.
    close(lp(BASE, Processing(temperature=0.5)), [LN(16 / 22), LN(4 / 22), LN(1 / 22), LN(1 / 22)])


def test_top_p_keeps_the_smallest_head_reaching_p() -> None:
    # 0.5 alone has less than 0.7; 0.5 + 0.25 reaches it: the head {0, 1} renormalised to 2/3, 1/3.
    close(lp(BASE, Processing(top_p=0.7)), [LN(2 / 3), LN(1 / 3), -math.inf, -math.inf])
    # p = 0.5: the most likely token holds exactly the mass; vLLM drops what lies at or below 1 - p.
    close(lp(BASE, Processing(top_p=0.5)), [0.0, -math.inf, -math.inf, -math.inf])


def test_top_k_keeps_ties_with_the_kth() -> None:
    close(lp(BASE, Processing(top_k=1)), [0.0, -math.inf, -math.inf, -math.inf])
    # k = 3: the third value (0.0) is shared by tokens 2 and 3; both stay, as in vLLM.
    close(lp(BASE, Processing(top_k=3)), softmax_log(BASE))
    close(lp(BASE, Processing(top_k=2)), [LN(2 / 3), LN(1 / 3), -math.inf, -math.inf])
    close(lp(BASE, Processing(top_k=0)), softmax_log(BASE))  # 0 is off


def test_min_p_drops_below_a_fraction_of_the_top() -> None:
    # Threshold 0.3 x 0.5 = 0.15: 0.125 goes, 0.25 stays.
    close(lp(BASE, Processing(min_p=0.3)), [LN(2 / 3), LN(1 / 3), -math.inf, -math.inf])
    # After temperature: at T = 0.5 probabilities are 16/22, 4/22, 1/22, 1/22; 0.2 x 16/22 = 3.2/22 keeps token 1.
    close(lp(BASE, Processing(temperature=0.5, min_p=0.2)), [LN(0.8), LN(0.2), -math.inf, -math.inf])


def test_logit_bias_adds_before_everything() -> None:
    # +ln 2 on token 3: weights 4, 2, 1, 2 out of 9.
    close(lp(BASE, Processing(logit_bias=((3, LN(2)),))), [LN(4 / 9), LN(2 / 9), LN(1 / 9), LN(2 / 9)])


def test_penalties_follow_vllm_and_openai() -> None:
    logits = [2.0, -1.0, 0.5, 0.0]
    prompt = [1]  # token 1 seen in the prompt only
    output = torch.tensor([2, 2])  # position 0 sees nothing of the output; position 1 sees token 2 once
    seen, counts = history(prompt, output, 4)
    assert seen.tolist() == [[False, True, False, False], [False, True, True, False]]
    assert counts.tolist() == [[0, 0, 0, 0], [0, 0, 1, 0]]
    rows = torch.tensor([logits, logits])
    p = Processing(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    out = processed_logprobs(rows, p, seen=seen, output_counts=counts).tolist()
    # Row 0: token 1 (negative, seen in the prompt) x 2 -> -2; no output yet, no frequency/presence.
    close(out[0], softmax_log([2.0, -2.0, 0.5, 0.0]))
    # Row 1: token 2 (positive, seen) / 2 -> 0.25, then - 0.5 x 1 - 0.25 -> -0.5.
    close(out[1], softmax_log([2.0, -2.0, -0.5, 0.0]))
    with pytest.raises(ValueError):
        processed_logprobs(rows, p)


def test_order_is_bias_penalties_temperature_min_p_top_k_top_p() -> None:
    logits = [1.0, 1.0, 0.0, -1.0]
    seen, counts = history([0], torch.tensor([3]), 4)
    p = Processing(temperature=0.5, top_k=3, top_p=0.9, min_p=0.01, repetition_penalty=2.0, logit_bias=((2, 1.0),))
    # bias: [1, 1, 1, -1]; repetition on token 0 (positive): 0.5 -> [0.5, 1, 1, -1]; T 0.5: [1, 2, 2, -2];
    # min-p keeps all (e^-4 / e^0 > 0.01 ... e^-2-2 = e^-4 = 0.018 of the top); top-k 3 drops token 3;
    # top-p 0.9 over e^1, e^2, e^2 = 0.1554, 0.4223, 0.4223: the least likely holds 0.1554 > 0.1, kept.
    close(processed_logprobs(torch.tensor([logits]), p, seen=seen, output_counts=counts)[0].tolist(),
          softmax_log([1.0, 2.0, 2.0, -math.inf]))


def test_greedy_is_the_biased_penalised_distribution_without_temperature() -> None:
    p = Processing(temperature=0.0, top_k=1, logit_bias=((1, 1.0),))
    close(lp([1.0, 0.5, 0.0], p), softmax_log([1.0, 1.5, 0.0]))
    assert p.greedy and Processing(temperature=1e-6).greedy and not Processing(temperature=1e-5).greedy


def test_processed_logprobs_carry_gradients_to_the_kept_logits() -> None:
    logits = torch.tensor([BASE], requires_grad=True)
    out = processed_logprobs(logits, Processing(temperature=0.5, top_k=2))
    out[0, 0].backward()
    grad = logits.grad[0].tolist()
    # log softmax over the kept pair {0, 1} at T = 0.5 (probabilities 0.8 and 0.2): d/dl_0 = (1 - 0.8) / 0.5,
    # d/dl_1 = -0.2 / 0.5, and nothing flows to the dropped tokens.
    assert grad == pytest.approx([0.4, -0.4, 0.0, 0.0], abs=1e-6)


def test_applied_takes_the_client_then_the_model_then_openai(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "do_sample": True, "max_new_tokens": 64, "bos_token_id": 1}))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "max_tokens": 64}
    assert generation_defaults(tmp_path / "nowhere") == {}
    got = applied({"temperature": 1.0, "presence_penalty": 0.5, "logit_bias": {"7": -100}}, defaults)
    assert got["temperature"] == 1.0 and got["top_p"] == 0.95 and got["top_k"] == 20 and got["min_p"] == 0.0
    assert got["presence_penalty"] == 0.5 and got["frequency_penalty"] == 0.0 and got["repetition_penalty"] == 1.0
    assert got["logit_bias"] == {"7": -100.0} and got["max_tokens"] == 64 and got["n"] == 1
    assert applied({"top_k": -1}, {})["top_k"] == 0  # vLLM's "off"
    assert Processing.of(applied({"temperature": 0.7, "logit_bias": {"3": 1}}, {})) == \
        Processing(temperature=0.7, logit_bias=((3, 1.0),))


def test_unsupported_knobs_are_named_and_neutral_values_pass() -> None:
    assert unsupported_knobs({"min_tokens": 0, "ignore_eos": False, "response_format": {"type": "text"},
                              "best_of": 1, "tools": [{}], "tool_choice": "auto"}) == []
    assert unsupported_knobs({"min_tokens": 3, "response_format": {"type": "json_object"},
                              "tools": [{}], "tool_choice": "required", "bad_words": ["x"]}) == \
        ["bad_words", "min_tokens", "response_format", "tool_choice"]
