"""Result lines and error lines (FORMATS.md), built the same way by every path.

The worker, `spec-run` and the producer (for lines rejected at submit time) all
build their output here, so the queue path and the local path write identical
lines. Nothing here imports MLX: results arrive as plain values.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
import time
import zlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:  # only its fields are read: status and collect need not load pydantic
    from jobstore.jobfile import JobLine

#: Error codes of FORMATS.md.
ERROR_CODES = (
    "invalid_request",
    "context_length_exceeded",
    "model_not_served",
    "timeout",
    "worker_lost",
    "cancelled",
    "internal_error",
)


def line_id(batch_id: str, line: int) -> str:
    """`<batch-id>-<line>`: the line's id, its RQ job id and its request id."""
    return f"{batch_id}-{line}"


def effective_seed(batch_id: str, job: JobLine) -> int | None:
    """The seed a request runs with: its own, else (when it samples) one derived from
    (batch id, custom_id), so a retried or re-run line gives the same output. None for
    greedy requests without a seed (the seed cannot matter)."""
    seed = job.params.get("seed")
    if seed is not None or job.params.get("temperature", 0) == 0:
        return seed
    digest = hashlib.sha256(f"{batch_id}\0{job.custom_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


class Choice(NamedTuple):
    """One choice of a result line: what `result_line` reads of each (an engine
    GenerationResult has the same attributes). `logprobs`: one entry per output token,
    {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}, or
    None; `reasoning`: a thinking model's reasoning, or None."""

    text: str
    finish_reason: str
    logprobs: list[dict] | None = None
    reasoning: str | None = None


def result_line(
    batch_id: str,
    job: JobLine,
    model: str,
    choices: Sequence,
    usage: dict,
    metrics: dict,
    seed: int | None,
    created: int | None = None,
) -> dict:
    """A success line: OpenAI batch output wrapping a complete chat.completion or
    text_completion object, plus `metrics` (timings, speculative-decoding counters)
    and the `seed` used.

    `choices`: the line's choices in order (each a Choice or anything with its
    attributes, such as an engine GenerationResult); `usage`: the line's, completion
    tokens summed over its choices. A chat choice carries `message.reasoning_content`
    only when it has reasoning, and `logprobs` as {"content": [...]}; a completion
    choice carries them in the legacy shape (completion_logprobs)."""
    request_id = line_id(batch_id, job.line)
    created = int(time.time()) if created is None else created
    if job.endpoint == "chat":
        body = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [_chat_choice(i, c) for i, c in enumerate(choices)],
        }
    else:
        body = {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": i,
                    "text": c.text,
                    "logprobs": completion_logprobs(_logprobs(c)),
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(choices)
            ],
        }
    body["usage"] = {
        "prompt_tokens": int(usage["prompt_tokens"]),
        "completion_tokens": int(usage["completion_tokens"]),
        "total_tokens": int(usage["total_tokens"]),
        # OpenAI's field: prompt tokens whose state came from the worker's prefix cache.
        "prompt_tokens_details": {"cached_tokens": cached_tokens(usage)},
    }
    body["metrics"] = metrics
    body["seed"] = seed
    body.update(job.echo)
    return {
        "id": request_id,
        "custom_id": job.custom_id,
        "response": {"status_code": 200, "request_id": request_id, "body": body},
        "error": None,
    }


def _logprobs(choice) -> list[dict] | None:
    return getattr(choice, "logprobs", None)


def _chat_choice(index: int, choice) -> dict:
    message = {"role": "assistant", "content": choice.text}
    reasoning = getattr(choice, "reasoning", None)
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    entries = _logprobs(choice)
    return {
        "index": index,
        "message": message,
        "logprobs": None if entries is None else {"content": entries},
        "finish_reason": choice.finish_reason,
    }


def completion_logprobs(entries: list[dict] | None) -> dict | None:
    """The completions endpoint's legacy `logprobs` object from per-token entries (the
    chat shape): {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
    "text_offset"}; text_offset counts characters of the choice's text from 0 (a token
    that ends inside a character counts it once complete)."""
    if entries is None:
        return None
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    offsets, at = [], 0
    for e in entries:
        offsets.append(at)
        raw = e.get("bytes")
        at += len(decoder.decode(bytes(raw))) if raw is not None else len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [
            {t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in entries
        ],
        "text_offset": offsets,
    }


def cached_tokens(usage: dict) -> int:
    """`usage.prompt_tokens_details.cached_tokens` of an engine usage dict (0 if absent)."""
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def error_line(batch_id: str, line: int, custom_id: str | None, code: str, message: str) -> dict:
    """An error line: `response` null, `error` {code, message, line}."""
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    return {
        "id": line_id(batch_id, line),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message, "line": line},
    }


def dumps(line: dict) -> str:
    """One JSONL line (no newline): compact, UTF-8 kept as is."""
    return _ENCODER.encode(line)


