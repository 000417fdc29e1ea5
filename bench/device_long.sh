#!/usr/bin/env bash
# One device call for long contexts (issue 27; one nvidia-h200): one group's stages (bench/stages.py) with keys read
# in chunks past pool_attention.LONG_REACH and without (LONG_REACH raised past every row), at CTXS (B = 1, 16), then
# at ctx 256 (B = BS, no chunks: a regression check), then the job path with long prompts (head and tail sharing the
# GPU, --gpu-memory 0.45 each, 43 ms each way, synthetic alpha 0.78), every greedy output checked against the
# no-speculation reference.
#   OUT=$OUT bash bench/device_long.sh [JOBS_S]      # JOBS_S: the job path's cap in seconds (0 skips it)
#   CTXS=8192 BS=1,16,128 PROMPT=4000 NS=1,8 WHOLE= ...     # WHOLE empty: no run without chunks
# What comes back: stages-<ctx>[-whole].log, stages-256.log, jobs.md, phases.txt.
set -uo pipefail
OUT=${OUT:-bench/out/device_long}
mkdir -p "$OUT" /tmp/o
source bench/device_env.sh
# bench.stages with every row below LONG_REACH: keys never in chunks
whole=(python3 -c "import sys; import workers.engine.pool_attention as p; p.LONG_REACH = 1 << 30
from bench.stages import main; sys.argv[0] = 'stages'; main()")
IFS=',' read -ra ctxs <<< "${CTXS:-8192}"
for c in "${ctxs[@]}"; do
  args=(--device cuda:0 --b 1,16 --ctx "$c" --max-len $((c + 256)) --iters 10 --no-reference)
  timeout 200 python3 -m bench.stages "${args[@]}" --out /tmp/o/c$c 2>&1 | quiet | grep -E "^B=|\|" > "$OUT/stages-$c.log"
  [ -n "${WHOLE-1}" ] && timeout 200 "${whole[@]}" "${args[@]}" --out /tmp/o/w$c 2>&1 | quiet | grep -E "^B=|\|" > "$OUT/stages-$c-whole.log"
  tail -n 3 "$OUT"/stages-"$c"*.log
done
timeout 200 python3 -m bench.stages --device cuda:0 --b "${BS:-1,16,128}" --iters 10 --no-reference --out /tmp/o/s256 \
  2>&1 | quiet | grep -E "^B=|\|" > "$OUT/stages-256.log"
tail -n 4 "$OUT/stages-256.log"
[ "${1:-240}" != 0 ] && timeout "${1:-240}" python3 -m bench.jobs --target random:qwen2.5-7b --split 14 \
  --draft random:qwen2.5-0.5b --synthetic 0.78 --head-device cuda:0 --tail-device cuda:0 --dtype bfloat16 --delay-ms 43 \
  --prompt-tokens "${PROMPT:-4000}" --new-tokens 64 --n "${NS:-1,8}" --distinct 4 --singles 2 \
  --head-args "--gpu-memory 0.45" --tail-args "--gpu-memory 0.45" --out /tmp/o/jobs 2>&1 | quiet | grep -E "^\||N=[0-9]+:|rror" | tail -8
cp /tmp/o/jobs/jobs.md "$OUT/jobs.md" 2>/dev/null
grep -h -E "head loop:|tail loop:|captured|Traceback|rror:" /tmp/o/jobs/logs/*.log 2>/dev/null | tail -30 > "$OUT/phases.txt"
ls "$OUT"
