"""Model blocks the drafters share (engine.dflash, engine.eagle3), under the names their
published checkpoints use.

mlx-lm's own blocks are not used here although they compute the same numbers:
`mlx_lm.models.llama.MLP` builds `down_proj` before `up_proj`, so a seeded fresh drafter
(the tests' tiny ones, scripts/train_dflash.py's start) would draw other weights, and its
attention takes its input width from `hidden_size`, while an EAGLE-3 layer reads 2 x hidden.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


class SwiGLU(nn.Module):
    """The gated feed-forward block: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class Projections(nn.Module):
    """What every drafter attention has: q/k/v projections of an input `width` wide, the
    output projection back to hidden, the head counts and the scale; the attention
    itself (which keys, which rotary embedding, which cache) is the subclass's."""

    def __init__(self, c, width: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.scale = c.head_dim**-0.5
        self.q_proj = nn.Linear(width, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(width, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
