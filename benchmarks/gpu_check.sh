#!/usr/bin/env bash
# Compiled GPU run of the Pallas kernel and library tests, then (optionally) the block-size
# sweep, the layer benchmark and the model benchmark. Run from the repository root on a GPU
# machine:
#
#   benchmarks/gpu_check.sh OUT_DIR [STEP...]
#     STEP: tests, tune, bench, model (default: tests)
#
# BENCH_ARGS / TUNE_ARGS / MODEL_ARGS pass extra flags to benchmarks.layer /
# benchmarks.tune_blocks / benchmarks.model. Where the image lacks pytest or has
# transformers 5.x (no Flax models), they are installed from wheels carried in .whl/.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR [tests] [tune] [bench] [model]}
shift
steps=${*:-tests}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if ! python3 -c "import pytest, transformers; assert transformers.__version__ < '5'" 2>/dev/null
then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "this machine lacks pytest or transformers 4.x: put their wheels (Python 3.12) in .whl/" \
      "or install them, e.g. pip install -e '.[hf,test]'" >&2
    exit 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
fi
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  python3 -c "import flax; print('flax', flax.__version__)" 2>&1 | tail -1
  date -u
} 2>&1 | tee "$out/device.txt"
status=0
for step in $steps; do
  case $step in
    tests)
      # The kernels compiled through Triton, and the library's own tests on the GPU: four
      # pytest workers share the card where pytest-xdist is installed, each allocating what it
      # uses rather than most of the card's memory up front.
      workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
      XLA_PYTHON_CLIENT_PREALLOCATE=false INTERPRET=0 timeout 540 python3 -m pytest -q \
        -p no:cacheprovider $workers tests/pallas_kernels \
        tests/test_implementations.py tests/test_backward.py tests/test_cost_model.py \
        tests/test_ops.py tests/test_ops_embed.py tests/test_layers.py tests/test_intercept.py \
        tests/test_packing.py tests/test_model_families.py tests/test_losses.py \
        tests/test_sharding.py \
        2>&1 | tee "$out/tests.log" | tail -25 || status=1 ;;
    tune)
      timeout 300 python3 -m benchmarks.tune_blocks --out "$out/tune.jsonl" ${TUNE_ARGS:-} \
        2>"$out/tune.err" | tee "$out/tune.txt" || status=1
      tail -5 "$out/tune.err" ;;
    bench)
      timeout 400 python3 -m benchmarks.layer --out "$out/layer.jsonl" ${BENCH_ARGS:-} \
        2>"$out/layer.err" | tee "$out/layer.txt" || status=1
      grep -E "device|measured|Error|error" "$out/layer.err" | tail -5 ;;
    model)
      timeout 600 python3 -m benchmarks.model --out "$out/model.jsonl" ${MODEL_ARGS:-} \
        2>"$out/model.err" | tee "$out/model.txt" || status=1 ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
done
exit $status
