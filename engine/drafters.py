"""Where draft tokens come from: prompt lookup, and a draft language model.

Prompt lookup proposes the tokens that followed the most recent earlier
occurrence of the last n-gram of prompt + output (longest n first). It costs no
model pass, so it pays wherever the output repeats its input: summaries,
extraction, code edits.

`ModelProposer` drafts with a small language model for every row of a batch at
once: K passes of one token per row over a ragged cache whose rows roll back on
their own after verification. Both it and `DFlashProposer` are `interfaces.Proposer`s;
`new_proposer(pair)` makes the one a pair drafts with.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

from . import processors, sampling
from .families import make_ragged_cache
from .interfaces import Joining, Proposer
from .prefix import prefill_cached
from .sampling import DRAW_DRAFT

# Squeeze holes out of a DFlash context every this many steps (it checks its waste).
DFLASH_COMPACT_EVERY = 32

PREFILL_CHUNK = 512


def new_proposer(pair) -> Proposer | None:
    """The proposer a pair drafts with: its hidden-state drafter's (DFlash, an MTP or
    EAGLE-3 head: `pair.dflash.proposer`), a `ModelProposer` over its draft LM, or None
    when it has neither (then only prompt lookup drafts)."""
    if pair.dflash is not None:
        proposer = pair.dflash.proposer(pair.target_vocab)
        drafter_params = pair.dflash.info().get("parameters")
    elif pair.draft is not None:
        proposer = ModelProposer(
            pair.draft, pair.draft_vocab, pair.target_vocab, prefix=prefix_of(pair, "draft")
        )
        drafter_params = pair.info()["draft_parameters"]
    else:
        return None
    target_params = pair.info()["target_parameters"]
    if drafter_params and target_params:
        # What it costs, declared: a drafter pass over a target pass, by their sizes.
        proposer.draft_cost = max(drafter_params / target_params, 0.05)
    return proposer


def prefix_of(pair, role: str):
    """The pair's prefix cache for "target" or "draft", or None where none is kept."""
    caches = pair.prefix
    cache = getattr(caches, role) if caches is not None else None
    return cache if cache is not None and cache.enabled else None


