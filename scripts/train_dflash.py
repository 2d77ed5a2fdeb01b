"""Train a DFlash block drafter for a target model and save it in the published layout.

A DFlash drafter reads the hidden states of a few target layers and proposes a whole block of
tokens in one pass (see engine/dflash.py). This script trains one for any local mlx-lm target:
the target stays frozen; for random windows of text it returns, in one forward pass, its
next-token distributions and the features of the named layers; the drafter learns, for
random block starts s, to predict tokens s+1 .. s+block-1 from the features of tokens < s and
the token at s. The loss is the cross-entropy against the *target's* distribution at each
position (distillation: agreement with the target is what speculation needs), plus a little
plain cross-entropy on the text, weighted to favour early block positions (a block is only
accepted up to its first miss).

For the bundled demo target (the default) the text is the same Python standard-library corpus
that scripts/train_demo_pair.py trains the demo pair on (held-out files excluded):

    taskset -c 1 python scripts/train_dflash.py --out engine/demo/dflash

For your own target, point it at the target directory and at text like your workload:

    python scripts/train_dflash.py --target ~/models/my-target --text data/ --out my-dflash \\
        --layers 2 --block-size 16 --steps 20000

`--text` takes files or directories (every *.txt, *.md, *.py, *.jsonl below; jsonl lines are
read from their "text" field, or "prompt" + "completion"). Training writes a checkpoint to
`<out>/checkpoint/` every `--save-every` steps; running the same command again resumes from it.
At the end the drafter is saved (config.json + model.safetensors) and evaluated with greedy
speculative decoding on held-out prompts; `<out>/training.json` records the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train_demo_pair as corpus  # noqa: E402  (loads OpenBLAS before MLX; stdlib corpus)

# isort: split

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

from engine.dflash import (  # noqa: E402
    DFlashConfig,
    DFlashDrafter,
    DFlashModel,
    default_target_layer_ids,
    greedy_reference,
    save_dflash,
)

DEMO_TARGET = Path(__file__).resolve().parent.parent / "engine" / "demo" / "target"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--target", type=Path, default=DEMO_TARGET, help="target model directory")
    p.add_argument("--out", type=Path, required=True, help="where the drafter is written")
    p.add_argument("--text", type=Path, action="append", help="training text (default: stdlib)")
    p.add_argument("--layers", type=int, default=2, help="drafter decoder layers")
    p.add_argument("--block-size", type=int, default=8, help="tokens per block (incl. last)")
    p.add_argument(
        "--target-layer-ids",
        type=str,
        default="1,2,3",
        help="comma-separated target layers to read ('auto': spread like the published ones)",
    )
    p.add_argument("--mask-token-id", type=int, default=None, help="default: the pad token")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch", type=int, default=8, help="text windows per step")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per window")
    p.add_argument("--blocks", type=int, default=8, help="blocks trained per window")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ce-weight", type=float, default=0.1, help="share of plain cross-entropy")
    p.add_argument("--gamma", type=float, default=None, help="position decay (default bs/2)")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--eval-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data


def read_user_text(paths: list[Path]) -> list[str]:
    """Documents from files and directories (see --help)."""
    docs = []
    for root in paths:
        files = [root] if root.is_file() else sorted(root.rglob("*"))
        for f in files:
            if f.suffix in (".txt", ".md", ".py"):
                docs.append(f.read_text(encoding="utf-8", errors="replace"))
            elif f.suffix == ".jsonl":
                for line in f.read_text(encoding="utf-8").splitlines():
                    if line.strip():
                        row = json.loads(line)
                        docs.append(
                            row.get("text") or row.get("prompt", "") + row.get("completion", "")
                        )
    return [d for d in docs if d]


def load_streams(args, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(train, held-out) token streams; every 10th document is held out."""
    if args.text:
        docs = read_user_text(args.text)
        train_docs = [d for i, d in enumerate(docs) if i % 10 != 9]
        held_docs = [d for i, d in enumerate(docs) if i % 10 == 9] or docs[:1]
    else:
        files = corpus.select_files(int(corpus.Settings.max_corpus_mb * 1e6))
        train_files, held_files = corpus.split_files(files, corpus.Settings.holdout_every)
        train_docs = corpus.read_texts(train_files)
        train_docs += corpus.chat_examples(train_docs, limit=2000)
        held_docs = corpus.read_texts(held_files)

    fast = getattr(getattr(tokenizer, "_tokenizer", None), "backend_tokenizer", None)

    def encode(docs):
        eos = tokenizer.eos_token_id
        if fast is not None:  # the Rust tokenizer encodes a batch much faster
            encoded = [e.ids for e in fast.encode_batch(docs, add_special_tokens=False)]
        else:
            encoded = [tokenizer.encode(d, add_special_tokens=False) for d in docs]
        ids = []
        for e in encoded:
            ids.append(eos)
            ids.extend(e)
        return np.asarray(ids, dtype=np.int32)

    return encode(train_docs), encode(held_docs)


