set -e
python3 -m zipfile -e .cutlass/*.whl /tmp/cl >/dev/null
export CUTLASS_DIR=/tmp/cl/cutlass_library/source/include PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FA3GEN_COMMIT=$1
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader
time python3 build.py --spec specs/h100.yaml --only 'fwd_e4m3_*' -j 16 2>&1 | tail -4
python3 -m pytest -q -m gpu tests/gpu/test_fp8.py tests/gpu/test_kvcache_kernels.py -x 2>&1 | tail -15
python3 tests/gpu/bench_fp8_quantize.py 2>&1 | tail -8
python3 tests/gpu/bench_kvcache.py 2>&1 | tail -12
