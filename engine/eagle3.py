"""EAGLE-3 heads: a one-layer drafter reading three target layers, with its own small vocabulary.

An EAGLE-3 head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test") reads per position i the outputs of three target layers
(low, middle, high; `eagle_aux_hidden_state_layer_ids` name the layers whose *input* is
read, so layer id - 1's output), concatenated and projected by `fc` (3 x hidden -> hidden),
paired with the embedding of the token x_{i+1}. Its one decoder layer attends over
concat(input_layernorm(embedding), hidden_norm(features)) (2 x hidden wide q/k/v) and adds
the un-normed features as the residual. `norm` + its own `lm_head` give logits over a draft
vocabulary of `draft_vocab_size` tokens; draft id d is target id d + d2t[d]. Further drafts
chain the layer's output (hidden wide, so without `fc`) in place of the features.

Drafting and rollback are engine.heads'; this module knows the published layout
(config.json with architectures `LlamaForCausalLMEagle3`, weights `fc`, `midlayer.*` or
`layers.0.*`, `norm`, `lm_head`, `d2t`, `t2d`) and how to read it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .blocks import Projections, SwiGLU
from .capture import capture_layers, target_layers
from .checkpoints import float32, load_strict, read_safetensors
from .dflash import _target_width_and_vocab, target_embed_and_head
from .heads import HeadProposer, PrefillHidden
from .types import ModelLoadError


def _names_eagle3(cfg: dict) -> bool:
    archs = cfg.get("architectures") or []
    return any("eagle3" in str(a).lower() for a in archs) or (
        str(cfg.get("speculators_model_type", "")).lower() == "eagle3"
    )


def is_eagle3_dir(path) -> bool:
    """True when `path`/config.json names an EAGLE-3 architecture."""
    try:
        cfg = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False
    return isinstance(cfg, dict) and _names_eagle3(cfg)


@dataclass(frozen=True)
class Eagle3Config:
    """What an EAGLE-3 config.json says, in the names this module uses."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    aux_layer_ids: tuple[int, ...] | None
    norm_before_residual: bool = False
    rope_scaling: dict | None = None

    @classmethod
    def from_dict(cls, cfg: dict) -> Eagle3Config:
        """Read a published config.json (flat, or speculators' `transformer_layer_config`);
        raises ModelLoadError naming a missing field."""
        text = cfg.get("transformer_layer_config") or cfg
        eagle = cfg.get("eagle_config") or {}
        aux = eagle.get(
            "eagle_aux_hidden_state_layer_ids", cfg.get("eagle_aux_hidden_state_layer_ids")
        )
        try:
            heads = int(text["num_attention_heads"])
            hidden = int(text["hidden_size"])
            vocab = int(text["vocab_size"])
            return cls(
                hidden_size=hidden,
                num_hidden_layers=int(text.get("num_hidden_layers", 1)),
                num_attention_heads=heads,
                num_key_value_heads=int(text.get("num_key_value_heads", heads)),
                head_dim=int(text.get("head_dim") or hidden // heads),
                intermediate_size=int(text["intermediate_size"]),
                vocab_size=vocab,
                draft_vocab_size=int(
                    cfg.get("draft_vocab_size", text.get("draft_vocab_size", vocab))
                ),
                target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                rope_theta=float(text.get("rope_theta", 10000.0)),
                max_position_embeddings=int(text.get("max_position_embeddings", 131072)),
                aux_layer_ids=tuple(int(i) for i in aux) if aux is not None else None,
                norm_before_residual=bool(cfg.get("norm_before_residual", False)),
                rope_scaling=text.get("rope_scaling"),
            )
        except KeyError as exc:
            raise ModelLoadError(f"EAGLE-3 config.json: missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"EAGLE-3 config.json: bad value: {exc}") from exc


class _Attention(Projections):
    def __init__(self, c: Eagle3Config, width: int):
        super().__init__(c, width)
        from mlx_lm.models.rope_utils import initialize_rope

        self.rope = initialize_rope(
            c.head_dim,
            base=c.rope_theta,
            traditional=False,
            scaling_config=c.rope_scaling,
            max_position_embeddings=c.max_position_embeddings,
        )

    def __call__(self, x: mx.array, mask, cache) -> mx.array:
        from mlx_lm.models.base import scaled_dot_product_attention

        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class _Layer(nn.Module):
    """The head's one decoder layer: attention over [embedding, features], 2 x hidden wide."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        self.norm_before_residual = c.norm_before_residual
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_attn = _Attention(c, 2 * c.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def __call__(self, embeds, hidden, mask, cache) -> mx.array:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = mx.concatenate([self.input_layernorm(embeds), normed], axis=-1)
        h = residual + self.self_attn(x, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """The head's weights under their published names (`midlayer` read as `layers.0`)."""

    def __init__(self, config: Eagle3Config, n_features: int):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.fc = nn.Linear(n_features * config.target_hidden_size, config.hidden_size, bias=False)
        self.layers = [_Layer(config)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache

        return [KVCache()]

    def __call__(self, embeds: mx.array, hidden: mx.array, cache=None) -> mx.array:
        """Layer outputs (B, L, hidden), before `norm`: target features (wide) go through
        `fc`, the head's own chained outputs (hidden wide) do not."""
        from mlx_lm.models.base import create_attention_mask

        if hidden.shape[-1] != self.hidden_size:
            hidden = self.fc(hidden)
        c = cache[0] if cache is not None else None
        return self.layers[0](embeds, hidden, create_attention_mask(hidden, c), c)


class Eagle3Drafter:
    """A loaded EAGLE-3 head bound to its target (embeddings, layers to read)."""

    kind = "eagle3"
    block = False  # K drafts cost K head passes

    def __init__(self, head: Eagle3Head, target, layer_ids, d2t: mx.array, embed, path: str):
        self.head = head
        self.path = path
        self.layer_ids = tuple(layer_ids)  # target layers whose outputs are read
        self.embed = embed
        self.target_vocab = int(target_embed_and_head(target)[0].weight.shape[0])
        self.to_target = mx.arange(head.config.draft_vocab_size, dtype=mx.int32) + d2t

    @property
    def feature_size(self) -> int:
        return len(self.layer_ids) * self.head.config.target_hidden_size

    def capture(self, target):
        """Inside the block, target forwards record the read layers' outputs."""
        return capture_layers(target, list(self.layer_ids), lambda outs: mx.concatenate(outs, -1))

    def new_state(self, batch: int = 0) -> PrefillHidden:
        return PrefillHidden(batch)

    def proposer(self, target_vocab: int) -> HeadProposer:
        """The proposer that drafts with this head (one token per head pass)."""
        return HeadProposer(self, target_vocab)

    def step(self, tokens: mx.array, hidden: mx.array, cache) -> mx.array:
        return self.head(self.embed(tokens), hidden, cache)

    def logits(self, out: mx.array) -> mx.array:
        """(..., target vocabulary) logits: the draft vocabulary's at their target ids,
        -inf elsewhere (a token outside it is never drafted: probability 0 in q)."""
        draft = self.head.lm_head(self.head.norm(out))
        full = mx.full((*draft.shape[:-1], self.target_vocab), -mx.inf, dtype=draft.dtype)
        full[..., self.to_target] = draft
        return full

    def info(self) -> dict:
        c = self.head.config
        return {
            "drafter": self.kind,
            "layers": len(self.head.layers),
            "parameters": sum(v.size for _, v in tree_flatten(self.head.parameters())),
            "target_layer_ids": list(self.layer_ids),
            "draft_vocab_size": c.draft_vocab_size,
        }

    def describe(self) -> str:
        """One phrase for spec-doctor."""
        d = self.info()
        return (
            f"EAGLE-3 head, reads the outputs of target layers {', '.join(map(str, self.layer_ids))}, "
            f"draft vocabulary {d['draft_vocab_size']} of {self.target_vocab}, "
            f"{d['parameters'] / 1e6:.3g}M parameters"
        )


def _read_weights(path: Path) -> dict:
    weights = read_safetensors(path, f"EAGLE-3 head {path}")
    out = {}
    for key, value in weights.items():
        key = key.removeprefix("model.")
        if key.startswith("midlayer."):  # EAGLE's own name for the one layer
            key = "layers.0." + key[len("midlayer.") :]
        if key == "t2d" or key.startswith("verifier_") or "rotary_emb.inv_freq" in key:
            continue
        out[key] = value
    return out


def load_eagle3(path, target, target_config: dict) -> Eagle3Drafter:
    """Load an EAGLE-3 head in its published layout and bind it to `target`.

    Raises ModelLoadError in one line naming the missing or unknown field, or what does
    not fit the target (hidden size, vocabulary, layer ids, the d2t map)."""
    path = Path(path).expanduser()
    raw = json.loads((path / "config.json").read_text())
    config = Eagle3Config.from_dict(raw)
    where = f"EAGLE-3 head {path}"
    n_layers = len(target_layers(target))
    hidden, vocab = _target_width_and_vocab(target, target_config)
    if config.num_hidden_layers != 1:
        raise ModelLoadError(
            f"{where}: num_hidden_layers {config.num_hidden_layers}: only one-layer heads are read"
        )
    if config.target_hidden_size != hidden:
        raise ModelLoadError(
            f"{where}: target_hidden_size {config.target_hidden_size} differs from the "
            f"target's hidden_size {hidden}"
        )
    if config.vocab_size != vocab:
        raise ModelLoadError(
            f"{where}: vocab_size {config.vocab_size} differs from the target's {vocab}"
        )
    aux = config.aux_layer_ids or (2, n_layers // 2, n_layers - 3)
    if any(not 1 <= i <= n_layers for i in aux):
        raise ModelLoadError(
            f"{where}: eagle_aux_hidden_state_layer_ids {list(aux)} outside the target's "
            f"layers 1..{n_layers}"
        )
    weights = _read_weights(path)
    d2t = weights.pop("d2t", None)
    if d2t is None and config.draft_vocab_size != vocab:
        raise ModelLoadError(
            f"{where}: draft_vocab_size {config.draft_vocab_size} < vocab_size {vocab} but "
            "no d2t tensor maps draft ids to target ids"
        )
    d2t = mx.zeros((config.draft_vocab_size,), mx.int32) if d2t is None else d2t.astype(mx.int32)
    fits = d2t.shape == (config.draft_vocab_size,)
    to_target = (mx.arange(config.draft_vocab_size) + d2t).tolist() if fits else []
    if (
        not fits
        or len(set(to_target)) != len(to_target)
        or not all(0 <= t < vocab for t in to_target)
    ):
        raise ModelLoadError(
            f"{where}: d2t does not map the {config.draft_vocab_size} draft ids to distinct "
            f"target ids in 0..{vocab - 1}"
        )
    own_embed = weights.pop("embed_tokens.weight", None)
    head = Eagle3Head(config, len(aux))
    load_strict(head, weights, f"{where}: weights do not match config.json")
    if own_embed is not None and mx.default_device() == mx.cpu:
        own_embed = float32(own_embed)
    embed, _ = target_embed_and_head(target)
    if own_embed is not None and tuple(own_embed.shape) != tuple(embed.weight.shape):
        own = nn.Embedding(*own_embed.shape)
        own.weight = own_embed
        embed = own
    # Layer id i names the input of target layer i: the output of layer i - 1.
    return Eagle3Drafter(head, target, [i - 1 for i in aux], d2t, embed, str(path))


__all__ = ["Eagle3Config", "Eagle3Drafter", "Eagle3Head", "is_eagle3_dir", "load_eagle3"]
