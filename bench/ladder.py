"""The speed ladder: no speculation -> eager speculation -> static caches + CUDA graphs, one job at a time,
through the real head -> Redis -> tail -> verify path with a WAN delay between the head and Redis.

    # H200 x2 (head on cuda:0, tail on cuda:1), Qwen2.5-7B-shaped target, 0.5B-shaped drafter, 43 ms each way:
    python -m bench.ladder --target random:qwen2.5-7b --draft random:qwen2.5-0.5b --split 14 \\
        --head-device cuda:0 --tail-device cuda:1 --dtype bfloat16 --delay-ms 43 --alpha 0.78 --out OUT
    # rows: {nospec,spec}-{eager,graphs,compiled}[-xN] (N jobs in flight; "compiled": torch.compile'd drafter)
    # CPU smoke run:
    python -m bench.ladder --target random:tiny --draft random:tiny --split 2 --delay-ms 0 --new 32

Random weights make drafts meaningless, so speculative rows use the synthetic drafter: it runs the real
draft model (paying its cost) and then proposes the target's own reference continuation with each
token replaced by a wrong one with probability 1 - alpha ("synthetic acceptance alpha"). Memory per
worker: the head's peak (torch's peak allocation on a GPU, peak resident set on CPU) and the tail
process's (GPU memory it holds per nvidia-smi, or its peak resident set). Writes ladder.json, ladder.md
and ladder.png to --out.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from contextlib import ExitStack
from pathlib import Path

import click
import torch

from bench.delay_proxy import spawn_proxy
from bench.jobs_report import process_memory_gb
from bench.synthetic import preset_of, registry
from producer.local import spawn_tail, wait_for_tails
from relay_broker.connection import connect
from relay_broker.embedded import EmbeddedRedis
from schemas.keys import Keys
from schemas.requests import DraftSettings, GenerationRequest
from schemas.settings import Settings
from workers.head.runtime import HeadRuntime, generate

FIELDS = ("draft_ms", "head_forward_ms", "relay_ms", "tail_forward_ms", "verify_ms")


def run_row(
    name: str, runtime, r, names, prompts, refs, kind: str, k: int, alpha: float, new: int, in_flight: int = 1
) -> dict:
    def request(p, ref):
        draft = (
            DraftSettings(kind=kind, k=k, adaptive=False, options={"alpha": alpha, "reference_ids": ref})
            if kind != "none"
            else DraftSettings(kind="none")
        )
        return GenerationRequest(prompt_ids=p, max_new_tokens=new, draft=draft)

    def in_flight_run(work: list) -> list:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(work)) as pool:
            return list(pool.map(lambda pr: generate(request(*pr), runtime, r, names=names), work))

    work = [(prompts[i % len(prompts)], refs[i % len(refs)]) for i in range(in_flight)]
    # warm-up: kernels, graph capture and compilation of every batch size the row will use
    generate(request(prompts[0], refs[0]), runtime, r, names=names) if in_flight == 1 else in_flight_run(work)
    if runtime.shard.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(runtime.shard.device)
    started = time.perf_counter()
    if in_flight == 1:
        results = [generate(request(p, ref), runtime, r, names=names) for p, ref in zip(prompts, refs, strict=True)]
    else:  # as many jobs in flight, sharing the head runtime (each its own cache, session and thread)
        results = in_flight_run(work)
        refs = [ref for _, ref in work]
    wall = time.perf_counter() - started
    same = sum(res.token_ids == ref[: len(res.token_ids)] for res, ref in zip(results, refs, strict=True))
    rounds = sum(x.rounds for x in results)
    split = {f: sum(getattr(x.timings, f) for x in results) / rounds for f in FIELDS}
    cuda = runtime.shard.device.type == "cuda"
    dev = runtime.shard.device
    mem = torch.cuda.max_memory_allocated(dev) if cuda else (process_memory_gb(os.getpid(), False) or 0.0) * 1e9
    return {
        "row": name,
        "in_flight": in_flight,
        "tokens_per_s": statistics.mean(x.tokens_per_s for x in results),
        "aggregate_tokens_per_s": sum(x.completion_tokens for x in results) / wall,
        "tokens_per_s_each": [round(x.tokens_per_s, 2) for x in results],
        "tokens_per_round": sum(x.completion_tokens for x in results) / rounds,
        "per_round_ms": split,
        "non_network_ms": split["draft_ms"] + split["head_forward_ms"] + split["tail_forward_ms"] + split["verify_ms"],
        "head_peak_mem_gb": mem / 1e9,
        "equal_to_reference": f"{same}/{len(results)}",
        "outputs": [x.token_ids for x in results],
    }


def ping_ms(r) -> float:
    ping = []
    for _ in range(10):
        t = time.perf_counter()
        r.ping()
        ping.append((time.perf_counter() - t) * 1000)
    return statistics.median(ping)


def write_outputs(out: Path, meta: dict, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "ladder.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        "| row | tokens/s per job | aggregate tokens/s | tokens/round | draft ms | head ms | relay ms | "
        "tail+verify ms | non-network ms | head / tail memory GB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in rows:
        p = x["per_round_ms"]
        lines.append(
            f"| {x['row']} | {x['tokens_per_s']:.2f} | {x['aggregate_tokens_per_s']:.2f} | "
            f"{x['tokens_per_round']:.2f} | {p['draft_ms']:.1f} | "
            f"{p['head_forward_ms']:.1f} | {p['relay_ms']:.1f} | {p['tail_forward_ms'] + p['verify_ms']:.1f} | "
            f"{x['non_network_ms']:.1f} | {x['head_peak_mem_gb']:.2f} / {x.get('tail_mem_gb', 0.0):.2f} |"
        )
    (out / "ladder.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.barh([x["row"] for x in rows], [x["aggregate_tokens_per_s"] for x in rows], color="#3b7dd8")
        ax.set_xlabel("aggregate tokens/s")
        ax.set_title(f"{meta['target']} split {meta['split']}, +{meta['delay_ms']} ms each way, K={meta['k']}")
        fig.tight_layout()
        fig.savefig(out / "ladder.png", dpi=120)
    except ImportError:
        pass


@click.command()
@click.option("--target", default="random:qwen2.5-7b", show_default=True)
@click.option("--draft", default="random:qwen2.5-0.5b", show_default=True)
@click.option("--split", type=int, default=14, show_default=True)
@click.option("--head-device", default="cpu", show_default=True)
@click.option("--tail-device", default="cpu", show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--delay-ms", type=float, default=43.0, show_default=True, help="Head <-> Redis delay each way.")
@click.option("-k", type=int, default=8, show_default=True)
@click.option("--alpha", type=float, default=0.78, show_default=True, help="Synthetic acceptance.")
@click.option("--new", type=int, default=128, show_default=True, help="Tokens per generation.")
@click.option("--prompts", "n_prompts", type=int, default=3, show_default=True)
@click.option("--prompt-len", type=int, default=128, show_default=True)
@click.option("--max-len", type=int, default=2048, show_default=True, help="Static cache positions.")
@click.option("--rows", default="nospec-eager,spec-eager,nospec-graphs,spec-graphs", show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="bench/out", show_default=True)
def main(
    target,
    draft,
    split,
    head_device,
    tail_device,
    dtype,
    delay_ms,
    k,
    alpha,
    new,
    n_prompts,
    prompt_len,
    max_len,
    rows,
    out,
) -> None:
    preset = preset_of(target)
    assert preset is not None, "ladder.py takes random:<preset> targets"
    n_layers, vocab = preset["num_hidden_layers"], preset["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=gen).tolist() for _ in range(n_prompts)]
    wanted = rows.split(",")
    with EmbeddedRedis() as server, ExitStack() as stack:
        # the delay proxy runs in a process of its own: a real link shares no interpreter lock with the head
        proxy_port = stack.enter_context(spawn_proxy(server.port, delay_ms / 1000)) if delay_ms > 0 else None
        head_url = f"redis://127.0.0.1:{proxy_port}/0" if proxy_port else server.url
        tails = {}
        for mode, flags in (("eager", ["--dynamic-cache", "--no-graphs"]), ("graphs", [])):
            if not any(f"-{mode}" in w or (mode == "graphs" and "-compiled" in w) for w in wanted):
                continue
            flags = flags or (["--static-cache"] if tail_device == "cpu" else [])
            proc = spawn_tail(
                target,
                (split, n_layers),
                server.url,
                prefix=f"ladder-{mode}",
                extra=["--device", tail_device, "--dtype", dtype, "--plugin", "bench.synthetic", *flags],
            )
            tails[mode] = (proc, Keys(f"ladder-{mode}"))
        try:
            r = connect(head_url)
            for proc, names in tails.values():
                wait_for_tails(connect(server.url), names, proc=proc, timeout_s=600)
            cuda = head_device.startswith("cuda")
            engine = dict(device=head_device, dtype=dtype, max_len=max_len, graph_k=k)
            modes = {"eager": dict(static=False, graphs=False), "graphs": dict(static=True, graphs=cuda)}
            modes["compiled"] = dict(modes["graphs"], compile_draft=True)  # torch.compile'd drafter, graphs
            used = {w.split("-")[1] for w in wanted}
            runtimes = {
                m: HeadRuntime.load(
                    target, (0, split), draft=draft, settings=Settings(engine=engine | modes[m]), plugins=registry()
                )
                for m in modes
                if m in used
            }
            # Each mode's synthetic drafter proposes that mode's own greedy continuation.
            plain = [
                GenerationRequest(prompt_ids=p, max_new_tokens=new, draft=DraftSettings(kind="none")) for p in prompts
            ]
            refs = {m: [generate(q, runtimes[m], r, names=tails[m][1]).token_ids for q in plain] for m in tails}
            if "compiled" in runtimes:  # same target path as graphs: same continuation
                tails["compiled"], refs["compiled"] = tails["graphs"], refs["graphs"]
            meta = {
                "target": target,
                "draft": draft,
                "split": split,
                "delay_ms": delay_ms,
                "k": k,
                "alpha": alpha,
                "new_tokens": new,
                "prompts": n_prompts,
                "prompt_len": prompt_len,
                "dtype": dtype,
                "head_device": head_device,
                "tail_device": tail_device,
                "ping_ms": ping_ms(r),
                "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            }
            table = []
            for row in wanted:
                spec, mode, *rest = row.split("-")
                in_flight = int(rest[0].lstrip("x")) if rest else 1
                label = {"nospec": "no speculation", "spec": f"speculation, synthetic α={alpha}"}[spec] + {
                    "eager": ", eager, dynamic caches",
                    "graphs": ", static caches + CUDA graphs" if cuda else ", static caches",
                    "compiled": ", static caches + CUDA graphs, torch.compile'd drafter",
                }[mode]
                label += f", {in_flight} jobs in flight" if in_flight > 1 else ""
                table.append(
                    run_row(
                        label,
                        runtimes[mode],
                        r,
                        tails[mode][1],
                        prompts,
                        refs[mode],
                        "synthetic" if spec == "spec" else "none",
                        k,
                        alpha,
                        new,
                        in_flight,
                    )
                )
                table[-1]["tail_mem_gb"] = process_memory_gb(tails[mode][0].pid, tail_device.startswith("cuda")) or 0.0
                click.echo(json.dumps({k: v for k, v in table[-1].items() if k != "outputs"}))
                write_outputs(Path(out), meta, table)  # after every row: a cut-short run still reports
            write_outputs(Path(out), meta, table)
            click.echo((Path(out) / "ladder.md").read_text())
        finally:
            for proc, _ in tails.values():
                proc.terminate()
            for proc, _ in tails.values():
                proc.wait(30)


if __name__ == "__main__":
    main()
