#!/usr/bin/env bash
# One device call for issue 26's figures (one nvidia-h200, head and tail sharing it): the job path at N = 1, 64,
# 256 with py-spy on both workers and their loops' phase lines, then bench/stages.py and bench/attn_variants.py.
#   OUT=$OUT bash bench/device_round.sh [JOBS_S] [STAGES_S] [ATTN_S]     # each part capped (seconds; 0 skips it)
#   NS=64,256 VARIANTS="auto=;g2=--groups 2;g8=--groups 8" ...           # other batch sizes, variants (';' between)
#   JOBS_ARGS="-k 4" SHARDFLOW_ENGINE__GRAPH_K=4 ...                      # more bench.jobs flags; settings by env
# What comes back (flat, at most 8 files): jobs.json, jobs.md, spy-summary.txt (the raw spy-head.txt and
# spy-tail.txt too with KEEP_SPY=1), cpu.txt, phases.txt, stages.json, attn.json.
#   SPY_ARGS=--gil NS=256 OUT=$OUT bash bench/device_round.sh 250 0 0   # which threads spend the interpreter lock
#   SPY=0 ...                                                            # without py-spy (its samples perturb the stages)
set -uo pipefail
OUT=${OUT:-bench/out/device_round}
mkdir -p "$OUT" /tmp/o
source bench/device_env.sh
variants=()
IFS=';' read -ra vs <<< "${VARIANTS:-default=}"
for v in "${vs[@]}"; do variants+=(--variant "$v"); done
spy=(bench/spy.sh /tmp/o); [ "${SPY:-1}" = 0 ] && spy=()  # SPY=0: no py-spy on the workers (stage times unperturbed)
timeout "${1:-330}" "${spy[@]}" python3 -m bench.jobs --target random:qwen2.5-7b --split 14 \
  --draft random:qwen2.5-0.5b --synthetic 0.78 --head-device cuda:0 --tail-device cuda:0 --dtype bfloat16 \
  --delay-ms 43 --prompt-tokens 128 --new-tokens 128 --n "${NS:-1,64,256}" --distinct 16 --singles 3 \
  --head-args "--gpu-memory 0.45" --tail-args "--gpu-memory 0.45" "${variants[@]}" ${JOBS_ARGS:-} --out /tmp/o/jobs 2>&1 \
  | quiet | grep -E "^\||N=[0-9]+:|rror" | tail -30
cp /tmp/o/jobs/jobs.json /tmp/o/jobs/jobs.md /tmp/o/cpu.txt "$OUT"/ 2>/dev/null
for role in head tail; do  # each worker's samples by thread, then the busiest threads' functions (bench/spy_threads.py)
  [ -s /tmp/o/spy-$role.txt ] || continue
  python3 -m bench.spy_threads /tmp/o/spy-$role.txt --top 30
  for t in ${SPY_THREADS:-head-loop head-sender head-receiver progress finisher MainThread}; do
    python3 -m bench.spy_threads /tmp/o/spy-$role.txt --top 30 --thread "$t" | sed -n '/^functions/,$p'
  done
done > "$OUT/spy-summary.txt" 2>&1
[ -n "${KEEP_SPY:-}" ] && cp /tmp/o/spy-*.txt "$OUT"/ 2>/dev/null
grep -h -E "head loop:|head senders:|head relay:|tail loop:|captured|memory:|Traceback|Error" /tmp/o/jobs/logs/*.log > "$OUT/phases.txt"
[ "${2:-200}" != 0 ] && timeout "${2:-200}" python3 -m bench.stages --device cuda:0 --b 1,16,64,128,256 --iters 10 --no-reference \
  --out /tmp/o/stages 2>&1 | quiet | tail -12
cp /tmp/o/stages/stages.json "$OUT"/ 2>/dev/null
[ "${3:-90}" != 0 ] && timeout "${3:-90}" python3 -m bench.attn_variants --out /tmp/o/attn 2>&1 | quiet | tail -10
cp /tmp/o/attn/attn.json "$OUT"/ 2>/dev/null
ls "$OUT"
