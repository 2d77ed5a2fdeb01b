"""Native multi-token-prediction (MTP) heads: the target drafts with its own extra layer.

Qwen3.5/3.6 checkpoints ship `mtp.*` weights (`mtp_num_hidden_layers` in the text config)
that mlx-lm's loader drops. The head reads a pair per position i: the target's final
(normed) hidden state h_i and the embedding of the token x_{i+1} after it; both are
RMS-normed (`pre_fc_norm_hidden`, `pre_fc_norm_embedding`), concatenated embedding first,
projected by `fc` (2 x hidden -> hidden), run through full-attention decoder layers of the
target's own kind (with a KV cache over earlier pairs) and a final `norm`; the target's LM
head then predicts x_{i+2}. Further drafts chain the head's own output in place of h.

So drafting K tokens costs K head passes (priced like a draft LM, not like a block
drafter). The head's cache holds only pairs built from the target's hidden states: after a
verify pass the chained entries are dropped and the accepted tokens are read again with
the target's hidden states of the verify pass, as the head was trained.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .capture import capture_layers
from .checkpoints import load_strict
from .dflash import target_embed_and_head
from .heads import HeadProposer, PrefillHidden
from .types import ModelLoadError

#: What `--draft` says to draft with the target's own MTP head.
MTP_SPEC = "mtp"
#: Target model types whose MTP head this module reads (dense layers).
MTP_MODEL_TYPES = ("qwen3_5",)

# RMSNorm weights of the head, which Hugging Face files store as offsets from 1.
_NORM_SUFFIXES = (
    ".input_layernorm.weight",
    ".post_attention_layernorm.weight",
    ".q_norm.weight",
    ".k_norm.weight",
)
_NORMS = ("norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")
# The safetensors format's own bound on a header.
_MAX_HEADER_BYTES = 100 * 1024 * 1024


def is_mtp_spec(draft) -> bool:
    """True when `--draft` names the target's own MTP head rather than a directory."""
    return isinstance(draft, str) and draft.strip().lower() == MTP_SPEC


class MTPHead(nn.Module):
    """The head's own weights under their published names (without the `mtp.` prefix)."""

    def __init__(self, text_config: dict, num_layers: int):
        super().__init__()
        from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

        # Every MTP layer is a full-attention layer of the target's kind.
        args = TextModelArgs.from_dict({**text_config, "full_attention_interval": 1})
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.hidden_size = hidden
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=eps)
        self.layers = [DecoderLayer(args, layer_idx=0) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(hidden, eps=eps)

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]

    def __call__(self, embeds: mx.array, hidden: mx.array, cache=None) -> mx.array:
        """Head outputs (B, L, hidden), normed, for pairs (hidden_i, embedding of x_{i+1})."""
        from mlx_lm.models.base import create_attention_mask

        h = mx.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        h = self.fc(h)
        cache = cache if cache is not None else [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, mask=mask, cache=c)
        return self.norm(h)


class MTPDrafter:
    """A loaded MTP head bound to its target's embeddings, final norm and LM head."""

    kind = "mtp"
    block = False  # K drafts cost K head passes

    def __init__(self, head: MTPHead, target: nn.Module, path: str, layout: NormLayout):
        self.head = head
        self.path = path
        self.layout = layout
        self.embed, self.lm_head = target_embed_and_head(target)
        self.final_norm = _inner(target).norm

    def capture(self, target: nn.Module):
        """Inside the block, target forwards record their final normed hidden states."""
        return capture_layers(target, [-1], lambda outs: self.final_norm(outs[0]))

    def new_state(self, batch: int = 0) -> PrefillHidden:
        return PrefillHidden(batch)

    def proposer(self, target_vocab: int) -> HeadProposer:
        """The proposer that drafts with this head (one token per head pass)."""
        return HeadProposer(self, target_vocab)

    @property
    def feature_size(self) -> int:
        return self.head.hidden_size

    def step(self, tokens: mx.array, hidden: mx.array, cache) -> mx.array:
        """Head outputs for token ids (B, L) paired with hidden states (B, L, hidden)."""
        return self.head(self.embed(tokens), hidden, cache)

    def logits(self, out: mx.array) -> mx.array:
        return self.lm_head(out)

    def info(self) -> dict:
        """Facts for logs and `spec-doctor`."""
        return {
            "drafter": self.kind,
            "layers": len(self.head.layers),
            "parameters": sum(v.size for _, v in tree_flatten(self.head.parameters())),
            "source": f"{self.path} (mtp.* weights)",
            "layout": self.layout.describe(),
        }

    def describe(self) -> str:
        """One phrase for spec-doctor."""
        d = self.info()
        return (
            f"the target's own MTP head, {d['layers']} layer(s), "
            f"{d['parameters'] / 1e6:.3g}M parameters, layout {d['layout']}"
        )


def _inner(target: nn.Module):
    """The text model holding embed_tokens, layers and the final norm."""
    for holder in (getattr(target, "language_model", None), target):
        inner = getattr(holder, "model", None) if holder is not None else None
        if inner is not None and "norm" in inner:
            return inner
    raise ModelLoadError(f"cannot find the final norm of {type(target).__name__}")


