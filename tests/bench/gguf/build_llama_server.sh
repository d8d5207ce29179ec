#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the sources llama-cpp-python 0.3.36
# vendors (the same llama.cpp as tests/bench/gguf/llamacpp.py's anchor), for
# this CPU with AMX off (the CPU lists AMX but this VM faults on it, see
# shared/DEPENDENCIES.md). cmake and ninja come from PyPI; about 20 minutes
# on 2 cores.
#
#     tests/bench/gguf/build_llama_server.sh     # -> $DEST/llama-server
#
# Environment: DEST [/tmp/llama-server-0.3.36], JOBS [2].
set -euo pipefail
DEST=${DEST:-/tmp/llama-server-0.3.36}
JOBS=${JOBS:-2}
mkdir -p "$DEST"
[ -x "$DEST/venv/bin/cmake" ] || { python3 -m venv "$DEST/venv" && "$DEST/venv/bin/pip" install -q cmake ninja; }
sdist=$DEST/llama_cpp_python-0.3.36.tar.gz
sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
if [ ! -f "$sdist" ]; then
  # The sdist as PyPI's simple index links it (pip download would build
  # its metadata, and with --no-binary its build tools, from source).
  url=$(curl -fsS https://pypi.org/simple/llama-cpp-python/ |
    grep -o 'https://[^"#]*/llama_cpp_python-0.3.36.tar.gz' | head -1)
  curl -fsSL -o "$sdist.part" "$url"
  echo "$sha  $sdist.part" | sha256sum -c --quiet
  mv "$sdist.part" "$sdist"
fi
src=$DEST/llama_cpp_python-0.3.36/vendor/llama.cpp
[ -d "$src" ] || tar -xzf "$sdist" -C "$DEST"
PATH=$DEST/venv/bin:$PATH
cmake -S "$src" -B "$DEST/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
  -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build "$DEST/build" --target llama-server -j "$JOBS"
cp "$DEST/build/bin/llama-server" "$DEST/llama-server"
"$DEST/llama-server" --version
