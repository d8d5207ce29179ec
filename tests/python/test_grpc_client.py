"""A Python gRPC client generated from proto/ by grpcio-tools calls the
frontend's Inference API and streams tokens."""

import importlib
import json
import pathlib
import sys
import tempfile

import grpc
import jsonschema
import pytest
from grpc_tools import protoc

from test_tools import SCHEMAS  # the HTTP tool tests' functions

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pb():
    out = tempfile.mkdtemp(prefix="sluice-pb-")
    protos = [str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto" / "sluice").rglob("*.proto")]
    rc = protoc.main(
        ["protoc", f"-I{ROOT / 'proto'}", f"-I{pathlib.Path(protoc.__file__).parent / '_proto'}",
         f"--python_out={out}", f"--grpc_python_out={out}", *protos]
    )
    assert rc == 0, "protoc failed"
    sys.path.insert(0, out)
    inference = importlib.import_module("sluice.inference.v1.inference_pb2")
    inference_grpc = importlib.import_module("sluice.inference.v1.inference_pb2_grpc")
    common = importlib.import_module("sluice.common.v1.common_pb2")
    return inference, inference_grpc, common


def test_generate_streams_tokens(sluice, pb):
    inference, inference_grpc, common = pb
    with grpc.insecure_channel(sluice) as channel:
        stub = inference_grpc.InferenceStub(channel)
        models = stub.ListModels(inference.ListModelsRequest())
        assert [m.id for m in models.models] == ["sluice-tiny"]
        req = inference.GenerateRequest(
            model="sluice-tiny",
            text="Once upon a time",
            sampling=common.SamplingParams(max_tokens=8, temperature=0.0),
            hints=common.PriorityHints(priority=3),
        )
        responses = list(stub.Generate(req))
        tokens = [t for r in responses for t in r.token_ids]
        assert len(tokens) == 8
        last = responses[-1]
        assert last.finish_reason == common.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 8
        assert last.serving.priority == 3
        assert last.serving.worker_id.startswith("decode-")


def test_bad_input_is_invalid_argument(sluice, pb):
    inference, inference_grpc, common = pb
    with grpc.insecure_channel(sluice) as channel:
        stub = inference_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(inference.GenerateRequest(model="sluice-tiny")))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(inference.GenerateRequest(model="other", text="hi")))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def tools(inference):
    return [
        inference.Tool(name="get_weather", description="The weather in a city",
                       parameters_json=json.dumps(SCHEMAS["get_weather"])),
        inference.Tool(name="add", parameters_json=json.dumps(SCHEMAS["add"])),
    ]


def chat(inference, text):
    return inference.ChatMessages(messages=[inference.ChatMessage(role="user", content=text)])


def test_required_tools_make_a_valid_call_on_the_last_chunk(sluice, pb):
    """The HTTP API's tools, through a generated client: the call is decoded
    under the tools' grammar (random weights still make a valid one) and
    parsed into `tool_calls`; its text never reaches `text`."""
    inference, inference_grpc, common = pb
    with grpc.insecure_channel(sluice) as channel:
        stub = inference_grpc.InferenceStub(channel)
        for seed in range(10):
            req = inference.GenerateRequest(
                model="sluice-tiny",
                chat=chat(inference, "What is the weather in Paris?"),
                tools=tools(inference),
                tool_choice=inference.ToolChoice(mode=inference.ToolChoice.MODE_REQUIRED),
                parallel_tool_calls=False,
                sampling=common.SamplingParams(max_tokens=200, seed=seed),
            )
            responses = list(stub.Generate(req))
            calls = [c for r in responses for c in r.tool_calls]
            assert len(calls) == 1, responses[-1]
            assert responses[-1].tool_calls, "the calls come on the last chunk"
            call = calls[0]
            assert call.id.startswith("call_")
            jsonschema.validate(json.loads(call.arguments_json), SCHEMAS[call.name])
            assert "get_weather" not in "".join(r.text for r in responses)
        named = inference.GenerateRequest(
            model="sluice-tiny",
            chat=chat(inference, "Add 2 and 3"),
            tools=tools(inference),
            tool_choice=inference.ToolChoice(function="add"),
            sampling=common.SamplingParams(max_tokens=200, seed=1),
        )
        calls = [c for r in stub.Generate(named) for c in r.tool_calls]
        assert calls and all(c.name == "add" for c in calls), calls
        for c in calls:
            jsonschema.validate(json.loads(c.arguments_json), SCHEMAS["add"])


