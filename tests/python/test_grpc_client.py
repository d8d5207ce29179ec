"""A Python gRPC client generated from proto/ by grpcio-tools calls the
frontend's Inference API and streams tokens."""

import importlib
import pathlib
import sys
import tempfile

import grpc
import pytest
from grpc_tools import protoc

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
