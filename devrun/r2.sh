python3 -m zipfile -e .cutlass/*.whl /tmp/cl >/dev/null
export CUTLASS_DIR=/tmp/cl/cutlass_library/source/include PYTHONUNBUFFERED=1 PYTHONPATH=$PWD FA3GEN_COMMIT=$1
python3 build.py --spec specs/h100.yaml --only 'fwd_e4m3_*' -j 16 2>&1 | tail -2
python3 -m pytest -q -m gpu tests/gpu/test_kvcache_kernels.py 2>&1 | tail -8
python3 -m pytest -q -m gpu tests/gpu/test_fp8.py 2>&1 | tail -4
python3 tests/gpu/bench_kvcache.py 2>&1 | tail -12
python3 tests/gpu/bench_fp8_quantize.py 2>&1 | tail -8
compute-sanitizer --tool memcheck python3 -m pytest -q -m gpu tests/gpu/test_kvcache_kernels.py -k "test_paged or (cap3333 and d128 and bf16)" 2>&1 | tail -3
compute-sanitizer --tool racecheck python3 -m pytest -q -m gpu tests/gpu/test_kvcache_kernels.py -k "test_paged and (64-16 or 64-24)" 2>&1 | tail -3
