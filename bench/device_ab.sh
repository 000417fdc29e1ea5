#!/usr/bin/env bash
# One device call that compares code: issue 26's job path (bench/device_round.sh's shapes, link and flags) at N
# jobs for the working tree and for a base commit's export, alternating, so both see the same machine.
#   rm -rf .clean/base && mkdir -p .clean/base && git archive BASE | tar -x -C .clean/base     # here, then carry .clean
#   NS=256 ORDER="new base new base" OUT=$OUT bash bench/device_ab.sh 130       # each invocation capped (seconds)
#   ORDER="new new:SHARDFLOW_RELAY__HEAD_READERS=6,SHARDFLOW_RELAY__HEAD_SENDERS=6"   # a run's settings after ':'
# What comes back: one jobs-<i>-<name>.md a run, ab.md with their summary rows in run order, and phases.txt with
# each run's last phase lines (where the head's and the tail's loops spent their time).
set -uo pipefail
OUT=${OUT:-bench/out/device_ab}
mkdir -p "$OUT"
ROOT=$PWD
ln -sfn "$ROOT/.whl" .clean/base/.whl 2>/dev/null
i=0
for run in ${ORDER:-new base}; do
  i=$((i + 1))
  name=${run%%:*}
  envs=(); [ "$run" != "$name" ] && IFS=',' read -ra envs <<< "${run#*:}"
  dir=$ROOT; [ "$name" = base ] && dir=$ROOT/.clean/base
  (cd "$dir" && source bench/device_env.sh && env "${envs[@]}" timeout "${1:-130}" python3 -m bench.jobs --target random:qwen2.5-7b \
    --split 14 --draft random:qwen2.5-0.5b --synthetic 0.78 --head-device cuda:0 --tail-device cuda:0 --dtype bfloat16 \
    --delay-ms 43 --prompt-tokens 128 --new-tokens 128 --n "${NS:-256}" --distinct 16 --singles 3 \
    --head-args "--gpu-memory 0.45" --tail-args "--gpu-memory 0.45" ${JOBS_ARGS:-} --out /tmp/ab-$i 2>&1 \
    | quiet | grep -E "N=[0-9]+:|rror" | tail -5)
  cp /tmp/ab-$i/jobs.md "$OUT/jobs-$i-$name.md" 2>/dev/null
  { echo "== $i $run"; grep -h -E "head loop:|head senders:|head relay:|tail loop:|tail intake:" /tmp/ab-$i/logs/*.log \
    | tail -15; } >> "$OUT/phases.txt"
  grep -E "^\| default" /tmp/ab-$i/jobs.md | head -3 | sed "s/^| default/| $i ${run//|/ }/" >> "$OUT/ab.md"
done
cat "$OUT/ab.md"
