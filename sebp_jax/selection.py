"""Row selection: which rows of the output gradient dY a sparse backward keeps.

The backward of ``y = x @ kernel + b`` only needs the rows of dY that carry signal. Selection
turns dY, flattened to ``[T, N]``, into a static-size index set ``active_rows: int32[top_n]``:

* a row is *active* when its largest ``|value|`` exceeds ``threshold`` (``0.0``: any non-zero);
* a row holding NaN or Inf is always active and ranks first, so a broken gradient stays visible
  instead of being dropped as "inactive";
* when more than ``top_n`` rows are active, the ``top_n`` with the largest L2 norm are kept
  (:func:`score_dtype` says where float32 scores stop telling norms apart);
* the kept indices are sorted ascending and padded at the end with the out-of-range sentinel
  ``T``. Padding with a valid index (``jnp.nonzero``'s default 0) would count a row twice in dW.

Cost, per layer and step, for ``T`` rows of width ``N``: one fused pass over dY (squared norm and
max-abs together, float32 accumulation, float64 for float64 dY), then either an O(T) compaction
(``jnp.nonzero`` with a static size: the common case, padding rows are exactly zero so
``#active <= top_n``) or, only when more rows are active than fit, an O(T log T)
``lax.top_k``. ``lax.cond`` runs one of the two.
Under ``vmap`` the cond becomes a select and both run, which is correct but slower.

Determinism: ties in norm go to the lower row index (``lax.top_k`` is stable) and the output is
sorted, so the same dY always yields the same ``active_rows`` and the same summation order in dW.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array


def score_dtype(dtype) -> jnp.dtype:
  """The dtype rows of dY of ``dtype`` are scored in: float32 for 16-bit and float32 dY,
  float64 for float64 (complex: of the magnitudes). A row's squared norm in float32 holds
  values of about 1e-19 to 1e19: a smaller non-zero row scores 0 (still active, ranked below
  every larger one), a larger one the dtype's largest (ranked above them, in row order)."""
  return jnp.promote_types(jnp.finfo(dtype).dtype, jnp.float32)


def nan_as_inf(magnitudes: Array) -> Array:
  """``magnitudes`` with NaN read as +Inf, for a max that must not be finite wherever a value
  is not: XLA:CPU's vectorized max drops NaN (openxla/xla#21461), never Inf."""
  return jnp.where(jnp.isnan(magnitudes), jnp.inf, magnitudes)


def row_magnitudes(dy: Array) -> Array:
  """``|dy|`` in :func:`score_dtype`; a complex entry's modulus, imaginary part included."""
  return jnp.abs(dy).astype(score_dtype(dy.dtype))


def validate_top_n(top_n: Any, name: str = "top_n", allow_zero: bool = False) -> int:
  """``top_n`` as a Python int, or ValueError saying what was expected."""
  what = "non-negative" if allow_zero else "positive"
  if isinstance(top_n, jax.core.Tracer):
    raise ValueError(
        f"{name} must be a static {what} Python int, got a traced value {top_n!r}: it fixes "
        "the shapes of the backward, so it cannot depend on data (pass it as a static argument "
        "of jit, or compute it from array shapes).")
  if isinstance(top_n, (bool, np.bool_)) or not isinstance(top_n, numbers.Integral):
    raise ValueError(f"{name} must be a {what} Python int, got {top_n!r} "
                     f"of type {type(top_n).__name__}")
  if top_n < (0 if allow_zero else 1):
    raise ValueError(f"{name} must be a {what} Python int, got {top_n}")
  return int(top_n)


def validate_threshold(threshold: Any) -> float:
  """``threshold`` as a Python float, or ValueError saying what was expected."""
  if (isinstance(threshold, (bool, np.bool_, jax.core.Tracer))
      or not isinstance(threshold, numbers.Real)
      or not math.isfinite(threshold) or threshold < 0):
    raise ValueError(f"threshold must be a finite non-negative Python float, got {threshold!r}")
  return float(threshold)


def threshold_below(threshold: float, dtype) -> np.ndarray:
  """The largest ``dtype`` value at most ``threshold``: a ``dtype`` value exceeds it exactly
  when it exceeds ``threshold`` (rounded to the nearest, the threshold can round up past a
  value above it, which would then count as below)."""
  rounded = np.asarray(threshold, dtype)
  if float(rounded) > threshold:
    rounded = np.nextafter(rounded, np.asarray(-np.inf, dtype))
  return rounded


