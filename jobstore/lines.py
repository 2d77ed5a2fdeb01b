"""Result lines and error lines (FORMATS.md), built the same way by every path.

The worker, `spec-run` and the producer (for lines rejected at submit time) all
build their output here, so the queue path and the local path write identical
lines. Nothing here imports MLX: results arrive as plain values.
"""

from __future__ import annotations

import hashlib
import json
import time

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


def result_line(
    batch_id: str,
    job: JobLine,
    model: str,
    text: str,
    finish_reason: str,
    usage: dict,
    metrics: dict,
    seed: int | None,
    created: int | None = None,
) -> dict:
    """A success line: OpenAI batch output wrapping a complete chat.completion or
    text_completion object, plus `metrics` (timings, speculative-decoding counters)
    and the `seed` used."""
    request_id = line_id(batch_id, job.line)
    created = int(time.time()) if created is None else created
    if job.endpoint == "chat":
        body = {
            "id": f"chatcmpl-{request_id}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            ],
        }
    else:
        body = {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            ],
        }
    body["usage"] = {
        "prompt_tokens": int(usage["prompt_tokens"]),
        "completion_tokens": int(usage["completion_tokens"]),
        "total_tokens": int(usage["total_tokens"]),
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
    return json.dumps(line, ensure_ascii=False, separators=(",", ":"))
