#!/usr/bin/env bash
# The spine's device tier on a GPU host, each arm beside its bound in one
# `fathom bench` run (docs/bench.md): K3DIM (8.03 GB of spine a pass)
# resident on the GPU; with --ram-budget 5GB, so the RAM plan reads every
# layer and the head for every pass, and room in VRAM for all of them
# (held on the device); with --vram-budget 5GB (some held, the rest read);
# and with --vram-budget 1GB (none held: every layer read from disk for
# every pass, as before the device tier). Runs on the device from the
# repository root after scripts/gpu-pack.sh's run.sh has unpacked
# target/release/fathom:
#
#   bash scripts/gpu-tiers.sh
#
# Output goes to stdout and $OUT/tiers.log (or target/gpu/tiers.log).
set -uo pipefail
log="${OUT:-target/gpu}/tiers.log"
exec > >(tee -a "$log") 2>&1
m=/tmp/fathom-k3dim
fathom=target/release/fathom
[ -d "$m" ] || $fathom synth --preset k3 --layers 4 --experts 16 --top-k 4 --out "$m" | tail -1
$fathom inspect "$m" --context 4096 --ram-budget 5GB --vram-budget 5GB | grep -E 'on the device|streamed layers|read per pass|  head'
p8=1,2,3,4,5,6,7,8
timeout 400 $fathom bench --model "$m" --prompt-ids "$p8" --max-new 6 --reps 1 --warmup 1 \
  --arm 'gpu=--experts resident --device cuda --context 4096 --ignore-eos' \
  --arm 'held=--device cuda --context 4096 --ram-budget 5GB --ignore-eos' \
  --arm 'v5=--device cuda --context 4096 --ram-budget 5GB --vram-budget 5GB --ignore-eos' \
  --arm 'v1=--device cuda --context 4096 --ram-budget 5GB --vram-budget 1GB --ignore-eos' |
  tail -22
# Where a held run's bytes went: copied once, none read for a pass.
timeout 100 $fathom run --model "$m" --prompt-ids "$p8" --max-new 16 --ignore-eos --json --stats \
  --device cuda --context 4096 --ram-budget 5GB 2>/dev/null |
  python3 -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; g=s.get("gpu") or {}; print("held: decode tok/s", round(s["decode_tok_s"],2), "device layers", s.get("spine_device_layers"), "held bytes copied", g.get("h2d_held_bytes"), "spine bytes read", s["spine_bytes_read"], "peak RSS", s["peak_rss_bytes"], "cpu products", g.get("cpu_products"), "ids", d["output_ids"][:8])'
