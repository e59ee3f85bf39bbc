#!/usr/bin/env bash
# Build the llama.cpp peers of `hetero-sd bench --peers llama.cpp-dflash,llama.cpp`.
#
# llama.cpp with DFlash (src/models/dflash.cpp, --spec-type draft-dflash) is taken from the sdist of
# llama-cpp-python==0.3.36, which vendors llama.cpp at commit 0c1e5709 (2026-10-01). Only two
# binaries are built, CPU only, Release, statically linked so they run from the cache folder:
#   llama-speculative-simple  target + DFlash draft (the llama.cpp-dflash peer)
#   llama-completion          plain autoregressive decoding (the llama.cpp peer)
# The vendored source is kept beside them: its convert_hf_to_gguf.py and gguf-py convert our draft.
#
# Output: $HETERO_SD_HOME/llama.cpp/{bin/,src/,BUILD_INFO}. A second run with the same version does
# nothing. 15-40 minutes on 2 cores; never run in CI. Needs cmake, a C++17 compiler, ninja (or make).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
HOME_DIR="${HETERO_SD_HOME:-$HOME/.cache/hetero-sd}"
DEST="$HOME_DIR/llama.cpp"
JOBS="${JOBS:-$(nproc)}"
PYTHON="${PYTHON:-python3}"
TARGETS=(llama-speculative-simple llama-completion)

built() {
  [[ -f "$DEST/BUILD_INFO" ]] && grep -q "llama-cpp-python==$VERSION" "$DEST/BUILD_INFO" || return 1
  for t in "${TARGETS[@]}"; do [[ -x "$DEST/bin/$t" ]] || return 1; done
}
if built; then
  echo "llama.cpp already built in $DEST ($(head -1 "$DEST/BUILD_INFO"))"
  exit 0
fi

GEN=(-G Ninja)
command -v ninja >/dev/null || { echo "ninja not found: using make (apt-get install -y ninja-build is faster)"; GEN=(); }
command -v cmake >/dev/null || { echo "cmake not found: apt-get install -y cmake" >&2; exit 2; }

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
echo "downloading llama-cpp-python==$VERSION sdist into $WORK"
# --no-binary for this package only: with :all: pip builds every build dependency from source to read the
# sdist's metadata (hatchling, scikit-build-core, ...), which took over 10 minutes on a shared 2-core VM
"$PYTHON" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$WORK" >/dev/null
tar xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"
[[ -f "$SRC/src/models/dflash.cpp" ]] || { echo "this llama.cpp has no DFlash (src/models/dflash.cpp)" >&2; exit 3; }

# Tests, server, web UI, the unified app and HTTPS are not needed: fewer files to compile.
cmake -S "$SRC" -B "$WORK/build" "${GEN[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON
cmake --build "$WORK/build" --target "${TARGETS[@]}" -j "$JOBS"

rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp/bin"
for t in "${TARGETS[@]}"; do cp "$WORK/build/bin/$t" "$DEST.tmp/bin/"; done
# Converter and its gguf-py: the only sources the runtime uses (to convert our draft).
mkdir -p "$DEST.tmp/src"
cp -r "$SRC/convert_hf_to_gguf.py" "$SRC/gguf-py" "$DEST.tmp/src/"
cp -r "$SRC/conversion" "$DEST.tmp/src/"
cp "$SRC/LICENSE" "$DEST.tmp/src/"
{
  echo "llama-cpp-python==$VERSION (vendored llama.cpp)"
  echo "commit: $(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -m), $("${CXX:-c++}" --version | head -1)"
  echo "flags: Release, static, CPU, GGML_NATIVE=ON"
} > "$DEST.tmp/BUILD_INFO"
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo "built into $DEST:"; ls -la "$DEST/bin"
