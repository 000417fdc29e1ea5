"""`shardflow serve` through the official `openai` client: a real serve process, real Redis, real tail and head
worker processes and a tiny split model. Greedy output equals HF `generate`, streamed equals not streamed, a
Batch API file goes through files and batches (its output byte-identical on every download), keys are
required, bad bodies are 400 and enqueue nothing, a stream the client drops cancels its job, a stop sequence
is left out of the text (chat, completions, streams, Batch output lines), an unknown model is a 404, and 300
requests at once are answered 200 or 429, never 500."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from click.testing import CliRunner

from producer.cli import main
from tests.conftest import PROMPTS
from tests.job_env import Env, batch_line, reference, start_serve, upload_batch, wait_batch

KEY = "test-key-1"


@pytest.fixture(scope="module")
def api(models, redis_server, redis_client, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("api")
    env = Env("api", models, redis_server, redis_client, tmp)
    proc, base = start_serve(env, tmp / "serve.log", KEY, {"SHARDFLOW_API__MODEL_NAME": "tiny"})
    client = openai.OpenAI(base_url=base, api_key=KEY, max_retries=0)
    yield SimpleNamespace(env=env, base=base, client=client, log=tmp / "serve.log")
    proc.terminate()
    proc.wait(20)
    env.close()


def chat_reference(hf, tok, content: str, n: int) -> str:
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return tok.decode(out[0, ids.shape[1] :].tolist())


def test_completions_and_chat_equal_generate(api, hf_models, tokenizers):
    tok, hf = tokenizers["qwen2"], hf_models["qwen2"]
    for p in PROMPTS[:3]:
        got = api.client.completions.create(model="tiny", prompt=p, max_tokens=8, temperature=0)
        want = reference(hf, tok, p, 8)
        assert got.choices[0].text == tok.decode(want) and got.object == "text_completion"
        assert got.usage.completion_tokens == len(want) and got.model == "tiny"
    chat = api.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPTS[5]}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content == chat_reference(hf, tok, PROMPTS[5], 8)
    assert chat.choices[0].finish_reason in ("stop", "length") and chat.object == "chat.completion"


def test_streamed_equals_not_streamed(api):
    for kind in ("chat", "text"):
        kw = dict(model="tiny", max_tokens=12, temperature=0)
        if kind == "chat":
            msgs = [{"role": "user", "content": PROMPTS[2]}]
            whole = api.client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
            stream = api.client.chat.completions.create(
                messages=msgs, stream=True, stream_options={"include_usage": True}, **kw
            )
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            whole = api.client.completions.create(prompt=PROMPTS[2], **kw).choices[0].text
            chunks = list(
                api.client.completions.create(
                    prompt=PROMPTS[2], stream=True, stream_options={"include_usage": True}, **kw
                )
            )
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == whole
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0  # include_usage
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_models_list_and_unknown_models(api):
    assert [m.id for m in api.client.models.list()] == ["tiny"]  # --served-model-name (here from the environment)
    with pytest.raises(openai.NotFoundError) as e:
        api.client.completions.create(model="gpt-nonexistent", prompt="x", max_tokens=1)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        api.client.models.retrieve("gpt-nonexistent")


def stop_case(tok, prompt_text: str, out: list[int]) -> tuple[str, str, int]:
    """A stop sequence a greedy generation `out` meets (3 characters ending at a token, seen there first, the
    prompt included): (stop, the text before it, tokens generated up to it)."""
    full = tok.decode(out)
    for k in range(3, len(out)):
        upto = tok.decode(out[:k])
        stop, whole = upto[-3:], prompt_text + upto
        if full.startswith(upto) and stop.strip() and "\ufffd" not in stop and whole.find(stop) == len(whole) - 3:
            return stop, upto[:-3], k
    raise AssertionError("no stop sequence found in the reference")


def chat_ids(hf, tok, content: str, n: int) -> tuple[str, list[int]]:
    text = tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n)
    return text, out[0, ids.shape[1] :].tolist()


def test_stop_sequences_are_left_out(api, hf_models, tokenizers, tmp_path):
    """As OpenAI: chat, completions, both streamed, and a Batch output line; finish_reason stop. The job's own
    result keeps the stop sequence (ShardFlow's rule)."""
    tok, hf = tokenizers["qwen2"], hf_models["qwen2"]
    prompt = PROMPTS[1]
    stop, before, k = stop_case(tok, prompt, reference(hf, tok, prompt, 12))
    kw = dict(model="tiny", prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "zzzz"])
    got = api.client.completions.create(**kw)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (before, "stop")
    assert got.usage.completion_tokens == k
    (view,) = api.env.client.views([got.id.removeprefix("cmpl-")])
    assert view.result["text"] == before + stop  # the job's GenerationResult keeps it
    chunks = list(api.client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == before  # never sent, not even in part
    assert chunks[-1].choices[0].finish_reason == "stop"
    chat_stop, chat_before, _ = stop_case(tok, *chat_ids(hf, tok, PROMPTS[3], 12))
    msgs = [{"role": "user", "content": PROMPTS[3]}]
    chat = api.client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0, stop=chat_stop)
    assert (chat.choices[0].message.content, chat.choices[0].finish_reason) == (chat_before, "stop")
    streamed = api.client.chat.completions.create(
        model="tiny", messages=msgs, max_tokens=12, temperature=0, stop=chat_stop, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
    batch = upload_batch(api.client, tmp_path / "in.jsonl", [batch_line("s", prompt=prompt, max_tokens=12, stop=stop)])
    batch = wait_batch(api.client, batch, "completed", 60)
    (line,) = [json.loads(x) for x in api.client.files.content(batch.output_file_id).text.splitlines()]
    assert line["response"]["body"]["choices"][0]["text"] == before
    assert line["response"]["body"]["choices"][0]["finish_reason"] == "stop"


def test_batch_api_file_to_output(api, hf_models, tokenizers, tmp_path):
    tok, hf = tokenizers["qwen2"], hf_models["qwen2"]
    lines = [batch_line(f"r{i}", prompt=p, max_tokens=6) for i, p in enumerate(PROMPTS[:5])]
    path = tmp_path / "in.jsonl"
    batch = upload_batch(api.client, path, lines)
    assert batch.status == "in_progress" and batch.request_counts.total == 5
    batch = wait_batch(api.client, batch, "completed", 120)
    assert batch.request_counts.completed == 5 and batch.output_file_id and batch.error_file_id is None
    assert batch.id in [b.id for b in api.client.batches.list()]
    first = api.client.files.content(batch.output_file_id).content
    out = [json.loads(x) for x in first.decode().splitlines()]
    by_id = {x["custom_id"]: x for x in out}
    for i, p in enumerate(PROMPTS[:5]):
        body = by_id[f"r{i}"]["response"]["body"]
        assert body["choices"][0]["text"] == tok.decode(reference(hf, tok, p, 6))
    assert api.client.files.content(batch.input_file_id).text == path.read_text()
    time.sleep(1.1)  # a stamp taken at read time would now differ
    again = api.client.batches.retrieve(batch.id)
    assert again.completed_at == batch.completed_at and again.created_at == batch.created_at
    assert api.client.files.content(batch.output_file_id).content == first  # byte-identical


def test_keys_are_required(api):
    wrong = openai.OpenAI(base_url=api.base, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model="tiny", prompt="x", max_tokens=1)
    r = httpx.post(f"{api.base}/completions", json={"model": "tiny", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    "body, fragment",
    [
        (b"{not json", "not JSON"),
        (b'{"model": "tiny"}', "prompt"),
        (b'{"model": "tiny", "prompt": "x", "n": 2}', "only n = 1"),
        (b'{"model": "tiny", "prompt": "x", "logit_bias": {}}', "logit_bias"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": 0}', "max_tokens"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": true}', "max_tokens: must be an integer"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": "8"}', "max_tokens: must be an integer"),
    ],
)
def test_malformed_bodies_are_400_and_enqueue_nothing(api, body, fragment):
    before = api.env.r.keys(f"{api.env.prefix}:batch:*")
    r = httpx.post(
        f"{api.base}/completions",
        content=body,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and fragment in err["message"]
    assert api.env.r.keys(f"{api.env.prefix}:batch:*") == before


def test_unknown_urls_are_404_in_openai_shape(api):
    r = httpx.get(f"{api.base}/batches/batch_nope", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()
    assert httpx.get(f"{api.base}/nothing").status_code == 404


def test_a_dropped_stream_cancels_its_job(api):
    """The client reads the first chunks of a long streamed completion, then goes away: its job is cancelled."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": "Tokyo", "max_tokens": 1500, "temperature": 0, "stream": True}
    job_id = None
    with httpx.stream("POST", f"{api.base}/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                data = json.loads(line[6:])
                job_id = data["id"].removeprefix("cmpl-")
                if data["choices"][0]["text"]:
                    break
    assert job_id is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        (view,) = api.env.client.views([job_id])
        if view.status == "canceled":
            break
        time.sleep(0.2)
    assert (view.status, view.error) == ("canceled", None)
    time.sleep(0.5)
    log = api.log.read_text()
    assert "Traceback" not in log and "unexpected error" not in log  # a client that went away is no error


def test_no_auth_only_on_loopback():
    res = CliRunner().invoke(main, ["serve", "--no-auth", "--host", "0.0.0.0"])
    assert res.exit_code == 2 and "loopback" in res.output
    res = CliRunner().invoke(main, ["serve"], env={"SHARDFLOW_API_KEYS": ""})
    assert res.exit_code == 2 and "no API keys" in res.output


def test_what_others_write_or_send_is_no_500(api, tmp_path):
    """A key with bytes past ASCII is a 401; an input file of plain ShardFlow lines is a 400 naming the line; a
    batch record with a forged creation time still reads."""
    r = httpx.get(f"{api.base}/models", headers={"Authorization": "Bearer caf\xe9".encode("latin-1")})
    assert r.status_code == 401
    path = tmp_path / "plain.jsonl"
    path.write_text('{"prompt": "hi"}\n')
    with path.open("rb") as f:
        upload = api.client.files.create(file=f, purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 1: not a Batch API line"):
        api.client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x"}}
    path.write_text(json.dumps(line) + "\n")
    with path.open("rb") as f:
        upload = api.client.files.create(file=f, purpose="batch")
    batch = api.client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    api.env.r.hset(f"{api.env.prefix}:batch:{batch.id}", "created_at", "inf")
    assert api.client.batches.retrieve(batch.id).created_at == 0


@pytest.mark.slow  # 300 requests on the tiny model: about 10 s on two cores
def test_many_requests_at_once_are_never_a_500(api):
    """300 concurrent completions of 2 tokens: each a 200 or a 429 (a job seen finished before its result
    could be read was a 500 "the request finished")."""
    body = {"model": "tiny", "prompt": "Tokyo", "max_tokens": 2, "temperature": 0}

    async def all_at_once() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=300)
        async with httpx.AsyncClient(timeout=300, limits=limits, headers={"Authorization": f"Bearer {KEY}"}) as c:
            return await asyncio.gather(*(c.post(f"{api.base}/completions", json=body) for _ in range(300)))

    answers = asyncio.run(all_at_once())
    counts = Counter(r.status_code for r in answers)
    assert set(counts) <= {200, 429} and counts[200] > 0, (counts, [r.text for r in answers if r.status_code >= 500])
