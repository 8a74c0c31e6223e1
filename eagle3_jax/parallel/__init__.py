"""Tensor parallelism over a jax.sharding Mesh with a "tp" axis (docs/tensor-parallel.md).

  mesh.py         building a mesh and refusing one the devices cannot hold
  layout.py       which rows and columns of each weight a device holds, and the per-device model config
What a device computes with its shard is models/collectives.py's (the models call it); loading straight to the
shards is checkpoints/sharded.py's; the engine's steps as shard_maps are decoding/parallel_steps.py's.
"""
