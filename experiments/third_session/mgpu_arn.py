import functools, jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

def add_rms_norm(x, d, w, eps, interpret=None):
    M, D = x.shape
    dt = x.dtype
    R = D // 256  # TMA copies at most 256 elements along a dimension
    x, d, w = x.reshape(M, R, 256), d.reshape(M, R, 256), w.reshape(R, 256)
    def body(x_gmem, d_gmem, w_gmem, sum_gmem, normed_gmem, x_smem, d_smem, w_smem, bar):
        m = lax.axis_index("row")
        plgpu.copy_gmem_to_smem(x_gmem.at[m], x_smem, bar)
        plgpu.copy_gmem_to_smem(d_gmem.at[m], d_smem, bar)
        plgpu.copy_gmem_to_smem(w_gmem, w_smem, bar)
        plgpu.barrier_wait(bar)
        x = x_smem[...] + d_smem[...]
        x32 = x.astype(jnp.float32)
        inv_rms = lax.rsqrt(jnp.sum(x32 * x32) / D + eps)
        normed = w_smem[...] * (x32 * inv_rms).astype(dt)
        x_smem[...] = x
        d_smem[...] = normed
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_smem, sum_gmem.at[m])
        plgpu.copy_smem_to_gmem(d_smem, normed_gmem.at[m])
        plgpu.wait_smem_to_gmem(0)
    out = jax.ShapeDtypeStruct((M, R, 256), dt)
    kw = {} if interpret is None else {"interpret": interpret}
    s, n = plgpu.kernel(body, out_type=(out, out), grid=(M,), grid_names=("row",),
        scratch_types=[plgpu.SMEM((R, 256), dt)] * 3 + [plgpu.Barrier(num_arrivals=3)], **kw)(x, d, w)
    return s.reshape(M, D), n.reshape(M, D)

if __name__ == "__main__":
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    k = jax.random.split(jax.random.key(0), 3)
    M, D = 3, 256
    for dt in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(k[0], (M, D), dt)
        d = jax.random.normal(k[1], (M, D), dt)
        w = jax.random.normal(k[2], (D,), dt)
        s, n = jax.jit(lambda x,d,w: add_rms_norm(x, d, w, 1e-6, interpret=InterpretGPUParams()))(x, d, w)
        ref = (x + d)
        r32 = ref.astype(jnp.float32)
        refn = w * (r32 * lax.rsqrt((r32 * r32).mean(-1, keepdims=True) + 1e-6)).astype(dt)
        print(dt, jnp.abs(s - ref).max(), jnp.abs((n - refn).astype(jnp.float32)).max())
