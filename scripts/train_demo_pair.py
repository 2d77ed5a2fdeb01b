"""Train the bundled demo draft/target model pair (engine/demo/) from scratch on the CPU.

The pair exists so the engine, the tests and the examples have a real speculative-decoding
setup that loads offline with ``mlx_lm.load`` and fits in the repository (<= 25 MB):

* corpus: the running interpreter's own standard-library ``.py`` files (PSF licence, offline),
  plus a few chat-formatted "write a function" examples cut from the same files;
* tokenizer: byte-level BPE (2048 entries including the special tokens), shared by both models;
* target: a 4-layer llama trained with next-token cross-entropy;
* draft: a 1-layer llama, first trained on its own (cross-entropy), then distilled from the
  target's logits so that its greedy choices agree with the target's as often as possible.

Usage (about 15 minutes on a 2-core x86 CPU)::

    python scripts/train_demo_pair.py --out engine/demo

The script prints progress with elapsed time, verifies that both directories load back through
``mlx_lm.load`` with the same logits, and writes ``<out>/README.md`` with the measurements.
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import json
import os
import platform
import shutil
import sys
import sysconfig
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Load the system OpenBLAS before MLX so that MLX's CPU matmuls resolve to it: on x86 Linux
# this makes fp32 GEMM ~30x faster than the fallback. Missing library = slower, not broken.
OPENBLAS = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
if os.path.exists(OPENBLAS):
    ctypes.CDLL(OPENBLAS, mode=ctypes.RTLD_GLOBAL)

# The pair must load without a model hub; nothing here should ever try the network.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models.llama import Model, ModelArgs  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SYSTEM, USER, ASSISTANT = "<|system|>", "<|user|>", "<|assistant|>"
# Order fixes the ids: <|endoftext|> = 0, <|pad|> = 1, <|system|> = 2, <|user|> = 3, ...
SPECIAL_TOKENS = [EOS, PAD, SYSTEM, USER, ASSISTANT]

# "<|role|>\ncontent\n" per message, then "<|assistant|>\n" when a reply is wanted. Roles other
# than system/user/assistant are not special tokens and would be split into ordinary BPE pieces.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

# Directories of the stdlib left out of the corpus: tests and GUI code are large and unlike the
# ordinary library code the demo should imitate; site-packages is not the stdlib at all.
SKIP_DIRS = {
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "encodings",
}

# Few, wide heads: on this CPU the attention softmax costs per head, so 4 x 64 trains faster than
# 8 x 32 for the same FLOPs.
TARGET_SHAPE = dict(
    hidden_size=256,
    num_hidden_layers=4,
    intermediate_size=704,
    num_attention_heads=4,
    num_key_value_heads=4,
)
DRAFT_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=1,
    intermediate_size=384,
    num_attention_heads=2,
    num_key_value_heads=2,
)

START = time.monotonic()


def log(msg: str) -> None:
    """Print ``msg`` prefixed with the seconds elapsed since the script started."""
    print(f"[{time.monotonic() - START:7.1f}s] {msg}", flush=True)


@dataclass
class Settings:
    """Every knob of a run; the defaults are what produced the committed pair."""

    out: Path
    seed: int = 0
    vocab_size: int = 2048
    context: int = 1024  # max_position_embeddings written to config.json
    # Windows of 128 tokens learn fastest per second here; the last long_frac of each run
    # switches to windows of 2 x seq_len (half the batch, same tokens per step) so that
    # positions up to 256 are trained too. Nothing longer was ever seen.
    seq_len: int = 128
    batch: int = 16
    long_frac: float = 0.2
    betas: tuple[float, float] = (0.9, 0.95)  # beta2 0.999 learned ~0.8 nats slower in 120 steps
    max_corpus_mb: float = 9.0
    holdout_every: int = 10  # every 10th selected file (sorted order) is held out
    target_steps: int = 800
    target_lr: float = 4e-3
    draft_ce_steps: int = 300
    draft_steps: int = 700
    draft_lr: float = 5e-3  # cross-entropy phase
    kd_lr: float = 2e-3  # distillation phase, starting from the cross-entropy weights
    kd_ce_weight: float = 0.1  # share of plain cross-entropy mixed into the distillation loss
    eval_windows: int = 24
    spec_k: int = 4  # draft tokens per verification step assumed for acceptance estimates


# ----------------------------------------------------------------------------- corpus


def select_files(max_bytes: int) -> list[Path]:
    """Return the stdlib ``.py`` files used as corpus: sorted by path, minus SKIP_DIRS,
    truncated once the running total would pass ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chosen, total = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts[:-1])
        if parts & SKIP_DIRS or path.name.startswith("config-"):
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            continue  # keep scanning: a smaller later file may still fit
        chosen.append(path)
        total += size
    return chosen


