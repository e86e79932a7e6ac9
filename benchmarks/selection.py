"""Times the row selection of the SEBP backward against the alternatives it was chosen over.

    python -m benchmarks.selection --out selection.jsonl

For T rows of dY [T, N] (bf16) and top_n = 20% of T, in two regimes: ``padding`` (exactly
top_n rows non-zero, the fine-tuning case) and ``dense`` (every row non-zero, so top_n must be
ranked), it times

* ``library``: :func:`sebp_jax.select_active_rows` as shipped;
* ``top_k_only``: score, ``lax.top_k`` over all rows, sentinel for inactive slots, sort: one
  code path for both regimes, no ``lax.cond``;
* ``scores_only``: the fused scoring pass alone (one read of dY: the floor of any selection).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.records import append_json_lines
from sebp_jax.selection import row_scores, select_active_rows


def top_k_only(dy, top_n, threshold=0.0):
  scores, _ = row_scores(dy, threshold)
  top_scores, rows = lax.top_k(scores, top_n)
  rows = jnp.where(top_scores < 0, dy.shape[0], rows.astype(jnp.int32))
  return jnp.sort(rows)


def scores_only(dy, top_n, threshold=0.0):
  del top_n
  return row_scores(dy, threshold)[0]


VARIANTS = {"library": select_active_rows, "top_k_only": top_k_only,
            "scores_only": scores_only}


def median_ms(fn, arg, repeats):
  jax.block_until_ready(fn(arg))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(arg))
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tokens", default="16384,65536")
  parser.add_argument("--widths", default="768,2048,8192")
  parser.add_argument("--kept", type=float, default=0.2)
  parser.add_argument("--repeats", type=int, default=50)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  records = []
  print(f"{'T':>6} {'N':>5} {'regime':8} " + " ".join(f"{v:>12}" for v in VARIANTS))
  for num_rows in map(int, args.tokens.split(",")):
    for width in map(int, args.widths.split(",")):
      top_n = int(num_rows * args.kept)
      rng = np.random.default_rng(0)
      dy = rng.standard_normal((num_rows, width), dtype=np.float32)
      for regime in ("padding", "dense"):
        data = dy.copy()
        if regime == "padding":
          data[rng.permutation(num_rows)[top_n:]] = 0
        data = jnp.asarray(data, jnp.bfloat16)
        times = {}
        for name, fn in VARIANTS.items():
          times[name] = median_ms(jax.jit(lambda a, fn=fn: fn(a, top_n)), data, args.repeats)
          records.append({"T": num_rows, "N": width, "top_n": top_n, "regime": regime,
                          "variant": name, "median_ms": times[name],
                          "device": jax.devices()[0].device_kind,
                          "jax_version": jax.__version__})
        print(f"{num_rows:6d} {width:5d} {regime:8} "
              + " ".join(f"{times[v]:12.4f}" for v in VARIANTS))
  append_json_lines(args.out, records)


if __name__ == "__main__":
  main()
