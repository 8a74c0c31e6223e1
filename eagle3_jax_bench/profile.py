"""Where a step's time goes: GPU kernel times from a profiler trace, grouped by kind, the kernels in an
executable, and XLA compilations counted inside a block."""

from __future__ import annotations

import contextlib
import glob
import re
import shutil
import tempfile

import jax

from eagle3_jax.decoding.warm_start import BACKEND_COMPILE_EVENT, Compilations


def gpu_events(run) -> list[tuple[str, float, float]]:
    """(kernel name, start us, duration us) of every GPU kernel one run() launched, from a jax.profiler trace,
    in start order ([] without a GPU)."""
    if jax.default_backend() != "gpu":
        return []
    run()  # not traced: the first call after a trace starts can pay for setup
    log_dir = tempfile.mkdtemp()
    jax.profiler.start_trace(log_dir)
    jax.block_until_ready(run())
    jax.profiler.stop_trace()
    trace = glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True)[0]
    data = jax.profiler.ProfileData.from_file(trace)
    shutil.rmtree(log_dir)
    events = []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if "stream" in line.name.lower():  # kernels, not derived lines like "XLA Ops"
                    events += [(e.name, e.start_ns / 1e3, e.duration_ns / 1e3) for e in line.events]
    return sorted(events, key=lambda e: e[1])


def gpu_kernel_times(run, reps: int = 2) -> dict[str, list]:
    """{kernel name: [launches, GPU microseconds]} per run(), the mean over reps traced calls ({} without a GPU)."""
    found: dict[str, list] = {}
    for _ in range(reps):
        for name, _, us in gpu_events(run):
            entry = found.setdefault(name, [0, 0.0])
            entry[0] += 1 / reps
            entry[1] += us / reps
    return found


def busy_and_idle(events: list[tuple[str, float, float]]) -> tuple[float, float]:
    """(microseconds some kernel ran, microseconds between the first kernel's start and the last's end when none
    ran) of one call's events: the idle part is what launches and the gaps between kernels cost."""
    if not events:
        return 0.0, 0.0
    busy, end = 0.0, events[0][1]
    for _, start, us in events:  # in start order; time when kernels overlap (other streams) is counted once
        busy += max(0.0, start + us - max(start, end))
        end = max(end, start + us)
    return busy, end - events[0][1] - busy


def kernel_sources(hlo_text: str, kernels: list[str], most: int = 4) -> dict[str, list[str]]:
    """{kernel name: the source ops (jax's op_name metadata, jit and loop prefixes cut) of the HLO instruction a
    trace's kernel is named after and of what it fuses, at most `most`}: which lines of the model a fusion runs.
    A kernel XLA reuses for identical fusions is named after one of them; a name with no instruction: []."""
    bodies: dict[str, str] = {}
    for block in re.split(r"\n(?=\S)", hlo_text):  # computations start at column 0
        head = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
        if head:
            bodies[head.group(1)] = block
    out = {}
    for kernel in kernels:
        found = re.search(rf"%({re.escape(kernel).replace('_', '[._]')}) = .*", hlo_text)
        ops: list[str] = []
        if found:
            line = found.group(0)
            called = re.search(r"calls=%([\w.\-]+)", line)
            text = line + ("\n" + bodies.get(called.group(1), "") if called else "")
            for name in re.findall(r'op_name="([^"]+)"', text):
                short = re.sub(r"^(jit\([^)]*\)/)?((while|body|cond|closed_call|checkpoint|jvp\(\w+\))/)*", "", name)
                if short not in ops:
                    ops.append(short)
        out[kernel] = ops[:most]
    return out


KERNEL_GROUPS = (  # (group, substrings of a kernel's name), first match wins
    ("matmuls", ("gemm", "cublas", "dot")),
    ("attention", ("attention", "entry_mosaic_gpu_kernel")),  # the paged kernel's Mosaic GPU call
    ("fused norm", ("add_rms_norm",)),
    ("routed experts", ("moe_gate_up", "moe_down")),
    ("MoE router", ("moe_router",)),
    ("RoPE + KV write", ("rope_page_write",)),
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
    """Counts XLA backend compilations inside a `with` block (JAX's own monitoring events, not timing): without
    fun_name, warm_start.Compilations' count (a program loaded from the persistent compilation cache is not one);
    with fun_name, only those of functions of that __name__ (the event's `fun_name` wraps it: "jit(name)")."""

    def __init__(self, fun_name: str | None = None):
        self.fun_name = fun_name

    def __enter__(self):
        self._named, self._all = 0, None
        if self.fun_name is None:
            self._all = Compilations()
        else:
            jax.monitoring.register_event_duration_secs_listener(self._listen)
        return self

    @property
    def count(self) -> int:
        return self._named if self._all is None else self._all.count

    def _listen(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT and self.fun_name == _bare(kwargs.get("fun_name", "")):
            self._named += 1

    def __exit__(self, *exc):
        if self._all is None:
            jax.monitoring.unregister_event_duration_listener(self._listen)
        else:
            self._all.close()
        return False


def _bare(fun_name: str) -> str:
    """A compilation event's function name without its transform: "jit(spec_rounds)" -> "spec_rounds"."""
    head, _, inner = fun_name.partition("(")
    return inner[:-1] if inner.endswith(")") and head.isidentifier() else fun_name