# ----------------------------------------------------------------------------- training


def block_batch(rng, stream, args) -> tuple[mx.array, mx.array]:
    """Windows (B, T) and block starts (B, nb), each start leaving room for a whole block."""
    t, bs = args.seq_len, args.block_size
    starts = rng.integers(0, len(stream) - t - 1, size=args.batch)
    windows = np.stack([stream[i : i + t] for i in starts])
    anchors = np.stack(
        [np.sort(rng.choice(np.arange(1, t - bs + 1), args.blocks, replace=False)) for _ in starts]
    )
    return mx.array(windows), mx.array(anchors.astype(np.int32))


def drafter_loss(model, embed, head, feats, t_logp, windows, anchors, args, weights):
    """Weighted distillation + cross-entropy loss of block positions 1..bs-1."""
    b, t = windows.shape
    nb, bs = anchors.shape[1], args.block_size
    flat = anchors.reshape(-1)  # (B*nb,) block start = position of the block's first token
    row = mx.repeat(mx.arange(b), nb)
    pos = flat[:, None] + mx.arange(bs)[None, :]  # (B*nb, bs) text positions of the block
    first = windows[row, flat]
    ids = mx.concatenate(
        [first[:, None], mx.full((b * nb, bs - 1), model.config.mask_token_id, mx.int32)], 1
    )
    ctx = model.context(feats)  # (B, T, hidden)
    ctx_kv, masks = [], []
    visible = (mx.arange(t)[None, :] < flat[:, None])[:, None, None, :]  # context < block start
    visible = mx.broadcast_to(visible, (b * nb, 1, bs, t))
    # ... and the whole block (the first layout's full-attention layers are bidirectional)
    visible = mx.concatenate([visible, mx.ones((b * nb, 1, bs, bs), dtype=mx.bool_)], axis=-1)
    for layer in model.layers:
        k, v = layer.self_attn.keys_values(ctx, model.rope, 0)
        ctx_kv.append((k[row], v[row]))
        masks.append(visible)
    h = model.block_hidden(embed(ids), flat, ctx_kv, masks)
    logp = nn.log_softmax(head(h[:, 1:]), axis=-1)  # (B*nb, bs-1, V)
    src = pos[:, :-1]  # the target's law for token p+1 sits at position p
    teacher = mx.exp(t_logp[row[:, None], src])
    soft = -(teacher * logp).sum(-1)
    labels = windows[row[:, None], pos[:, 1:]]
    hard = -mx.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    per = soft + args.ce_weight * hard
    return (per * weights).sum() / (weights.sum() * b * nb)


def save_checkpoint(ckpt: Path, model, opt, step: int) -> None:
    ckpt.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(ckpt / "model.safetensors"), dict(tree_flatten(model.parameters())))
    mx.save_safetensors(str(ckpt / "optimizer.safetensors"), dict(tree_flatten(opt.state)))
    tmp = ckpt / "step.json.tmp"
    tmp.write_text(json.dumps({"step": step}))
    os.replace(tmp, ckpt / "step.json")  # the step file is written last: it marks a whole save


def load_checkpoint(ckpt: Path, model, opt) -> int:
    if not (ckpt / "step.json").exists():
        return 0
    model.load_weights(str(ckpt / "model.safetensors"))
    opt.state = tree_unflatten(list(mx.load(str(ckpt / "optimizer.safetensors")).items()))
    return int(json.loads((ckpt / "step.json").read_text())["step"])


