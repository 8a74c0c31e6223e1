"""Where a step's time goes: GPU kernel times from a profiler trace, grouped by kind, the kernels in an
executable, and XLA compilations counted inside a block."""

from __future__ import annotations

import contextlib
import glob
import shutil
import tempfile

import jax


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
    ("fused norm", ("add_rms_norm",)),
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


def kernel_count(compiled) -> int:
    """Kernels (fusions and library calls) in the optimised HLO's entry computation."""
    text = compiled.as_text()
    entry = text[text.find("ENTRY"):]
    return sum(line.count(" fusion(") + line.count(" custom-call(") for line in entry.splitlines())


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
