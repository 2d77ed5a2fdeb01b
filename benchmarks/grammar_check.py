"""How long the submit-side constraint check (jobstore.grammars) takes on hostile
constraints, and what it says of each: deep and wide schemas, huge enums, regexes
with exponential automata, large Lark grammars, and one that crashes llguidance.

    python benchmarks/grammar_check.py

Each row: the seconds `check_constraint` took and its verdict (ok or the line error).
The first row includes starting the compiling child; the last shows a cache hit.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jobstore import grammars  # noqa: E402


def _schema(schema) -> dict:
    return {"type": "json_schema", "schema": schema, "whitespace_flexible": False}


def _nested(levels: int) -> dict:
    node: dict = {"type": "string"}
    for _ in range(levels):
        node = {"type": "object", "properties": {"a": node}, "required": ["a"]}
    return node


def _props(n: int) -> dict:
    return {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(n)}}


def _chain(n: int) -> str:
    rules = "\n".join(f'r{i}: "a" r{i + 1} | "b" r{i + 1}' for i in range(n))
    return f'start: r0\n{rules}\nr{n}: "c"'


CASES = [
    ("warm-up (child start)", "guided_regex", {"type": "regex", "pattern": "a+"}),
    ("nested 30 levels", "guided_json", _schema(_nested(30))),
    ("nested 60 levels", "guided_json", _schema(_nested(60))),
    ("5000 optional properties", "guided_json", _schema(_props(5000))),
    ("9500 optional properties", "guided_json", _schema(_props(9500))),
    ("enum of 18000", "guided_json", _schema({"enum": [f"v-{i}" for i in range(18000)]})),
    ("enum of 100000", "guided_json", _schema({"enum": [f"value-{i}" for i in range(100000)]})),
    ("regex (a|b)*a(a|b){60}", "guided_regex", {"type": "regex", "pattern": "(a|b)*a(a|b){60}"}),
    (
        "regex ((a{100}){100}){100}",
        "guided_regex",
        {"type": "regex", "pattern": "((a{100}){100}){100}"},
    ),
    (
        "lark, 20000 alternatives",
        "guided_grammar",
        {"type": "grammar", "grammar": "start: " + " | ".join(f'"w{i}"' for i in range(20000))},
    ),
    ("lark, 3000 chained rules", "guided_grammar", {"type": "grammar", "grammar": _chain(3000)}),
    ("9500 properties again", "guided_json", _schema(_props(9500))),
]


def main() -> None:
    for name, field, constraint in CASES:
        started = time.perf_counter()
        problem = grammars.check_constraint(field, constraint)
        took = time.perf_counter() - started
        print(f"{name:30s} {took:7.3f} s  {problem or 'ok'}"[:160], flush=True)
    print(f"compiles: {grammars.compiles()} (deadline {grammars.COMPILE_TIMEOUT_S:g} s)")


if __name__ == "__main__":
    main()
