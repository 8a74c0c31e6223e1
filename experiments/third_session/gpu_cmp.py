import sys, functools, importlib.util, jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
spec = importlib.util.spec_from_file_location("rcw_old", "scratch/rcw_old.py"); old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
from pallas_kernels.rope_cache_write import rope_cache_write as new
import pallas_kernels.add_rms_norm  # noqa
arn = sys.modules["pallas_kernels.add_rms_norm"]
from eagle3_jax.attention import rotate_and_cache
B, T, N, K, H, S = 8, 4, 32, 8, 128, 64
ks = jax.random.split(jax.random.key(0), 8)
dt = jnp.bfloat16
qkv = jax.random.normal(ks[0], (B, T, (N + 2 * K) * H), dt)
ang = jax.random.uniform(ks[1], (B, T, H // 2)) * 6
cos = jnp.concatenate([jnp.cos(ang)] * 2, -1).astype(dt); sin = jnp.concatenate([jnp.sin(ang)] * 2, -1).astype(dt)
kc = jax.random.normal(ks[2], (B, K, S, H), dt); vc = jax.random.normal(ks[3], (B, K, S, H), dt)
qn = (1 + 0.1 * jax.random.normal(ks[4], (H,))).astype(dt); kn = (1 + 0.1 * jax.random.normal(ks[5], (H,))).astype(dt)
start = jnp.arange(B, dtype=jnp.int32) * 5
a = old.rope_cache_write(qkv, cos, sin, kc, vc, start, num_heads=N, q_norm=qn, k_norm=kn)
b = new(qkv, cos, sin, kc, vc, start, num_heads=N, q_norm=qn, k_norm=kn)
x = rotate_and_cache(qkv, cos, sin, kc, vc, start, num_heads=N, q_norm=qn, k_norm=kn, eps=1e-6, kernels="xla")
f32 = rotate_and_cache(*(t.astype(jnp.float32) for t in (qkv, cos, sin, kc, vc)), start, num_heads=N, q_norm=qn.astype(jnp.float32), k_norm=kn.astype(jnp.float32), eps=1e-6, kernels="xla")
for name, o in (("old", a), ("new", b), ("xla", x)):
    print("rope", name, "bitwise==old:", [bool(np.array_equal(np.asarray(p, np.float32), np.asarray(q, np.float32))) for p, q in zip(o, a)],
          "max err vs f32:", [float(jnp.abs(p.astype(jnp.float32) - q).max()) for p, q in zip(o, f32)],
          "mean err:", [float(jnp.abs(p.astype(jnp.float32) - q).mean()) for p, q in zip(o, f32)])

def arn_w(x, d, w, nw):
    M, D = x.shape
    row = pl.BlockSpec((None, D), lambda m: (m, 0)); out = jax.ShapeDtypeStruct((M, D), x.dtype)
    return pl.pallas_call(functools.partial(arn._kernel, eps=1e-6, with_delta=True), grid=(M,),
        in_specs=[row, row, pl.BlockSpec((D,), lambda m: (0,))], out_specs=[row, row], out_shape=[out, out],
        compiler_params=pltriton.CompilerParams(num_warps=nw, num_stages=1))(x, d, w)
M, D = 64, 4096
xx = jax.random.normal(ks[6], (M, D), dt); dd = jax.random.normal(ks[7], (M, D), dt); ww = (1 + 0.1 * jax.random.normal(ks[4], (D,))).astype(dt)
s32 = xx.astype(jnp.float32) + dd.astype(jnp.float32)
ref = ww.astype(jnp.float32) * s32 * lax.rsqrt((s32 * s32).mean(-1, keepdims=True) + 1e-6)
r4 = arn_w(xx, dd, ww, 4)[1]
for nw in (4, 16):
    r = arn_w(xx, dd, ww, nw)[1]
    print("arn warps", nw, "bitwise==w4:", bool(np.array_equal(np.asarray(r, np.float32), np.asarray(r4, np.float32))),
          "n differing:", int((r != r4).sum()), "max err vs f32:", float(jnp.abs(r.astype(jnp.float32) - ref).max()), "mean:", float(jnp.abs(r.astype(jnp.float32) - ref).mean()))
