#!/usr/bin/env bash
# Packs what a GPU machine runs, for a device machine that has no Rust
# toolchain: builds fathom, the GPU test binaries (kernels-cuda's parity,
# sets, glu, graphs, mla, gqa, kda; the CLI's device tests), bench_cuda and
# host_time, strips them and compresses them into target/gpu/gpu.tar.xz
# (target/ is ignored: carry target/gpu). It also writes target/gpu/run.sh,
# which runs there from the repository root:
#
#   bash target/gpu/run.sh [tests|graphs|bench|prefill|ae|d|bc|tiers]...
#                                   (default: tests graphs bench)
#
# tests:  the GPU tests in order of importance, each under a time limit;
# graphs: a K3-dimension synth made there, decoded resident on the GPU
#         with and without --no-cuda-graphs, interleaved, three pairs;
# bench:  bench_cuda (kernel times, graphs on and off);
# prefill: K3DIM prefill of 512 and 4,096 tokens, the tiled products and
#         the head-grouped MLA attention on and off;
# ae, d, bc: the GPU figures of docs/bench.md through `fathom bench`, each
#         beside its bound from the same run: (a) with (e), (d), then (b)
#         and (c) (docs/bench.md gives the latest of each);
# tiers:  the spine's device tier (scripts/gpu-tiers.sh).
# A summary goes to the output and $OUT/log, every line of the tests and
# runs to $OUT/full.log ($OUT or target/gpu); the exit status is 1 when a
# test binary failed. The CLI's device tests look for the
# fixtures at the path they were built at: run.sh links that path to the
# repository there when they differ.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
out=target/gpu
mkdir -p "$out/bin"

