#!/usr/bin/env bash
# One GPU session's checks in one run: versions, tests/test_gpu.py (compiled Pallas kernels,
# ragged_all_to_all, cuDNN, the serving engine), then the attention, MoE and serving benches, then
# FP8 (cuBLAS FP8 GEMMs in the compiled program; step time and TFLOP/s per recipe against bf16).
# Logs go to $OUT (default ./gpu_out); each stage has its own time limit, so the run ends within
# about 13 minutes. With the argument `fp8` it runs only the FP8 stages (within about 4.5 minutes).
# With the argument `cpu_suite` it runs only the whole test suite on that machine's CPUs
# instead (its JAX version, no GPU needed), within about 4 minutes.
#
#   bash experiments/gpu_check.sh             # the GPU pass
#   bash experiments/gpu_check.sh cpu_suite   # the suite under the GPU machine's JAX
#   bash experiments/gpu_check.sh fp8         # the FP8 stages alone
#
# On a machine without ml_collections / gin-config / tensorboardX and without network, bring
# them as wheels (pure Python) in .whl/ first; the script installs whatever .whl/ holds:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux2014_x86_64 -d .whl \
#       ml_collections==1.1.0 gin-config==0.5.0 tensorboardX==2.6.5
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1

stage() {  # stage NAME SECONDS PLATFORM COMMAND...: runs one stage, its log in $OUT/NAME.log
  local name=$1 seconds=$2 platform=$3
  shift 3
  echo "=== $name (limit ${seconds}s, JAX_PLATFORMS=$platform)"
  local start=$SECONDS
  JAX_PLATFORMS=$platform timeout "$seconds" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "=== $name: exit ${PIPESTATUS[0]} after $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import jax, jaxlib, flax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__); print(jax.devices())"
} 2>&1 | tee "$OUT/summary.txt"
fp8_stages() {
  stage fp8_gpu_test 60 cuda python3 -m pytest -q -p no:cacheprovider -rs tests/ops/test_fp8.py -k gpu
  stage fp8_bench 200 cuda python3 -m experiments.fp8_bench --parts gpu --repeats 5
}
if [ "${1:-}" = fp8 ]; then
  fp8_stages
  exit
fi
if [ "${1:-}" = cpu_suite ]; then
  stage cpu_suite 230 cpu python3 -m pytest -q -p no:cacheprovider -n 12
  exit
fi
stage test_gpu 170 cuda python3 -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
stage attention_bench 150 cuda python3 -m experiments.attention_bench --repeats 5
stage moe_bench 60 cuda python3 -m experiments.moe_bench --tokens 4096 --d_model 1024 --d_ff 2048
stage paged_attention 60 cuda python3 -m experiments.serve_bench --kernel --repeats 20
stage serve_bench 90 cuda python3 -m experiments.serve_bench --requests 64 --rates 32
fp8_stages
