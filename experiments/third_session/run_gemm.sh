export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
B="python3 -W ignore::DeprecationWarning -m eagle3_jax.bench --variants-only --kernels pallas --no-peer"
$B --out $OUT/default 2>&1 | grep -A14 "^variants"
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false $B --out $OUT/cublas 2>&1 | grep -A14 "^variants"
