"""Atomic writes of lines and counters (Lua scripts), and the counter arithmetic.

Every line is written through `store_line`: the line and its counters go in
together, once per (batch, line key), even if a job runs twice. Counters are plain
integers (HINCRBY), so batch, worker and fleet totals are exact sums. Each write
renews the batch's TTL on every key of the batch (the batch's own `result_ttl`,
set by `spec-submit --result-ttl`, else the writer's SPEC_RESULT_TTL_S), and a line
over SPEC_MAX_RESULT_BYTES is replaced by an error line saying so.
"""

from __future__ import annotations

import json
import logging
import time

from redis import Redis

from jobstore import config
from jobstore.keys import JOB_DIGEST_CHARS, Keys, job_id_stem
from jobstore.lines import dumps, error_line
from jobstore.stats import drafter_of, summary

log = logging.getLogger("specfleet.store")

_STORE = """
-- KEYS: 1 meta, 2 results, 3 errors, 4 done, 5 batch workers, 6 worker stats,
--       7 order, 8 requests, 9 submitting flag
-- ARGV: 1 line key, 2 'result'|'error', 3 line JSON, 4 now, 5 worker ('' = none),
--       6 ttl seconds when the batch sets none (0 = none), 7.. counter name / increment pairs
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[3], ARGV[1]) == 1 then
  return 0
end
local outcome, target = 'failed', KEYS[3]
if ARGV[2] == 'result' then outcome, target = 'completed', KEYS[2] end
redis.call('HSET', target, ARGV[1], ARGV[3])
redis.call('RPUSH', KEYS[4], ARGV[1])
redis.call('HINCRBY', KEYS[1], outcome, 1)
redis.call('HSET', KEYS[1], 'last_done_at', ARGV[4])
local worker = ARGV[5]
if worker ~= '' then
  redis.call('HINCRBY', KEYS[5], outcome .. ':' .. worker, 1)
  redis.call('HINCRBY', KEYS[6], outcome, 1)
end
for i = 7, #ARGV, 2 do
  local name, n = ARGV[i], tonumber(ARGV[i + 1])
  redis.call('HINCRBY', KEYS[1], name, n)
  if worker ~= '' then
    redis.call('HINCRBY', KEYS[6], name, n)
    if name == 'completion_tokens' or name == 'prompt_tokens' or name == 'busy_ms' then
      redis.call('HINCRBY', KEYS[5], name .. ':' .. worker, n)
    end
  end
end
local done = tonumber(redis.call('HGET', KEYS[1], 'completed') or '0')
  + tonumber(redis.call('HGET', KEYS[1], 'failed') or '0')
if done >= redis.call('ZCARD', KEYS[7]) and redis.call('EXISTS', KEYS[9]) == 0 then
  redis.call('HSETNX', KEYS[1], 'completed_at', ARGV[4])
end
if worker ~= '' then redis.call('EXPIRE', KEYS[6], 604800) end  -- worker stats: a week idle
local ttl = tonumber(redis.call('HGET', KEYS[1], 'result_ttl') or ARGV[6])
if ttl > 0 then
  for _, i in ipairs({1, 2, 3, 4, 5, 7, 8}) do redis.call('EXPIRE', KEYS[i], ttl) end
end
return 1
"""

_CLASSIFY = """
-- KEYS: 1 results, 2 errors, 3 requests
-- ARGV: pairs (line key, 'rq:job:' .. its job id stem, to which the request's line is added)
-- -> per key: 'done' (has a result), 'error' (has an error line), 'pending' (its job
--    is queued or running) or 'new'
local out = {}
for i = 1, #ARGV, 2 do
  local k, s = ARGV[i], 'new'
  if redis.call('HEXISTS', KEYS[1], k) == 1 then s = 'done'
  elseif redis.call('HEXISTS', KEYS[2], k) == 1 then s = 'error'
  else
    local rec = redis.call('HGET', KEYS[3], k)
    if rec then
      local line = string.format('%d', cjson.decode(rec)['line'])
      local st = redis.call('HGET', ARGV[i + 1] .. line, 'status')
      if st == 'queued' or st == 'started' or st == 'deferred' or st == 'scheduled' then
        s = 'pending'
      end
    end
  end
  out[#out + 1] = s
end
return out
"""

