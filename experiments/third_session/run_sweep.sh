export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -W ignore::DeprecationWarning scratch/sweep_arn.py 2>&1 | grep "^add_rms"
export SWEEP_SHAPES='[[1,1024,1],[1,4096,1],[1,16384,1],[1,32768,1],[1,16384,4],[8,16384,1]]'
export SWEEP_TUNINGS='[{"block_k":128,"num_warps":4,"num_stages":3,"wave_slots":132},{"block_k":64,"num_warps":4,"num_stages":3,"wave_slots":264},{"block_k":64,"num_warps":4,"num_stages":4,"wave_slots":132},{"block_k":32,"num_warps":4,"num_stages":4,"wave_slots":396},{"block_k":128,"num_warps":4,"num_stages":2,"wave_slots":132},{"block_k":64,"num_warps":4,"num_stages":3,"wave_slots":132},{"block_k":128,"num_warps":8,"num_stages":3,"wave_slots":132},{"block_k":128,"num_warps":4,"num_stages":3,"num_splits":4},{"block_k":64,"num_warps":2,"num_stages":4,"wave_slots":264}]'
BENCH_BUDGET_S=250 python3 -W ignore::DeprecationWarning pallas_kernels/bench_attention.py sweep 2>&1 | grep -v "^W1\|^I1\|Warning\|warn" | cut -c1-330
