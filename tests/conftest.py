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


# Each executable XLA:CPU compiles keeps its own memory mappings, and jax keeps every executable: a worker that runs
# many test files can pass the kernel's mapping limit (vm.max_map_count, 65530 by default), and XLA then crashes in
# its next compile (a segfault). Between test files, jax's caches are cleared once a worker holds more than 3/4 of the
# limit, which frees their mappings; below that, later files keep reusing earlier compilations.
_MAPS = Path("/proc/self/maps")
_MAP_LIMIT = Path("/proc/sys/vm/max_map_count")


@pytest.fixture(autouse=True, scope="module")
def _bounded_memory_mappings():
    yield
    if _MAPS.exists() and _MAP_LIMIT.exists():
        with _MAPS.open() as maps:
            count = sum(1 for _ in maps)
        if count > 3 * int(_MAP_LIMIT.read_text()) // 4:
            import jax

            jax.clear_caches()
            gc.collect()
