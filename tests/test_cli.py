"""The command line: `shardflow tail` and `shardflow generate` as separate processes over Redis."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner

from producer.cli import main
from schemas.settings import Settings
from tests.conftest import PROMPTS


@pytest.mark.slow
def test_cli_generate_against_cli_tail(models, tails, redis_server, redis_client, hf_models, tokenizers):
    ms = models["llama"]
    names = tails.get(ms.target, 2, ms.n_layers)
    prompt = PROMPTS[2]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "producer",
            "generate",
            prompt,
            "--target",
            str(ms.target),
            "--layers",
            "0:2",
            "--draft",
            str(ms.drafter),
            "--max-new-tokens",
            "16",
            "-k",
            "4",
            "--json",
            "--no-chat-template",
            "--redis-url",
            redis_server.url,
            "--prefix",
            names.prefix,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    ids = torch.tensor([tokenizers["llama"].encode(prompt)])
    want = hf_models["llama"].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16)
    assert result["token_ids"] == want[0, ids.shape[1] :].tolist()
    assert result["rounds"] >= 1 and set(result["timings"]) >= {"draft_ms", "relay_ms", "tail_forward_ms"}
    # streams stay bounded: handled entries are deleted, and the head's reply stream (every reply to its sessions,
    # no stream per session) expires after the last reply
    assert redis_client.xlen(names.shared_requests) == 0
    assert not redis_client.exists(names.reply(result["session_id"]))
    shared = redis_client.keys(f"{names.prefix}:reply:head.*")
    assert shared and all(0 < redis_client.ttl(k) <= Settings().relay.reply_ttl_s for k in shared)


def test_cli_rejects_bad_layers():
    res = CliRunner().invoke(main, ["tail", "--target", "x", "--layers", "4"])
    assert res.exit_code == 2 and "is not A:B" in res.output
    res = CliRunner().invoke(main, ["tail", "--target", "x", "--layers", "5:3"])
    assert res.exit_code == 2 and "0 <= A < B" in res.output


@pytest.mark.slow
def test_local_command_runs_end_to_end():
    res = subprocess.run(
        [sys.executable, "-m", "producer", "local", "Hello world", "--max-new-tokens", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr
    result = json.loads(res.stdout.strip().splitlines()[-1])
    assert result["completion_tokens"] == 8 and result["finish_reason"] == "length"
