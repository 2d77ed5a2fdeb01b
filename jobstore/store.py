"""Atomic writes of lines and counters (Lua scripts), and the counter arithmetic.

Every line is written through `store_line`: the line and its counters go in
together, once per (batch, line key), even if a job runs twice. Counters are plain
integers in hash fields, so batch, worker and fleet totals are exact sums; the script
reads every field a line adds to with one HMGET and writes them back with one HSET
(a line's ~30 statistics counters cost two commands, not one HINCRBY each). Lines are
stored packed (jobstore.lines.pack), and a line with a result drops its request
record (an error line keeps it, for spec-retry). Each write renews the batch's TTL on
every key of the batch (the batch's own `result_ttl`, set by `spec-submit
--result-ttl`, else the writer's SPEC_RESULT_TTL_S), and a line over
SPEC_MAX_RESULT_BYTES is replaced by an error line saying so.

Scripts run by SHA (EVALSHA; loaded on first use, and again after a Redis restart):
Redis then neither receives nor hashes their text on every call.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from typing import Literal, NamedTuple

from redis import Redis
from redis.commands.core import Script

from contract.stats import counters_of_line, from_fields, summary, to_fields
from jobstore import config
from jobstore.keys import Keys, custom_id_of
from jobstore.lines import DIGEST_BYTES, PACKED_V2, cached_tokens, dumps, error_line, pack

log = logging.getLogger("specfleet.store")


class _Lua:
    """A Lua script run by SHA on whichever client (or pipeline) is given."""

    def __init__(self, text: str):
        self._script = Script(None, text.encode())

    def __call__(self, conn, keys: list, args: list):
        return self._script(keys=keys, args=args, client=conn)


_STORE = _Lua(
    """
