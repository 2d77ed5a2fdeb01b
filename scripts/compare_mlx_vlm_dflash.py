"""Draft with the same tiny DFlash / DFlash2 drafter through specfleet and through mlx-vlm's
drafter classes, greedy, full blocks, and compare acceptance step by step.

A drafter read differently from its authors stays lossless (the target verifies every
token) but loses the acceptance it was trained for, so equal acceptance, step for step, is
the check that the published layout is read the way mlx-vlm reads it.

    python scripts/compare_mlx_vlm_dflash.py --mlx-vlm /tmp/mlxvlm2/x

`--mlx-vlm` is a directory holding the `mlx_vlm` package (an unzipped wheel:
`pip download mlx-vlm==0.7.10 --no-deps` and unzip). Only its drafter modules are imported;
the package's own __init__ (which needs torch-free but heavy extras) is bypassed, and PIL,
which mlx-vlm imports for images, is stubbed when it is absent.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import types
from pathlib import Path

import engine  # noqa: F401  (loads the fast BLAS before mlx)

# isort: split
import mlx.core as mx
import mlx_lm

from engine.dflash import DFlashConfig, DFlashModel, load_dflash, save_dflash

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import build_llama  # noqa: E402

VOCAB, HIDDEN, LAYERS = 32, 64, 3
PROMPTS = [[5, 9, 11, 4, 2, 7], [1, 2, 3], [30, 8, 8, 1, 17, 22, 6, 6, 9], [12]]


def import_drafters(root: Path):
    """mlx-vlm's drafter package, without running mlx_vlm/__init__.py."""
    if importlib.util.find_spec("PIL") is None:
        pil = types.ModuleType("PIL")
        pil.Image = types.ModuleType("PIL.Image")
        sys.modules.update({"PIL": pil, "PIL.Image": pil.Image})
    for name, sub in (
        ("mlx_vlm", ""),
        ("mlx_vlm.models", "models"),
        ("mlx_vlm.speculative", "speculative"),
        ("mlx_vlm.speculative.drafters", "speculative/drafters"),
    ):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__path__ = [str(root / "mlx_vlm" / sub)]
            sys.modules[name] = module
    dflash = importlib.import_module("mlx_vlm.speculative.drafters.qwen3_dflash")
    dflash2 = importlib.import_module("mlx_vlm.speculative.drafters.dflash2")
    base = importlib.import_module("mlx_vlm.speculative.drafters.qwen3_dflash.dflash")
    return dflash, dflash2, base.DFlashDraftModel


def greedy_steps(target, drafter, propose, prompt: list[int], max_tokens: int):
    """The plainest greedy loop: `propose(last, fresh)` gives a block of drafts from the
    target features of the tokens accepted since the previous call. Returns the text, and
    per verify step the drafts and how many were accepted."""
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    cache = make_prompt_cache(target)
    with drafter.capture(target) as cap:
        logits = target(mx.array([prompt]), cache=cache)
        fresh = cap.features
    last = int(mx.argmax(logits[0, -1]).item())
    out, steps = [last], []
    while len(out) < max_tokens:
        drafts = propose(last, fresh)
        with drafter.capture(target) as cap:
            logits = target(mx.array([[last] + drafts]), cache=cache)
            feats = cap.features
        verified = mx.argmax(logits[0], axis=-1).tolist()
        n = next(
            (i for i, (d, v) in enumerate(zip(drafts, verified[:-1], strict=True)) if d != v),
            len(drafts),
        )
        trim_prompt_cache(cache, len(drafts) - n)
        fresh = feats[:, : n + 1]
        out.extend(drafts[:n] + [verified[n]])
        steps.append((drafts, n))
        last = verified[n]
    return out[:max_tokens], steps


def ours_proposer(drafter):
    state = drafter.new_state(1)

    def propose(last, fresh):
        state.extend(fresh, [fresh.shape[1]])
        return drafter.greedy_block(state, [last])[0].tolist()

    return propose


def theirs_proposer(theirs, block_size):
    cache = theirs.make_cache()  # mlx-vlm caches the context keys itself

    def propose(last, fresh):
        drafts = theirs.draft_block(last, fresh, cache, block_size, lambda x: mx.argmax(x, -1))
        return drafts[0].tolist()

    return propose


def configs() -> dict[str, DFlashConfig]:
    common = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=VOCAB,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        block_size=6,
        mask_token_id=VOCAB - 1,
        target_layer_ids=(0, 2),
        num_target_layers=LAYERS,
    )
    return {
        "dflash": DFlashConfig(**common),
        # Shaped like z-lab's published DFlash2 (all layers sliding, non-causal blocks,
        # output multiplier, soft cap); texts stay inside the window, where mlx-vlm's
        # sliding rule (the last window - 1 context tokens for every block position) and
        # z-lab's (keys less than the window before each position) agree.
        "dflash2": DFlashConfig(
            **common,
            kind="dflash2",
            layer_types=("sliding_attention", "sliding_attention"),
            sliding_window=128,
            is_causal=False,
            output_multiplier=0.7,
            final_logit_softcapping=20.0,
            conv_kernel_size=2,
            conv_group_size=16,
            selector_rank=8,
            selector_top_k=4,
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mlx-vlm", type=Path, required=True, help="directory holding mlx_vlm/")
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()
    vlm_dflash, vlm_dflash2, vlm_base = import_drafters(args.mlx_vlm)
    classes = {"dflash": vlm_dflash, "dflash2": vlm_dflash2}
    tmp = Path(tempfile.mkdtemp())
    tpath = build_llama(tmp / "t", vocab_size=VOCAB, hidden=HIDDEN, layers=LAYERS, scale=3.0)
    target, tcfg = mlx_lm.utils.load_model(tpath)
    failed = 0
    for kind, config in configs().items():
        mx.random.seed(7)
        model = DFlashModel(config)
        if kind == "dflash2":
            for layer in model.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.base_kernel = 0.5 * mx.random.normal(conv.base_kernel.shape)
        save_dflash(model, tmp / kind)
        ours = load_dflash(tmp / kind, target, tcfg)
        raw = json.loads((tmp / kind / "config.json").read_text())
        module = classes[kind]
        theirs = module.Model(module.ModelConfig.from_dict(raw))
        weights = dict(mx.load(str(tmp / kind / "model.safetensors")))
        theirs.load_weights(list(theirs.sanitize(weights).items()), strict=True)
        vlm_base.bind(theirs, target)  # mlx-vlm's own bind, minus its rollback-hook check
        steps = same = accepted = 0
        for prompt in PROMPTS:
            a_out, a_steps = greedy_steps(target, ours, ours_proposer(ours), prompt, args.tokens)
            b_out, b_steps = greedy_steps(
                target, ours, theirs_proposer(theirs, config.block_size), prompt, args.tokens
            )
            steps += len(b_steps)
            same += sum(x == y for x, y in zip(a_steps, b_steps, strict=False))
            accepted += sum(n for _, n in a_steps)
            failed += not (a_out == b_out and a_steps == b_steps)
        print(
            f"{kind}: {same}/{steps} verify steps with the same {config.block_size - 1} drafts "
            f"and the same acceptance ({accepted} drafts accepted over {len(PROMPTS)} prompts)"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
