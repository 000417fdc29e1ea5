#!/usr/bin/env bash
# The device calls behind docs/benchmarks.md's GPU figures: `bench/device.sh PART[:SECONDS] ...` runs each part in
# turn, each capped in seconds (590 if not given; families and qparity: each run of the part), from the repo root on
# a machine with one GPU (head and tail share cuda:0; TAIL_DEVICE=cuda:1 puts the tail on a second card). Wheels the
# device image lacks travel in .whl/ (bench/device_env.sh); what comes back goes to $OUT, progress to stdout.
#   OUT=$OUT bash bench/device.sh jobs:330                  # the job path, the shared setup, N = 1, 64, 256
#   NS=256 VARIANTS="auto=;g2=--groups 2" OUT=$OUT bash bench/device.sh jobs:480 stages:200
# The shared setup (docs/benchmarks.md): random:<preset> weights through the bench.synthetic plugin, bf16, synthetic
# acceptance 0.78, 128-token prompts (16 distinct, cycled), 128 new tokens, a seed per job, the head's link to Redis
# LINK (a bench/link.py profile: wan, 43 ms each way, no cap, unless set), each worker --gpu-memory 0.45; the N=1 row
# runs 3 prompts one at a time.
# Parts:
#   jobs      the job path (bench.jobs) at NS (1,64,256) for TARGET=preset:split:drafter (qwen2.5-7b:14:qwen2.5-0.5b);
#             VARIANTS="NAME=HEAD ARGS | TAIL ARGS;..." (default=), HEAD_ARGS / TAIL_ARGS (every variant's worker
#             flags), JOBS_ARGS (more bench.jobs flags; a flag given again wins: JOBS_ARGS="--prompt-tokens 8000
#             --new-tokens 64" with HEAD_ARGS=TAIL_ARGS="--gpu-memory 0.45 --max-len 32768 --slots 16" for long
#             prompts), settings by environment (SHARDFLOW_ENGINE__GRAPH_K=4 ...)
#   families  the jobs part for each FAMILIES="preset:split:drafter ..." (NS 1,16), each capped
#   gemma4    tests/test_gemma4.py's CUDA-graph static-batch cases (carry pytest, pluggy and iniconfig in .whl/;
#             PYTEST=0 skips them), then the jobs part on gemma-4-e2b:15:gemma-3-1b (NS 1,16) with static caches,
#             growing caches and graphs asked for (VARIANTS)
#   ab        code against code: the jobs part (NS 256) for the working tree and for a base commit's export,
#             alternating on one machine (ORDER="new base new base"; "new:SHARDFLOW_X=1,SHARDFLOW_Y=2": that run's
#             settings). Before the call: rm -rf .clean/base && mkdir -p .clean/base && git archive BASE | tar -x -C
#             .clean/base, and carry .clean (NEW_DIR=.clean/new: an export of a commit as "new", not the working
#             tree); BASE_LINK=PROFILE with BASE_LINK_ARGS="--delay-ms 43" runs a base from
#             before bench/link.py through that profile
#   stages    bench.stages on cuda:0 (STAGES_ARGS: its flags, e.g. "--b 16,128 --iters 10 --no-reference")
#   qparity   bench.gpu_parity for each of QUANTS (4bit,int8; none) x DTYPES (float32; float16, bfloat16)
#   card7 card14   the 16 GB card profile: float16, every worker --gpu-memory 15, NS 1,16, SINGLES 4 prompts
#             one at a time; 7B-shaped split 14/14 (V7: variants, default fp16=) and 14B-shaped 4-bit 24/24 (V14)
#   plan      `shardflow plan` for both 16 GB shapes
#   nstage    N stages on the card (issue 59): 14B-shaped fp16 and 32B-shaped 4-bit over 4 workers of 15 GiB, each
#             43 ms from Redis, and the plan's memory for both (NAME-plan.txt)
# What comes back: per run of the job path NAME.json / NAME.md (bench.jobs' jobs.json / jobs.md), NAME-phases.txt
# (the workers' loop phase lines) and NAME-error-*.log where a worker raised (NAME: jobs, the family preset, gemma4,
# ab-<i>-<new|base>, card7, card14); ab.md (the ab runs' rows in order), pytest.txt, stages.json / stages.md,
# qparity-<quant>-<dtype>.log, and each part's log.
set -uo pipefail
OUT=${OUT:-bench/out/device} QUANTS=${QUANTS:-4bit,int8} DTYPES=${DTYPES:-float32} TAIL=${TAIL_DEVICE:-cuda:0}
mkdir -p "$OUT" /tmp/sf
OUT=$(cd "$OUT" && pwd) ROOT=$PWD
source bench/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader

