"""Sampling-exact training: with identical weights (the served bf16 version loaded into the trainer's
policy), the built-in engine's served logprobs equal the trainer's recomputation of the processed
distribution to 1e-5, over a grid of temperature, top-p, top-k, min-p and repetition penalty.

The path is the production one: ``Engine`` samples, the turn is assembled by ingest
(``build_segments``) from a GenerationEvent carrying the applied sampling, collated by the trainer
(trainer/batch.py), and ``trainer.head.token_logprobs`` recomputes it on the policy's model.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from flywheel import lm
from flywheel.events import GenerationEvent, SamplingParams, ScoredTrajectory
from flywheel.sampling import Processing
from flywheel.settings import TrainerSettings, load_settings
from ingest.assemble import build_segments
from trainer.batch import collate
from trainer.head import token_logprobs
from trainer.policy import Policy

pytestmark = pytest.mark.integration

GRID = list(itertools.product((0.5, 0.7, 1.3), (0.9, 1.0), (0, 20), (0.0, 0.05), (1.0, 1.1)))


@pytest.fixture(scope="module")
def engine_and_policy(tiny_model_dir, tmp_path_factory):
    from serving.node.engine import Engine

    torch.set_num_threads(2)
    settings = load_settings(data_dir=str(tmp_path_factory.mktemp("parity")))
    engine = Engine(tiny_model_dir, settings, version=0, max_batch=64, batch_window_s=0.01)
    model, tokenizer = lm.load_model(tiny_model_dir)
    policy = Policy(copy.deepcopy(model), TrainerSettings())
    policy.load_published(engine.state())  # the served bf16 version, into the trainer's fp32 model
    yield engine, policy.model, tokenizer
    engine.close()


def _event(prompt: list[int], completion, sampling: SamplingParams, i: int) -> GenerationEvent:
    return GenerationEvent(
        tenant="t", session_id=f"s{i}", generation_id=f"g{i}", model_line="tiny", model_version=0, node_id="n",
        request={}, response={}, prompt_token_ids=prompt, completion_token_ids=completion.token_ids,
        completion_logprobs=completion.logprobs, sampling=sampling, latency_ms=1.0,
    )


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "min_p", "repetition"), GRID)
def test_served_logprobs_equal_the_trainers_recomputation(engine_and_policy, temperature, top_p, top_k, min_p,
                                                          repetition) -> None:
    from serving.node.engine import GenerationRequest

    engine, model, tokenizer = engine_and_policy
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                              repetition_penalty=repetition)
    processing = Processing.of(sampling)
    prompts = [lm.chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])
               for text in ("add 12 and 7", "what is 3 plus 5", "sum 40 and 2", "add 9 and 9")]
    futures = [engine.submit(GenerationRequest(p, 12, processing=processing, seed=None)) for p in prompts]
    samples = [ScoredTrajectory(tenant="t", session_id=f"s{i}", trajectory_id=f"tr{i}", model_line="tiny",
                                segments=build_segments([_event(p, f.result()[0], sampling, i)]), turn_rewards=[1.0],
                                total_reward=1.0, reward_spec_version="v")
               for i, (p, f) in enumerate(zip(prompts, futures, strict=True))]
    for packed in (False, True):  # one padded row per sample, or all four back to back in one row
        batch = collate(samples, [0.0] * len(samples), packed=packed)
        assert len(batch.processed) == (0 if processing.neutral else len(samples))
        with torch.no_grad():
            recomputed = token_logprobs(model, batch, chunk=5)  # turns span several chunks
        on = batch.mask > 0
        assert int(on.sum()) == sum(len(f.result()[0].token_ids) for f in futures)  # every completion token trainable
        gap = (recomputed - batch.logp_behaviour)[on].abs().max().item()
        assert gap < 1e-5, f"served and recomputed logprobs differ by {gap:.2e} ({packed=})"


def test_greedy_and_unsupported_turns_are_masked_and_counted(engine_and_policy) -> None:
    from serving.node.engine import GenerationRequest

    engine, _, tokenizer = engine_and_policy
    prompt = lm.chat_prompt_ids(tokenizer, [{"role": "user", "content": "add 1 and 2"}])
    (greedy,) = engine.submit(GenerationRequest(prompt, 6, processing=Processing(temperature=0.0))).result()
    (plain,) = engine.submit(GenerationRequest(prompt, 6)).result()
    events = [_event(prompt, greedy, SamplingParams(temperature=0.0), 0),
              _event(prompt, plain, SamplingParams(unsupported=["response_format"]), 1)]
    sample = ScoredTrajectory(tenant="t", session_id="s", trajectory_id="tr", model_line="tiny",
                              segments=build_segments(events[:1]) + build_segments(events[1:]), turn_rewards=[1.0, 1.0],
                              total_reward=2.0, reward_spec_version="v")
    batch = collate([sample], [0.0])
    assert int(batch.mask.sum()) == 0
    assert batch.masked == {"greedy": len(greedy.token_ids), "unsupported:response_format": len(plain.token_ids)}
    assert batch.completion_tokens == len(greedy.token_ids) + len(plain.token_ids)


def test_the_node_honours_every_knob_and_refuses_what_it_cannot_sample_exactly(engine_and_policy) -> None:
    from fastapi.testclient import TestClient

    from serving.node.app import create_app

    engine, _, tokenizer = engine_and_policy
    client = TestClient(create_app(engine))
    chat = {"messages": [{"role": "user", "content": "add 2 and 2"}], "logprobs": True, "max_tokens": 6}
    # top_k = 1 leaves one token: the processed logprob of every sampled token is log 1 = 0.
    r = client.post("/v1/chat/completions", json={**chat, "top_k": 1, "temperature": 1.3})
    assert r.status_code == 200, r.text
    logprobs = [e["logprob"] for e in r.json()["choices"][0]["logprobs"]["content"]]
    assert logprobs and all(abs(lp) < 1e-6 for lp in logprobs), logprobs
    # A bias of -100 on eos keeps it out of every completion; penalties and min-p are accepted.
    eos = tokenizer.eos_token_id
    r = client.post("/v1/chat/completions", json={**chat, "logit_bias": {str(eos): -100}, "min_p": 0.05,
                                                 "presence_penalty": 0.5, "frequency_penalty": 0.2,
                                                 "repetition_penalty": 1.1, "return_token_ids": True})
    assert r.status_code == 200 and eos not in r.json()["choices"][0]["token_ids"]
    for field, value in [("response_format", {"type": "json_object"}), ("min_tokens", 2), ("bad_words", ["x"]),
                         ("logit_bias", {str(len(tokenizer) + 5): 1})]:
        r = client.post("/v1/chat/completions", json={**chat, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_the_n_choices_of_one_request_are_each_exact_and_trainable(engine_and_policy) -> None:
    """``n = 4`` at temperature 0.7, top-k 20, repetition penalty 1.1 (end of text biased away, so the
    choices are long enough to differ): four samples of one prompt from one version, each assembled
    as its own turn of one group, each recomputed to 1e-5."""
    from serving.node.engine import GenerationRequest

    engine, model, tokenizer = engine_and_policy
    sampling = SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.1, n=4,
                              logit_bias={str(tokenizer.eos_token_id): -100.0})
    prompt = lm.chat_prompt_ids(tokenizer, [{"role": "user", "content": "add 12 and 7"}])
    choices = engine.submit(GenerationRequest(prompt, 12, processing=Processing.of(sampling), n=4)).result()
    assert len(choices) == 4 and len({c.version for c in choices}) == 1
    assert len({tuple(c.token_ids) for c in choices}) > 1  # independent samples, not one copied
    events = [_event(prompt, c, sampling, 0).model_copy(update={"generation_id": f"g-{i}", "group_id": "g",
                                                                 "choice_index": i})
              for i, c in enumerate(choices)]
    segments = build_segments(events)
    assert [(t.group_id, t.choice_index) for s in segments for t in s.turns] == [("g", i) for i in range(4)]
    sample = ScoredTrajectory(tenant="t", session_id="s", trajectory_id="tr", model_line="tiny", segments=segments,
                              turn_rewards=[1.0] * 4, total_reward=4.0, reward_spec_version="v")
    batch = collate([sample], [0.0], packed=True)
    with torch.no_grad():
        recomputed = token_logprobs(model, batch)
    on = batch.mask > 0
    assert int(on.sum()) == sum(len(c.token_ids) for c in choices)
    gap = (recomputed - batch.logp_behaviour)[on].abs().max().item()
    assert gap < 1e-5, f"served and recomputed logprobs differ by {gap:.2e}"