class LookupIndex:
    """Incremental n-gram index over a growing token sequence.

    `append` only queues tokens (a step's upkeep for a row whose free drafts nobody
    asks for, as while "auto" keeps a K = 0); `offer`, where the current proposal starts
    in `tokens` (-1: none), and `propose` index the queued tokens first.
    """

    def __init__(self, tokens: list[int], max_ngram: int = 3, min_ngram: int = 1):
        self.tokens: list[int] = []
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        # (n-gram) -> index of the token that followed its latest occurrence
        self._follower: dict[tuple[int, ...], int] = {}
        self._start = -1
        self._queued: list[int] = []
        self.extend(tokens)

    def append(self, new_tokens: list[int]) -> None:
        """Queue tokens for indexing at the next `offer` or `propose`."""
        self._queued += new_tokens

    def extend(self, new_tokens: list[int]) -> None:
        """Append tokens, indexing each n-gram once a token follows it, then find the
        latest earlier match of the longest suffix (n from max_ngram down to min_ngram)."""
        tokens, follower, low = self.tokens, self._follower, self.min_ngram
        for tok in new_tokens:
            end = len(tokens)
            for n in range(low, min(self.max_ngram, end) + 1):
                follower[tuple(tokens[end - n : end])] = end
            tokens.append(tok)
        end = len(tokens)
        self._start = -1
        for n in range(min(self.max_ngram, end), low - 1, -1):
            start = follower.get(tuple(tokens[end - n :]))
            if start is not None:
                self._start = start
                return

    @property
    def offer(self) -> int:
        """Where the current proposal starts in `tokens`; -1 if there is none."""
        if self._queued:
            queued, self._queued = self._queued, []
            self.extend(queued)
        return self._start

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier match of the longest suffix."""
        start = self.offer
        if k <= 0 or start < 0:
            return []
        return self.tokens[start : start + k]


def prefill_rows(model, prompts: list[list[int]], after_pass=None):
    """A ragged cache holding several prompts, filled in batched passes (right-padded;
    pads masked out). `after_pass(keep)`, if given, runs after each pass with how many
    positions of each row were real. Returns (rows, layer caches)."""
    rows, cache = make_ragged_cache(model, len(prompts))
    longest = max(map(len, prompts), default=0)
    for start in range(0, longest, PREFILL_CHUNK):
        width = min(PREFILL_CHUNK, longest - start)
        chunks = [p[start : start + width] for p in prompts]
        model(mx.array([c + [0] * (width - len(c)) for c in chunks]), cache=cache)
        keep = [len(c) for c in chunks]
        rows.advance(width, keep)
        if after_pass is not None:
            after_pass(keep)
        mx.eval([c.state for c in cache])
    return rows, cache


@dataclass
class _Member:
    """A row the draft model drafts for; `pending` are accepted tokens it has not seen."""

    key: object
    pending: list[int]
    params: sampling.SamplingParams
    seed: int
    position: int = 0  # output position of the row's next token
    used: bool = field(default=False)  # its drafts this step came from the model
    read: int = 1  # pending tokens the step's draft passes read
    reading: bool = False  # it does not draft, and the next chained pass reads its backlog


class ModelProposer(Proposer):
    """Batched drafting with a draft LM (`needs_features` False: it reads only tokens).
    Rows join (`admit`), leave (`remove`), get `propose(want)` drafts, then `commit`
    tells it what the target accepted.

    A row joins cold: the draft model reads nothing of it until the row first asks for
    drafts, and then takes its prompt and everything emitted so far in one prefill. So
    rows that "auto" never drafts for (plain decoding pays better, as in large batches
    on a CPU) cost the draft model nothing. A row it has not drafted for lately, or one
    that took a prompt-lookup draft, has a backlog (accepted tokens it has not read):
    the step's first draft pass reads it, as wide as the longest backlog of a drafting
    row. A pass of its own before the drafts cost a whole pass more for a few positions
    (measured at 4 demo rows: a draft pass 1.1 ms one position wide, 1.6 ms nine wide),
    and "auto" paid it after every step that took lookup drafts. Rows that do not draft
    read as much of their backlog as fits in the first pass, and a token more in each
    chained pass (their positions are computed either way).
    """

    kind = "model"
    masks_drafts = True
    stops_early = True

    def __init__(self, model, draft_vocab: int, target_vocab: int, prefix=None):
        self.model = model
        self.prefix = prefix  # engine.prefix.PrefixCache of the draft model, or None
        self.draft_vocab = draft_vocab
        self.target_vocab = target_vocab
        self.rows, self.cache = make_ragged_cache(model, 0)
        self.members: list[_Member] = []  # rows in the draft cache, in its row order
        self.cold: dict = {}  # key -> (tokens so far, params, seed): not read yet
        self.depth = 0  # draft passes of the step in progress (reset by commit)
        self._sampled: list[_Member] = []  # members drawing samples at this depth

    def admit(self, joining: list[Joining], context=None) -> None:
        """Rows that draft by the model join cold (see the class docstring); the others
        never reach the draft model."""
        for row in joining:
            if row.drafts:
                self.cold[row.key] = (list(row.ids), row.params, row.seed)

    def _warm(self, keys: list) -> None:
        """Prefill cold rows with every token they have; the newest stays pending, as
        in the target."""
        found = [(key, *self.cold.pop(key)) for key in keys]
        prompts = [ids[:-1] for _, ids, _, _ in found]
        if self.prefix is not None:
            rows, _, _ = prefill_cached(self.model, prompts, self.prefix)
        else:
            rows, _ = prefill_rows(self.model, prompts)
        # A fresh ragged cache's layer objects are grafted onto ours by RaggedRows.append.
        self.rows.append(rows)
        self.members += [_Member(key, [ids[-1]], params, seed) for key, ids, params, seed in found]

    def cold_tokens(self, key) -> int:
        """Tokens a cold row's first prefill would run the draft over (0 if warm)."""
        if key not in self.cold:
            return 0
        ids = self.cold[key][0]
        kept = self.prefix.kept_length(ids[:-1]) if self.prefix is not None else 0
        return len(ids) - kept

    def remove(self, keys: set) -> None:
        for key in keys:
            self.cold.pop(key, None)
        keep = [i for i, m in enumerate(self.members) if m.key not in keys]
        if len(keep) != len(self.members):
            self.rows.select(keep)
            self.members = [self.members[i] for i in keep]

    def propose(
        self,
        want: dict,
        positions: dict,
        last: dict | None = None,
        grammar: dict | None = None,
        stop=None,
    ) -> tuple[dict, dict]:
        """Draft want[key] tokens for each member key (0 or absent: none); every member
        runs through the same passes (`last` is not needed: a member's pending tokens
        end with it). Returns ({key: tokens}, {key: (k, V) law}) with
        laws only for sampled rows (over the target's vocabulary, padding rows 0).
        `grammar`: {key: processors.RowLogits} of rows whose processors (bias, penalties,
        grammar) apply to their drafts (`DraftLogits`). `stop`: after each pass it is
        called with {key: [the draft model's probability of each draft so far]} of the
        drafting rows, and the drafts end where it returns False (early stopping)."""
        waking = [key for key in self.cold if want.get(key, 0) > 0]
        if waking:
            self._warm(waking)
        depth = max((want.get(m.key, 0) for m in self.members), default=0)
        self.depth = depth
        for m in self.members:
            m.used = want.get(m.key, 0) > 0
            m.position = positions.get(m.key, 0)
        if depth == 0:
            return {}, {}
        members = self.members
        self.rows.checkpoint()  # what the draft passes add may roll back; nothing before
        # The first pass reads every drafting row's pending tokens, and as many of its
        # backlog as fit for a row that does not draft; each row's first draft is at its
        # last token read.
        width = max(len(m.pending) for m in members if m.used)
        for m in members:
            m.read, m.reading = min(width, len(m.pending)), False
        feed = mx.array([m.pending[: m.read] + [0] * (width - m.read) for m in members])
        last = mx.array([m.read - 1 for m in members]) if width > 1 else None
        dv = self.draft_vocab
        walkers = DraftLogits(members, grammar, dv) if grammar else None
        try:
            tokens, laws = self._passes(members, feed, last, width, depth, dv, walkers, stop)
        finally:
            if walkers is not None:
                walkers.rollback()
        mx.eval(tokens)
        table = mx.stack(tokens, axis=1).tolist()
        sampled = {m.key: j for j, m in enumerate(self._sampled)}
        if sampled:  # (sampled members, depth, V): each member's law at every depth
            stacked = mx.stack(laws, axis=1)
            if dv < self.target_vocab:
                stacked = mx.pad(stacked, [(0, 0), (0, 0), (0, self.target_vocab - dv)])
        drafts, q = {}, {}
        for j, m in enumerate(members):
            k = want.get(m.key, 0)
            if not k:
                continue
            drafts[m.key] = table[j][:k]
            if m.key in sampled:
                q[m.key] = stacked[sampled[m.key], :k]
        return drafts, q

    def _passes(self, members, feed, last, width: int, depth: int, dv: int, walkers, stop):
        """The step's draft passes: a token (and, for sampled rows, its law) per member
        at each depth; rows with processors drafted under them (`walkers`); fewer passes
        where `stop` says so (`self.depth` is then the passes run)."""
        tokens, laws = [], []
        used = [j for j, m in enumerate(members) if m.used]
        probs: dict = {members[j].key: [] for j in used}
        sure: list = []  # per pass, the drafting rows' confidence, not yet read
        for step in range(depth):
            out = self.model(feed, cache=self.cache)
            if step == 0 and last is not None:
                logits = out[mx.arange(len(members)), last, :dv]
                self.rows.advance(width, [m.read for m in members])
            else:
                logits = out[:, -1, :dv]
                # A row that does not draft reads a token more of its backlog, if it has
                # one; else it keeps none of the chained passes' positions.
                keep = [1 if step == 0 or m.used or m.reading else 0 for m in members]
                self.rows.advance(1, keep)
                for m in members:
                    m.read += m.reading
            if walkers is not None:
                logits = walkers.apply(logits)
            tok, law = self._sample(logits, step)
            if walkers is not None and step + 1 < depth:
                walkers.walk(tok)
            tokens.append(tok)
            laws.append(law)
            if stop is not None:
                top = logits[mx.array(used)]
                sure.append(mx.exp(mx.max(top, axis=-1) - mx.logsumexp(top, axis=-1)))
                # The last pass's confidence is read with its tokens (no sync of its own).
                if step + 1 < depth and not stop(self._confidence(probs, used, sure)):
                    self.depth = step + 1
                    break
            if step + 1 < depth:
                for m in members:
                    m.reading = not m.used and m.read < len(m.pending)
                feed = tok[:, None].astype(mx.uint32)
                if any(m.reading for m in members):
                    backlog = mx.array([m.pending[m.read] if m.reading else 0 for m in members])
                    reading = mx.array([m.reading for m in members])
                    feed = mx.where(reading[:, None], backlog[:, None], feed)
        if sure:
            self._confidence(probs, used, sure)
        return tokens, laws

    def _confidence(self, probs: dict, used: list, sure: list) -> dict:
        """Read the passes' confidences not read yet into probs ({key: [p per draft]})."""
        for pass_probs in sure:
            for j, p in zip(used, pass_probs.tolist(), strict=True):
                probs[self.members[j].key].append(p)
        sure.clear()
        return probs

    def _sample(self, logits, step):
        """Tokens for every member at this depth, and the laws of the sampled members
        (in self._sampled order) they were drawn from."""
        greedy = mx.argmax(logits, axis=-1)
        index = [j for j, m in enumerate(self.members) if not m.params.greedy]
        self._sampled = [self.members[j] for j in index]
        if not index:
            return greedy, None
        rows = mx.array(index)
        law = sampling.probs_rows(logits[rows], [m.params for m in self._sampled])
        keys = sampling.position_keys(
            [m.seed for m in self._sampled],
            [m.position + step for m in self._sampled],
            1,
            DRAW_DRAFT,
        )
        drawn = sampling.sample_rows(law, sampling.gumbel_table(keys, law.shape[-1])[:, 0])
        if len(index) == len(self.members):
            return drawn, law
        spread = mx.zeros(greedy.shape, greedy.dtype).at[rows].add(drawn.astype(greedy.dtype))
        is_sampled = mx.array([not m.params.greedy for m in self.members])
        return mx.where(is_sampled, spread, greedy), law

    def commit(self, emitted: dict, accepted: dict) -> None:
        """After verification: emitted[key] = tokens the row put out this step (accepted
        drafts + the target's token), accepted[key] = how many drafts passed."""
        depth = self.depth
        for key, (ids, _, _) in self.cold.items():
            ids.extend(emitted.get(key, []))
        drop = []
        for m in self.members:
            out = emitted.get(m.key, [])
            if depth == 0:  # the draft did not run: it owes these tokens
                m.pending.extend(out)
                continue
            if not m.used:  # it read m.read tokens of its backlog and kept no draft position
                drop.append(0)
                m.pending = m.pending[m.read :] + out
                continue
            # Its cache holds pending + depth - 1 drafted tokens; keep those the target
            # accepted.
            kept = min(accepted.get(m.key, 0), depth - 1)
            drop.append(depth - 1 - kept)
            m.pending = out[kept:]
        if depth:
            self.rows.drop_last(drop)
        self.depth = 0

    def lengths(self) -> dict:
        """{key: tokens in the draft cache} (accepted tokens minus pending; 0 when cold)."""
        found = dict(zip((m.key for m in self.members), self.rows.offset.tolist(), strict=True))
        return {**found, **dict.fromkeys(self.cold, 0)}

    def pending(self, key) -> list[int]:
        """Accepted tokens of a row the draft model has not read yet."""
        if key in self.cold:
            return list(self.cold[key][0])
        return list(next(m.pending for m in self.members if m.key == key))