_REBUILD_LIST = """
local function rebuild(key, keep)
  redis.call('DEL', key)
  for i = 1, #keep, 1000 do
    redis.call('RPUSH', key, unpack(keep, i, math.min(i + 999, #keep)))
  end
end
"""

_CLEAR_ERRORS = (
    _REBUILD_LIST
    + """
-- KEYS: 1 meta, 2 errors, 3 done; ARGV: line keys whose error lines are dropped
local gone, n = {}, 0
for i = 1, #ARGV do
  if redis.call('HDEL', KEYS[2], ARGV[i]) == 1 then n = n + 1; gone[ARGV[i]] = true end
end
if n > 0 then
  redis.call('HINCRBY', KEYS[1], 'failed', -n)
  redis.call('HDEL', KEYS[1], 'completed_at')
  local keep = {}
  for _, v in ipairs(redis.call('LRANGE', KEYS[3], 0, -1)) do
    if not gone[v] then keep[#keep + 1] = v end
  end
  rebuild(KEYS[3], keep)
end
return n
"""
)

_REMOVE_QUEUED = (
    _REBUILD_LIST
    + """
-- KEYS: 1 an RQ queue list; ARGV: 1 job id prefix ('<batch>-'), 2 digest length
-- Removes the batch's job ids (prefix, hex digest, '-', digits) and returns them.
local p, removed, keep = ARGV[1], {}, {}
local tail = '^' .. string.rep('%x', tonumber(ARGV[2])) .. '%-%d+$'
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  if string.sub(id, 1, #p) == p and string.match(string.sub(id, #p + 1), tail) then
    removed[#removed + 1] = id
  else
    keep[#keep + 1] = id
  end
end
if #removed > 0 then rebuild(KEYS[1], keep) end
return removed
"""
)


def store_line(
    conn: Redis,
    keys: Keys,
    batch_id: str,
    line_key: str,
    line_json: str,
    *,
    ok: bool,
    counters: dict[str, int] | None = None,
    worker: str | None = None,
    ttl_s: int = 0,
) -> bool:
    """Write a result (ok) or error line and add its counters, atomically and only if
    the line key has no line yet. Returns True when this call wrote it.

    A line longer than SPEC_MAX_RESULT_BYTES is not stored: an `invalid_request`
    error line saying how long it was and what the limit is takes its place, without
    counters, and a warning is logged. `ttl_s` applies when the batch has no
    `result_ttl` of its own.
    """
    limit = config.max_result_bytes()
    size = len(line_json.encode("utf-8"))
    if size > limit:
        line_json = _oversized(conn, keys, batch_id, line_key, line_json, size, limit)
        ok, counters = False, None
    args: list = [line_key, "result" if ok else "error", line_json, f"{time.time():.3f}"]
    args += [worker or "", int(ttl_s)]
    for name, n in (counters or {}).items():
        if n:
            args += [name, int(n)]
    script_keys = [
        keys.batch(batch_id),
        keys.results(batch_id),
        keys.errors(batch_id),
        keys.done(batch_id),
        keys.batch_workers(batch_id),
        keys.worker(worker or "-"),
        keys.order(batch_id),
        keys.requests(batch_id),
        keys.submitting(batch_id),
    ]
    return bool(conn.eval(_STORE, len(script_keys), *script_keys, *args))


def _oversized(
    conn: Redis, keys: Keys, batch_id: str, line_key: str, line_json: str, size: int, limit: int
) -> str:
    """The error line stored instead of a line over the size limit."""
    try:
        line = int(json.loads(line_json)["id"].rsplit("-", 1)[1])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        line = int(conn.zscore(keys.order(batch_id), line_key) or 0)
    custom_id = line_key[2:] if line_key.startswith("c:") else None
    message = (
        f"result line too large: {size} bytes, over the limit of {limit} bytes "
        "(SPEC_MAX_RESULT_BYTES on the workers): ask for less (max_tokens, metadata) "
        "or raise the limit"
    )
    log.warning(
        "%s line %d (%s): %s; stored an error line instead", batch_id, line, custom_id, message
    )
    return dumps(error_line(batch_id, line, custom_id, "invalid_request", message))


