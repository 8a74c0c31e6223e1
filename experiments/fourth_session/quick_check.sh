#!/bin/bash
# The batch-1 step with the row-reduction matvecs, under XLA's default flags and with PDL forced on/off;
# the debug options XLA records say what the default is.
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="python3 -W ignore::DeprecationWarning"
rm -rf /tmp/dump
XLA_FLAGS="--xla_dump_to=/tmp/dump" $PY -c "import jax.numpy as jnp; print(jnp.ones(3).sum())" >/dev/null 2>&1
grep -h "pdl\|command_buffer\|triton_gemm" /tmp/dump/*debug_options* 2>/dev/null | sort | uniq -c | head; ls /tmp/dump | head -3
for f in "" "--xla_gpu_enable_pdl=true" "--xla_gpu_enable_pdl=false"; do
  echo "=== XLA_FLAGS=[$f]"
  XLA_FLAGS="$f" timeout 200 $PY -m eagle3_jax.bench --variants-only --kernels pallas --no-peer --out /tmp/v 2>&1 \
    | grep -A13 "^variants b"
done
