#!/bin/bash
# Is XLA's Programmatic Dependent Launch (PDL) on in jax 0.11.2, does it reach our Pallas kernels, and what
# does it do to the batch-1 step? One device call: flag checks, a PTX dump of the step, then the step's
# variants under each flag setting.
set -u
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
PY="python3 -W ignore::DeprecationWarning"
for f in --xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true --xla_gpu_enable_pdl=false; do
  if XLA_FLAGS="$f" $PY -c "import jax, jax.numpy as jnp; print(float(jnp.ones(3).sum()))" >/dev/null 2>&1;
  then echo "flag ok: $f"; else echo "flag REFUSED: $f"; fi
done
# PTX of the step with default flags: which kernels carry griddepcontrol?
rm -rf /tmp/dump
XLA_FLAGS="--xla_dump_to=/tmp/dump" timeout 300 $PY -m eagle3_jax.bench --variants-only --kernels pallas --no-peer \
  --out /tmp/dumprun > /tmp/dumprun.log 2>&1
echo "dump files: $(ls /tmp/dump | wc -l); by suffix:"; ls /tmp/dump | sed 's/.*\.//' | sort | uniq -c | sort -rn | head
grep -l griddepcontrol -r /tmp/dump | sed 's/.*\///' | head -5
echo "files with griddepcontrol: $(grep -l griddepcontrol -r /tmp/dump | wc -l)"
for p in $(ls /tmp/dump/*.ptx 2>/dev/null | head -400); do
  e=$(grep -c "^.visible .entry\|^\.entry" $p); w=$(grep -c "griddepcontrol.wait" $p); l=$(grep -c "griddepcontrol.launch" $p)
  echo "$e $w $l"
done | awk '{e+=$1; w+=$2; l+=$3} END {print "ptx entries", e, "with wait", w, "with launch_dependents", l}'
grep "variants b" -A14 /tmp/dumprun.log
for f in "--xla_gpu_enable_pdl=false" "--xla_gpu_enable_pdl=true" "--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true"; do
  echo "=== XLA_FLAGS=[$f]"
  XLA_FLAGS="$f" timeout 200 $PY -m eagle3_jax.bench --variants-only --kernels pallas --no-peer \
    --out "$OUT/v$(echo $f | tr -dc 'a-z=' | tail -c 20)" 2>&1 | grep -A14 "^variants b"
done
