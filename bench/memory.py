"""Memory of a shard load: parameters held and peak RSS, for layers [a, b) of a checkpoint.

    python -m bench.memory --model DIR --layers 0:4 [--embed] [--head] [--json]
    python -m bench.memory --build /tmp/memmodel        # build an 8-layer multi-file checkpoint first

Prints parameter bytes held, the checkpoint's total bytes, and the RSS growth of this process (peak
RSS while loading and running one forward, minus RSS before), so a half-layer worker can be seen to
hold about half.
"""

from __future__ import annotations

import json
import resource
from pathlib import Path

import click


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    """Reset the kernel's peak-RSS mark (VmHWM) so the peak below covers only the load."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    return _status("VmHWM:") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(model: str, layers: tuple[int, int], embed: bool, head: bool) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from workers.engine.shard import load_shard, weight_files

    # Import the model's code and warm up the CPU kernels before the baseline, so the growth below is
    # the shard's own memory, not one-time library state.
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    with torch.inference_mode():
        torch.nn.Linear(64, 64)(torch.randn(4, 64))
    files = weight_files(Path(model))
    ckpt_bytes = sum(p.stat().st_size for p in set(files.values()))
    from workers.engine.kvcache import KVCache

    reset_peak()
    before = _status("VmRSS:")
    shard = load_shard(model, layers, embed=embed, head=head)
    with torch.inference_mode():  # touch every weight, as serving would
        x = torch.arange(4) if shard.embed is not None else torch.zeros(4, shard.config.hidden_size)
        shard(x, 0, KVCache(), logits_last=1)
    params = {id(p): p for p in shard.parameters()}
    held = sum(p.numel() * p.element_size() for p in params.values())
    return {
        "layers": list(layers),
        "param_count": sum(p.numel() for p in params.values()),
        "param_bytes": held,
        "checkpoint_bytes": ckpt_bytes,
        "checkpoint_files": len(set(files.values())),
        "rss_growth_bytes": peak_rss_bytes() - before,
    }


@click.command()
@click.option("--model", type=click.Path(exists=True, file_okay=False), help="Checkpoint directory.")
@click.option("--layers", default="0:4", show_default=True, help="Layers A:B to load.")
@click.option("--embed/--no-embed", default=True, show_default=True)
@click.option("--head/--no-head", default=False, show_default=True)
@click.option(
    "--build", type=click.Path(file_okay=False), default=None, help="Build an 8-layer test checkpoint here and exit."
)
@click.option("--json", "as_json", is_flag=True)
def main(model: str | None, layers: str, embed: bool, head: bool, build: str | None, as_json: bool) -> None:
    if build:
        from workers.tiny_models import save_tiny_model

        save_tiny_model(build, "qwen2", layers=8, hidden=768, max_shard_size="40MB")
        click.echo(build)
        return
    a, b = (int(x) for x in layers.split(":"))
    out = measure(str(model), (a, b), embed, head)
    if as_json:
        click.echo(json.dumps(out))
        return
    mb = 1 << 20
    click.echo(f"layers {a}:{b} of {out['checkpoint_files']}-file checkpoint ({out['checkpoint_bytes'] / mb:.1f} MiB)")
    click.echo(f"parameters held: {out['param_count']:,} ({out['param_bytes'] / mb:.1f} MiB)")
    click.echo(
        f"peak RSS growth: {out['rss_growth_bytes'] / mb:.1f} MiB "
        f"({out['rss_growth_bytes'] / out['checkpoint_bytes']:.2f} of the checkpoint)"
    )


if __name__ == "__main__":
    main()
