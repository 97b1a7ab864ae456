#!/usr/bin/env bash
# Issue 21's GPU figures in one call, for a short lease of a GPU machine:
#   bash benchmarks/gpu_check.sh        # gemma3-1b, bfloat16, 16 x 2048; writes to $OUT
#   PRESET=gemma3-tiny ROWS=2 SEQ=256 DTYPE=float32 NORM_SHAPES=64x1152 \
#     XLA_VARIANTS="xla_cpu_use_xnnpack=false;xla_backend_optimization_level=2" \
#     DECODE_VARIANTS="--xla_cpu_use_xnnpack=false" \
#     bash benchmarks/gpu_check.sh                                        # a dry run
#
# The step as `benchmarks/accelerator.py` times a user's loop (`scan_unroll` "auto": the
# layer loop unrolled; `model.loss(params, tokens)`; cuDNN attention given the mask by its
# structure alone), weights and AdamW state in bfloat16, forward pass not timed, at
# ROWS x 2048 (default 16; the sixth lease, the gated activation recomputed in the
# gradient: 419.6 ms, 49.3% MFU, fetched every 10 steps, peak 59.6 GiB; 19 rows fit; the
# seventh, RMSNorm's gradient as a Pallas kernel in an earlier form: 416.7-417.0 ms, 49.6%,
# the kept form not yet timed in the step):
# 0. benchmarks/norm_gradient.py: RMSNorm's gradient, XLA's against the Pallas kernel;
# 1. the step, timed both ways, under XLA's defaults and each set of XLA_VARIANTS (one
#    process: `--xla_variants`, a compile per set; six GPU flags are on record, none
#    faster: docs/architecture.md, "A fifth H100 lease"); then (NORM_AB=1, the default)
#    the same step with XLA's RMSNorm gradient instead of the kernel, its own process;
# 2. MoE: one Gemma 4 26B-A4B layer's experts by each dispatch (MOE_LIMIT=0 skips it;
#    never measured on a GPU yet: `auto` there runs the loop, since XLA expands
#    ragged_dot into every row times every expert);
# 3. greedy decoding at batch 1 and 64, under XLA's defaults and each set of XLA_FLAGS
#    in DECODE_VARIANTS (';'-separated; on record: 456 / 28,100 tokens/s as is, batch 1
#    launch-bound at 726 kernels a token; 410 / 28,500 with the loop's while and
#    conditionals as CUDA graphs, the sixth lease);
# 4. CHAT_LIMIT (off by default): benchmarks/chat_reply.py, a streamed chat reply;
#    WIDE_LIMIT (off by default): a 512-wide global attention layer, blocks against one call;
# 5. benchmarks/profile_step.py: the step by kernel, and the device's idle gaps (the
#    fifth lease: 1.8 ms a step between kernels).
# NORM_LIMIT=0 / STEP_LIMIT=0 skip the first stages, NORM_AB=0 the step with XLA's norm
# gradient. One call has 600 s: the next lease's MFU with the kept norm kernel and its
# MoE layer fit in one (~530 s),
#   NORM_AB=0 DECODE_LIMIT=0 PROFILE_LIMIT=0 bash benchmarks/gpu_check.sh
# and the norm kernel's A/B against XLA's gradient in another,
#   NORM_LIMIT=0 MOE_LIMIT=0 DECODE_LIMIT=0 PROFILE_LIMIT=0 bash benchmarks/gpu_check.sh
# attention_kernels.py (tokamax's kernels included), the 4, 8, 12 and 16 row steps,
# float32 weights and the one-pass log_z A/B are on record for the H100. Call with
# timeout_s 600: the lease's start is ~90 s of its 900, and what runs late may be cut
# (each run's lines are in gpu_check.log as it goes).
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
# Inside it XLA keeps each GEMM fusion's autotuning result (JAX's default XLA cache), which
# a cold compile of the step spends much of its ~140 s finding. Leases start bare, so the
# results travel: those of the last lease are read from .gpu_cache/ (git-ignored; name it
# in the call's carry, after copying the last call's xla_autotune_*.tar.gz there), and
# this lease's come back in $OUT. A changed fusion, another card or another jax misses and
# is tuned again; the file names the jax version, so another version's results stay out.
jax_version=$(python3 -c "import jax; print(jax.__version__)" 2>/dev/null || echo unknown)
autotune=xla_autotune_jax$jax_version.tar.gz
mkdir -p "$JAX_COMPILATION_CACHE_DIR"
[ -f ".gpu_cache/$autotune" ] && tar -xzf ".gpu_cache/$autotune" -C "$JAX_COMPILATION_CACHE_DIR"
save_autotune() {
  [ -d "$JAX_COMPILATION_CACHE_DIR/xla_gpu_per_fusion_autotune_cache_dir" ] &&
    tar -czf "$out/$autotune" -C "$JAX_COMPILATION_CACHE_DIR" xla_gpu_per_fusion_autotune_cache_dir
}
trap save_autotune EXIT
# The card's memory for the 16 rows (XLA's allocator takes 75% of it by default).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.94}
rows=${ROWS:-16}
model=(--preset="${PRESET:-gemma3-1b}" --seq_len="${SEQ:-2048}" --dtype="${DTYPE:-bfloat16}"
       --scan_unroll=auto)
