source .peers/b/install.sh >/dev/null || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH FA3GEN_COMMIT=$1
python3 -m pytest -q -m gpu tests/gpu/test_fp8.py -k quantize tests/gpu/test_kvcache_kernels.py 2>&1 | tail -3
python3 tests/gpu/bench_fp8_quantize.py 2>&1 | tail -4
python3 tests/gpu/bench_kvcache.py --out $OUT/decode.json 2>&1 | grep -v Warning | tail -90
python3 -m fa3gen.cli bench --spec h100 --dtype e4m3 --direction fwd --rounds 2 --min-ms 80 --out $OUT/bench_fp8.json --markdown $OUT/bench_fp8.md --plot $OUT/bench_fp8.png 2>&1 | tail -45
