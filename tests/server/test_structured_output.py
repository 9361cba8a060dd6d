"""Structured output through the server, on the embedded SmolLM2 (its engine in a
process of its own, where each guide is rebuilt): our own service's
`structured` constraint and vLLM's `SamplingParams.constraint`, checked by parsers
nobody here wrote; bad constraints refused with INVALID_ARGUMENT and what is wrong,
the server serving on."""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from llamastream.v1 import generation_pb2 as pb
from tests.serving import chat, collect, local_server, stub

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    s = local_server(model=None, num_kv_blocks=512, engine_process=True)
    yield s
    s.drain()


def ask(server, structured: pb.StructuredOutput, question: str = "Tell me about a person, in JSON.", **sampling):
    request = chat(question, structured=structured, sampling=pb.SamplingParams(**{"temperature": 0.0, **sampling}),
                   stop=pb.StopCriteria(max_tokens=240))
    msgs, text = collect(stub(f"127.0.0.1:{server.port}").Generate(request, timeout=120))
    return text, msgs[-1].finished


def test_a_json_schema_holds(server):
    for seed in (None, 3):
        text, finished = ask(server, pb.StructuredOutput(json_schema=json.dumps(PERSON)),
                             **({} if seed is None else dict(temperature=0.8, seed=seed)))
        assert finished.reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_regex_choice_and_grammar_hold(server):
    text, _ = ask(server, pb.StructuredOutput(json_object=True), "Describe a cat as a JSON object with its name and age.")
    assert isinstance(json.loads(text), dict)
    text, _ = ask(server, pb.StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}"), "Give me a phone number.")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text)
    text, _ = ask(server, pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no"])), "Is Paris in France?")
    assert text in ("yes", "no")
    text, _ = ask(server, pb.StructuredOutput(grammar='root ::= [1-9] [0-9]? ("+" [1-9] [0-9]?)?'), "Add two numbers.")
    assert re.fullmatch(r"[1-9][0-9]?(\+[1-9][0-9]?)?", text)


@pytest.mark.parametrize("structured, says", [
    (pb.StructuredOutput(json_schema='{"type": "object",'), "structured.json_schema: not JSON"),
    (pb.StructuredOutput(json_schema='{"type": "object", "if": {}}'), "Unimplemented keys"),
    (pb.StructuredOutput(json_schema='{"$ref": "#/$defs/none"}'), "does not exist"),
    (pb.StructuredOutput(json_schema="42"), "an object or a boolean"),
    (pb.StructuredOutput(regex="(ab"), "unclosed group"),
    (pb.StructuredOutput(regex="[z-a]"), "structured.regex"),
    (pb.StructuredOutput(choice=pb.Choices()), "at least one choice"),
    (pb.StructuredOutput(grammar="start: undefined_rule"), "unknown name"),
    (pb.StructuredOutput(grammar='root ::= "a" | ('), "GBNF"),
    (pb.StructuredOutput(grammar="start: " + " | ".join(f'"{i}"' for i in range(20000))), "--max-grammar-bytes"),
])
def test_a_bad_constraint_is_refused_and_the_server_serves_on(server, structured, says):
    if structured.WhichOneof("constraint") is None:  # (an empty Choices message)
        structured.choice.SetInParent()
    with pytest.raises(grpc.RpcError) as e:
        ask(server, structured)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and says in e.value.details(), e.value.details()
    assert ask(server, pb.StructuredOutput(choice=pb.Choices(choices=["ok"])))[0] == "ok"


@pytest.mark.parametrize("constraint, check", [
    (dict(json_schema=json.dumps(PERSON)), lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    (dict(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    (dict(regex=r"[A-Z][a-z]{2,8}"), lambda text: re.fullmatch(r"[A-Z][a-z]{2,8}", text)),
    (dict(choice=vpb.ChoiceConstraint(choices=["red", "blue"])), lambda text: text in ("red", "blue")),
    (dict(grammar='start: "a" B\nB: /b{1,3}/'), lambda text: re.fullmatch("ab{1,3}", text)),
])
def test_vllm_protocol_constraints_hold(server, constraint, check):
    ids = server.engine.info.tokenizer.encode("Answer: ", add_special_tokens=True)
    request = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=ids), stream=False,
                                  sampling_params=vpb.SamplingParams(temperature=0.0, max_tokens=80, **constraint))
    (response,) = vpb_grpc.VllmEngineStub(grpc.insecure_channel(f"127.0.0.1:{server.port}")).Generate(request, timeout=120)
    text = server.engine.info.tokenizer.decode(list(response.complete.output_ids), skip_special_tokens=True)
    assert response.complete.finish_reason == "stop" and check(text), text
