"""spec-serve: the OpenAI Batch API over the fleet's Redis (uvicorn). No MLX here."""

from __future__ import annotations

import ipaddress
import logging

import click

from jobstore import config
from jobstore.options import fail, friendly_errors, redis_option


def is_loopback(host: str) -> bool:
    """Whether binding `host` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unusable_key(key: str) -> str | None:
    """Why no client could send `key` in an Authorization header, or None. HTTP clients
    (the openai SDK's httpx among them) send header values as ASCII, so a key with any
    other character could never be matched: refused at start-up instead."""
    for i, c in enumerate(key):
        if not (c.isascii() and c.isprintable()):
            return (
                f"SPEC_API_KEY has the character {c!r} at position {i + 1}: an API key must be "
                "printable ASCII (HTTP clients send only ASCII in headers)"
            )
    return None


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(1, 65535), default=config.SERVE_PORT, show_default=True)
@click.option(
    "--data-dir",
    metavar="DIR",
    help="Where uploaded files are kept [default: $SPEC_SERVE_DATA_DIR, else "
    f"./{config.SERVE_DATA_DIR}].",
)
@redis_option
@click.option(
    "--skip-invalid",
    is_flag=True,
    help="Run the valid lines of a file with bad ones (those become error lines) instead "
    "of failing the batch.",
)
@friendly_errors("spec-serve")
def serve(host, port, data_dir, redis_url, skip_invalid):
    """Serve OpenAI's Files, Batches and Models endpoints for this fleet.

    The API key comes from $SPEC_API_KEY (never from the command line, which other users
    of the machine can read); it is required unless --host is a loopback address.
    """
    import uvicorn

    from server.app import Settings, create_app

    api_key = config.serve_api_key()
    if api_key is not None and (problem := unusable_key(api_key)):
        fail("spec-serve", problem)
    if api_key is None and not is_loopback(host):
        fail("spec-serve", f"--host {host} is reachable from other machines: set SPEC_API_KEY")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    settings = Settings(
        redis_url=redis_url,
        data_dir=config.serve_data_dir(data_dir),
        api_key=api_key,
        skip_invalid=skip_invalid,
        max_upload_bytes=config.serve_max_upload_bytes(),
    )
    app = create_app(settings)
    click.echo(
        f"spec-serve: http://{host}:{port}/v1 (Redis {config.redact(config.redis_url(redis_url))}, "
        f"files in {settings.data_dir}, API key {'required' if api_key else 'not required'})",
        err=True,
    )
    uvicorn.run(app, host=host, port=port, access_log=False, log_level="warning")
