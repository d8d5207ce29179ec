"""Structured outputs through the unmodified `openai` package against `sluice up`.

The built-in model has random weights: whatever it would say, the engine masks
every token that would leave the schema, so each answer parses. That is the
proof decoding is constrained (a gateway that only validates could not do it).
"""

import json
from typing import Annotated, List

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field


@pytest.fixture(scope="module")
def client(sluice):
    return OpenAI(base_url=f"http://{sluice}/v1", api_key="unused", max_retries=0)


MESSAGES = [{"role": "user", "content": "Describe a river as JSON."}]


class Bank(BaseModel):
    side: str = Field(max_length=8)
    trees: int = Field(ge=0, le=99)


class River(BaseModel):
    name: str = Field(max_length=12)
    length_km: int = Field(ge=1, le=9999)
    navigable: bool
    banks: List[Bank] = Field(max_length=2)
    towns: List[Annotated[str, Field(max_length=10)]] = Field(max_length=3)


def test_parse_returns_a_valid_nested_object_every_time(client):
    for i in range(100):
        r = client.chat.completions.parse(
            model="sluice-tiny",
            messages=MESSAGES,
            response_format=River,
            max_tokens=400,
            seed=i,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        river = choice.message.parsed
        assert isinstance(river, River)
        assert len(river.name) <= 12 and 1 <= river.length_km <= 9999
        assert all(0 <= b.trees <= 99 for b in river.banks)


def test_streamed_json_object_is_valid_json(client):
    stream = client.chat.completions.create(
        model="sluice-tiny",
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {
                "name": "flag",
                "schema": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                    "required": ["ok", "n"],
                    "additionalProperties": False,
                },
            },
        },
        max_tokens=100,
        stream=True,
        seed=7,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    value = json.loads(text)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)


def test_completions_take_response_format_too(client):
    r = client.completions.create(
        model="sluice-tiny",
        prompt="A number:",
        max_tokens=20,
        seed=3,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 10, "maximum": 99}},
            }
        },
    )
    assert r.choices[0].finish_reason == "stop"
    assert 10 <= int(r.choices[0].text) <= 99


def test_a_schema_that_cannot_compile_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="sluice-tiny",
            messages=MESSAGES,
            max_tokens=10,
            response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}},
        )
    assert e.value.body["param"] == "response_format"
    assert "no-such-type" in str(e.value)
