"""OpenAI Batch API files in and out: `shardflow enqueue --file` takes Batch API lines (all-or-nothing, errors by
line number), `shardflow results --format openai` writes output lines joined on custom_id, as jobs end with
--follow, and a re-run with the same -o appends only what is missing; a stop sequence is left out of a line's
text (OpenAI's rule) while the job's own result keeps it, and a cancelled request is OpenAI's cancelled line."""

from __future__ import annotations

import json
import threading
import time

import pytest
from pydantic import ValidationError

from schemas.openai import CHAT, TEXT, BatchLine, ChatBody, JobTag, output_line, visible_text
from schemas.settings import GenerationSettings
from tests.conftest import PROMPTS
from tests.job_env import Env, batch_line, reference, write_jsonl


@pytest.fixture(scope="module")
def env(models, redis_server, redis_client, tmp_path_factory):
    e = Env("oai", models, redis_server, redis_client, tmp_path_factory.mktemp("oai"))
    yield e
    e.close()


def read_jsonl(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_bodies_become_generation_requests():
    chat = ChatBody.model_validate(
        {
            "model": "m",
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "stop": "\n",
            "seed": 3,
        }
    ).generation(GenerationSettings())
    assert chat.messages[0].role == "system" and chat.messages[0].content == "Be brief."
    assert chat.max_new_tokens == 7 and chat.stop == ["\n"] and chat.sampling.temperature == 1.0
    assert chat.sampling.seed == 3
    text = BatchLine.model_validate(batch_line("a", prompt=["x y"], max_tokens=4)).generation(GenerationSettings())
    assert text.prompt == "x y" and text.chat_template is False and text.sampling.greedy
    for bad in ({"n": 2}, {"logit_bias": {}}, {"temperature": 3}, {"prompt": ["a", "b"]}):
        with pytest.raises(ValidationError):
            BatchLine.model_validate(batch_line("a", **bad))
    failed = output_line(JobTag(custom_id="x", url=CHAT), "b-00000", None, "InvalidRequest: prompt too long")
    assert failed["response"]["status_code"] == 400 and failed["error"]["message"].startswith("InvalidRequest")
    assert output_line(JobTag(custom_id="x"), "b-1", None, "tail crashed")["response"]["status_code"] == 500
    hidden = output_line(JobTag(custom_id="x"), "b-1", None, "RuntimeError: /srv/x.py failed", detail=False)
    assert "/srv" not in json.dumps(hidden) and hidden["response"]["status_code"] == 500
    cancelled = output_line(JobTag(custom_id="x"), "b-1", None, "cancelled by user", cancelled=True)
    assert cancelled["response"] is None and cancelled["error"]["code"] == "batch_cancelled"
    for bad in ({"max_tokens": True}, {"max_tokens": "8"}, {"temperature": "0"}, {"stream": 1}):  # strict types
        with pytest.raises(ValidationError):
            BatchLine.model_validate(batch_line("a", **bad))


def test_stop_sequences_are_left_out_of_what_is_returned():
    result = {"text": "The capital is Tokyo", "finish_reason": "stop", "prompt_tokens": 3, "completion_tokens": 4}
    got = output_line(JobTag(custom_id="x", url=TEXT, stop=["Tok", "Tokyo"]), "b-1", result, None, created=7)
    body = got["response"]["body"]
    assert body["choices"][0]["text"] == "The capital is " and body["created"] == 7
    assert visible_text("yo", ["Tokyo"], "stop") == ""  # the stop sequence began in the prompt
    assert visible_text("Tokyo", ["Tokyo"], "length") == "Tokyo"  # no stop ended it: the text as it is


def test_batch_file_in_and_out(env, hf_models, tokenizers, tmp_path):
    tok, hf = tokenizers["qwen2"], hf_models["qwen2"]
    lines = [batch_line(f"req-{i}", prompt=p, max_tokens=6 + i) for i, p in enumerate(PROMPTS[:4])]
    lines.append(batch_line("chat-1", CHAT, max_completion_tokens=5, stop=["zzz"]))
    res = env.cli("enqueue", "--file", write_jsonl(tmp_path / "in.jsonl", lines), "--wait", "--timeout", "120")
    assert res.exit_code == 0, res.output
    batch = env.r.keys(f"{env.prefix}:batch:*")
    batch_id = max(b.decode() for b in batch).rsplit(":", 1)[-1]
    out = tmp_path / "out.jsonl"
    res = env.cli("results", batch_id, "--format", "openai", "-o", str(out))
    assert res.exit_code == 0, res.output
    got = {x["custom_id"]: x for x in read_jsonl(out)}
    assert set(got) == {x["custom_id"] for x in lines}
    for i, p in enumerate(PROMPTS[:4]):
        line = got[f"req-{i}"]
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        want = reference(hf, tok, p, 6 + i)
        assert body["object"] == "text_completion" and body["model"] == "tiny"
        assert body["choices"][0]["text"] == tok.decode(want)
        assert body["usage"]["completion_tokens"] == len(want)
        assert body["choices"][0]["finish_reason"] == ("stop" if len(want) < 6 + i else "length")
    res = env.cli("results", batch_id, "--format", "openai")  # no -o: stdout
    assert res.exit_code == 0 and {json.loads(x)["custom_id"] for x in res.output.splitlines()} == set(got)
    chat = got["chat-1"]["response"]["body"]
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    # a second run with the same file appends nothing; a torn last line is cut, then only the missing lines come
    assert env.cli("results", batch_id, "--format", "openai", "-o", str(out)).exit_code == 0
    assert len(read_jsonl(out)) == 5
    kept = out.read_text().splitlines()[:2]
    out.write_text("\n".join(kept) + "\n" + '{"id": "torn')
    res = env.cli("results", batch_id, "--format", "openai", "-o", str(out))
    assert res.exit_code == 0 and "3 lines written" in res.output
    again = read_jsonl(out)
    assert len(again) == 5 and {x["custom_id"] for x in again} == set(got)


def test_results_leave_stop_sequences_out(env, hf_models, tokenizers, tmp_path):
    """`results --format openai` leaves a stop sequence out of a line's text, for a Batch API line and for a
    plain prompt with --stop alike; the jobs' own results (`results --json`) keep it."""
    tok, hf = tokenizers["qwen2"], hf_models["qwen2"]
    out_ids = reference(hf, tok, PROMPTS[1], 12)
    full = tok.decode(out_ids)
    for k in range(3, 12):  # a stop sequence first met where a token ends
        upto = tok.decode(out_ids[:k])
        stop, whole = upto[-3:], PROMPTS[1] + upto
        if full.startswith(upto) and stop.strip() and "\ufffd" not in stop and whole.find(stop) == len(whole) - 3:
            break
    lines = [batch_line("stopped", prompt=PROMPTS[1], max_tokens=12, stop=stop)]
    res = env.cli("enqueue", "--file", write_jsonl(tmp_path / "in.jsonl", lines), "--json")
    assert res.exit_code == 0, res.output
    plain = env.cli("enqueue", PROMPTS[1], "--no-chat-template", "--max-new-tokens", "12", "--stop", stop, "--json")
    assert plain.exit_code == 0, plain.output
    for out in (res, plain):
        batch_id = json.loads(out.output)["batch_id"]
        env.client.wait(env.client.resolve(batch_id), timeout=60)
        got = env.cli("results", batch_id, "--format", "openai")
        (choice,) = json.loads(got.output)["response"]["body"]["choices"]
        text = choice["text"] if "text" in choice else choice["message"]["content"]  # a plain prompt's: a chat shape
        assert (text, choice["finish_reason"]) == (upto[:-3], "stop")
        (view,) = env.client.views(env.client.resolve(batch_id))
        assert view.result["text"] == upto  # ShardFlow's rule: the job's result keeps it


def test_follow_writes_lines_as_jobs_end(env, tmp_path):
    # greedy "Tokyo" runs 120 tokens without an EOS on the tiny model: the long jobs outlive the short one
    long = [batch_line(f"long-{i}", prompt="Tokyo", max_tokens=120) for i in range(3)]
    lines = [batch_line("short", max_tokens=1), *long]
    res = env.cli("enqueue", "--file", write_jsonl(tmp_path / "in.jsonl", lines), "--json")
    assert res.exit_code == 0, res.output
    batch_id = json.loads(res.output)["batch_id"]
    out = tmp_path / "follow.jsonl"
    seen_partial = threading.Event()

    def watch() -> None:  # the file holds the first line while the long jobs still run
        while not seen_partial.is_set():
            text = out.read_text() if out.exists() else ""
            views = env.client.views(env.client.resolve(batch_id))
            if text.count("\n") >= 1 and any(v.status != "finished" for v in views):
                seen_partial.set()
            if all(v.status == "finished" for v in views):
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    res = env.cli("results", batch_id, "--format", "openai", "-o", str(out), "--follow", "--timeout", "120")
    watcher.join(10)
    assert res.exit_code == 0, res.output
    assert seen_partial.is_set()
    order = [x["custom_id"] for x in read_jsonl(out)]
    assert sorted(order) == sorted(x["custom_id"] for x in lines) and order[0] == "short"


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"n": 2}, "only n = 1"),
        ({"prompt": None}, "prompt"),
        ({"stream": "yes"}, "stream"),
    ],
)
def test_bad_batch_lines_are_refused_by_line_number(env, tmp_path, bad, fragment):
    lines = [batch_line("ok-1"), batch_line("bad", **bad), batch_line("ok-2")]
    before = env.r.keys(f"{env.prefix}:batch:*")
    res = env.cli("enqueue", "--file", write_jsonl(tmp_path / "in.jsonl", lines))
    assert res.exit_code == 2 and "line 2" in res.output and fragment in res.output, res.output
    assert env.r.keys(f"{env.prefix}:batch:*") == before  # nothing enqueued


def test_duplicate_and_long_custom_ids_are_refused(env, tmp_path):
    lines = [batch_line("same"), batch_line("same"), batch_line("x" * 65), {**batch_line("u"), "url": "/v1/embeddings"}]
    res = env.cli("enqueue", "--file", write_jsonl(tmp_path / "in.jsonl", lines))
    assert res.exit_code == 2, res.output
    assert "line 2: custom_id 'same' already on line 1" in res.output
    assert "line 3: custom_id" in res.output and "line 4: url" in res.output
