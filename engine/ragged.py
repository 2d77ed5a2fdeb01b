"""A batched KV cache whose rows roll back independently.

Rows of a batch accept different numbers of draft tokens, so after a verify step
each row must drop a different number of trailing positions. Moving every row's
keys would cost a copy of the whole cache per step; instead rejected positions
stay where they are and are masked out, and each row keeps its own true length
(its RoPE offset). Keys carry their positions from when they were written, so
masked holes do not disturb attention. `compact()` squeezes holes out now and then.

One `RaggedRows` is shared by all layer caches of one model; the decoder calls
`advance()` after every forward pass to say which new positions were real.
Sliding-window layers use the same plain cache: their mask counts each key's true
position (its rank among the row's real tokens), not its slot, so a row attends
exactly the window the model defines however many holes it has. Recurrent layer
state (engine/recurrent.py) and the DFlash drafter's context (engine/dflash.py) hang
off the same rows: `advance`, `drop_last`, `checkpoint`, `select`, `append` and
`compact` reach every layer kind through one interface.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx

from .types import CacheError

GROW = 256
#: Without a `checkpoint()`, how many past forward passes `drop_last` may reach into
#: (a draft step is at most MAX_DRAFT_TOKENS passes plus the one that feeds it).
MAX_HISTORY = 17


class RaggedRows:
    """Per-row validity and true lengths shared by the layer caches of one model."""

    def __init__(self, batch: int):
        self.length = 0  # physical positions in use (same for every row)
        self.valid = mx.zeros((batch, 0), dtype=mx.bool_)
        self.offset = mx.zeros((batch,), dtype=mx.int32)  # true tokens per row
        self.layers: list = []  # every layer cache of the model, in any kind
        self.history: list[list[int]] = []  # keep lists of the passes since checkpoint()

    @property
    def batch(self) -> int:
        return self.valid.shape[0]

    def checkpoint(self) -> None:
        """`drop_last` will never reach back past this point (free for KV layers)."""
        self.history = []
        for layer in self.layers:
            layer.checkpoint()

    def positions(self) -> mx.array:
        """True position of every slot in its row (rank among the real tokens)."""
        return mx.cumsum(self.valid.astype(mx.int32), axis=1) - 1

    def advance(self, n_new: int, keep: list[int]) -> None:
        """After a forward over n_new positions, keep the first keep[i] of row i."""
        keep_arr = mx.array(keep, dtype=mx.int32)
        new_valid = mx.arange(n_new)[None, :] < keep_arr[:, None]
        self.valid = mx.concatenate([self.valid, new_valid], axis=1)
        self.offset = self.offset + keep_arr
        self.length += n_new
        for layer in self.layers:
            layer.settle(n_new, keep)
        self.history.append(list(keep))
        if len(self.history) > MAX_HISTORY:
            self.history.pop(0)
            for layer in self.layers:
                layer.forget_oldest()
        # Some row kept the last new position, so it is real and nothing after it is: no
        # dead tail, and no need to read `valid` back (a sync point on every plain step).
        if not (n_new and max(keep) >= n_new):
            self._drop_dead_tail()

    def drop_last(self, counts: list[int]) -> None:
        """Mark the last counts[i] real tokens of row i as gone (a rollback)."""
        if not any(counts):
            return
        self._rewind_history(counts)
        counts_arr = mx.array(counts, dtype=mx.int32)
        # Rank of each valid position from the end: 1 for the last real token.
        from_end = mx.cumsum(self.valid[:, ::-1].astype(mx.int32), axis=1)[:, ::-1]
        self.valid = self.valid & ~(from_end <= counts_arr[:, None])
        self.offset = self.offset - counts_arr
        self._drop_dead_tail()

    def _rewind_history(self, counts: list[int]) -> None:
        # For each row: the oldest pass it must go back to, and what it keeps after it.
        plan: dict[int, list[tuple[int, list[int]]]] = {}
        for row, count in enumerate(counts):
            if not count:
                continue
            start, seen = len(self.history), 0
            while seen < count and start > 0:
                start -= 1
                seen += self.history[start][row]
            if seen < count:
                raise CacheError(
                    f"rollback of {count} tokens reaches back past the last checkpoint "
                    f"(row {row} has {seen} since then)"
                )
            left = seen - count
            kept = []
            for keep in self.history[start:]:
                k = min(keep[row], left)
                kept.append(k)
                left -= k
            for t, k in enumerate(kept):
                self.history[start + t][row] = k
            plan.setdefault(start, []).append((row, kept))
        for layer in self.layers:
            layer.rewind(plan)

    def _drop_dead_tail(self) -> None:
        # Trailing positions invalid in every row can simply be overwritten.
        alive = mx.any(self.valid, axis=0).tolist()
        end = len(alive)
        while end > 0 and not alive[end - 1]:
            end -= 1
        if end < self.length:
            self.valid = self.valid[:, :end]
            self.length = end

    def waste(self) -> float:
        """Share of physical positions that hold no real token."""
        if self.length == 0:
            return 0.0
        return 1.0 - mx.sum(self.valid).item() / (self.batch * self.length)

    def compact(self) -> None:
        """Move each row's real positions to the right end, in order; drop holes."""
        if self.length == 0:
            return
        order_key = self.valid.astype(mx.int32) * self.length + mx.arange(self.length)[None, :]
        order = mx.argsort(order_key, axis=1)
        keep = int(mx.max(mx.sum(self.valid, axis=1)).item())
        order = order[:, self.length - keep :]
        self.valid = mx.take_along_axis(self.valid, order, axis=1)
        for layer in self.layers:
            layer.gather(order)
        self.length = keep
        self.evaluate()

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""
        idx = mx.array(rows, dtype=mx.int32)
        self.valid = self.valid[idx]
        self.offset = self.offset[idx]
        self.history = [[keep[r] for r in rows] for keep in self.history]
        for layer in self.layers:
            layer.select(idx)
        self.drop_dead_head()
        self.evaluate()

    def forget(self, seen: mx.array) -> None:
        """Positions where `seen` (batch, length) is False stop being real: no later
        query attends them (they are past every sliding window). Rows keep their length."""
        self.valid = self.valid & seen

    def drop_dead_head(self, least: int = 1) -> None:
        """Drop the leading positions no row uses, when there are at least `least`."""
        alive = mx.any(self.valid, axis=0).tolist()
        start = next((i for i, a in enumerate(alive) if a), len(alive))
        if start >= least:
            self.valid = self.valid[:, start:]
            for layer in self.layers:
                layer.shift(start)
            self.length -= start

    def append(self, other: RaggedRows) -> None:
        """Add the rows of another cache (e.g. a freshly prefilled request)."""
        if other.length > self.length:
            self._pad_left(other.length - self.length)
        elif self.length > other.length:
            other._pad_left(self.length - other.length)
        self.valid = mx.concatenate([self.valid, other.valid])
        self.offset = mx.concatenate([self.offset, other.offset])
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.concat(theirs)
        self.checkpoint()  # the joined rows have no common past to roll back into
        self.evaluate()

    def can_place(self, other: RaggedRows) -> bool:
        """Whether `place` can put the rows of `other` into rows of this cache: no longer
        than this cache, and every layer of a kind that writes a row in place."""
        return (
            0 < self.length
            and other.length <= self.length
            and len(other.layers) == len(self.layers)
            and all(getattr(layer, "placeable", False) for layer in self.layers)
        )

    def place(self, slots: list[int], other: RaggedRows) -> None:
        """Put the rows of `other` (a fresh prefill) into rows `slots` of this cache, in
        place of the rows there (which leave): each new row's positions end where this
        cache's do, the slots before them hold nothing real. Only those rows' positions
        are written, where `select` then `append` copied every layer's whole cache twice
        and the next pass grew it a third time (measured at 4 demo rows: 1.0 + 1.0 + ~1
        ms a row that left and one that joined, against ~0.15 ms; the draft model's
        cache too). Needs `can_place(other)`."""
        pad = self.length - other.length
        at = mx.array(slots, dtype=mx.int32)
        fresh = mx.concatenate([mx.zeros((other.batch, pad), dtype=mx.bool_), other.valid], axis=1)
        self.valid[at] = fresh
        self.offset[at] = other.offset
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            mine.place(slots, theirs, pad)
        self.checkpoint()  # the placed rows have no past in this cache to roll back into
        self.drop_dead_head()  # the rows that left may have held the oldest positions
        self.evaluate()

    def evaluate(self) -> None:
        """Compute the rows' arrays now. Rows joining, leaving or compacting copy every
        layer's state lazily; left lazy, that copy would run inside the next forward
        pass and be timed as part of it, and the draft-length policy would price that
        pass shape (and so plain decoding, or a draft length) by a one-off copy."""
        arrays = [self.valid, self.offset]
        for layer in self.layers:
            arrays += layer.arrays()
        mx.eval(arrays)

    def _pad_left(self, n: int) -> None:
        self.valid = mx.concatenate([mx.zeros((self.batch, n), dtype=mx.bool_), self.valid], axis=1)
        for layer in self.layers:
            layer.pad_left(n)
        self.length += n


