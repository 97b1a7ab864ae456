#!/usr/bin/env bash
# Issue 21's GPU figures in one call, for a short lease of a GPU machine:
#   bash benchmarks/gpu_check.sh        # gemma3-1b, bfloat16, 4 x 2048; writes to $OUT
#   PRESET=gemma3-tiny BATCH=2 SEQ=256 DTYPE=float32 bash benchmarks/gpu_check.sh   # a dry run
#
# 1. benchmarks/accelerator.py as a user's loop runs by default (`scan_unroll` "auto":
#    the layer loop unrolled, which the H100's rolled loop spent 29 of 196 ms stacking
#    and copying without), its step taking `model.loss`: train-step MFU per attention
#    kernel, forward, decoding at batch 1 and 64;
# 2. accelerator.py with optax over `apply`'s logits, cuDNN only (the einsum kernel's
#    step ran out of an H100's memory that way);
# 3. benchmarks/profile_step.py: the step of 2 by kernel;
# 4. benchmarks/attention_kernels.py: one attention layer per kernel, tokamax's included
#    where its wheel travels.
# Each runs under its own timeout, so one that hangs leaves the others' results.
#
# Packages the machine lacks travel as wheels in .wheels/ (git-ignored), fetched here
# beforehand by `bash benchmarks/gpu_wheels.sh`; name .wheels in the call's carry.
# tokamax imports xprof's kernel-statistics tool at import time (for its own benchmarking,
# which is not used here) and xprof pulls in a server's dependencies: an empty module
# stands in for it where xprof is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/gpu_check}
mkdir -p "$out"
if compgen -G ".wheels/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site .wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/gpu_check_site:${PYTHONPATH:-}
  if [ -d /tmp/gpu_check_site/tokamax ] && ! python3 -c "import xprof" 2>/dev/null; then
    mkdir -p /tmp/gpu_check_site/xprof/cli/tools
    touch /tmp/gpu_check_site/xprof/__init__.py /tmp/gpu_check_site/xprof/cli/__init__.py \
      /tmp/gpu_check_site/xprof/cli/tools/__init__.py \
      /tmp/gpu_check_site/xprof/cli/tools/get_kernel_stats_tool.py
  fi
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
model=(--preset="${PRESET:-gemma3-1b}" --batch_size="${BATCH:-4}" --seq_len="${SEQ:-2048}"
       --dtype="${DTYPE:-bfloat16}")
cd benchmarks
run() {  # seconds, log name, command...
  local limit=$1 name=$2
  shift 2
  timeout "$limit" "$@" 2>&1 | grep -v '^[IW][0-9]' | tee "$out/$name.log"
}
run 240 accelerator python3 accelerator.py "${model[@]}" --scan_unroll=auto --loss=chunked \
  --steps=5 --out="$out/accelerator.json"
run 110 accelerator_logits python3 accelerator.py "${model[@]}" --scan_unroll=auto \
  --kernels=jax --decode_batch_sizes= --steps=5 --out="$out/accelerator_logits.json"
run 90 profile_step python3 profile_step.py "${model[@]}" --scan_unroll=auto \
  --attention_kernel=jax --out="$out/profile_step.json"
run 60 attention_kernels python3 attention_kernels.py --batch_size="${BATCH:-4}" \
  --seq_len="${SEQ:-2048}" --out="$out/attention_kernels.json"
