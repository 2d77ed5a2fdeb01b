"""DFlash block drafters: a small model that reads target hidden states and drafts a block.

A DFlash drafter (z-lab, "DFlash: Block Diffusion for Flash Speculative Decoding") has no
embeddings and no LM head of its own: it embeds the block [last token, mask x (block-1)] with
the target's embeddings, lets every block position attend (bidirectionally) to the block and
to the *context*, and reads the target's LM head at the block positions. The context is the
hidden states the target's layers `target_layer_ids` output for every token it has processed,
concatenated, projected by `fc` + `hidden_norm`, and turned into keys and values by each
drafter layer. Those keys and values are cached like a KV cache, so they roll back with the
acceptance: after a verify pass the decoder appends the features of the tokens it kept.

Layer kinds follow z-lab's reference: full-attention layers see the whole context and block;
sliding layers (`layer_types`, `sliding_window`) see context keys less than the window before
each block position and, unless config.json sets `is_causal`, no later block position.
DFlash2 (`DFlash2DraftModel`) wraps each sub-layer in a dynamic convolution and picks drafts
with a candidate selector chained over the block (engine.dflash2).

This module knows the published layouts (config.json + safetensors, optionally quantized the
way mlx-lm writes it), how to capture target features during an ordinary forward pass of an
mlx-lm model, and a batched drafter state whose rows roll back on their own. The decoder
decides what to do with the block logits (greedy argmax or the request's sampling law as q).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .blocks import Projections, SwiGLU
from .capture import capture_layers, target_layers
from .checkpoints import load_strict, read_safetensors
from .dflash2 import CODEBOOKS, CandidateSelector, GroupedDynamicConv, chain_noise
from .drafters import DFlashProposer
from .ragged import MaskedLayer, RaggedRows
from .types import ModelLoadError

ARCHITECTURE = "DFlashDraftModel"
ARCHITECTURE2 = "DFlash2DraftModel"
GROW = 256  # context slots are allocated in steps of this many positions
LAYER_TYPES = ("full_attention", "sliding_attention")
#: Fields DFlash2 needs, at the top level of config.json or inside its dflash_config.
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DFlashConfig:
    """What a drafter's config.json says, in the names this module uses.

    `kind` is "dflash" (z-lab's first layout) or "dflash2" (dynamic convolutions and a
    candidate selector, engine.dflash2). `is_causal` None means z-lab's default: causal
    attention inside the block in sliding layers, bidirectional in full ones.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    rope_scaling: dict | None = None
    kind: str = "dflash"
    is_causal: bool | None = None
    rope_is_neox_style: bool = True
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def name(self) -> str:
        """The kind as messages spell it: DFlash or DFlash2."""
        return "DFlash2" if self.kind == "dflash2" else "DFlash"

    @classmethod
    def from_dict(cls, cfg: dict, kind: str = "dflash") -> DFlashConfig:
        """Read a published config.json dict; raises ModelLoadError naming a missing,
        unknown or bad field."""
        name = "DFlash2" if kind == "dflash2" else "DFlash"
        dcfg = cfg.get("dflash_config") or {}

        def get(key, default=None):
            # dflash_config wins over the top level, as in z-lab's and mlx-vlm's readers.
            return dcfg.get(key, cfg.get(key, default))

        _check_layout(cfg, name)
        if kind == "dflash2":
            for key in DFLASH2_FIELDS:
                if get(key) is None:
                    raise ModelLoadError(
                        f"DFlash2 config.json: missing field {key!r} (top level or in dflash_config)"
                    )
        for key in ("block_size", "mask_token_id", "target_layer_ids"):
            if get(key) is None:
                raise ModelLoadError(
                    f"{name} config.json: missing field {key!r} (top level or in dflash_config)"
                )
        rope = dict(cfg.get("rope_parameters") or {})
        theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
        softcap = get("final_logit_softcapping")
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            causal = get("is_causal")
            return cls(
                hidden_size=hidden,
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads", heads)),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                block_size=int(get("block_size")),
                mask_token_id=int(get("mask_token_id")),
                target_layer_ids=tuple(int(i) for i in get("target_layer_ids")),
                num_target_layers=get("num_target_layers"),
                layer_types=tuple(cfg["layer_types"]) if cfg.get("layer_types") else None,
                sliding_window=cfg.get("sliding_window"),
                rope_scaling=cfg.get("rope_scaling") or (rope or None),
                kind=kind,
                is_causal=None if causal is None else bool(causal),
                rope_is_neox_style=bool(get("rope_is_neox_style", True)),
                input_embedding_scale=float(get("input_embedding_scale", 1.0)),
                output_multiplier=float(get("output_multiplier", 1.0)),
                final_logit_softcapping=None if softcap is None else float(softcap),
                conv_kernel_size=int(get("conv_kernel_size", 0)),
                conv_group_size=int(get("conv_group_size", 0)),
                selector_rank=int(get("selector_rank", 0)),
                selector_top_k=int(get("selector_top_k", 0)),
            )
        except KeyError as exc:
            raise ModelLoadError(f"{name} config.json: missing field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"{name} config.json: bad value: {exc}") from exc

    def window_of(self, layer: int) -> int | None:
        """The sliding window of drafter layer `layer`, or None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    def causal_of(self, layer: int) -> bool:
        """Whether block position j attends only to block positions <= j in `layer`."""
        if self.is_causal is not None:
            return self.is_causal
        return self.window_of(layer) is not None


def _check_layout(cfg: dict, name: str) -> None:
    """Refuse layer kinds and options this module does not implement, naming the field."""
    types = cfg.get("layer_types") or []
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            raise ModelLoadError(
                f"{name} config.json: layer_types[{i}] is {t!r}, a layer kind specfleet does "
                f"not know (known: {', '.join(LAYER_TYPES)})"
            )
    if "sliding_attention" in types and not cfg.get("sliding_window"):
        raise ModelLoadError(
            f"{name} config.json: missing field 'sliding_window' (layer_types has "
            "sliding_attention layers)"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{name} config.json: hidden_act {act!r} is not supported (silu)")
    if cfg.get("attention_bias"):
        raise ModelLoadError(f"{name} config.json: attention_bias true is not supported")


# ----------------------------------------------------------------------------- the model


class _Attention(Projections):
    """Block queries against cached context keys plus the block's own keys."""

    def __init__(self, c: DFlashConfig):
        super().__init__(c, c.hidden_size)
        self.q_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(c.head_dim, eps=c.rms_norm_eps)

    def keys_values(self, x: mx.array, rope, positions: mx.array) -> tuple[mx.array, mx.array]:
        """Keys (rotated to `positions`, (B,) start offsets) and values of `x` (B, L, hidden)."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.n_kv_heads, -1)).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return rope(k, offset=positions), v

    def __call__(self, x, rope, positions, ctx_k, ctx_v, mask) -> mx.array:
        """`mask` (B, 1, L, S + L) bool: the context's S keys, then the block's L."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.n_heads, -1)).transpose(0, 2, 1, 3)
        q = rope(q, offset=positions)
        k, v = self.keys_values(x, rope, positions)
        keys = mx.concatenate([ctx_k, k], axis=2)
        values = mx.concatenate([ctx_v, v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class _Layer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.self_attn = _Attention(c)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.convolved = c.kind == "dflash2"
        if self.convolved:
            self.attention_conv = GroupedDynamicConv(
                c.hidden_size, c.conv_kernel_size, c.conv_group_size
            )
            self.mlp_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def __call__(self, x, rope, positions, ctx_k, ctx_v, mask) -> mx.array:
        if not self.convolved:
            h = x + self.self_attn(self.input_layernorm(x), rope, positions, ctx_k, ctx_v, mask)
            return h + self.mlp(self.post_attention_layernorm(h))
        # DFlash2: each sub-layer's input and output go through its dynamic convolution.
        a, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(
            self.self_attn(a, rope, positions, ctx_k, ctx_v, mask), kernel
        )
        m, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), kernel)


class DFlashModel(nn.Module):
    """The drafter's own weights (`fc`, `hidden_norm`, `layers.*`, `norm`, and for DFlash2
    `layers.*.attention_conv`, `layers.*.mlp_conv`, `candidate_selector`), published names."""

    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        width = len(config.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = [_Layer(config) for _ in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.kind == "dflash2":
            self.candidate_selector = CandidateSelector(
                config.vocab_size, config.hidden_size, config.selector_rank, config.selector_top_k
            )
        from mlx_lm.models.rope_utils import initialize_rope

        # MLX calls the interleaved (GPT-J) pairing "traditional"; Qwen-style is NeoX.
        self._rope = initialize_rope(
            config.head_dim,
            base=config.rope_theta,
            traditional=not config.rope_is_neox_style,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )

    def rope(self, x: mx.array, offset) -> mx.array:
        return self._rope(x, offset=offset)

    def context(self, features: mx.array) -> mx.array:
        """Project target features (B, W, len(ids) * hidden) to the context stream."""
        return self.hidden_norm(self.fc(features))

    def block_hidden(self, h: mx.array, positions, ctx_kv, masks) -> mx.array:
        """Run the block embeddings `h` (B, L, hidden) through the layers; final norm applied.

        ctx_kv[i] = (keys, values) of layer i's context, masks[i] (B, 1, L, S + L) bool.
        """
        for layer, (k, v), m in zip(self.layers, ctx_kv, masks, strict=True):
            h = layer(h, self.rope, positions, k, v, m)
        return self.norm(h)


# ----------------------------------------------------------------------------- target side


def target_embed_and_head(target: nn.Module) -> tuple[Any, Any]:
    """The target's token embedding module and LM head callable (tied or not)."""
    for holder in (getattr(target, "language_model", None), target):
        if holder is None:
            continue
        inner = getattr(holder, "model", None)
        if inner is not None and "embed_tokens" in inner:
            embed = inner.embed_tokens
            head = holder["lm_head"] if "lm_head" in holder else embed.as_linear
            return embed, head
    raise ModelLoadError(f"cannot find the token embeddings of {type(target).__name__}")


# ----------------------------------------------------------------------------- the drafter


class DFlashDrafter:
    """A loaded DFlash drafter bound to its target's embeddings and LM head."""

    def __init__(self, model: DFlashModel, target: nn.Module, path: str = ""):
        self.model = model
        self.config = model.config
        self.kind = model.config.kind  # "dflash" or "dflash2": what statistics say
        self.path = path
        self.embed, self.lm_head = target_embed_and_head(target)

    @property
    def chained(self) -> bool:
        """True for DFlash2: each draft is chosen given the draft before it."""
        return self.kind == "dflash2"

    def embed_block(self, ids: mx.array, embed: Any = None) -> mx.array:
        """The target's raw token embeddings times `input_embedding_scale` (z-lab's rule)."""
        h = (self.embed if embed is None else embed)(ids)
        scale = self.config.input_embedding_scale
        return h if scale == 1.0 else h * scale

    def logits(self, hidden: mx.array, lm_head: Any = None) -> mx.array:
        """The target's LM head on drafter states, times `output_multiplier`, soft-capped
        at `final_logit_softcapping` when the config sets one."""
        out = (self.lm_head if lm_head is None else lm_head)(hidden)
        c = self.config
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping:
            cap = c.final_logit_softcapping
            out = mx.tanh(out / cap) * cap
        return out

    def draft_chain(
        self,
        state: DFlashState,
        last_tokens: list[int],
        depth: int,
        sampled: list[int],
        params: list,
        seeds: list[int],
        positions: list[int],
    ) -> tuple[mx.array, mx.array | None]:
        """DFlash2: one block pass, then the candidate selector's chain over the first
        `depth` positions. Rows `sampled` draw with params/seeds/positions (theirs, in
        that order). Returns tokens (B, depth) and the sampled rows' laws (S, depth, V)."""
        hidden = state.block_hidden(last_tokens)[:, :depth]
        logits = self.logits(hidden)
        noise = None
        if sampled:
            noise = chain_noise(seeds, positions, depth, logits.shape[-1])
        anchors = mx.array(last_tokens, dtype=mx.uint32)
        return self.model.candidate_selector.draft(hidden, logits, anchors, sampled, params, noise)

    def greedy_block(self, state: DFlashState, last_tokens: list[int]) -> mx.array:
        """Greedy drafts (B, block - 1) of one drafter pass: what a draft step costs."""
        if self.chained:
            return self.draft_chain(state, last_tokens, self.block_size - 1, [], [], [], [])[0]
        return mx.argmax(state.block_logits(last_tokens), axis=-1)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def capture(self, target: nn.Module):
        """Inside the block, every forward of `target` records the named layers' outputs.

        `with drafter.capture(target) as cap: logits = target(x, cache=c)` then
        `cap.features` (B, T, len(target_layer_ids) * hidden). Works with any cache the
        target accepts; the target's layer list is restored on exit.
        """
        ids = list(self.config.target_layer_ids)
        return capture_layers(target, ids, lambda outs: mx.concatenate(outs, axis=-1))

    def new_state(self, batch: int = 0) -> DFlashState:
        """An empty batched context with `batch` rows."""
        return DFlashState(self, batch)

    #: Any number of drafts costs one drafter pass.
    block = True

    def proposer(self, target_vocab: int) -> DFlashProposer:
        """The proposer that drafts with this drafter (one block pass per step)."""
        return DFlashProposer(self, target_vocab)

    def info(self) -> dict:
        """Facts for logs and `spec-doctor`."""
        return {
            "drafter": self.kind,
            "block_size": self.block_size,
            "sliding_window": self.config.sliding_window
            if self.config.layer_types and ("sliding_attention" in self.config.layer_types)
            else None,
            "target_layer_ids": list(self.config.target_layer_ids),
            "layers": self.config.num_hidden_layers,
            "parameters": sum(v.size for _, v in tree_flatten(self.model.parameters())),
        }


class DFlashState:
    """The drafter's context for a batch: per-layer context keys/values, ragged per row.

    Its rows are a ragged.RaggedRows, the one row bookkeeping of every cache here, and its
    keys and values a layer kind of it (`_ContextLayer`): physical positions are shared by
    all rows, `valid` marks which hold a real token of a row and `length` counts real
    tokens per row (their RoPE positions are 0..length-1); rows join, leave and compact by
    the ragged cache's rules. Rejected positions are never written: `extend` keeps only the
    first keep[i] new ones, so the context never rolls back.
    """

    def __init__(self, drafter: DFlashDrafter, batch: int):
        self.drafter = drafter
        c = drafter.config
        self.rows = RaggedRows(batch)
        self.context = _ContextLayer(
            self.rows, c.num_hidden_layers, (batch, c.num_key_value_heads, 0, c.head_dim)
        )
        windows = [c.window_of(i) for i in range(c.num_hidden_layers)]
        # A drafter whose every layer slides never sees a slot again once the row has moved
        # `horizon` positions past it (rows only grow): such slots are let go.
        self.horizon = None if None in windows else max(windows)

    @property
    def batch(self) -> int:
        return self.rows.batch

    @property
    def used(self) -> int:
        """Physical positions in use (the same for every row)."""
        return self.rows.length

    @property
    def valid(self) -> mx.array:
        return self.rows.valid

    @property
    def length(self) -> mx.array:
        """Context tokens per row (B,)."""
        return self.rows.offset

    @property
    def positions(self) -> mx.array:
        """RoPE position of every slot (B, used)."""
        return self.context.positions

    def lengths(self) -> list[int]:
        """Context tokens per row."""
        return self.length.tolist()

    def extend(self, features: mx.array, keep: list[int]) -> None:
        """Append the first keep[i] of the W positions in `features` (B, W, F) to row i."""
        b, w, _ = features.shape
        if b != self.batch or len(keep) != b:
            raise ValueError(f"extend: {b} feature rows and {len(keep)} keeps for {self.batch}")
        if max(keep, default=0) > w or min(keep, default=0) < 0:
            raise ValueError(f"extend: keep {keep} outside 0..{w}")
        n = max(keep, default=0)
        if n == 0:
            return
        ctx = self.drafter.model.context(features[:, :n])
        for i, layer in enumerate(self.drafter.model.layers):
            k, v = layer.self_attn.keys_values(ctx, self.drafter.model.rope, self.length)
            self.context.write(i, k, v)
        self.context.add_positions(self.length, n)
        self.rows.advance(n, keep)
        if self.horizon is not None:
            self.rows.forget(self.length[:, None] - self.positions < self.horizon)
            if self.used >= self.horizon + GROW:
                self.rows.drop_dead_head(least=GROW)

    def block_hidden(self, last_tokens: list[int], embed: Any = None) -> mx.array:
        """One drafter pass over [last token, mask x (block-1)] per row: the final-normed
        states (B, block_size - 1, hidden) of block positions 1..block-1."""
        model, c = self.drafter.model, self.drafter.config
        if len(last_tokens) != self.batch:
            raise ValueError(f"block_logits: {len(last_tokens)} last tokens for {self.batch} rows")
        bs = c.block_size
        ids = mx.array([[t] + [c.mask_token_id] * (bs - 1) for t in last_tokens], dtype=mx.int32)
        h = self.drafter.embed_block(ids, embed)
        qpos = self.length[:, None] + mx.arange(bs)[None, :]  # (B, bs)
        ctx_kv, masks = [], []
        for i in range(c.num_hidden_layers):
            ctx_kv.append(self.context.used(i))
            masks.append(self._mask(i, qpos)[:, None])
        return model.block_hidden(h, self.length, ctx_kv, masks)[:, 1:]

    def _mask(self, layer: int, qpos: mx.array) -> mx.array:
        """(B, block, used + block) bool: which context slots and block positions each block
        position of `layer` sees (z-lab's rule: a sliding layer sees keys less than
        `sliding_window` positions away; a causal one no later block position)."""
        c = self.drafter.config
        bs = c.block_size
        ctx = mx.broadcast_to(self.valid[:, None, :], (self.batch, bs, self.used))
        block = mx.ones((bs, bs), dtype=mx.bool_)
        window = c.window_of(layer)
        if window is not None:
            ctx = ctx & (qpos[:, :, None] - self.positions[:, None, :] < window)
            j = mx.arange(bs)
            block = block & (mx.abs(j[:, None] - j[None, :]) < window)
        if c.causal_of(layer):
            block = block & (mx.arange(bs)[None, :] <= mx.arange(bs)[:, None])
        block = mx.broadcast_to(block[None], (self.batch, bs, bs))
        return mx.concatenate([ctx, block], axis=-1)

    def block_logits(
        self, last_tokens: list[int], embed: Any = None, lm_head: Any = None
    ) -> mx.array:
        """One drafter pass over [last token, mask x (block-1)] per row.

        Returns the logits (B, block_size - 1, V) of block positions 1..block-1: position j
        predicts the j-th token after `last_tokens[i]`. `embed` and `lm_head` default to the
        target's, bound at load.
        """
        return self.drafter.logits(self.block_hidden(last_tokens, embed), lm_head)

    def select(self, rows: list[int]) -> None:
        """Keep only these rows, in this order (rows that finished leave)."""
        self.rows.select(rows)

    def append(self, other: DFlashState) -> None:
        """Add the rows of `other` (e.g. requests just prefilled) after this state's rows."""
        self.rows.append(other.rows)

    def compact(self) -> None:
        """Squeeze out slots that no row uses (after many rows left); order is kept."""
        self.rows.compact()


class _ContextLayer(MaskedLayer):
    """The context keys and values of every drafter layer, and the RoPE position of each
    slot (a sliding drafter lets old slots go, so a slot's rank among its row's real ones
    is not its position): one layer kind behind ragged.RaggedRows. The context never
    rolls back (rejected positions are never written)."""

    def __init__(self, rows: RaggedRows, layers: int, shape: tuple):
        self.rows = rows
        rows.layers.append(self)
        self.keys = [mx.zeros(shape) for _ in range(layers)]
        self.values = [mx.zeros(shape) for _ in range(layers)]
        self.positions = mx.zeros((shape[0], 0), dtype=mx.int32)

    def write(self, i: int, k: mx.array, v: mx.array) -> None:
        """Layer i's keys and values of the next k.shape[2] slots (before `advance`)."""
        start, n = self.rows.length, k.shape[2]
        if start + n > self.keys[i].shape[2]:
            size = ((start + n + GROW - 1) // GROW) * GROW
            pad = [(0, 0), (0, 0), (0, size - self.keys[i].shape[2]), (0, 0)]
            self.keys[i] = mx.pad(self.keys[i], pad)
            self.values[i] = mx.pad(self.values[i], pad)
        self.keys[i][..., start : start + n, :] = k
        self.values[i][..., start : start + n, :] = v

    def arrays(self) -> list[mx.array]:
        """Every array this layer holds (what `RaggedRows.evaluate` computes)."""
        return [*self.keys, *self.values, self.positions]

    def add_positions(self, length: mx.array, n: int) -> None:
        """The RoPE positions of the next n slots of rows now `length` tokens long."""
        new = (length[:, None] + mx.arange(n)[None, :]).astype(mx.int32)
        self.positions = mx.concatenate([self.positions, new], axis=1)

    def used(self, i: int) -> tuple[mx.array, mx.array]:
        n = self.rows.length
        return self.keys[i][..., :n, :], self.values[i][..., :n, :]

    def gather(self, order: mx.array) -> None:
        idx = order[:, None, :, None]
        for i in range(len(self.keys)):
            k, v = self.used(i)
            self.keys[i] = mx.take_along_axis(k, idx, axis=2)
            self.values[i] = mx.take_along_axis(v, idx, axis=2)
        self.positions = mx.take_along_axis(self.positions, order, axis=1)

    def select(self, idx: mx.array) -> None:
        self.keys = [k[idx] for k in self.keys]
        self.values = [v[idx] for v in self.values]
        self.positions = self.positions[idx]

    def shift(self, start: int) -> None:
        n = self.rows.length
        self.keys = [k[..., start:n, :] for k in self.keys]
        self.values = [v[..., start:n, :] for v in self.values]
        self.positions = self.positions[:, start:]

    def pad_left(self, n: int) -> None:
        pad = [(0, 0), (0, 0), (n, 0), (0, 0)]
        used = [self.used(i) for i in range(len(self.keys))]
        self.keys = [mx.pad(k, pad) for k, _ in used]
        self.values = [mx.pad(v, pad) for _, v in used]
        self.positions = mx.pad(self.positions, [(0, 0), (n, 0)])

    def concat(self, other: _ContextLayer) -> None:
        # Both sides were padded to the same length (RaggedRows.append).
        mine = [self.used(i) for i in range(len(self.keys))]
        theirs = [other.used(i) for i in range(len(other.keys))]
        self.keys = [mx.concatenate([a[0], b[0]]) for a, b in zip(mine, theirs, strict=True)]
        self.values = [mx.concatenate([a[1], b[1]]) for a, b in zip(mine, theirs, strict=True)]
        self.positions = mx.concatenate([self.positions, other.positions])


# ----------------------------------------------------------------------------- loading


def _read_config(path: str | Path) -> dict | None:
    try:
        cfg = json.loads((Path(path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def drafter_kind(cfg: dict) -> str | None:
    """ "dflash2", "dflash", or None when config.json names neither layout."""
    archs = cfg.get("architectures") or []
    if ARCHITECTURE2 in archs or cfg.get("model_type") == "dflash2":
        return "dflash2"
    if ARCHITECTURE in archs:
        return "dflash"
    return None


def is_dflash_dir(path: str | Path) -> bool:
    """True when `path`/config.json is a DFlash-family drafter: it names DFlashDraftModel
    or DFlash2DraftModel, or it has a `dflash_config` (a layout load_dflash refuses by
    name rather than loading it as a language model)."""
    cfg = _read_config(path)
    if cfg is None:
        return False
    return drafter_kind(cfg) is not None or isinstance(cfg.get("dflash_config"), dict)


def _target_width_and_vocab(target: nn.Module, target_config: dict) -> tuple[int, int]:
    cfg = target_config.get("text_config", target_config)
    embed, _ = target_embed_and_head(target)
    hidden = cfg.get("hidden_size")
    vocab = cfg.get("vocab_size")
    if hidden is None or vocab is None:
        shape = embed.weight.shape
        vocab = vocab or shape[0]
        hidden = hidden or int(getattr(embed, "dims", shape[1]))
    return int(hidden), int(vocab)


def check_against_target(config: DFlashConfig, target: nn.Module, target_config: dict) -> None:
    """Raise ModelLoadError when the drafter was not made for this target (both values named)."""
    name = config.name
    n_layers = len(target_layers(target))
    hidden, vocab = _target_width_and_vocab(target, target_config)
    for i in config.target_layer_ids:
        if not 0 <= i < n_layers:
            raise ModelLoadError(
                f"{name} drafter reads target layer {i}, but the target has {n_layers} layers "
                f"(0..{n_layers - 1})"
            )
    if len(set(config.target_layer_ids)) != len(config.target_layer_ids):
        raise ModelLoadError(
            f"{name} target_layer_ids {list(config.target_layer_ids)} name a layer twice"
        )
    if config.num_target_layers is not None and int(config.num_target_layers) != n_layers:
        raise ModelLoadError(
            f"{name} drafter was made for a target of {config.num_target_layers} layers, "
            f"the target has {n_layers}"
        )
    if config.hidden_size != hidden:
        raise ModelLoadError(
            f"{name} drafter hidden_size {config.hidden_size} differs from the target's "
            f"hidden_size {hidden}"
        )
    if config.vocab_size != vocab:
        raise ModelLoadError(
            f"{name} drafter vocab_size {config.vocab_size} differs from the target's "
            f"vocab_size {vocab}"
        )
    if not 0 <= config.mask_token_id < vocab:
        raise ModelLoadError(
            f"{name} mask_token_id {config.mask_token_id} is outside the target's vocabulary "
            f"(0..{vocab - 1})"
        )
    if config.block_size < 2:
        raise ModelLoadError(f"{name} block_size must be >= 2, got {config.block_size}")
    if config.kind == "dflash2":
        if config.hidden_size % config.conv_group_size:
            raise ModelLoadError(
                f"DFlash2 conv_group_size {config.conv_group_size} does not divide "
                f"hidden_size {config.hidden_size}"
            )
        for key in DFLASH2_FIELDS:
            if getattr(config, key) < 1:
                raise ModelLoadError(f"DFlash2 {key} must be >= 1, got {getattr(config, key)}")
        if config.selector_top_k > vocab:
            raise ModelLoadError(
                f"DFlash2 selector_top_k {config.selector_top_k} exceeds the target's "
                f"vocab_size {vocab}"
            )
    if config.layer_types and len(config.layer_types) != config.num_hidden_layers:
        raise ModelLoadError(
            f"{name} layer_types has {len(config.layer_types)} entries for "
            f"{config.num_hidden_layers} layers"
        )


def _read_weights(path: Path, name: str = "DFlash") -> dict:
    weights = read_safetensors(path, f"{name} drafter {path}")
    # Some exports nest the drafter's weights under "model."; the names inside are the same.
    weights = {k.removeprefix("model."): v for k, v in weights.items()}
    for key in CODEBOOKS:  # DFlash2 stores its codebooks as bare tensors
        if key in weights:
            weights[f"{key}.weight"] = weights.pop(key)
    return weights


def load_dflash(path: str | Path, target_model: nn.Module, target_config: dict) -> DFlashDrafter:
    """Load a DFlash drafter in the published layout and bind it to `target_model`.

    Both layouts load: DFlashDraftModel and DFlash2DraftModel (`drafter.kind` says which).
    Quantized drafters (config `quantization` as mlx-lm writes it) load too. On the CPU
    backend float weights are cast to float32. Raises ModelLoadError when the directory is
    not a DFlash drafter, its files are incomplete, or it does not fit the target.
    """
    path = Path(path).expanduser()
    raw = _read_config(path)
    kind = drafter_kind(raw) if raw is not None else None
    if kind is None:
        archs = (raw or {}).get("architectures")
        raise ModelLoadError(
            f"{path}/config.json: architectures {archs!r} is not a drafter layout specfleet "
            f"knows ({ARCHITECTURE}, {ARCHITECTURE2})"
        )
    config = DFlashConfig.from_dict(raw, kind)
    check_against_target(config, target_model, target_config)
    weights = _read_weights(path, config.name)
    model = DFlashModel(config)
    quant = raw.get("quantization") or raw.get("quantization_config")
    load_strict(model, weights, f"{config.name} drafter {path}: weights do not match config", quant)
    return DFlashDrafter(model, target_model, str(path))


def save_dflash(model: DFlashModel, path: str | Path, extra: dict | None = None) -> None:
    """Write `model` in the published layout: config.json and model.safetensors.

    A DFlash2 model is written as z-lab's checkpoints are: architectures
    DFlash2DraftModel, its own fields inside dflash_config, bare codebook tensors."""
    from mlx.utils import tree_flatten

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = model.config
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": c.hidden_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "intermediate_size": c.intermediate_size,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "max_position_embeddings": c.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {
            "mask_token_id": c.mask_token_id,
            "target_layer_ids": list(c.target_layer_ids),
        },
        "torch_dtype": "float32",
        **(extra or {}),
    }
    if c.layer_types:
        cfg["layer_types"] = list(c.layer_types)
        cfg["sliding_window"] = c.sliding_window
    if c.is_causal is not None:
        cfg["is_causal"] = c.is_causal
    dcfg = cfg["dflash_config"]
    for key, default in (
        ("output_multiplier", 1.0),
        ("input_embedding_scale", 1.0),
        ("final_logit_softcapping", None),
    ):
        if getattr(c, key) != default:
            dcfg[key] = getattr(c, key)
    if not c.rope_is_neox_style:
        cfg["rope_is_neox_style"] = False
    if c.kind == "dflash2":
        cfg["architectures"] = [ARCHITECTURE2]
        dcfg["block_size"] = cfg.pop("block_size")
        for key in DFLASH2_FIELDS:
            dcfg[key] = getattr(c, key)
    weights = {k: v for k, v in tree_flatten(model.parameters()) if not k.startswith("_")}
    for key in CODEBOOKS:
        if f"{key}.weight" in weights:
            weights[key] = weights.pop(f"{key}.weight")
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Evenly spread layers from the second to the third-last (the published choice)."""
    if num_draft_layers <= 1 or num_target_layers <= 4:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    step = (end - start) / (num_draft_layers - 1)
    return [int(math.floor(start + i * step + 0.5)) for i in range(num_draft_layers)]


def greedy_reference(
    target: nn.Module, drafter: DFlashDrafter, prompt: list[int], max_tokens: int
) -> tuple[list[int], dict]:
    """Single-row greedy speculative decoding with `drafter`, the plainest correct loop.

    A yardstick for tests and for measuring a drafter (not the serving decoder): mlx-lm's
    prompt cache for the target, trimmed after each verify. Returns the first `max_tokens`
    tokens (EOS not treated specially) and {"target_passes": verify passes, "accepted": the
    drafts accepted per pass}; the prefill that yields the first token is not counted.
    """
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(target)
    state = drafter.new_state(1)
    with drafter.capture(target) as cap:
        logits = target(mx.array([prompt]), cache=cache)
        state.extend(cap.features, [len(prompt)])
    last = int(mx.argmax(logits[0, -1]).item())
    out, accepted = [last], []
    while len(out) < max_tokens:
        drafts = drafter.greedy_block(state, [last])[0].tolist()
        with drafter.capture(target) as cap:
            logits = target(mx.array([[last] + drafts]), cache=cache)
            feats = cap.features
        verified = mx.argmax(logits[0], axis=-1).tolist()
        n = next(
            (
                i
                for i, (d, v) in enumerate(zip(drafts, verified[: len(drafts)], strict=True))
                if d != v
            ),
            len(drafts),
        )
        trim_prompt_cache(cache, len(drafts) - n)
        state.extend(feats, [n + 1])
        out.extend(drafts[:n] + [verified[n]])
        accepted.append(n)
        last = verified[n]
    return out[:max_tokens], {"target_passes": len(accepted), "accepted": accepted}
