#!/usr/bin/env bash
# fathom beside llama.cpp's CUDA build on a GPU host, each beside its bound
# in one `fathom bench` run (docs/bench.md, "Peers on the GPU host"). Runs
# on the device from the repository root, after scripts/gpu-pack.sh's
# run.sh has unpacked target/release/fathom:
#
#   bash scripts/gpu-peer.sh build   # llama.cpp from target/llama/llama.cpp.tar.xz
#                                    # (scripts/llama-src.sh), in the background
#   bash scripts/gpu-peer.sh gguf    # the K3-dimension synth and its GGUF
#   bash scripts/gpu-peer.sh check   # the GGUF is the same model (prompt ids, greedy ids)
#   bash scripts/gpu-peer.sh bench [i ii iii]   # (i) resident and (v) the CPU,
#                                    # 16 threads; (ii) experts in host RAM;
#                                    # (iii) prefill 512 and 4,096 (default: all three)
#
# Output lines go to stdout and to $OUT/peer.log (or target/gpu/peer.log).
set -uo pipefail
log="${OUT:-target/gpu}/peer.log"
exec > >(tee -a "$log") 2>&1
L=/tmp/llama/llama.cpp
bin=$L/build/bin
m=/tmp/fathom-k3dim
gguf=/tmp/fathom-k3dim.gguf
fathom=target/release/fathom

case "${1:-}" in
build)
  mkdir -p /tmp/llama
  [ -d "$L" ] || tar -C /tmp/llama -xJf target/llama/llama.cpp.tar.xz
  # Its own session, so the build outlives this call; `wait` polls for it.
  setsid nohup bash -c "cd $L && cmake -B build -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF >/tmp/llama/cmake.log 2>&1 \
      && cmake --build build --target llama-bench llama-batched-bench llama-completion \
      -j 12 >/tmp/llama/build.log 2>&1; echo \$? >/tmp/llama/built" </dev/null >/dev/null 2>&1 &
  echo "llama.cpp: CUDA build started in the background (/tmp/llama/build.log)"
  ;;
wait)
  for _ in $(seq 1 "${2:-540}"); do
    [ -f /tmp/llama/built ] && break
    sleep 1
  done
  if [ "$(cat /tmp/llama/built 2>/dev/null)" != 0 ]; then
    echo "llama.cpp: not built yet or failed"
    tail -5 /tmp/llama/cmake.log /tmp/llama/build.log 2>/dev/null
    exit 1
  fi
  echo "llama.cpp: built ($(ls "$bin" | tr '\n' ' '))"
  ;;
gguf)
  [ -d "$m" ] || $fathom synth --preset k3 --layers 4 --experts 16 --top-k 4 --out "$m" | tail -1
  [ -d /tmp/llama/llama.cpp ] || tar -C /tmp/llama -xJf target/llama/llama.cpp.tar.xz
  # The converter reads a chat template the packed tree leaves out; a
  # synth has no chat format of its own, so any template serves.
  t=$L/models/templates/Kimi-K3.jinja
  [ -f "$t" ] || { mkdir -p "$(dirname "$t")" && echo '{% for m in messages %}{{ m.content }}{% endfor %}' >"$t"; }
  [ -f "$gguf" ] || python3 scripts/gguf-from-synth.py "$L" "$m" "$gguf" --outtype bf16 </dev/null |
    tail -4
  ls -la "$gguf"
  ;;
check)
  # The same model: llama.cpp's greedy continuation of a prompt of ids
  # against fathom's (llama-completion has no ids input; compare on text).
  $fathom run --model "$m" --prompt "def fibonacci(n):" --max-new 8 --json --device cuda \
    --experts resident 2>/dev/null |
    python3 -c 'import json,sys; d=json.load(sys.stdin); print("fathom prompt ids", d.get("prompt_ids"), "output ids", d.get("output_ids"), "text", repr(d.get("text")))'
  "$bin/llama-completion" -m "$gguf" -p "def fibonacci(n):" -n 8 --temp 0 -ngl 99 -no-cnv \
    --verbose-prompt 2>/tmp/llama/check.log | tee /tmp/llama/check.out
  echo
  grep -E "[0-9]+ -> '" /tmp/llama/check.log | head -20
  ;;
bench)
  ids() { python3 -c "print(','.join(str((7 * i + 3) % 150000 + 100) for i in range($1)))"; }
  p8=$(ids 8)
  shift
  want=" ${*:-i ii iii} "
  if [[ $want == *" i "* ]]; then
  echo "== (i) resident on the GPU; (v) the CPU, 16 threads"
  timeout 500 $fathom bench --model "$m" --prompt-ids "$p8" --max-new 32 --reps 2 --warmup 1 \
    --arm 'gpu=--experts resident --device cuda --context 4096' \
    --arm 'cpu16=--experts resident --context 4096 --threads 16' \
    --peer llama-gpu="$bin/llama-bench -m $gguf -p 0 -n {max_new} -r 1 -ngl 99 -o json" \
    --peer llama-cpu16="env CUDA_VISIBLE_DEVICES= $bin/llama-bench -m $gguf -p 0 -n {max_new} -r 1 -ngl 0 -t 16 -o json" |
    tail -14
  fi
  if [[ $want == *" ii "* ]]; then
  echo "== (ii) routed experts in host RAM"
  timeout 300 $fathom bench --model "$m" --prompt-ids "$p8" --max-new 32 --reps 2 --warmup 1 \
    --arm 'hybrid=--experts resident --device cuda --context 4096 --vram-budget 9GB' \
    --peer llama-exps-cpu="$bin/llama-bench -m $gguf -p 0 -n {max_new} -r 1 -ngl 99 -ot exps=CPU -o json" |
    tail -10
  fi
  if [[ $want == *" iii "* ]]; then
  for n in 512 4096; do
  echo "== (iii) prefill of $n tokens, resident and with experts in host RAM"
  timeout 280 $fathom bench --model "$m" --prompt-ids "$(ids $n)" --max-new 1 --reps 2 --warmup 1 \
    --arm 'gpu=--experts resident --device cuda --context 8192' \
    --arm 'hybrid=--experts resident --device cuda --context 8192 --vram-budget 9GB' \
    --peer llama-gpu="$bin/llama-bench -m $gguf -p $n -n 0 -r 1 -ngl 99 -o json" \
    --peer llama-exps-cpu="$bin/llama-bench -m $gguf -p $n -n 0 -r 1 -ngl 99 -ot exps=CPU -o json" |
    tail -6
  done
  fi
  ;;
*)
  echo "usage: gpu-peer.sh build|wait|gguf|check|bench"
  exit 2
  ;;
esac
