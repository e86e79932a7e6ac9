"""Whether every device gets the same embedding-table gradient from the gathered rows.

    python -m benchmarks.gathered_rows --tables 30522x768,128256x2048 --out rows.jsonl

In a data-parallel step each device scatters every device's kept rows of dY into its own
copy of the table's gradient (:func:`sebp_jax.sharding.gather_row_shards`), and the copies
must agree bit for bit. This runs that combine (:func:`sebp_jax.backward.sum_rows_of_equal_ids`,
then :func:`sebp_jax.backward.scatter_into_table`) ``--runs`` times on the same rows, and a
plain scatter-add of the rows beside it: a record counts the elements of each run's table
that differ from the first run's (a GPU's atomic adds sum repeated ids in any order), its
largest error against a float64 sum, and the median milliseconds of a call of each.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import append_json_lines, median_ms, parse_pairs, record
from sebp_jax.backward import scatter_into_table, sum_rows_of_equal_ids

#: (rows gathered from every device, distinct ids among them): BERT-base on 2 devices at its
#: capacity of 384 tokens, and Llama-1B shapes at 4,096.
ROW_SETS = ((768, 300), (8192, 3000))


def combines(num_embeddings: int) -> dict:
  """The two ways to make the table from ``(ids, rows)``, jitted."""
  return {
      "summed_per_id": jax.jit(lambda ids, rows: scatter_into_table(
          *sum_rows_of_equal_ids(ids, rows, num_embeddings=num_embeddings), None,
          num_embeddings=num_embeddings)),
      "scatter_add": jax.jit(lambda ids, rows: scatter_into_table(
          ids, rows, None, num_embeddings=num_embeddings)),
  }


def run(num_embeddings: int, features: int, runs: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  records = []
  for num_rows, distinct in ROW_SETS:
    ids = jnp.asarray(rng.integers(0, min(distinct, num_embeddings), num_rows), jnp.int32)
    rows = jnp.asarray(rng.normal(size=(num_rows, features)), jnp.bfloat16)
    want = np.zeros((num_embeddings, features))
    np.add.at(want, np.asarray(ids), np.asarray(rows, np.float64))
    for name, fn in combines(num_embeddings).items():
      first = np.asarray(fn(ids, rows))
      differing = [int(np.sum(np.asarray(fn(ids, rows)) != first)) for _ in range(runs - 1)]
      records.append(record(
          combine=name, table=[num_embeddings, features], rows=num_rows,
          distinct_ids=int(np.unique(np.asarray(ids)).size), runs=runs,
          differing_elements=differing,
          max_abs_error_vs_float64=float(np.max(np.abs(first - want))),
          call_ms=median_ms(fn, ids, rows, repeats=5, calls_per_repeat=10)))
  return records


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.gathered_rows",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--tables", type=lambda text: parse_pairs(text, "VxF"),
                      default=[(30522, 768), (128256, 2048)],
                      help="comma-separated table shapes, rows x features")
  parser.add_argument("--runs", type=int, default=30, help="runs of each combine")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default=None, help="append every record here as a JSON line")
  args = parser.parse_args(argv)
  if args.runs < 2:
    parser.error("--runs must be at least 2: each run is compared with the first")
  records = [r for v, f in args.tables for r in run(v, f, args.runs, args.seed)]
  for r in records:
    print(f"{r['combine']:>14} {r['table']} rows {r['rows']:>5}: runs differing "
          f"{sum(d > 0 for d in r['differing_elements'])}/{len(r['differing_elements'])}, "
          f"error {r['max_abs_error_vs_float64']:.2e}, {r['call_ms']:.3f} ms")
  append_json_lines(args.out, records)
  return records


if __name__ == "__main__":
  main()
