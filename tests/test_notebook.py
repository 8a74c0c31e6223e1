"""notebooks/explore_eagle3.ipynb runs top to bottom on the CPU with the demo checkpoints, writes its figures, and is
stored without outputs."""

import json
import os
import sys
from pathlib import Path

import pytest

# The notebook's runners are test extras of the CPU suite; a machine without them (the GPU image) skips the file.
nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
from jupyter_client.kernelspec import KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "explore_eagle3.ipynb"
FIGURES = ("acceptance_histogram", "acceptance_by_position", "tau_vs_gamma", "draft_tree", "round_timing")


def test_notebook_is_saved_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


def _kernel_manager(tmp_path: Path) -> KernelManager:
    """A kernel on this very interpreter (whatever python3 kernelspec the machine has), via a private kernelspec."""
    kernels = tmp_path / "kernels"
    (kernels / "eagle3-test").mkdir(parents=True)
    spec = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "eagle3-jax test", "language": "python"}
    (kernels / "eagle3-test" / "kernel.json").write_text(json.dumps(spec))
    return KernelManager(kernel_name="eagle3-test", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))


def test_notebook_runs_and_saves_figures(tmp_path, monkeypatch):
    out = tmp_path / "figures"
    # The kernel inherits this environment (JAX_PLATFORMS=cpu from conftest included).
    monkeypatch.setenv("EAGLE3_NOTEBOOK_OUT", str(out))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(nb, km=_kernel_manager(tmp_path), timeout=600,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    for name in FIGURES:
        assert (out / f"{name}.png").stat().st_size > 1000, name
