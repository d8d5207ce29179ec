"""The official `openai` client against `sluice up`, unmodified."""

import openai
import pytest
from openai import OpenAI


@pytest.fixture(scope="module")
def client(sluice):
    return OpenAI(base_url=f"http://{sluice}/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Write one sentence about rivers."}]


def test_models_lists_the_builtin_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["sluice-tiny"]


def test_chat_completion_returns_text_usage_and_nvext(client):
    r = client.chat.completions.create(model="sluice-tiny", messages=MESSAGES, max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 10
    assert r.usage.prompt_tokens > 0
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    nvext = r.model_extra["nvext"]
    assert nvext["worker_id"].startswith("decode-")
    assert nvext["priority"] == 0


def test_priority_is_read_from_nvext_agent_hints(client):
    r = client.chat.completions.create(
        model="sluice-tiny",
        messages=MESSAGES,
        max_tokens=2,
        extra_body={"nvext": {"agent_hints": {"priority": 5}}},
    )
    assert r.model_extra["nvext"]["priority"] == 5


def test_chat_streaming_with_usage(client):
    stream = client.chat.completions.create(
        model="sluice-tiny",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert finals and finals[-1].choices[0].finish_reason == "length"
    assert usage and usage[-1].completion_tokens == 12
    assert isinstance(text, str)


def test_completions_streaming_and_not(client):
    r = client.completions.create(model="sluice-tiny", prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert r.usage.completion_tokens == 8
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model="sluice-tiny", prompt="Once upon a time", max_tokens=8, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == r.choices[0].text


def test_same_seed_same_tokens(client):
    def sample():
        return client.chat.completions.create(
            model="sluice-tiny", messages=MESSAGES, max_tokens=16, temperature=1.0, seed=1234
        ).choices[0].message.content

    assert sample() == sample()


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES, max_tokens=2)


@pytest.mark.parametrize(
    "extra",
    [
        {"nvext": {"priority": 3}},
        {"priority": 3},
        {"nvext": {"agent_hints": {"priority": "urgent"}}},
    ],
)
def test_misplaced_priority_is_a_400_naming_the_right_path(client, extra):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="sluice-tiny", messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert "nvext.agent_hints.priority" in str(e.value)


def test_unknown_field_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="sluice-tiny", messages=MESSAGES, max_tokens=2, extra_body={"max_tokenz": 3}
        )
    assert "max_tokenz" in str(e.value)


def test_n_returns_n_choices_and_counts_the_prompt_once(client):
    one = client.chat.completions.create(model="sluice-tiny", messages=MESSAGES, max_tokens=6, seed=3)
    r = client.chat.completions.create(model="sluice-tiny", messages=MESSAGES, max_tokens=6, n=4, seed=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.message.content is not None for c in r.choices)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.usage.completion_tokens <= 4 * 6
    # Choice 0 has the request's seed: the same text as alone.
    assert r.choices[0].message.content == one.choices[0].message.content


def test_n_streamed_tags_each_delta_with_its_choice(client):
    stream = client.chat.completions.create(
        model="sluice-tiny", messages=MESSAGES, max_tokens=5, n=3, seed=5, stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(finish) == [0, 1, 2]
    assert usage is not None and usage.completion_tokens <= 15
    whole = client.chat.completions.create(model="sluice-tiny", messages=MESSAGES, max_tokens=5, n=3, seed=5)
    assert [text[i] for i in range(3)] == [c.message.content for c in whole.choices]


def test_n_out_of_range_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="sluice-tiny", messages=MESSAGES, max_tokens=2, n=17)
    assert e.value.body["param"] == "n"


def test_stop_string_ends_generation(client):
    full = client.completions.create(model="sluice-tiny", prompt="The river", max_tokens=24, temperature=0)
    text = full.choices[0].text
    assert len(text) >= 4, f"greedy output too short for this test: {text!r}"
    # Stop on a piece from the middle of the greedy output: the text ends
    # right before its first occurrence.
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    r = client.completions.create(model="sluice-tiny", prompt="The river", max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.find(stop)]


def test_max_tokens_beyond_the_context_is_a_400_naming_the_limit(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="sluice-tiny", messages=MESSAGES, max_tokens=10**9)
    assert e.value.body["param"] == "max_tokens"
    assert "at most" in str(e.value)
    # Unset, it is whatever the context leaves (or the server's default).
    r = client.chat.completions.create(model="sluice-tiny", messages=MESSAGES, temperature=0)
    assert r.usage.completion_tokens > 0


def test_a_client_request_id_is_echoed_but_never_becomes_the_completion_id(client):
    from concurrent.futures import ThreadPoolExecutor

    def one(_):
        raw = client.chat.completions.with_raw_response.create(
            model="sluice-tiny",
            messages=MESSAGES,
            max_tokens=2,
            extra_headers={"x-request-id": "shared-by-ten"},
        )
        assert raw.headers["x-request-id"] == "shared-by-ten"
        return raw.parse().id

    with ThreadPoolExecutor(10) as pool:
        ids = list(pool.map(one, range(10)))
    assert len(set(ids)) == 10, ids
    assert not any("shared-by-ten" in i for i in ids)