class RowStatistics(NamedTuple):
  """What one pass over the rows of ``dy: [T, N]`` tells, each ``[T]``: the selection's
  ``scores`` and ``active`` (:func:`row_scores`), and each row's ``max_abs`` and
  ``squared_norm`` in :func:`score_dtype` (for the row log)."""
  scores: Array
  active: Array
  max_abs: Array
  squared_norm: Array


def row_statistics(dy: Array, threshold: float) -> RowStatistics:
  """Scores the rows of ``dy: [T, N]`` in one pass: :class:`RowStatistics`."""
  magnitudes = row_magnitudes(dy)
  squared_norm = jnp.sum(magnitudes * magnitudes, axis=-1)
  max_abs = jnp.max(nan_as_inf(magnitudes), axis=-1, initial=0)
  # Inf where a row holds NaN or Inf. Such a row scores Inf, above every finite row, that one
  # whose squares overflow the score dtype included: that one scores the dtype's largest.
  finite = jnp.isfinite(max_abs)
  active = (max_abs > threshold_below(threshold, max_abs.dtype)) | ~finite
  largest = jnp.finfo(squared_norm.dtype).max
  scores = jnp.where(finite, jnp.minimum(squared_norm, largest), jnp.inf)
  scores = jnp.where(active, scores, -1.0)
  return RowStatistics(scores, active, max_abs, squared_norm)


def row_scores(dy: Array, threshold: float) -> tuple[Array, Array]:
  """Scores the rows of ``dy: [T, N]``.

  Returns:
    ``(scores, active)``, both ``[T]``: ``scores`` is the squared L2 norm of each row in
    :func:`score_dtype` (monotone in the norm, so no square root is needed to rank), ``+inf``
    for a row holding NaN or Inf and ``-1`` for an inactive row; ``active`` is True for a row
    whose max ``|value|`` exceeds ``threshold`` or that is not finite.
  """
  statistics = row_statistics(dy, validate_threshold(threshold))
  return statistics.scores, statistics.active


def select_active_rows(dy: Array, top_n: int, threshold: float = 0.0) -> Array:
  """Picks at most ``top_n`` active rows of ``dy: [T, N]``.

  Returns:
    ``active_rows: int32[top_n]``, the kept row indices in ascending order, followed by the
    sentinel ``T`` in every unused slot.
  """
  if jnp.ndim(dy) != 2:
    raise ValueError(f"dy must be [rows, features], got shape {jnp.shape(dy)}")
  return select_from_scores(*row_scores(dy, threshold), validate_top_n(top_n))


def select_from_scores(scores: Array, active: Array, top_n: int) -> Array:
  """:func:`select_active_rows` from the rows' ``scores`` and ``active`` (:func:`row_scores`)."""
  num_rows = scores.shape[0]

  def compact_all_active():
    (rows,) = jnp.nonzero(active, size=top_n, fill_value=num_rows)
    return rows.astype(jnp.int32)

  def keep_largest():
    # Only taken when more than top_n rows are active, so every kept slot is an active row.
    _, rows = lax.top_k(scores, top_n)
    return jnp.sort(rows.astype(jnp.int32))

  if top_n >= num_rows:
    return compact_all_active()
  return lax.cond(jnp.sum(active) <= top_n, compact_all_active, keep_largest)


def capacity_ladder(num_rows: int) -> tuple[int, ...]:
  """The capacities ``top_n="auto"`` compiles for ``num_rows`` rows: T/16, T/8, T/4 and T/2,
  each rounded up to a multiple of 8 (the matmul tiles' granularity), those below T only. At
  run time the backward takes the smallest that holds every active row, else every row."""
  rungs = {8 * -(-num_rows // (8 * part)) for part in (16, 8, 4, 2)}
  return tuple(sorted(rung for rung in rungs if rung < num_rows))


def active_rows_from_mask(mask: Array, top_n: int) -> Array:
  """The SEBP index for a known token mask, computed once and shared by every layer.

  Args:
    mask: ``[...]`` token mask (non-zero = a real token whose gradient matters), with the same
      leading shape as the layers' inputs, e.g. ``attention_mask: [B, L]``.
    top_n: static size of the index.

  Returns:
    ``int32[top_n]``: the flat indices of the first ``top_n`` real tokens in ascending order,
    then the sentinel ``mask.size``. Tokens past the first ``top_n`` are dropped, so ``top_n``
    must cover the real tokens of the batch for an exact gradient.
  """
  flat = jnp.reshape(mask, (-1,)) != 0
  size = validate_top_n(top_n, allow_zero=True)  # An empty batch's index is empty.
  (rows,) = jnp.nonzero(flat, size=size, fill_value=flat.shape[0])
  return rows.astype(jnp.int32)