# One encoder for every line: json.dumps with options builds a new one per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


# --- stored form ---------------------------------------------------------------------

#: First byte of a line stored compressed (a JSON line starts with "{"; anything else
#: stored is read as plain JSON, as written before compression).
PACKED_V1 = b"\x01"
#: First byte of a packed result line that carries its request's digest: the digest's
#: DIGEST_BYTES bytes follow, then the line deflated as in PACKED_V1. A re-submit
#: compares the digest (`--changed`); nothing else reads it.
PACKED_V2 = b"\x02"
#: A request digest (producer.spool.request_digest: 8 bytes of blake2b), written as
#: 2 * DIGEST_BYTES hex digits everywhere but in a packed line.
DIGEST_BYTES = 8
_DIGEST = re.compile(f"[0-9a-f]{{{2 * DIGEST_BYTES}}}")


def is_digest(value: object) -> bool:
    """Whether a value has a request digest's shape (what `pack` accepts)."""
    return isinstance(value, str) and _DIGEST.fullmatch(value) is not None


#: What result and error lines have in common, so deflate can refer to it instead of
#: storing it again: a line of a few hundred bytes keeps about a third of its size. The
#: strings used most sit at the end (the shortest distances). Never change these bytes:
#: stored lines need them to be read back; a new dictionary needs a new first byte.
_ZDICT_V1 = (
    b'"response":null,"error":{"code":"invalid_request","message":"context_length_exceeded'
    b'model_not_served timeout worker_lost cancelled internal_error (3 attempts)","line":'
    b'{"index":0,"message":{"role":"assistant","content":""},"logprobs":null,"finish_reason'
    b'":"stop"}],"object":"chat.completion","id":"chatcmpl-"mean_acceptance_length":1.0,'
    b'"draft_acceptance_rate":0.0,"per_position_acceptance":[],"draft_tokens_per_position":[]'
    b'{"id":"batch_2026","custom_id":"","response":{"status_code":200,"request_id":"batch_'
    b'"body":{"id":"cmpl-batch_","object":"text_completion","created":17,"model":"demo",'
    b'"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}],"usage":'
    b'{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2},"metrics":'
    b'{"time_to_first_token_ms":1.0,"generation_time_ms":1.0,"tokens_per_second":1.0,'
    b'"speculative_decoding":{"drafter":"model","num_spec_steps":1,"num_draft_tokens":0,'
    b'"num_accepted_draft_tokens":0,"draft_acceptance_rate":0.0,"mean_acceptance_length":1.0,'
    b'"acceptance_histogram":[1],"per_position_acceptance":[],"draft_tokens_per_position":[]},'
    b'"worker":{"name":"","host":""}},"seed":null}},"error":null}'
)


def pack(line_json: str, digest: str | None = None) -> bytes:
    """A line as stored in Redis: deflate against a dictionary of what lines share,
    after the digest of the request it answers when given one (8 bytes in the value
    instead of a hash field of its own: ~80 B a line less). `unpack` reads it back;
    `spec-collect` writes the very same JSON line."""
    # A 4 KiB window covers the dictionary; a larger one only costs set-up time.
    deflate = zlib.compressobj(6, zlib.DEFLATED, -12, 8, zlib.Z_DEFAULT_STRATEGY, _ZDICT_V1)
    body = deflate.compress(line_json.encode("utf-8")) + deflate.flush()
    if digest is None:
        return PACKED_V1 + body
    if not is_digest(digest):
        raise ValueError(f"a request digest is {2 * DIGEST_BYTES} hex digits, got {digest!r}")
    return PACKED_V2 + bytes.fromhex(digest) + body


def packed_digest(raw: bytes) -> str | None:
    """The request digest a stored line carries (PACKED_V2), else None."""
    if raw[:1] != PACKED_V2:
        return None
    return raw[1 : 1 + DIGEST_BYTES].hex()


def unpack(raw: bytes | str, limit: int) -> str:
    """The JSON line of a stored value (packed, with or without its request's digest,
    or plain JSON as written before), at most `limit` bytes. Raises ValueError saying
    what is wrong with damaged bytes."""
    if isinstance(raw, str):
        return raw
    if raw[:1] == PACKED_V2:
        start = 1 + DIGEST_BYTES
    elif raw[:1] == PACKED_V1:
        start = 1
    else:
        return raw.decode("utf-8")  # UnicodeDecodeError is a ValueError
    inflate = zlib.decompressobj(-15, zdict=_ZDICT_V1)
    try:
        data = inflate.decompress(memoryview(raw)[start:], limit + 1)
    except zlib.error as exc:
        raise ValueError(f"not a valid compressed line ({exc})") from exc
    if len(data) > limit or inflate.unconsumed_tail:
        raise ValueError(f"longer than {limit} bytes once decompressed")
    if not inflate.eof:
        raise ValueError("a compressed line cut short")
    return data.decode("utf-8")