def split_files(files: list[Path], every: int) -> tuple[list[Path], list[Path]]:
    """Split ``files`` into (train, held_out); every ``every``-th file is held out."""
    held = [f for i, f in enumerate(files) if i % every == every - 1]
    train = [f for i, f in enumerate(files) if i % every != every - 1]
    return train, held


def read_texts(files: list[Path]) -> list[str]:
    """Read each file as UTF-8 (undecodable bytes replaced, which the stdlib barely has)."""
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def chat_examples(texts: list[str], limit: int) -> list[str]:
    """Cut top-level functions out of ``texts`` and wrap them as chat turns, so the chat
    template's markers are tokens the models have seen: in, source texts; out, up to ``limit``
    documents "<|user|>\\nWrite a function named f: <doc line>\\n<|assistant|>\\n<source>\\n"."""
    out = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef):
                continue
            src = ast.get_source_segment(text, node)
            if not src or len(src) > 1500:
                continue
            doc = (ast.get_docstring(node) or "").strip().splitlines()
            ask = f"Write a function named {node.name}" + (f": {doc[0]}" if doc else ".")
            out.append(f"{USER}\n{ask}\n{ASSISTANT}\n{src}\n")
            if len(out) >= limit:
                return out
    return out


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``texts``; the special tokens take the lowest ids and all 256
    byte symbols are in the base alphabet, so any UTF-8 string round-trips."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Encode ``texts`` into one int32 token stream, each document preceded by <|endoftext|>
    (so the models learn it both as a document separator and as a start-of-text marker)."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.append(eos)
        ids.extend(enc.ids)
    ids.append(eos)
    return np.asarray(ids, dtype=np.int32)


def tokenizer_config(context: int) -> dict:
    """The tokenizer_config.json contents: a plain PreTrainedTokenizerFast with our specials."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "additional_special_tokens": [SYSTEM, USER, ASSISTANT],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
        "chat_template": CHAT_TEMPLATE,
    }


# ----------------------------------------------------------------------------- models


def model_args(shape: dict, s: Settings) -> ModelArgs:
    """Llama ModelArgs for a ``shape`` (TARGET_SHAPE or DRAFT_SHAPE) under settings ``s``."""
    return ModelArgs(
        model_type="llama",
        vocab_size=s.vocab_size,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=s.context,
        tie_word_embeddings=True,
        **shape,
    )


def make_model(shape: dict, s: Settings, seed: int) -> Model:
    """A freshly initialised llama ``Model``; ``seed`` fixes the initial weights."""
    mx.random.seed(seed)
    model = Model(model_args(shape, s))
    mx.eval(model.parameters())
    return model


def n_params(model: nn.Module) -> int:
    """Number of scalar parameters in ``model``."""
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def hf_config(shape: dict, s: Settings, eos_id: int, pad_id: int) -> dict:
    """config.json for ``shape`` in the Hugging Face llama layout mlx_lm.load understands."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "vocab_size": s.vocab_size,
        "max_position_embeddings": s.context,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
    }


# ----------------------------------------------------------------------------- training


def sample_batch(stream: np.ndarray, rng: np.random.Generator, batch: int, seq: int) -> mx.array:
    """``batch`` random windows of ``seq + 1`` tokens from ``stream`` (inputs + shifted labels)."""
    starts = rng.integers(0, len(stream) - seq - 1, size=batch)
    return mx.array(np.stack([stream[i : i + seq + 1] for i in starts]))


