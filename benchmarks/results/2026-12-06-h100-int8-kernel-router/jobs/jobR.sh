python3 -m pip install -q --no-index --no-deps dist/*.whl 2>&1 | tail -1
PYTHONPATH=starter_code timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_adamw_kernel.py -k "cuda or bucketize" 2>&1 | tail -2
PYTHONPATH=starter_code timeout 40 python3 benchmarks/int8_kernel_configs.py $OUT/configs-final.json --configs 16x1x1
