#!/usr/bin/env bash
# Issue 21's GPU figures in one call, for a short lease of a GPU machine:
#   bash benchmarks/gpu_check.sh        # gemma3-1b, bfloat16, 4 x 2048; writes to $OUT
#   PRESET=gemma3-tiny BATCH=2 SEQ=256 DTYPE=float32 bash benchmarks/gpu_check.sh   # a dry run
#
# 1. benchmarks/profile_step.py: the step of 2, by kernel, and its compiled HLO (a cold
#    compile cache needed more than 110 s for it);
# 2. benchmarks/accelerator.py as a user's loop runs by default (`scan_unroll` "auto":
#    the layer loop unrolled), its step taking `model.loss(params, tokens)` (rows keep
#    their length; loss chunks of 2048 rows), cuDNN attention given the mask by its
#    structure alone (no segment_ids): 120.2 ms, 43.0% MFU on an H100;
# 3. 2 at twice the rows (222.6 ms, 46.4%).
# Decoding is on record for the H100 and H200.
# On an H100 each unrolled gemma3-1b step compiles in ~30 s (the forward's beside it).
# benchmarks/attention_kernels.py (one attention layer per kernel, tokamax's included)
# is on record for the H100 and H200 and is not rerun.
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
# JAX's persistent cache across the runs: profile_step's step, and every run's init and
# forward of the same config, load what an earlier run compiled (~30 s each on an H100).
export JAX_COMPILATION_CACHE_DIR=/tmp/gpu_check_xla_cache
model=(--preset="${PRESET:-gemma3-1b}" --batch_size="${BATCH:-4}" --seq_len="${SEQ:-2048}"
       --dtype="${DTYPE:-bfloat16}")
cd benchmarks
run() {  # seconds, log name, command...
  local limit=$1 name=$2
  shift 2
  echo "$(date +%T) $name (limit $limit s)"
  timeout "$limit" "$@" 2>&1 | grep -v '^[IW][0-9]' | tee "$out/$name.log"
}
common=("${model[@]}" --scan_unroll=auto --steps=5 --kernels=jax --decode_batch_sizes=)
run 170 profile_step python3 profile_step.py "${model[@]}" --scan_unroll=auto --loss=chunked \
  --attention_kernel=jax --out="$out/profile_step.json" --hlo_out="$out/profile_step.hlo.gz"
run 70 accelerator python3 accelerator.py "${common[@]}" --loss=chunked --out="$out/accelerator.json"
run 90 accelerator_twice python3 accelerator.py "${common[@]}" --batch_size=$((2 * ${BATCH:-4})) \
  --loss=chunked --out="$out/accelerator_twice.json"
