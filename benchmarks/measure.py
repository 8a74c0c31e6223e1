"""The measuring pieces of `eagle3-jax bench`: random inputs on the device, timing, ceilings, floors,
and the jitted step functions it times (each donates its last argument, the state it updates)."""

from __future__ import annotations

import contextlib
import functools
import glob
import shutil
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from eagle3_jax.models import eagle3 as drafter_lib
from eagle3_jax.models import layers
from eagle3_jax.models import qwen3 as target_lib
from eagle3_jax.models.config import Qwen3Config, RopeConfig
from eagle3_jax.models.eagle3 import DrafterConfig
from eagle3_jax.models.kv_cache import KVCache


def model_pair(*, vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int,
               head_dim: int, theta: float, draft_vocab: int, tied: bool = False,
               max_positions: int = 40960) -> tuple[Qwen3Config, DrafterConfig]:
    """A Qwen3 target's config and an EAGLE-3 drafter's of the same width and layer shape, capturing the
    target's default layers: the pairs the benchmarks and GPU checks build random weights for."""
    rope = RopeConfig(theta=theta, head_dim=head_dim)
    target = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_layers=layers,
                         num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6, rope=rope,
                         tie_word_embeddings=tied, max_position_embeddings=max_positions)
    drafter = DrafterConfig(hidden_size=hidden, intermediate_size=intermediate, num_heads=heads, num_kv_heads=kv_heads,
                            head_dim=head_dim, rms_norm_eps=1e-6, rope=rope, draft_vocab_size=draft_vocab,
                            target_vocab_size=vocab, target_hidden_size=hidden,
                            capture_layers=target.default_capture_layers)
    return target, drafter


def random_tree(abstract, seed: int):
    """Random device arrays for a tree of ShapeDtypeStructs: matrices normal * 0.02, vectors (the norm
    weights) 1 + normal * 0.02 so logits are not flat, integers (d2t) zero: draft ids are target ids."""
    leaves, treedef = jax.tree.flatten(abstract)
    out = []
    for i, leaf in enumerate(leaves):
        key = jax.random.key(seed * 1000 + i)
        if jnp.issubdtype(leaf.dtype, jnp.integer):
            out.append(jnp.zeros(leaf.shape, leaf.dtype))
        elif len(leaf.shape) == 1:
            out.append((1 + normal(key, leaf.shape, jnp.float32)).astype(leaf.dtype))
        else:
            out.append(normal(key, leaf.shape, leaf.dtype))
    return jax.tree.unflatten(treedef, out)


@functools.partial(jax.jit, static_argnums=(1, 2))
def normal(key, shape, dtype):
    return (jax.random.normal(key, shape, jnp.float32) * 0.02).astype(dtype)


def random_cache(num_layers, batch, kv_heads, capacity, head_dim, length, dtype, seed) -> KVCache:
    shape = (batch, kv_heads, capacity, head_dim)
    return KVCache(
        k=tuple(normal(jax.random.key(seed + 2 * i), shape, dtype) for i in range(num_layers)),
        v=tuple(normal(jax.random.key(seed + 2 * i + 1), shape, dtype) for i in range(num_layers)),
        lengths=jnp.full((batch,), length, jnp.int32),
    )


def time_chain(compiled, state, args, reps: int, inner: int):
    """Median seconds per call of `state, out = compiled(*args, state)`, state donated and rebound."""
    for _ in range(3):
        state, _ = compiled(*args, state)
    jax.block_until_ready(state)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            state, _ = compiled(*args, state)
        jax.block_until_ready(state)
        samples.append((time.perf_counter() - start) / inner)
    return statistics.median(samples), state


def gpu_kernel_times(run, reps: int = 2) -> dict[str, list]:
    """{kernel name: [launches, GPU microseconds]} per run(), from a jax.profiler trace ({} without a GPU)."""
    if jax.default_backend() != "gpu":
        return {}
    run()  # not traced: the first call after a trace starts can pay for setup
    log_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(log_dir)
    for _ in range(reps):
        jax.block_until_ready(run())
    jax.profiler.stop_trace()
    trace = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(trace)
    shutil.rmtree(log_dir)
    found: dict[str, list] = {}
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if "stream" in line.name.lower():  # kernels, not derived lines like "XLA Ops"
                    for event in line.events:
                        entry = found.setdefault(event.name, [0, 0.0])
                        entry[0] += 1 / reps
                        entry[1] += event.duration_ns / reps / 1e3
    return found


KERNEL_GROUPS = (  # (group, substrings of a kernel's name), first match wins
    ("matmuls", ("gemm", "cublas", "dot")),
    ("attention", ("attention",)),
    ("fused norm / rope / cache write", ("add_rms_norm", "rope_cache_write")),
)


# The batch-1 matvecs are XLA reduction fusions (layers.linear); they are the only reductions in a step
# that take this long per launch, the norms' and split-K reduces' take about 1-2 us.
MATVEC_MIN_US = 4.0


