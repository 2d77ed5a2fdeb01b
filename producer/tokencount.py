"""The prompt-versus-context check at submit time, without MLX.

The producer counts prompt tokens with the `tokenizers` library when it is installed,
using the tokenizer a worker registered for the alias in Redis (`P:model:<alias>`), or,
for the "demo" alias, the bundled `engine/demo/target/tokenizer.json` read as a plain
file (the engine package is never imported). The count is a lower bound: the prompt
without special tokens, chat messages as their contents without the template. So the
check never rejects a line that fits; the worker checks again, exactly, and writes a
`context_length_exceeded` error line for what slips through.

Counting stops once the count passes what the context leaves for the prompt, and a long
text is tokenized WINDOW_CHARS characters at a time: the tokenizers library holds about
200 bytes per character while it encodes, so a whole 8 MB prompt would cost ~2 GB.
"""

from __future__ import annotations

import json
import re

from redis import Redis

from jobstore import config
from jobstore.jobfile import JobLine, LineError
from jobstore.keys import Keys

DEMO_TARGET_DIR = config.DEMO_PAIR_DIR / "target"


class _Model:
    def __init__(self, tokenizer, context_length: int | None):
        self.tokenizer = tokenizer
        self.context_length = context_length


class ContextChecker:
    """Callable per line: a LineError when the prompt plus max_tokens cannot fit the
    model's context, else None. Models are looked up once per alias."""

    def __init__(self, conn: Redis | None, keys: Keys, default_model: str):
        self._conn = conn
        self._keys = keys
        self._default = default_model
        self._models: dict[str, _Model | None] = {}

    def __call__(self, job: JobLine) -> LineError | None:
        alias = job.model or self._default
        model = self._model(alias)
        if model is None or model.context_length is None:
            return None
        max_tokens = job.params["max_tokens"]
        field = job.prefix + job.prompt_field
        if max_tokens >= model.context_length:
            return LineError(
                job.line,
                job.prefix + "max_tokens",
                f"must be < the context of model {alias} ({model.context_length} tokens), "
                f"got {max_tokens}",
                job.custom_id,
            )
        if model.tokenizer is None:
            return None
        if job.endpoint == "completion":
            texts = [job.params["prompt"]]
        else:
            texts = [m["content"] for m in job.params["messages"]]
        # Cheap bound first: a (byte-level) token covers at least one UTF-8 byte.
        if sum(len(t.encode()) for t in texts) <= model.context_length - max_tokens:
            return None
        n = count_tokens(model.tokenizer, texts, model.context_length - max_tokens)
        if n + max_tokens > model.context_length:
            return LineError(
                job.line,
                field,
                f"too long for model {alias}: at least {n} prompt tokens + max_tokens "
                f"{max_tokens} > context {model.context_length} tokens",
                job.custom_id,
            )
        return None

    def _model(self, alias: str) -> _Model | None:
        if alias not in self._models:
            self._models[alias] = self._load(alias)
        return self._models[alias]

    def _load(self, alias: str) -> _Model | None:
        tokenizer_json, context = None, None
        if self._conn is not None:
            fields = self._conn.hmget(self._keys.model(alias), "tokenizer_json", "context_length")
            if fields[1] is not None:
                tokenizer_json, context = fields[0], int(fields[1])
        if (
            context is None
            and alias == config.DEFAULT_MODEL
            and (DEMO_TARGET_DIR / "config.json").is_file()
        ):
            cfg = json.loads((DEMO_TARGET_DIR / "config.json").read_text())
            context = _context_length(cfg)
            path = DEMO_TARGET_DIR / "tokenizer.json"
            tokenizer_json = path.read_bytes() if path.is_file() else None
        if context is None:
            return None
        return _Model(_tokenizer(tokenizer_json), context)


#: Characters tokenized per call while counting a long prompt (bounds memory).
WINDOW_CHARS = 1 << 16

_WORD_START = re.compile(r"\s(?=\S)")


def count_tokens(tokenizer, texts: list[str], limit: int) -> int:
    """Tokens of `texts` (no special tokens), counted until the count passes `limit`:
    exact when it is at most `limit`, else a lower bound above `limit`.

    A text longer than WINDOW_CHARS is tokenized a window at a time, each cut made
    before the last space that starts a word (where a byte-level or metaspace
    tokenizer starts a new pre-token anyway), and one token per cut is taken off, so
    the sum stays a lower bound of the whole text's count.
    """
    n = 0
    for text in texts:
        start = 0
        while start < len(text) and n <= limit:
            end = start + WINDOW_CHARS
            if end < len(text):
                last = None
                for last in _WORD_START.finditer(text, start + 1, end + 1):  # noqa: B007
                    pass
                end = last.start() if last is not None else end
            piece = text[start:end]
            n += len(tokenizer.encode(piece, add_special_tokens=False).ids)
            if end < len(text):
                n -= 1
            start = end
    return n


def _context_length(cfg: dict) -> int:
    # Same keys, same order, same fallback as engine.loading.context_length_of.
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        if cfg.get(key):
            return int(cfg[key])
    return 4096


def _tokenizer(data: bytes | str | None):
    if not data:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:  # optional on a submit-only machine: the worker checks anyway
        return None
    try:
        return Tokenizer.from_str(data.decode() if isinstance(data, bytes) else data)
    except Exception:  # a tokenizer this library cannot read: leave it to the worker
        return None