class DFlashProposer(Proposer):
    """Batched drafting with a DFlash block drafter: one drafter pass per step proposes
    up to block_size - 1 tokens for every row, read off the target's own hidden states.

    Its context (the target features of every token the target has processed) has one
    row per decoder row, in the decoder's order: the decoder feeds it the features of
    each prefill and verify pass (`needs_features`), keeping per row only the accepted
    positions, so a rejection needs no rollback here. Block position j's law, given the
    context up to the block, is the q of speculative sampling for the j-th draft.
    """

    kind = "dflash"
    needs_features = True
    block = True

    def __init__(self, drafter, target_vocab: int):
        self.drafter = drafter
        self.target_vocab = target_vocab
        self.state = drafter.new_state(0)
        self.keys: list = []  # decoder row keys, in state row order
        self.params: dict = {}
        self.seeds: dict = {}
        self.depth = 0
        self.max_draft = drafter.block_size - 1
        self._steps = 0

    @property
    def members(self) -> list:
        return self.keys

    def capture(self, target):
        """A context manager: target forwards inside it record the features."""
        return self.drafter.capture(target)

    def new_context(self, batch: int):
        return self.drafter.new_state(batch)

    def admit(self, joining: list[Joining], context=None) -> None:
        """Every decoder row joins (drafted by the model or not: the context's rows are
        the decoder's rows), with the context its prefill passes built."""
        self.state.append(context)
        for row in joining:
            self.keys.append(row.key)
            self.params[row.key], self.seeds[row.key] = row.params, row.seed

    def remove(self, keys: set) -> None:
        keep = [i for i, k in enumerate(self.keys) if k not in keys]
        if len(keep) != len(self.keys):
            self.state.select(keep)
            self.keys = [self.keys[i] for i in keep]
            for k in keys:
                self.params.pop(k, None)
                self.seeds.pop(k, None)

    def observe_target(self, features, keep: list[int]) -> None:
        """After a target pass over every row: row i's first keep[i] positions are real."""
        self.state.extend(features, keep)
        self._steps += 1
        if self._steps % DFLASH_COMPACT_EVERY == 0 and self.state.used:
            real = sum(self.state.lengths())
            if real < 0.5 * self.state.batch * self.state.used:
                self.state.compact()

    def propose(self, want: dict, positions: dict, last: dict) -> tuple[dict, dict]:
        """Draft want[key] tokens per row from one block pass; `last` maps each key to
        the row's newest (pending) token. Laws only for sampled rows."""
        depth = min(max(want.values(), default=0), self.max_draft)
        self.depth = 1 if depth else 0
        if depth == 0:
            return {}, {}
        if self.drafter.chained:
            return self._propose_chain(want, positions, last, depth)
        logits = self.drafter_logits([last[k] for k in self.keys])[:, :depth]
        greedy = mx.argmax(logits, axis=-1).tolist()
        sampled = [i for i, key in enumerate(self.keys) if not self.params[key].greedy]
        if sampled:  # one draw for every sampled row and block position
            keys = [self.keys[i] for i in sampled]
            laws = sampling.probs_rows(logits[mx.array(sampled)], [self.params[k] for k in keys])
            noise = sampling.gumbel_table(
                sampling.position_keys(
                    [self.seeds[k] for k in keys], [positions[k] for k in keys], depth, DRAW_DRAFT
                ),
                laws.shape[-1],
            )
            drawn = dict(zip(keys, sampling.sample_rows(laws, noise).tolist(), strict=True))
            law_of = {k: j for j, k in enumerate(keys)}
        drafts, q = {}, {}
        for i, key in enumerate(self.keys):
            k = min(want.get(key, 0), depth)
            if not k:
                continue
            if self.params[key].greedy:
                drafts[key] = greedy[i][:k]
                continue
            drafts[key] = drawn[key][:k]
            q[key] = laws[law_of[key], :k]
        return drafts, q

    def _propose_chain(self, want: dict, positions: dict, last: dict, depth: int):
        """DFlash2: the candidate selector picks each draft given the one before; a sampled
        row's law at position j is conditional on its drafts before j."""
        sampled = [i for i, key in enumerate(self.keys) if not self.params[key].greedy]
        keys = [self.keys[i] for i in sampled]
        tokens, laws = self.drafter.draft_chain(
            self.state,
            [last[k] for k in self.keys],
            depth,
            sampled,
            [self.params[k] for k in keys],
            [self.seeds[k] for k in keys],
            [positions[k] for k in keys],
        )
        table = tokens.tolist()
        law_of = {k: j for j, k in enumerate(keys)}
        drafts, q = {}, {}
        for i, key in enumerate(self.keys):
            k = min(want.get(key, 0), depth)
            if k:
                drafts[key] = table[i][:k]
                if key in law_of:
                    q[key] = laws[law_of[key], :k]
        return drafts, q

    def drafter_logits(self, last_tokens: list[int]) -> mx.array:
        return self.state.block_logits(last_tokens)

    def commit(self, emitted: dict, accepted: dict) -> None:
        self.depth = 0

    def lengths(self) -> dict:
        return dict(zip(self.keys, self.state.lengths(), strict=True))

    def pending(self, key) -> list[int]:
        return []


