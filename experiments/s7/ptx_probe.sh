#!/bin/bash
# Seventh session, device call 4: the PTX and SASS of the owner's combine (remote shared-memory loads).
#   bash experiments/s7/ptx_probe.sh   (on the GPU machine; prints excerpts)
set -u
D=$(mktemp -d)
MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_TO=$D PYTHONPATH=.:experiments/s7 timeout 120 \
  python3 -W ignore::DeprecationWarning -c "
import jax, jax.numpy as jnp
from decode_mgpu import decode_attention_mgpu
q = jnp.ones((1,1,32,128), jnp.bfloat16); k = jnp.ones((1,8,16384,128), jnp.bfloat16)
print(decode_attention_mgpu(q, k, k, jnp.array([16383], jnp.int32), scale=0.1, combine='o_only').sum())
" > $D/stdout.txt 2>&1
ls -la $D
P=$(ls $D/*.ptx | head -1)
echo "== ptx: counts"; for w in "ld.shared::cluster" "mapa" "cluster_ctaid" "bar.sync" "barrier.sync" "st.global" "fence"; do echo "$w $(grep -c "$w" $P)"; done
echo "== ptx: around the first remote load"
L=$(grep -n "ld.shared::cluster" $P | head -1 | cut -d: -f1)
sed -n "$((L-60)),$((L+80))p" $P
S=$(ls $D/* | grep -i sass | head -1)
echo "== sass file $S"
if [ -n "$S" ]; then
  grep -n "LD\.\|LDS\|MAPA\|BAR\|S2R\|S2UR" $S | awk -F: '$1>0' | grep -n "MAPA" | head -5
  M=$(grep -n "MAPA" $S | head -1 | cut -d: -f1)
  sed -n "$((M-20)),$((M+120))p" $S
fi
cat $D/stdout.txt | tail -3
