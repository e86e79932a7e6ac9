"""Ablations: the measurements behind three design choices of the SEBP backward.

Each study swaps one function of the library for its alternative (``unittest.mock.patch``)
and times both side by side in one run:

* ``dx``: one layer's SEBP backward, with dX built by a gather through the inverse index (what
  ``sebp_jax.backends`` ships) or by a scatter into a zero-filled ``[T, D]`` (the obvious
  version), against dense and the Pallas kernels. dX feeds an add, as it does in a model.
* ``check``: with a shared index the backward never scores dY, so it checks dY for NaN/Inf
  separately (``sebp_jax.ops.nan_if_not_finite``). Model-level backward with a max over rows
  (shipped), a column sum, ``all(isfinite)`` and no check at all.
* ``embed-accumulation``: the SEBP embedding backward scattering into float32 (shipped) or
  into the table's 16-bit dtype.

    python -m benchmarks.ablations dx --out ablations.jsonl
    python -m benchmarks.ablations check --model bert --model llama --out ablations.jsonl
    python -m benchmarks.ablations embed-accumulation --out ablations.jsonl
    python -m benchmarks.ablations check --tiny          # a CPU smoke run at toy sizes
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import sebp_jax.backends
import sebp_jax.embedding
import sebp_jax.ops
from benchmarks import model as model_bench
from benchmarks.layer import over_input_sets, time_ms
from benchmarks.records import append_json_lines

#: (T, D, N, kept rows): BERT-base at 32x512 with SST-2's 319 real tokens (and 20% kept),
#: Llama-1B shapes at 4x1024 with WikiText-2's 577.
DX_CASES = ((16384, 768, 768, 319), (16384, 768, 3072, 319), (16384, 3072, 768, 319),
            (16384, 768, 3072, 3277), (4096, 2048, 8192, 577), (4096, 8192, 2048, 577),
            (4096, 2048, 2048, 577))
TINY_DX_CASES = ((256, 64, 96, 20),)


def _spread_rows_by_scatter(kept, rows, num_rows):
  """The alternative to ``backends._spread_rows``: scatter into zeros (sentinel dropped)."""
  return jnp.zeros((num_rows, kept.shape[1]), kept.dtype).at[rows].set(
      kept, mode="drop", indices_are_sorted=True)


def _column_sum(dy):
  return jnp.sum(dy, axis=0, dtype=jnp.float32) * 0  # [N]: NaN in a non-finite column


def _all_isfinite(dy):
  return jnp.where(jnp.all(jnp.isfinite(dy)), 0.0, jnp.nan).astype(jnp.float32)


def _no_check(dy):
  del dy
  return jnp.float32(0)


CHECKS = {"row_max": sebp_jax.ops.nan_if_not_finite, "column_sum": _column_sum,
          "all_isfinite": _all_isfinite, "none": _no_check}


def _record(study: str, variant: str, **fields) -> dict:
  return {"study": study, "variant": variant, "device": jax.devices()[0].device_kind,
          "jax_version": jax.__version__, **fields}


def dx_study(repeats: int, tiny: bool) -> list[dict]:
  records = []
  for num_rows, d, n, kept in tqdm(TINY_DX_CASES if tiny else DX_CASES, desc="dx",
                                   file=sys.stdout):
    keys = jax.random.split(jax.random.key(0), 4)
    rows = jnp.sort(jax.random.choice(keys[0], num_rows, (kept,), replace=False))
    rows = rows.astype(jnp.int32)
    row_mask = jnp.zeros((num_rows, 1), jnp.bfloat16).at[rows].set(1)
    x = jax.random.normal(keys[1], (num_rows, d), jnp.bfloat16)
    kernel = jax.random.normal(keys[2], (d, n), jnp.bfloat16) * 0.02
    dy = jax.random.normal(keys[3], (num_rows, n), jnp.bfloat16) * row_mask
    residual = jax.random.normal(keys[3], (num_rows, d), jnp.bfloat16)
    inputs = (x, kernel, dy, rows, residual)

    def dense(x, kernel, dy, rows, residual):
      _, vjp = jax.vjp(jnp.matmul, x, kernel)
      dx, dkernel = vjp(dy)
      return dx + residual, dkernel

    def sparse(backend):
      def backward(x, kernel, dy, rows, residual):
        dx, dkernel, _ = sebp_jax.backends.sparse_backward(
            x, kernel, dy, rows, with_bias=False, backend=backend)
        return dx + residual, dkernel
      return backward

    variants = {
        "dense": (dense, []),
        "xla, dX by gather": (sparse("xla"), []),
        "xla, dX by scatter": (sparse("xla"),
                               [(sebp_jax.backends, "_spread_rows", _spread_rows_by_scatter)]),
        "pallas": (sparse("pallas"), [])}
    times, dense_out = {}, None
    for name, (fn, swaps) in variants.items():
      with _patched(swaps):  # Acts while jit traces: the first call below.
        compiled = jax.jit(over_input_sets(fn))
        out = jax.tree.map(lambda a: np.asarray(a, np.float32), compiled(inputs))
      # The unkept rows of dY are zero, so every variant must give the dense result.
      dense_out = dense_out or out
      for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(dense_out)):
        np.testing.assert_allclose(got, want, rtol=5e-2, atol=5e-2, err_msg=name)
      times[name] = time_ms(compiled, inputs, repeats=repeats)
    for name, ms in times.items():
      records.append(_record("dx", name, tokens=num_rows, d=d, n=n, kept_rows=kept, ms=ms,
                             speedup_vs_dense=times["dense"] / ms))
  return records


def _model_study(study: str, kinds, repeats: int, tiny: bool, variants) -> list[dict]:
  """Backward of each model, dense and with the shared index under each variant's swaps."""
  records = []
  for kind in kinds:
    runs = []
    for variant, swaps in [("dense", None), *variants]:
      with _patched(swaps or []):
        (row,) = model_bench.run(kind, ["dense" if swaps is None else "sebp_shared"], repeats,
                                 tiny, 0, "auto")
      runs.append({"study": study, "variant": variant, **row})  # row names device and jax
    for record in runs:
      record["backward_speedup_vs_dense"] = runs[0]["backward_ms"] / record["backward_ms"]
    records += runs
  return records


