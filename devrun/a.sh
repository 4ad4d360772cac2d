mkdir -p /tmp/peers && cp .peers/a/* /tmp/peers/
python3 -m zipfile -e .cutlass/*.whl /tmp/cl >/dev/null
export CUTLASS_DIR=/tmp/cl/cutlass_library/source/include PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 build.py --spec specs/h100.yaml --only 'fwd_e4m3_*' -j 16 2>&1 | tail -2
