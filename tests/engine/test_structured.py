"""Structured output on the numpy backend with the embedded SmolLM2: every output a
constraint allows is checked by a parser nobody here wrote (the jsonschema package,
Python's json and re, Python's own expression parser), greedy and sampled; and the
rest of the engine keeps its promises beside it (the batch, logprobs, preemption,
stop strings and lengths)."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest

from engine.backends import create_backend
from engine.llm_engine import EngineConfig, LLMEngine
from engine.model_loader import load_model
from engine.sampling_params import InvalidRequest, SamplingParams
from engine.sequence import FinishReason
from engine.structured import Constraint
from tests.conftest import check_a_mask_fault_fails_its_step_only, run, tokens

GREEDY = dict(temperature=0.0)
SAMPLED = [dict(temperature=0.8, top_p=0.95, seed=seed) for seed in (1, 2)]


def closed(schema):
    """`schema` with additionalProperties false in every object (what a caller that
    parses the reply sends: otherwise a small model may add keys without end)."""
    if isinstance(schema, dict):
        schema = {k: closed(v) for k, v in schema.items()}
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [closed(v) for v in schema]
    return schema

NAME = {"type": "string", "minLength": 1, "maxLength": 20}
SCHEMAS = [closed(s) for s in [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city", "country"]},
    {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
     "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}}, "required": ["point"]},
    {"type": "object", "properties": {"name": NAME, "nickname": NAME}, "required": ["name"]},  # an optional field
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]},
    {"$defs": {"person": {"type": "object", "properties": {"name": NAME}, "required": ["name"]}},
     "type": "object", "properties": {"author": {"$ref": "#/$defs/person"}, "editor": {"$ref": "#/$defs/person"}},
     "required": ["author", "editor"]},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "ok"}, "code": {"type": "integer", "enum": [200, 404]}},
     "required": ["status", "code"]},
    {"type": "object", "properties": {"id": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000},
                                      "active": {"type": "boolean"}}, "required": ["id", "active"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "null"}]}}, "required": ["value"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["sku", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}}, "required": ["temperature", "unit"]},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^2[0-9]{3}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"title": NAME, "pages": {"type": "integer", "minimum": 1, "maximum": 999},
                                      "meta": {"type": "object", "properties": {"lang": {"enum": ["en", "fr"]}},
                                               "required": ["lang"]}}, "required": ["title", "pages", "meta"]},
]]
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(yes|no)", r"[A-Z][a-z]{2,8}", r"[0-9]{1,4}\.[0-9]{2}",
           r"[a-z]{2,10}@[a-z]{2,10}\.(com|org)", r"#[0-9a-f]{6}", r"(\+|-)?[0-9]{1,4}", r"[A-Z]{3} [0-9]{1,2}",
           r"(ab|cd){2,3}e?", r"[a-zA-Z]{3,6}!"]  # ([0-9], not \d: Unicode has many more digits)
# Arithmetic of a few terms (a small model, free to, may add terms without end)
ARITHMETIC = """
start: expr
expr: term | term ADD term | term ADD term ADD term
term: factor | factor MUL factor
factor: NUMBER | "(" term ADD term ")"
ADD: "+" | "-"
MUL: "*" | "/"
NUMBER: /[1-9][0-9]{0,2}/
"""
ARITHMETIC_GBNF = r'''
root ::= term (("+" | "-") term)? (("+" | "-") term)?
term ::= [1-9] [0-9]? | "(" [1-9] [0-9]? ("*" [1-9] [0-9]?)? ")"
'''


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    model = load_model()
    return LLMEngine(model, create_backend("cpu", model.config, model.model_weights()),
                     EngineConfig(num_kv_blocks=1024, max_num_seqs=64, max_num_batched_tokens=512))


def chat(engine: LLMEngine, question: str) -> list[int]:
    t = engine.tokenizer
    return t.encode(t.render_chat([{"role": "user", "content": question}]))


def generate(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], overlapped: bool = True):
    """Each request's (text, finish reason, outputs), all submitted at once."""
    seqs = [engine.make_sequence(f"r{i}", prompt, params) for i, (prompt, params) in enumerate(requests)]
    outs = run(engine, seqs, overlapped=overlapped)
    return [("".join(o.text for o in outs[s.request_id]), outs[s.request_id][-1].finish_reason, outs[s.request_id])
            for s in seqs]


def constrained(kind: str, spec, **params) -> SamplingParams:
    return SamplingParams(max_tokens=160, constraint=Constraint(kind, spec), **params)


def test_json_schemas_hold_greedy_and_sampled(engine):
    prompt = chat(engine, "Answer in JSON.")
    requests = [(prompt, constrained("json_schema", json.dumps(schema), **p)) for schema in SCHEMAS
                for p in (GREEDY, SAMPLED[0])]
    results = generate(engine, requests)
    for (_, params), (text, reason, _) in zip(requests, results):
        assert reason is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), json.loads(params.constraint.spec))


def test_json_object_regex_and_choice_hold(engine):
    prompt = chat(engine, "Say something.")
    cat = chat(engine, "Describe a cat as a JSON object with its name and age.")
    requests = [(cat, constrained("json_object", "", **p)) for p in [GREEDY, *SAMPLED]]
    requests += [(prompt, constrained("regex", r, **p)) for r in REGEXES for p in (GREEDY, SAMPLED[0])]
    choices = ("Paris", "London", "New York")
    requests += [(chat(engine, "What is the capital of France?"), constrained("choice", choices, **p))
                 for p in [GREEDY, *SAMPLED]]
    results = iter(generate(engine, requests))
    for i in range(3):  # (a sampled one may still be going at max_tokens: cut, as documented)
        text, reason, outs = next(results)
        assert reason is FinishReason.STOP or (i and len(tokens(outs)) == 160), text
        if reason is FinishReason.STOP:
            assert isinstance(json.loads(text), dict), text
    for r in REGEXES:
        for _ in range(2):
            text, reason, _ = next(results)
            assert reason is FinishReason.STOP and re.fullmatch(r, text), (r, text)
    texts = [next(results)[0] for _ in range(3)]
    assert set(texts) <= set(choices)