def schedule(lr: float, steps: int) -> Callable[[mx.array], mx.array]:
    """Linear warm-up over 10% of ``steps`` (at least 10), then cosine decay to lr / 10."""
    warm = max(10, steps // 10)
    return optim.join_schedules(
        [
            optim.linear_schedule(lr / 100, lr, warm),
            optim.cosine_decay(lr, max(1, steps - warm), lr / 10),
        ],
        [warm],
    )


def ce_loss(model: Model, tokens: mx.array) -> mx.array:
    """Mean next-token cross-entropy of ``model`` on ``tokens`` [B, T+1]."""
    logits = model(tokens[:, :-1])
    return nn.losses.cross_entropy(logits, tokens[:, 1:]).mean()


def kd_loss(draft: Model, tokens: mx.array, target_p: mx.array, ce_weight: float) -> mx.array:
    """Distillation loss of ``draft`` on ``tokens`` [B, T+1]: the cross-entropy of the draft
    against the target's next-token distribution ``target_p`` (softmax over the same inputs,
    computed outside so no gradient reaches the target), plus ``ce_weight`` x the plain
    cross-entropy on the real next tokens. The soft term equals KL(target || draft) plus the
    target's entropy, a constant, so it has the KL's gradient without paying for log(target_p);
    vocabulary-wide exp() passes are what a step spends most of its time on here."""
    logp = log_softmax(draft(tokens[:, :-1]))
    soft = -(target_p * logp).sum(axis=-1).mean()
    hard = -mx.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
    return soft + ce_weight * hard


def teacher_probs(teacher: Model, tokens: mx.array) -> mx.array:
    """The teacher's next-token distribution [B, T, V] on ``tokens[:, :-1]``, as a constant."""
    return mx.stop_gradient(mx.softmax(teacher(tokens[:, :-1]), axis=-1))


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities from ``logits`` along the last axis."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def train(
    model: Model,
    stream: np.ndarray,
    steps: int,
    lr: float,
    s: Settings,
    seed: int,
    name: str,
    teacher: Model | None = None,
) -> float:
    """Train ``model`` in place for ``steps`` AdamW steps on random windows of ``stream``
    (``s.seq_len`` tokens, doubled for the last ``s.long_frac`` of the steps). With a
    ``teacher`` the loss is ``kd_loss`` against it, else plain cross-entropy.
    Returns the mean loss over the last 20 steps."""
    rng = np.random.default_rng(seed)
    opt = optim.AdamW(learning_rate=schedule(lr, steps), betas=list(s.betas), weight_decay=0.01)
    long_from = round(steps * (1 - s.long_frac))
    loss_fn = ce_loss if teacher is None else (lambda m, x, t: kd_loss(m, x, t, s.kd_ce_weight))
    grad_fn = nn.value_and_grad(model, loss_fn)
    tail, t0 = [], time.monotonic()
    for step in range(1, steps + 1):
        if step <= long_from:
            tokens = sample_batch(stream, rng, s.batch, s.seq_len)
        else:
            tokens = sample_batch(stream, rng, s.batch // 2, s.seq_len * 2)
        extra = () if teacher is None else (teacher_probs(teacher, tokens),)
        loss, grads = grad_fn(model, tokens, *extra)
        grads, _ = optim.clip_grad_norm(grads, 1.0)  # early steps at high lr can spike
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        tail = (tail + [loss.item()])[-20:]
        if step % 20 == 0 or step == steps:
            rate = step / (time.monotonic() - t0)
            log(f"{name} step {step}/{steps} loss {np.mean(tail):.3f} ({rate:.2f} steps/s)")
    return float(np.mean(tail))


# ----------------------------------------------------------------------------- evaluation


def eval_windows(stream: np.ndarray, n: int, seq: int) -> mx.array:
    """``n`` evenly spaced windows of ``seq + 1`` tokens over the held-out ``stream``."""
    starts = np.linspace(0, len(stream) - seq - 1, n).astype(np.int64)
    return mx.array(np.stack([stream[i : i + seq + 1] for i in starts]))


def heldout_stats(target: Model, draft: Model, windows: mx.array) -> dict:
    """Teacher-forced comparison on held-out ``windows``: the share of positions where the
    draft's argmax equals the target's, and each model's cross-entropy (nats/token)."""
    agree, ce_t, ce_d = [], [], []
    for i in range(0, windows.shape[0], 8):  # chunks of 8 keep memory small
        x = windows[i : i + 8]
        lt, ld = target(x[:, :-1]), draft(x[:, :-1])
        agree.append((lt.argmax(-1) == ld.argmax(-1)).astype(mx.float32).mean())
        ce_t.append(nn.losses.cross_entropy(lt, x[:, 1:]).mean())
        ce_d.append(nn.losses.cross_entropy(ld, x[:, 1:]).mean())
    mean = lambda xs: float(mx.stack(xs).mean().item())  # noqa: E731
    return {"agreement": mean(agree), "target_ce": mean(ce_t), "draft_ce": mean(ce_d)}


def expected_accept_len(alpha: float, k: int) -> float:
    """Tokens emitted per target verification with ``k`` greedy draft tokens, if each draft
    token independently matches with probability ``alpha``: (1 - alpha^(k+1)) / (1 - alpha)."""
    return float(k + 1) if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def greedy_continue(model: Model, prompt: mx.array, n: int) -> list[int]:
    """``n`` greedy tokens from ``model`` after ``prompt`` (1-D ids), using a KV cache."""
    from mlx_lm.generate import generate_step

    out = []
    for tok, _ in generate_step(prompt, model, max_tokens=n):
        out.append(int(tok))
    return out


def simulate_speculation(target: Model, draft: Model, prompts: mx.array, n: int, k: int) -> dict:
    """Greedy speculative decoding replayed exactly: the target continues each prompt
    greedily for ``n`` tokens, the draft is run teacher-forced on the result, and the run of
    matching argmaxes decides how many of ``k`` proposals each verification would accept.
    Returns the agreement on the target's own output and the mean tokens per verification."""
    matches, per_step = [], []
    for prompt in prompts:
        cont = greedy_continue(target, prompt, n)
        seq = mx.concatenate([prompt, mx.array(cont, dtype=prompt.dtype)])[None]
        guess = draft(seq[:, :-1])[0, prompt.shape[0] - 1 :].argmax(-1).tolist()
        ok = [g == c for g, c in zip(guess, cont, strict=True)]
        matches.extend(ok)
        i = 0
        while i < len(ok):
            run = 0
            while run < k and i + run < len(ok) and ok[i + run]:
                run += 1
            per_step.append(run + 1)  # accepted proposals plus the target's own token
            i += run + 1
    return {"agreement": float(np.mean(matches)), "tokens_per_step": float(np.mean(per_step))}


# ----------------------------------------------------------------------------- saving


def save_tokenizer(tok: Tokenizer, path: Path, context: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to ``path``."""
    tok.save(str(path / "tokenizer.json"))
    write_json(path / "tokenizer_config.json", tokenizer_config(context))
    write_json(
        path / "special_tokens_map.json",
        {
            "bos_token": EOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "additional_special_tokens": [SYSTEM, USER, ASSISTANT],
        },
    )


def save_model(model: Model, shape: dict, tok: Tokenizer, path: Path, s: Settings) -> None:
    """Write ``model`` to ``path`` in the HF layout: config.json, model.safetensors (fp32,
    mlx-lm parameter names), generation_config.json and the tokenizer files."""
    path.mkdir(parents=True, exist_ok=True)
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_json(path / "config.json", hf_config(shape, s, eos, pad))
    write_json(
        path / "generation_config.json",
        {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": pad},
    )
    save_tokenizer(tok, path, s.context)


def write_json(path: Path, obj: dict) -> None:
    """Write ``obj`` as indented JSON with a trailing newline (stable diffs)."""
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- verification


def verify_dir(path: Path, trained: Model, probe: mx.array) -> tuple[Model, object]:
    """Load ``path`` with mlx_lm.load (offline) and check it reproduces ``trained``'s logits on
    ``probe``, that the tokenizer round-trips odd UTF-8 and that the chat template renders.
    Returns the loaded (model, tokenizer); raises AssertionError on any mismatch."""
    import mlx_lm

    model, tokenizer = mlx_lm.load(str(path))
    diff = mx.abs(model(probe) - trained(probe)).max().item()
    assert diff < 1e-4, f"{path}: reloaded logits differ by {diff}"
    text = "héllo 世界 🎉\n\tdef f(x):"
    assert tokenizer.decode(tokenizer.encode(text)) == text, "tokenizer does not round-trip"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a function"}], add_generation_prompt=True
    )
    rendered = tokenizer.decode(chat)
    assert rendered == "<|user|>\nWrite a function\n<|assistant|>\n", repr(rendered)
    log(f"verified {path}: max logit diff {diff:.2e}, round-trip ok, chat template ok")
    return model, tokenizer


def sample_text(model: Model, tokenizer, prompt: str, n: int, draft: Model | None = None):
    """Greedy-generate ``n`` tokens after ``prompt`` with mlx_lm.stream_generate; with a
    ``draft`` it runs speculative decoding. Returns (text, share of tokens from the draft)."""
    import mlx_lm

    pieces, from_draft, count = [], 0, 0
    kwargs = {} if draft is None else {"draft_model": draft, "num_draft_tokens": 4}
    for resp in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n, **kwargs):
        pieces.append(resp.text)
        count += 1
        from_draft += int(getattr(resp, "from_draft", False))
    return "".join(pieces), from_draft / max(count, 1)


# ----------------------------------------------------------------------------- report


def write_readme(path: Path, r: dict, s: Settings) -> None:
    """Write ``path``/README.md recording how the pair was made and what was measured."""
    k = s.spec_k
    lines = [
        "# Demo draft/target pair",
        "",
        "Tiny llama models bundled so the engine, tests and examples have a real, offline",
        "speculative-decoding pair. They write Python-*looking* text, not useful code.",
        f"Produced by `scripts/train_demo_pair.py` ({r['command']}), {r['platform']}, "
        f"{r['minutes']:.1f} minutes in all (the stage table below gives the CPU load "
        "at the end of each stage; above the CPU count means other jobs slowed this one).",
        "",
        "| | target | draft |",
        "|---|---|---|",
        f"| layers / hidden / heads / MLP | {fmt_shape(TARGET_SHAPE)} | {fmt_shape(DRAFT_SHAPE)} |",
        f"| parameters | {r['target_params']:,} | {r['draft_params']:,} |",
        f"| training | {s.target_steps} steps cross-entropy | {s.draft_ce_steps} steps "
        f"cross-entropy, then {s.draft_steps} steps distillation |",
        f"| held-out cross-entropy (nats/token) | {r['after']['target_ce']:.3f} | "
        f"{r['before']['draft_ce']:.3f} before, {r['after']['draft_ce']:.3f} after distillation |",
        "",
        "Both use fp32 weights (`model.safetensors`), `max_position_embeddings` "
        f"{s.context}, rope_theta 10000, tied embeddings, and the same tokenizer files. "
        f"Training windows were {s.seq_len} tokens, then {2 * s.seq_len} for the last "
        f"{s.long_frac:.0%} of each run, so text beyond {2 * s.seq_len} tokens is untested.",
        "",
        "## Data and tokenizer",
        "",
        f"- Corpus: {r['n_files']} `.py` files of the Python {platform.python_version()} "
        f"standard library (sorted paths, no tests/GUI/site-packages, capped at "
        f"{s.max_corpus_mb} MB), PSF licence. Every {s.holdout_every}th file "
        f"({r['n_heldout']} files, {r['heldout_tokens']:,} tokens) is held out for evaluation.",
        f"- Training stream: {r['train_tokens']:,} tokens, including {r['n_chat']} chat-formatted "
        '"Write a function named ..." examples cut from the training files.',
        f"- Tokenizer: byte-level BPE (`tokenizers`), {s.vocab_size} entries. Special tokens: "
        + ", ".join(f"`{t}` = {i}" for i, t in enumerate(SPECIAL_TOKENS))
        + ". `<|endoftext|>` is bos, eos and the document separator; `<|pad|>` is padding.",
        "- Chat template: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`.",
        "",
        "## Training",
        "",
        f"AdamW (betas {s.betas}, weight decay 0.01), batch {s.batch} x {s.seq_len} tokens "
        f"(then {s.batch // 2} x {2 * s.seq_len}), linear warm-up then "
        f"cosine decay, gradient clipping 1.0, seed {s.seed}. Target: lr {s.target_lr}. Draft: "
        f"lr {s.draft_lr} for the cross-entropy phase, then lr {s.kd_lr} for distillation with "
        f"loss KL(target || draft) + {s.kd_ce_weight} x cross-entropy (the KL is computed as "
        "the cross-entropy against the target's softmax, which differs by a constant).",
        "",
        "| stage | seconds | 1-min load average at the end |",
        "|---|---|---|",
        *[f"| {name} | {sec:.0f} | {load:.1f} |" for name, (sec, load) in r["timings"].items()],
        "",
        "## Draft/target agreement",
        "",
        "Share of positions where the draft's greedy token equals the target's:",
        "",
        "| | before distillation | after distillation |",
        "|---|---|---|",
        f"| held-out stdlib text, teacher-forced ({r['heldout_positions']:,} positions) | "
        f"{r['before']['agreement']:.3f} | {r['after']['agreement']:.3f} |",
        f"| the target's own greedy output ({r['spec_positions']:,} positions) | "
        f"{r['spec_before']['agreement']:.3f} | {r['spec_after']['agreement']:.3f} |",
        "",
        f"Expected tokens per target verification with {k} draft tokens, if matches were "
        f"independent at the held-out rate a: (1 - a^{k + 1}) / (1 - a) = "
        f"{expected_accept_len(r['after']['agreement'], k):.2f}. Replaying greedy speculative "
        "decoding exactly on the target's own output gives "
        f"{r['spec_after']['tokens_per_step']:.2f} tokens per verification (of at most {k + 1}; "
        f"{r['spec_before']['tokens_per_step']:.2f} before distillation). "
        f"mlx_lm.stream_generate with the draft (4 draft tokens) took "
        f"{r['mlx_from_draft']:.0%} of a {r['sample_tokens']}-token sample from the draft.",
        "",
        "## Sample (target, greedy, prompt `def fibonacci(n):`)",
        "",
        "```python",
        "def fibonacci(n):" + r["sample"],
        "```",
        "",
    ]
    (path / "README.md").write_text("\n".join(lines), encoding="utf-8")


def fmt_stats(held: dict, spec: dict) -> str:
    """One log line from heldout_stats and simulate_speculation results."""
    return (
        f"held-out agreement {held['agreement']:.3f}, CE target {held['target_ce']:.3f} "
        f"draft {held['draft_ce']:.3f}; on target output agreement {spec['agreement']:.3f}, "
        f"{spec['tokens_per_step']:.2f} tokens/verification"
    )


def fmt_shape(shape: dict) -> str:
    """'4 / 256 / 8 / 704' for a model shape dict."""
    return (
        f"{shape['num_hidden_layers']} / {shape['hidden_size']} / "
        f"{shape['num_attention_heads']} / {shape['intermediate_size']}"
    )


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> Settings:
    """Command-line options -> Settings."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("engine/demo"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target-steps", type=int, default=Settings.target_steps)
    p.add_argument("--draft-ce-steps", type=int, default=Settings.draft_ce_steps)
    p.add_argument(
        "--draft-steps", type=int, default=Settings.draft_steps, help="distillation steps"
    )
    p.add_argument("--max-corpus-mb", type=float, default=Settings.max_corpus_mb)
    a = p.parse_args(argv)
    return Settings(
        out=a.out,
        seed=a.seed,
        target_steps=a.target_steps,
        draft_ce_steps=a.draft_ce_steps,
        draft_steps=a.draft_steps,
        max_corpus_mb=a.max_corpus_mb,
    )


def main(argv: list[str] | None = None) -> None:
    """Build the corpus and tokenizer, train target then draft, save, verify, report."""
    s = parse_args(argv)
    np.random.seed(s.seed)
    r: dict = {
        "timings": {},
        "command": "`python " + " ".join(sys.argv) + "`",
        "platform": f"{platform.machine()} {os.cpu_count()} CPUs, MLX {mx.__version__}",
    }
    mark = time.monotonic()

    def lap(name: str) -> None:
        nonlocal mark
        # The 1-minute load average says whether other jobs were sharing the CPUs meanwhile.
        r["timings"][name] = (time.monotonic() - mark, os.getloadavg()[0])
        mark = time.monotonic()

    files = select_files(int(s.max_corpus_mb * 1e6))
    train_files, held_files = split_files(files, s.holdout_every)
    train_texts, held_texts = read_texts(train_files), read_texts(held_files)
    chats = chat_examples(train_texts, limit=2000)
    r.update(n_files=len(files), n_heldout=len(held_files), n_chat=len(chats))
    log(
        f"corpus: {len(train_files)} train files, {len(held_files)} held out, "
        f"{len(chats)} chat examples"
    )
    tok = train_tokenizer(train_texts + chats, s.vocab_size)
    assert tok.get_vocab_size() == s.vocab_size, tok.get_vocab_size()
    train_stream = encode_stream(tok, train_texts + chats)
    held_stream = encode_stream(tok, held_texts)
    r.update(train_tokens=len(train_stream), heldout_tokens=len(held_stream))
    log(
        f"tokenizer: {tok.get_vocab_size()} entries; {len(train_stream):,} train tokens, "
        f"{len(held_stream):,} held-out tokens"
    )
    lap("corpus + tokenizer")

    target = make_model(TARGET_SHAPE, s, s.seed)
    draft = make_model(DRAFT_SHAPE, s, s.seed + 1)
    r.update(target_params=n_params(target), draft_params=n_params(draft))
    log(f"target {r['target_params']:,} params, draft {r['draft_params']:,} params")
    train(target, train_stream, s.target_steps, s.target_lr, s, s.seed + 10, "target")
    lap("target training")

    windows = eval_windows(held_stream, s.eval_windows, 2 * s.seq_len)
    r["heldout_positions"] = windows.shape[0] * 2 * s.seq_len
    prompts = windows[:4, :32]  # 4 held-out prompts of 32 tokens for the speculation replay
    r["spec_positions"] = prompts.shape[0] * 96

    train(draft, train_stream, s.draft_ce_steps, s.draft_lr, s, s.seed + 20, "draft-ce")
    lap("draft cross-entropy training")
    r["before"] = heldout_stats(target, draft, windows)
    r["spec_before"] = simulate_speculation(target, draft, prompts, 96, s.spec_k)
    log(f"before distillation: {fmt_stats(r['before'], r['spec_before'])}")
    lap("evaluation before distillation")
    train(draft, train_stream, s.draft_steps, s.kd_lr, s, s.seed + 30, "draft-kd", teacher=target)
    lap("draft distillation")
    r["after"] = heldout_stats(target, draft, windows)
    r["spec_after"] = simulate_speculation(target, draft, prompts, 96, s.spec_k)
    log(f"after distillation: {fmt_stats(r['after'], r['spec_after'])}")

    if s.out.exists():
        for sub in ("target", "draft"):
            shutil.rmtree(s.out / sub, ignore_errors=True)
    save_model(target, TARGET_SHAPE, tok, s.out / "target", s)
    save_model(draft, DRAFT_SHAPE, tok, s.out / "draft", s)
    probe = windows[:2, :-1]
    t_model, t_tok = verify_dir(s.out / "target", target, probe)
    d_model, _ = verify_dir(s.out / "draft", draft, probe)
    r["sample_tokens"] = 60
    r["sample"], _ = sample_text(t_model, t_tok, "def fibonacci(n):", 60)
    _, r["mlx_from_draft"] = sample_text(t_model, t_tok, "def fibonacci(n):", 60, d_model)
    log("sample:\ndef fibonacci(n):" + r["sample"])
    lap("evaluation after distillation, saving, verification")
    r["minutes"] = (time.monotonic() - START) / 60
    write_readme(s.out, r, s)
    log(f"wrote {s.out}/README.md; done in {r['minutes']:.1f} min")


if __name__ == "__main__":
    main()
