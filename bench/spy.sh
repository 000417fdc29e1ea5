#!/usr/bin/env bash
# Samples the bench's worker processes with py-spy while a command runs (GPU runs; py-spy travels as a wheel):
#   bench/spy.sh OUTDIR COMMAND...   ->  OUTDIR/spy-head.txt, OUTDIR/spy-tail.txt (collapsed stacks per thread,
#   idle samples left out, 40 Hz, from each worker's start to its exit), and OUTDIR/cpu.txt (top's per-second CPU of
#   Redis, the delay proxy, the workers and the producer, and of the machine, while COMMAND runs)
#   SPY_ARGS="--gil" bench/spy.sh ...   only samples of the thread holding the interpreter lock (who spends it)
# Each `python -m producer head|tail` process started while COMMAND runs is recorded once (the first of each role).
set -uo pipefail
out=$1; shift
mkdir -p "$out"
spy=$(command -v py-spy || echo /tmp/site/bin/py-spy)
(
  declare -A seen
  while sleep 2; do
    for role in head tail; do
      [ -n "${seen[$role]:-}" ] && continue
      pid=$(pgrep -f -n "python3? -m producer (-v )?$role" || true)
      [ -z "$pid" ] && continue
      seen[$role]=$pid
      "$spy" record --pid "$pid" -r 40 -f raw -t --nonblocking ${SPY_ARGS:-} -o "$out/spy-$role.txt" >"$out/spy-$role.log" 2>&1 &
    done
  done
) &
watcher=$!
(top -b -c -d 1 -w 200 | grep --line-buffered -E "^top -|%Cpu|[r]edis-server|[d]elay_proxy|[p]roducer (-v )?(head|tail)|[b]ench.jobs" \
  > "$out/cpu.txt") &
sampler=$!
"$@"; rc=$?
kill "$watcher" 2>/dev/null
pkill -P "$sampler" 2>/dev/null; kill "$sampler" 2>/dev/null
sleep 3
exit $rc
