"""The submit-side check of output constraints (jobstore.grammars): a constraint that
does not compile is refused with llguidance's reason, hostile ones are bounded in time
and memory, and one schema compiles once per process. No model, no Redis."""

from __future__ import annotations

import json
import sys

import pytest

from jobstore import grammars
from jobstore.jobfile import LineError, parse_line

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


def _line(number: int, schema: dict) -> bytes:
    body = {
        "messages": [{"role": "user", "content": "a record"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
    }
    return json.dumps({"custom_id": f"c{number}", **body}).encode()


def test_the_second_line_with_the_same_schema_compiles_nothing():
    schema = {**SCHEMA, "title": "once"}  # a schema no other test compiled
    before = grammars.compiles()
    (first,) = parse_line(1, _line(1, schema))
    assert grammars.compiles() == before + 1
    (second,) = parse_line(2, _line(2, dict(schema)))
    assert grammars.compiles() == before + 1
    assert first.params["constraint"] == second.params["constraint"]
    # A refused schema is remembered too.
    bad = {"type": "array", "uniqueItems": True, "title": "once"}
    errors = parse_line(3, _line(3, bad)) + parse_line(4, _line(4, bad))
    assert [e.message for e in errors] == ['Unimplemented keys: ["uniqueItems"]'] * 2
    assert grammars.compiles() == before + 2


def test_a_deep_or_huge_schema_is_refused_before_compiling():
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    huge = {"enum": [f"value-{i}" for i in range(30000)]}
    before = grammars.compiles()
    (e1,) = parse_line(1, _line(1, deep))
    (e2,) = parse_line(2, _line(2, huge))
    assert isinstance(e1, LineError) and isinstance(e2, LineError)
    assert e1.field == e2.field == "response_format.json_schema.schema"
    assert e1.message == "nested deeper than 64 levels"
    assert e2.message.startswith("too large to compile: 409033 bytes as a grammar, over 262144")
    assert grammars.compiles() == before


def test_a_grammar_that_crashes_the_compiler_is_an_error_not_a_crash():
    # llguidance overflows its stack on this one (a segmentation fault in-process).
    n = 3000
    rules = "\n".join(f'r{i}: "a" r{i + 1} | "b" r{i + 1}' for i in range(n))
    text = f'start: r0\n{rules}\nr{n}: "c"'
    raw = json.dumps({"custom_id": "g", "prompt": "x", "guided_grammar": text}).encode()
    (error,) = parse_line(1, raw)
    assert error.field == "guided_grammar"
    assert error.message.startswith("the grammar compiler crashed on it")
    # The next compile gets a fresh child.
    (ok,) = parse_line(2, b'{"custom_id": "h", "prompt": "x", "guided_regex": "[0-9]{3}"}')
    assert ok.params["constraint"] == {"type": "regex", "pattern": "[0-9]{3}"}


def test_a_compile_past_its_deadline_is_an_error(monkeypatch):
    compiler = grammars._Compiler()
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(
        compiler, "_start", lambda: __import__("subprocess").Popen(hang, stdin=-1, stdout=-1)
    )
    monkeypatch.setattr(grammars, "_COMPILER", compiler)
    monkeypatch.setattr(grammars, "COMPILE_TIMEOUT_S", 0.5)
    raw = b'{"custom_id": "t", "prompt": "x", "guided_regex": "deadline-[a-z]+"}'
    (error,) = parse_line(1, raw)
    assert (error.field, error.message) == ("guided_regex", "took longer than 0.5 s to compile")
    assert compiler.proc is None  # the late child was killed


@pytest.mark.parametrize(
    "door,field",
    [
        ('"structured_outputs": {"regex": "(a"}', "structured_outputs.regex"),
        ('"guided_json": {"type": "string", "format": "nope"}', "guided_json"),
        (
            '"structured_outputs": {"json": {"x-guidance": {"lenient": true}, "not": {}}}',
            "structured_outputs.json",
        ),
    ],
)
def test_errors_name_the_field_that_holds_the_constraint(door, field):
    (error,) = parse_line(1, ('{"custom_id": "f", "prompt": "x", ' + door + "}").encode())
    assert isinstance(error, LineError) and error.field == field, error


def test_a_worker_refuses_a_stored_constraint_that_does_not_compile():
    from jobstore.jobfile import JobLine
    from worker.execute import unusable_constraint

    record = {
        "line": 3,
        "custom_id": "raw",
        "endpoint": "completion",
        "model": "demo",
        "params": {"prompt": "x", "max_tokens": 4, "temperature": 0.0},
    }
    assert unusable_constraint("B", JobLine.from_record(record)) is None
    record["params"]["constraint"] = {"type": "grammar", "grammar": "start: nowhere"}
    outcome = unusable_constraint("B", JobLine.from_record(record))
    assert not outcome.ok and outcome.line["error"] == {
        "code": "invalid_request",
        "message": 'constraint: at 1(8): unknown name: "nowhere" 1 | start: nowhere ^',
        "line": 3,
    }