# ----------------------------------------------------------------------------- loading


def _mtp_name(key: str) -> str | None:
    """The head-relative name of a checkpoint tensor, or None when it is not the head's."""
    for prefix in ("mtp.", "model.mtp.", "language_model.mtp.", "model.language_model.mtp."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return None


def _shards(path: Path, where: str) -> list[Path]:
    """Every safetensors file of the checkpoint: those its index names, else all."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            return [path / n for n in sorted(set(weight_map.values()))]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(
                f"{where}: cannot read the weight map of {index}: {exc!r}"
            ) from exc
    return sorted(path.glob("*.safetensors"))


def _header(file: Path, where: str) -> dict[str, list[int]]:
    """{tensor name: shape} from a safetensors header; no tensor data is read."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > _MAX_HEADER_BYTES:
                raise ValueError(f"header of {n} bytes (at most {_MAX_HEADER_BYTES})")
            header = json.loads(f.read(n))
        return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as exc:
        raise ModelLoadError(
            f"{where}: cannot read the safetensors header of {file}: {exc}"
        ) from exc


@dataclass(frozen=True)
class NormLayout:
    """How the checkpoint stores RMSNorm weights, decided from all of its tensors.

    Hugging Face Qwen3.5 files store them as offsets from 1 and their conv1d kernels last;
    mlx-lm shifts the target's norms by that same test over the whole checkpoint, so the
    head follows the target. A head alone in its own shard (common) holds no conv1d
    weight: deciding from its shards alone would read a Hugging Face head's norms as
    stored (about 0) and draft garbage."""

    offsets: bool  # norms stored as offsets from 1: the head's are shifted on load
    evidence: str  # which tensor decided, for the start-up line

    def describe(self) -> str:
        if self.offsets:
            return f"Hugging Face (norms stored as offsets from 1, shifted; {self.evidence})"
        return f"converted (norms used as stored; {self.evidence})"


def norm_layout(shapes: dict[str, tuple[str, list[int]]]) -> NormLayout:
    """The layout from {tensor name: (file name, shape)} of the whole checkpoint."""
    conv = sorted((k, f, s) for k, (f, s) in shapes.items() if "conv1d.weight" in k)
    for key, file, shape in conv:
        if shape[-1] != 1:
            return NormLayout(True, f"{key} in {file} has shape {shape}, its kernel last")
    if conv:
        key, file, shape = conv[0]
        return NormLayout(False, f"{key} in {file} has shape {shape}, as mlx-lm converts it")
    return NormLayout(False, "no conv1d weight: mlx-lm reads the target's norms as stored too")


def load_mtp(target_path: str, target: nn.Module, config: dict) -> MTPDrafter:
    """The MTP head inside the target checkpoint at `target_path`, bound to `target`.

    Raises ModelLoadError in one line naming what is missing: a target type without a
    head this module reads, no `mtp_num_hidden_layers`, no `mtp.*` tensors (converted
    checkpoints drop them), or tensors that do not match the config.
    """
    path = Path(target_path).expanduser()
    text = config.get("text_config") or config
    model_type = config.get("model_type")
    where = f"--draft mtp: target {target_path}"
    if model_type not in MTP_MODEL_TYPES:
        raise ModelLoadError(
            f"{where}: model_type {model_type!r} has no MTP head this engine reads "
            f"(it reads {', '.join(MTP_MODEL_TYPES)})"
        )
    if int(text.get("num_experts") or 0) > 0:
        raise ModelLoadError(
            f"{where}: text_config.num_experts {text['num_experts']}: MTP heads of "
            "mixture-of-experts targets are not supported yet"
        )
    layers = int(text.get("mtp_num_hidden_layers") or 0)
    if layers <= 0:
        raise ModelLoadError(
            f"{where}: config has no text_config.mtp_num_hidden_layers: this checkpoint "
            "has no MTP head (use --draft DIR with a draft model or drafter)"
        )
    shapes = {k: (f.name, s) for f in _shards(path, where) for k, s in _header(f, where).items()}
    layout = norm_layout(shapes)
    weights = {}
    for f in sorted({path / f for k, (f, _) in shapes.items() if _mtp_name(k) is not None}):
        for key, value in mx.load(str(f)).items():  # only the shards that hold the head
            name = _mtp_name(key)
            if name is not None:
                weights[name] = value
    if not weights:
        raise ModelLoadError(
            f"{where}: config says mtp_num_hidden_layers {layers} but the safetensors hold "
            "no mtp.* tensors (mlx-lm conversions drop them; use the original checkpoint)"
        )
    if layout.offsets:
        weights = {
            k: v + 1.0 if (k in _NORMS or k.endswith(_NORM_SUFFIXES)) and v.ndim == 1 else v
            for k, v in weights.items()
        }
    head = MTPHead(text, layers)
    quant = config.get("quantization") or config.get("quantization_config")
    load_strict(head, weights, f"{where}: mtp.* tensors do not match the config", quant)
    return MTPDrafter(head, target, str(target_path), layout)


__all__ = ["MTPDrafter", "MTPHead", "NormLayout", "is_mtp_spec", "load_mtp", "norm_layout"]
