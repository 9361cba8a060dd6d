"""TLS, mutual TLS, bearer tokens, message limits, malformed bytes and prompt logging,
against servers in this process on real sockets (certificates: the `pki` fixture)."""

from __future__ import annotations

import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from llamastream.v1 import generation_pb2 as pb
from llamastream.v1 import generation_pb2_grpc as pb_grpc
from server.app import Server
from tests.serving import collect, local_server

REQUEST = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=0.0),
                             stop=pb.StopCriteria(max_tokens=3, ignore_eos=True))
TOKEN = "s3cret-token"


@pytest.fixture
def servers():
    started = []
    yield lambda **config: started.append(local_server(grace=2, **config)) or started[-1]
    for s in started:
        s.drain()


def secure_stub(server: Server, pki, ca: str = "ca", client_cert: bool | str = False) -> pb_grpc.GenerationStub:
    """A stub over TLS; with `client_cert` (True: "client", or the name of another), presenting that certificate."""
    client = "client" if client_cert is True else client_cert
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki[ca].read_bytes(),
        private_key=pki[f"{client}_key"].read_bytes() if client else None,
        certificate_chain=pki[f"{client}_cert"].read_bytes() if client else None,
    )
    channel = grpc.secure_channel(f"127.0.0.1:{server.port}", creds, options=[("grpc.ssl_target_name_override", "localhost")])
    return pb_grpc.GenerationStub(channel)


def plain_stub(server: Server) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(f"127.0.0.1:{server.port}"))


def code_of(call) -> grpc.StatusCode:
    try:
        collect(call)
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_tls(servers, pki):
    server = servers(tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]))
    msgs, _ = collect(secure_stub(server, pki).Generate(REQUEST, timeout=10))
    assert msgs[-1].HasField("finished")
    assert code_of(plain_stub(server).Generate(REQUEST, timeout=5)) == grpc.StatusCode.UNAVAILABLE  # plaintext
    assert code_of(secure_stub(server, pki, ca="other_ca").Generate(REQUEST, timeout=5)) == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls(servers, pki):
    server = servers(tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]), tls_client_ca=str(pki["ca"]))
    msgs, _ = collect(secure_stub(server, pki, client_cert=True).Generate(REQUEST, timeout=10))
    assert msgs[-1].HasField("finished")
    assert code_of(secure_stub(server, pki).Generate(REQUEST, timeout=5)) == grpc.StatusCode.UNAVAILABLE  # no client cert


def test_under_mutual_tls_abort_reaches_only_the_callers_own_requests(servers, pki):
    server = servers(tls_cert=str(pki["server_cert"]), tls_key=str(pki["server_key"]), tls_client_ca=str(pki["ca"]))
    alice, mallory = secure_stub(server, pki, client_cert=True), secure_stub(server, pki, client_cert="other_client")
    long = pb.GenerateRequest(request_id="alices", prompt="hi", sampling=pb.SamplingParams(temperature=0.0),
                              stop=pb.StopCriteria(max_tokens=1000, ignore_eos=True))
    call = alice.Generate(long, timeout=60)
    next(call)
    assert mallory.Abort(pb.AbortRequest(request_ids=["alices"]), timeout=5).aborted == 0
    assert alice.Abort(pb.AbortRequest(request_ids=["alices"]), timeout=5).aborted == 1
    assert list(call)[-1].finished.reason == pb.FINISH_REASON_ABORT


def test_bearer_token(servers, tmp_path):
    (tmp_path / "token").write_text(TOKEN + "\n")
    server = servers(auth_token_file=str(tmp_path / "token"))
    client = plain_stub(server)
    msgs, _ = collect(client.Generate(REQUEST, timeout=10, metadata=[("authorization", f"Bearer {TOKEN}")]))
    assert msgs[-1].HasField("finished")
    for metadata in ([], [("authorization", "Bearer nope")], [("authorization", TOKEN)]):
        with pytest.raises(grpc.RpcError) as e:
            collect(client.Generate(REQUEST, timeout=5, metadata=metadata))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:  # health needs no token by default
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_token_for_health_and_reflection_too(servers, tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    server = servers(auth_token_file=str(tmp_path / "token"), auth_health_and_reflection=True)
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        reply = health.Check(health_pb2.HealthCheckRequest(), timeout=5, metadata=[("authorization", f"Bearer {TOKEN}")])
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_bad_security_settings_are_refused_at_start(tmp_path, pki):
    for config, words in [
        (dict(tls_cert=str(pki["server_cert"])), "--tls-key"),
        (dict(tls_cert=str(tmp_path / "missing.pem"), tls_key=str(pki["server_key"])), "cannot read"),
        (dict(auth_token_file=str(tmp_path / "empty")), "empty"),
    ]:
        (tmp_path / "empty").write_text("\n")
        with pytest.raises(ValueError, match=words):
            local_server(start=False, num_kv_blocks=8, **config)


def test_message_size_limit(servers):
    server = servers(max_message_bytes=4096)
    with pytest.raises(grpc.RpcError) as e:
        collect(plain_stub(server).Generate(pb.GenerateRequest(prompt="x" * 10_000), timeout=5))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_bytes_that_do_not_parse_get_invalid_argument(servers):
    server = servers()
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for method in ("Generate", "Tokenize", "GetModelInfo", "Abort"):
            call = (channel.unary_stream if method == "Generate" else channel.unary_unary)(f"/llamastream.v1.Generation/{method}")
            with pytest.raises(grpc.RpcError) as e:
                result = call(b"\xff\xff\xff", timeout=5)
                if method == "Generate":
                    list(result)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method


def test_prompts_are_logged_only_when_asked(servers, caplog):
    secret = "my private question"
    with caplog.at_level(logging.INFO, logger="llamastream"):
        quiet, loud = servers(), servers(log_prompts=True)
        collect(plain_stub(quiet).Generate(pb.GenerateRequest(prompt=secret, stop=pb.StopCriteria(max_tokens=2)), timeout=10))
        assert secret not in caplog.text
        collect(plain_stub(loud).Generate(pb.GenerateRequest(prompt=secret, stop=pb.StopCriteria(max_tokens=2)), timeout=10))
        assert secret in caplog.text


def test_health_watch_streams_through_the_interceptors(servers, tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    server = servers(auth_token_file=str(tmp_path / "token"))
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=5)
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()
