"""What a request may hold its output to, and the llguidance grammar of each kind."""

from __future__ import annotations

import json
from dataclasses import dataclass

import llguidance

from engine.sampling_params import InvalidRequest

CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
ANY_JSON_OBJECT = '{"type": "object"}'
# Whitespace between JSON tokens: enough to pretty-print a few levels deep, and bounded,
# since a small model may otherwise emit blank lines without end. A schema's own
# "x-guidance" options take precedence.
JSON_OPTIONS = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}


@dataclass(frozen=True)
class Constraint:
    """`kind` is one of CONSTRAINT_KINDS; `spec` the JSON schema (as JSON text), the
    regex, the grammar (Lark, as llguidance reads it, or llama.cpp's GBNF) or the
    choices; nothing for json_object. Errors name the field as llamastream.v1 does
    (structured.KIND)."""

    kind: str
    spec: str | tuple[str, ...] = ""

    @property
    def size(self) -> int:
        """Bytes of its specification (what --max-grammar-bytes bounds)."""
        parts = self.spec if isinstance(self.spec, tuple) else (self.spec,)
        return sum(len(p.encode()) for p in parts)

    def grammar(self) -> str:
        """Its llguidance grammar, not yet checked against a tokenizer; raises
        InvalidRequest for a specification llguidance cannot read."""
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=JSON_OPTIONS)
        if self.kind == "choice":
            if not self.spec or any(not c for c in self.spec):
                raise InvalidRequest("structured.choice: give at least one choice, none of them empty")
            return llguidance.grammar_from("choice", json.dumps(list(self.spec)))
        if not self.spec:
            raise InvalidRequest(f"structured.{self.kind}: the {self.kind.replace('_', ' ')} is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"structured.json_schema: not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("structured.json_schema: a schema is an object or a boolean, not "
                                     f"{type(schema).__name__}")
            return llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        try:
            return llguidance.grammar_from(self.kind, self.spec)
        except ValueError as e:  # (a grammar that is neither Lark nor GBNF)
            raise InvalidRequest(f"structured.{self.kind}: {e}") from None