cargo build --release -p fathom-cli
cargo build --release -p fathom-kernels-cuda --example bench_cuda
cargo build --release -p fathom-model --example host_time
tests=$(cargo test --release --no-run --message-format=json \
  -p fathom-kernels-cuda -p fathom-cli \
  --test parity --test spine_copy --test mxfp4 --test sets --test glu --test graphs --test mla --test gqa --test kda --test device |
  python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
')
while read -r name exe; do
  cp "$exe" "$out/bin/$name"
done <<<"$tests"
cp target/release/fathom target/release/examples/bench_cuda target/release/examples/host_time "$out/bin/"
strip "$out"/bin/*
# Written beside, then renamed: a copy of target/gpu taken meanwhile sees
# the old pack or the new one, never half of one.
tar -C "$out/bin" -cJf "$out/gpu.tar.xz.part" .
mv "$out/gpu.tar.xz.part" "$out/gpu.tar.xz"
rm -rf "$out/bin"

{
  echo '#!/usr/bin/env bash'
  echo '# Written by scripts/gpu-pack.sh; run from the repository root on the device.'
  printf 'built=%q\n' "$root"
} >"$out/run.sh"
cat >>"$out/run.sh" <<EOF
set -uo pipefail
dir=\${OUT:-target/gpu}
full="\$dir/full.log"
exec > >(tee -a "\$dir/log") 2>&1
bin=target/gpu/bin
mkdir -p "\$bin" target/release
tar -C "\$bin" -xJf target/gpu/gpu.tar.xz
cp "\$bin/fathom" target/release/fathom
failed=0
# Runs a test binary: every line to the full log, the results and any
# panic with its message here; a failure is remembered.
check() {
  local name=\$1; shift
  echo "== \$name"
  "\$@" 2>&1 | tee -a "\$full" | grep -E -A4 "^test |FAIL|panicked|test result|skipped" | grep -v "^--"
  [ "\${PIPESTATUS[0]}" -eq 0 ] || failed=1
}
if [ "\$(pwd)" != "\$built" ] && [ ! -e "\$built" ]; then
  mkdir -p "\$(dirname "\$built")" && ln -s "\$(pwd)" "\$built"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
steps=("\$@"); [ \${#steps[@]} -eq 0 ] && steps=(tests graphs bench)
for step in "\${steps[@]}"; do
  case "\$step" in
  tests)
    for t in parity spine_copy mxfp4 sets glu graphs mla gqa kda; do
      check "\$t" timeout 300 "\$bin/\$t"
    done
    check device timeout 900 "\$bin/device" --test-threads 2
    ;;
  graphs)
    m=/tmp/fathom-k3dim
    [ -d "\$m" ] || target/release/fathom synth --preset k3 --layers 4 --experts 16 --top-k 4 --out "\$m" >/dev/null
    for i in 1 2 3; do
      for g in "" "--no-cuda-graphs"; do
        target/release/fathom run --model "\$m" --prompt-ids 1,2,3,4,5,6,7,8 --max-new 32 --ignore-eos \\
          --experts resident --device cuda --context 4096 --json \$g 2>>"\$full" |
          python3 -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; g=s["gpu_decode"]; n=max(1,s["generated_tokens"]-1)
print(sys.argv[1] or "graphs", round(s["decode_tok_s"],1), "tok/s; kernel ms/token", round(g["kernel_ms"]/n,3), "; calls", g["device_calls"], "replayed", g["graph_launches"], "built", g["graph_builds"], "failed", g["graph_failures"], g.get("last_error"))' "\$g"
      done
    done
    ;;
  bench)
    timeout 300 "\$bin/bench_cuda" || failed=1
    ;;
  prefill)
    # Prefill of 512 and 4,096 tokens on the GPU, resident and with the
    # routed experts in host RAM (--vram-budget 9GB): as it runs, with MLA
    # attention a head a block (MLA_HEADS=0), and with that and the tiled
    # products off too (TILES=0).
    m=/tmp/fathom-k3dim
    [ -d "\$m" ] || target/release/fathom synth --preset k3 --layers 4 --experts 16 --top-k 4 --out "\$m" >/dev/null
    for n in 512 4096; do
      ids=\$(python3 -c "print(','.join(str(1 + (7 * i) % 1000) for i in range(\$n)))")
      for place in "" "--vram-budget 9GB"; do
        for knobs in "" "MLA_HEADS=0" "TILES=0 MLA_HEADS=0"; do
          FATHOM_CUDA_DEFINES="\$knobs" timeout 120 target/release/fathom run --model "\$m" --prompt-ids "\$ids" \\
            --max-new 2 --experts resident --device cuda --context 8192 --json \$place 2>>"\$full" |
            python3 -c 'import json,sys; d=json.load(sys.stdin); s=d["stats"]; g=s.get("gpu") or {}
print(sys.argv[1], sys.argv[2] or "resident", sys.argv[3] or "tiled", "prefill tok/s", round(s["prefill_tok_s"],1), "kernel ms", round(g.get("kernel_ms",0)), "tiled", g.get("tiled_launches"), "launches", g.get("kernel_launches"), "ids", d["output_ids"])' "\$n" "\$place" "\$knobs" || failed=1
        done
      done
    done
    ;;
  ae)
    # (a) resident K3-dimension synth on the GPU, (e) the CPU, one run.
    m=/tmp/fathom-k3dim
    [ -d "\$m" ] || target/release/fathom synth --preset k3 --layers 4 --experts 16 --top-k 4 --out "\$m" >/dev/null
    timeout 300 target/release/fathom bench --model "\$m" --prompt-ids 1,2,3,4,5,6,7,8 --max-new 32 \\
      --reps 2 --warmup 1 --arm 'a=--experts resident --device cuda --context 4096' \\
      --arm 'e=--experts resident --context 4096' 2>>"\$full" | tail -16 || failed=1
    ;;
  d)
    # (d) batch 8: eight 8-token prompts, against batch 1 and one by one.
    m=/tmp/fathom-k3dim
    [ -d "\$m" ] || target/release/fathom synth --preset k3 --layers 4 --experts 16 --top-k 4 --out "\$m" >/dev/null
    python3 -c 'import json
for i in range(8): print(json.dumps({"prompt_ids": [(1 + 37 * i + 11 * j) % 1000 + 1 for j in range(8)]}))' >/tmp/fathom-p8.jsonl
    timeout 300 target/release/fathom bench --model "\$m" --prompts /tmp/fathom-p8.jsonl --batch-sizes 1,8 \\
      --max-new 16 --reps 1 --arm 'd=--experts resident --device cuda --context 4096' 2>>"\$full" | tail -8 || failed=1
    ;;
  bc)
    # (b) an 8-layer 64-expert top-16 K3 synth streamed from page-locked
    # RAM with 13 GB of VRAM and a heat map; (c) a 4-layer 64-expert
    # synth from disk, the CPU from disk beside it. About 37 GB of disk.
    m=/tmp/fathom-m8
    [ -d "\$m" ] || target/release/fathom synth --preset k3 --layers 8 --experts 64 --top-k 16 --out "\$m" | tail -1
    target/release/fathom run --model "\$m" --prompt-ids 1,2,3,4,5,6,7,8 --max-new 16 --experts stream \\
      --ram-budget 40GB --context 4096 --heat-out /tmp/fathom-heat.json >/dev/null 2>>"\$full"
    timeout 300 target/release/fathom bench --model "\$m" --prompt-ids 1,2,3,4,5,6,7,8 --max-new 16 --reps 1 \\
      --warmup 1 --arm 'b=--experts stream --ram-budget 40GB --context 4096 --heat /tmp/fathom-heat.json --heat-pin 0.9 --device cuda --vram-budget 13GB' \\
      2>>"\$full" | tail -12 || failed=1
    rm -rf "\$m"
    m=/tmp/fathom-m4
    [ -d "\$m" ] || target/release/fathom synth --preset k3 --layers 4 --experts 64 --top-k 8 --out "\$m" | tail -1
    sync; { echo 3 >/proc/sys/vm/drop_caches; } 2>/dev/null || true
    timeout 300 target/release/fathom bench --model "\$m" --prompt-ids 1,2,3,4,5,6,7,8 --max-new 16 --reps 2 \\
      --warmup 1 --arm 'c=--experts stream --ram-budget 12.6GB --context 4096 --device cuda --vram-budget 9GB' \\
      --arm 'c-cpu=--experts stream --ram-budget 12.6GB --context 4096' 2>>"\$full" | tail -14 || failed=1
    ;;
  tiers)
    # The spine's device tier (scripts/gpu-tiers.sh).
    bash scripts/gpu-tiers.sh || failed=1
    ;;
  *)
    echo "unknown step \$step: tests, graphs, bench, ae, d, bc or tiers"; failed=1
    ;;
  esac
done
exit \$failed
EOF
echo "packed: $(du -h "$out/gpu.tar.xz" | cut -f1) in $out/gpu.tar.xz; run there: bash $out/run.sh"
