"""Load a target and an optional draft once, and check they speak the same tokens."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .blas import blas_info
from .checkpoints import to_float32
from .dflash import is_dflash_dir, load_dflash
from .draft_length import DraftLengthPolicy
from .eagle3 import is_eagle3_dir, load_eagle3
from .mtp import is_mtp_spec, load_mtp
from .types import ModelLoadError, TokenizerMismatchError

log = logging.getLogger("specfleet.engine")

DEMO_DIR = Path(__file__).resolve().parent / "demo"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFT = DEMO_DIR / "draft"
DEMO_ALIAS = "demo"


@dataclass
class ModelPair:
    """A loaded target, an optional draft, and the target's tokenizer.

    `draft_vocab` is how many draft rows map onto target token ids (the shared
    vocabulary); `policy` picks "auto"'s draft lengths from what this process measures
    (engine.draft_length: pure Python, learnt online, nothing timed at start-up).
    """

    target: nn.Module
    draft: nn.Module | None
    tokenizer: Any
    target_path: str
    draft_path: str | None
    context_length: int
    target_vocab: int
    draft_vocab: int
    name: str
    policy: DraftLengthPolicy = field(default_factory=DraftLengthPolicy, repr=False)
    #: A drafter that reads target hidden states (draft is None): an engine.dflash
    #: DFlashDrafter, the target's own MTP head (engine.mtp, --draft mtp) or an EAGLE-3
    #: head (engine.eagle3).
    dflash: Any = None
    #: Why the target runs with plain decoding only (a layer kind with no exact ragged
    #: form: engine.plain), or None when the speculative decoder runs it.
    plain_only: str | None = None
    #: engine.prefix.PairCaches: kept prompt prefixes shared by every row this pair
    #: decodes (None: no prefix cache, every prompt is prefilled in full).
    prefix: Any = field(default=None, repr=False)

    def info(self) -> dict:
        """Versions, device, BLAS and model facts, for logs and `spec-doctor`."""
        import mlx_lm

        # How the checkpoint's norms were read, where a drafter says (engine.mtp).
        layout = self.dflash.info().get("layout") if self.dflash is not None else None
        return {
            "name": self.name,
            "target": self.target_path,
            "draft": self.draft_path,
            "drafter": self.drafter_kind,
            "target_parameters": _num_params(self.target),
            "draft_parameters": _num_params(self.draft) if self.draft is not None else 0,
            "context_length": self.context_length,
            "vocab_size": self.target_vocab,
            "mlx": mx.__version__,
            "mlx_lm": mlx_lm.__version__,
            "device": str(mx.default_device()),
            "blas": blas_info(),
            "features": self.features().as_dict(),
            **({"draft_layout": layout} if layout else {}),
        }

    @property
    def drafter_kind(self) -> str | None:
        """What drafts for drafter "model": "model" (a draft LM), "dflash", "mtp",
        "eagle3", or None."""
        if self.dflash is not None:
            return self.dflash.kind
        return "model" if self.draft is not None else None

    def features(self):
        """Which drafters and batching this pair supports, and its layer kinds
        (a families.Features)."""
        from .families import features

        return features(self.target, self.draft, self.dflash, plain_only=bool(self.plain_only))


def _num_params(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def _resolve(path_or_id: str | os.PathLike | None, default: Path) -> str:
    if path_or_id is None:
        return str(default)
    return os.fspath(path_or_id)


def _load_one(path_or_id: str, role: str):
    import mlx_lm

    local = Path(path_or_id).expanduser()
    looks_like_hub_id = path_or_id.count("/") == 1 and not path_or_id.startswith((".", "/", "~"))
    if not local.exists() and not looks_like_hub_id:
        raise ModelLoadError(f"{role} model: no such directory: {path_or_id}")
    try:
        model, tokenizer, config = mlx_lm.load(
            str(local) if local.exists() else path_or_id, return_config=True
        )
    except Exception as exc:  # mlx_lm raises many kinds; say which model failed
        raise ModelLoadError(f"{role} model {path_or_id!r} could not be loaded: {exc}") from exc
    if mx.default_device() == mx.cpu:
        to_float32(model)
    return model, tokenizer, config


def _vocab_rows(model: nn.Module, config: dict) -> int:
    if "vocab_size" in config:
        return int(config["vocab_size"])
    return int(model.model.embed_tokens.weight.shape[0])


def check_tokenizers(target_tok, draft_tok, target_name: str, draft_name: str) -> int:
    """Compare the two vocabularies id by id; return the size of the shared one.

    Raises TokenizerMismatchError naming both models and the first differing id.
    Extra ids on one side (padding rows) are allowed; different strings are not.
    """
    t_vocab = target_tok._tokenizer.get_vocab()
    d_vocab = draft_tok._tokenizer.get_vocab()
    t_by_id = {i: s for s, i in t_vocab.items()}
    d_by_id = {i: s for s, i in d_vocab.items()}
    shared = min(len(t_by_id), len(d_by_id))
    for i in range(shared):
        if t_by_id.get(i) != d_by_id.get(i):
            raise TokenizerMismatchError(
                f"tokenizers differ: target {target_name} has id {i} = {t_by_id.get(i)!r}, "
                f"draft {draft_name} has id {i} = {d_by_id.get(i)!r}; "
                "use a draft from the same model family (same tokenizer)"
            )
    return shared


def context_length_of(config: dict) -> int:
    for key in ("max_position_embeddings", "max_sequence_length", "n_positions", "seq_length"):
        if key in config and config[key]:
            return int(config[key])
    return 4096


def load_pair(
    target: str | os.PathLike | None = None,
    draft: str | os.PathLike | None = None,
    *,
    use_draft: bool = True,
    prefix_cache_bytes: int | None = None,
) -> ModelPair:
    """Load a target and a draft (local directories or hub ids) once.

    With no arguments: the bundled demo pair. With a target but no draft: the
    target alone (drafters "lookup" and "none" still work). On the CPU backend
    weights are cast to float32. A target whose layers the speculative decoder cannot
    keep exact (families.check_model) loads without a draft for plain decoding only
    (engine.plain), with a warning. `prefix_cache_bytes` bounds the prefix cache
    (engine.prefix; None: sized from the machine's memory, 0: off). Raises ModelLoadError (families.UnsupportedModelError
    for such a target given with a draft, or such a draft) or TokenizerMismatchError.
    """
    from .families import UnsupportedModelError, check_model

    if target is None and draft is None and use_draft:
        draft = DEMO_DRAFT
    target_path = _resolve(target, DEMO_TARGET)
    model, tokenizer, config = _load_one(target_path, "target")
    plain_only = None
    try:
        check_model(model, "target")
    except UnsupportedModelError as exc:
        if draft is not None and use_draft:
            raise UnsupportedModelError(
                f"{exc}; load it without a draft: plain decoding (drafter 'none') still "
                "works, one request at a time"
            ) from exc
        plain_only = str(exc)
    draft_model, draft_path, draft_vocab = None, None, 0
    target_vocab = _vocab_rows(model, config)
    dflash = None
    if draft is not None and use_draft and is_mtp_spec(draft):
        draft_path = "mtp"
        dflash = load_mtp(target_path, model, config)
    elif draft is not None and use_draft and is_eagle3_dir(draft):
        draft_path = os.fspath(draft)
        dflash = load_eagle3(draft_path, model, config)
    elif draft is not None and use_draft and is_dflash_dir(draft):
        draft_path = os.fspath(draft)
        dflash = load_dflash(draft_path, model, config)
    elif draft is not None and use_draft:
        draft_path = os.fspath(draft)
        draft_model, draft_tok, draft_config = _load_one(draft_path, "draft")
        check_model(draft_model, "draft")
        check_tokenizers(tokenizer, draft_tok, target_path, draft_path)
        # Rows past the smaller table are padding: the draft gives them probability 0.
        draft_vocab = min(_vocab_rows(draft_model, draft_config), target_vocab)
    name = DEMO_ALIAS if Path(target_path).resolve() == DEMO_TARGET else Path(target_path).name
    pair = ModelPair(
        target=model,
        draft=draft_model,
        tokenizer=tokenizer,
        target_path=target_path,
        draft_path=draft_path,
        context_length=context_length_of(config),
        target_vocab=target_vocab,
        draft_vocab=draft_vocab,
        name=name,
        dflash=dflash,
        plain_only=plain_only,
    )
    from .prefix import pair_caches

    pair.prefix = pair_caches(pair, prefix_cache_bytes)
    log.info("loaded %s on %s, %s", pair.name, mx.default_device(), blas_info())
    if plain_only:
        log.warning(
            "%s: %s. Serving it with plain decoding only: every request runs as drafter "
            "'none' (the same text), one row per forward pass, no speculation or batching",
            pair.name,
            plain_only,
        )
    return pair
