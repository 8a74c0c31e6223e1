import gc
import os
from pathlib import Path

import pytest

# The suite runs on the CPU in float32 (Pallas kernels in interpret mode); `pytest -m gpu` runs the GPU
# checks (tests/test_gpu.py) on the machine's GPU instead.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The CLI's persistent compilation cache stays off in the test process (test_cli turns it on in a subprocess).
os.environ["EAGLE3_JAX_COMPILE_CACHE"] = ""


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: numerical checks at real shapes on a GPU (pytest -m gpu)")
    config.addinivalue_line("markers", "lm_eval: lm-evaluation-harness against the server (the lm-eval extra)")
    if config.option.markexpr != "gpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # The CPU suite's time is mostly XLA compiling tiny programs; without its optimisation passes it
        # compiles them in about 40% less time, and tiny programs run about as fast unoptimised.
        flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
        os.environ.setdefault("XLA_FLAGS", flags)
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    jax.monitoring.register_event_duration_secs_listener(_count_compile)
    if os.environ.get(PROGRAM_TABLE):
        jax.monitoring.register_event_duration_secs_listener(_count_program)


# The programs each test file compiles (jax's monitoring events: backend compilations, and the seconds of those and
# of tracing and lowering), appended as JSON lines to the file $EAGLE3_JAX_PROGRAM_TABLE names when it is set, one
# per file and process (tools/program_table.py sums them into tests/README.md's table).
PROGRAM_TABLE = "EAGLE3_JAX_PROGRAM_TABLE"
_EVENTS = {"/jax/core/compile/backend_compile_duration": "compile_s",
           "/jax/core/compile/jaxpr_trace_duration": "trace_s",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower_s"}
_programs: dict[str, dict[str, float]] = {}
_current = ["(session)"]


def _count_program(event: str, duration: float, **kwargs) -> None:
    column = _EVENTS.get(event)
    if column is not None:
        counts = _programs.setdefault(_current[0], {"programs": 0, "compile_s": 0.0, "trace_s": 0.0, "lower_s": 0.0})
        counts[column] += duration
        counts["programs"] += column == "compile_s"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current[0] = item.location[0]
    return (yield)


def pytest_sessionfinish(session):
    if os.environ.get(PROGRAM_TABLE) and _programs:
        import json

        with open(os.environ[PROGRAM_TABLE], "a") as out:
            for name, counts in _programs.items():
                out.write(json.dumps({"file": name, **counts}) + "\n")


# Each program XLA:CPU compiles keeps three memory mappings per kernel (code, constants, data: about 330 for one of
# the engine's tiny calls) and some 20-70 MB of memory, and jax keeps every program: a worker that runs many tests
# passes the kernel's mapping limit (vm.max_map_count, 65530 by default) after about 200 of them, and XLA then fails
# its next compile ("Cannot allocate memory") or crashes, or two workers outgrow the machine's memory (a worker of
# 7.8 GB was killed on the 24 GB machine). After any test that compiled 16 programs or more since the last look, a
# worker past half the mapping limit or a sixth of the machine's memory clears jax's caches and hands the freed memory
# back to the system (malloc_trim); below that, later tests keep reusing earlier compilations.
_MAPS = Path("/proc/self/maps")
_MAP_LIMIT = Path("/proc/sys/vm/max_map_count")
_compiled_since_count = [0]


def _count_compile(event: str, duration: float, **kwargs) -> None:
    _compiled_since_count[0] += event == "/jax/core/compile/backend_compile_duration"


def _crowded() -> bool:
    """Whether this process holds more than half the mapping limit or a sixth of the machine's memory."""
    with _MAPS.open() as maps:
        if sum(1 for _ in maps) > int(_MAP_LIMIT.read_text()) // 2:
            return True
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return resident > os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 6


@pytest.fixture(autouse=True)
def _bounded_memory():
    yield
    if _compiled_since_count[0] >= 16 and _MAPS.exists() and _MAP_LIMIT.exists():
        _compiled_since_count[0] = 0
        if _crowded():
            import ctypes

            import jax

            jax.clear_caches()
            gc.collect()
            ctypes.CDLL("libc.so.6").malloc_trim(0)
