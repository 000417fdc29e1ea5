"""An HTTP fuzz test of `shardflow serve`'s routes (hypothesis): random methods, paths, ids, query strings,
keys, content types and bodies (JSON of any shape, near-valid completion bodies with one field gone wrong,
raw bytes, broken multipart) against a real serve process over a queue with no head. Every answer is a 4xx,
a 2xx, or the 503 that names the missing head: never a 500, never a traceback or internal text (addresses,
paths, exception or pydantic names), and every error is in OpenAI's shape."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from schemas.jobs import ModelInfo
from schemas.keys import Keys
from tests.job_env import start_serve

KEY, QUEUE, PREFIX, MODEL = "fuzz-key", "q-fuzz", "p-fuzz", "fuzz-model"
LEAKS = ("Traceback", 'File "', "127.0.0.1", "localhost", "Error 1", "/tmp", "/work", "pydantic", "constrained-")
LEAKS += ("list[", "ValidationError", "RecursionError", "Exception", "redis.")


@pytest.fixture(scope="module")
def fuzzed(redis_server, redis_client, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api-fuzz")
    info = ModelInfo(target=f"/tmp/private/{MODEL}", vocab_size=320, has_chat_template=True, head_layers=[0, 2])
    redis_client.set(Keys(PREFIX).model_info(QUEUE), info.model_dump_json())  # announced, no head alive
    env = SimpleNamespace(opts=["--queue", QUEUE, "--prefix", PREFIX, "--redis-url", redis_server.url])
    proc, base = start_serve(env, tmp / "serve.log", KEY, {"SHARDFLOW_API__MAX_BODY_BYTES": "65536"})  # type: ignore[arg-type]
    with httpx.Client(base_url=base.removesuffix("/v1"), timeout=30) as http:
        line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": MODEL, "prompt": "x"}}
        files = {"file": ("in.jsonl", json.dumps(line).encode() + b"\n")}
        upload = http.post("/v1/files", files=files, data={"purpose": "batch"}, headers=auth(KEY)).json()
        yield SimpleNamespace(http=http, file_id=upload["id"], log=tmp / "serve.log")
    proc.terminate()
    assert proc.wait(20) == 0


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=16,
)
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed"]
FIELDS += ["stop", "n", "stream", "stream_options", "user", "logit_bias", "input_file_id", "endpoint"]
BASES = [
    {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    {"input_file_id": "file-x", "endpoint": "/v1/completions", "completion_window": "24h"},
]


@st.composite
def near_valid(draw) -> object:
    """A valid-looking body with one field set to anything (or dropped), sometimes streamed."""
    body = dict(draw(st.sampled_from(BASES)))
    field = draw(st.sampled_from(FIELDS))
    if draw(st.booleans()):
        body[field] = draw(json_values)
    else:
        body.pop(field, None)
    if draw(st.booleans()):
        body["stream"] = True
    return body


ids = st.text(alphabet="abcdef0123456789-_.%~", max_size=24) | st.sampled_from(["file-out-", "file-err-", "batch_"])
routes = st.sampled_from(
    [
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/v1/models/{id}"),
        ("POST", "/v1/files"),
        ("GET", "/v1/files/{id}"),
        ("GET", "/v1/files/{id}/content"),
        ("POST", "/v1/batches"),
        ("GET", "/v1/batches"),
        ("GET", "/v1/batches/{id}"),
        ("POST", "/v1/batches/{id}/cancel"),
        ("PUT", "/v1/{id}"),
        ("DELETE", "/v1/batches/{id}"),
        ("GET", "/{id}"),
    ]
)
keys = st.sampled_from([KEY, KEY, KEY, "wrong", None, "caf\xe9"])
content_types = st.sampled_from(["application/json", "text/plain", "multipart/form-data; boundary=zz", ""])


@st.composite
def requests(draw) -> tuple[str, str, dict[str, str | bytes], bytes]:
    method, path = draw(routes)
    path = path.replace("{id}", draw(ids))
    if draw(st.booleans()):
        path += "?limit=" + draw(st.sampled_from(["1", "0", "-1", "x", "1000", "5" * 30]))
    kind = draw(st.sampled_from(["json", "near", "near", "bytes", "multipart"]))
    if kind == "json":
        body = json.dumps(draw(json_values)).encode()
    elif kind == "near":
        body = json.dumps(draw(near_valid())).encode()
    elif kind == "bytes":
        body = draw(st.binary(max_size=64))
    else:
        body = b"--zz\r\nContent-Disposition: form-data; name=" + draw(st.binary(max_size=40)) + b"\r\n\r\nx\r\n--zz--"
    key = draw(keys)
    headers: dict[str, str | bytes] = {} if key is None else {"Authorization": f"Bearer {key}".encode("latin-1")}
    if ct := draw(content_types):
        headers["Content-Type"] = ct
    return method, path, headers, body


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(req=requests())
def test_no_input_gets_a_500_or_internal_text(fuzzed, req):
    method, path, headers, body = req
    body = body.replace(b'"file-x"', json.dumps(fuzzed.file_id).encode())  # batches from a real input file
    r = fuzzed.http.request(method, path, headers=headers, content=body)
    event(f"{method} {r.status_code}")  # --hypothesis-show-statistics: what the examples reached
    text = r.text
    assert r.status_code < 500 or (r.status_code == 503 and "no head worker" in text), (r.status_code, text)
    assert not any(leak in text for leak in LEAKS), text
    if r.status_code >= 400:
        error = r.json()["error"]  # OpenAI's shape
        assert isinstance(error["message"], str) and error["type"]


def test_the_fuzzed_server_logged_no_traceback(fuzzed):
    text = fuzzed.log.read_text()
    assert "Traceback" not in text and "unexpected error" not in text, text[-2000:]
