"""Tool calls through the unmodified `openai` package against `sluice up`.

With `tool_choice="required"` (or a named function) the engine decodes the
call under a grammar built from the tools' schemas, so even the built-in
model's random weights make a well-formed call whose arguments validate.
"""

import json

import jsonschema
import pytest
from openai import OpenAI


@pytest.fixture(scope="module")
def client(sluice):
    return OpenAI(base_url=f"http://{sluice}/v1", api_key="unused", max_retries=0)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {"terms": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
                "required": ["terms"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_call(call):
    assert call.type == "function"
    assert call.id
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])


def test_required_makes_a_valid_call_every_time(client):
    for i in range(100):
        r = client.chat.completions.create(
            model="sluice-tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=200, seed=i,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0])


def test_required_streamed_makes_a_valid_call_every_time(client):
    for i in range(100):
        stream = client.chat.completions.create(
            model="sluice-tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
            parallel_tool_calls=False, max_tokens=200, seed=1000 + i, stream=True,
        )
        calls, finish = {}, None
        for chunk in stream:
            if not chunk.choices:
                continue
            c = chunk.choices[0]
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
        assert finish == "tool_calls"
        assert len(calls) == 1
        (call,) = calls.values()
        assert call["id"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_named_function_is_the_one_called(client):
    r = client.chat.completions.create(
        model="sluice-tiny", messages=MESSAGES, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, parallel_tool_calls=False,
        max_tokens=200, seed=5,
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "add"
    check_call(call)


def test_a_call_and_its_result_go_back_into_the_conversation(client):
    first = client.chat.completions.create(
        model="sluice-tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=200, seed=9,
    )
    call = first.choices[0].message.tool_calls[0]
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 degrees"},
    ]
    r = client.chat.completions.create(model="sluice-tiny", messages=history, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.content is not None
    assert r.choices[0].message.tool_calls is None


def test_auto_and_none_answer_text_or_calls(client):
    r = client.chat.completions.create(model="sluice-tiny", messages=MESSAGES, tools=TOOLS, max_tokens=16, seed=1)
    m = r.choices[0].message
    assert m.content is not None or m.tool_calls
    for call in m.tool_calls or []:
        assert call.function.name in SCHEMAS


def test_bad_tool_choices_are_400s_naming_the_field(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="sluice-tiny", messages=MESSAGES, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}}, max_tokens=4,
        )
    assert e.value.body["param"] == "tool_choice"
