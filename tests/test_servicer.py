"""The servicer without a socket (grpcio-testing), and the engine's fault paths."""

from __future__ import annotations

import grpc
import grpc_testing
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.engine_loop import EngineLoop
from engine.sampling_params import SamplingParams
from llamastream.v1 import generation_pb2 as pb
from server.app import Server, ServerConfig
from server.servicer import GenerationServicer
from tests.conftest import TINY_MODEL, make_engine
from tests.serving import check_stream_shape, collect, stub

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]


@pytest.fixture
def testing_server(tiny_model):
    loop = EngineLoop(make_engine(tiny_model))
    loop.start()
    servicer = GenerationServicer(loop, "numpy", max_in_flight=8)
    servicer.accepting.set()
    yield grpc_testing.server_from_dictionary({SERVICE: servicer}, grpc_testing.strict_real_time())
    loop.stop()


def generate(server, request: pb.GenerateRequest):
    rpc = server.invoke_unary_stream(SERVICE.methods_by_name["Generate"], (), request, 10)
    responses = []
    while True:
        try:
            responses.append(rpc.take_response())
        except ValueError:  # no more responses
            break
    _, code, details = rpc.termination()
    return responses, code, details


def test_generate_streams_started_deltas_finished(testing_server):
    request = pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(temperature=0.0),
                                 stop=pb.StopCriteria(max_tokens=5, ignore_eos=True))
    responses, code, _ = generate(testing_server, request)
    assert code == grpc.StatusCode.OK
    check_stream_shape(responses)
    assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
    assert sum(len(r.delta.token_ids) for r in responses if r.HasField("delta")) == 5


def test_generate_refuses_bad_input_before_any_message(testing_server):
    responses, code, details = generate(testing_server, pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_k=-5)))
    assert responses == [] and code == grpc.StatusCode.INVALID_ARGUMENT and "top_k" in details


class FaultyBackend:
    """Wraps a backend; raises on chosen calls of execute."""

    def __init__(self, inner, fail_on: set[int], fatal: bool):
        self.inner, self.fail_on, self.fatal, self.calls = inner, fail_on, fatal, 0
        self.name = inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def execute(self, batch):
        self.calls += 1
        if self.calls in self.fail_on:
            raise RuntimeError("injected fault")
        return self.inner.execute(batch)

    def is_fatal(self, error: BaseException) -> bool:
        return self.fatal


@pytest.fixture
def live_server():
    server = Server(ServerConfig(model=str(TINY_MODEL), host="127.0.0.1", port=0, device="cpu", num_kv_blocks=64, grace=5))
    yield server
    server.drain()


def request(n: int = 8) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="go", sampling=pb.SamplingParams(temperature=0.0), stop=pb.StopCriteria(max_tokens=n, ignore_eos=True))


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(live_server):
    engine = live_server.loop.engine
    engine.backend = FaultyBackend(engine.backend, fail_on={4}, fatal=False)  # after the warm-up's steps
    live_server.start()
    client = stub(f"127.0.0.1:{live_server.port}")
    with pytest.raises(grpc.RpcError) as e:
        collect(client.Generate(request(), timeout=10))
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected fault" in e.value.details()
    msgs, _ = collect(client.Generate(request(), timeout=10))  # the server keeps serving
    assert msgs[-1].finished.usage.completion_tokens == 8
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_fatal_device_error_stops_serving(live_server):
    engine = live_server.loop.engine
    engine.backend = FaultyBackend(engine.backend, fail_on={4}, fatal=True)
    live_server.start()
    address = f"127.0.0.1:{live_server.port}"
    with pytest.raises(grpc.RpcError) as e:
        collect(stub(address).Generate(request(), timeout=10))
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert live_server.exit_code == 1  # the CLI exits with it, for a supervisor to restart the server
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
        collect(stub(address).Generate(request(), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_reader_that_falls_behind_gets_coalesced_deltas(tiny_model):
    """Events queued while a stream was not read go out as one Delta, with nothing lost."""
    engine = make_engine(tiny_model)
    loop = EngineLoop(engine)  # not started: the test plays the engine
    servicer = GenerationServicer(loop, "numpy", max_in_flight=8)
    seq = engine.make_sequence("slow", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add(seq)
    produced = []
    while engine.has_work():
        produced += engine.step()
    outputs = loop.submit(seq)  # (registers the queue; the engine already ran)
    expected_ids = [t for o in produced[:-1] for t in o.token_ids]
    expected_text = "".join(o.text for o in produced[:-1])
    for out in produced[:-1]:
        outputs.put(out)
    first = servicer._next_output(outputs, context=None)
    assert first.token_ids == expected_ids and first.text == expected_text and not first.finished
    outputs.put(produced[-1])
    last = servicer._next_output(outputs, context=None)
    assert last.finished and last.usage.completion_tokens == 6
