"""What DFlash2 adds to a DFlash drafter: dynamic convolutions and a candidate selector.

z-lab's second-generation drafters (`architectures: ["DFlash2DraftModel"]`) keep the
first layout (context from target features, a block of [last token, mask x (block-1)]
read in one pass) and add two things, defined by z-lab's reference code:

- Around each layer's attention and MLP, a *grouped dynamic causal convolution* over the
  block positions: position t mixes its own input with the inputs of the `kernel` - 1
  positions before it, with per-channel base weights plus per-group weights computed from
  position t's (normed) input. `prepare` convolves the sub-layer's input and computes the
  kernel that `finish` applies to the sub-layer's output.
- A *candidate selector*: the LM head's top `selector_top_k` tokens at each block position
  are rescored by a rank-`selector_rank` bilinear term between the token drafted just
  before (the predecessor; the block's anchor for the first) and each candidate, weighted
  by the position's hidden state. The drafts form a chain: each is chosen given the one
  before, so position j's law q_j is conditional on the drafts before it, which is what
  speculative sampling needs of an autoregressive drafter.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import sampling

#: Published checkpoints store the two codebooks as bare tensors, without ".weight".
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def grouped_dynamic_convolve(
    x: mx.array, dynamic: mx.array, base: mx.array, group_size: int
) -> mx.array:
    """Causal convolution of x (B, L, H) along L: out[t] = sum_o (base[o] + dynamic[t, o])
    * x[t - o], with base (K, H) per channel and dynamic (B, L, K, H / group_size) per
    group of `group_size` channels; positions before 0 are zeros."""
    b, n, h = x.shape
    groups = h // group_size
    blocks = x.reshape(b, n, groups, group_size)
    dyn = dynamic.reshape(b, n, base.shape[0], groups, 1)
    out = mx.zeros_like(blocks)
    for o in range(base.shape[0]):
        shifted = blocks if o == 0 else mx.pad(blocks[:, : n - o], [(0, 0), (o, 0), (0, 0), (0, 0)])
        kernel = base[o].reshape(1, 1, groups, group_size).astype(x.dtype) + dyn[:, :, o]
        out = out + kernel * shifted
    return out.reshape(b, n, h)


class GroupedDynamicConv(nn.Module):
    """The `attention_conv` / `mlp_conv` of a DFlash2 layer (published weight names)."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

    def prepare(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(x convolved with the first kernel, the second kernel for `finish`)."""
        groups = x.shape[-1] // self.group_size
        dyn = self.kernel_projection(x).reshape(*x.shape[:-1], 2, self.kernel_size, groups)
        return (
            grouped_dynamic_convolve(x, dyn[..., 0, :, :], self.base_kernel[0], self.group_size),
            dyn[..., 1, :, :],
        )

    def finish(self, y: mx.array, dynamic: mx.array) -> mx.array:
        return grouped_dynamic_convolve(y, dynamic, self.base_kernel[1], self.group_size)


class CandidateSelector(nn.Module):
    """`candidate_selector.*`: rescoring of the LM head's top-k tokens along the chain."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def draft(
        self,
        hidden: mx.array,
        logits: mx.array,
        anchors: mx.array,
        sampled: list[int],
        params: list,
        noise: mx.array | None,
    ) -> tuple[mx.array, mx.array | None]:
        """Walk the chain over the L block positions of every row.

        hidden (B, L, H) and logits (B, L, V) of the block positions, anchors (B,) the
        tokens before them; rows `sampled` (with params[i] and Gumbel noise (S, L, V))
        draw from the law of their scores, the others take the best candidate. Returns
        tokens (B, L) and, for the sampled rows, the laws (S, L, V) they were drawn from.
        """
        k = min(self.top_k, logits.shape[-1])
        candidates = mx.argpartition(logits, -k, axis=-1)[..., -k:]  # (B, L, K)
        unary = mx.take_along_axis(logits, candidates, axis=-1).astype(mx.float32)
        projected = self.hidden_projection(hidden)  # (B, L, r)
        successors = self.successor_codebook(candidates)  # (B, L, K, r)
        rows = mx.array(sampled, dtype=mx.int32) if sampled else None
        chosen = set(sampled)
        is_sampled = mx.array([i in chosen for i in range(logits.shape[0])])
        predecessor, path, laws = anchors, [], []
        for j in range(logits.shape[1]):
            weight = self.predecessor_codebook(predecessor) * projected[:, j]  # (B, r)
            edges = (successors[:, j] @ weight[..., None])[..., 0]  # (B, K)
            scores = unary[:, j] + edges.astype(mx.float32)
            best = mx.take_along_axis(
                candidates[:, j], mx.argmax(scores, axis=-1)[:, None], axis=-1
            )[:, 0]
            if sampled:
                # The law over the whole vocabulary: the candidates' scores, -inf elsewhere.
                full = mx.full((len(sampled), logits.shape[-1]), -mx.inf, dtype=mx.float32)
                full = mx.put_along_axis(full, candidates[rows, j], scores[rows], axis=-1)
                law = sampling.probs_rows(full, params)
                drawn = sampling.sample_rows(law, noise[:, j]).astype(best.dtype)
                spread = mx.zeros_like(best).at[rows].add(drawn)
                best = mx.where(is_sampled, spread, best)
                laws.append(law)
            path.append(best)
            predecessor = best
        return mx.stack(path, axis=1), (mx.stack(laws, axis=1) if laws else None)


def chain_noise(seeds: list[int], positions: list[int], depth: int, vocab: int) -> mx.array:
    """The Gumbel noise of the sampled rows' draft draws, keyed by (seed, position)."""
    keys = sampling.position_keys(seeds, positions, depth, sampling.DRAW_DRAFT)
    return sampling.gumbel_table(keys, vocab)
