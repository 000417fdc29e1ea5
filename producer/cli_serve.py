"""`shardflow serve`: the OpenAI-compatible HTTP API (producer/api.py) in front of the queue, run by uvicorn.

    shardflow serve --host 0.0.0.0 --port 8000 --api-keys /etc/shardflow/api-keys   # one key a line
    SHARDFLOW_API_KEYS=key1,key2 shardflow serve --served-model-name qwen-7b
    shardflow serve --api-keys keys --admin-keys admin-keys                           # admins see all batches
    shardflow serve --no-auth                                                        # loopback only

The URL is printed once the port is bound (a port that is taken exits 4 with one line and no URL); SIGTERM
or Ctrl-C stops it (requests in flight get api.shutdown_s to finish) and it exits 0.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import click

from producer.options import EXIT_BAD_INPUT, EXIT_UNREACHABLE, CliConfig, connection_options, fail
from schemas.settings import Settings


def read_keys(path: str | None, env: str = "SHARDFLOW_API_KEYS") -> frozenset[str]:
    """API keys from a file (one a line, # comments) and an environment variable (comma-separated)."""
    keys = {k.strip() for k in os.environ.get(env, "").split(",") if k.strip()}
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            fail(f"cannot read {path}: {e.strerror or e}", EXIT_BAD_INPUT)
        keys |= {ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")}
    return frozenset(keys)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; a port that is taken (or an address this machine lacks) is one line
    and exit 4."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, address = infos[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        fail(f"cannot listen on {host}:{port}: {e.strerror or e}", EXIT_UNREACHABLE)
    sock.listen(2048)
    return sock


def url_of(sock: socket.socket, host: str) -> str:
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/v1"


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="TCP port (0: any).")
@click.option(
    "--api-keys",
    "keys_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="File of Bearer API keys, one a line (also SHARDFLOW_API_KEYS=key1,key2). Each key sees only the batches "
    "and files it made.",
)
@click.option(
    "--admin-keys",
    "admin_file",
    type=click.Path(dir_okay=False),
    default=None,
    help="File of admin API keys, one a line (also SHARDFLOW_API_ADMIN_KEYS): valid keys that see every batch and "
    "file, CLI batches included.",
)
@click.option(
    "--shared-batches/--own-batches",
    default=None,
    help="Every key sees every batch and file, CLI batches included [default: own; env SHARDFLOW_API__SHARED_BATCHES]",
)
@click.option(
    "--served-model-name",
    default=None,
    help="The model name listed and accepted (default: the head's target hub id, or its directory's name) "
    "[env SHARDFLOW_API__MODEL_NAME].",
)
@click.option("--no-auth", is_flag=True, help="Serve without API keys (only on a loopback address).")
@connection_options
def serve(
    host: str,
    port: int,
    keys_file: str | None,
    admin_file: str | None,
    shared_batches: bool | None,
    served_model_name: str | None,
    no_auth: bool,
    config: CliConfig,
) -> None:
    """Serve OpenAI's chat completions, completions (streamed or not), models, files and batches over the
    queue: every request becomes a job for the head workers. Stop sequences are left out of the text returned
    (OpenAI's rule; the job's own result keeps them). SIGTERM or Ctrl-C stops it."""
    from producer.api import Api
    from producer.api_common import ApiConfig, loopback
    from producer.client import Client

    admins = read_keys(admin_file, "SHARDFLOW_API_ADMIN_KEYS")
    keys = read_keys(keys_file) | admins
    if no_auth and not loopback(host):
        fail(f"--no-auth serves only a loopback address, not {host}", EXIT_BAD_INPUT)
    if not keys and not no_auth:
        fail("no API keys: give --api-keys FILE or SHARDFLOW_API_KEYS, or --no-auth on loopback", EXIT_BAD_INPUT)
    config = config.with_flags(api={"shared_batches": shared_batches, "model_name": served_model_name})
    settings = config.settings
    r = config.connect(max_connections=settings.api.max_concurrent + 16)
    client = Client(r, settings=settings)
    api_config = ApiConfig(
        keys=None if no_auth else keys,
        max_body_bytes=settings.api.max_body_bytes,
        max_concurrent=settings.api.max_concurrent,
        timeout_s=settings.api.timeout_s,
        body_timeout_s=settings.api.body_timeout_s,
        max_json_depth=settings.api.max_json_depth,
        admin_keys=admins,
        shared_batches=settings.api.shared_batches,
        served_name=settings.api.model_name,
    )
    sock = bind(host, port)
    ready = f"serving the OpenAI API for queue {config.queue} on {url_of(sock, host)}"
    run(Api(client, api_config).app(), sock, ready, settings)


def run(app: object, sock: socket.socket, ready: str, settings: Settings) -> None:
    """uvicorn on a bound socket; `ready` printed once it serves; a stop signal ends it with exit 0."""
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, except that a stop signal it handled is not raised again once it has stopped
        (uvicorn does that, and the process would die of the signal instead of exiting 0)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                yield
                self._captured_signals.clear()

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                click.echo(ready, err=True)

    cfg = uvicorn.Config(
        app,  # type: ignore[arg-type]
        log_level="warning",
        timeout_graceful_shutdown=int(settings.api.shutdown_s),
    )
    Server(cfg).run(sockets=[sock])
