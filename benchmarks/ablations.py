"""Ablations: the measurements behind seven design choices of the SEBP backward.

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
* ``poison``: the result of that check added to the gathered rows of dY (shipped: it fuses
  into the gather) or to dW and db after the matmuls.
* ``cast``: float32 params used in bf16 cast to bf16 inside the SEBP ops (shipped: dW comes
  back in float32 straight from the float32 sums) or before them, as ``nn.Dense`` does (dW
  is written in bf16, then widened to float32).
* ``store``: the reduced matmuls of one layer (dX and dW of K kept rows, bf16 operands) storing
  their bf16 result themselves from their float32 sums (shipped) or returning float32 that a
  cast then rounds (the same numbers, one more pass).

    python -m benchmarks.ablations dx --out ablations.jsonl
    python -m benchmarks.ablations check --model bert --model llama --out ablations.jsonl
    python -m benchmarks.ablations embed-accumulation --out ablations.jsonl
    python -m benchmarks.ablations poison --out ablations.jsonl
    python -m benchmarks.ablations cast --out ablations.jsonl
    python -m benchmarks.ablations store --out ablations.jsonl
    python -m benchmarks.ablations bias-sum --out ablations.jsonl
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
import sebp_jax.layers
import sebp_jax.ops
from benchmarks import model as model_bench
from benchmarks.layer import (dense_backward, dense_backward_as_the_op, over_input_sets,
                              time_ms)
from benchmarks.records import append_json_lines

#: (T, D, N, kept rows): BERT-base at 32x512 with SST-2's 319 real tokens (and 20% kept),
#: Llama-1B shapes at 4x1024 with WikiText-2's 577.
DX_CASES = ((16384, 768, 768, 319), (16384, 768, 3072, 319), (16384, 3072, 768, 319),
            (16384, 768, 3072, 3277), (4096, 2048, 8192, 577), (4096, 8192, 2048, 577),
            (4096, 2048, 2048, 577))
TINY_DX_CASES = ((256, 64, 96, 20),)
#: (kept rows K, D, N): 20% of T=16384 at Llama-3.2 and bert-base shapes, and Llama-1B's 577.
STORE_CASES = ((3277, 2048, 8192), (3277, 8192, 2048), (3277, 3072, 8192), (577, 2048, 8192),
               (3277, 768, 3072))
TINY_STORE_CASES = ((40, 64, 96),)
#: (T, D, N): bert-base and Llama-3.2 shapes at T=4096 and 16384, where ``auto`` runs the
#: smaller ones dense at high kept fractions.
BIAS_SUM_CASES = (*((4096, d, n) for d, n in ((768, 768), (768, 3072), (3072, 768), (2048, 512),
                                               (2048, 2048), (2048, 8192))),
                  *((16384, d, n) for d, n in ((768, 768), (768, 3072), (3072, 768), (2048, 512),
                                                (2048, 2048))))
TINY_BIAS_SUM_CASES = ((256, 64, 96),)


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

_xla_sparse_backward = sebp_jax.backends.xla_sparse_backward


def _poison_after_matmuls(x, kernel, dy, active_rows, *, poison=None, **options):
  """The alternative to poisoning the kept rows of dY: add the check to dW and db."""
  dx, dkernel, dbias = _xla_sparse_backward(x, kernel, dy, active_rows, **options)
  if poison is None:
    return dx, dkernel, dbias
  return (dx, dkernel + poison.astype(dkernel.dtype),
          None if dbias is None else dbias + poison.astype(dbias.dtype))


def _promote_before_the_op(module, *arrays, inexact=True):
  """The alternative to casting inside the op: the module's own promotion, as nn.Dense does."""
  return tuple(module.promote_dtype(*arrays, dtype=module.dtype, inexact=inexact)), None


def _sum_rows_at_once(a, dtype):
  """The alternative to ``backends.sum_rows``: one sum over all the rows."""
  return jnp.sum(a, axis=0, dtype=dtype)


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
            x, kernel, dy, rows, with_bias=False, backend=backend, dkernel_dtype=kernel.dtype)
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


