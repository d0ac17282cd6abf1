"""The official ``openai`` Python SDK (pinned in the ``test`` extra) against the gateway, unchanged:
chat (plain and streamed), text completions, flywheel's headers, and errors as the SDK's own
exception classes. The stack is the one test_streaming.py runs (node + gateway, real HTTP).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from flywheel import lm
from tests.fixtures.roles import MESSAGES
from tests.integration.test_streaming import faulty_upstream, running_stack

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def client(served) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{served.gateway}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_chat_and_the_flywheel_headers(client, served, tiny_model_dir):
    _, tokenizer = lm.load_model(tiny_model_dir)
    raw = client.chat.completions.with_raw_response.create(
        model=served.settings.model.line, messages=MESSAGES, max_tokens=8, seed=11,
        extra_headers={"X-Flywheel-Session": "sdk-1"},
    )
    assert raw.headers["X-Flywheel-Session"] == "sdk-1" and raw.headers["X-Flywheel-Model-Version"] == "0"
    completion = raw.parse()
    assert completion.object == "chat.completion" and completion.choices[0].message.role == "assistant"
    assert completion.choices[0].finish_reason in ("stop", "length") and completion.choices[0].logprobs is None
    assert completion.usage.completion_tokens >= 1

    # Training extras through extra_body come back as the SDK's extra fields.
    rich = client.chat.completions.create(
        model=served.settings.model.line, messages=MESSAGES, max_tokens=8, seed=11, logprobs=True,
        extra_body={"return_token_ids": True},
    )
    choice = rich.choices[0]
    assert choice.message.content == completion.choices[0].message.content
    assert choice.token_ids and len(choice.token_ids) == len(choice.logprobs.content)
    assert rich.prompt_token_ids == lm.chat_prompt_ids(tokenizer, MESSAGES)
    assert choice.message.content == lm.completion_text(tokenizer, choice.token_ids)

    generation = raw.headers["X-Flywheel-Generation"]
    (event,) = served.events([generation])[generation]
    assert event.session_id == "sdk-1" and event.completion_token_ids == choice.token_ids


def test_streamed_chat_with_usage(client, served):
    with client.chat.completions.with_streaming_response.create(
        model=served.settings.model.line, messages=MESSAGES, max_tokens=8, seed=11, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Flywheel-Session": "sdk-2"},
    ) as response:
        assert response.headers["X-Flywheel-Session"] == "sdk-2"
        generation = response.headers["X-Flywheel-Generation"]
        chunks = list(response.parse())
    *content, last = chunks
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens >= 1
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in content)
    assert content[-1].choices[0].finish_reason in ("stop", "length")
    text = "".join(c.choices[0].delta.content or "" for c in content)
    plain = client.chat.completions.create(model=served.settings.model.line, messages=MESSAGES, max_tokens=8, seed=11)
    assert text == plain.choices[0].message.content

    (event,) = served.events([generation])[generation]
    assert event.session_id == "sdk-2" and len(event.completion_token_ids) == last.usage.completion_tokens
    assert event.response["choices"][0]["message"]["content"] == text

    # The plain iterator form, without usage.
    stream = client.chat.completions.create(model=served.settings.model.line, messages=MESSAGES, max_tokens=4,
                                            stream=True)
    chunks = list(stream)
    assert chunks and all(c.usage is None and len(c.choices) == 1 for c in chunks)


def test_text_completions(client, served):
    completion = client.completions.create(model=served.settings.model.line, prompt="sort: 3 1 2", max_tokens=6,
                                           seed=5, extra_headers={"X-Flywheel-Session": "sdk-3"})
    assert completion.object == "text_completion" and completion.choices[0].finish_reason in ("stop", "length")
    streamed = client.completions.create(model=served.settings.model.line, prompt="sort: 3 1 2", max_tokens=6,
                                         seed=5, stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text
    with_logprobs = client.completions.create(model=served.settings.model.line, prompt="sort: 3 1 2", max_tokens=6,
                                              seed=5, logprobs=0)
    logprobs = with_logprobs.choices[0].logprobs
    assert len(logprobs.token_logprobs) == len(logprobs.tokens) == completion.usage.completion_tokens


def test_errors_are_the_sdk_exception_classes(client, served):
    line = served.settings.model.line
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=line, messages=MESSAGES, temperature=7.5)
    assert bad.value.status_code == 400 and bad.value.param == "temperature"
    assert bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=line, messages=MESSAGES, stream=True, top_logprobs=2)
    assert bad.value.param == "top_logprobs"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=line, prompt="x", echo=True)
    assert bad.value.param == "echo"


def test_a_stream_that_breaks_off_raises_in_the_sdk(tmp_path_factory, tiny_model_dir):
    with faulty_upstream() as upstream, running_stack(
        tmp_path_factory.mktemp("sdk-faulty"), tiny_model_dir, node=False, upstream=upstream
    ) as stack, openai.OpenAI(base_url=f"{stack.gateway}/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(model="tiny-sim", messages=MESSAGES, stream=True,
                                                extra_body={"fault": "error"})
        got = []
        with pytest.raises(openai.APIError) as failed:
            for chunk in stream:
                got.append(chunk.choices[0].delta.content)
        assert got == ["", "ab"]
        assert "engine crashed" in failed.value.message and failed.value.code == "engine_failure"
