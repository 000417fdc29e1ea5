#!/usr/bin/env bash
# One device call for issue 28's figures (one nvidia-h200, head and tail sharing it, each --gpu-memory 0.45, bf16,
# 43 ms each way, synthetic alpha 0.78, a seed per job): one job and 16 jobs of each family preset, every greedy output
# checked against the no-speculation reference, then the Qwen2.5-7B row of the same run.
#   OUT=$OUT bash bench/device_families.sh [SECONDS_EACH]
#   FAMILIES="qwen3-8b:18:qwen3-0.6b gemma-3-12b:24:gemma-3-1b" ...   # preset:split:drafter, space-separated
#   HEAD_ARGS="--gpu-memory 15 --quant 4bit" TAIL_ARGS="--gpu-memory 15 --quant 4bit" ...   # workers' flags
# What comes back: <preset>.json / .md and phases-<preset>.txt per family.
set -uo pipefail
OUT=${OUT:-bench/out/device_families}
mkdir -p "$OUT" /tmp/f
source bench/device_env.sh
for spec in ${FAMILIES:-qwen3-8b:18:qwen3-0.6b gemma-3-12b:24:gemma-3-1b gpt-oss-20b:12:o200k-0.5b qwen2.5-7b:14:qwen2.5-0.5b}; do
  IFS=: read -r preset split draft <<< "$spec"
  echo "== $preset split $split, drafter $draft"
  timeout "${1:-150}" python3 -m bench.jobs --target "random:$preset" --split "$split" --draft "random:$draft" \
    --synthetic 0.78 --head-device cuda:0 --tail-device cuda:0 --dtype bfloat16 --delay-ms 43 --prompt-tokens 128 \
    --new-tokens 128 --n "${NS:-1,16}" --distinct 16 --singles 3 --head-args "${HEAD_ARGS:---gpu-memory 0.45}" \
    --tail-args "${TAIL_ARGS:---gpu-memory 0.45}" ${JOBS_ARGS:-} --out "/tmp/f/$preset" 2>&1 | quiet | grep -E "^\||N=[0-9]+:|rror" | tail -12
  cp "/tmp/f/$preset/jobs.json" "$OUT/$preset.json" 2>/dev/null
  cp "/tmp/f/$preset/jobs.md" "$OUT/$preset.md" 2>/dev/null
  grep -h -E "head loop:|tail loop:|captured|memory:|Traceback|Error|rror:" /tmp/f/$preset/logs/*.log 2>/dev/null \
    | tail -40 > "$OUT/phases-$preset.txt"
  for f in /tmp/f/$preset/logs/*.log; do grep -q Traceback "$f" && grep -v "^\[" "$f" | tail -60 > "$OUT/error-$preset-$(basename "$f")"; done
done
ls "$OUT"
