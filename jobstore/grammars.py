"""Checking a line's output constraint at submit: its grammar must compile.

A JSON schema, regex or grammar that llguidance cannot compile becomes a line error
naming the field and llguidance's reason before anything is queued; so do the
JSON-schema keywords llguidance does not implement (it names them: `Unimplemented
keys: ["not"]`; a warning, e.g. under the schema's own `x-guidance: {lenient: true}`,
is refused as well, since an output could then break the schema).

Compiling is bounded: the schema's nesting depth and the grammar's size are checked
first (MAX_SCHEMA_DEPTH, MAX_GRAMMAR_BYTES), then llguidance compiles it under
`contract.constraints.PARSER_LIMITS` in a child process (`python -m jobstore.grammars`,
started once and reused) with a memory cap and a deadline (COMPILE_TIMEOUT_S). A
child, not a thread: llguidance overflows its stack and kills its process on some
grammars (a Lark grammar of 3000 chained rules, ~90 KB, does), and a thread could
not be stopped at a deadline. A child that dies or runs late is replaced and the line
gets an error saying so.

Verdicts are cached per process by `contract.constraints.key`, so a million lines with
one schema compile it once (`compiles()` counts real compiles). Standard library only
in this process: llguidance is imported by the child alone.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from collections import OrderedDict
from pathlib import Path

from contract.constraints import PARSER_LIMITS, ConstraintError, grammar, key

#: A schema nested deeper than this (objects and arrays, counted as JSON) is refused
#: before compiling (llguidance's own JSON reader stops near 128).
MAX_SCHEMA_DEPTH = 64
#: A constraint whose llguidance grammar text is larger than this is refused unread
#: (a 9500-property schema, ~250 KB, compiles in about 3 s on one core).
MAX_GRAMMAR_BYTES = 256 * 1024
#: Seconds one compile may take before the line is refused and the child replaced.
COMPILE_TIMEOUT_S = 15.0
#: Address space of the compiling child, in bytes (where the OS enforces it).
COMPILE_MEMORY_BYTES = 2 << 30
#: Verdicts kept per process (least recently used dropped first).
CACHE_ENTRIES = 4096

_cache: OrderedDict[str, str | None] = OrderedDict()
_lock = threading.Lock()
_compiles = 0


def compiles() -> int:
    """How many constraints this process has compiled (cache misses that compiled)."""
    return _compiles


def check_constraint(field: str, constraint: dict) -> ConstraintError | None:
    """None if the constraint compiles, else a ConstraintError naming the field that
    holds it (`response_format.json_schema.schema`, `structured_outputs.regex`,
    `guided_grammar`...) and the reason. `field`: the top-level field that set it
    (`contract.constraints.normalise`)."""
    where = _where(field, constraint)
    if constraint["type"] == "json_schema":
        depth = _depth(constraint["schema"], MAX_SCHEMA_DEPTH)
        if depth > MAX_SCHEMA_DEPTH:
            return ConstraintError(where, f"nested deeper than {MAX_SCHEMA_DEPTH} levels")
    verdict = _verdict(key(constraint), constraint)
    return None if verdict is None else ConstraintError(where, verdict)


def _where(field: str, constraint: dict) -> str:
    if field == "response_format":
        return "response_format.json_schema.schema"
    if field == "structured_outputs":
        kind = constraint["type"]
        return "structured_outputs." + ("json" if kind == "json_schema" else kind)
    return field


def _depth(value, limit: int) -> int:
    """Nesting depth of a JSON value (containers counted), without recursion; stops
    counting past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _verdict(cache_key: str, constraint: dict) -> str | None:
    """Why the constraint does not compile (None: it does), from the cache or else by
    building its grammar, bounding its size and compiling it."""
    global _compiles
    with _lock:
        if cache_key in _cache:
            _cache.move_to_end(cache_key)
            return _cache[cache_key]
        data = grammar(constraint).encode("utf-8")
        if len(data) > MAX_GRAMMAR_BYTES:
            verdict = (
                f"too large to compile: {len(data)} bytes as a grammar, over {MAX_GRAMMAR_BYTES}"
            )
        else:
            verdict = _COMPILER.check(data)
            _compiles += 1
        _cache[cache_key] = verdict
        if len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
        return verdict


class _Compiler:
    """The compiling child: one grammar in (its length on a line, then its bytes), one
    JSON line out ({"error": bool, "messages": [...]}). Used under `_lock`."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        root = str(Path(__file__).resolve().parent.parent)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        return subprocess.Popen(
            [sys.executable, "-m", "jobstore.grammars"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout):
                pipe.close()
            self.proc = None

    def check(self, data: bytes) -> str | None:
        """None if llguidance compiles the grammar `data` (UTF-8), else why not, in one
        line."""
        for attempt in (1, 2):  # a child that died since its last use is replaced once
            if self.proc is None or self.proc.poll() is not None:
                self._stop()
                self.proc = self._start()
            try:
                self.proc.stdin.write(b"%d\n" % len(data) + data)
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._stop()
                if attempt == 2:
                    return "the grammar compiler could not be started"
                continue
            return self._answer()
        return None  # pragma: no cover

    def _answer(self) -> str | None:
        out = self.proc.stdout
        ready, _, _ = select.select([out], [], [], COMPILE_TIMEOUT_S)
        if not ready:
            self._stop()
            return f"took longer than {COMPILE_TIMEOUT_S:g} s to compile"
        raw = out.readline()
        if not raw:
            code = self.proc.wait()
            self._stop()
            return (
                f"the grammar compiler crashed on it (exit status {code}): "
                "too large or too deeply nested to compile"
            )
        answer = json.loads(raw)
        messages = [" ".join(m.split()) for m in answer["messages"]]
        if answer["error"]:
            return _short(messages[0] if messages else "does not compile")
        if messages:  # warnings: something in it would not be enforced
            return _short("not supported: " + "; ".join(messages))
        return None


def _short(message: str, limit: int = 400) -> str:
    return message if len(message) <= limit else message[: limit - 3] + "..."


_COMPILER = _Compiler()


def _serve() -> None:
    """The child's loop (`python -m jobstore.grammars`)."""
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (COMPILE_MEMORY_BYTES, COMPILE_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):  # not enforced here: the deadline still is
        pass
    import llguidance

    limits = llguidance.LLParserLimits(**PARSER_LIMITS)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.readline()
        if not header:
            return
        text = stdin.read(int(header)).decode("utf-8")
        try:
            error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                text, limits=limits
            )
        except Exception as exc:  # an error llguidance raises instead of returning
            error, messages = True, [f"{type(exc).__name__}: {exc}"]
        stdout.write(json.dumps({"error": error, "messages": messages}).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    _serve()