def kernel_groups(kernel_times: dict[str, list]) -> dict[str, float]:
    """GPU microseconds per step by kind of kernel; what matches no group is "other (small XLA fusions)"."""
    out: dict[str, float] = {}
    for name, (count, us) in kernel_times.items():
        group = next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "other (small XLA fusions)")
        if group.startswith("other") and "reduce" in name and us / count >= MATVEC_MIN_US:
            group = "matmuls"
        out[group] = out.get(group, 0.0) + us
    return out


def compile_timed(jitted, *args, **static):
    start = time.perf_counter()
    compiled = jitted.lower(*args, **static).compile()
    return compiled, time.perf_counter() - start


class count_compilations(contextlib.ContextDecorator):
    """Counts XLA backend compilations inside a `with` block (JAX's own monitoring event, not timing)."""

    def __enter__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            self.count += 1

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listen)
        return False


BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT


def measure_copy_bandwidth(nbytes: int) -> dict:
    x = normal(jax.random.key(0), (nbytes // 2,), jnp.bfloat16)
    scale = jax.jit(lambda a: a * jnp.bfloat16(1.5))
    jax.block_until_ready(scale(x))
    samples = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(scale(x))
        samples.append(time.perf_counter() - start)
    out = {"jax_elementwise_tbps": 2 * nbytes / statistics.median(samples) / 1e12}
    del x
    try:
        import torch

        if torch.cuda.is_available():
            a = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
            b = torch.empty_like(a)
            b.copy_(a)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            times = []
            for _ in range(10):
                ev[0].record()
                b.copy_(a)
                ev[1].record()
                torch.cuda.synchronize()
                times.append(ev[0].elapsed_time(ev[1]) / 1e3)
            out["torch_copy_tbps"] = 2 * nbytes / statistics.median(times) / 1e12
            del a, b
            torch.cuda.empty_cache()
    except ImportError:
        pass
    out["copy_tbps"] = max(out.values())
    return out


def measure_matmul(n: int) -> float:
    a = normal(jax.random.key(1), (n, n), jnp.bfloat16)
    b = normal(jax.random.key(2), (n, n), jnp.bfloat16)
    mm = jax.jit(lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.float32).astype(jnp.bfloat16))
    jax.block_until_ready(mm(a, b))
    samples = []
    for _ in range(10):
        start = time.perf_counter()
        jax.block_until_ready(mm(a, b))
        samples.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(samples) / 1e12


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def target_weight_bytes(params) -> int:
    """Bytes a target step reads: every weight but the embedding, which is a gather of B x T rows."""
    return nbytes({k: v for k, v in params.items() if k != "embed"})


def kv_bytes(num_layers, batch, length, kv_heads, head_dim, itemsize) -> int:
    return num_layers * 2 * batch * length * kv_heads * head_dim * itemsize


def target_step(params, tokens, cache, *, cfg, capture, kernels):
    hidden, cache, features = target_lib.forward(params, cfg, tokens, cache, capture, kernels)
    return cache, (jnp.argmax(target_lib.logits(params, hidden, kernels), -1), features)


def draft_step(params, embed, h, token, cache, *, cfg, kernels):
    out, cache = drafter_lib.forward(params, cfg, embed, h[:, None], token[:, None], cache, kernels)
    return cache, drafter_lib.draft_token(params, cfg, out[:, 0])


def rebuild_step(params, embed, features, tokens, cache, *, cfg, kernels):
    h = drafter_lib.project_features(params, cfg, features)
    out, cache = drafter_lib.forward(params, cfg, embed, h, tokens, cache, kernels)
    return cache, out[:, -1]


def chain_step(params, embed, h, cache, *, cfg, gamma, kernels):
    drafts, cache = drafter_lib.draft_chain(params, cfg, embed, h, cache, gamma, kernels)
    return cache, drafts


def forward_only(params, tokens, cache, *, cfg, kernels):
    hidden, cache, _ = target_lib.forward(params, cfg, tokens, cache, (), kernels)
    return cache, hidden


def matmuls_only(params, x, state, *, cfg):
    """Only the step's weight reads: each layer's four matmuls (`layers.linear`, as the step runs them)
    and the lm_head, chained so none is dropped, with no norm, RoPE, attention or cache write. The bound
    a step built from these matmuls can reach."""
    N, H, I = cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    for layer in params["layers"]:
        qkv = layers.linear(x, layer["wqkv"])
        x = layers.linear(qkv[:, : N * H], layer["wo"])
        gate_up = layers.linear(x, layer["w_gate_up"])
        x = layers.linear(gate_up[:, :I], layer["w_down"])
    return state + 1, target_lib.logits(params, x).argmax(-1)


def jit_step(fn, num_args, **static):
    """jit with the state (last argument) donated, so the step updates its buffers in place."""
    return jax.jit(functools.partial(fn, **static), donate_argnums=(num_args - 1,))


def kernel_count(compiled) -> int:
    """Kernels (fusions and library calls) in the optimised HLO's entry computation."""
    text = compiled.as_text()
    entry = text[text.find("ENTRY"):]
    return sum(line.count(" fusion(") + line.count(" custom-call(") for line in entry.splitlines())