def classify(conn: Redis, keys: Keys, batch_id: str, line_keys: list[str]) -> list[str]:
    """For each line key: 'done', 'error', 'pending' or 'new' (one atomic look)."""
    if not line_keys:
        return []
    script_keys = [keys.results(batch_id), keys.errors(batch_id), keys.requests(batch_id)]
    args = [a for k in line_keys for a in (k, keys.rq_job(job_id_stem(batch_id, k)))]
    out = conn.eval(_CLASSIFY, 3, *script_keys, *args)
    return [s.decode() if isinstance(s, bytes) else s for s in out]


def clear_errors(conn: Redis, keys: Keys, batch_id: str, line_keys: list[str]) -> int:
    """Drop these lines' error lines (to run them again); returns how many were dropped."""
    if not line_keys:
        return 0
    script_keys = [keys.batch(batch_id), keys.errors(batch_id), keys.done(batch_id)]
    return int(conn.eval(_CLEAR_ERRORS, 3, *script_keys, *line_keys))


def wrong_key_type(conn: Redis, keys: Keys, batch_id: str) -> str | None:
    """`key K: holds a T, expected a U` for the first key of the batch whose Redis type
    is wrong (damaged state), else None."""
    expected = keys.batch_key_types(batch_id)
    with conn.pipeline(transaction=False) as pipe:
        for key in expected:
            pipe.type(key)
        found = [t.decode() if isinstance(t, bytes) else t for t in pipe.execute()]
    for (key, want), got in zip(expected.items(), found, strict=True):
        if got not in ("none", want):
            return f"key {key}: holds a {got}, expected a {want}"
    return None


def remove_queued(conn: Redis, queue_key: str, batch_id: str) -> list[str]:
    """Take the batch's waiting jobs out of one RQ queue; returns their job ids."""
    out = conn.eval(_REMOVE_QUEUED, 1, queue_key, f"{batch_id}-", JOB_DIGEST_CHARS)
    return [s.decode() if isinstance(s, bytes) else s for s in out]


def result_counters(usage: dict, stats: dict, busy_ms: int) -> dict[str, int]:
    """Counters of one successful request. `stats` holds SpecStats' raw fields
    (`dataclasses.asdict(SpecStats)`)."""
    counters = {
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "busy_ms": int(busy_ms),
    }
    for name in (
        "num_spec_steps",
        "num_draft_tokens",
        "num_accepted_draft_tokens",
        "num_emitted_tokens",
    ):
        counters[f"sd:{name}"] = int(stats.get(name, 0))
    for short, name in (
        ("hist", "acceptance_histogram"),
        ("dpp", "draft_tokens_per_position"),
        ("app", "accepted_per_position"),
    ):
        for i, n in enumerate(stats.get(name) or []):
            counters[f"sd:{short}:{i}"] = int(n)
    counters[f"sd:drafter:{stats.get('drafter', 'none')}"] = 1
    return counters


def spec_summary(fields: dict[str, str]) -> dict:
    """The FORMATS.md `speculative_decoding` object from summed counters (hash fields
    as stored by `store_line`), through jobstore.stats like engine.SpecStats.to_dict."""

    def n(name: str) -> int:
        return int(fields.get(name, 0) or 0)

    def series(short: str) -> list[int]:
        idx = sorted(int(k.split(":")[2]) for k in fields if k.startswith(f"sd:{short}:"))
        return [n(f"sd:{short}:{i}") for i in range(idx[-1] + 1)] if idx else []

    return summary(
        drafter_of(k.split(":", 2)[2] for k in fields if k.startswith("sd:drafter:")),
        n("sd:num_spec_steps"),
        n("sd:num_draft_tokens"),
        n("sd:num_accepted_draft_tokens"),
        n("sd:num_emitted_tokens"),
        series("hist"),
        series("dpp"),
        series("app"),
    )
