#!/usr/bin/env bash
# The spine's GPU tier on a GPU host, each arm beside its bound in one
# `fathom bench` run (docs/bench.md): K3DIM resident on the GPU, with
# --vram-budget below its 8.03 GB spine, and with the spine also read from
# disk for every pass. Runs on the device from the repository root after
# scripts/gpu-pack.sh's run.sh has unpacked target/release/fathom:
#
#   bash scripts/gpu-tiers.sh [FATHOM]   # FATHOM: another build to time
#                                        # the 5 GB arm with, beside it
#
# Output goes to stdout and $OUT/tiers.log (or target/gpu/tiers.log).
set -uo pipefail
log="${OUT:-target/gpu}/tiers.log"
exec > >(tee -a "$log") 2>&1
m=/tmp/fathom-k3dim
fathom=target/release/fathom
[ -d "$m" ] || $fathom synth --preset k3 --layers 4 --experts 16 --top-k 4 --out "$m" | tail -1
p8=1,2,3,4,5,6,7,8
timeout 300 $fathom bench --model "$m" --prompt-ids "$p8" --max-new 8 --reps 2 --warmup 1 \
  --arm 'gpu=--experts resident --device cuda --context 4096 --ignore-eos' \
  --arm 'v5=--experts resident --device cuda --context 4096 --vram-budget 5GB --ignore-eos' \
  --arm 'v5d=--device cuda --context 4096 --vram-budget 5GB --ram-budget 9GB --spine-resident-layers 0 --ignore-eos' |
  tail -12
if [ -n "${1:-}" ]; then
  for b in "$1" "$fathom"; do
    echo "== $b, --vram-budget 5GB"
    timeout 100 "$b" run --model "$m" --prompt-ids "$p8" --max-new 16 --ignore-eos --json \
      --experts resident --device cuda --context 4096 --vram-budget 5GB 2>/dev/null |
      python3 -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; g=s.get("gpu_decode") or {}; print("decode tok/s", round(s["decode_tok_s"],2), "h2d bytes", g.get("h2d_bytes"), "cpu products", g.get("cpu_products"), "ids", d["output_ids"][:8])'
  done
fi
