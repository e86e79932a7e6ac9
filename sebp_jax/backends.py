"""Backends of the sparse backward: given the kept rows, compute dX, dW and db.

Every backend has one signature, ``sparse_backward(x, kernel, dy, active_rows, ...)``, with
``x: [T, D]``, ``kernel: [D, N]``, ``dy: [T, N]`` and ``active_rows: int32[K]`` as produced by
:func:`sebp_jax.selection.select_active_rows` (sorted, padded with the sentinel ``T``). It returns

* ``dx: [T, D]`` (dtype of x): ``dy[r] @ kernel.T`` for every kept row r, exactly 0 elsewhere;
* ``dkernel: [D, N]``: ``x[rows].T @ dy[rows]``;
* ``dbias: [N]`` or None: ``sum(dy[rows])``;

all summed in the accumulation dtype (:func:`accumulation_dtype`: float32, or float64 for
float64 operands; the Pallas kernels sum in float32) and rounded once. dx and dkernel are stored
by their matmuls in their final dtypes, since a separate cast of a float32 result would be a
pass of its own: dx in x's (the Pallas dx kernel stores dy's, which is x's wherever
:func:`sebp_jax.ops.sebp_linear` calls it), dkernel in ``dkernel_dtype``, the kernel
parameter's own (a float32 kernel computed in bf16 gets its gradient without a round trip
through bf16). dbias comes in the accumulation dtype, for the caller's cast to fuse into its
reduction.

``poison``, an optional float32 scalar that is 0 or NaN, must reach dkernel and dbias (see
:func:`sebp_jax.ops.nan_if_not_finite`).

``"xla"`` is the reference: a gather, two reduced dots and a gather back in plain jnp. It
materialises the gathered ``[K, N]`` and ``[K, D]`` copies, which the ``"pallas"`` backend avoids
by gathering inside its kernels (see ``pallas_kernels/``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax

Array = jax.Array
Backend = Literal["xla", "pallas"]
BACKENDS: tuple[str, ...] = ("xla", "pallas")
#: What ``backend=`` accepts: a backend, or "auto" (see :func:`choose_backend`).
BACKEND_CHOICES: tuple[str, ...] = ("auto", *BACKENDS)


def _gather_rows(a: Array, rows: Array) -> Array:
  """``a[rows]`` for ``a: [T, F]``, with zero rows for sentinel slots (``rows == T``)."""
  return jnp.take(a, rows, axis=0, mode="fill", fill_value=0, indices_are_sorted=True)


def _spread_rows(kept: Array, rows: Array, num_rows: int) -> Array:
  """``[T, F]`` with ``kept[k]`` in row ``rows[k]`` and zeros elsewhere, for ``kept: [K, F]``.

  Built as a gather through the inverse index (each of the T rows looks up its slot, or the
  out-of-range slot K and reads zeros) rather than a scatter into a zero-filled ``[T, F]``: XLA
  fuses a gather into whatever consumes dX (the residual sum of several layers' dX, a
  LayerNorm backward), while a scatter is a kernel of its own after a full zero fill. Measured
  on an H200 with dX feeding an add (T=16384, 319 rows): 0.16 vs 0.30 ms at 3072x768, and at
  T=4096, 577 rows: 0.24 vs 0.42 ms at 8192x2048; the scatter won only at 768x768 (0.08 vs
  0.11 ms) (``benchmarks/RESULTS.md``).
  """
  num_slots = rows.shape[0]
  slot_of_row = jnp.full((num_rows,), num_slots, jnp.int32).at[rows].set(
      jnp.arange(num_slots, dtype=jnp.int32), mode="drop", indices_are_sorted=True)
  return jnp.take(kept, slot_of_row, axis=0, mode="fill", fill_value=0)


def accumulation_dtype(dtype) -> jnp.dtype:
  """float32 for 16-bit operands (and float32), float64 for float64 operands."""
  return jnp.promote_types(dtype, jnp.float32)


#: About how many rows each partial sum of :func:`sum_rows` adds up.
ROWS_PER_PARTIAL_SUM = 256


def sum_rows(a: Array, dtype) -> Array:
  """``sum(a, axis=0)`` of ``a: [T, F]`` in ``dtype``, as ``k`` interleaved partial sums
  (``[T/k, k*F]`` summed to ``[k*F]``, then ``[k, F]`` to ``[F]``), ``k`` the largest power of
  two that divides T and leaves each partial at least ``ROWS_PER_PARTIAL_SUM`` rows (T=4096:
  16; T=16384: 64; odd T: 1).

  The same float32 sums as ``jnp.sum(a, axis=0, dtype=dtype)`` in another order, but faster
  on a GPU: XLA (jax 0.11.2) emits that convert-and-sum of a bf16 ``[T, F]`` as a Triton
  reduction fusion, slower than autodiff's bf16 sum, and the partial sums as a reduction of
  its own emitter. Autodiff's bf16 sum, the faster one before, rounds as it adds: it left
  86-88% of db's entries off the float64 sum rounded once at T=4096 (60-65% at T=16384),
  these none. The library's dense backward (what ``auto`` runs where SEBP would lose) against
  ``jax.vjp`` on an H100, bert-base and Llama layer shapes, two runs: at T=4096, 0.89-1.03x
  with one sum, 0.99-1.16x with 16 partials; at T=16384, 0.98-1.04x with either (64
  partials). A fixed 8 partials, tried first, fell to 0.96x at T=16384 (``python -m
  benchmarks.ablations bias-sum``, ``benchmarks/RESULTS.md``).
  """
  num_rows, num_features = a.shape
  most_partials = max(1, num_rows // ROWS_PER_PARTIAL_SUM)
  num_partials = math.gcd(num_rows, 1 << (most_partials.bit_length() - 1))
  partials = jnp.sum(a.reshape(num_rows // num_partials, num_partials * num_features), axis=0,
                     dtype=dtype)
  return jnp.sum(partials.reshape(num_partials, num_features), axis=0)


def dense_backward(x, kernel, dy, *, with_bias, precision, dkernel_dtype=None):
  """The dense backward, every row kept, in the contract of :func:`sparse_backward`.

  Each matmul stores its own output dtype from its float32 (float64) sums: on an H100 a
  bf16 ``[2048, 8192]`` dW from 577 rows took 0.106 ms as float32 then cast, 0.072 ms stored
  as bf16 by the matmul (``python -m benchmarks.ablations store``, ``benchmarks/RESULTS.md``).
  """
  accumulate = accumulation_dtype(dy.dtype)
  dx = lax.dot_general(dy, kernel, (((1,), (1,)), ((), ())), precision=precision,
                       preferred_element_type=x.dtype)
  dkernel = lax.dot_general(x, dy, (((0,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=dkernel_dtype or accumulate)
  dbias = sum_rows(dy, accumulate) if with_bias else None
  return dx, dkernel, dbias


def xla_sparse_backward(x, kernel, dy, active_rows, *, with_bias, precision, poison=None,
                        dkernel_dtype=None):
  """The jnp reference of :func:`sparse_backward`: the dense backward of the kept rows, dX
  spread back to all T rows (see the module docstring for shapes)."""
  dy_kept = _gather_rows(dy, active_rows)  # [K, N]
  if poison is not None:
    # Added to the kept rows, it fuses into their gather and reaches dX's kept rows, dW and db
    # (every kept row, even a zero sentinel one, times NaN is NaN). Added to dW and db after
    # the matmuls instead, the model backward was slower: on an H100, 1.30x vs 1.39x of dense
    # (Llama-1B shapes) and 2.08x vs 2.17x (BERT-base) (python -m benchmarks.ablations poison).
    dy_kept = dy_kept + poison.astype(dy_kept.dtype)
  dx_kept, dkernel, dbias = dense_backward(_gather_rows(x, active_rows), kernel, dy_kept,
                                           with_bias=with_bias, precision=precision,
                                           dkernel_dtype=dkernel_dtype)
  return _spread_rows(dx_kept, active_rows, x.shape[0]), dkernel, dbias


def pallas_sparse_backward(x, kernel, dy, active_rows, *, with_bias, precision, poison=None,
                           dkernel_dtype=None):
  """:func:`sparse_backward` through the Pallas kernels (Triton on GPU, interpreted elsewhere).

  The kernels gather the kept rows themselves. dX comes back as its ``K`` kept rows, spread by
  the same fusible gather as the XLA backend's: the kernel writing all ``T`` rows, zeros
  included, cost Llama-1B 3.0 ms of a 46 ms backward even with 16 rows kept (H200). The poison
  is the start of the dW kernel's sums: no pass of its own, as in the XLA backend, where it
  fuses into the gather of dY.
  """
  import pallas_kernels  # Imported lazily: the XLA path must not pay for Pallas' import.

  interpret = jax.default_backend() != "gpu"
  dx_kept = pallas_kernels.gathered_dx(dy, kernel, active_rows, kept_rows_only=True,
                                       precision=precision, interpret=interpret)
  accumulate = accumulation_dtype(dy.dtype)
  dkernel, dbias = pallas_kernels.gathered_dw_db(
      x, dy, active_rows, with_bias=with_bias, poison=poison, precision=precision,
      interpret=interpret, dw_dtype=dkernel_dtype or accumulate, db_dtype=accumulate)
  return _spread_rows(dx_kept.astype(x.dtype), active_rows, x.shape[0]), dkernel, dbias


def sparse_backward(x: Array, kernel: Array, dy: Array, active_rows: Array, *,
                    with_bias: bool, precision=None, backend: Backend = "xla",
                    poison: Array | None = None, dkernel_dtype=None):
  """dX, dW, db of ``y = x @ kernel + b`` from the rows ``active_rows`` of ``dy`` alone.

  Args:
    x: ``[T, D]`` forward input.
    kernel: ``[D, N]``.
    dy: ``[T, N]`` output gradient.
    active_rows: ``int32[K]``, sorted, padded with the sentinel ``T``.
    with_bias: whether to return db.
    precision: ``lax.Precision`` for the dots, as in the forward.
    backend: ``"xla"`` or ``"pallas"``.
    poison: optional float32 scalar, 0 or NaN; NaN makes dkernel and dbias NaN (and may make
      the kept rows of dx NaN).
    dkernel_dtype: dtype of dkernel (the kernel parameter's); default the accumulation dtype.

  Returns:
    ``(dx [T, D], dkernel [D, N], dbias [N] or None)``: dx in the dtype of x, dkernel in
    ``dkernel_dtype``, dbias in :func:`accumulation_dtype` of dy's dtype.
  """
  options = dict(with_bias=with_bias, precision=precision, poison=poison,
                 dkernel_dtype=dkernel_dtype)
  if active_rows.shape[0] == 0:
    # An index of no slots gets one sentinel slot: a zero row that still carries the poison
    # into the sums (and gives the gathers an axis to take from).
    active_rows = jnp.full((1,), x.shape[0], jnp.int32)
  if backend == "xla":
    return xla_sparse_backward(x, kernel, dy, active_rows, **options)
  if backend == "pallas":
    return pallas_sparse_backward(x, kernel, dy, active_rows, **options)
  raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


@dataclasses.dataclass(frozen=True)
class GpuCostModel:
  """Predicted seconds of one linear layer's backward on a GPU, dense vs SEBP.

  Rates measured with jax 0.11.2, bf16 (``benchmarks/RESULTS.md``): cuBLAS reaches ~780
  TFLOP/s on the dense backward (H200), a device copy 2.9 TB/s; the fixed costs are what
  small shapes showed on top of that. The dense backward overlaps its bytes with its FLOPs (a
  max); the SEBP one is modelled additively. The reduced matmuls of the kept rows measured
  ~600 TFLOP/s (H100, the layer benchmark's ``kept_matmuls``); 700 is the rate at which this
  model, as it stands, picks the faster of dense and XLA in 230 of the 234 cases of five H100
  layer benchmark runs (T=4096 at 5/20/50% kept, four runs, and T=16384 at 20%), the other 4
  costing at most 16%. At 600 it missed 16, by up to 27%, all of them dense picks at 50%
  kept where XLA was ahead; above 700 a bert-base layer at 50% kept flips to XLA, which lost
  by up to 44% in two of the runs.
  """
  dense_flops_per_s: float = 7.8e14
  sparse_flops_per_s: float = 7.0e14
  bytes_per_s: float = 2.9e12
  dense_fixed_s: float = 3e-5
  sparse_fixed_s: float = 3e-5
  selection_fixed_s: float = 4e-5
  #: SEBP must be predicted this much faster: near a tie, dense is exact and simpler.
  margin: float = 1.1

  def dense_seconds(self, num_rows, in_features, out_features, itemsize) -> float:
    flops = 4 * num_rows * in_features * out_features
    # Reads dY twice, X and W once; writes dX and dW.
    moved = itemsize * (2 * num_rows * out_features + 2 * num_rows * in_features
                        + 2 * in_features * out_features)
    return self.dense_fixed_s + max(flops / self.dense_flops_per_s, moved / self.bytes_per_s)

  def sparse_seconds(self, num_rows, in_features, out_features, top_n, itemsize,
                     index_given) -> float:
    flops = 4 * top_n * in_features * out_features
    # Kept rows of dY (twice) and X, W, dW, and the whole of dX (its zero rows are written).
    moved = itemsize * (2 * top_n * out_features + top_n * in_features
                        + 2 * in_features * out_features + num_rows * in_features)
    seconds = self.sparse_fixed_s + flops / self.sparse_flops_per_s + moved / self.bytes_per_s
    if not index_given:  # scoring reads all of dY once
      seconds += self.selection_fixed_s + itemsize * num_rows * out_features / self.bytes_per_s
    return seconds

  def sparse_wins(self, num_rows, in_features, out_features, top_n, itemsize,
                  index_given) -> bool:
    sparse = self.sparse_seconds(num_rows, in_features, out_features, top_n, itemsize,
                                 index_given)
    return sparse * self.margin < self.dense_seconds(num_rows, in_features, out_features,
                                                     itemsize)


GPU_COST_MODEL = GpuCostModel()


def choose_backend(backend: str, *, num_rows: int, in_features: int, out_features: int,
                   top_n: int, itemsize: int, index_given: bool,
                   platform: str | None = None) -> str:
  """The backward to run for one layer: ``"dense"``, ``"xla"`` or ``"pallas"``.

  With ``top_n >= num_rows`` and no index given nothing can be skipped: dense. An explicit
  backend is kept otherwise. ``"auto"`` picks, from static shapes only:

  * on GPU, SEBP where :class:`GpuCostModel` predicts it ahead of the dense backward, and the
    dense backward elsewhere (it keeps every row, so its gradient is the exact one; SEBP
    cannot win on small layers at high kept fractions);
  * the SEBP it picks is ``"xla"`` on every platform. Since XLA builds dX by a gather that
    fuses into its consumer, the Pallas kernels no longer lead it (H100, T=16384, 20% kept,
    selection included: Pallas 0.77-0.85x of XLA on the five shapes of 2048x2048 and up,
    1.02x only on 768x768, whose SEBP backward is slower than dense either way); inside the
    models, with the same dX spread for both, XLA led too (backward vs dense, shared index:
    BERT-base 2.20x vs 1.79x on an H100, Llama-1B shapes 1.38x vs 1.34x on an H200).
    ``"pallas"`` runs the kernels when asked for.
  """
  if backend not in BACKEND_CHOICES:
    raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
  if top_n >= num_rows and not index_given:
    return "dense"
  if backend != "auto":
    return backend
  if (platform or jax.default_backend()) == "gpu" and not GPU_COST_MODEL.sparse_wins(
      num_rows, in_features, out_features, top_n, itemsize, index_given):
    return "dense"
  return "xla"
