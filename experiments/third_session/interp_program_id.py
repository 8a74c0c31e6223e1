import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
def k(x_gmem, o_gmem):
    m = pl.program_id(0)
    def body(s, bar):
        plgpu.copy_gmem_to_smem(x_gmem.at[m], s, bar)
        plgpu.barrier_wait(bar)
        s[...] = s[...] + m.astype(jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(s, o_gmem.at[m])
        plgpu.wait_smem_to_gmem(0)
    pl.run_scoped(body, plgpu.SMEM((128,), jnp.float32), plgpu.Barrier(num_arrivals=1))
g = pl.BlockSpec(memory_space=plgpu.GMEM)
x = jnp.ones((3,128))
o = pl.pallas_call(k, grid=(3,), in_specs=[g], out_specs=g, out_shape=jax.ShapeDtypeStruct((3,128), jnp.float32), interpret=InterpretGPUParams())(x)
print(o[:, :3])
