"""One of two processes decoding on one mesh over both (jax.distributed, gloo collectives on the CPU):
started by tests/tp_four_devices.py as `python tests/tp_two_processes.py PROCESS PORT TARGET DRAFTER MAX_LEN
NEW PROMPTS SAMPLING` (the last two as JSON); speculates for the sampled rows and prints the tokens as JSON."""

import json
import sys

import jax

PROCESS, PORT, TARGET, DRAFTER = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
MAX_LEN, NEW, PROMPTS, SAMPLING = int(sys.argv[5]), int(sys.argv[6]), json.loads(sys.argv[7]), json.loads(sys.argv[8])


def main():
    jax.config.update("jax_default_matmul_precision", "highest")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{PORT}", num_processes=2, process_id=PROCESS)
    import eagle3_jax
    from eagle3_jax.parallel.mesh import tp_mesh

    assert jax.process_count() == 2 and jax.device_count() == 2
    mesh = tp_mesh(2)
    target = eagle3_jax.load_target(TARGET, dtype="float32", progress=False, mesh=mesh)
    drafter = eagle3_jax.load_drafter(DRAFTER, target, dtype="float32")
    engine = eagle3_jax.Engine(target, drafter, num_draft_tokens=3, max_len=MAX_LEN, proposal="argmax", mesh=mesh)
    print(json.dumps([r.token_ids for r in engine.generate(PROMPTS, NEW, **SAMPLING)]))


if __name__ == "__main__":
    main()
