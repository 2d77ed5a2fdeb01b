"""`spec-generate`: one prompt through the engine, text then one line of statistics."""

from __future__ import annotations

import sys

import click

from contract.defaults import ENGINE, JOB_FILE
from contract.limits import DRAFTERS, MAX_DRAFT_TOKENS


def _draft_tokens(value: str) -> int | str:
    if value == "auto":
        return "auto"
    try:
        return int(value)
    except ValueError:
        raise click.BadParameter(
            f"must be 'auto' or an integer 1..{MAX_DRAFT_TOKENS}, got {value!r}"
        ) from None


@click.command()
@click.argument("prompt")
@click.option("--target", default=None, help="Target model directory or hub id (default: demo).")
@click.option("--draft", default=None, help="Draft model directory or hub id (default: demo's).")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--temperature",
    default=ENGINE.temperature,
    show_default=True,
    type=click.FloatRange(min=0),
    help=f"0 is greedy, this command's default; a job-file line's default is "
    f"{JOB_FILE.temperature}, as in the OpenAI API.",
)
@click.option("--top-p", default=ENGINE.top_p, show_default=True, type=float)
@click.option("--top-k", default=ENGINE.top_k, show_default=True, type=click.IntRange(min=0))
@click.option("--seed", default=None, type=int, help="Same seed, same output.")
@click.option(
    "--num-draft-tokens",
    default=ENGINE.num_draft_tokens,
    show_default=True,
    help=f"1..{MAX_DRAFT_TOKENS} or auto.",
)
@click.option("--drafter", default=ENGINE.drafter, show_default=True, type=click.Choice(DRAFTERS))
@click.option("--chat", is_flag=True, help="Send the prompt as a user chat message.")
def main(
    prompt,
    target,
    draft,
    max_tokens,
    temperature,
    top_p,
    top_k,
    seed,
    num_draft_tokens,
    drafter,
    chat,
):
    """Generate text for PROMPT and print it, then tokens/s and acceptance statistics."""
    import engine

    k = _draft_tokens(num_draft_tokens)
    try:
        pair = engine.load_pair(target, draft, use_draft=drafter == "model" or draft is not None)
        request = engine.GenerationRequest(
            prompt=None if chat else prompt,
            messages=[{"role": "user", "content": prompt}] if chat else None,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            num_draft_tokens=k,
            drafter=drafter,
        )
        for item in engine.stream(pair, request):
            sys.stdout.write(item.text)
            sys.stdout.flush()
            result = item.result
    except engine.EngineError as exc:
        raise click.ClickException(str(exc)) from exc
    s = result.metrics["speculative_decoding"]
    click.echo()
    click.echo(
        f"[{result.usage['completion_tokens']} tokens, "
        f"{result.metrics['tokens_per_second']:.1f} tokens/s, drafter {s['drafter']}, "
        f"acceptance rate {s['draft_acceptance_rate']:.2f}, "
        f"mean acceptance length {s['mean_acceptance_length']:.2f}, "
        f"finish {result.finish_reason}]",
        err=True,
    )