@pytest.mark.parametrize("grammar", [ARITHMETIC, ARITHMETIC_GBNF], ids=["lark", "gbnf"])
def test_a_grammar_holds(engine, grammar):
    prompt = chat(engine, "Write a short arithmetic expression, such as (2*3)+4.")
    for text, reason, _ in generate(engine, [(prompt, constrained("grammar", grammar, **p)) for p in [GREEDY, *SAMPLED]]):
        assert reason is FinishReason.STOP and re.fullmatch(r"[0-9+\-*/() ]+", text), text
        ast.parse(text, mode="eval")  # Python's parser takes it as an expression


def test_an_unconstrained_request_beside_a_constrained_one_is_unchanged(engine):
    """(greedy on the numpy backend, whose rows do not depend on the batch's)"""
    free = (chat(engine, "Tell me about Paris."), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    alone = generate(engine, [free])[0][2]
    schema = json.dumps(SCHEMAS[0])
    for overlapped in (True, False):
        beside = generate(engine, [free, (chat(engine, "JSON please."), constrained("json_schema", schema, **GREEDY))],
                          overlapped=overlapped)
        assert tokens(beside[0][2]) == tokens(alone)


def test_logprobs_are_of_the_raw_distribution(engine):
    """Logprobs describe the model's own distribution, before the grammar's mask (as
    before penalties): the first token's alternatives are those of a free request."""
    prompt = chat(engine, "What is the capital of France?")
    free, held = generate(engine, [(prompt, SamplingParams(temperature=0.0, max_tokens=1, top_logprobs=5)),
                                   (prompt, constrained("choice", ("London", "Rome"), top_logprobs=5, **GREEDY))])
    first_free, first_held = free[2][0].logprobs[0], held[2][0].logprobs[0]
    assert first_held.top == first_free.top  # (Paris among them, though the grammar forbids it)
    assert held[0] in ("London", "Rome")


def test_preempted_and_recomputed_outputs_still_hold(engine):
    """A cache too small for the batch: sequences are preempted and recomputed, and each
    guide picks up where its output is (greedy: the same text as without preemption)."""
    model = engine.model
    small = LLMEngine(model, create_backend("cpu", model.config, model.model_weights()),
                      EngineConfig(num_kv_blocks=14, max_num_seqs=8, max_num_batched_tokens=128, output_reserve=0.0))
    requests = [(chat(engine, f"Person number {i} as JSON."),
                 SamplingParams(max_tokens=60, constraint=Constraint("json_schema", json.dumps(SCHEMAS[0])), **GREEDY))
                for i in range(6)]
    results = generate(small, requests)
    assert small.scheduler.num_preemptions > 0
    assert [t for t, _, _ in results] == [t for t, _, _ in generate(engine, requests)]
    for text, reason, _ in results:
        jsonschema.validate(json.loads(text), SCHEMAS[0])


def test_length_and_stop_strings_end_a_constrained_output_as_any_other(engine):
    prompt = chat(engine, "Answer in JSON.")
    schema = json.dumps(SCHEMAS[0])
    (cut, reason, outs), (stopped, stop_reason, stop_outs) = generate(engine, [
        (prompt, SamplingParams(temperature=0.0, max_tokens=4, constraint=Constraint("json_schema", schema))),
        (prompt, SamplingParams(temperature=0.0, max_tokens=160, stop=['"age"'], constraint=Constraint("json_schema", schema)))])
    assert reason is FinishReason.LENGTH and len(tokens(outs)) == 4  # incomplete, as documented
    assert stop_reason is FinishReason.STOP and stop_outs[-1].stop_string == '"age"' and '"age"' not in stopped
    assert stopped.startswith("{")


@pytest.mark.parametrize("constraint, says", [
    (Constraint("json_schema", '{"type": "object",'), "not JSON"),
    (Constraint("json_schema", "[1, 2]"), "object or a boolean"),
    (Constraint("json_schema", json.dumps({"type": "object", "unevaluatedProperties": False})), "Unimplemented keys"),
    (Constraint("json_schema", json.dumps({"$ref": "#/$defs/missing"})), "does not exist"),
    (Constraint("json_schema", json.dumps({"type": "banana"})), "banana"),
    (Constraint("regex", "(ab"), "unclosed group"),
    (Constraint("regex", r"\q"), "unrecognized escape"),
    (Constraint("choice", ()), "at least one choice"),
    (Constraint("grammar", "start: foo"), "unknown name"),
    (Constraint("grammar", 'root ::= "a" | ('), "GBNF"),
    (Constraint("grammar", 'start: "' + "a" * 70000 + '"'), "--max-grammar-bytes"),
])
def test_a_bad_constraint_is_refused_with_what_is_wrong(engine, constraint, says):
    with pytest.raises(InvalidRequest, match=re.escape(says)):
        engine.make_sequence("bad", [1, 2, 3], SamplingParams(constraint=constraint))


def test_a_mask_fault_fails_its_step_only(engine, monkeypatch):
    check_a_mask_fault_fails_its_step_only(engine, engine.tokenizer.encode("Spell a long word:"), monkeypatch)
