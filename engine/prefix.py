"""A prefix cache: prompts that start alike are prefilled once per worker, exactly.

Bulk jobs put the same system prompt, instructions or document before every line. The
state every layer holds after a prefix depends on that prefix alone, so it is kept
(per model of the loaded pair) and a later row starts from the longest kept prefix of
its prompt, prefilling only the rest.

Entries are segments of BLOCK-aligned prefixes, chained to their parent (the entry
ending where theirs starts) and indexed by a hash chained block by block, as vLLM
does; the tokens are kept too and compared on every hit, so a hash collision can never
hand a row another prompt's state. A segment holds, per layer:
- attention (full and sliding-window: the ragged cache keeps every key and masks the
  window, so its keys are exact whatever the window): the keys and values of the
  segment's positions, stored once and copied into each batch that reuses them;
- recurrent state (engine/recurrent.py): a snapshot at the segment's end. A recurrent
  state exists only where a pass ended, so in such a model prefill passes stop at
  block boundaries worth keeping (the chunk size, and each prompt's last boundary).

Entries are made while prefilling, and rows that join together and share a prefix
have it prefilled once first, so even the first batch of a job shares. Memory is
bounded by a byte budget, least recently used leaves going first.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .families import make_ragged_cache
from .recurrent import RecurrentLayerCache

#: Prefix lengths kept are multiples of BLOCK tokens.
BLOCK = 64
#: Longest prefill pass per row (a multiple of BLOCK): bounds the peak memory of a pass.
CHUNK = 512


@dataclass(eq=False)
class _Entry:
    """Tokens [start, end) of a prefix whose first `start` tokens are `parent`'s."""

    key: bytes
    parent: _Entry | None
    start: int
    end: int
    tokens: tuple
    layers: list  # per layer: (keys, values) for attention, a state list for recurrent
    nbytes: int
    children: int = 0


@dataclass
class PrefixStats:
    """Raw counters of one prefix cache, summed over its lifetime."""

    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    prefilled_tokens: int = 0
    evicted: int = 0
    entries: int = 0
    bytes: int = 0
    budget: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        total = self.reused_tokens + self.prefilled_tokens
        return {
            "lookups": self.lookups,
            "hits": self.hits,
            "reused_tokens": self.reused_tokens,
            "prefilled_tokens": self.prefilled_tokens,
            "hit_rate": round(self.reused_tokens / total, 4) if total else 0.0,
            "evicted": self.evicted,
            "entries": self.entries,
            "bytes": self.bytes,
            "budget_bytes": self.budget,
        }


def _digest(parent: bytes, block) -> bytes:
    return hashlib.blake2b(parent + array("q", block).tobytes(), digest_size=16).digest()


