#!/usr/bin/env bash
# Download the wheels that scripts/gpu_ci.sh installs on a GPU host without network (the test
# dependencies its image lacks, pinned in scripts/gpu_ci_wheels.txt) into ./.whl, for Python 3.12
# on x86-64 Linux. Run it on a machine with the package index; carry .whl to the GPU host.
set -eu
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl -r scripts/gpu_ci_wheels.txt
ls .whl
