#!/usr/bin/env bash
# What the GPU figures in docs/benchmarks.md come from: one device call per part, on nvidia-h200-x2.
#   bench/device.sh ladder    # the ladder (graphs, compiled, 16 in flight, no speculation, eager rows)
#   bench/device.sh checks    # profile_round, gpu_parity, batch_check
#   bench/device.sh parity    # gpu_parity, batch_check
#   bench/device.sh profile   # profile_round only (no HF-layers row)
#   bench/device.sh jobs      # the job path (bench/jobs.py): real tail + head processes, default flags (NS=1,4,...;
#                             TAIL_DEVICE=cuda:0 on one GPU; each job its own seed, SAME_SEED=1: none, lockstep;
#                             GPU utilization and the workers' thread counts per N)
#   bench/device.sh stages    # bench/stages.py: one group's draft / head / tail at B=1..256 against the floor
#                             (7B shapes on cuda:0; STAGES_ARGS=... adds flags)
#   bench/device.sh qparity   # gpu_parity with 4-bit and int8 shards (QUANTS=4bit,int8), in DTYPES (float32;
#                             float16,bfloat16: against HF generate in that dtype, rounding ties counted apart;
#                             a part's cap applies to each quant x dtype run)
#   bench/device.sh card7 card14   # the 16 GB card profile: fp16, every worker capped at 15 GiB (--gpu-memory 15),
#                             7B-shaped split 14/14 (V7: variants) and 14B-shaped 4-bit split 24/24; NS=1,16
#   bench/device.sh plan      # shardflow plan for both shapes
#   bench/device.sh ladder:330 profile:230   # several parts in one call, each capped (seconds)
# ROWS=... picks ladder rows; a capped part keeps what it wrote before the cap in $OUT.
# Wheels the device image lacks travel in .whl/ (see the tool library's device README); logs go to $OUT.
set -uo pipefail
OUT=${OUT:-bench/out/device} QUANTS=${QUANTS:-4bit,int8} DTYPES=${DTYPES:-float32}
mkdir -p "$OUT"
source bench/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for part in "${@:-ladder}"; do
LIMIT=${part#*:}; [ "$LIMIT" = "$part" ] && LIMIT=590
case "${part%%:*}" in
  ladder)
    timeout "$LIMIT" python3 -m bench.ladder --target random:qwen2.5-7b --draft random:qwen2.5-0.5b --split 14 \
      --head-device cuda:0 --tail-device "${TAIL_DEVICE:-cuda:1}" --dtype bfloat16 --delay-ms 43 --alpha 0.78 \
      --new 128 --prompts 2 --max-len 2048 \
      --rows "${ROWS:-spec-compiled,nospec-graphs,spec-graphs,spec-compiled-x16,spec-eager,nospec-eager}" \
      --out "$OUT/ladder" 2>&1 | quiet | tee "$OUT/ladder.log" | grep -v "^ " | tail -40
    ;;
  jobs)
    # VARIANT1 / VARIANT2: more worker configurations ("NAME=HEAD ARGS | TAIL ARGS"), after the defaults
    timeout "$LIMIT" python3 -m bench.jobs --target random:qwen2.5-7b --split 14 --draft random:qwen2.5-0.5b \
      --synthetic 0.78 --head-device cuda:0 --tail-device "${TAIL_DEVICE:-cuda:1}" --dtype bfloat16 --delay-ms 43 \
      --prompt-tokens 128 --new-tokens 128 --n "${NS:-1,4,16,64}" --distinct 16 ${SAME_SEED:+--same-seed} --variant "default=" \
      ${VARIANT1:+--variant "$VARIANT1"} ${VARIANT2:+--variant "$VARIANT2"} \
      --out "$OUT/jobs" 2>&1 | quiet | tee "$OUT/jobs.log" | grep -v "^ " | tail -40
    ;;
  stages)
    # shellcheck disable=SC2086
    timeout "$LIMIT" python3 -m bench.stages --device cuda:0 ${STAGES_ARGS:-} --out "$OUT/stages" 2>&1 | quiet \
      | tee "$OUT/stages.log" | tail -30
    ;;
  qparity)
    for q in ${QUANTS//,/ }; do for d in ${DTYPES//,/ }; do
      timeout "$LIMIT" python3 -m bench.gpu_parity --head-device cuda:0 --tail-device "${TAIL_DEVICE:-cuda:1}" \
        --quant "$q" --dtype "$d" 2>&1 | quiet > "$OUT/qparity-$q-$d.log"; tail -4 "$OUT/qparity-$q-$d.log"
    done; done
    ;;
  card7|card14)
    if [ "${part%%:*}" = card7 ]; then model=(random:qwen2.5-7b --split 14); variants=("${V7:-fp16=}"); else
      model=(random:qwen2.5-14b --split 24); variants=("${V14:-4bit=--quant 4bit | --quant 4bit}"); fi
    vargs=(); IFS=';' read -ra vs <<< "${variants[0]}"; for v in "${vs[@]}"; do vargs+=(--variant "$v"); done
    timeout "$LIMIT" python3 -m bench.jobs --target "${model[@]}" --draft random:qwen2.5-0.5b --synthetic 0.78 \
      --head-device cuda:0 --tail-device "${TAIL_DEVICE:-cuda:1}" --dtype float16 --delay-ms 43 \
      --prompt-tokens 128 --new-tokens 128 --n "${NS:-1,16}" --distinct 16 --singles "${SINGLES:-4}" \
      --head-args "--gpu-memory 15" --tail-args "--gpu-memory 15" "${vargs[@]}" \
      --out "$OUT/${part%%:*}" 2>&1 | quiet | tee "$OUT/${part%%:*}.log" | grep -v "^ " | tail -30
    ;;
  plan)
    for m in "random:qwen2.5-7b --quant none" "random:qwen2.5-14b --quant 4bit"; do
      # shellcheck disable=SC2086
      python3 -m producer plan --plugin bench.synthetic --target $m --draft random:qwen2.5-0.5b --gpus 15GiB,15GiB \
        --dtype float16
    done
    ;;
  profile)
    timeout "$LIMIT" python3 -m bench.profile_round --device cuda:0 --tail-device cuda:1 --compile-draft \
      --no-hf --out "$OUT" 2>&1 | quiet > "$OUT/profile.log"; tail -45 "$OUT/profile.log"
    ;;
  parity)
    timeout "$LIMIT" python3 -m bench.gpu_parity --head-device cuda:0 --tail-device cuda:1 2>&1 | quiet > "$OUT/parity.log"
    tail -8 "$OUT/parity.log"
    timeout 120 python3 -m bench.batch_check --device cuda:0 2>&1 | quiet > "$OUT/batch_check.log"
    tail -8 "$OUT/batch_check.log"
    ;;
  checks)
    python3 -m bench.profile_round --device cuda:0 --tail-device cuda:1 --compile-draft --out "$OUT" 2>&1 \
      | quiet > "$OUT/profile.log"; tail -45 "$OUT/profile.log"
    python3 -m bench.gpu_parity --head-device cuda:0 --tail-device cuda:1 2>&1 | quiet > "$OUT/parity.log"
    tail -8 "$OUT/parity.log"
    python3 -m bench.batch_check --device cuda:0 2>&1 | quiet > "$OUT/batch_check.log"; tail -8 "$OUT/batch_check.log"
    ;;
esac
done
