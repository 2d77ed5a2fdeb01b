"""Tiny llama models built on the fly, so engine tests need no download."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import llama

import engine  # noqa: F401  (loads the fast BLAS before mlx)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>"]


def build_tokenizer(out: Path, vocab_size: int = 320, pad_to: int | None = None) -> None:
    """Train a byte-level BPE on a few lines and save tokenizer.json + config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n",
        "The quick brown fox jumps over the lazy dog. " * 3,
        "import os\nimport sys\nfor i in range(10):\n    print(i, sys.argv)\n",
    ] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 512,
            }
        )
    )


def build_llama(
    out: Path,
    *,
    vocab_size: int,
    hidden: int = 32,
    layers: int = 2,
    heads: int = 2,
    seed: int = 0,
    scale: float = 1.0,
    context: int = 512,
    tokenizer_from: Path | None = None,
    eos_token_id: int = 0,
) -> Path:
    """Save a random fp32 llama in the standard layout; weights scaled by `scale`."""
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": hidden * 2,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": context,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float32",
    }
    mx.random.seed(seed)
    args = llama.ModelArgs.from_dict(config)
    model = llama.Model(args)
    model.update(tree_map(lambda w: w * scale, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config))
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (out / name).write_bytes((tokenizer_from / name).read_bytes())
    return out


def reference_greedy(pair, ids: list[int], max_tokens: int) -> list[int]:
    """Target-only greedy tokens from mlx-lm's own stream_generate (EOS excluded)."""
    from mlx_lm import stream_generate

    out = []
    for resp in stream_generate(pair.target, pair.tokenizer, mx.array(ids), max_tokens=max_tokens):
        if resp.finish_reason is None:
            out.append(resp.token)
        elif resp.finish_reason == "length":
            out.append(resp.token)
    return out


def tiny_pair(
    tmp: Path, *, target_scale: float = 3.0, draft_scale: float = 3.0, draft_seed: int = 2
):
    """A random target/draft pair sharing a small byte-level BPE tokenizer."""

    build_tokenizer(tmp / "tok")
    vocab = len(json.loads((tmp / "tok" / "tokenizer.json").read_text())["model"]["vocab"])
    build_llama(
        tmp / "target",
        vocab_size=vocab,
        hidden=64,
        layers=2,
        seed=1,
        scale=target_scale,
        tokenizer_from=tmp / "tok",
    )
    build_llama(
        tmp / "draft",
        vocab_size=vocab,
        hidden=32,
        layers=1,
        seed=draft_seed,
        scale=draft_scale,
        tokenizer_from=tmp / "tok",
    )
    return engine.load_pair(tmp / "target", tmp / "draft")
