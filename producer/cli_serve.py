"""`shardflow serve`: the OpenAI-compatible HTTP API (producer/api.py) in front of the queue, run by uvicorn.

    shardflow serve --host 0.0.0.0 --port 8000 --api-keys /etc/shardflow/api-keys   # one key a line
    SHARDFLOW_API_KEYS=key1,key2 shardflow serve
    shardflow serve --no-auth                                                        # loopback only
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from producer.options import EXIT_BAD_INPUT, connection_options, fail, run_guarded


def read_keys(path: str | None) -> frozenset[str]:
    """API keys from a file (one a line, # comments) and SHARDFLOW_API_KEYS (comma-separated)."""
    keys = {k.strip() for k in os.environ.get("SHARDFLOW_API_KEYS", "").split(",") if k.strip()}
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            fail(f"cannot read {path}: {e.strerror or e}", EXIT_BAD_INPUT)
        keys |= {ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")}
    return frozenset(keys)


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port.")
@click.option(
    "--api-keys",
    "keys_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="File of Bearer API keys, one a line (also SHARDFLOW_API_KEYS=key1,key2).",
)
@click.option("--no-auth", is_flag=True, help="Serve without API keys (only on a loopback address).")
@connection_options
def serve(host: str, port: int, keys_file: str | None, no_auth: bool, queue: str, redis_url: str, prefix: str) -> None:
    """Serve OpenAI's chat completions, completions (streamed or not), models, files and batches over the
    queue: every request becomes a job for the head workers; Ctrl-C stops."""
    import uvicorn

    from producer.api import Api
    from producer.api_common import ApiConfig, loopback
    from producer.client import Client
    from relay_broker.connection import connect
    from schemas.settings import Settings

    keys = read_keys(keys_file)
    if no_auth and not loopback(host):
        fail(f"--no-auth serves only a loopback address, not {host}", EXIT_BAD_INPUT)
    if not keys and not no_auth:
        fail("no API keys: give --api-keys FILE or SHARDFLOW_API_KEYS, or --no-auth on loopback", EXIT_BAD_INPUT)
    settings = Settings(redis_url=redis_url, prefix=prefix, queue=queue)
    r = run_guarded(lambda: connect(redis_url, settings=settings, max_connections=settings.api_max_concurrent + 16))
    client = Client(r, prefix=prefix, queue=queue, settings=settings)
    config = ApiConfig(
        keys=None if no_auth else keys,
        max_body_bytes=settings.api_max_body_bytes,
        max_concurrent=settings.api_max_concurrent,
        timeout_s=settings.api_timeout_s,
    )
    click.echo(f"serving the OpenAI API for queue {queue} on http://{host}:{port}/v1", err=True)
    uvicorn.run(Api(client, config).app(), host=host, port=port, log_level="warning")
