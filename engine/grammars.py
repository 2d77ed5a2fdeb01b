"""Compiled output constraints for one target: llguidance matchers, one compile per
constraint.

A request's constraint (the normalised dict of `contract.constraints`) compiles, with
the target's tokenizer, to an llguidance `LLMatcher`: the grammar's state, which gives
the set of tokens allowed next as a bitmask and can be rolled back. Compiling is the
expensive part (up to a second for a large schema), so each constraint compiles once
per process, keyed by its text (`contract.constraints.key`), and every row starts from
a copy of that compiled prototype (a microsecond). A million lines with one schema
compile it once.
"""

from __future__ import annotations

from collections import OrderedDict

import llguidance

from contract import constraints

from .types import InvalidRequestError

#: Compiled constraints kept per target (least recently used dropped first).
MAX_COMPILED = 256


class Grammars:
    """The compiled constraints of one target: `matcher(constraint)` gives a fresh
    matcher at the grammar's start. `compiles` counts the compiles this process ran."""

    def __init__(self, tokenizer, vocab: int):
        self._hf = tokenizer
        self.vocab = vocab
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self.compiles = 0
        self.executor = llguidance.LLExecutor()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the target tokenizer (built on first use: ~10 ms to 1 s)."""
        if self._tokenizer is None:
            hf = getattr(self._hf, "_tokenizer", self._hf)
            backend = getattr(hf, "backend_tokenizer", None)
            if backend is None:
                raise InvalidRequestError(
                    "constraints need a fast (tokenizer.json) tokenizer; this target has none"
                )
            eos = sorted(self._hf.eos_token_ids)
            self._tokenizer = llguidance.LLTokenizer(
                backend.to_str(), n_vocab=self.vocab, eos_token=eos
            )
        return self._tokenizer

    def matcher(self, constraint: dict) -> llguidance.LLMatcher:
        """A matcher at the start of `constraint`'s grammar. Raises InvalidRequestError
        naming the reason when the grammar does not compile for this tokenizer."""
        try:
            key = constraints.key(constraint)
            text = constraints.grammar(constraint) if key not in self._compiled else None
        except constraints.ConstraintError as exc:
            raise InvalidRequestError(f"constraint.{exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidRequestError(
                f"constraint: not a normalised constraint ({type(exc).__name__}: {exc})"
            ) from None
        proto = self._compiled.get(key)
        if proto is None:
            # The submit-time check's limits, so what passed there compiles here.
            limits = llguidance.LLParserLimits(**constraints.PARSER_LIMITS)
            proto = llguidance.LLMatcher(self.tokenizer, text, log_level=0, limits=limits)
            self.compiles += 1
            if proto.is_error():
                raise InvalidRequestError(
                    f"{constraint['type']}: does not compile: {proto.get_error().strip()}"
                )
            self._compiled[key] = proto
            while len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return proto.deep_copy()
