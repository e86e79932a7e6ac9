"""What an FSDP step's collectives cost on this host: the time and bus bandwidth of an
all-gather, a reduce-scatter and an all-reduce of bf16 arrays over every device, by size.

    python -m benchmarks.collectives --sizes-mb 8,32,64,128,256 --out collectives.jsonl

A record's ``whole_bytes`` is the whole array's size: what an all-gather returns, what a
reduce-scatter sums. The bus bandwidth is NCCL's ``busbw``, the bytes each device sends over
the time: ``whole_bytes·(n-1)/n`` for an all-gather or a reduce-scatter over ``n`` devices,
twice that for an all-reduce. It says what a step that gathers its weights and scatters
their gradients pays at the least: ``benchmarks.model`` records those bytes per step
(``collective_bytes``). Each time is the median of ``--repeats`` repeats of
``--calls-per-repeat`` calls synced once, so a small array's includes the host's dispatch of
a call; each collective runs alone, with nothing beside it on the devices.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.harness import append_json_lines, median_ms, parse_positive_ints, record

KINDS = ("all-gather", "reduce-scatter", "all-reduce")
#: The whole array's columns; its rows follow from the size.
COLUMNS = 4096


def collective(kind: str, mesh: Mesh) -> tuple[Callable, P]:
  """``(fn, in_spec)``: ``kind`` over the mesh's one axis as a jitted function of a whole
  array laid out as ``in_spec`` (split over the axis for an all-gather, on every device
  otherwise); its result is the gathered array, this device's rows of the sum, or the sum."""
  (axis,) = mesh.axis_names
  body, in_spec, out_spec = {
      "all-gather": (lambda shard: jax.lax.all_gather(shard, axis, tiled=True), P(axis), P()),
      "reduce-scatter": (lambda whole: jax.lax.psum_scatter(whole, axis, tiled=True), P(),
                         P(axis)),
      "all-reduce": (lambda whole: jax.lax.psum(whole, axis), P(), P()),
  }[kind]
  # The gathered array and the sum are the same on every device, which the types do not say.
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec,
                               check_vma=False)), in_spec


def bus_bytes(kind: str, size: int, devices: int) -> float:
  """The bytes each device sends for ``kind`` over ``devices`` of a ``size``-byte array."""
  return size * (devices - 1) / devices * (2 if kind == "all-reduce" else 1)


def run(sizes_mb: list[int], repeats: int, calls_per_repeat: int,
        out: str | None = None) -> list[dict]:
  devices = jax.devices()
  if len(devices) < 2:
    raise SystemExit("benchmarks.collectives needs at least 2 devices, this host has "
                     f"{len(devices)} (on a CPU, XLA_FLAGS="
                     "--xla_force_host_platform_device_count=N makes N)")
  mesh = Mesh(np.array(devices), ("devices",))
  records = []
  print(f"{'kind':16} {'MB':>6} {'ms':>9} {'bus GB/s':>9}")
  for size_mb in sizes_mb:
    # Rows that the devices divide, for the all-gather's shards and the reduce-scatter's.
    rows = max(1, size_mb * 2**20 // (2 * COLUMNS) // len(devices)) * len(devices)
    whole = jnp.ones((rows, COLUMNS), jnp.bfloat16)
    size = whole.nbytes
    for kind in KINDS:
      fn, in_spec = collective(kind, mesh)
      array = jax.device_put(whole, NamedSharding(mesh, in_spec))
      ms = median_ms(fn, array, repeats=repeats, calls_per_repeat=calls_per_repeat)
      row = record(kind=kind, devices=len(devices), whole_bytes=size, ms=ms,
                   bus_gb_per_s=bus_bytes(kind, size, len(devices)) / ms / 1e6,
                   repeats=repeats, calls_per_repeat=calls_per_repeat)
      records.append(row)
      print(f"{kind:16} {size / 2**20:6.0f} {ms:9.3f} {row['bus_gb_per_s']:9.0f}")
  append_json_lines(out, records)
  return records


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.collectives",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("--sizes-mb", type=parse_positive_ints, default=[8, 32, 64, 128, 256],
                      help="comma list of whole-array sizes in MiB")
  parser.add_argument("--repeats", type=int, default=7, help="timed repeats per case")
  parser.add_argument("--calls-per-repeat", type=int, default=10,
                      help="calls dispatched back to back before each sync")
  parser.add_argument("--out", default=None, help="append JSON lines here")
  args = parser.parse_args(argv)
  if args.repeats <= 0 or args.calls_per_repeat <= 0:
    parser.error("--repeats and --calls-per-repeat must be positive")
  return run(args.sizes_mb, args.repeats, args.calls_per_repeat, args.out)


if __name__ == "__main__":
  main()
