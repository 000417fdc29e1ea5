#!/usr/bin/env bash
# One device call for Gemma 4 on static caches (issue 28; one nvidia-h200, head and tail sharing it): the CUDA-graph
# cases of tests/test_gemma4.py's static-batch test (carry pytest, pluggy and iniconfig wheels in .whl/ too), then
# the job path of a gemma-4-e2b-shaped split 15/15 (bf16, a gemma-3-1b-shaped drafter, 43 ms each way, synthetic
# alpha 0.78, a seed per job, 128 + 128 tokens, each worker --gpu-memory 0.45) with static caches (the default), with
# growing caches (one sequence at a time, as before), and with graphs asked for.
#   OUT=$OUT bash bench/device_gemma4.sh [JOBS_S]
#   NS=1,16,64 VARIANTS="static=;graphs=--graphs | --graphs" ...
#   STAGES=150 ...     # then bench/stages.py on the same shapes (B = 1, 16, 64; STAGES_ARGS=--graphs: with graphs)
# What comes back: pytest.txt, jobs.json, jobs.md, phases.txt (stages.json with STAGES).
set -uo pipefail
OUT=${OUT:-bench/out/device_gemma4}
mkdir -p "$OUT" /tmp/g
source bench/device_env.sh
if [ "${PYTEST:-1}" != 0 ]; then  # PYTEST=0: the job path only
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m "" -k "static_batches and graphs" tests/test_gemma4.py 2>&1 \
    | quiet | tail -40 > "$OUT/pytest.txt"
  tail -3 "$OUT/pytest.txt"
fi
variants=()
IFS=';' read -ra vs <<< "${VARIANTS:-static=;dynamic=--dynamic-cache | --dynamic-cache;graphs=--graphs | --graphs}"
for v in "${vs[@]}"; do variants+=(--variant "$v"); done
timeout "${1:-420}" python3 -m bench.jobs --target random:gemma-4-e2b --split 15 --draft random:gemma-3-1b \
  --synthetic 0.78 --head-device cuda:0 --tail-device cuda:0 --dtype bfloat16 --delay-ms 43 --prompt-tokens 128 \
  --new-tokens 128 --n "${NS:-1,16}" --distinct 16 --singles 3 --head-args "--gpu-memory 0.45" \
  --tail-args "--gpu-memory 0.45" "${variants[@]}" --out /tmp/g/jobs 2>&1 | quiet | grep -E "^\||N=[0-9]+:|rror" | tail -20
cp /tmp/g/jobs/jobs.json /tmp/g/jobs/jobs.md "$OUT"/ 2>/dev/null
grep -h -E "head loop:|tail loop:|captured|memory:|Traceback|Error" /tmp/g/jobs/logs/*.log 2>/dev/null | tail -80 > "$OUT/phases.txt"
for f in /tmp/g/jobs/logs/*.log; do grep -q Traceback "$f" && grep -v "^\[" "$f" | tail -60 > "$OUT/error-$(basename "$f")"; done
if [ "${STAGES:-0}" != 0 ]; then
  timeout "$STAGES" python3 -m bench.stages --device cuda:0 --target random:gemma-4-e2b --split 15 \
    --draft random:gemma-3-1b --b 1,16,64 --iters 10 --no-reference ${STAGES_ARGS:-} --out /tmp/g/stages 2>&1 | quiet | tail -8
  cp /tmp/g/stages/stages.json "$OUT"/ 2>/dev/null
fi
ls "$OUT"
