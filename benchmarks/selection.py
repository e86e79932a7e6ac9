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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks.harness import (append_json_lines, median_ms, parse_positive_ints, positive_int,
                                record)
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


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.selection",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--tokens", type=parse_positive_ints, default=[16384, 65536],
                      help="comma list of T")
  parser.add_argument("--widths", type=parse_positive_ints, default=[768, 2048, 8192],
                      help="comma list of N, the width of dY")
  parser.add_argument("--kept", type=float, default=0.2, help="top_n as a fraction of T, in (0, 1]")
  parser.add_argument("--repeats", type=positive_int, default=50,
                      help="timed repeats; the median")
  parser.add_argument("--out", default=None, help="append JSON lines here")
  args = parser.parse_args(argv)
  if not 0 < args.kept <= 1:
    parser.error(f"--kept must lie in (0, 1], got {args.kept}")
  if int(min(args.tokens) * args.kept) < 1:
    parser.error(f"--kept {args.kept} of {min(args.tokens)} tokens keeps no row")
  records = []
  print(f"{'T':>6} {'N':>5} {'regime':8} " + " ".join(f"{v:>12}" for v in VARIANTS))
  for num_rows in args.tokens:
    for width in args.widths:
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
          times[name] = median_ms(jax.jit(lambda a, fn=fn: fn(a, top_n)), data,
                                  repeats=args.repeats, warmup=1)
          records.append(record(T=num_rows, N=width, top_n=top_n, regime=regime, variant=name,
                                median_ms=times[name]))
        print(f"{num_rows:6d} {width:5d} {regime:8} "
              + " ".join(f"{times[v]:12.4f}" for v in VARIANTS))
  append_json_lines(args.out, records)


if __name__ == "__main__":
  main()
