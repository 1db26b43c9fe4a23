#!/usr/bin/env bash
# JAX's CUDA plugin (at jaxlib's version) and ptxas in .gpu-aot/, for compiling the step for
# an H100 on a machine without one (benchmarks/gpu_structure.py; the step-structure tests
# run with PYTHONPATH=.gpu-aot JAX_PLATFORMS=cpu). Kept out of the environment: there, every
# JAX process on a CPU-only machine would print the plugin's failure to find a GPU.
set -euo pipefail
cd "$(dirname "$0")"
version=$(python -c 'import jaxlib; print(jaxlib.__version__)')
pip install --no-deps --target .gpu-aot --upgrade \
    "jax-cuda12-plugin==$version" "jax-cuda12-pjrt==$version" nvidia-cuda-nvcc-cu12
