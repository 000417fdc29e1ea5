#!/usr/bin/env bash
# One device call for issue 27's long prompts (one GPU, head and tail sharing it): the job path at each prompt
# length, one job (two, one at a time) and NS jobs, 64 new tokens, Qwen2.5-7B-shaped bf16 14/14 with the
# 0.5B-shaped drafter, 43 ms each way, synthetic alpha 0.78, a seed per job, every greedy output checked against
# the no-speculation reference. Each worker: --gpu-memory 0.45, --max-len MAXLEN, --slots SLOTS (full-length slots
# for every job: the default plan keeps a quarter of the memory for them).
#   OUT=$OUT bash bench/device_prompts.sh [CAP_S]           # CAP_S: each length's cap in seconds
#   PROMPTS="2000 8000 32000" NS=1,16 MAXLEN=32768 SLOTS=16 ...
# What comes back: jobs-<len>.md and phases-<len>.txt a length.
set -uo pipefail
OUT=${OUT:-bench/out/device_prompts}
mkdir -p "$OUT"
source bench/device_env.sh
w="--gpu-memory 0.45 --max-len ${MAXLEN:-32768} --slots ${SLOTS:-16}"
for p in ${PROMPTS:-2000 8000 32000}; do
  timeout "${1:-200}" python3 -m bench.jobs --target random:qwen2.5-7b --split 14 --draft random:qwen2.5-0.5b \
    --synthetic 0.78 --head-device cuda:0 --tail-device cuda:0 --dtype bfloat16 --delay-ms 43 --prompt-tokens "$p" \
    --new-tokens 64 --n "${NS:-1,16}" --distinct 4 --singles 2 --head-args "$w" --tail-args "$w" \
    --out /tmp/p$p 2>&1 | quiet | grep -E "N=[0-9]+:|rror" | tail -4
  cp /tmp/p$p/jobs.md "$OUT/jobs-$p.md" 2>/dev/null
  grep -h -E "head loop:|tail loop:|Traceback|rror:|exceeds" /tmp/p$p/logs/*.log 2>/dev/null | tail -12 > "$OUT/phases-$p.txt"
done
ls "$OUT"
