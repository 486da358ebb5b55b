#!/usr/bin/env bash
# bash scripts/fetch_gpu_wheels.sh [DIR]        (here, where PyPI is reachable; DIR default .whl)
# The wheels scripts/gpu_check.sh installs on a GPU machine that reaches no registry: what its image lacks (hydra,
# omegaconf, datasets, deepspeed and their needs), transformers at our version, and draftsmith itself. For the
# lent H200 (Python 3.12, x86-64, CUDA torch and lightning already there); at most 64 MiB, the files that travel
# with a working tree to it. Prints the total.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
binary=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# binary wheels and pure ones published as wheels; the versions this project's CI installs
python3 -m pip download -q --no-deps "${binary[@]}" -d "$DIR" \
    "transformers==$(python3 -c 'import transformers; print(transformers.__version__)')" \
    hydra-core==1.3.2 omegaconf==2.3.0 "datasets==5.2.0" "dill==0.4.1" "multiprocess==0.70.19" \
    "fsspec==2026.9.0" "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0" \
    "typing-inspection==0.4.5" "hjson==3.1.0"
# published as source only: built here into pure-Python wheels
python3 -m pip wheel -q --no-deps -w "$DIR" "antlr4-python3-runtime==4.9.3" "deepspeed==0.19.8"
rm -f "$DIR"/*.tar.gz
python3 -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" .
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "fetch_gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $((total / 1048576)) MiB in $DIR"
if [ "$total" -gt $((64 * 1048576)) ]; then
    echo "fetch_gpu_wheels: over the 64 MiB a working tree may carry to the GPU machine" >&2
    exit 1
fi
