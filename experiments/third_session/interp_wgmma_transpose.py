import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
def body(a_g, b_g, o_g, a_s, b_s, o_s, bar):
    plgpu.copy_gmem_to_smem(a_g, a_s, bar); plgpu.copy_gmem_to_smem(b_g, b_s, bar); plgpu.barrier_wait(bar)
    def comp(acc):
        plgpu.wgmma(acc, a_s, plgpu.transpose_ref(b_s, (1, 0)))
        return acc[...]
    s = pl.run_scoped(comp, plgpu.ACC((64, 64), jnp.float32))
    o_s[...] = s
    plgpu.commit_smem(); plgpu.copy_smem_to_gmem(o_s, o_g); plgpu.wait_smem_to_gmem(0)
a = jax.random.normal(jax.random.key(0), (64, 128), jnp.bfloat16); b = jax.random.normal(jax.random.key(1), (64, 128), jnp.bfloat16)
o = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32), grid=(1,), grid_names=("g",),
    scratch_types=[plgpu.SMEM((64, 128), jnp.bfloat16), plgpu.SMEM((64, 128), jnp.bfloat16),
                   plgpu.SMEM((64, 64), jnp.float32), plgpu.Barrier(num_arrivals=2)], interpret=InterpretGPUParams())(a, b)
print(float(jnp.abs(o - a.astype(jnp.float32) @ b.astype(jnp.float32).T).max()))
