#!/usr/bin/env bash
# bash scripts/fetch_gpu_wheels.sh [DIR]        (here, where PyPI is reachable; DIR default .whl)
# The wheels scripts/gpu_check.sh installs on the GPU machine, which reaches no registry: what draftsmith needs that
# its image (scripts/gpu_image.txt) lacks, chosen by pip's resolver in a copy of that image (scripts/gpu_image.py;
# the copy's venv is made once, under GPU_IMAGE_VENV), and draftsmith itself, built from this working tree (the
# GPU check refuses a draftsmith wheel that differs from the tree it runs in: fetch again after an edit). For
# Python 3.12 on x86-64 (GPU_WHEELS_PYTHON=3.11: the image copy's own set); at most 64 MiB, what a working tree may
# carry to the GPU machine with it. Prints the total.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PYV=${GPU_WHEELS_PYTHON:-3.12}
VENV=${GPU_IMAGE_VENV:-${DRAFTSMITH_HOME:-$HOME/.cache/draftsmith}/gpu-image-venv}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
"$PY" scripts/gpu_image.py venv "$VENV"
carried=$("$PY" scripts/gpu_image.py carried "$VENV")
wheels=$(awk '$1 == "wheel" {print $2}' <<< "$carried")
sources=$(awk '$1 == "source" {print $2}' <<< "$carried")
binary=(--only-binary=:all: --python-version "$PYV" --implementation cp --platform manylinux_2_28_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform linux_x86_64)
# shellcheck disable=SC2086  # one requirement a word
[ -z "$wheels" ] || "$PY" -m pip download -q --no-deps "${binary[@]}" -d "$DIR" $wheels
# published as source only (antlr4-python3-runtime, deepspeed): built here into wheels, which are pure Python
# shellcheck disable=SC2086
[ -z "$sources" ] || "$PY" -m pip wheel -q --no-deps -w "$DIR" $sources
rm -f "$DIR"/*.tar.gz
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DIR" .
total=$(du -cb "$DIR"/*.whl | tail -1 | cut -f1)
echo "fetch_gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $((total / 1048576)) MiB in $DIR (Python $PYV):" \
     $(ls "$DIR" | sed 's/-py3.*\|-cp3.*//' | tr '\n' ' ')
if [ "$total" -gt $((64 * 1048576)) ]; then
    echo "fetch_gpu_wheels: over the 64 MiB a working tree may carry to the GPU machine" >&2
    exit 1
fi
