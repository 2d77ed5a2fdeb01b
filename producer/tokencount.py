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

from redis import Redis

from jobstore import config
from jobstore.jobfile import JobLine, LineError
from jobstore.keys import Keys
from jobstore.tokens import WINDOW_CHARS, count_tokens, prompt_texts, tokens_over

__all__ = ["WINDOW_CHARS", "ContextChecker", "count_tokens"]

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
        n = tokens_over(model.tokenizer, prompt_texts(job), max_tokens, model.context_length)
        if n is not None:
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
