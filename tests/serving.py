"""Helpers for tests that talk to a real server over a socket."""

from __future__ import annotations

import grpc

from devtools.servers import ROOT, ServerProcess, free_port, wait_serving  # noqa: F401 (the tests' names for them)
from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc


def local_server(start: bool = True, build=None, **config):
    """A Server in this process on the tiny model, on a free loopback port; started
    unless `start` is False. Its engine runs on a thread here (so tests can reach
    into it) unless engine_process=True; `build` replaces server.app.build_engine."""
    from server.app import Server, ServerConfig, build_engine
    from tests.conftest import TINY_MODEL

    defaults = dict(model=str(TINY_MODEL), host="127.0.0.1", port=0, device="cpu", num_kv_blocks=64, grace=5,
                    engine_process=False)
    server = Server(ServerConfig(**{**defaults, **config}), build or build_engine)
    if start:
        server.start()
    return server


def stub(address: str) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(address))


def chat(content: str, **fields) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content=content)]), **fields)


def collect(responses) -> tuple[list[pb.GenerateResponse], str]:
    """All messages of a Generate stream, and the text of its deltas."""
    msgs = list(responses)
    return msgs, "".join(m.delta.text for m in msgs if m.HasField("delta"))


def check_stream_shape(msgs: list[pb.GenerateResponse]) -> None:
    """One Started first, Deltas, one Finished last."""
    kinds = [m.WhichOneof("event") for m in msgs]
    assert kinds[0] == "started" and kinds[-1] == "finished", kinds
    assert set(kinds[1:-1]) <= {"delta"}, kinds
    assert len({m.request_id for m in msgs}) == 1


class FaultyBackend:
    """Wraps a backend; chosen steps raise as they are queued (`when="launch"`) or as
    their samples are waited for (`"wait"`, where a GPU's asynchronous errors show)."""

    def __init__(self, inner, fail_on: set[int], fatal: bool, when: str = "launch"):
        self.inner, self.fail_on, self.fatal, self.when, self.calls = inner, fail_on, fatal, when, 0
        self.name = inner.name

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, batch, masks=None):
        self.calls += 1
        fail = self.calls in self.fail_on
        if fail and self.when == "launch":
            raise RuntimeError("injected fault")
        samples = self.inner.execute(batch, masks)

        def wait():
            if fail:
                raise RuntimeError("injected fault")
            return samples
        return wait

    def is_fatal(self, error: BaseException) -> bool:
        return self.fatal


def faulty_engine(cfg, **fault):
    """The server's engine on a FaultyBackend (a `build` for local_server: it runs
    where the engine runs, in its process too)."""
    from server.app import build_engine

    engine = build_engine(cfg)
    engine.backend = FaultyBackend(engine.backend, **fault)
    return engine