class RowLayer(Protocol):
    """What `RaggedRows` calls on every layer kind that hangs off its rows: the KV
    cache of an attention layer (`RaggedLayerCache`), a recurrent layer's state
    (recurrent.RecurrentLayerCache) and the DFlash drafter's context
    (dflash._ContextLayer)."""

    def settle(self, n_new: int, keep: list[int]) -> None:
        """A forward pass over n_new positions ended; row i keeps the first keep[i]."""

    def checkpoint(self) -> None:
        """No rollback will reach back past this point."""

    def forget_oldest(self) -> None:
        """The oldest pass in the rollback history will never be rolled back into."""

    def rewind(self, plan) -> None:
        """Undo the rows' last tokens (`RaggedRows.drop_last`'s plan)."""

    def gather(self, order: mx.array) -> None:
        """Reorder every row's slots (compaction)."""

    def select(self, idx: mx.array) -> None:
        """Keep only these rows, in this order."""

    def shift(self, start: int) -> None:
        """Drop the first `start` slots of every row."""

    def pad_left(self, n: int) -> None:
        """Put n empty slots before every row's first."""

    def concat(self, other) -> None:
        """Add the rows of the same layer of another cache, padded to the same length."""

    def arrays(self) -> list[mx.array]:
        """Every array the layer holds (what `RaggedRows.evaluate` computes)."""


