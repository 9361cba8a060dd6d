"""Logs that no request can forge or garble: control characters escaped in the text
format, one JSON object a line in the JSON format, as the server writes them."""

from __future__ import annotations

import json
import logging
import re

import grpc
import pytest

from llamastream.v1 import generation_pb2 as pb
from server.log_format import JsonFormatter, TextFormatter, escape_controls
from tests.conftest import TINY_MODEL
from tests.serving import ServerProcess, collect, stub

FORGED = "\nINFO llamastream.requests: request_id=forged status=OK\r\x1b[2K\x07\x00"
TIMESTAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}"
RECORD_START = re.compile(TIMESTAMP + r" [A-Z]+ [\w.]+: ")
REQUEST_RECORD = re.compile(TIMESTAMP + r" INFO llamastream\.requests: request_id=(\S*)")


def record(message: str, *args, fields=None, exc_info=None) -> logging.LogRecord:
    r = logging.LogRecord("llamastream.requests", logging.INFO, __file__, 1, message, args, exc_info)
    if fields is not None:
        r.fields = fields
    return r


def test_escape_controls_leaves_no_control_character():
    escaped = escape_controls(FORGED + "\u2028\u202e\x85")
    assert escaped.isprintable() and "\\n" in escaped and "\\x1b" in escaped and "\\u202e" in escaped


def test_text_records_are_one_line_with_fields_quoted_where_needed():
    line = TextFormatter().format(record("prompt %r and %s", "x", FORGED, fields={"request_id": "a=b", "n": 3}))
    assert "\n" not in line and line.isprintable()
    assert line.endswith(' request_id="a=b" n=3')


def test_a_traceback_cannot_pass_for_a_record():
    try:
        raise ValueError(FORGED)
    except ValueError:
        import sys

        text = TextFormatter().format(record("step failed", exc_info=sys.exc_info()))
    first, *rest = text.split("\n")
    assert RECORD_START.match(first) and rest
    assert all(line.startswith("    ") and line.isprintable() for line in rest)


def test_json_records_carry_fields_as_keys():
    entry = json.loads(JsonFormatter().format(record("%s", FORGED, fields={"request_id": "r1", "completion_tokens": 9})))
    assert entry["message"] == FORGED and entry["request_id"] == "r1" and entry["completion_tokens"] == 9
    assert entry["level"] == "INFO" and entry["logger"] == "llamastream.requests"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_the_servers_log_holds_no_forged_line(log_format):
    """A request id that tries to write a record is refused, and a prompt that tries it
    (logged with --log-prompts) stays inside its own record."""
    with ServerProcess("--model", str(TINY_MODEL), "--log-prompts", "--log-format", log_format) as s:
        client = stub(s.address)
        with pytest.raises(grpc.RpcError) as e:
            collect(client.Generate(pb.GenerateRequest(request_id="a" + FORGED, prompt="hi"), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        request = pb.GenerateRequest(request_id="honest", prompt="hi" + FORGED, stop=pb.StopCriteria(max_tokens=2))
        collect(client.Generate(request, timeout=30))
        s.terminate()
        s.proc.wait(60)
        output = s.output()
    lines = output.splitlines()
    assert not any(c in output for c in "\x1b\x07\x00\r")
    if log_format == "json":
        entries = [json.loads(line) for line in lines]  # every line is one record
        logged = [e["request_id"] for e in entries if e["logger"] == "llamastream.requests"]
    else:
        assert all(RECORD_START.match(line) or line.startswith("    ") for line in lines if line.strip())
        logged = [m.group(1) for line in lines if (m := REQUEST_RECORD.match(line))]
    assert logged == ["-", "honest"]  # the refused id is not logged; nothing forged one
