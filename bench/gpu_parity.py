"""Greedy parity on a GPU with static caches + CUDA graphs: the split speculative path equals HF `generate`.

    python -m bench.gpu_parity --head-device cuda:0 --tail-device cuda:1 [--quant 4bit] [--dtype float16]

Builds the tiny test models (Qwen2-shaped untied, Llama-shaped tied) on disk, runs a tail process and
the head with graphs on, for 20 prompts x K in {1, 4, 8} x {draft model, n-gram}, and prints mismatches.
Then all 20 prompts at once (threads sharing the runtime: batched forwards).
Also checks that a fixed seed reproduces a sampled generation. Exit status 1 on any mismatch.
With `--dtype float16|bfloat16` (against HF generate in that dtype) a generation may part from generate's
where generate's own two best logits are within rounding (`divergence_ulps` <= TIE_ULPS): counted as ties;
a larger gap is a mismatch.
"""

from __future__ import annotations

import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import torch

from producer.local import spawn_tail, wait_for_tails
from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis
from schemas.keys import Keys
from schemas.requests import DraftSettings, GenerationRequest, SamplingParams
from schemas.settings import Settings
from workers.head.runtime import HeadRuntime, generate
from workers.tiny_models import (
    PROMPTS,
    TIE_ULPS,
    build_tokenizer,
    divergence_ulps,
    greedy_with_logits,
    save_noisy_copy,
    save_tiny_model,
)


@click.command()
@click.option("--head-device", default="cuda:0")
@click.option("--tail-device", default="cuda:0")
@click.option("--new", type=int, default=20)
@click.option(
    "--quant",
    type=click.Choice(["none", "int8", "4bit"]),
    default="none",
    help="Quantized shards and drafter, against HF generate on the model transformers quantizes the same way.",
)
@click.option("--dtype", "dtype_name", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32")
def main(head_device: str, tail_device: str, new: int, quant: str, dtype_name: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.engine.quant import exact_on_cpu, transformers_config

    bad = checked = ties = 0
    dtype = getattr(torch, dtype_name)
    worst = 0.0

    def compare(got: list[int], want: list[int], logits: tuple[torch.Tensor, ...], what: str) -> None:
        nonlocal bad, checked, ties, worst
        checked += 1
        if got == want:
            return
        ulps = divergence_ulps(got, want, logits, dtype) if dtype != torch.float32 else None
        if ulps is not None and ulps <= TIE_ULPS:
            ties, worst = ties + 1, max(worst, ulps)
            return
        bad += 1
        far = f" ({ulps:.0f} ulps)" if ulps is not None else ""
        click.echo(f"MISMATCH {what}{far}: {got} != {want}")

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis() as server:
        tok0 = build_tokenizer()
        r = connect(server.url)
        for family in ("qwen2", "llama"):
            target = save_tiny_model(Path(tmp) / family, family, tokenizer=tok0)
            draft = save_noisy_copy(target, Path(tmp) / f"{family}-d", 0.02)
            tok = AutoTokenizer.from_pretrained(target)
            qc = {"quantization_config": transformers_config(quant, dtype)} if quant != "none" else {}
            hf = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, device_map=head_device, **qc).eval()
            for m in hf.modules():
                exact_on_cpu(m)  # (a CPU run: the kernel the workers use)
            names = Keys(f"gpu-{family}")
            extra = ["--device", tail_device, "--quant", quant, "--dtype", dtype_name]
            tail = spawn_tail(target, (2, 4), server.url, prefix=names.prefix, extra=extra)
            try:
                wait_for_tails(r, names, proc=tail, timeout_s=300)
                rt = HeadRuntime.load(
                    target,
                    (0, 2),
                    draft=draft,
                    settings=Settings(
                        engine={"device": head_device, "dtype": dtype_name, "quant": quant, "draft_quant": quant}
                    ),
                )
                assert rt.engine.graphs or not head_device.startswith("cuda"), "graphs should be on for CUDA"
                wants = []
                for p in PROMPTS:
                    ids = torch.tensor([tok.encode(p)], device=head_device)
                    want, logits = greedy_with_logits(hf, ids, new)
                    wants.append((want, logits))
                    for kind in ("model", "ngram"):
                        for k in (1, 4, 8):
                            req = GenerationRequest(
                                prompt=p,
                                max_new_tokens=new,
                                chat_template=False,
                                draft=DraftSettings(kind=kind, k=k, adaptive=False),
                            )
                            got = generate(req, rt, r, names=names).token_ids
                            compare(got, want, logits, f"{family} {kind} k={k} {p!r}")
                # all 20 prompts in flight at once: batched drafter / head / tail forwards over graph buckets
                for k in (4, 8):

                    def one(p: str, k: int = k, rt: HeadRuntime = rt, names: Keys = names) -> list[int]:
                        draft = DraftSettings(kind="model", k=k, adaptive=False)
                        req = GenerationRequest(prompt=p, max_new_tokens=new, chat_template=False, draft=draft)
                        return generate(req, rt, r, names=names).token_ids

                    with ThreadPoolExecutor(len(PROMPTS)) as pool:
                        for p, got, (want, logits) in zip(PROMPTS, pool.map(one, PROMPTS), wants, strict=True):
                            compare(got, want, logits, f"in flight {family} k={k} {p!r}")
                click.echo(f"{family}: head batches {rt.batcher.batches} for {rt.batcher.rounds} rounds")
                s = SamplingParams(temperature=0.9, top_k=50, seed=11)
                req = GenerationRequest(prompt=PROMPTS[0], max_new_tokens=new, chat_template=False, sampling=s)
                a, b = (generate(req, rt, r, names=names).token_ids for _ in range(2))
                if a != b:
                    bad += 1
                    click.echo(f"SEED NOT REPRODUCED {family}: {a} != {b}")
            finally:
                tail.terminate()
                tail.wait(30)
    tie_note = f", {ties} part from it at a rounding tie (<= {worst:.0f} ulps)" if dtype != torch.float32 else ""
    click.echo(
        f"gpu parity ({quant}, {dtype_name}): {checked - bad - ties}/{checked} generations equal HF generate"
        f"{tie_note} (graphs on)"
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