def check_study(kinds, repeats: int, tiny: bool) -> list[dict]:
  return _model_study("check", kinds, repeats, tiny, [
      (name, [(sebp_jax.ops, "nan_if_not_finite", check),
              (sebp_jax.embedding, "nan_if_not_finite", check)])
      for name, check in CHECKS.items()])


def embed_accumulation_study(repeats: int, tiny: bool) -> list[dict]:
  return _model_study("embed-accumulation", ["bert"], repeats, tiny, [
      ("float32", []),
      ("table dtype", [(sebp_jax.embedding, "accumulation_dtype", lambda dtype: dtype)])])


@contextlib.contextmanager
def _patched(swaps):
  """Replaces each ``(module, name, value)`` for the duration of the context."""
  with contextlib.ExitStack() as stack:
    for module, name, value in swaps:
      stack.enter_context(mock.patch.object(module, name, value))
    yield


def print_table(records) -> None:
  for r in records:
    where = (f"T={r['tokens']} {r['d']}x{r['n']} K={r['kept_rows']}" if r["study"] == "dx"
             else r["model"])
    ms = r["ms"] if r["study"] == "dx" else r["backward_ms"]
    speedup = r.get("speedup_vs_dense", r.get("backward_speedup_vs_dense"))
    print(f"{r['study']:18} {where:28} {r['variant']:20} {ms:9.3f} ms  {speedup:5.2f}x")


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("study", choices=("dx", "check", "embed-accumulation"))
  parser.add_argument("--model", choices=sorted(model_bench.SETUPS), action="append",
                      help="model(s) of the check study (default: all)")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke run)")
  parser.add_argument("--out", default=None, help="append JSON lines here")
  args = parser.parse_args(argv)
  if args.repeats <= 0:
    parser.error("--repeats must be positive")
  if args.study == "dx":
    records = dx_study(args.repeats, args.tiny)
  elif args.study == "check":
    records = check_study(args.model or sorted(model_bench.SETUPS), args.repeats, args.tiny)
  else:
    records = embed_accumulation_study(args.repeats, args.tiny)
  print_table(records)
  append_json_lines(args.out, records)
  return records


if __name__ == "__main__":
  main()
