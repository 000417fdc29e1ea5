"""A TLS-only redis-server loaded with the shipped ACL file (deploy/users.acl.template rendered with
random test passwords), with a CA, server and client certificates made by the openssl CLI at test
time: the `pki` and `secured` fixtures and helpers of tests/test_security.py."""

from __future__ import annotations

import importlib.util
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis, TLSFiles, tls_redis_server

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("render_acl", ROOT / "deploy" / "render_acl.py")
assert _spec is not None and _spec.loader is not None
render_acl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_acl)

ROLES = ("admin", "producer", "head", "tail")
PREFIX, QUEUE, SPLIT, N_LAYERS = "shardflow", "secq", 2, 4
CALLBACK_MARKER = "SHARDFLOW_TEST_CALLBACK_MARKER"


# --- certificates, made with the openssl CLI (nothing committed) -----------------------------------
def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


EC_KEY = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"


def _ca(d: Path, name: str) -> None:
    _openssl(*f"req -x509 {EC_KEY} -keyout {name}.key -out {name}.crt -days 2 -subj /CN={name}".split(), cwd=d)


def _leaf(d: Path, name: str, ca: str, ext: str) -> None:
    """A key and a certificate for `name`, signed by `ca`, with the X.509 extensions `ext`."""
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl(*f"req {EC_KEY} -keyout {name}.key -out {name}.csr -subj /CN={name}".split(), cwd=d)
    sign = f"x509 -req -in {name}.csr -CA {ca}.crt -CAkey {ca}.key -CAcreateserial -out {name}.crt -days 2"
    _openssl(*sign.split(), "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl CLI to make test certificates (scripts/test.sh installs it as root)")
    d = tmp_path_factory.mktemp("pki")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth")
    _leaf(d, "client", "ca", "extendedKeyUsage=clientAuth")
    _leaf(d, "rogue-client", "rogue-ca", "extendedKeyUsage=clientAuth")
    return d


# --- one TLS-only redis-server with the shipped ACL file --------------------------------------------
class Secured:
    """The server, the test passwords, and a URL / client per role."""

    def __init__(self, server: EmbeddedRedis, passwords: dict[str, str], pki: Path) -> None:
        self.server, self.passwords, self.pki = server, passwords, pki

    def url(self, role: str) -> str:
        return self.server.url_for(role, self.passwords[role])

    def client(self, role: str, **kwargs) -> redis.Redis:
        return connect(self.url(role), attempts=1, **kwargs)


@pytest.fixture(scope="module")
def secured(pki, tmp_path_factory) -> Iterator[Secured]:
    binary = tls_redis_server()
    if binary is None:
        pytest.skip("no redis-server 7+ built with TLS (apt-get install redis-server; scripts/test.sh does as root)")
    passwords = {role: secrets.token_hex(24) for role in ROLES}
    values = {f"REDIS_{role.upper()}_PASSWORD": pw for role, pw in passwords.items()} | {"SHARDFLOW_PREFIX": PREFIX}
    acl = tmp_path_factory.mktemp("acl") / "users.acl"
    render_acl.write_atomic(acl, render_acl.render(render_acl.TEMPLATE.read_text(), values))
    tls = TLSFiles(pki / "ca.crt", pki / "server.crt", pki / "server.key", pki / "client.crt", pki / "client.key")
    server = EmbeddedRedis(
        binary=binary,
        aclfile=acl,
        tls=tls,
        username="admin",
        password=passwords["admin"],
        extra_args=["--enable-debug-command", "yes"],  # so that only the ACL stands between a role and DEBUG
    )
    with server:
        yield Secured(server, passwords, pki)


def _refused(r: redis.Redis, *args: str) -> str:
    """Send one raw command and return its NOPERM error text (fails if the command is allowed)."""
    conn = r.connection_pool.get_connection()
    try:
        conn.send_command(*args)
        with pytest.raises(redis.exceptions.NoPermissionError) as e:
            conn.read_response()
    finally:
        conn.disconnect()
        r.connection_pool.release(conn)
    return str(e.value)