-- KEYS: 1 meta, 2 results, 3 errors, 4 done, 5 batch workers, 6 worker stats,
--       7 order, 8 requests, 9 submitting flag
-- ARGV: 1 now, 2 worker ('' = none), 3 ttl seconds when the batch sets none (0 = none),
--       then per line: line key, 'result'|'error', stored line, n, n counter name /
--       increment pairs
-- Returns {1 if the batch is cancelled else 0, then per line 1 if this call stored it},
-- or {2} when the batch has no record (created_at): Redis lost it; nothing is stored.
-- A line is stored when its key has neither a result nor an error line (nor came
-- earlier in this call): two HMGETs and an HSET per call, not two commands per line.
if redis.call('HEXISTS', KEYS[1], 'created_at') == 0 then return {2} end
local now, worker = ARGV[1], ARGV[2]
local names, sums, at = {'completed', 'failed'}, {0, 0}, {completed = 1, failed = 2}
local function bump(name, n)
  if at[name] == nil then
    names[#names + 1] = name
    sums[#sums + 1] = 0
    at[name] = #names
  end
  sums[at[name]] = sums[at[name]] + n
end
local starts, line_keys = {}, {}
local i = 4
while i <= #ARGV do
  starts[#starts + 1] = i
  line_keys[#line_keys + 1] = ARGV[i]
  i = i + 4 + 2 * tonumber(ARGV[i + 3])
end
if #line_keys == 0 then return {0} end
local has_result = redis.call('HMGET', KEYS[2], unpack(line_keys))
local has_error = redis.call('HMGET', KEYS[3], unpack(line_keys))
local out, written, answered, results, errors, seen = {0}, {}, {}, {}, {}, {}
for j, p in ipairs(starts) do
  local key, ok, n = ARGV[p], ARGV[p + 1] == 'result', tonumber(ARGV[p + 3])
  local stored = 0
  if not has_result[j] and not has_error[j] and not seen[key] then
    stored, seen[key] = 1, true
    written[#written + 1] = key
    local into = errors
    if ok then
      answered[#answered + 1] = key
      into = results
    end
    into[#into + 1] = key
    into[#into + 1] = ARGV[p + 2]
    bump(ok and 'completed' or 'failed', 1)
    for c = p + 4, p + 3 + 2 * n, 2 do bump(ARGV[c], tonumber(ARGV[c + 1])) end
  end
  out[#out + 1] = stored
end
if #results > 0 then redis.call('HSET', KEYS[2], unpack(results)) end
if #errors > 0 then redis.call('HSET', KEYS[3], unpack(errors)) end
if #written == 0 then
  out[1] = redis.call('HEXISTS', KEYS[1], 'cancelled')
  return out
end
redis.call('RPUSH', KEYS[4], unpack(written))
if #answered > 0 then redis.call('HDEL', KEYS[8], unpack(answered)) end  -- kept for errors

local function int(hash, field, value)
  local v = tonumber(value or '0')
  if v == nil or v ~= math.floor(v) then
    error({err = 'key ' .. hash .. ' field ' .. field .. ': expected an integer, got ' .. value})
  end
  return v
end
-- Read every field the lines add to (and `reads`), add, write back those that changed:
-- one HMGET, one HSET. Returns the new values and the values of `reads`.
local function add(hash, fields, increments, extra, reads)
  local all = {unpack(fields)}
  for _, f in ipairs(reads or {}) do all[#all + 1] = f end
  local found = redis.call('HMGET', hash, unpack(all))
  local set, new = extra or {}, {}
  for k = 1, #fields do
    new[k] = int(hash, fields[k], found[k]) + increments[k]
    if increments[k] ~= 0 then
      set[#set + 1] = fields[k]
      set[#set + 1] = new[k]
    end
  end
  redis.call('HSET', hash, unpack(set))
  return new, {unpack(found, #fields + 1, #all)}
end

local new, meta = add(KEYS[1], names, sums, {'last_done_at', now}, {'result_ttl', 'cancelled'})
if worker ~= '' then
  local mine, step = {}, {}
  for k, name in ipairs(names) do
    if k <= 2 or name == 'completion_tokens' or name == 'prompt_tokens' or name == 'busy_ms' then
      mine[#mine + 1] = name .. ':' .. worker
      step[#step + 1] = sums[k]
    end
  end
  add(KEYS[5], mine, step)
  add(KEYS[6], names, sums)  -- its TTL is renewed by the worker's heartbeat
end
if new[1] + new[2] >= redis.call('ZCARD', KEYS[7]) and redis.call('EXISTS', KEYS[9]) == 0 then
  redis.call('HSETNX', KEYS[1], 'completed_at', now)
end
local ttl = tonumber(meta[1] or ARGV[3])
if ttl > 0 then
  for k = 1, 8 do
    if k ~= 6 then redis.call('EXPIRE', KEYS[k], ttl) end
  end
end
out[1] = meta[2] and 1 or 0
return out
"""
)

_CLASSIFY = _Lua(
    """#!lua flags=no-writes
-- KEYS: 1 results, 2 errors, 3 requests, 4 request hashes (what spec-submit wrote before
--       digests went into records and results; read only for a line without one)
-- ARGV: 1 'rq:job:<batch>-j' (a job number completes it), 2 the first byte of a result
--       that carries its request's digest, 3 the digest's length, 4.. line keys
-- -> per key two values: 'done' (has a result), 'error' (has an error line), 'pending'
--    (the job its request record names is queued or running) or 'new'; then the digest
--    of the request it was answered or queued with ('done' and 'pending'; nil: unknown)
local out, tag, width = {}, ARGV[2], tonumber(ARGV[3])
local function hex(bytes)
  return (string.gsub(bytes, '.', function(c) return string.format('%02x', string.byte(c)) end))
end
for i = 4, #ARGV do
  local k, s, d = ARGV[i], 'new', false
  local result = redis.call('HGET', KEYS[1], k)
  if result then
    s = 'done'
    if string.sub(result, 1, 1) == tag then d = hex(string.sub(result, 2, 1 + width)) end
  elseif redis.call('HEXISTS', KEYS[2], k) == 1 then s = 'error'
  else
    local rec = redis.call('HGET', KEYS[3], k)
    if rec then
      local fine, decoded = pcall(cjson.decode, rec)
      local job = fine and type(decoded) == 'table' and tonumber(decoded['job'])
      if job then
        local st = redis.call('HGET', ARGV[1] .. string.format('%d', job), 'status')
        if st == 'queued' or st == 'started' or st == 'deferred' or st == 'scheduled' then
          s = 'pending'
          if type(decoded['digest']) == 'string' then d = decoded['digest'] end
        end
      end
    end
  end
  if (s == 'done' or s == 'pending') and not d then d = redis.call('HGET', KEYS[4], k) end
  out[#out + 1] = s
  out[#out + 1] = d
end
return out
"""
)

_REBUILD_LIST = """
local function rebuild(key, keep)
  redis.call('DEL', key)
  for i = 1, #keep, 1000 do
    redis.call('RPUSH', key, unpack(keep, i, math.min(i + 999, #keep)))
  end
end
"""

_CLEAR_ERRORS = _Lua(
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

_REMOVE_QUEUED = _Lua(
    _REBUILD_LIST
    + """
-- KEYS: 1 an RQ queue list; ARGV: 1 job id prefix ('<batch>-')
-- Removes the batch's job ids (prefix, 'j', digits) and returns them.
local p, removed, keep = ARGV[1], {}, {}
for _, id in ipairs(redis.call('LRANGE', KEYS[1], 0, -1)) do
  if string.sub(id, 1, #p) == p and string.match(string.sub(id, #p + 1), '^j%d+$') then
    removed[#removed + 1] = id
  else
    keep[#keep + 1] = id
  end
end
if #removed > 0 then rebuild(KEYS[1], keep) end
return removed
"""
)


_UNSTORE = _Lua(
    _REBUILD_LIST
    + """
-- KEYS: 1 meta, 2 results, 3 done, 4 batch workers
-- ARGV: per line: line key, worker ('' = none), n, n counter name / amount pairs
-- Drops each line's result and takes its counters off the batch's and its worker's;
-- returns how many results were dropped.
local gone, n, i = {}, 0, 1
while i <= #ARGV do
  local key, worker, k = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  if redis.call('HDEL', KEYS[2], key) == 1 then
    gone[key], n = true, n + 1
    redis.call('HINCRBY', KEYS[1], 'completed', -1)
    if worker ~= '' then redis.call('HINCRBY', KEYS[4], 'completed:' .. worker, -1) end
    for j = i + 3, i + 2 + 2 * k, 2 do
      local name, amount = ARGV[j], -tonumber(ARGV[j + 1])
      redis.call('HINCRBY', KEYS[1], name, amount)
      if worker ~= '' and (name == 'prompt_tokens' or name == 'completion_tokens') then
        redis.call('HINCRBY', KEYS[4], name .. ':' .. worker, amount)
      end
    end
  end
  i = i + 3 + 2 * k
end
if n > 0 then
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


_READ_JOB = _Lua(
    """#!lua flags=no-writes
-- KEYS: 1 requests, 2 errors, 3 meta; ARGV: 1 largest record sent, 2.. line keys
-- -> {1 if the batch is cancelled else 0, 1 if it has its record (created_at) else 0,
--     then per key: its request record, or its size when larger than ARGV[1] (never
--     sent), or nil when it has none (answered) or has an error line}
-- Three HMGETs whatever the number of lines (a record over the limit is copied inside
-- Redis once, to measure it, and not sent).
local limit = tonumber(ARGV[1])
local meta = redis.call('HMGET', KEYS[3], 'cancelled', 'created_at')
local out = {meta[1] and 1 or 0, meta[2] and 1 or 0}
if #ARGV < 2 then return out end
local records = redis.call('HMGET', KEYS[1], unpack(ARGV, 2))
local errors = redis.call('HMGET', KEYS[2], unpack(ARGV, 2))
for i = 1, #ARGV - 1 do
  local record = records[i]
  if not record or errors[i] then out[i + 2] = false
  elseif #record > limit then out[i + 2] = #record
  else out[i + 2] = record end
end
return out
"""
)


_COUNT_UNANSWERED = _Lua(
    """#!lua flags=no-writes
-- (no-writes: Redis runs it while over its maxmemory too)
-- KEYS: 1 requests, 2 errors; ARGV: line keys
-- -> how many still have a request record (no result) and no error line
local n = 0
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 and redis.call('HEXISTS', KEYS[2], ARGV[i]) == 0 then
    n = n + 1
  end
end
return n
"""
)


class Stored(NamedTuple):
    """What `put_lines` did: per line whether this call wrote it, whether the batch is
    cancelled, and whether the batch has no record any more (`gone`: nothing written)."""

    written: list[bool]
    cancelled: bool
    gone: bool = False


class LineToStore(NamedTuple):
    """One line for `put_lines`: its key, its JSON, result (ok) or error, its counters,
    and the digest of the request it answers (kept with a result: a re-submit compares
    it)."""

    key: str
    line_json: str
    ok: bool
    counters: dict[str, int] | None = None
    digest: str | None = None


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
    the line key has no line yet. Returns True when this call wrote it (on a pipeline:
    the pipeline; its result comes with the pipeline's).

    A line longer than SPEC_MAX_RESULT_BYTES is not stored: an `invalid_request`
    error line saying how long it was and what the limit is takes its place, without
    counters, and a warning is logged. `ttl_s` applies when the batch has no
    `result_ttl` of its own.
    """
    line = LineToStore(line_key, line_json, ok, counters)
    done = put_lines(conn, keys, batch_id, [line], worker=worker, ttl_s=ttl_s)
    return done.written[0] if isinstance(done, Stored) else done


def put_lines(
    conn: Redis,
    keys: Keys,
    batch_id: str,
    lines: list[LineToStore],
    *,
    worker: str | None = None,
    ttl_s: int = 0,
) -> Stored:
    """`store_line` for several lines of one batch in one call (each still once per line
    key; the counters of the lines this call wrote are summed first, so the batch's,
    the worker's and its per-batch counters are one HMGET and one HSET each, whatever
    the number of lines). A batch without its record (`created_at`: a Redis restarted
    without persistence lost it) gets nothing. Returns a Stored; on a pipeline, the
    pipeline."""
    limit = config.max_result_bytes()
    args: list = [f"{time.time():.3f}", worker or "", int(ttl_s)]
    for key, line_json, ok, counters, digest in lines:
        size = len(line_json.encode("utf-8"))
        if size > limit:
            line_json = _oversized(conn, keys, batch_id, key, line_json, size, limit)
            ok, counters = False, None
        pairs = [x for name, n in (counters or {}).items() if n for x in (name, int(n))]
        packed = pack(line_json, digest if ok else None)
        args += [key, "result" if ok else "error", packed, len(pairs) // 2, *pairs]
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
    out = _STORE(conn, script_keys, args)
    if isinstance(out, list):
        if int(out[0]) == 2:
            return Stored([False] * len(lines), False, gone=True)
        return Stored([bool(x) for x in out[1:]], bool(out[0]))
    return out  # a pipeline: the result comes with its execute()


def _oversized(
    conn: Redis, keys: Keys, batch_id: str, line_key: str, line_json: str, size: int, limit: int
) -> str:
    """The error line stored instead of a line over the size limit."""
    try:
        line = int(json.loads(line_json)["id"].rsplit("-", 1)[1])
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        line = line_number(conn, keys, batch_id, line_key)
    custom_id = custom_id_of(line_key)
    message = (
        f"result line too large: {size} bytes, over the limit of {limit} bytes "
        "(SPEC_MAX_RESULT_BYTES on the workers): ask for less (max_tokens, metadata) "
        "or raise the limit"
    )
    log.warning(
        "%s line %d (%s): %s; stored an error line instead", batch_id, line, custom_id, message
    )
    return dumps(error_line(batch_id, line, custom_id, "invalid_request", message))


def line_number(conn: Redis, keys: Keys, batch_id: str, line_key: str, record=None) -> int:
    """A line's number in the file that queued it: from its request record (JSON bytes)
    when given one that says, else its number in the `order` zset (the latest file),
    else 0."""
    if record is not None:
        try:
            return int(json.loads(record)["line"])
        except (ValueError, KeyError, TypeError):
            pass
    return int(conn.zscore(keys.order(batch_id), line_key) or 0)


def classify(
    conn: Redis, keys: Keys, batch_id: str, line_keys: list[str]
) -> tuple[list[str], list[str | None]]:
    """For each line key: 'done', 'error', 'pending' or 'new', and the digest of the
    request a 'done' or 'pending' line was answered or queued with (None when unknown:
    queued before digests were kept, or another state), in one atomic look."""
    if not line_keys:
        return [], []
    script_keys = [
        keys.results(batch_id),
        keys.errors(batch_id),
        keys.requests(batch_id),
        keys.hashes(batch_id),
    ]
    args = [keys.rq_job(f"{batch_id}-j"), PACKED_V2, DIGEST_BYTES, *line_keys]
    found = _CLASSIFY(conn, script_keys, args)
    out = [x.decode(errors="replace") if isinstance(x, bytes) else x for x in found]
    return out[0::2], out[1::2]


class JobRead(NamedTuple):
    """What `read_job` found: the batch's cancel flag, whether it has its record, and
    per line key its request record (bytes), None (answered, or it has an error line)
    or the size of a record over the limit (an int: never sent)."""

    cancelled: bool
    known: bool
    records: list[bytes | int | None]


def read_job(conn: Redis, keys: Keys, batch_id: str, line_keys: list[str], limit: int) -> JobRead:
    """A job's lines still to run, in one call of three HMGETs (see JobRead)."""
    script_keys = [keys.requests(batch_id), keys.errors(batch_id), keys.batch(batch_id)]
    out = _READ_JOB(conn, script_keys, [limit, *line_keys])
    return JobRead(bool(out[0]), bool(out[1]), out[2:])


def count_unanswered(conn, keys: Keys, batch_id: str, line_keys: list[str]):
    """How many of these lines have neither a result nor an error line (on a pipeline:
    the count comes with its execute())."""
    return _COUNT_UNANSWERED(conn, [keys.requests(batch_id), keys.errors(batch_id)], line_keys)


class StoredLine(NamedTuple):
    """One line of a batch as `read_lines` finds it."""

    key: str  # its line key
    kind: Literal["result", "error", "pending"]  # pending: no result or error line yet
    text: str  # the JSON line, unpacked ("" when pending or damaged)
    hash_key: str  # the hash it is stored in ("" when pending)
    damage: str | None = None  # why the stored bytes cannot be unpacked


def read_lines(
    conn: Redis,
    keys: Keys,
    batch_id: str,
    order: Literal["input", "completion"] = "input",
    chunk: int | None = None,
) -> Iterator[StoredLine]:
    """The batch's lines, `chunk` line keys a round trip (CHUNK_LINES when None), so
    memory stays bounded: in input order (the `order` zset: every line, pending ones
    too) or in completion order (the `done` list: the lines written so far). Stored
    lines come unpacked; bytes that cannot be unpacked come with `damage` set."""
    from jobstore.lines import unpack

    step = chunk or config.CHUNK_LINES
    results, errors = keys.results(batch_id), keys.errors(batch_id)
    start = 0
    while True:
        if order == "input":
            found = conn.zrange(keys.order(batch_id), start, start + step - 1)
        else:
            found = conn.lrange(keys.done(batch_id), start, start + step - 1)
        if not found:
            return
        with conn.pipeline(transaction=False) as pipe:
            pipe.hmget(results, found)
            pipe.hmget(errors, found)
            stored_results, stored_errors = pipe.execute()
        for raw_key, result, error in zip(found, stored_results, stored_errors, strict=True):
            key = raw_key.decode(errors="replace") if isinstance(raw_key, bytes) else raw_key
            if result is None and error is None:
                yield StoredLine(key, "pending", "", "")
                continue
            kind, raw, hash_key = (
                ("result", result, results) if result is not None else ("error", error, errors)
            )
            try:
                text, damage = unpack(raw, config.MAX_STORED_LINE_BYTES), None
            except ValueError as exc:  # damaged compressed data, or not UTF-8
                text, damage = "", str(exc)
            yield StoredLine(key, kind, text, hash_key, damage)
        start += step


def drop_results(conn: Redis, keys: Keys, batch_id: str, line_keys: list[str]) -> int:
    """Drop these lines' results (to run them again with a changed request) and take
    their counters off the batch and its per-worker counters, exactly: every counter a
    result line carries (tokens, speculative-decoding statistics) is read back from the
    stored line. A worker's busy time and lifetime counters stay (the work was done).
    Returns how many results were dropped."""
    if not line_keys:
        return 0
    from jobstore.lines import unpack

    args: list = []
    for key, raw in zip(line_keys, conn.hmget(keys.results(batch_id), line_keys), strict=True):
        if raw is None:
            continue
        line = json.loads(unpack(raw, config.MAX_STORED_LINE_BYTES))
        body = line["response"]["body"]
        usage, metrics = body.get("usage") or {}, body.get("metrics") or {}
        spec = metrics.get("speculative_decoding") or {}
        stats = counters_of_line(spec, int(usage.get("completion_tokens") or 0))
        counters = result_counters(usage, stats, busy_ms=0, choices=len(body["choices"]))
        pairs = [x for name, n in counters.items() if n for x in (name, int(n))]
        worker = (metrics.get("worker") or {}).get("name") or ""
        args += [key, worker, len(pairs) // 2, *pairs]
    if not args:
        return 0
    script_keys = [
        keys.batch(batch_id),
        keys.results(batch_id),
        keys.done(batch_id),
        keys.batch_workers(batch_id),
    ]
    return int(_UNSTORE(conn, script_keys, args))


def clear_errors(conn: Redis, keys: Keys, batch_id: str, line_keys: list[str]) -> int:
    """Drop these lines' error lines (to run them again); returns how many were dropped."""
    if not line_keys:
        return 0
    script_keys = [keys.batch(batch_id), keys.errors(batch_id), keys.done(batch_id)]
    return int(_CLEAR_ERRORS(conn, script_keys, line_keys))


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


def record_problem(conn: Redis, keys: Keys, batch_id: str) -> str | None:
    """Why the batch cannot be read as a batch, naming the fix, or None when its record
    is there: no batch hash at all, or a hash without `created_at` or lines stored
    without an `order` (what a worker wrote into a Redis restarted without persistence
    before workers checked for the record)."""
    meta, order = keys.batch(batch_id), keys.order(batch_id)
    with conn.pipeline(transaction=False) as pipe:
        pipe.exists(meta)
        pipe.hexists(meta, "created_at")
        pipe.exists(order)
        pipe.exists(keys.results(batch_id), keys.errors(batch_id))
        has_meta, has_created, has_order, has_lines = pipe.execute()
    fix = f"re-submit its file with --batch-id {batch_id}"
    if not has_meta and not has_lines:
        return _no_record(conn, keys, batch_id, fix)
    if not has_created:
        why = f"key {meta} has no created_at"
    elif has_lines and not has_order:
        why = f"key {order} is missing"
    else:
        return None
    return (
        f"batch {batch_id} has lost its record in this Redis ({why}; was Redis restarted "
        f"without persistence?): {fix}"
    )


def _no_record(conn: Redis, keys: Keys, batch_id: str, fix: str) -> str:
    """Why a batch without keys is not there, from the ids recorded at creation
    (`Keys.batches`, `Keys.api_batches`): never created here (a mistyped id), created
    through spec-serve but never queued, or created and since vanished (expired, or
    lost with Redis's data)."""
    with conn.pipeline(transaction=False) as pipe:
        pipe.zscore(keys.batches, batch_id)
        pipe.hget(keys.api_batch(batch_id), "state")
        pipe.zcard(keys.batches)
        pipe.zrange(keys.batches, 0, 0, withscores=True)
        created, api_state, count, first = pipe.execute()
    api_state = api_state.decode() if isinstance(api_state, bytes) else api_state
    where = f"this Redis (prefix {keys.prefix!r})"
    if created is None and api_state == "failed":
        return (
            f"batch {batch_id} was created through spec-serve and failed validation, so "
            f"nothing was queued: GET /v1/batches/{batch_id} lists the problems "
            "(errors.data); fix the file and create a new batch"
        )
    if created is None and api_state == "validating":
        return f"batch {batch_id} is still being validated by spec-serve: try again shortly"
    if created is None and api_state == "cancelled":
        return f"batch {batch_id} was cancelled in spec-serve before it was queued: nothing ran"
    if created is None and not count:
        return (
            f"no such batch {batch_id!r}: {where} has no record of any batch; check the "
            "id, the Redis URL and SPEC_KEY_PREFIX. If it was submitted to this Redis, "
            f"Redis has lost its data (restarted without persistence?): {fix}"
        )
    if created is None:
        return (
            f"no such batch {batch_id!r}: none with that id was submitted to {where} "
            f"since {_utc(first[0][1])} ({count} batch(es) recorded); check the id "
            "(spec-submit printed it; spec-collect --delete forgets a batch)"
        )
    return (
        f"batch {batch_id} was submitted to {where} at {_utc(created)} but its keys are "
        "gone: it expired if it had a result TTL (--result-ttl, SPEC_RESULT_TTL_S), "
        f"else Redis lost it (restarted without persistence?); to run it again, {fix}"
    )


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def remove_queued(conn: Redis, queue_key: str, batch_id: str) -> list[str]:
    """Take the batch's waiting jobs out of one RQ queue; returns their job ids."""
    out = _REMOVE_QUEUED(conn, [queue_key], [f"{batch_id}-"])
    return [s.decode() if isinstance(s, bytes) else s for s in out]


def result_counters(usage: dict, stats: dict, busy_ms: int, choices: int = 1) -> dict[str, int]:
    """Counters of one successful request: its usage and busy time, then its
    speculative-decoding counters in their hash-field form (`contract.stats.to_fields`).
    `stats` holds SpecStats' raw fields (`dataclasses.asdict(SpecStats)`). A line of
    n > 1 choices also counts its extra choices (EXTRA_CHOICES_FIELD: spec-status adds them
    to its lines), so a batch of single-choice lines keeps the fields it always had."""
    counters = {
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "completion_tokens": int(usage.get("completion_tokens", 0)),
        "cached_prompt_tokens": cached_tokens(usage),
        "busy_ms": int(busy_ms),
        **to_fields(stats),
    }
    if choices > 1:
        counters[EXTRA_CHOICES_FIELD] = choices - 1
    return counters


#: Batch hash field: choices beyond the first of the completed lines (n - 1 each).
EXTRA_CHOICES_FIELD = "extra_choices"


def spec_summary(fields: dict[str, str]) -> dict:
    """The `speculative_decoding` object of docs/formats.md from summed counters (hash
    fields as stored by `store_line`), through contract.stats like SpecStats.to_dict."""
    return summary(**from_fields(fields))