def store_study(repeats: int, tiny: bool) -> list[dict]:
  contract = {"dX": (((1,), (1,)), ((), ())), "dW": (((0,), (0,)), ((), ()))}
  records = []
  for kept, d, n in tqdm(TINY_STORE_CASES if tiny else STORE_CASES, desc="store",
                         file=sys.stdout):
    keys = jax.random.split(jax.random.key(0), 3)
    x_kept = jax.random.normal(keys[0], (kept, d), jnp.bfloat16)
    dy_kept = jax.random.normal(keys[1], (kept, n), jnp.bfloat16)
    kernel = jax.random.normal(keys[2], (d, n), jnp.bfloat16)
    for output, dims in contract.items():
      operands = (dy_kept, kernel) if output == "dX" else (x_kept, dy_kept)
      variants = {
          "stored by the matmul": lambda a, b, dims=dims: jax.lax.dot_general(
              a, b, dims, preferred_element_type=jnp.bfloat16),
          "float32, then cast": lambda a, b, dims=dims: jax.lax.dot_general(
              a, b, dims, preferred_element_type=jnp.float32).astype(jnp.bfloat16)}
      times, results = {}, {}
      for name, fn in variants.items():
        compiled = jax.jit(fn)
        results[name] = np.asarray(compiled(*operands), np.float32)
        times[name] = time_ms(compiled, *operands, repeats=repeats)
      # The same float32 sums rounded once either way (up to the matmuls' summation order).
      np.testing.assert_allclose(*results.values(), rtol=2**-7, atol=1e-3)
      for name, ms in times.items():
        records.append(_record("store", name, output=output, kept_rows=kept, d=d, n=n, ms=ms,
                               speedup_vs_cast=times["float32, then cast"] / ms))
  return records


def bias_sum_study(repeats: int, tiny: bool, input_sets: int = 4, rounds: int = 3) -> list[dict]:
  """Each variant runs ``input_sets`` backwards per call (distinct inputs, so that none reads
  its operands from L2), in ``rounds`` rounds taken in turn; the median over rounds."""
  records = []
  for num_rows, d, n in tqdm(TINY_BIAS_SUM_CASES if tiny else BIAS_SUM_CASES,
                             desc="bias-sum", file=sys.stdout):
    inputs = []
    for seed in range(input_sets):
      keys = jax.random.split(jax.random.key(seed), 3)
      inputs.append((jax.random.normal(keys[0], (num_rows, d), jnp.bfloat16),
                     jax.random.normal(keys[1], (d, n), jnp.bfloat16) * 0.02,
                     jnp.zeros((n,), jnp.bfloat16),
                     jax.random.normal(keys[2], (num_rows, n), jnp.bfloat16)))

    def library(x, kernel, bias, dy):
      del bias  # Only its gradient's shape and dtype matter, which are dy's.
      return dense_backward_as_the_op(x, kernel, dy)

    variants = {"jax.vjp": (dense_backward, []),
                "partial sums": (library, []),
                "one sum": (library, [(sebp_jax.backends, "sum_rows", _sum_rows_at_once)])}
    # The float64 sum of the first set's dY, rounded once to bf16.
    exact = np.asarray(jnp.asarray(np.asarray(inputs[0][3], np.float64).sum(axis=0),
                                   jnp.float32).astype(jnp.bfloat16), np.float32)
    compiled, mismatches = {}, {}
    for name, (fn, swaps) in variants.items():
      with _patched(swaps):
        compiled[name] = jax.jit(over_input_sets(fn)).lower(*inputs).compile()
      dbias = np.asarray(compiled[name](*inputs)[0][2], np.float32)
      mismatches[name] = int(np.sum(dbias != exact))
    times = {name: [] for name in variants}
    for _ in range(rounds):
      for name, fn in compiled.items():
        times[name].append(time_ms(fn, *inputs, repeats=repeats, work_items=input_sets))
    vjp_ms = float(np.median(times["jax.vjp"]))
    for name in variants:
      ms = float(np.median(times[name]))
      records.append(_record("bias-sum", name, tokens=num_rows, d=d, n=n, ms=ms,
                             ms_rounds=times[name], speedup_vs_vjp=vjp_ms / ms,
                             dbias_entries_off=mismatches[name], dbias_entries=n))
  return records


