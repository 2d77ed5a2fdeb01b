"""Held-out code prompts: functions from standard-library files the demo pair never saw.

scripts/train_demo_pair.py picks the stdlib `.py` files in sorted order (skipping
tests, GUI code and a few others, up to MAX_CORPUS_BYTES) and holds out every
HOLDOUT_EVERY-th one. `heldout_files()` repeats that selection, so prompts come from
files that were not in the demo pair's training text.
"""

from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
import textwrap
from pathlib import Path

# Must match scripts/train_demo_pair.py (Settings.max_corpus_mb, holdout_every, SKIP_DIRS).
MAX_CORPUS_BYTES = int(9.0 * 1024 * 1024)
HOLDOUT_EVERY = 10
SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "encodings",
}


def heldout_files() -> list[Path]:
    """The stdlib files the demo pair held out of training, in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if parts & SKIP_DIRS or path.name.startswith("config-"):
            continue
        size = path.stat().st_size
        if total + size > MAX_CORPUS_BYTES:
            continue
        chosen.append(path)
        total += size
    return [f for i, f in enumerate(chosen) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]


@functools.cache
def functions(min_chars: int = 600, max_chars: int = 3000) -> list[tuple[str, str]]:
    """(name, dedented source) of every function or method in the held-out files
    whose source is between min_chars and max_chars long (read once a process)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in heldout_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = _LINE.findall(text)  # once a file: ast.get_source_segment splits per call
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            src = _segment(lines, node)
            if min_chars <= len(src) <= max_chars:
                rel = path.relative_to(root).as_posix()
                out.append((f"{rel}:{node.lineno}:{node.name}", textwrap.dedent(src)))
    return out


# A line and its end (\r\n, \n or \r), as ast.get_source_segment splits source.
_LINE = re.compile(r".*?(?:\r\n|\n|\r)|.+$", re.DOTALL)


def _segment(lines: list[str], node: ast.AST) -> str:
    """The node's source, its first line padded as ast.get_source_segment(padded=True)
    pads it (column offsets count UTF-8 bytes)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    head = lines[first].encode()
    if first == last:
        return head[node.col_offset : node.end_col_offset].decode()
    pad = "".join(c if c in "\f\t" else " " for c in head[: node.col_offset].decode())
    tail = lines[last].encode()[: node.end_col_offset].decode()
    return pad + head[node.col_offset :].decode() + "".join(lines[first + 1 : last]) + tail


def _spread(items: list, n: int) -> list:
    """n items evenly spaced over the list (deterministic, covers many files)."""
    if n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def code_prompts(tokenizer, n: int, prompt_tokens: int) -> list[tuple[str, list[int]]]:
    """n prompts: the first prompt_tokens tokens of held-out functions."""
    picked = _spread(functions(), n)
    out = []
    for name, src in picked:
        ids = tokenizer.encode(src, add_special_tokens=False)
        out.append((name, ids[:prompt_tokens]))
    return out


def prompt_pool(tokenizer, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """The first prompt_tokens tokens of every held-out function, in a shuffled order (so
    that n in a row come from many files): the pool of `lockstep.py --fresh`."""
    pool = [ids for _, ids in code_prompts(tokenizer, len(functions()), prompt_tokens)]
    random.Random(seed).shuffle(pool)
    return pool


LOOKUP_HEADER = "# Original version:\n"
LOOKUP_SEPARATOR = "\n\n# The same code, copied exactly:\n"


def lookup_prompts(
    tokenizer, n: int, head_tokens: int = 12, body_tokens: tuple[int, int] = (60, 110)
) -> list[tuple[str, list[int]]]:
    """n input-grounded prompts: a held-out function of body_tokens tokens, then the
    start of the same function again, so the natural continuation copies from the prompt.
    (Short functions: the demo pair was trained on windows of at most 256 tokens, so the
    prompt and 96 new tokens stay within that.)"""
    out = []
    for name, src in functions(200, 1000):
        body = tokenizer.encode(src, add_special_tokens=False)
        if body_tokens[0] <= len(body) <= body_tokens[1]:
            text = LOOKUP_HEADER + src + LOOKUP_SEPARATOR
            ids = tokenizer.encode(text, add_special_tokens=False) + body[:head_tokens]
            out.append((name, ids))
    if len(out) < n:
        raise SystemExit(f"only {len(out)} held-out functions of {body_tokens} tokens")
    return _spread(out, n)