class PrefixCache:
    """Kept prefix states of one model, within `budget` bytes (0: keep nothing)."""

    def __init__(self, budget: int, block: int = BLOCK):
        self.budget = int(budget)
        self.block = block
        self.entries: OrderedDict[bytes, _Entry] = OrderedDict()  # least recent first
        self.stats = PrefixStats(budget=self.budget)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def _keys(self, tokens: list[int], upto: int) -> list[bytes]:
        """Chained hash of every block boundary up to `upto` tokens."""
        out, key = [], b""
        for end in range(self.block, upto + 1, self.block):
            key = _digest(key, tokens[end - self.block : end])
            out.append(key)
        return out

    def lookup(self, tokens: list[int]) -> _Entry | None:
        """The entry of the longest kept prefix of `tokens` (None: nothing kept)."""
        self.stats.lookups += 1
        entry = self._find(tokens)
        if entry is not None:
            self._touch(entry)
            self.stats.hits += 1
        return entry

    def kept_length(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` a row would reuse now (no side effects)."""
        entry = self._find(tokens)
        return entry.end if entry is not None else 0

    def _find(self, tokens: list[int]) -> _Entry | None:
        for key in reversed(self._keys(tokens, len(tokens))):
            entry = self.entries.get(key)
            if entry is not None and _matches(entry, tokens):
                return entry
        return None

    def _touch(self, entry: _Entry | None) -> None:
        # Leaf first, then its ancestors: a parent is always more recent than its
        # children, so eviction from the old end meets leaves first.
        while entry is not None:
            if self.entries.get(entry.key) is entry:
                self.entries.move_to_end(entry.key)
            entry = entry.parent

    def kept(self, entry: _Entry | None) -> bool:
        return entry is None or self.entries.get(entry.key) is entry

    def insert(self, parent, start, end, tokens, layers) -> _Entry | None:
        """Keep the state of tokens[:end] as a segment after `parent` (ending at start).
        Returns the entry (an equal one already kept, if any), or None when it cannot
        be kept (its parent was evicted, or it exceeds the budget alone)."""
        if not self.kept(parent):
            return None
        key = parent.key if parent is not None else b""
        for b in range(start, end, self.block):
            key = _digest(key, tokens[b : b + self.block])
        found = self.entries.get(key)
        if found is not None and _matches(found, tokens[:end]):
            self._touch(found)
            return found
        nbytes = sum(a.nbytes for state in layers for a in _arrays(state))
        if nbytes > self.budget:
            return None
        entry = _Entry(key, parent, start, end, tuple(tokens[start:end]), layers, nbytes)
        if parent is not None:
            parent.children += 1
        self.entries[key] = entry
        self._touch(entry)
        self.stats.bytes += nbytes
        self.stats.entries += 1
        self._evict()
        return entry if self.kept(entry) else None

    def _evict(self) -> None:
        while self.stats.bytes > self.budget:
            victim = next((e for e in self.entries.values() if e.children == 0), None)
            if victim is None:  # pragma: no cover - a tree always has a leaf
                return
            del self.entries[victim.key]
            if victim.parent is not None:
                victim.parent.children -= 1
            self.stats.bytes -= victim.nbytes
            self.stats.entries -= 1
            self.stats.evicted += 1

    def clear(self) -> None:
        """Forget every entry (the counters stay)."""
        self.entries.clear()
        self.stats.bytes = self.stats.entries = 0


def _arrays(state):
    if state is None:
        return []
    return [a for a in state if a is not None]


def _matches(entry: _Entry, tokens: list[int]) -> bool:
    """Whether the chain ending at `entry` holds exactly tokens[:entry.end]."""
    if entry.end > len(tokens):
        return False
    while entry is not None:
        if tuple(tokens[entry.start : entry.end]) != entry.tokens:
            return False
        entry = entry.parent
    return True


def _chain(entry: _Entry | None) -> list[_Entry]:
    out = []
    while entry is not None:
        out.append(entry)
        entry = entry.parent
    return out[::-1]


def _start_rows(model, hits: list[_Entry | None]):
    """A ragged cache whose row i holds the kept state of hits[i] (empty for None),
    left-padded to the longest."""
    rows, caches = make_ragged_cache(model, len(hits))
    lengths = [h.end if h is not None else 0 for h in hits]
    longest = max(lengths, default=0)
    if longest == 0:
        return rows, caches
    chains = [_chain(h) for h in hits]
    for li, layer in enumerate(caches):
        if isinstance(layer, RecurrentLayerCache):
            states = [c[-1].layers[li] if c else None for c in chains]
            ref = next(s for s in states if s is not None)
            layer.cache = [
                None
                if r is None
                else mx.concatenate(
                    [s[j] if s is not None else mx.zeros_like(r) for s in states], axis=0
                )
                for j, r in enumerate(ref)
            ]
            continue
        ks, vs = [], []
        ref = next(c[0].layers[li] for c in chains if c)
        for chain, n in zip(chains, lengths, strict=True):
            if chain:
                k = mx.concatenate([e.layers[li][0] for e in chain], axis=2)
                v = mx.concatenate([e.layers[li][1] for e in chain], axis=2)
            else:
                k = mx.zeros((1, ref[0].shape[1], 0, ref[0].shape[3]), ref[0].dtype)
                v = mx.zeros((1, ref[1].shape[1], 0, ref[1].shape[3]), ref[1].dtype)
            pad = [(0, 0), (0, 0), (longest - n, 0), (0, 0)]
            ks.append(mx.pad(k, pad) if n < longest else k)
            vs.append(mx.pad(v, pad) if n < longest else v)
        layer.keys, layer.values = mx.concatenate(ks), mx.concatenate(vs)
    rows.length = longest
    rows.valid = mx.arange(longest)[None, :] >= mx.array([longest - n for n in lengths])[:, None]
    rows.offset = mx.array(lengths, dtype=mx.int32)
    mx.eval(rows.valid, *[c.state for c in caches])
    return rows, caches


def _snapshot(caches, valid_row: np.ndarray, row: int, start: int, end: int) -> list:
    """Every layer's state for the real positions [start, end) of one row."""
    slots = mx.array(np.flatnonzero(valid_row)[start:end].astype(np.int32))
    pick = mx.array([row], dtype=mx.int32)
    out = []
    for layer in caches:
        if isinstance(layer, RecurrentLayerCache):
            out.append([None if c is None else mx.take(c, pick, axis=0) for c in layer.cache])
        else:
            k = mx.take(layer.keys[row : row + 1], slots, axis=2)
            v = mx.take(layer.values[row : row + 1], slots, axis=2)
            out.append((k, v))
    mx.eval([a for s in out for a in _arrays(s)])
    return out


def _stops(cache: PrefixCache, start: int, n: int, recurrent: bool) -> list[int]:
    """Where a row's prefill passes end: chunk boundaries, its end and, for a model
    with recurrent layers, its last block boundary (the only place a state exists)."""
    last_block = (n // cache.block) * cache.block
    stops = set(range(start + CHUNK, n, CHUNK)) | {n}
    if recurrent and last_block > start:
        stops.add(last_block)
    return sorted(stops)


def _shared_prefixes(cache: PrefixCache, prompts: list[list[int]], hits) -> list[list[int]]:
    """The longest block-aligned prefixes that two or more of `prompts` share beyond
    what is kept already, once each."""
    keyed = [cache._keys(p, len(p)) for p in prompts]
    seen: dict[bytes, int] = {}
    for keys in keyed:
        for key in set(keys):
            seen[key] = seen.get(key, 0) + 1
    out: dict[bytes, list[int]] = {}
    for p, keys, hit in zip(prompts, keyed, hits, strict=True):
        kept = hit.end if hit is not None else 0
        shared = [i for i, k in enumerate(keys) if seen[k] > 1]
        if shared and (shared[-1] + 1) * cache.block > kept:
            end = (shared[-1] + 1) * cache.block
            out.setdefault(keys[shared[-1]], p[:end])
    return list(out.values())


def prefill_cached(model, prompts: list[list[int]], cache: PrefixCache):
    """Like drafters.prefill_rows, starting each row from its longest kept prefix and
    keeping new entries on the way. Returns (rows, layer caches, reused tokens per row).
    """
    hits = [cache.lookup(p) for p in prompts]
    shared = _shared_prefixes(cache, prompts, hits)
    if shared:
        _prefill(model, shared, [cache.lookup(p) for p in shared], cache)
        hits = [cache.lookup(p) for p in prompts]
    rows, caches = _prefill(model, prompts, hits, cache)
    reused = [h.end if h is not None else 0 for h in hits]
    cache.stats.reused_tokens += sum(reused)
    cache.stats.prefilled_tokens += sum(len(p) for p in prompts) - sum(reused)
    return rows, caches, reused


def _prefill(model, prompts, hits, cache: PrefixCache):
    rows, caches = _start_rows(model, hits)
    recurrent = any(isinstance(c, RecurrentLayerCache) for c in caches)
    pos = [h.end if h is not None else 0 for h in hits]
    tails = list(hits)  # each row's newest kept entry (None: none, or not kept)
    stops = [_stops(cache, p0, len(p), recurrent) for p0, p in zip(pos, prompts, strict=True)]
    while any(p < len(prompt) for p, prompt in zip(pos, prompts, strict=True)):
        ends = [next((s for s in st if s > p), p) for st, p in zip(stops, pos, strict=True)]
        chunks = [prompt[p:e] for prompt, p, e in zip(prompts, pos, ends, strict=True)]
        width = max(map(len, chunks))
        model(mx.array([c + [0] * (width - len(c)) for c in chunks]), cache=caches)
        rows.advance(width, [len(c) for c in chunks])
        mx.eval([c.state for c in caches])
        valid = np.array(rows.valid)
        for i, (prompt, p, e) in enumerate(zip(prompts, pos, ends, strict=True)):
            pos[i] = e
            if e == p or not cache.kept(tails[i]):
                continue
            tails[i] = _keep(cache, caches, valid, i, prompt, tails[i], p, e, recurrent)
    return rows, caches


def _keep(cache, caches, valid, row, prompt, tail, p, e, recurrent):
    """Keep the row's new block boundaries in (p, e]: each one for attention-only
    models, only the pass's end for recurrent ones (the only state there is)."""
    start = tail.end if tail is not None else 0
    ends = range(start + cache.block, e + 1, cache.block)
    if recurrent:
        ends = [e] if e % cache.block == 0 and e > start else []
    for end in ends:
        layers = _snapshot(caches, valid[row], row, start, end)
        tail = cache.insert(tail, start, end, prompt, layers)
        if tail is None:
            return None
        start = end
    return tail


@dataclass
class PairCaches:
    """The prefix caches of a loaded pair: target and draft model (None: not kept),
    and, for a kind of state that is not kept, why (said once by the worker)."""

    target: PrefixCache | None
    draft: PrefixCache | None
    budget: int
    not_kept: str | None = None

    def info(self) -> dict:
        """Budget and counters, for logs, `spec-doctor` and benchmarks."""
        return {
            "budget_bytes": self.budget,
            "target": self.target.stats.as_dict() if self.target is not None else None,
            "draft": self.draft.stats.as_dict() if self.draft is not None else None,
            "not_kept": self.not_kept,
        }


def default_budget() -> int:
    """Bytes the prefix caches may hold when no setting says: a tenth of the machine's
    memory, at most 8 GiB (kept state is cheap beside prefilling it again)."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        total = 8 << 30
    return int(min(total // 10, 8 << 30))


def pair_caches(pair, budget: int | None) -> PairCaches:
    """Prefix caches for a pair within `budget` bytes (None: `default_budget()`), split
    between target and draft by parameter count."""
    budget = default_budget() if budget is None else max(0, int(budget))
    if getattr(pair, "plain_only", None):
        return PairCaches(None, None, budget, "plain decoding (engine.plain) keeps no prefixes")
    if getattr(pair, "dflash", None) is not None:
        # Its context is target features per token, which entries do not hold yet.
        return PairCaches(
            None,
            None,
            budget,
            "the DFlash drafter's context is not kept: prompts are prefilled in full",
        )
    if pair.draft is None:
        return PairCaches(PrefixCache(budget), None, budget)
    t, d = _params(pair.target), _params(pair.draft)
    share = max(0.1, d / (t + d)) if t + d else 0.5
    draft_budget = int(budget * share)
    return PairCaches(PrefixCache(budget - draft_budget), PrefixCache(draft_budget), budget)


def _params(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.size for _, v in tree_flatten(model.parameters()))


def prefix_line(pair) -> str:
    """The prefix cache of a loaded pair in one line, for start-up logs and spec-doctor."""
    caches = getattr(pair, "prefix", None)
    if caches is None or (caches.target is None and caches.draft is None):
        why = caches.not_kept if caches is not None else "not set up"
        return f"prefix cache: off ({why})"
    if not caches.budget:
        return "prefix cache: off (SPEC_PREFIX_CACHE_MB=0)"
    parts = [f"prefix cache: {caches.budget / (1 << 20):.0f} MiB"]
    for role, cache in (("target", caches.target), ("draft", caches.draft)):
        if cache is not None:
            parts.append(f"{role} {cache.budget / (1 << 20):.0f} MiB")
    line = parts[0] + " (" + ", ".join(parts[1:]) + f"), blocks of {BLOCK} tokens"
    if caches.not_kept:
        line += f"; not kept: {caches.not_kept}"
    return line