def _model_study(study: str, kinds, repeats: int, tiny: bool, variants,
                 rounds: int = 2) -> list[dict]:
  """Backward of each model, dense and with the shared index under each variant's swaps.

  Every variant is compiled first; then ``rounds`` rounds time them all in turn, so that a
  drift of the device (clocks, heat) reaches every variant alike. The backward is the median
  gradient time minus the dense forward's, the median over rounds.
  """
  records = []
  for kind in kinds:
    setup = model_bench.setup_for(kind, tiny)
    model = model_bench.build_model(kind, tiny, jnp.bfloat16)
    batch = model_bench.make_batch(kind, model, setup, 0)
    top_n = int(batch["attention_mask"].sum())
    args = (model.params, batch)
    forward_ms = model_bench.median_ms(
        jax.jit(model_bench.make_loss(kind, model, "dense", top_n, "auto")), args, repeats)
    grads = {}
    for variant, swaps in tqdm([("dense", None), *variants], desc=f"{study} {kind}",
                               file=sys.stdout):
      mode = "dense" if swaps is None else "sebp_shared"
      with _patched(swaps or []):  # Traced and compiled here, under the swaps.
        grads[variant] = mode, jax.jit(jax.grad(model_bench.make_loss(
            kind, model, mode, top_n, "auto"))).lower(*args).compile()
    times = {variant: [] for variant in grads}
    for _ in range(rounds):
      for variant, (_, grad) in grads.items():
        times[variant].append(model_bench.median_ms(grad, args, repeats) - forward_ms)
    for variant, (mode, _) in grads.items():
      backward_ms = float(np.median(times[variant]))
      records.append(_record(
          study, variant, model=kind, setup=setup.name, mode=mode, tiny=tiny,
          real_tokens=top_n, rows=int(batch["input_ids"].size), forward_ms=forward_ms,
          backward_ms=backward_ms, backward_ms_rounds=times[variant], repeats=repeats,
          compute_dtype="bfloat16",
          backward_speedup_vs_dense=float(np.median(times["dense"])) / backward_ms))
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


def poison_study(kinds, repeats: int, tiny: bool) -> list[dict]:
  return _model_study("poison", kinds, repeats, tiny, [
      ("kept rows of dY", []),
      ("dW and db", [(sebp_jax.backends, "xla_sparse_backward", _poison_after_matmuls)])])


def cast_study(kinds, repeats: int, tiny: bool) -> list[dict]:
  return _model_study("cast", kinds, repeats, tiny, [
      ("inside the op", []),
      ("before the op", [(sebp_jax.layers, "promotion_for_sebp", _promote_before_the_op),
                         (sebp_jax.embedding, "promotion_for_sebp", _promote_before_the_op)])])


@contextlib.contextmanager
def _patched(swaps):
  """Replaces each ``(module, name, value)`` for the duration of the context."""
  with contextlib.ExitStack() as stack:
    for module, name, value in swaps:
      stack.enter_context(mock.patch.object(module, name, value))
    yield


def print_table(records) -> None:
  """One line per record; the ratio is to dense (to the cast in the store study, to
  ``jax.vjp`` in the bias-sum study, which also gives db's entries off)."""
  for r in records:
    if r["study"] in ("dx", "bias-sum"):
      where = f"T={r['tokens']} {r['d']}x{r['n']}" + (
          f" K={r['kept_rows']}" if "kept_rows" in r else "")
    elif r["study"] == "store":
      where = f"{r['output']} {r['d']}x{r['n']} K={r['kept_rows']}"
    else:
      where = r["model"]
    ms = r.get("ms", r.get("backward_ms"))
    ratio = next(r[key] for key in ("speedup_vs_dense", "backward_speedup_vs_dense",
                                    "speedup_vs_cast", "speedup_vs_vjp") if key in r)
    off = (f"  db off in {r['dbias_entries_off']}/{r['dbias_entries']}"
           if "dbias_entries_off" in r else "")
    print(f"{r['study']:18} {where:28} {r['variant']:20} {ms:9.3f} ms  {ratio:5.2f}x{off}")


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("study", choices=("dx", "check", "embed-accumulation", "poison", "cast",
                                        "store", "bias-sum"))
  parser.add_argument("--model", choices=sorted(model_bench.SETUPS), action="append",
                      help="model(s) of the check, poison and cast studies (default: all)")
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--tiny", action="store_true", help="toy sizes (CPU smoke run)")
  parser.add_argument("--out", default=None, help="append JSON lines here")
  args = parser.parse_args(argv)
  if args.repeats <= 0:
    parser.error("--repeats must be positive")
  kinds = args.model or sorted(model_bench.SETUPS)
  if args.study == "dx":
    records = dx_study(args.repeats, args.tiny)
  elif args.study == "embed-accumulation":
    records = embed_accumulation_study(args.repeats, args.tiny)
  elif args.study == "store":
    records = store_study(args.repeats, args.tiny)
  elif args.study == "bias-sum":
    records = bias_sum_study(args.repeats, args.tiny)
  else:
    study = {"check": check_study, "poison": poison_study, "cast": cast_study}[args.study]
    records = study(kinds, args.repeats, args.tiny)
  print_table(records)
  append_json_lines(args.out, records)
  return records


if __name__ == "__main__":
  main()
