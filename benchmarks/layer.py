"""Times the backward of one linear layer: dense vs SEBP (XLA and Pallas implementations).

    python -m benchmarks.layer --out results.jsonl
    python -m benchmarks.layer --shapes 2048x8192,768x3072 --tokens 16384 --kept 20 --rounds 3

For each layer shape (D -> N), token count T and kept fraction, dY is random with the
unkept rows zeroed (as padding rows are), and each variant's backward is timed on whatever
device JAX sees, as ``jax.vjp`` of its forward (XLA drops the unused forward dot):

* ``dense``: ``x @ W + b`` in plain jnp, the full backward;
* ``xla`` / ``pallas`` / ``auto``: :func:`sebp_jax.sebp_linear` with that backend, the index
  ``selected`` from dY inside the backward (``top_n`` = the kept rows, ``overflow="drop"``)
  or ``given`` (precomputed); ``auto`` and ``pallas`` also with ``top_n="auto"``
  (``auto_capacity``: ``pallas_triton`` and ``pallas_mosaic`` run once, their kernels following
  the run-time count;
  ``auto`` does so where the cost model predicts it ahead, else runs the capacity that holds
  the kept rows, chosen at run time by a ``lax.switch``);
* ``kept_matmuls``: the op's dense backward of the kept rows alone, handed over as contiguous
  ``[K, D]`` / ``[K, N]`` arrays (index ``pregathered``): what the reduced matmuls cost with
  no selection, gather or spread, the floor of any implementation built on cuBLAS-class
  matmuls. Not a valid backward (dX has K rows, not T).

The roofline bound of each variant is its FLOPs at the measured matmul rate plus the bytes
it must move at the measured copy rate (both measured in the same run). Results go to stdout
as a table and, one JSON object per measurement, to ``--out``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from benchmarks.harness import (ALL_SHAPES, append_json_lines, median_ms, over_input_sets,
                                parse_positive_ints, parse_shapes, positive_int, record)
from sebp_jax import sebp_linear

TOKENS = (4096, 16384, 65536)
KEPT_PERCENT = (5, 10, 20, 50)
SPARSE_BACKENDS = ("xla", "pallas", "auto")
INDEX_MODES = ("selected", "given", "auto_capacity")


# ---------------------------------------------------------------------------
# Timing.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeviceRates:
  """Measured ceilings: bf16 matmul FLOP/s and device copy bytes/s."""
  matmul_flops_per_s: float
  copy_bytes_per_s: float


def measure_rates(repeats: int) -> DeviceRates:
  # Sizes that saturate a GPU (a 1 GiB copy is far beyond any L2); a CPU run
  # is only a smoke test, so it gets small ones.
  on_cpu = jax.default_backend() == "cpu"
  size = 1024 if on_cpu else 8192
  keys = jax.random.split(jax.random.key(1), 2)
  a = jax.random.normal(keys[0], (size, size), jnp.bfloat16)
  b = jax.random.normal(keys[1], (size, size), jnp.bfloat16)
  matmul_ms = median_ms(jax.jit(jnp.dot), a, b, repeats=repeats, calls_per_repeat=3)
  # Elementwise op: reads and writes every byte once.
  data = jax.random.normal(keys[0], (2**22 if on_cpu else 2**29,), jnp.bfloat16)
  copy_ms = median_ms(jax.jit(lambda v: v + 1), data, repeats=repeats, calls_per_repeat=3)
  return DeviceRates(matmul_flops_per_s=2 * size**3 / (matmul_ms * 1e-3),
                     copy_bytes_per_s=2 * data.nbytes / (copy_ms * 1e-3))


def roofline_ms(d: int, n: int, num_rows: int, num_kept: int, itemsize: int,
                rates: DeviceRates, *, selected: bool) -> float:
  """FLOPs at the matmul rate plus must-move bytes at the copy rate.

  Dense is the case ``num_kept == num_rows``. dX is written whole (zeros
  included); selecting the rows reads all of dY once more.
  """
  flops = 2 * 2 * num_kept * d * n
  moved = (num_kept * (n + d)  # selected rows of dY and X
           + 2 * d * n  # W read, dW written
           + num_rows * d  # dX written
           + n)  # db
  if selected:
    moved += num_rows * n
  return 1e3 * (flops / rates.matmul_flops_per_s
                + moved * itemsize / rates.copy_bytes_per_s)


# ---------------------------------------------------------------------------
# The measured functions.
# ---------------------------------------------------------------------------


def backward_of(forward):
  """The backward of ``forward(x, kernel, bias)`` for dY, as ``jax.vjp`` computes it."""
  def backward(x, kernel, bias, dy):
    _, vjp = jax.vjp(forward, x, kernel, bias)
    return vjp(dy)
  return backward


dense_backward = backward_of(lambda x, kernel, bias: x @ kernel + bias)


def sebp_backward(backend: str, top_n: int | str):
  """The backward of :func:`sebp_jax.sebp_linear`; the index is selected from dY when
  ``active_rows`` is None."""
  def backward(x, kernel, bias, dy, active_rows=None):
    return backward_of(lambda x, kernel, bias: sebp_linear(
        x, kernel, bias, top_n=top_n, overflow="drop", backend=backend,
        active_rows=active_rows))(x, kernel, bias, dy)
  return backward


@dataclasses.dataclass(frozen=True)
class Case:
  d: int
  n: int
  num_rows: int
  kept_percent: int
  dtype: str

  @property
  def num_kept(self) -> int:
    return max(1, round(self.num_rows * self.kept_percent / 100))

  @property
  def shape_name(self) -> str:
    return f"{self.d}x{self.n}"


def variants(case: Case):
  """(backend, index_mode, fn, argument shapes) of every timed variant."""
  dtype = jnp.dtype(case.dtype)
  x = jax.ShapeDtypeStruct((case.num_rows, case.d), dtype)
  kernel = jax.ShapeDtypeStruct((case.d, case.n), dtype)
  bias = jax.ShapeDtypeStruct((case.n,), dtype)
  dy = jax.ShapeDtypeStruct((case.num_rows, case.n), dtype)
  rows = jax.ShapeDtypeStruct((case.num_kept,), jnp.int32)
  yield "dense", None, dense_backward, (x, kernel, bias, dy)
  for backend in SPARSE_BACKENDS:
    fn = sebp_backward(backend, case.num_kept)
    yield backend, "selected", fn, (x, kernel, bias, dy)
    yield backend, "given", fn, (x, kernel, bias, dy, rows)
  # top_n="auto": with the defaults (the cost model's choice) and with the kernels that run
  # once, at every row, and follow the run-time count.
  for backend in ("auto", "pallas_triton", "pallas_mosaic"):
    yield backend, "auto_capacity", sebp_backward(backend, "auto"), (x, kernel, bias, dy)
  x_kept = jax.ShapeDtypeStruct((case.num_kept, case.d), dtype)
  dy_kept = jax.ShapeDtypeStruct((case.num_kept, case.n), dtype)
  yield ("kept_matmuls", "pregathered", sebp_backward("dense", case.num_kept),
         (x_kept, kernel, bias, dy_kept))


def compile_all(cases, threads: int, input_sets: int):
  """Compiles every variant of every case ahead of timing, in parallel."""
  jobs = [(case, backend, mode, fn, args)
          for case in cases for backend, mode, fn, args in variants(case)]

  def compile_one(job):
    case, backend, mode, fn, args = job
    executable = jax.jit(over_input_sets(fn)).lower(
        *[args] * input_sets).compile()
    return (case, backend, mode), executable

  compiled = {}
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for key, executable in tqdm(pool.map(compile_one, jobs), total=len(jobs),
                                desc="compile", file=sys.stderr):
      compiled[key] = executable
  return compiled


def make_inputs(case: Case, seed: int = 0):
  """Random x, W, b, dY with all but ``num_kept`` random rows of dY zeroed,
  and the matching sorted index of kept rows."""
  dtype = jnp.dtype(case.dtype)
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (case.num_rows, case.d), dtype)
  kernel = (jax.random.normal(keys[1], (case.d, case.n), jnp.float32)
            / np.sqrt(case.d)).astype(dtype)
  bias = jnp.zeros((case.n,), dtype)
  kept = np.sort(np.random.default_rng(seed).choice(
      case.num_rows, case.num_kept, replace=False))
  active_rows = jnp.asarray(kept, jnp.int32)
  is_kept = jnp.zeros((case.num_rows, 1), dtype).at[active_rows].set(1)
  dy = jax.random.normal(keys[2], (case.num_rows, case.n), dtype) * is_kept
  return x, kernel, bias, dy, active_rows


# ---------------------------------------------------------------------------
# Driver.
# ---------------------------------------------------------------------------


def main(argv=None):
  parser = argparse.ArgumentParser(
      prog="python -m benchmarks.layer", description=__doc__.split("\n\n")[0],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", type=pathlib.Path, default=None,
                      help="append one JSON object per measurement to this file")
  parser.add_argument("--shapes", type=parse_shapes, default=ALL_SHAPES,
                      help="'all', 'bert-base', 'llama-3.2-1b/3b' or a comma list "
                           "of DxN (default: all)")
  parser.add_argument("--tokens", type=parse_positive_ints, default=list(TOKENS),
                      help="comma list of T (default: 4096,16384,65536)")
  parser.add_argument("--kept", type=parse_positive_ints, default=list(KEPT_PERCENT),
                      help="comma list of kept percentages (default: 5,10,20,50)")
  parser.add_argument("--dtype", default="bfloat16",
                      choices=("bfloat16", "float16", "float32"))
  parser.add_argument("--repeats", type=positive_int, default=20,
                      help="timed repeats per measurement; the median is kept")
  parser.add_argument("--input-sets", type=positive_int, default=4,
                      help="distinct random inputs evaluated per timed call")
  parser.add_argument("--compile-threads", type=positive_int, default=8)
  parser.add_argument("--rounds", type=positive_int, default=1,
                      help="interleaved rounds per case, every variant timed once in each; a "
                           "record keeps the median and the rounds, ratios their spread")
  args = parser.parse_args(argv)
  if max(args.kept) > 100:
    parser.error(f"--kept is a percentage of the rows, at most 100, got {max(args.kept)}")

  # T outermost, in the order given: an interrupted run has whole T sweeps.
  cases = [Case(d, n, t, kept, args.dtype)
           for t in args.tokens for (d, n) in args.shapes
           for kept in args.kept]
  device = jax.devices()[0]
  print(f"device: {device.device_kind}, jax {jax.__version__}", file=sys.stderr)
  rates = measure_rates(args.repeats)
  print(f"measured: matmul {rates.matmul_flops_per_s / 1e12:.3g} TFLOP/s, "
        f"copy {rates.copy_bytes_per_s / 1e12:.2f} TB/s", file=sys.stderr)
  compiled = compile_all(cases, args.compile_threads, args.input_sets)

  records = []
  for case in tqdm(cases, desc="time", file=sys.stderr):
    input_sets = [make_inputs(case, seed) for seed in range(args.input_sets)]
    inputs = {
        mode: [(x, kernel, bias, dy) if mode in ("dense", "selected", "auto_capacity") else
               (x, kernel, bias, dy, active_rows) if mode == "given" else
               (x[active_rows], kernel, bias, dy[active_rows])
               for x, kernel, bias, dy, active_rows in input_sets]
        for mode in ("dense", "selected", "given", "auto_capacity", "pregathered")}
    rounds_ms = {}
    for _ in range(args.rounds):
      for backend, mode, _, _ in variants(case):
        rounds_ms.setdefault((backend, mode), []).append(median_ms(
            compiled[case, backend, mode], *inputs[mode or "dense"], repeats=args.repeats,
            calls_per_repeat=3, work_items=args.input_sets))
    dense_rounds = np.asarray(rounds_ms["dense", None])
    for (backend, mode), variant_rounds in rounds_ms.items():
      ms = float(np.median(variant_rounds))
      bound = roofline_ms(case.d, case.n,
                          case.num_kept if backend == "kept_matmuls" else case.num_rows,
                          case.num_rows if backend == "dense" else case.num_kept,
                          jnp.dtype(case.dtype).itemsize, rates,
                          selected=mode in ("selected", "auto_capacity"))
      records.append(record(
          shape=case.shape_name, d_in=case.d, d_out=case.n, tokens=case.num_rows,
          kept_percent=case.kept_percent, dtype=case.dtype, backend=backend, index=mode,
          median_ms=ms, rounds_ms=variant_rounds,
          speedup_over_dense=float(np.median(dense_rounds / np.asarray(variant_rounds))),
          roofline_ms=bound, time_over_roofline=ms / bound))
    # Written per case, so that an interrupted run keeps what it timed.
    append_json_lines(args.out, records[-len(rounds_ms):])
    del input_sets, inputs
  print_table(records)


def print_table(records):
  """One line per case: times; speedups over dense (index selected, and auto
  selected / given / top_n="auto"); Pallas over XLA (selected, then given); XLA and Pallas
  (selected) time over their roofline; XLA (index given) over the kept rows'
  matmuls alone; then ``pallas_triton`` and ``pallas_mosaic`` at top_n="auto" (one run, following
  the run-time count): the time, and XLA at the kept rows' capacity (selected, the capacity a
  host would pick) over it, the median of the rounds' ratios (their range in brackets)."""
  by_case = {}
  for r in records:
    key = (r["shape"], r["tokens"], r["kept_percent"])
    by_case.setdefault(key, {})[(r["backend"], r["index"])] = r
  header = (f"{'shape':>10} {'T':>6} {'kept':>4} | {'dense':>7} "
            f"{'xla-sel':>7} {'pal-sel':>7} {'xla-giv':>7} {'pal-giv':>7} ms | "
            f"{'dense/xla':>9} {'dense/pal':>9} {'xla/pal-s':>9} "
            f"{'xla/pal-g':>9} {'xla/roof':>8} {'pal/roof':>8} | {'auto-sel':>8} {'auto-giv':>8} "
            f"{'auto-cap':>8} | "
            f"{'matmuls':>7} {'xla-giv/mm':>10} | {'tri-cap':>7} {'xla-s/tri-cap':>17} "
            f"{'mos-cap':>7} {'xla-s/mos-cap':>17}")
  print(header)
  print("-" * len(header))
  for (shape, tokens, kept), v in by_case.items():
    ms = {k: r["median_ms"] for k, r in v.items()}
    print(f"{shape:>10} {tokens:>6} {kept:>3}% | {ms['dense', None]:7.3f} "
          f"{ms['xla', 'selected']:7.3f} {ms['pallas', 'selected']:7.3f} "
          f"{ms['xla', 'given']:7.3f} {ms['pallas', 'given']:7.3f}    | "
          f"{v['xla', 'selected']['speedup_over_dense']:8.2f}x "
          f"{v['pallas', 'selected']['speedup_over_dense']:8.2f}x "
          f"{ms['xla', 'selected'] / ms['pallas', 'selected']:8.2f}x "
          f"{ms['xla', 'given'] / ms['pallas', 'given']:8.2f}x "
          f"{v['xla', 'selected']['time_over_roofline']:7.2f}x "
          f"{v['pallas', 'selected']['time_over_roofline']:7.2f}x | "
          f"{v['auto', 'selected']['speedup_over_dense']:7.2f}x "
          f"{v['auto', 'given']['speedup_over_dense']:7.2f}x "
          f"{v['auto', 'auto_capacity']['speedup_over_dense']:7.2f}x | "
          f"{ms['kept_matmuls', 'pregathered']:7.3f} "
          f"{ms['xla', 'given'] / ms['kept_matmuls', 'pregathered']:9.2f}x | "
          f"{ms['pallas_triton', 'auto_capacity']:7.3f} "
          f"{round_ratios(v['xla', 'selected'], v['pallas_triton', 'auto_capacity']):>17} "
          f"{ms['pallas_mosaic', 'auto_capacity']:7.3f} "
          f"{round_ratios(v['xla', 'selected'], v['pallas_mosaic', 'auto_capacity']):>17}")


def round_ratios(numerator: dict, denominator: dict) -> str:
  """The median over rounds of one record's time over another's, with its range where there
  are several rounds."""
  ratios = np.asarray(numerator["rounds_ms"]) / np.asarray(denominator["rounds_ms"])
  text = f"{np.median(ratios):.2f}x"
  return text if len(ratios) == 1 else f"{text} ({ratios.min():.2f}-{ratios.max():.2f})"


if __name__ == "__main__":
  main()
