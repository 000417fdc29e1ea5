"""The plan for N stages (workers/engine/plan_stages.py, `shardflow plan --gpus A,B,C,D` / `--machines`): real
models' shapes from their configs alone (no weights; a few seconds in all), every worker within its budget, the
layers covered once, each device's memory the accounting workers check at start (`worker_needs`), the commands,
and the advice when fewer stages would be faster.

    pytest -n 0 tests/test_plan_stages.py
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import Qwen2Config

from producer.cli import main
from schemas.settings import Settings
from workers.engine import plan_stages as plan_stages_module
from workers.engine.plan import GiB, Part, plan_split, worker_needs
from workers.engine.plan_stages import StagePlan, Timing, layouts, plan_stages
from workers.speculative.adaptive import expected_tokens

QWEN = dict(
    vocab_size=152064,
    hidden_size=5120,
    num_attention_heads=40,
    num_key_value_heads=8,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    rope_theta=1e6,
)
SHAPES = {  # Qwen2.5's public configs' shapes
    "14b": Qwen2Config(**QWEN, intermediate_size=13824, num_hidden_layers=48),
    "32b": Qwen2Config(**QWEN, intermediate_size=27648, num_hidden_layers=64),
    "0.5b": Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
}
T4 = 15 * GiB
TIMING = Timing(tokens_per_round=expected_tokens(0.78, 8), k=8)


def check(plan: StagePlan, config: Qwen2Config, settings: Settings, quant: str, draft: Qwen2Config | None) -> None:
    """Each device within its budget, holding jobs; the layers covered once, in order; head, stages, tail; and
    each device's weights and slot what the worker's check at start counts (`worker_needs`)."""
    ranges = [d.layers for w in plan.workers for d in w.devices]
    assert ranges[0][0] == 0 and ranges[-1][1] == config.num_hidden_layers
    assert all(a < b for a, b in ranges) and all(p[1] == q[0] for p, q in itertools.pairwise(ranges))
    roles = [w.role for w in plan.workers]
    assert roles == ["head", *(f"stage {i}" for i in range(1, len(roles) - 1)), "tail"]
    last = len(ranges) - 1
    for i, d in enumerate(d for w in plan.workers for d in w.devices):
        assert 0 < d.slots and d.expected + d.context <= d.budget, d
        parts = [Part(config, d.layers, i == 0, i == last, torch.float16, quant)]
        if i == 0 and draft is not None:
            parts.append(Part(draft, (0, draft.num_hidden_layers), True, True, torch.float16))
        weights, slot, _ = worker_needs(parts, settings)
        assert (weights, slot) == (d.weights, d.full_slot)


@pytest.mark.parametrize(("shape", "quant"), [("14b", "none"), ("32b", "4bit")])
def test_four_workers_of_15_gib_each_fit_and_cover_the_layers(shape, quant):
    cfg, draft = Settings(), SHAPES["0.5b"]
    got = plan_stages(
        SHAPES[shape], [T4] * 4, dtype=torch.float16, quant=quant, draft=draft, settings=cfg, timing=TIMING, stages=4
    )
    plan = got.chosen
    assert plan.hops == plan.gpus == 4 and plan.in_flight > 0
    check(plan, SHAPES[shape], cfg, quant, draft)
    assert plan.round_ms == pytest.approx(4 * 86 + plan.compute_ms)
    assert plan.tok_s == pytest.approx(1000 * expected_tokens(0.78, 8) / plan.round_ms)
    # fewer stages are faster for one job where they fit: said, and 4 kept as asked
    three = next(o for o in got.options if o.hops == 3)
    assert three.fits and three.tok_s > plan.tok_s
    assert got.advice.startswith(f"3 stages predict {three.tok_s:.1f} tok/s against {plan.tok_s:.1f} for 4: use 3")
    assert not next(o for o in got.options if o.hops == 2).fits  # neither shape fits two 15 GiB GPUs


def test_the_14b_shape_needs_its_stages_where_fewer_do_not_fit():
    got = plan_stages(SHAPES["14b"], [T4] * 3, dtype=torch.float16, draft=SHAPES["0.5b"], timing=TIMING)
    assert got.chosen.hops == 3 and got.advice == "3 stages needed: the model does not fit 2 of these GPUs"


def test_a_model_that_fits_two_workers_says_fewer_stages_are_faster():
    """14B-shaped 4-bit fits two 15 GiB GPUs: with four, the plan picks two and says so."""
    got = plan_stages(SHAPES["14b"], [T4] * 4, dtype=torch.float16, quant="4bit", draft=SHAPES["0.5b"], timing=TIMING)
    assert got.chosen.hops == 2 and [o.hops for o in got.options] == [2, 3, 4]
    four = got.options[-1]
    assert got.advice.startswith(f"2 stages predict {got.chosen.tok_s:.1f} tok/s against {four.tok_s:.1f} for 4: use 2")
    assert f"(4 hold {four.in_flight} jobs in flight against {got.chosen.in_flight}" in got.advice
    jobs = plan_stages(  # --jobs: the fastest that holds as many
        SHAPES["14b"], [T4] * 4, dtype=torch.float16, quant="4bit", draft=SHAPES["0.5b"], timing=TIMING, min_jobs=30
    )
    assert jobs.chosen.in_flight >= 30 and jobs.chosen.hops > 2


def test_two_workers_plan_as_plan_split_counts_them():
    """A two-worker layout's memory at its split is the two-way plan's at that split."""
    cfg = Settings()
    got = plan_stages(SHAPES["14b"], [T4, T4], dtype=torch.float16, quant="4bit", draft=SHAPES["0.5b"], settings=cfg)
    plan = got.chosen
    two = plan_split(
        SHAPES["14b"], [T4, T4], dtype=torch.float16, quant="4bit", draft=SHAPES["0.5b"], settings=cfg,
        split=plan.workers[0].layers[1],
    )  # fmt: skip
    assert [d.as_dict() for w in plan.workers for d in w.devices] == [w.as_dict() for w in two.workers]


def test_machines_of_two_gpus_run_a_worker_spanning_each():
    shapes = [
        [sum(s.worker == w for s in seats) for w in range(seats[-1].worker + 1)] for seats in layouts([[1, 1]] * 2)
    ]
    assert shapes == [[2, 2], [1, 1], [1, 1, 2], [2, 1, 1], [1, 1, 1, 1]]  # fewest workers first; a machine alone: 1+1
    cfg, draft = Settings(), SHAPES["0.5b"]
    got = plan_stages(
        SHAPES["14b"], dtype=torch.float16, draft=draft, settings=cfg, machines=[[T4, T4], [T4, T4]], timing=TIMING
    )
    plan = got.chosen
    assert plan.shape == "2+2" and [w.indices for w in plan.workers] == [[0, 1], [0, 1]]
    assert [w.machine for w in plan.workers] == [0, 1] and plan.round_ms == pytest.approx(2 * 86 + plan.compute_ms)
    assert got.advice.startswith("2 stages (2+2 GPUs) predict") and got.advice.endswith("for 4: use 2")
    check(plan, SHAPES["14b"], cfg, "none", draft)
    devices = plan.workers[0].devices  # one worker's devices hold as many slots each
    assert devices[0].full == devices[1].full and devices[0].short == devices[1].short


def write(tmp_path: Path) -> dict[str, str]:
    out = {}
    for name, config in SHAPES.items():
        config.save_pretrained(tmp_path / name)
        out[name] = str(tmp_path / name)
    return out


def test_plan_command_for_n_stages(tmp_path):
    paths, runner = write(tmp_path), CliRunner()
    args = ["plan", "--target", paths["14b"], "--draft", paths["0.5b"], "--dtype", "float16"]
    res = runner.invoke(main, [*args, "--gpus", "15GiB,15GiB,15GiB,15GiB", "--stages", "4"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    cmds = [line for line in lines if line.startswith("shardflow ")]
    assert [c.split()[1] for c in cmds] == ["head", "stage", "stage", "tail"]
    assert "3 stages predict" in res.output and "use 3; 4 as asked" in res.output
    assert all("--dtype float16 --gpu-memory 15" in c and "--device cuda:0" in c for c in cmds)
    assert f"--draft {paths['0.5b']}" in cmds[0] and "--draft" not in cmds[1]
    layers = [c.split("--layers ")[1].split()[0] for c in cmds]
    assert layers[0].startswith("0:") and layers[-1].endswith(":48")
    assert all(a.split(":")[1] == b.split(":")[0] for a, b in itertools.pairwise(layers))
    res = runner.invoke(main, [*args, "--machines", "15GiB+15GiB,15GiB+15GiB", "--json"])
    got = json.loads(res.output)
    assert got["chosen"]["hops"] == 2 and "--devices cuda:0,cuda:1 --draft-device cuda:0" in got["commands"][1]
    assert [o["shape"] for o in got["options"]] == ["2+2", "1+1", "1+1+2", "2+1+1", "1+1+1+1"]
    res = runner.invoke(main, ["plan", "--target", paths["32b"], "--quant", "4bit", "--gpus", "15,15,15,15"])
    assert res.exit_code == 0 and "--quant 4bit" in res.output, res.output
    res = runner.invoke(main, [*args, "--gpus", "1GiB,1GiB,1GiB,1GiB"])
    assert res.exit_code == 2 and "does not fit" in res.output
    res = runner.invoke(main, [*args, "--machines", "15+15", "--split", "3"])
    assert res.exit_code == 2 and "--split is for two workers" in res.output
    res = runner.invoke(main, [*args, "--gpus", "15,15", "--machines", "15+15"])
    assert res.exit_code == 2 and "one of them" in res.output


def test_the_deploy_pages_four_t4_plan_is_what_plan_prints(tmp_path, monkeypatch):
    """docs/deploy.md's four-T4 block: its command, on the hub models' config shapes, prints its lines."""
    page = (Path(__file__).resolve().parents[1] / "docs" / "deploy.md").read_text()
    section = page.split("## Four T4s in two notebooks")[1]
    command, text = (block.split("```")[0] for block in section.split("```bash\n")[1].split("```text\n"))
    args = command.replace("\\\n", " ").split()
    assert args[0] == "shardflow"
    SHAPES["14b"].save_pretrained(tmp_path / "Qwen" / "Qwen2.5-14B-Instruct")
    SHAPES["0.5b"].save_pretrained(tmp_path / "Qwen" / "Qwen2.5-0.5B-Instruct")
    monkeypatch.chdir(tmp_path)  # the hub ids are these directories
    res = CliRunner().invoke(main, args[1:])
    assert res.exit_code == 0, res.output
    printed = res.output.splitlines()
    shown = [line for line in text.splitlines() if line != "..."]
    assert len([line for line in shown if line.startswith("shardflow ")]) == 4
    assert all(line in printed for line in shown), [line for line in shown if line not in printed]


def test_stages_cut_only_where_a_split_may(monkeypatch):
    """Where a model may be cut only at some layers (Gemma 4's shared keys and values: `per_layer.plan_cuts`),
    every stage's range starts and ends at one of them; a layout with more stages than those allow does not fit."""
    monkeypatch.setattr(plan_stages_module, "plan_cuts", lambda _config: [10, 20])
    cfg = Settings()
    got = plan_stages(SHAPES["32b"], [40 * GiB] * 4, dtype=torch.float16, quant="4bit", settings=cfg, timing=TIMING)
    three = next(o for o in got.options if o.hops == 3)
    assert [w.layers for w in three.workers] == [(0, 10), (10, 20), (20, 64)] and three.fits
    assert not next(o for o in got.options if o.hops == 4).fits


def test_the_readmes_four_t4_block_is_what_plan_prints(tmp_path, monkeypatch):
    """README's "Four T4s in two notebooks": its plan command, on the hub models' config shapes, prints its lines."""
    page = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = page.split("### Four T4s in two notebooks")[1].split("\n### ")[0]
    command, text = (block.split("```")[0] for block in section.split("```bash\n")[1].split("```text\n"))
    args = [a for a in command.replace("\\\n", " ").split() if not a.startswith("#")]
    args = args[args.index("shardflow") :]
    SHAPES["14b"].save_pretrained(tmp_path / "Qwen" / "Qwen2.5-14B-Instruct")
    SHAPES["0.5b"].save_pretrained(tmp_path / "Qwen" / "Qwen2.5-0.5B-Instruct")
    monkeypatch.chdir(tmp_path)
    res = CliRunner().invoke(main, args[1:])
    assert res.exit_code == 0, res.output
    shown = text.splitlines()
    assert sum("--devices cuda:0,cuda:1" in line for line in shown) == 2
    assert all(line in res.output.splitlines() for line in shown), [x for x in shown if x not in res.output]
