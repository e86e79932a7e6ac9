"""One of several processes of a packed data-parallel step (`jax.distributed`, CPU devices,
Gloo collectives), run by `tests/test_packing_sharded.py`:

    python -m tests.multiprocess_packing PROCESS_ID NUM_PROCESSES PORT OUT

Each process has 2 host devices; together they hold the 4 shards of that file's tiny Llama
batch, pack them per device and take one gradient. Process 0 writes the loss and the
gradient's leaves to OUT (`.npz`).
"""

import os
import sys


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes,
                             process_id=process_id)
  # Imported only now: the test module asks for the devices when imported.
  import numpy as np
  from jax.sharding import NamedSharding, PartitionSpec as P

  from sebp_jax import token_capacity
  from tests import test_packing_sharded as shared

  model = shared.tiny_models()["llama"]
  ids, mask, labels = shared._batch(3)
  capacity = token_capacity(mask, multiple=8, num_shards=shared.SHARDS)
  mesh = shared._mesh()

  def put(array, spec):  # Every process holds the whole batch; each places its shards.
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

  params = jax.device_put(model.params, NamedSharding(mesh, P()))
  sebp = dict(batch_axes="data", mesh=mesh, attention="rows")
  loss, grads = jax.jit(jax.value_and_grad(shared._loss(model, "llama", capacity, sebp)))(
      params, *(put(a, P("data")) for a in (ids, mask, labels)))
  leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(grads)]  # Replicated: local copies.
  if process_id == 0:
    np.savez(out, loss=np.asarray(loss), **{f"leaf_{i}": leaf for i, leaf in enumerate(leaves)})
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
