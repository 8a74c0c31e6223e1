"""eagle3_jax_bench/paged_attention.py in its dry run (tiny shapes, float32, the kernels in their CPU
interpreters): every section writes its rows, each paged result matches the dense reference on the same keys,
and the table prints. Times are not asserted: speed is measured on the GPU."""

import json

import jax.numpy as jnp
import numpy as np

from eagle3_jax_bench import paged_attention


def test_paged_attention_bench_dry_run(tmp_path, capsys):
    tunings = '[{"block_kv": 64, "num_splits": 2}]'
    argv = ["--dry-run", "--out", str(tmp_path), "--tunings", tunings, "--tuning-shapes", "[[1, 40, 8]]",
            "--heads", "8", "1", "64"]  # one KV head of a group of 8 (the dry run's own plan: 8 / 2)
    assert paged_attention.main(argv) == 0
    results = json.loads((tmp_path / "bench_paged_attention.json").read_text())
    assert results["skipped"] == [] and results["ceilings"]["copy_tbps"] > 0
    shapes = {s: [(r["batch"], r["keys"], r["tokens"], r["page_size"]) for r in results[s]]
              for s in paged_attention.SECTIONS}
    assert shapes == {"decode": [(3, 40, 1, 8)], "verify": [(2, 40, 4, 16)], "chunk": [(1, 40, 24, 8)],
                      "tuning": [(1, 40, 1, 8)]}
    for section in paged_attention.SECTIONS:
        for r in results[section]:
            assert not any(k.endswith("_error") for k in r), r
            assert r["paged_err"] < 1e-5 and r["paged"]["us"] > 0 and r["paged"]["of_copy"] > 0
            assert r["paged"]["tflops"] > 0 and "contiguous" not in r
            assert ("xla" in r) == (section != "tuning")  # the XLA path at the first page size, untuned rows
            assert section == "tuning" or r["xla_err"] < 1e-5
    assert results["tuning"][0]["tuning"] == {"block_kv": 64, "num_splits": 2}
    assert results["plan"]["heads"] == [8, 1, 64]
    assert "paged us" in capsys.readouterr().out


def test_page_pool_holds_each_calls_keys_in_shuffled_pages():
    """The bench's pool, read back through each call's page table, is that call's contiguous cache."""
    plan = paged_attention.tiny_plan()
    shape = paged_attention.make_shape(plan, batch=2, keys=20, tokens=1, seed=0)
    k_pages, v_pages, tables = paged_attention.page_pool(shape, 8, seed=1)
    K, H = plan.heads[1], plan.heads[2]
    assert k_pages.shape == (K, shape.calls * 2 * 3, 8, H)
    for table, (k, v) in zip(tables, shape.caches):
        assert not np.array_equal(np.asarray(table).ravel(), np.sort(np.asarray(table).ravel()))  # shuffled
        for pages, cache in ((k_pages, k), (v_pages, v)):
            read = pages[:, table].reshape(K, 2, 24, H).transpose(1, 0, 2, 3)[:, :, :20]
            np.testing.assert_array_equal(np.asarray(read), np.asarray(cache.astype(jnp.float32)))