class MaskedLayer:
    """A layer kind whose rollback is masking (RaggedRows marks the positions gone):
    the history hooks of the layer interface do nothing."""

    def settle(self, n_new: int, keep: list[int]) -> None:
        pass

    def checkpoint(self) -> None:
        pass

    def forget_oldest(self) -> None:
        pass

    def rewind(self, plan) -> None:
        pass


class RaggedLayerCache(MaskedLayer):
    """The KV cache of one attention layer (full or sliding-window), in the interface
    mlx-lm models call."""

    def __init__(self, rows: RaggedRows, window: int | None = None):
        self.rows = rows
        rows.layers.append(self)
        self.window = window  # the layer's own window (mlx-lm's RotatingKVCache max_size)
        self.keys = None
        self.values = None

    @property
    def offset(self) -> mx.array:
        return self.rows.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start, n = self.rows.length, keys.shape[2]
        if self.keys is None or start + n > self.keys.shape[2]:
            self._grow(keys, values, start + n)
        self.keys[..., start : start + n, :] = keys
        self.values[..., start : start + n, :] = values
        return self.keys[..., : start + n, :], self.values[..., : start + n, :]

    def _grow(self, keys, values, needed: int) -> None:
        size = ((needed + GROW - 1) // GROW) * GROW
        b, h, _, dk = keys.shape
        new_k = mx.zeros((b, h, size, dk), keys.dtype)
        new_v = mx.zeros((b, h, size, values.shape[3]), values.dtype)
        if self.keys is not None:
            used = self.rows.length
            new_k[..., :used, :] = self.keys[..., :used, :]
            new_v[..., :used, :] = self.values[..., :used, :]
        self.keys, self.values = new_k, new_v

    def make_mask(self, n: int, return_array: bool = False, window_size=None) -> mx.array:
        """Boolean mask (batch, 1, n, length + n): real past keys, causal new ones and,
        for a sliding layer, only keys whose true position is within the window."""
        rows, old = self.rows, self.rows.length
        j = mx.arange(n)
        causal = j[:, None] >= j[None, :]
        past = mx.broadcast_to(rows.valid[:, None, :], (rows.batch, n, old))
        if window_size is not None:
            # query at true position offset + i sees key at p iff offset + i - p < window
            query = rows.offset[:, None, None] + j[None, :, None]
            past = past & (query - rows.positions()[:, None, :] < window_size)
            causal = causal & (j[:, None] - j[None, :] < window_size)
        new = mx.broadcast_to(causal[None], (rows.batch, n, n))
        return mx.concatenate([past, new], axis=2)[:, None]

    @property
    def state(self):
        return self.keys, self.values

    def arrays(self) -> list[mx.array]:
        """Every array this layer holds (what `RaggedRows.evaluate` computes)."""
        return [] if self.keys is None else [self.keys, self.values]

    def is_trimmable(self) -> bool:
        return True

    def _used(self):
        n = self.rows.length
        return self.keys[..., :n, :], self.values[..., :n, :]

    def gather(self, order: mx.array) -> None:
        k, v = self._used()
        idx = order[:, None, :, None]
        self.keys = mx.take_along_axis(k, idx, axis=2)
        self.values = mx.take_along_axis(v, idx, axis=2)

    def select(self, idx: mx.array) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[idx], self.values[idx]

    #: `place` writes rows in place (RaggedRows.can_place).
    placeable = True

    def place(self, slots: list[int], other: RaggedLayerCache, pad: int) -> None:
        """Write row j of `other` into row slots[j], its positions from `pad` on (what
        is before them is masked: RaggedRows.place marks it not real)."""
        if other.keys is None or self.keys is None:
            return  # (prompts of one token: nothing prefilled, nothing to write)
        n = other.rows.length
        for j, slot in enumerate(slots):
            self.keys[slot : slot + 1, :, pad : pad + n, :] = other.keys[j : j + 1, :, :n, :]
            self.values[slot : slot + 1, :, pad : pad + n, :] = other.values[j : j + 1, :, :n, :]

    def shift(self, start: int) -> None:
        if self.keys is not None:
            self.keys = self.keys[..., start:, :]
            self.values = self.values[..., start:, :]

    def pad_left(self, n: int) -> None:
        if self.keys is not None:
            k, v = self._used()
            pad = [(0, 0), (0, 0), (n, 0), (0, 0)]
            self.keys, self.values = mx.pad(k, pad), mx.pad(v, pad)

    def concat(self, other: RaggedLayerCache) -> None:
        if self.keys is None and other.keys is None:
            return
        n = self.rows.length  # both sides were padded to this length
        mine = self._used() if self.keys is not None else None
        theirs = other._used() if other.keys is not None else None
        ref = mine or theirs

        def empty(b: int):
            k, v = ref
            return (
                mx.zeros((b, k.shape[1], n, k.shape[3]), k.dtype),
                mx.zeros((b, v.shape[1], n, v.shape[3]), v.dtype),
            )

        mine = mine or empty(self.rows.batch - other.rows.batch)
        theirs = theirs or empty(other.rows.batch)
        self.keys = mx.concatenate([mine[0], theirs[0]])
        self.values = mx.concatenate([mine[1], theirs[1]])
