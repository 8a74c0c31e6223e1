export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
P="python3 -W ignore::DeprecationWarning scratch/probe_graph.py"
D=/tmp/dump
TAG=default XLA_FLAGS="--xla_dump_to=$D --xla_dump_hlo_as_text" $P > /tmp/a.log 2>&1
TAG=nocmdbuf XLA_FLAGS=--xla_gpu_enable_command_buffer= $P > /tmp/b.log 2>&1
grep "^default\|^nocmd" /tmp/a.log /tmp/b.log | cut -c1-400
grep -i -m3 "error\|Traceback" /tmp/a.log
mkdir -p $OUT/t; i=0; for f in $D/*jit_f*thunk_sequence.txt; do cp $f $OUT/t/seq$i.txt; i=$((i+1)); done; ls -la $OUT/t
