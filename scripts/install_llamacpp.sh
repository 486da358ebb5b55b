#!/usr/bin/env bash
# bash scripts/install_llamacpp.sh
# llama.cpp's server and GGUF converter from the llama-cpp-python sdist on PyPI (it vendors both), built once into
# $DRAFTSMITH_HOME/engines/llamacpp (several minutes on 2 cores). draftsmith deploy-check --engine llamacpp runs it.
set -euo pipefail
VERSION=0.3.36
HOME_DIR="${DRAFTSMITH_LLAMACPP:-${DRAFTSMITH_HOME:-$HOME/.cache/draftsmith}/engines/llamacpp}"
if [ -x "$HOME_DIR/bin/llama-server" ] && [ -f "$HOME_DIR/src/convert_hf_to_gguf.py" ] \
    && python3 -c "import sentencepiece" 2>/dev/null; then
    echo "llama.cpp already built in $HOME_DIR"; exit 0
fi
mkdir -p "$HOME_DIR/dl"
pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$HOME_DIR/dl"
rm -rf "$HOME_DIR/src" "$HOME_DIR/build"
tar xzf "$HOME_DIR/dl/llama_cpp_python-$VERSION.tar.gz" -C "$HOME_DIR/dl"
mv "$HOME_DIR/dl/llama_cpp_python-$VERSION/vendor/llama.cpp" "$HOME_DIR/src"
# no curl/openssl (models come from disk); static libs so bin/ holds everything the server needs
cmake -S "$HOME_DIR/src" -B "$HOME_DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=ON > "$HOME_DIR/cmake.log"
cmake --build "$HOME_DIR/build" -j "$(nproc)" --target llama-server >> "$HOME_DIR/cmake.log"
mkdir -p "$HOME_DIR/bin"
cp "$HOME_DIR/build/bin/llama-server" "$HOME_DIR/bin/"
echo "llama-cpp-python $VERSION (llama.cpp $(git -C "$HOME_DIR/src" describe --tags 2>/dev/null || echo vendored))" \
    > "$HOME_DIR/VERSION"
# the vendored converter (convert_hf_to_gguf.py) runs in draftsmith's env and imports sentencepiece
python3 -m pip install --quiet "sentencepiece>=0.2"
"$HOME_DIR/bin/llama-server" --version 2>&1 | tail -2
echo "llama.cpp built in $HOME_DIR"