def evaluate(target, drafter, held: np.ndarray, args) -> dict:
    """Greedy speculative decoding from held-out prompts: tokens per target pass."""
    starts = np.linspace(0, len(held) - 200, args.eval_prompts).astype(int)
    passes, tokens, hist = 0, 0, [0] * args.block_size
    for s in starts:
        prompt = held[s : s + 32].tolist()
        out, stats = greedy_reference(target, drafter, prompt, args.eval_tokens)
        passes += stats["target_passes"]
        tokens += len(out)
        for a in stats["accepted"]:
            hist[a] += 1
    return {
        "prompts": len(starts),
        "tokens": tokens,
        "target_passes": passes,
        "tokens_per_target_pass": tokens / passes,
        "accepted_histogram": hist,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    import mlx_lm
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    t0 = time.monotonic()
    target, tokenizer, tcfg = mlx_lm.load(str(args.target), return_config=True)
    target.freeze()
    mx.eval(target.parameters())
    cache = args.out / "checkpoint" / "tokens.npz"
    if cache.exists():  # resuming: the text is tokenized once per run
        saved = np.load(cache)
        train_stream, held_stream = saved["train"], saved["held"]
    else:
        train_stream, held_stream = load_streams(args, tokenizer)
        cache.parent.mkdir(parents=True, exist_ok=True)
        np.savez(cache, train=train_stream, held=held_stream)
    print(
        f"[{time.monotonic() - t0:.0f}s] text: {len(train_stream):,} training tokens, "
        f"{len(held_stream):,} held out",
        flush=True,
    )

    from engine.capture import target_layers

    n_target = len(target_layers(target))
    if args.target_layer_ids == "auto":
        ids = default_target_layer_ids(n_target, args.layers)
    else:
        ids = [int(i) for i in args.target_layer_ids.split(",")]
    text_cfg = tcfg.get("text_config", tcfg)
    mask_id = args.mask_token_id
    if mask_id is None:
        mask_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    config = DFlashConfig(
        hidden_size=text_cfg["hidden_size"],
        num_hidden_layers=args.layers,
        num_attention_heads=text_cfg["num_attention_heads"],
        num_key_value_heads=text_cfg.get("num_key_value_heads", text_cfg["num_attention_heads"]),
        head_dim=text_cfg.get("head_dim")
        or text_cfg["hidden_size"] // text_cfg["num_attention_heads"],
        intermediate_size=text_cfg["intermediate_size"],
        vocab_size=text_cfg["vocab_size"],
        rms_norm_eps=text_cfg.get("rms_norm_eps", 1e-6),
        rope_theta=text_cfg.get("rope_theta", 10000.0),
        max_position_embeddings=text_cfg.get("max_position_embeddings", 4096),
        block_size=args.block_size,
        mask_token_id=int(mask_id),
        target_layer_ids=tuple(ids),
        num_target_layers=n_target,
    )
    mx.random.seed(args.seed)
    model = DFlashModel(config)
    drafter = DFlashDrafter(model, target)
    embed, head = drafter.embed, drafter.lm_head
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"drafter: {args.layers} layers, {n_params:,} parameters, reads layers {ids}")

    warm = max(10, args.steps // 20)
    lr = optim.join_schedules(
        [
            optim.linear_schedule(args.lr / 100, args.lr, warm),
            optim.cosine_decay(args.lr, max(1, args.steps - warm), args.lr / 10),
        ],
        [warm],
    )
    opt = optim.AdamW(learning_rate=lr, betas=[0.9, 0.95], weight_decay=0.01)
    ckpt = args.out / "checkpoint"
    start = load_checkpoint(ckpt, model, opt)
    if start:
        print(f"resuming from {ckpt} at step {start}")
    gamma = args.gamma or args.block_size / 2
    weights = mx.exp(-mx.arange(args.block_size - 1, dtype=mx.float32) / gamma)
    loss_grad = nn.value_and_grad(model, drafter_loss)
    recent: list[float] = []
    with Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} loss {task.fields[loss]}"),
        TimeRemainingColumn(),
    ) as bar:
        task = bar.add_task("train", total=args.steps, completed=start, loss="-")
        for step in range(start + 1, args.steps + 1):
            rng = np.random.default_rng([args.seed, step])  # batches do not depend on resuming
            windows, anchors = block_batch(rng, train_stream, args)
            with drafter.capture(target) as cap:
                logits = target(windows)
            feats = mx.stop_gradient(cap.features)
            t_logp = mx.stop_gradient(nn.log_softmax(logits, axis=-1))
            loss, grads = loss_grad(
                model, embed, head, feats, t_logp, windows, anchors, args, weights
            )
            grads, _ = optim.clip_grad_norm(grads, 1.0)
            opt.update(model, grads)
            mx.eval(loss, model.parameters(), opt.state)
            recent = (recent + [loss.item()])[-20:]
            bar.update(task, completed=step, loss=f"{np.mean(recent):.3f}")
            if step % args.save_every == 0 or step == args.steps:
                save_checkpoint(ckpt, model, opt, step)
    train_s = time.monotonic() - t0
    save_dflash(model, args.out)
    result = evaluate(target, drafter, held_stream, args)
    record = {
        "command": "python " + " ".join(sys.argv),
        "platform": f"{platform.machine()}, MLX {mx.__version__}",
        "target": str(args.target),
        "parameters": n_params,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "final_loss": float(np.mean(recent)) if recent else None,
        "train_seconds": round(train_s),
        "eval": result,
    }
    (args.out / "training.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps(record["eval"]), flush=True)


if __name__ == "__main__":
    main()