# job_path NAME CAP PRESET:SPLIT:DRAFTER NS [bench.jobs flags]: one bench.jobs call in the shared setup ("$@" after
# its defaults, JOBS_ARGS last: a flag given again wins); keeps its results in $OUT as NAME.*
job_path() {
  local name=$1 cap=$2 preset split draft ns=$4
  IFS=: read -r preset split draft <<< "$3"
  shift 4
  echo "== $name: $preset split $split, drafter $draft, N = $ns"
  # shellcheck disable=SC2086
  timeout "$cap" python3 -m bench.jobs --target "random:$preset" --split "$split" --draft "random:$draft" \
    --synthetic 0.78 --head-device cuda:0 --tail-device "$TAIL" --dtype bfloat16 ${LINK_ARGS:---link ${LINK:-wan}} --prompt-tokens 128 \
    --new-tokens 128 --n "$ns" --distinct 16 --singles 3 --head-args "${HEAD_ARGS:---gpu-memory 0.45}" \
    --tail-args "${TAIL_ARGS:---gpu-memory 0.45}" "$@" ${JOBS_ARGS:-} --out "/tmp/sf/$name" 2>&1 | quiet \
    | tee "$OUT/$name.log" | grep -E "^\||N=[0-9]+:|rror" | tail -30
  cp "/tmp/sf/$name/jobs.json" "$OUT/$name.json" 2>/dev/null
  cp "/tmp/sf/$name/jobs.md" "$OUT/$name.md" 2>/dev/null
  grep -h -E "head loop:|head senders:|head relay:|tail loop:|tail intake:|captured|memory:|Traceback|rror:" \
    /tmp/sf/"$name"/logs/*.log 2>/dev/null | tail -80 > "$OUT/$name-phases.txt"
  for f in /tmp/sf/"$name"/logs/*.log; do
    grep -q Traceback "$f" 2>/dev/null && grep -v "^\[" "$f" | tail -60 > "$OUT/$name-error-$(basename "$f")"
  done
}

# variants "NAME=HEAD ARGS | TAIL ARGS;...": bench.jobs' --variant flags, in the array `vargs`
variants() { vargs=(); local vs v; IFS=';' read -ra vs <<< "$1"; for v in "${vs[@]}"; do vargs+=(--variant "$v"); done; }

for part in "${@:-jobs}"; do
LIMIT=${part#*:}; [ "$LIMIT" = "$part" ] && LIMIT=590
case "${part%%:*}" in
  jobs)
    variants "${VARIANTS:-default=}"
    job_path jobs "$LIMIT" "${TARGET:-qwen2.5-7b:14:qwen2.5-0.5b}" "${NS:-1,64,256}" "${vargs[@]}"
    ;;
  families)
    for spec in ${FAMILIES:-qwen3-8b:18:qwen3-0.6b gemma-3-12b:24:gemma-3-1b gpt-oss-20b:12:o200k-0.5b qwen2.5-7b:14:qwen2.5-0.5b}; do
      job_path "${spec%%:*}" "$LIMIT" "$spec" "${NS:-1,16}"
    done
    ;;
  gemma4)
    if [ "${PYTEST:-1}" != 0 ]; then
      timeout 240 python3 -m pytest -q -p no:cacheprovider -m "" -k "static_batches and graphs" tests/test_gemma4.py \
        2>&1 | quiet | tail -40 > "$OUT/pytest.txt"
      tail -3 "$OUT/pytest.txt"
    fi
    variants "${VARIANTS:-static=;dynamic=--dynamic-cache | --dynamic-cache;graphs=--graphs | --graphs}"
    job_path gemma4 "$LIMIT" gemma-4-e2b:15:gemma-3-1b "${NS:-1,16}" "${vargs[@]}"
    ;;
  ab)
    i=0
    if [ -n "${BASE_LINK:-}" ]; then
      # a base from before bench/link.py: its delay proxy gives way to this tree's link, profile BASE_LINK (its
      # bench.jobs then runs with BASE_LINK_ARGS="--delay-ms 43", any delay > 0 turning the proxy on)
      cp bench/link.py .clean/base/bench/link.py
      printf '%s\n' "from contextlib import contextmanager" "from bench.link import parse_link, spawn_link" \
        "@contextmanager" "def spawn_proxy(upstream_port, delay_s, upstream_host='127.0.0.1'):" \
        "    with spawn_link(upstream_port, parse_link('$BASE_LINK'), upstream_host) as link:" \
        "        yield link.port" > .clean/base/bench/delay_proxy.py
    fi
    for run in ${ORDER:-new base}; do
      i=$((i + 1)); name=${run%%:*}; envs=()
      [ "$run" != "$name" ] && IFS=',' read -ra envs <<< "${run#*:}"
      dir=${NEW_DIR:-$ROOT}; [ "$name" = base ] && dir=$ROOT/.clean/base  # NEW_DIR: a commit's export as "new"
      # the base's own modules first: `python -m` puts its directory (the cwd) first, PYTHONPATH the wheels after;
      # a base from before bench/link.py (BASE_LINK_ARGS, e.g. "--delay-ms 43") gets its own link flags
      la=${LINK_ARGS:-}; [ "$name" = base ] && la=${BASE_LINK_ARGS:-$la}
      (cd "$dir" && export "${envs[@]}" PYTHONPATH=/tmp/site:$dir LINK_ARGS="$la" && job_path "ab-$i-$name" "$LIMIT" \
        qwen2.5-7b:14:qwen2.5-0.5b "${NS:-256}")
      # the first table only (the second, where a round goes, has rows of the same variant)
      awk '/^\|/ { t = 1; print; next } t { exit }' "$OUT/ab-$i-$name.md" 2>/dev/null | grep -E "^\| default" | head -3 \
        | sed "s/^| default/| $i ${run//|/ }/" >> "$OUT/ab.md"
    done
    cat "$OUT/ab.md"
    ;;
  stages)
    # shellcheck disable=SC2086
    timeout "$LIMIT" python3 -m bench.stages --device cuda:0 ${STAGES_ARGS:-} --out "$OUT/stages" 2>&1 | quiet \
      | tee "$OUT/stages.log" | tail -30
    ;;
  qparity)
    for q in ${QUANTS//,/ }; do for d in ${DTYPES//,/ }; do
      timeout "$LIMIT" python3 -m bench.gpu_parity --head-device cuda:0 --tail-device "$TAIL" --quant "$q" --dtype "$d" \
        2>&1 | quiet > "$OUT/qparity-$q-$d.log"; tail -4 "$OUT/qparity-$q-$d.log"
    done; done
    ;;
  card7|card14)
    if [ "${part%%:*}" = card7 ]; then model=qwen2.5-7b:14:qwen2.5-0.5b; variants "${V7:-fp16=}"
    else model=qwen2.5-14b:24:qwen2.5-0.5b; variants "${V14:-4bit=--quant 4bit | --quant 4bit}"; fi
    HEAD_ARGS="--gpu-memory 15" TAIL_ARGS="--gpu-memory 15" job_path "${part%%:*}" "$LIMIT" "$model" "${NS:-1,16}" \
      --dtype float16 --singles "${SINGLES:-4}" "${vargs[@]}"
    ;;
  nstage)
    # issue 59 on one card: every worker --gpu-memory 15 (a T4's worth) and 43 ms from Redis (each its own `wan`
    # link); 14B-shaped fp16 over 4 workers at the plan's cuts (NS 1,16), 32B-shaped 4-bit over 4 (N 1); then the
    # plan of both, whose memory columns the workers' "memory:" lines (NAME-phases.txt) are compared with
    links="--link wan --tail-link wan --stage-link wan"
    for spec in "n14:qwen2.5-14b:9,23,37:--gpu-memory 15:${NS:-1,16}" "n32:qwen2.5-32b:10,30,50:--gpu-memory 15 --quant 4bit:1"; do
      IFS=: read -r name preset cuts flags ns <<< "$spec"
      LINK_ARGS=$links HEAD_ARGS=$flags TAIL_ARGS=$flags job_path "$name" "$LIMIT" "$preset:${cuts%%,*}:qwen2.5-0.5b" "$ns" \
        --dtype float16 --stages 4 --cuts "$cuts" --stage-args "$flags"
      quant=none; [[ $flags == *4bit* ]] && quant=4bit
      python3 -m producer plan --plugin bench.synthetic --target "random:$preset" --draft random:qwen2.5-0.5b \
        --quant "$quant" --dtype float16 --gpus 15GiB,15GiB,15GiB,15GiB --stages 4 > "$OUT/$name-plan.txt" 2>&1
      tail -12 "$OUT/$name-plan.txt"
    done
    ;;
  plan)
    for m in "random:qwen2.5-7b --quant none" "random:qwen2.5-14b --quant 4bit"; do
      # shellcheck disable=SC2086
      python3 -m producer plan --plugin bench.synthetic --target $m --draft random:qwen2.5-0.5b --gpus 15GiB,15GiB \
        --dtype float16
    done
    ;;
  *) echo "unknown part ${part%%:*}: jobs families gemma4 ab stages qparity card7 card14 plan nstage" >&2 ;;
esac
done
ls "$OUT"
