#!/usr/bin/env bash
# One device call for issue 27's kernel figures (one nvidia-h200): whether attention over the pools in place runs
# (workers/engine/pool_attention.py probe), then bench/stages.py with it and with gathered copies, top kernels at
# PROFILE_B, and long contexts (CTXS, B=16).
#   OUT=$OUT bash bench/device_kernels.sh [STAGES_S] [GATHER_S] [LONG_S]     # each part capped (seconds; 0 skips)
#   BS=1,16,64,128,256 PROFILE_B=128 CTXS=2048,8192 ...
# What comes back: probe.txt, stages-in_place.json, stages-gather.json, long-<ctx>.json, and the logs.
set -uo pipefail
OUT=${OUT:-bench/out/device_kernels}
mkdir -p "$OUT"
source bench/device_env.sh
python3 - <<'EOF' 2>&1 | tee "$OUT/probe.txt"
import torch
from workers.engine import pool_attention as pa
print(torch.__version__, torch.cuda.get_device_name(0))
print(torch.ops.aten._flash_attention_forward.default._schema)
for dt in (torch.bfloat16, torch.float16):
    for d in (64, 128):
        print(dt, d, "supported:", pa.supported(torch.device("cuda:0"), dt, d))
EOF
BS=${BS:-1,16,64,128,256}
[ "${1:-240}" != 0 ] && timeout "${1:-240}" python3 -m bench.stages --device cuda:0 --b "$BS" --iters 10 \
  --attention auto --profile "${PROFILE_B:-128}" --out /tmp/o/in_place 2>&1 | quiet | tee "$OUT/stages-in_place.log" | tail -60
cp /tmp/o/in_place/stages.json "$OUT/stages-in_place.json" 2>/dev/null
[ "${2:-200}" != 0 ] && timeout "${2:-200}" python3 -m bench.stages --device cuda:0 --b "$BS" --iters 10 \
  --attention gather --no-reference --profile "${PROFILE_B:-128}" --out /tmp/o/gather 2>&1 | quiet \
  | tee "$OUT/stages-gather.log" | tail -40
cp /tmp/o/gather/stages.json "$OUT/stages-gather.json" 2>/dev/null
IFS=',' read -ra ctxs <<< "${CTXS:-2048,8192}"
for c in "${ctxs[@]}"; do
  [ "${3:-200}" != 0 ] && timeout "${3:-200}" python3 -m bench.stages --device cuda:0 --b 1,16 --ctx "$c" \
    --max-len $((c + 256)) --iters 5 --out /tmp/o/long-$c 2>&1 | quiet | tail -6
  cp /tmp/o/long-$c/stages.json "$OUT/long-$c.json" 2>/dev/null
done
ls "$OUT"
