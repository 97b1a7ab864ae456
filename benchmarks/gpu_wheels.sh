#!/usr/bin/env bash
# Fetches, on this machine, the wheels that a lent GPU machine lacks for
# benchmarks/gpu_check.sh, into .wheels/ (git-ignored; name it in the device call's carry):
#   bash benchmarks/gpu_wheels.sh
# The lent machines run Python 3.12 with jax 0.11.2 (and flax, optax, chex, orbax) but
# without ml_collections, qwix or tensorboardX; tokamax and the packages it imports
# travel too, so that benchmarks/attention_kernels.py can time its kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .wheels \
  ml_collections==1.1.0 qwix==0.1.8 tensorboardx==2.6.5 tokamax==0.0.17 einshape==1.0 \
  immutabledict==4.3.1 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 typing-extensions==4.16.0
ls .wheels
