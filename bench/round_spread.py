"""How many rounds the jobs of one batch need, when each draft token is accepted with probability alpha on its own
(the synthetic drafter's model, a seed per job): a batch ends with its slowest job, so its wall time is about its
first token plus the most rounds any job needs, each at the round latency of the jobs still in flight.

    python -m bench.round_spread [--alpha 0.78] [-k 8] [--new 128] [--n 1,64,256] [--trials 200]

Prints, for each N, the mean rounds a job needs, the mean (over trials) of the most any of the N jobs needs, and
the aggregate tokens/s that gives at a few round latencies L, with T0 seconds to the first token:
N * new / (T0 + max_rounds * L). Arithmetic only: no model runs.
"""

from __future__ import annotations

import random
import statistics

import click


def rounds_for(rng: random.Random, alpha: float, k: int, new: int) -> int:
    """Rounds one job needs for `new` tokens: each round commits its accepted drafts and one more token."""
    made = rounds = 0
    while made < new:
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        made += accepted + 1
        rounds += 1
    return rounds


@click.command()
@click.option("--alpha", type=float, default=0.78, show_default=True)
@click.option("-k", type=int, default=8, show_default=True)
@click.option("--new", type=int, default=128, show_default=True)
@click.option("--n", "ns", default="1,64,256", show_default=True)
@click.option("--trials", type=int, default=200, show_default=True)
@click.option("--t0", type=float, default=1.5, show_default=True, help="Seconds to the first token.")
@click.option("--latency", "latencies", default="0.12,0.15,0.20,0.23", show_default=True, help="Round latencies, s.")
def main(alpha: float, k: int, new: int, ns: str, trials: int, t0: float, latencies: str) -> None:
    """Rounds a batch's jobs need (see the module docstring)."""
    rng = random.Random(0)
    ls = [float(x) for x in latencies.split(",")]
    click.echo(f"alpha {alpha}, K {k}, {new} new tokens, first token after {t0} s, {trials} trials")
    heads = " | ".join(f"tok/s at L={x}" for x in ls)
    click.echo(f"| N | mean rounds a job | most rounds of the N (mean) | {heads} |")
    click.echo("|---" * (3 + len(ls)) + "|")
    for n in (int(x) for x in ns.split(",")):
        runs = [[rounds_for(rng, alpha, k, new) for _ in range(n)] for _ in range(trials)]
        mean = statistics.mean(r for run in runs for r in run)
        most = statistics.mean(max(run) for run in runs)
        rates = " | ".join(f"{n * new / (t0 + most * x):,.0f}" for x in ls)
        click.echo(f"| {n} | {mean:.1f} | {most:.1f} | {rates} |")


if __name__ == "__main__":
    main()