def test_n_choices_stream_with_their_index(sluice, pb):
    inference, inference_grpc, common = pb
    with grpc.insecure_channel(sluice) as channel:
        stub = inference_grpc.InferenceStub(channel)
        req = inference.GenerateRequest(
            model="sluice-tiny",
            text="Once upon a time",
            n=3,
            sampling=common.SamplingParams(max_tokens=6, ignore_eos=True, seed=7),
        )
        tokens = {}
        last = {}
        for r in stub.Generate(req):
            tokens.setdefault(r.index, []).extend(r.token_ids)
            if r.finish_reason:
                last[r.index] = r
        assert sorted(tokens) == [0, 1, 2]
        assert all(len(t) == 6 for t in tokens.values()), tokens
        assert sorted(last) == [0, 1, 2]
        assert all(r.finish_reason == common.FINISH_REASON_LENGTH for r in last.values())


def test_bad_tools_are_invalid_argument_naming_the_field(sluice, pb):
    inference, inference_grpc, common = pb
    cases = [
        (inference.GenerateRequest(model="sluice-tiny", chat=chat(inference, "hi"),
                                   tools=[inference.Tool(name="f", parameters_json="{not json")]),
         "tools[0].parameters_json"),
        (inference.GenerateRequest(model="sluice-tiny", chat=chat(inference, "hi"),
                                   tools=tools(inference), tool_choice=inference.ToolChoice(function="nope")),
         "tool_choice"),
        (inference.GenerateRequest(model="sluice-tiny", chat=chat(inference, "hi"),
                                   tools=tools(inference), n=2),
         "n"),
        (inference.GenerateRequest(model="sluice-tiny", text="hi", tools=tools(inference)),
         "tools"),
        (inference.GenerateRequest(model="sluice-tiny", text="hi", n=17), "n"),
    ]
    with grpc.insecure_channel(sluice) as channel:
        stub = inference_grpc.InferenceStub(channel)
        for req, field in cases:
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
            assert field in e.value.details(), (field, e.value.details())


def test_a_json_schema_is_enforced_over_grpc_too(sluice, pb):
    """`sampling.structured_output` is the HTTP API's `response_format`:
    random weights still return JSON valid against the schema; a schema
    that does not compile is INVALID_ARGUMENT."""
    inference, inference_grpc, common = pb
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10},
                       "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    with grpc.insecure_channel(sluice) as channel:
        stub = inference_grpc.InferenceStub(channel)
        for seed in range(10):
            req = inference.GenerateRequest(
                model="sluice-tiny",
                chat=chat(inference, "A name and a number"),
                sampling=common.SamplingParams(
                    max_tokens=200, seed=seed,
                    structured_output=common.StructuredOutput(json_schema=json.dumps(schema))),
            )
            responses = list(stub.Generate(req))
            text = "".join(r.text for r in responses)
            assert responses[-1].finish_reason == common.FINISH_REASON_STOP, text
            jsonschema.validate(json.loads(text), schema)
        bad = inference.GenerateRequest(
            model="sluice-tiny", text="hi",
            sampling=common.SamplingParams(
                structured_output=common.StructuredOutput(json_schema='{"type": "no-such-type"}')),
        )
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(bad))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value


def test_a_tool_call_history_is_rendered_and_bad_arguments_named(sluice, pb):
    """An assistant turn's calls and the tool's answer travel in the chat,
    as on HTTP: the model answers after them; arguments that are not JSON
    are INVALID_ARGUMENT naming the call."""
    inference, inference_grpc, common = pb

    def history(arguments_json):
        return inference.ChatMessages(messages=[
            inference.ChatMessage(role="user", content="Weather in Paris?"),
            inference.ChatMessage(role="assistant", content="", tool_calls=[
                inference.ToolCall(id="call_1", name="get_weather", arguments_json=arguments_json)]),
            inference.ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1"),
        ])

    with grpc.insecure_channel(sluice) as channel:
        stub = inference_grpc.InferenceStub(channel)
        req = inference.GenerateRequest(
            model="sluice-tiny", chat=history('{"city": "Paris", "unit": "celsius"}'),
            tools=tools(inference), sampling=common.SamplingParams(max_tokens=4, ignore_eos=True),
        )
        responses = list(stub.Generate(req))
        assert responses[-1].finish_reason == common.FINISH_REASON_LENGTH
        # The call and its answer are in the prompt, not dropped.
        alone = inference.GenerateRequest(
            model="sluice-tiny", chat=chat(inference, "Weather in Paris?"),
            tools=tools(inference), sampling=common.SamplingParams(max_tokens=1, ignore_eos=True),
        )
        without = list(stub.Generate(alone))[-1].usage.prompt_tokens
        assert responses[-1].usage.prompt_tokens > without + 10, (responses[-1].usage, without)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(inference.GenerateRequest(
                model="sluice-tiny", chat=history("{not json"), tools=tools(inference))))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "messages[1].tool_calls[0]" in e.value.details(), e.value.details()
