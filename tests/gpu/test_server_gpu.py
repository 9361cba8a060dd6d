"""The gRPC server on the CUDA backend streams a Generate call end to end."""

from __future__ import annotations

from llamastream.v1 import generation_pb2 as pb
from tests.gpu.conftest import require_gpu
from devtools.checkpoints import SMOLLM2, make_model
from tests.serving import ServerProcess, check_stream_shape, collect, stub

require_gpu()


def test_server_streams_on_cuda(tmp_path):
    make_model(tmp_path, SMOLLM2, seed=3)
    with ServerProcess("--model", str(tmp_path), "--device", "cuda") as server:
        info = stub(server.address).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.backend == "cuda"
        request = pb.GenerateRequest(prompt="Hello there", stop=pb.StopCriteria(max_tokens=20, ignore_eos=True),
                                     sampling=pb.SamplingParams(temperature=0.8, top_p=0.9, seed=1))
        msgs, _ = collect(stub(server.address).Generate(request, timeout=120))
        check_stream_shape(msgs)
        assert msgs[-1].finished.usage.completion_tokens == 20
