"""One of two processes decoding on one mesh over both (jax.distributed, gloo collectives on the CPU):
run by tests/test_tensor_parallel.py as `python tests/tp_two_processes.py PROCESS PORT TARGET_FOLDER`;
prints the greedy and the seeded sampled tokens as JSON."""

import json
import sys

import jax

PROCESS, PORT, FOLDER = int(sys.argv[1]), sys.argv[2], sys.argv[3]
PROMPTS = [[1, 5, 7, 9, 11], [3, 4]]


def main():
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{PORT}", num_processes=2, process_id=PROCESS)
    import eagle3_jax
    from eagle3_jax.parallel.mesh import tp_mesh

    assert jax.process_count() == 2 and jax.device_count() == 2
    mesh = tp_mesh(2)
    target = eagle3_jax.load_target(FOLDER, dtype="float32", progress=False, mesh=mesh)
    engine = eagle3_jax.Engine(target, max_len=32, max_batch=2, mesh=mesh)
    greedy = engine.generate(PROMPTS, 10)
    sampled = engine.generate(PROMPTS, 10, temperature=0.9, top_k=30, top_p=0.9, seed=11)
    print(json.dumps([[r.token_ids for r in greedy], [r.token_ids for r in sampled]]))


if __name__ == "__main__":
    main()
