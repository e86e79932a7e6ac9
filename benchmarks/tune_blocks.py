"""Sweeps block sizes of the Pallas SEBP kernels and reports the fastest per shape.

    python -m benchmarks.tune_blocks --out tune.jsonl

Times ``gathered_dx`` and ``gathered_dw_db`` (with bias, index given) for each
candidate ``BlockSizes`` on each layer shape at one T and kept fraction (default
T=16384, 20%, bf16), and (``--kernels mosaic``) the whole count-following Mosaic GPU
backward ``kept_rows_backward`` for each candidate ``MosaicBlockSizes``, on an index as
long as T. The winners feed the defaults of ``pallas_kernels/`` by hand: there is no
runtime autotuning.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
from tqdm import tqdm

from benchmarks.harness import (ALL_SHAPES, append_json_lines, median_ms, over_input_sets,
                                parse_shapes, parse_subset, record)
from benchmarks.layer import Case, make_inputs
from pallas_kernels import BlockSizes, gathered_dw_db, gathered_dx
from pallas_kernels.sebp_matmul_mgpu import MatmulTiles, MosaicBlockSizes, kept_rows_backward

# BlockSizes(block_rows, block_d, block_n, split_rows, num_warps, num_stages).
# dx tiles [rows, D], stepping over N.
DX_CANDIDATES = [
    BlockSizes(128, 256, 64, 1, 8, 3),
    BlockSizes(128, 256, 64, 1, 8, 4),
    BlockSizes(128, 256, 32, 1, 8, 4),
    BlockSizes(256, 128, 64, 1, 8, 3),
    BlockSizes(128, 128, 64, 1, 8, 3),
    BlockSizes(128, 128, 64, 1, 4, 4),
    BlockSizes(128, 128, 32, 1, 4, 5),
    BlockSizes(64, 128, 64, 1, 4, 3),
]
# dW tiles [D, N], stepping over the selected rows; splits for small D * N.
DW_CANDIDATES = [
    BlockSizes(64, 128, 128, 1, 4, 4),
    BlockSizes(64, 128, 128, 1, 4, 3),
    BlockSizes(64, 128, 128, 1, 8, 4),
    BlockSizes(128, 128, 128, 1, 8, 3),
    BlockSizes(64, 256, 128, 1, 8, 4),
    BlockSizes(64, 128, 256, 1, 8, 4),
    BlockSizes(64, 64, 128, 1, 4, 4),
    BlockSizes(64, 128, 128, 2, 4, 4),
    BlockSizes(64, 128, 128, 4, 4, 4),
    BlockSizes(64, 128, 128, 4, 8, 3),
    BlockSizes(64, 64, 128, 4, 4, 4),
    # Deeper pipelines: dW's in-loop row-index load takes stages of its own
    # (see _DW_DEFAULTS in pallas_kernels/sebp_matmul.py).
    BlockSizes(64, 128, 128, 1, 8, 5),
    BlockSizes(64, 128, 128, 1, 8, 6),
    BlockSizes(64, 128, 128, 1, 4, 5),
    BlockSizes(64, 128, 128, 1, 4, 6),
    BlockSizes(32, 128, 128, 1, 4, 6),
    BlockSizes(32, 128, 128, 1, 8, 7),
    BlockSizes(128, 128, 128, 1, 8, 5),
    BlockSizes(64, 256, 128, 1, 8, 5),
    BlockSizes(64, 128, 256, 1, 8, 5),
    BlockSizes(64, 128, 128, 2, 8, 5),
    BlockSizes(64, 128, 128, 4, 4, 5),
    BlockSizes(64, 64, 128, 4, 4, 5),
    BlockSizes(64, 64, 128, 4, 4, 6),
]

# The count-following backward: dX's tiles varied at fixed dW tiles, then dW's at fixed dX
# tiles (MatmulTiles(block_m, block_n, block_k, max_concurrent_steps, split_k)).
_MOSAIC_DX = [MatmulTiles(*tiles) for tiles in (
    (128, 128, 64, 4), (128, 128, 64, 5), (128, 128, 64, 6), (64, 128, 64, 6),
    (128, 64, 64, 6), (64, 256, 64, 4), (64, 256, 64, 5))]
_MOSAIC_DW = [MatmulTiles(*tiles) for tiles in (
    (128, 128, 64, 5), (128, 128, 64, 4, 2), (128, 128, 64, 5, 2), (64, 256, 64, 4),
    (64, 256, 64, 5), (128, 64, 64, 6), (128, 128, 64, 4, 3), (128, 128, 64, 3, 4))]
MOSAIC_CANDIDATES = [
    *(MosaicBlockSizes(dx=dx) for dx in _MOSAIC_DX),
    *(MosaicBlockSizes(dw=dw) for dw in _MOSAIC_DW),
    MosaicBlockSizes(copy_rows=256),
]
KERNELS = ("dx", "dw", "mosaic")


def _kernels(case: Case, kernels: tuple[str, ...]):
  dtype = jnp.dtype(case.dtype)
  x = jax.ShapeDtypeStruct((case.num_rows, case.d), dtype)
  kernel = jax.ShapeDtypeStruct((case.d, case.n), dtype)
  dy = jax.ShapeDtypeStruct((case.num_rows, case.n), dtype)
  rows = jax.ShapeDtypeStruct((case.num_kept,), jnp.int32)
  interpret = jax.default_backend() == "cpu"  # CPU: a smoke test only.
  if "dx" in kernels:
    for blocks in DX_CANDIDATES:
      fn = lambda dy_, k_, r_, b=blocks: gathered_dx(
          dy_, k_, r_, block_sizes=b, interpret=interpret)
      yield "dx", blocks, fn, (dy, kernel, rows)
  if "dw" in kernels:
    for blocks in DW_CANDIDATES:
      # float32 stores, as the pallas implementation asks for float32 parameters.
      fn = lambda x_, dy_, r_, b=blocks: gathered_dw_db(
          x_, dy_, r_, with_bias=True, dw_dtype=jnp.float32, db_dtype=jnp.float32,
          block_sizes=b, interpret=interpret)
      yield "dw", blocks, fn, (x, dy, rows)
  if "mosaic" in kernels:
    every_row = jax.ShapeDtypeStruct((case.num_rows,), jnp.int32)
    for blocks in MOSAIC_CANDIDATES:
      fn = lambda x_, k_, dy_, r_, b=blocks: kept_rows_backward(
          x_, k_, dy_, r_, with_bias=True, dw_dtype=jnp.float32, db_dtype=jnp.float32,
          block_sizes=b, interpret=interpret)
      yield "mosaic", blocks, fn, (x, kernel, dy, every_row)


def _parse_kernels(text: str) -> tuple[str, ...]:
  """``--kernels``: a comma-separated subset of dx,dw,mosaic, each named once, in sweep
  order."""
  names = parse_subset(text, KERNELS)
  return tuple(name for name in KERNELS if name in names)


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.tune_blocks",
      description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="append one JSON object per measurement")
  parser.add_argument("--shapes", type=parse_shapes, default=ALL_SHAPES,
                      help="as in benchmarks.layer (default: all)")
  parser.add_argument("--kernels", type=_parse_kernels, default=("dx", "dw"),
                      help="comma-separated subset of dx,dw,mosaic to sweep (default: dx,dw)")
  parser.add_argument("--tokens", type=int, default=16384, help="T, rows of dY")
  parser.add_argument("--kept", type=int, default=20, help="kept percent")
  parser.add_argument("--dtype", default="bfloat16", help="dtype of x, W and dY")
  parser.add_argument("--repeats", type=int, default=20, help="timed repeats; the median")
  parser.add_argument("--input-sets", type=int, default=4,
                      help="distinct random inputs evaluated per timed call")
  parser.add_argument("--compile-threads", type=int, default=8,
                      help="threads compiling the candidates ahead of timing")
  args = parser.parse_args(argv)

  cases = [Case(d, n, args.tokens, args.kept, args.dtype)
           for d, n in args.shapes]
  jobs = [(case, *job) for case in cases for job in _kernels(case, args.kernels)]

  def compile_one(job):
    case, name, blocks, fn, shapes = job
    try:
      executable = jax.jit(over_input_sets(fn)).lower(
          *[shapes] * args.input_sets).compile()
      return executable, None
    except Exception as error:  # A tile that does not fit is a result too.
      return None, f"{type(error).__name__}: {str(error)[:200]}"

  with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
    compiled = list(tqdm(pool.map(compile_one, jobs), total=len(jobs),
                         desc="compile", file=sys.stderr))

  records = []
  for case in tqdm(cases, desc="time", file=sys.stderr):
    input_sets = [make_inputs(case, seed) for seed in range(args.input_sets)]
    inputs = {"dx": [(dy, kernel, rows) for _, kernel, _, dy, rows in input_sets],
              "dw": [(x, dy, rows) for x, _, _, dy, rows in input_sets],
              "mosaic": [(x, kernel, dy, jnp.pad(rows, (0, case.num_rows - rows.shape[0]),
                                                 constant_values=case.num_rows))
                         for x, kernel, _, dy, rows in input_sets]}
    for (job_case, name, blocks, _, _), (executable, error) in zip(jobs,
                                                                   compiled):
      if job_case != case:
        continue
      ms = (median_ms(executable, *inputs[name], repeats=args.repeats, calls_per_repeat=3,
                      work_items=args.input_sets)
            if executable is not None else None)
      records.append(record(shape=case.shape_name, tokens=case.num_rows,
                            kept_percent=case.kept_percent, dtype=case.dtype, kernel=name,
                            blocks=dataclasses.asdict(blocks), median_ms=ms, error=error))

  append_json_lines(args.out, records)
  print(f"{'shape':>10} {'kernel':>6} {'best ms':>8} {'worst ms':>8}  best blocks")
  for case in cases:
    for name in args.kernels:
      timed = [r for r in records if r["shape"] == case.shape_name
               and r["kernel"] == name and r["median_ms"] is not None]
      if not timed:
        print(f"{case.shape_name:>10} {name:>6}  no candidate compiled")
        continue
      best = min(timed, key=lambda r: r["median_ms"])
      worst = max(r["median_ms"] for r in timed)
      print(f"{case.shape_name:>10} {name:>6} {best['median_ms']:8.3f} "
            f"{worst:8.3f}  {tuple(best['blocks'].values())}")
  for r in records:
    if r["error"]:
      print(f"failed {r['shape']} {r['kernel']} {r['blocks']}: {r['error']}")


if __name__ == "__main__":
  main()
