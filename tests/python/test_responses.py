"""The Responses API (`POST /v1/responses`, stateless) through the unmodified
`openai` package against `sluice up`."""

import json

import jsonschema
import openai
import pytest
from openai import OpenAI


@pytest.fixture(scope="module")
def client(sluice):
    return OpenAI(base_url=f"http://{sluice}/v1", api_key="unused", max_retries=0)


TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_create_answers_text_with_usage(client):
    r = client.responses.create(
        model="sluice-tiny", input="Write about rivers.", instructions="Be brief.", max_output_tokens=12, store=False,
        extra_body={"seed": 1},
    )
    assert r.object == "response"
    assert r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    assert isinstance(r.output_text, str) and r.output_text
    assert r.output[0].type == "message"
    assert r.usage.output_tokens <= 12 and r.usage.input_tokens > 0


def test_streamed_text_deltas_add_up_to_the_completed_response(client):
    stream = client.responses.create(
        model="sluice-tiny", input="Rivers?", max_output_tokens=10, stream=True, extra_body={"seed": 2}
    )
    deltas, completed, types = [], None, []
    for event in stream:
        types.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    assert types[0] == "response.created"
    assert "response.output_item.added" in types and "response.output_text.done" in types
    assert completed is not None
    assert "".join(deltas) == completed.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_makes_a_function_call_item(client, stream):
    # One call (not parallel) of bounded arguments: always within the limit.
    kwargs = dict(
        model="sluice-tiny", input="Weather in Paris?", tools=[TOOL], tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=100, extra_body={"seed": 4},
    )
    if stream:
        final = None
        for event in client.responses.create(stream=True, **kwargs):
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        r = final
    else:
        r = client.responses.create(**kwargs)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1
    for call in calls:
        assert call.name == "get_weather" and call.call_id
        jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])


def test_a_function_call_output_goes_back_as_input(client):
    r = client.responses.create(
        model="sluice-tiny",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
        tools=[TOOL],
        max_output_tokens=8,
    )
    assert r.output_text is not None


def test_text_format_json_schema_is_enforced(client):
    r = client.responses.create(
        model="sluice-tiny",
        input="A number",
        text={"format": {"type": "json_schema", "name": "n", "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}}},
        max_output_tokens=50,
    )
    assert 0 <= json.loads(r.output_text)["n"] <= 9


@pytest.mark.parametrize("extra,param", [({"previous_response_id": "resp_x"}, "previous_response_id"), ({"store": True}, "store")])
def test_what_needs_a_store_is_a_clear_400(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="sluice-tiny", input="hi", max_output_tokens=2, **extra)
    assert e.value.body["param"] == param


def test_auto_beside_a_text_format_is_a_valid_call_or_a_valid_answer(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], "additionalProperties": False}
    kinds = set()
    for seed in range(20):
        r = client.responses.create(
            model="sluice-tiny", input="Weather in Paris?", tools=[TOOL], max_output_tokens=200, parallel_tool_calls=False,
            text={"format": {"type": "json_schema", "name": "n", "schema": schema}}, extra_body={"seed": seed},
        )
        calls = [o for o in r.output if o.type == "function_call"]
        if calls:
            kinds.add("call")
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), TOOL["parameters"])
        else:
            kinds.add("answer")
            jsonschema.validate(json.loads(r.output_text), schema)
    assert kinds  # each of the 20 was one or the other, valid
