"""Tensor parallelism over a jax.sharding Mesh with a "tp" axis (docs/tensor-parallel.md).

  mesh.py         building a mesh and refusing one the devices cannot hold
  collectives.py  what a device does with its shard inside shard_map: the all-reduce after a row-parallel
                  matmul, the embedding lookup over a vocabulary slice, reductions over a sharded vocabulary
  layout.py       which rows and columns of each weight a device holds, and the per-device model config
  steps.py        the engine's jitted steps as shard_maps over the mesh
Loading straight to the shards is checkpoints/sharded.py's.
"""