cd benchmarks
run() {  # seconds, name, command...: one log for all (the tool brings back 8 files at most)
  local limit=$1 name=$2
  shift 2
  echo "$(date +%T) $name (limit $limit s)" | tee -a "$out/gpu_check.log"
  timeout "$limit" "$@" 2>&1 | grep -v '^[IW][0-9]' | tee -a "$out/gpu_check.log"
}
[ "${NORM_LIMIT:-90}" != 0 ] && run "${NORM_LIMIT:-90}" norm_gradient python3 norm_gradient.py \
  --out="$out/norm_gradient.json" --shapes="${NORM_SHAPES:-32768x1152,131072x256,32768x256}"
step=(python3 accelerator.py "${model[@]}" --loss=chunked --kernels=jax --decode_batch_sizes=
      --noforward --batch_size="$rows" --param_dtype=bfloat16 --steps=10)
if [ "${STEP_LIMIT:-240}" != 0 ]; then
  run "${STEP_LIMIT:-240}" step "${step[@]}" --out="$out/accelerator_bf16.json" \
    --xla_variants="${XLA_VARIANTS:-}"
  [ "${NORM_AB:-1}" = 1 ] && run "${STEP_LIMIT:-240}" "step, XLA's norm gradient" "${step[@]}" \
    --nonorm_gradient_kernel --out="$out/accelerator_bf16_xla_norm_gradient.json"
fi
# One Gemma 4 26B-A4B MoE layer's experts (128 of them, top 8, 4096 tokens), bfloat16:
# the loop (what `auto` runs on a GPU), tokamax's ragged_dot kernels, the dense
# reference, and XLA's ragged_dot (expanded to every row times every expert) last.
[ "${MOE_LIMIT:-200}" != 0 ] && run "${MOE_LIMIT:-200}" moe_dispatch python3 moe_dispatch.py \
  ${MOE_SHAPE:---experts=128 --top_k=8 --tokens=4096 --d_model=2816 --expert_mlp_dim=704} \
  --dtype=bfloat16 --dispatches=loop,tokamax,dense,ragged --loop_blocks= --seconds=1 \
  --out="$out/moe_dispatch_gpu.json"
IFS=';' read -ra decode_variants <<< "${DECODE_VARIANTS:-}"
decode_variants=("" "${decode_variants[@]}")
[ "${DECODE_LIMIT:-150}" = 0 ] && decode_variants=()  # DECODE_LIMIT=0: no decoding (on record)
for i in "${!decode_variants[@]}"; do
  XLA_FLAGS="${decode_variants[$i]}" run "${DECODE_LIMIT:-150}" "decode XLA_FLAGS=${decode_variants[$i]}" \
    python3 accelerator.py "${model[@]}" --kernels= --decode_batch_sizes=1,64 \
    --out="$out/decode_variant$i.json"
done
# A chat reply streamed a call a token (ChatSession) against the sampler's loop, batch 1;
# off unless CHAT_LIMIT is set (never measured on a GPU: each token's step is dispatched
# before the token before it is read, which should matter most where a step is ~2 ms).
[ "${CHAT_LIMIT:-0}" != 0 ] && run "$CHAT_LIMIT" chat_reply python3 chat_reply.py \
  --shapes="${PRESET:-gemma3-1b}" --dtype="${DTYPE:-bfloat16}" --new_tokens=128 --rounds=5 \
  --out="$out/chat_reply_gpu.json"
# Gemma 4 26B-A4B's global layer (16 heads, 2 key/value heads, 512 wide: more than cuDNN
# takes) at 1 x 8192: the "jax" kernel in causal blocks, as the decoder now runs it,
# against the one call over every logit it ran before; off unless WIDE_LIMIT is set.
[ "${WIDE_LIMIT:-0}" != 0 ] && run "$WIDE_LIMIT" wide_heads python3 attention_kernels.py \
  --batch_size=1 --seq_len=8192 --heads=16 --kv_heads=2 --head_dim=512 \
  --layer_types=global --out="$out/attention_kernels_wide_gpu.json"
[ "${PROFILE_LIMIT:-200}" = 0 ] && exit 0  # PROFILE_LIMIT=0: no profile (one is on record)
run "${PROFILE_LIMIT:-200}" profile_step python3 profile_step.py "${model[@]}" --batch_size="$rows" \
  --param_dtype=bfloat16 --loss=chunked --attention_kernel=jax \
  --out="$out/profile_step_bf16.json"
