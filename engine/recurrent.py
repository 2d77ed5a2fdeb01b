"""Recurrent layer state (mlx-lm's ArraysCache) kept exact per row of a ragged batch.

Gated delta-nets (qwen3_5, qwen3_next), conv layers (lfm2) and SSMs (nemotron_h) carry
a state that every position they see changes: right-padding and rejected drafts cannot
be masked away afterwards as in a KV cache. So each layer's mixer is made to record
its input during the pass (`install_recorder`), and once the decoder says which
positions each row keeps, the rows that kept fewer than they were fed are replayed:
the layer's own mixer runs again on the kept prefix, from the state before the pass,
with mlx-lm's right-padding support (`ArraysCache.lengths`: the state stops at each
row's length). `drop_last` replays from the state before an earlier pass over the
inputs still kept since then. Rows that kept everything cost nothing; the replay
costs one mixer call (not a model pass) over the kept prefix of the other rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

_INPUT_NAMES = ("x", "inputs", "input_states", "hidden_states")


@dataclass
class _Call:
    """One mixer call, so it can be run again on other inputs and another cache."""

    module: object
    fn: object  # the mixer class's own __call__
    args: tuple
    kwargs: dict
    x_at: int | str  # where the input tensor is: positional index or keyword
    cache_at: int | str

    @property
    def x(self) -> mx.array:
        return self._get(self.x_at)

    def _get(self, at):
        return self.args[at] if isinstance(at, int) else self.kwargs[at]

    def run(self, x: mx.array, mask, cache) -> None:
        args, kwargs = list(self.args), dict(self.kwargs)
        for at, value in ((self.x_at, x), (self.cache_at, cache)):
            if isinstance(at, int):
                args[at] = value
            else:
                kwargs[at] = value
        if "mask" in kwargs:
            kwargs["mask"] = mask
        elif len(args) > 1 and self.x_at == 0 and self.cache_at != 1:
            args[1] = mask  # mlx-lm mixers take (x, mask, cache)
        self.fn(self.module, *args, **kwargs)


def _locate(args, kwargs, test):
    for i, a in enumerate(args):
        if test(a):
            return i
    for k, a in kwargs.items():
        if test(a):
            return k
    return None


_RECORDING: dict[type, type] = {}


def install_recorder(mixer) -> None:
    """Make `mixer` (an nn.Module instance) tell its RecurrentLayerCache what it was
    called with. The parameter tree is untouched; installing twice is harmless."""
    cls = type(mixer)
    if cls in _RECORDING.values():
        return
    if cls not in _RECORDING:
        original = cls.__call__

        def __call__(self, *args, **kwargs):
            cache_at = _locate(args, kwargs, lambda a: isinstance(a, RecurrentLayerCache))
            if cache_at is not None:
                cache = args[cache_at] if isinstance(cache_at, int) else kwargs[cache_at]
                x_at = 0 if args else next(k for k in _INPUT_NAMES if k in kwargs)
                cache.begin(_Call(self, original, args, kwargs, x_at, cache_at))
            return original(self, *args, **kwargs)

        _RECORDING[cls] = type(f"Recorded{cls.__name__}", (cls,), {"__call__": __call__})
    mixer.__class__ = _RECORDING[cls]


def _take(state: list, idx: mx.array) -> list:
    return [s[idx] for s in state]


class RecurrentLayerCache:
    """One recurrent layer's state for every row, in the ArraysCache interface that
    mlx-lm mixers call (`cache[i]`, `lengths`, `advance`, `make_mask`)."""

    def __init__(self, rows, size: int):
        self.rows = rows
        rows.layers.append(self)
        self.cache: list = [None] * size
        self.lengths = None  # never set here: replays use a private ArraysCache
        self.left_padding = None
        self._pending: tuple[list, _Call] | None = None
        self.history: list[tuple[list, _Call | None]] = []  # (state before, call) per pass

    # -- what mlx-lm mixers call ----------------------------------------------------------
    def __getitem__(self, i):
        return self.cache[i]

    def __setitem__(self, i, value):
        self.cache[i] = value

    def advance(self, n: int) -> None:
        pass

    def make_mask(self, n: int, **_):
        return None  # every position is real during the pass; `settle` fixes the rest

    @property
    def state(self):
        return [c for c in self.cache if c is not None]

    def arrays(self) -> list[mx.array]:
        """Every array this layer holds (what `RaggedRows.evaluate` computes)."""
        return self.state

    def empty(self) -> bool:
        return self.cache[0] is None

    def is_trimmable(self) -> bool:
        return True

    # -- the ragged interface -------------------------------------------------------------
    def begin(self, call: _Call) -> None:
        """Called by the recording mixer at the start of a pass over this cache."""
        self._pending = (list(self.cache), call)

    def _zeros_for_empty(self, state: list) -> list:
        return [
            s if s is not None else (mx.zeros_like(c) if c is not None else None)
            for s, c in zip(state, self.cache, strict=True)
        ]

    def settle(self, n_new: int, keep: list[int]) -> None:
        """After a pass over n_new positions: row i holds the state after keep[i]."""
        before, call = self._pending or (list(self.cache), None)
        self._pending = None
        before = self._zeros_for_empty(before)
        fix = [i for i, k in enumerate(keep) if k < n_new]
        if fix and call is not None:
            lengths = [keep[i] for i in fix]
            idx = mx.array(fix, dtype=mx.int32)
            x = call.x[idx, : max(lengths)]
            self._put(fix, self._replay(call, _take(before, idx), x, lengths))
        self.history.append((before, call))

    def _replay(self, call: _Call, state: list, x: mx.array, lengths: list[int]) -> list:
        tmp = ArraysCache(len(state))
        tmp.cache = list(state)
        if max(lengths) == 0:
            return tmp.cache
        tmp.lengths = mx.array(lengths, dtype=mx.int32)
        call.run(x, tmp.make_mask(x.shape[1]), tmp)
        return tmp.cache

    def _put(self, rows: list[int], new: list) -> None:
        # A gathered copy, then assignment: the old arrays stay as they were, since
        # history entries may still hold them.
        batch = self.rows.batch
        everyone = mx.arange(batch)
        idx = mx.array(rows, dtype=mx.int32)
        out = []
        for cur, val in zip(self.cache, new, strict=True):
            if cur is None:
                out.append(None)
                continue
            copy = cur[everyone]
            copy[idx] = val.astype(cur.dtype)
            out.append(copy)
        self.cache = out

    def checkpoint(self) -> None:
        self.history = []

    def forget_oldest(self) -> None:
        self.history.pop(0)

    def rewind(self, plan: dict[int, list[tuple[int, list[int]]]]) -> None:
        """Undo drops: plan[start] lists (row, kept inputs of each pass since `start`)."""
        for start, members in plan.items():
            entries = self.history[start:]
            rows = [row for row, _ in members]
            idx = mx.array(rows, dtype=mx.int32)
            before = _take(entries[0][0], idx)
            lengths = [sum(kept) for _, kept in members]
            if max(lengths) == 0:
                self._put(rows, before)
                continue
            seqs = []
            for row, kept in members:
                parts = [c.x[row, :k] for (_, c), k in zip(entries, kept, strict=True) if k]
                seq = mx.concatenate(parts) if parts else None
                seqs.append(seq)
            ref = next(s for s in seqs if s is not None)
            width = max(lengths)
            x = mx.stack(
                [
                    mx.zeros((width, ref.shape[-1]), ref.dtype)
                    if s is None
                    else mx.pad(s, [(0, width - s.shape[0]), (0, 0)])
                    for s in seqs
                ]
            )
            call = next(c for _, c in entries if c is not None)
            self._put(rows, self._replay(call, before, x, lengths))

    def select(self, idx: mx.array) -> None:
        self.cache = [c[idx] if c is not None else None for c in self.cache]
        self.history = [
            (_take_opt(before, idx), _select_call(call, idx)) for before, call in self.history
        ]

    def concat(self, other: RecurrentLayerCache) -> None:
        a, b = self.rows.batch - other.rows.batch, other.rows.batch
        out = []
        for mine, theirs in zip(self.cache, other.cache, strict=True):
            ref = mine if mine is not None else theirs
            if ref is None:
                out.append(None)
                continue
            mine = mine if mine is not None else mx.zeros((a, *ref.shape[1:]), ref.dtype)
            theirs = theirs if theirs is not None else mx.zeros((b, *ref.shape[1:]), ref.dtype)
            out.append(mx.concatenate([mine, theirs]))
        self.cache = out
        self.history = []

    # Slots are a KV notion: a recurrent state has none to move.
    def gather(self, order) -> None:
        pass

    def shift(self, start: int) -> None:
        pass

    def pad_left(self, n: int) -> None:
        pass


def _take_opt(state: list, idx: mx.array) -> list:
    return [s[idx] if s is not None else None for s in state]


def _select_call(call: _Call | None, idx: mx.array) -> _Call | None:
    if call is None:
        return None
    args, kwargs = list(call.args), dict(call.kwargs)
    if isinstance(call.x_at, int):
        args[call.x_at] = call.x[idx]
    else:
        kwargs[call.x_at] = call.x[idx]
    return _Call(call.module, call.fn, tuple(args), kwargs, call.x_at, call.cache_at)
