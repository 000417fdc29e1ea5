"""One group's compute stages alone, in one process, at B sequences each: what the kernels take, so that the
job path's per-round stage times (bench/jobs.py) can be read beside them.

    # GPU: Qwen2.5-7B-shaped bf16 split 14/14, 0.5B-shaped drafter, K=8, 2,048-position slots, 256 cached
    python -m bench.stages --device cuda:0 --out bench/out/stages
    # this CPU: tiny presets (bench/synthetic.py), small B: checks that it runs (floors stay the H200's)
    python -m bench.stages --device cpu --b 1,4,16 --iters 3

Through the engine's real code paths (`Engine` with static caches, and CUDA graphs where the device is CUDA;
one pool of max(B) slots per engine; random weights of `random:<preset>` shapes, or a model directory; a tail that
takes token ids beside hidden states, Gemma 4's, is given each row's), ms per call for one group:
- draft: the drafter's K greedy steps for B sequences (`propose_many`; on CUDA the whole draft is one graph
  replay), each fed one new token, as after a rejection, and read back to the host;
- head: the lower shard over B x (K+1) token ids (`Engine.forward_many`), the hidden states copied to the
  host in one (pageable) copy and checked for non-finite values there, as the head's batcher once did; "head,
  check on device" is the batcher's way today: one non-finite reduction on the device and one copy into pinned
  host memory (workers/head/batching.py `to_host_checked`);
- tail: the upper shard + norm + LM head over B x (K+1) hidden rows (`Engine.forward_many`, logits of every
  row), then as the tail does today: a non-finite check per sequence and `verify_greedy` per sequence (one
  host read each); "tail, batched" is the same forward with one non-finite reduction and one argmax over the
  whole group, read once (verification on the device across sessions).
Beside each: the floor (bench/stages_floor.py; printed with the table; --bandwidth / --peak, H200 defaults
4.17 TB/s and 700 TFLOP/s bf16) and a plain-PyTorch reference (the same GEMMs + SDPA over the real lengths,
eager; --no-reference skips it). Device defaults: cuda -> the 7B shapes above, B in {1,16,64,128,256};
cpu -> `random:tiny` for both, split 2, B in {1,4,16}, 32 positions cached, 256-position slots, float32.
`--profile 16,128`: those groups' draft, head and tail kernels (torch.profiler: count, device ms, the top ones; with
--no-graphs also the operators that launched them). `--torch-silu` / `--torch-merge`: torch's kernels instead of
the fused layers' own (A/B); `--attention gather`: gathered copies instead of attention over the pools in place.
Writes stages.json and stages.md to --out; the table and the floor formula go to stdout.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import click
import torch
from torch.profiler import ProfilerActivity, profile

from bench.stages_floor import FLOOR_FORMULA, Reference, Shape, floors_ms, uniform
from bench.synthetic import load_shard, preset_of
from schemas.requests import SamplingParams
from schemas.settings import Settings
from workers.engine import fused
from workers.engine.numerics import finite_rows
from workers.engine.runner import Engine
from workers.head.batching import to_host_checked
from workers.speculative.drafters import ModelDrafter, propose_many
from workers.speculative.verify import verify_greedy

REPO = Path(__file__).resolve().parents[1]
GPU_DEFAULTS = dict(target="random:qwen2.5-7b", draft="random:qwen2.5-0.5b", split=14, b="1,16,64,128,256",
                    ctx=256, max_len=2048, dtype="bfloat16", iters=20)  # fmt: skip
CPU_DEFAULTS = dict(target="random:tiny", draft="random:tiny", split=2, b="1,4,16", ctx=32, max_len=256,
                    dtype="float32", iters=5)  # fmt: skip
STAGES = ("draft", "head", "head_batched", "tail", "tail_batched")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_ms(fn: Callable[[], object], dev: torch.device, warmup: int, iters: int) -> dict[str, float]:
    """Median (and p10 / p90) host wall ms per call, the device synchronised before and after each."""
    for _ in range(warmup):  # the first calls capture their graphs
        fn()
    times = []
    for _ in range(iters):
        sync(dev)
        t = time.perf_counter()
        fn()
        sync(dev)
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    return {
        "ms": round(statistics.median(times), 3),
        "p10": round(times[int(0.1 * (len(times) - 1))], 3),
        "p90": round(times[int(0.9 * (len(times) - 1))], 3),
    }


def kernels(fn: Callable[[], object], dev: torch.device, calls: int = 3) -> dict:
    """Kernel count per call, summed device ms per call and the top kernels (name, ms per call, count); on a CPU
    device, every operator with CPU time of its own (views and allocations too) and that time. On CUDA also "ops":
    the operators that launched them, with their input shapes (device ms of their own kernels per call, count;
    empty where a CUDA graph's replay launches them: run with graphs off to see them)."""
    cpu = dev.type == "cpu"
    acts = [ProfilerActivity.CPU] if cpu else [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts, record_shapes=not cpu) as prof:
        for _ in range(calls):
            fn()
        sync(dev)
    rows, ops = [], []
    total_us, count = 0.0, 0
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", 0.0) or getattr(ev, "self_cuda_time_total", 0.0)
        dev_us = ev.self_cpu_time_total if cpu else dev_us
        if (cpu or ev.device_type == torch.autograd.DeviceType.CUDA) and dev_us > 0:
            rows.append((ev.key[:90], dev_us / calls / 1000, ev.count // calls))
            total_us += dev_us
            count += ev.count
    for ev in [] if cpu else prof.key_averages(group_by_input_shape=True):
        dev_us = getattr(ev, "self_device_time_total", 0.0)
        if ev.device_type == torch.autograd.DeviceType.CPU and dev_us > 0 and not ev.key.startswith("cuda"):
            ops.append((f"{ev.key} {str(ev.input_shapes)[:100]}", dev_us / calls / 1000, ev.count // calls))
    rows.sort(key=lambda r: -r[1])
    ops.sort(key=lambda r: -r[1])
    return {"kernels_per_call": count // calls, "device_ms_per_call": total_us / calls / 1000, "top": rows[:12],
            "ops": ops[:16]}  # fmt: skip


class Rig:
    """The three engines with max(B) sequences each, prefilled with `ctx` positions; `stage(name, b)` is one
    call of that stage for the first b of them."""

    def __init__(
        self,
        shards: dict,
        k: int,
        ctx: int,
        max_len: int,
        bmax: int,
        graphs: bool | None,
        attention: str = "auto",
        compile_draft: bool = False,
    ) -> None:
        self.k, self.ctx, self.dev = k, ctx, shards["head"].device
        engine = {"static": True, "graphs": graphs, "max_len": max_len, "graph_k": k, "attention": attention}
        settings = Settings(engine=engine)
        self.head = Engine(shards["head"], settings, slots=bmax, label="head")
        self.tail = Engine(shards["tail"], settings, slots=bmax, label="tail")
        dengine = Engine(
            shards["draft"], settings, step_tokens=2, pad=False, max_draft=k, slots=bmax, compile=compile_draft,
            label="draft",
        )  # fmt: skip
        self.graphs = self.head.graphs
        gen = torch.Generator().manual_seed(0)
        vocab = min(s.config.vocab_size for s in shards.values())
        hidden, dtype = shards["tail"].config.hidden_size, shards["tail"].dtype

        def ids(n: int) -> list[int]:
            return torch.randint(0, vocab, (n,), generator=gen).tolist()

        self.rows = [ids(k + 1) for _ in range(bmax)]  # a round's [last token, drafts]
        self.row_ids = self._ids(self.rows)
        self.drafts = [r[1:] for r in self.rows]
        self.hs = [torch.randn(k + 1, hidden, generator=gen).to(self.dev, dtype) for _ in range(bmax)]
        self.contexts = [ids(ctx) for _ in range(bmax)]
        self.feed = ids(4096)  # the token each draft call appends, in turn
        self.calls = 0
        with torch.inference_mode():
            self.hcaches = [self.head.acquire() for _ in range(bmax)]
            self.head.forward_many(self.hcaches, [torch.tensor(c, device=self.dev) for c in self.contexts], [0] * bmax)
            self.tcaches = [self.tail.acquire() for _ in range(bmax)]
            prompt = [torch.randn(ctx, hidden, generator=gen).to(self.dev, dtype) for _ in range(bmax)]
            self.tail.forward_many(self.tcaches, prompt, [0] * bmax, ids=self._ids(self.contexts))
        drafter = ModelDrafter(shards["draft"], dengine)
        self.sessions = [drafter.new_session() for _ in range(bmax)]
        self.greedy = SamplingParams()
        propose_many(self.sessions, self.contexts, [k] * bmax, [self.greedy] * bmax, [None] * bmax)  # prefill

    def _ids(self, rows: list[list[int]]) -> list[torch.Tensor] | None:
        """The rows' token ids for a tail that takes them beside hidden states (Gemma 4's), else None."""
        return [torch.tensor(r, device=self.dev) for r in rows] if self.tail.shard.needs_ids else None

    def draft(self, b: int) -> None:
        for c in self.contexts[:b]:
            c.append(self.feed[self.calls % len(self.feed)])  # one new committed token, as after a rejection
            if len(c) > self.ctx + 64:
                del c[self.ctx :]
        self.calls += 1
        propose_many(self.sessions[:b], self.contexts[:b], [self.k] * b, [self.greedy] * b, [None] * b)

    def head_round(self, b: int) -> None:
        for c in self.hcaches[:b]:
            c.crop(self.ctx)
        with torch.inference_mode():
            xs = [torch.tensor(r, device=self.dev) for r in self.rows[:b]]
            hidden = self.head.forward_many(self.hcaches[:b], xs, [self.ctx] * b)
            if self.dev.type == "cuda":  # the batcher's one copy to the host
                hidden = list(torch.cat(hidden).cpu().split([h.shape[0] for h in hidden]))
        finite_rows(hidden)

    def head_batched(self, b: int) -> None:
        for c in self.hcaches[:b]:
            c.crop(self.ctx)
        with torch.inference_mode():
            xs = [torch.tensor(r, device=self.dev) for r in self.rows[:b]]
            to_host_checked(self.head.forward_many(self.hcaches[:b], xs, [self.ctx] * b))  # as the batcher does

    def _tail_forward(self, b: int) -> list[torch.Tensor]:
        for c in self.tcaches[:b]:
            c.crop(self.ctx)
        ids = self.row_ids[:b] if self.row_ids is not None else None
        return self.tail.forward_many(self.tcaches[:b], self.hs[:b], [self.ctx] * b, [self.k + 1] * b, ids=ids)

    def tail_round(self, b: int) -> None:
        with torch.inference_mode():
            logits = self._tail_forward(b)
            sync(self.dev)
            finite_rows(logits)
            for lg, d in zip(logits, self.drafts[:b], strict=True):
                verify_greedy(lg, d)

    def tail_batched(self, b: int) -> None:
        with torch.inference_mode():
            stacked = torch.stack(self._tail_forward(b))  # [b, K+1, vocab]
            ok = torch.isfinite(stacked).flatten(1).all(1)
            host = torch.cat([ok.long()[:, None], stacked.argmax(-1)], dim=1).tolist()  # one read
        for row, d in zip(host, self.drafts[:b], strict=True):
            target, accepted = row[1:], 0
            while accepted < len(d) and d[accepted] == target[accepted]:
                accepted += 1

    def stage(self, name: str) -> Callable[[int], None]:
        return {"draft": self.draft, "head": self.head_round, "head_batched": self.head_batched,
                "tail": self.tail_round, "tail_batched": self.tail_batched}[name]  # fmt: skip


def reference_ms(refs: dict[str, Reference], b: int, k: int, ctx: int, dev: torch.device, warm: int, iters: int):
    """Plain-PyTorch ms per call of each stage for b sequences (caches allocated for this b, then freed)."""
    out = {}
    vocab = refs["head"].s.vocab
    with torch.inference_mode():
        ids = torch.randint(0, vocab, (b, k + 1), device=dev)
        hidden = torch.randn(b, k + 1, refs["tail"].s.hidden, device=dev, dtype=refs["tail"].dtype)
        calls = {
            "draft": partial(refs["draft"].draft, ids[:, :1], refs["draft"].cache(b, ctx + k), ctx, k),
            "head": partial(refs["head"].head, ids, refs["head"].cache(b, ctx + k + 1), ctx),
            "tail": partial(refs["tail"].tail, hidden, refs["tail"].cache(b, ctx + k + 1), ctx),
        }
        for name, call in calls.items():
            out[name] = time_ms(call, dev, warm, iters)
    return out


def git_commit() -> str | None:
    try:
        got = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    except OSError:
        return None
    return got.stdout.strip() or None


def markdown(rows: list[dict], reference: bool) -> str:
    def cell(r: dict, s: str) -> str:
        floor = r["floor_ms"][s.split("_")[0]]
        return f"{r[s]['ms']:.2f} ({r[s]['ms'] / floor:.3g}×)" if floor > 0 else f"{r[s]['ms']:.2f}"

    head = "| B | draft ms (× floor) | head ms (× floor) | head, check on device ms (× floor) | tail ms (× floor) | "
    head += "tail, batched verify ms (× floor) | floor draft / head / tail ms |"
    head += " plain PyTorch draft / head / tail ms |" if reference else ""
    lines = [head, "|---" * (len(STAGES) + 2 + reference) + "|"]
    for r in rows:
        fl = r["floor_ms"]
        line = f"| {r['b']} | " + " | ".join(cell(r, s) for s in STAGES)
        line += f" | {fl['draft']:.3g} / {fl['head']:.3g} / {fl['tail']:.3g} |"
        if reference:
            ref = r.get("reference", {})
            line += " " + " / ".join(f"{ref[s]['ms']:.2f}" if s in ref else "—" for s in ("draft", "head", "tail"))
            line += " |"
        lines.append(line)
    return "\n".join(lines) + "\n"


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--device", default=None, help="Default: cuda:0 if CUDA is there, else cpu.")
@click.option("--target", default=None, help="random:<preset> (bench/synthetic.py) or a checkpoint directory.")
@click.option("--draft", default=None, help="The draft model (random:<preset> or a directory).")
@click.option("--split", type=int, default=None, help="First layer of the tail.")
@click.option("--b", "bs", default=None, help="Group sizes B, comma-separated.")
@click.option(
    "-k", type=click.IntRange(1, 64), default=Settings().engine.graph_k, show_default=True, help="Drafts/round."
)
@click.option("--ctx", type=click.IntRange(1), default=None, help="Positions already cached per sequence.")
@click.option("--max-len", type=click.IntRange(64), default=None, help="Positions of a slot.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default=None)
@click.option("--graphs/--no-graphs", default=None, help="CUDA graphs (default: on a CUDA device).")
@click.option("--iters", type=click.IntRange(1), default=None, help="Timed calls per stage (median reported).")
@click.option("--warmup", type=click.IntRange(1), default=3, show_default=True)
@click.option("--bandwidth", type=float, default=4.17, show_default=True, help="Device copy bandwidth, TB/s.")
@click.option("--peak", type=float, default=700.0, show_default=True, help="Peak matrix rate, TFLOP/s.")
@click.option("--reference/--no-reference", default=True, show_default=True, help="Time the plain-PyTorch one.")
@click.option(
    "--attention",
    type=click.Choice(["auto", "gather", "in_place"]),
    default="auto",
    show_default=True,
    help="EngineSettings.attention: in place over the pools, or gathered copies.",
)
@click.option("--compile-draft", is_flag=True, help="The drafter through torch.compile (EngineSettings.compile_draft).")
@click.option("--torch-silu", is_flag=True, help="SiLU(gate) * up as torch's two kernels (A/B).")
@click.option("--torch-merge", is_flag=True, help="A round's later tokens merged by torch's kernels (A/B).")
@click.option("--profile", "profile_b", default="", help="Group sizes whose stages' top kernels are listed.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("bench/out/stages"))
def main(device: str | None, target: str | None, draft: str | None, split: int | None, bs: str | None, k: int,
         ctx: int | None, max_len: int | None, dtype: str | None, graphs: bool | None, iters: int | None,
         warmup: int, bandwidth: float, peak: float, reference: bool, attention: str, compile_draft: bool,
         torch_silu: bool, torch_merge: bool, profile_b: str, out: Path) -> None:  # fmt: skip
    """Time one group's draft / head / tail at each B against the floor (see the module docstring)."""
    dev = torch.device(device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    d = GPU_DEFAULTS if dev.type == "cuda" else CPU_DEFAULTS
    target, draft, split = target or d["target"], draft or d["draft"], d["split"] if split is None else split
    ctx, max_len, iters = ctx or d["ctx"], max_len or d["max_len"], iters or d["iters"]
    sizes = sorted({int(x) for x in (bs or d["b"]).split(",") if x.strip()})
    dt = getattr(torch, dtype or d["dtype"])
    preset = preset_of(target)
    n_layers = preset["num_hidden_layers"] if preset else None
    if n_layers is None:
        from transformers import AutoConfig

        n_layers = AutoConfig.from_pretrained(target).num_hidden_layers
    if torch_silu:  # the fused layers' SiLU kernel off (workers/engine/fused.py asks for it as it builds them)
        fused.silu_mul_kernel = lambda *_: None
    if torch_merge:  # and their attention's merge kernel (pool_attention.merge_later in torch)
        fused.merge_kernel = lambda *_: None
    t0 = time.perf_counter()
    where = dict(device=str(dev), dtype=dt)
    shards = {
        "draft": load_shard(draft, None, embed=True, head=True, **where),
        "head": load_shard(target, (0, split), embed=True, head=False, **where),
        "tail": load_shard(target, (split, n_layers), embed=False, head=True, **where),
    }

    def shape(name: str, layers: int, lm_head: bool) -> Shape:
        config = shards[name].config
        if uniform(config):
            return Shape.of(config, layers, lm_head, dt)
        return Shape.of_layers(config, shards[name].layers, lm_head, dt)  # Gemma 4: each layer its own widths

    shapes = {
        "draft": shape("draft", shards["draft"].config.num_hidden_layers, True),
        "head": shape("head", split, False),
        "tail": shape("tail", n_layers - split, True),
    }
    rig = Rig(shards, k, ctx, max_len, max(sizes), graphs, attention, compile_draft)
    setup = f"set up in {time.perf_counter() - t0:.0f} s: {target} split {split}/{n_layers - split}, draft {draft}"
    click.echo(f"{setup}, K={k}, {ctx} cached, {max_len}-position slots, {dt}, graphs {rig.graphs}, {dev}", err=True)
    refs = {}
    if reference and any(sh.per_layer for sh in shapes.values()):
        raise click.UsageError("this model's layers differ in width: the plain-PyTorch reference needs --no-reference")
    if reference:
        refs["head"] = Reference(shapes["head"], dev, dt, embed=True)
        refs["tail"] = Reference(shapes["tail"], dev, dt, embed=False, share=refs["head"])
        refs["draft"] = Reference(shapes["draft"], dev, dt, embed=True)
    bw, pk = bandwidth * 1e12, peak * 1e12
    rows = []
    for b in sizes:
        row: dict = {"b": b, "floor_ms": {s: float(f"{v:.4g}") for s, v in floors_ms(
            shapes["draft"], shapes["head"], shapes["tail"], b, k, ctx, bw, pk).items()}}  # fmt: skip
        for name in STAGES:
            fn = rig.stage(name)
            row[name] = time_ms(partial(fn, b), dev, warmup, iters)
        if refs:
            row["reference"] = reference_ms(refs, b, k, ctx, dev, warmup, iters)
        if str(b) in profile_b.split(","):
            row["kernels"] = {name: kernels(partial(rig.stage(name), b), dev) for name in ("draft", "head", "tail")}
            for name, got in row["kernels"].items():
                total = f"{got['kernels_per_call']} kernels, {got['device_ms_per_call']:.2f} ms"
                click.echo(f"B={b} {name}: {total}", err=True)
                for kname, ms, cnt in got["top"]:
                    click.echo(f"    {ms:7.3f} ms  x{cnt:<4d} {kname}", err=True)
                if got["ops"]:  # with --no-graphs: which operators launched them
                    click.echo("  by operator (input shapes):", err=True)
                for op, ms, cnt in got["ops"]:
                    click.echo(f"    {ms:7.3f} ms  x{cnt:<4d} {op}", err=True)
        rows.append(row)
        click.echo(f"B={b}: " + ", ".join(f"{s} {row[s]['ms']:.2f} ms" for s in STAGES), err=True)
    table = markdown(rows, bool(refs))
    formula = f"{FLOOR_FORMULA}; BW = {bandwidth} TB/s, P = {peak} TFLOP/s"
    doc = {
        "command": [sys.executable, "-m", "bench.stages", *sys.argv[1:]],
        "attention_in_place": {s: rig_shard.attends_in_place for s, rig_shard in shards.items()},
        "settings": {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                     "torch": torch.__version__, "target": target, "draft": draft, "split": split,
                     "layers": n_layers, "k": k, "ctx": ctx, "max_len": max_len, "dtype": str(dt), "graphs": rig.graphs,
                     "slots": max(sizes), "iters": iters, "warmup": warmup, "bandwidth_tb_s": bandwidth,
                     "peak_tflop_s": peak, "commit": git_commit(),
                     "weights_gb": {s: round(v.weight_bytes / 1e9, 3) for s, v in shapes.items()}},
        "floor_formula": formula,
        "rows": rows,
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "stages.json").write_text(json.dumps(doc, indent=1))
    (out / "stages.md").write_text(table + "\n" + formula + "\n")
    click.echo(table)
    click.echo(formula)


if __name__ == "__main__":
    main()
