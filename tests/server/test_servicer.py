"""The servicer in a server in this process, its hand-over of outputs, and the engine's fault
paths, with the engine on a thread of the server's process and in a process of its own."""

from __future__ import annotations

import asyncio
import functools
import pickle

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.sampling_params import SamplingParams
from llamastream.v1 import generation_pb2 as pb
from server.streams import EngineStopped, OutputHub
from tests.conftest import make_engine
from tests.serving import check_stream_shape, collect, faulty_engine, local_server, stub

GREEDY = pb.SamplingParams(temperature=0.0)


@pytest.fixture
def live_server():
    server = local_server(start=False)
    yield server
    server.drain()


def test_generate_streams_started_deltas_finished(live_server):
    live_server.start()
    request = pb.GenerateRequest(prompt="hello", sampling=GREEDY, stop=pb.StopCriteria(max_tokens=5, ignore_eos=True))
    responses, _ = collect(stub(f"127.0.0.1:{live_server.port}").Generate(request, timeout=10))
    check_stream_shape(responses)
    assert responses[-1].finished.reason == pb.FINISH_REASON_LENGTH
    assert sum(len(r.delta.token_ids) for r in responses if r.HasField("delta")) == 5


def test_generate_refuses_bad_input_before_any_message(live_server):
    live_server.start()
    call = stub(f"127.0.0.1:{live_server.port}").Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_k=-5)))
    with pytest.raises(grpc.RpcError) as e:
        next(call)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_k" in e.value.details()


def request(n: int = 8) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="go", sampling=pb.SamplingParams(temperature=0.0), stop=pb.StopCriteria(max_tokens=n, ignore_eos=True))


def faulty_server(engine_process: bool, **fault):
    """A server whose backend fails as `fault` says (FaultyBackend), wherever its engine runs."""
    return local_server(build=functools.partial(faulty_engine, **fault), engine_process=engine_process)


@pytest.mark.parametrize("engine_process", [False, True])
@pytest.mark.parametrize("when", ["launch", "wait"])
def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(when, engine_process):
    server = faulty_server(engine_process, fail_on={4}, fatal=False, when=when)  # after the warm-up's steps
    try:
        client = stub(f"127.0.0.1:{server.port}")
        with pytest.raises(grpc.RpcError) as e:
            collect(client.Generate(request(), timeout=10))
        assert e.value.code() == grpc.StatusCode.INTERNAL and "injected fault" in e.value.details()
        msgs, _ = collect(client.Generate(request(), timeout=10))  # the server keeps serving
        assert msgs[-1].finished.usage.completion_tokens == 8
        assert server.engine.stats().kv_blocks_free == server.engine.info.num_kv_blocks
    finally:
        server.drain()


@pytest.mark.parametrize("engine_process", [False, True])
def test_a_fatal_device_error_stops_serving(engine_process):
    server = faulty_server(engine_process, fail_on={4}, fatal=True)
    try:
        check_stops_serving(server, stub(f"127.0.0.1:{server.port}").Generate(request(), timeout=10))
    finally:
        server.drain()


def test_an_engine_process_that_dies_stops_serving():
    server = local_server(engine_process=True)
    try:
        call = stub(f"127.0.0.1:{server.port}").Generate(request(1000), timeout=30)
        next(call), next(call)  # Started, then a first delta
        server.engine._process.kill()
        check_stops_serving(server, call)
    finally:
        server.drain()


def test_an_engine_that_cannot_be_built_fails_the_start_with_its_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        local_server(model=str(tmp_path / "missing"), engine_process=True)


def check_stops_serving(live_server, call) -> None:
    """The call fails (INTERNAL), the server is marked to exit 1, health says
    NOT_SERVING and later calls get UNAVAILABLE."""
    address = f"127.0.0.1:{live_server.port}"
    with pytest.raises(grpc.RpcError) as e:
        collect(call)
    assert e.value.code() == grpc.StatusCode.INTERNAL
    assert live_server.exit_code == 1  # the CLI exits with it, for a supervisor to restart the server
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(grpc.RpcError) as e:
        collect(stub(address).Generate(request(), timeout=10))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_reader_that_falls_behind_gets_coalesced_deltas(tiny_model):
    """Events queued while a stream was not read come out as one, with nothing lost."""
    engine = make_engine(tiny_model)
    seq = engine.make_sequence("slow", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add(seq)
    produced = []
    while engine.has_work():
        produced += engine.step()
    expected_ids = [t for o in produced[:-1] for t in o.token_ids]
    expected_text = "".join(o.text for o in produced[:-1])

    async def read():
        outputs = OutputHub(asyncio.get_running_loop(), max_backlog=100).outputs(on_overflow=lambda: None)
        for out in produced[:-1]:
            outputs.put(out)
        first = await asyncio.wait_for(outputs.get(), 5)
        outputs.put(produced[-1])
        return first, await asyncio.wait_for(outputs.get(), 5)

    first, last = asyncio.run(read())
    assert first.token_ids == expected_ids and first.text == expected_text and not first.finished
    assert last.finished and last.usage.completion_tokens == 6


def test_outputs_cross_to_the_server_process_whole(tiny_model):
    """Every field of an engine's outputs (logprobs, the finish reason, usage) survives
    the pickling that carries them from the engine's process to the server's."""
    engine = make_engine(tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=5, top_logprobs=2, ignore_eos=True)
    engine.add(engine.make_sequence("r", [3, 4, 5], params))
    produced = []
    while engine.has_work():
        produced += engine.step()
    assert produced[-1].usage is not None and produced[-1].logprobs[0].top
    assert pickle.loads(pickle.dumps(produced)) == produced


def test_a_stream_waiting_on_a_stopped_engine_ends():
    """If the engine thread stops without ending its requests, waiting streams learn it
    from the hub's watch (the server then answers INTERNAL) instead of waiting forever."""

    class StoppedEngine:
        alive, fatal_error = False, "device lost"

    async def wait():
        hub = OutputHub(asyncio.get_running_loop(), max_backlog=100)
        outputs = hub.outputs(on_overflow=lambda: None)
        waiting = asyncio.create_task(outputs.get())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await hub.watch(StoppedEngine(), interval=0.01)
        with pytest.raises(EngineStopped, match="device lost"):
            await asyncio.wait_for(waiting, 5)
        with pytest.raises(EngineStopped):  # and so does every later wait
            await asyncio.wait_for(outputs.get(), 5)

    asyncio.run(wait())