class DraftLogits:
    """The processors of a draft step's rows (`processors.RowLogits`), applied to every
    draft pass as the target's verify pass will apply them, so the draft model proposes
    what the processed target would choose (better acceptance) and a sampled row's law is
    the processed one it drew from. In the verify pass's order: `logit_bias`; the
    repetition penalty over the row's tokens so far and the drafts before this depth;
    frequency and presence penalties over the row's output so far and those drafts; the
    grammar's mask after those drafts (rows inside a thinking section: no mask).

    Each row's matcher holds emitted tokens only: `walk` feeds it the drafts of each depth
    and `rollback` (always, when the step's passes end) takes them back off. The drafts'
    own counts stay on the device (`extra`), added to each pass's base counts."""

    def __init__(self, members, rows: dict, vocab: int):
        self.vocab = vocab
        n = len(members)
        procs = {j: rows[m.key] for j, m in enumerate(members) if m.used and m.key in rows}
        self.grammar = {j: p for j, p in procs.items() if p.constrained}
        self.walked = dict.fromkeys(self.grammar, 0)
        self.live = set(self.grammar)
        words = (max(vocab, 1) + 31) // 32
        self.bitmask = np.full((n, words), -1, dtype=np.int32)
        self.bias = self.seen = self.counts = None
        if any(p._bias is not None for p in procs.values()):
            self.bias = mx.array(self._stack(procs, n, lambda p: p._bias, np.float32))
        penalised = [
            j in procs and (procs[j].seen is not None or procs[j].counts is not None)
            for j in range(n)
        ]
        if any(penalised):
            # (rows, vocab): this step's drafts so far, in the rows with penalties
            self.extra = mx.zeros((n, vocab), mx.float32)
            self.penalised = mx.array([float(x) for x in penalised])
        if any(p.seen is not None for p in procs.values()):
            self.seen = mx.array(self._stack(procs, n, lambda p: p.seen, bool))
            self.rp = mx.array([procs[j].repetition if j in procs else 1.0 for j in range(n)])
        if any(p.counts is not None for p in procs.values()):
            self.counts = mx.array(self._stack(procs, n, lambda p: p.counts, np.float32))
            self.weights = mx.array(
                [
                    (procs[j].frequency, procs[j].presence) if j in procs else (0.0, 0.0)
                    for j in range(n)
                ],
                dtype=mx.float32,
            )

    def _stack(self, procs: dict, n: int, values, dtype) -> np.ndarray:
        """(rows, vocab) of one processor's per-token array (zeros where a row has none),
        cut or padded to the draft's vocabulary."""
        out = np.zeros((n, self.vocab), dtype)
        for j, p in procs.items():
            v = values(p)
            if v is not None:
                m = min(len(v), self.vocab)
                out[j, :m] = v[:m]
        return out

    def apply(self, logits: mx.array) -> mx.array:
        """(members, vocab) logits processed for this depth."""
        part = logits
        if self.bias is not None or self.seen is not None or self.counts is not None:
            part = part.astype(mx.float32)
        if self.bias is not None:
            part = part + self.bias
        if self.seen is not None:
            part = processors.repetition(part, self.seen | (self.extra > 0), self.rp[:, None])
        if self.counts is not None:
            w = self.weights
            part = processors.frequency_presence(
                part, self.counts + self.extra, w[:, 0, None], w[:, 1, None]
            )
        return self._mask(part)

    def _mask(self, logits: mx.array) -> mx.array:
        """Each live row's disallowed tokens at -inf."""
        if not self.live:
            return logits
        self.bitmask.fill(-1)
        for j in self.live:
            matcher = self.grammar[j].matcher
            if matcher.is_stopped():
                continue
            fill_next_token_bitmask(matcher, self.bitmask, j)
            if not self.bitmask[j].any():  # nothing allowed: leave the row unmasked
                self.bitmask[j] = -1
        bits = mx.array(self.bitmask)[:, :, None] >> mx.arange(32, dtype=mx.int32)
        allowed = (bits & 1).astype(mx.bool_).reshape(self.bitmask.shape[0], -1)
        return mx.where(allowed[:, : logits.shape[-1]], logits, -mx.inf)

    def walk(self, tokens: mx.array) -> None:
        """The rows take the tokens they drafted at this depth: penalty counts on the
        device, each live row's grammar on the host."""
        if self.seen is not None or self.counts is not None:
            rows = mx.arange(tokens.shape[0])
            self.extra = self.extra.at[rows, tokens.astype(mx.int32)].add(self.penalised)
        if not self.live:
            return
        drafted = tokens.tolist()
        for j in list(self.live):
            matcher = self.grammar[j].matcher
            t = drafted[j]
            if matcher.is_stopped() or matcher.validate_tokens([t]) != 1:
                self.live.discard(j)  # the drafts after it are cut (BatchDecoder._trim)
                continue
            matcher.consume_token(t)
            self.walked[j] += 1

    def rollback(self) -> None:
        for j, n in self.walked.items():
            if n:
                self.grammar[j].matcher.rollback(n)
        self.walked = dict.fromkeys(self.grammar, 0)
