"""Draft with the same tiny heads through specfleet and through mlx-vlm 0.7.10, step by step.

mlx-vlm's `speculative/drafters/` (qwen3_5_mtp, eagle3) is the MLX reference for these
layouts. It needs transformers >= 5.14, datasets and more that this project does not depend
on, so this script is not a test: it imports mlx-vlm from an unpacked wheel with those
packages replaced by inert stand-ins (the drafters never call them), builds a tiny 6-token
target with a random head of each kind in its published layout, runs greedy decoding with
mlx-vlm's drafter API (prefill, draft_block, accept_verified_tokens) and with specfleet's
decoder, and prints how many steps drafted the same tokens.

    pip download mlx-vlm==0.7.10 --no-deps -d /tmp/mlxvlm && (cd /tmp/mlxvlm && unzip -q *.whl)
    .venv/bin/python scripts/compare_mlx_vlm_heads.py /tmp/mlxvlm

specfleet's first step drafts the first generated token, which mlx-vlm's prefill emits
undrafted, so steps are matched by the output position their drafts start at.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STUBBED = ("requests", "transformers", "datasets", "miniaudio", "PIL", "llguidance", "tqdm")
STUBBED += ("sentencepiece", "jinja2", "huggingface_hub", "soundfile", "cv2")


class _Inert(type):
    # Any attribute of a stubbed package is a class whose attributes are classes again.
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (), {"__init__": lambda self, *a, **k: None})

    def __getitem__(cls, key):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert(name, (), {"__init__": lambda self, *a, **k: None})


class _StubFinder:
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Stub(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


def _greedy(x):
    import mlx.core as mx

    return mx.argmax(x, -1)


def reference_drafts(drafter, target, capture, prompt, steps, k):
    """{output position: mlx-vlm's drafts from there}, each block verified against the target
    from scratch."""
    import mlx.core as mx

    drafter.reset(target)
    with capture(target) as cap:
        logits = target(mx.array([prompt]))
        hidden = cap.features
    bonus = int(mx.argmax(logits[0, -1]).item())
    drafter.prefill_from_target_hidden(mx.array([prompt]), hidden, bonus, _greedy, greedy=True)
    text, seen = [*prompt, bonus], {}
    for _ in range(steps):
        block = drafter.draft_block(bonus, hidden[:, -1:], None, k + 1, _greedy, greedy=True)
        drafts = block[0].tolist()
        seen[len(text) - len(prompt)] = drafts
        with capture(target) as cap:
            logits = target(mx.array([text + drafts]))
            verify_hidden = cap.features[:, len(text) - 1 :]
        best = mx.argmax(logits[0, len(text) - 1 :], -1).tolist()
        n = next((i for i, d in enumerate(drafts) if d != best[i]), k)
        emitted = drafts[:n] + [best[n]]
        drafter.accept_verified_tokens(verify_hidden, block, n, emitted, _greedy, greedy=True)
        text += emitted
        bonus = best[n]
    return seen


def our_drafts(pair, prompt, steps, k):
    from engine.batch import SpeculativeDecoder
    from engine.heads import HeadProposer
    from engine.sampling import SamplingParams

    """{output position: specfleet's drafts from there}."""
    seen, original = {}, HeadProposer.propose

    def record(self, want, positions, last=None):
        drafts, laws = original(self, want, positions, last)
        seen[positions[0]] = drafts.get(0)
        return drafts, laws

    HeadProposer.propose = record
    try:
        dec = SpeculativeDecoder(
            pair, prompt, SamplingParams(0.0), num_draft_tokens=k, max_tokens=10_000
        )
        for _ in range(steps + 1):
            dec.step()
    finally:
        HeadProposer.propose = original
    return seen


def _pair(t_model, target_dir, drafter, name):
    from engine.loading import ModelPair

    pair = ModelPair(t_model, None, None, str(target_dir), name, 512, 6, 6, name)
    pair.dflash = drafter
    return pair


def mtp_case(tmp: Path):
    import mlx.core as mx
    import mlx_lm
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.config import Qwen3_5MTPConfig
    from mlx_vlm.speculative.drafters.qwen3_5_mtp.qwen3_5_mtp import Qwen3_5MTPDraftModel
    from tiny_families import build_model, tokenizer_dir
    from tiny_heads import add_mtp_head, to_hf_layout

    from engine import mtp

    tok, _ = tokenizer_dir(tmp)
    target = build_model(
        tmp / "q", "qwen3_5", vocab_size=6, tokenizer_from=tok, hidden=16, seed=11, scale=2.0,
        layers=2,
    )  # fmt: skip
    add_mtp_head(target, seed=23, scale=1.0)
    hf = to_hf_layout(target, tmp / "q_hf")  # mlx-vlm reads mtp.* norms as Hugging Face's
    t_model, config = mlx_lm.utils.load_model(target)
    ours = mtp.load_mtp(str(target), t_model, config)
    text = {**config, "model_type": "qwen3_5_text"}
    text["rope_parameters"] = {**config["rope_parameters"], "mrope_section": [4, 2, 2]}
    ref = Qwen3_5MTPDraftModel(Qwen3_5MTPConfig.from_dict({"text_config": text}))
    weights = {k: v for k, v in mx.load(str(hf / "model.safetensors")).items() if "mtp." in k}
    ref.load_weights(list(ref.sanitize(weights).items()), strict=True)
    return _pair(t_model, target, ours, "mtp"), ref, t_model, ours.capture


def eagle3_case(tmp: Path):
    import json

    import mlx.core as mx
    import mlx_lm
    from mlx_vlm.speculative.drafters.eagle3.config import Eagle3Config
    from mlx_vlm.speculative.drafters.eagle3.eagle3 import Eagle3DraftModel
    from tiny_heads import build_eagle3
    from tiny_models import build_llama

    from engine.eagle3 import load_eagle3

    target = build_llama(tmp / "l", vocab_size=6, hidden=16, layers=1, seed=11, scale=6.0)
    head = build_eagle3(tmp / "e", target, aux_ids=[1, 1, 1], draft_vocab=[0, 2, 3, 5], seed=32)
    t_model, config = mlx_lm.utils.load_model(target)
    ours = load_eagle3(head, t_model, config)
    flat = json.loads((head / "config.json").read_text())
    ref = Eagle3DraftModel(
        Eagle3Config.from_dict(
            {
                "transformer_layer_config": flat,
                "draft_vocab_size": flat["draft_vocab_size"],
                "eagle_aux_hidden_state_layer_ids": [1, 1, 1],
            }
        )
    )
    weights = {
        k.replace("midlayer.", "layers.0."): v
        for k, v in mx.load(str(head / "model.safetensors")).items()
    }
    weights["embed_tokens.weight"] = t_model.model.embed_tokens.weight
    ref.load_weights(list(ref.sanitize(weights).items()), strict=True)
    return _pair(t_model, target, ours, str(head)), ref, t_model, ours.capture


def _reread(ref) -> None:
    accept = type(ref).accept_verified_tokens

    def reread(self, *args, **kwargs):
        for cache in self._cache:
            cache.trim(self._round_appended)
        self._next_position -= self._round_appended
        self._round_appended = 0
        return accept(self, *args, **kwargs)

    ref.accept_verified_tokens = types.MethodType(reread, ref)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mlx_vlm_dir", help="directory holding the unpacked mlx_vlm package")
    parser.add_argument("--steps", type=int, default=11)
    parser.add_argument(
        "--mtp-reread",
        action="store_true",
        help="make mlx-vlm's MTP head drop its chained cache entries after a verify pass and "
        "read the accepted tokens again with the target's hidden states, as specfleet does "
        "(mlx-vlm keeps the entries of accepted drafts built from the head's own output)",
    )
    args = parser.parse_args()
    sys.meta_path.insert(0, _StubFinder())
    sys.path[:0] = [args.mlx_vlm_dir, str(ROOT), str(ROOT / "tests")]
    prompts = ([1, 4, 2, 2, 5, 3, 0, 1], [3, 3, 1, 0, 2])
    with tempfile.TemporaryDirectory() as tmp:
        for kind, case in (("mtp", mtp_case), ("eagle3", eagle3_case)):
            pair, ref, target, capture = case(Path(tmp))
            if kind == "mtp" and args.mtp_reread:
                _reread(ref)
            for prompt in prompts:
                for k in (1, 2, 3):
                    theirs = reference_drafts(ref, target, capture, prompt, args.steps, k)
                    mine = our_drafts(pair, prompt, args.steps, k)
                    both = sorted(set(theirs) & set(mine))
                    same = sum(theirs[i] == mine[i] for i in both)
                    print(
                        f"{kind} prompt {prompt} K={k}: same drafts at {same} of the {len(both)} "
                        "output positions both drafted from"
                    )


if __name__ == "__main__":
    main()
