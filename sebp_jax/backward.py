"""The one place that decides and runs an SEBP backward, for both ops and the benchmarks.

Each backward takes the output gradient flattened to ``dy: [T, F]`` and

1. finds the rows to keep (:func:`kept_rows`): scored from dY, or an index given by the
   caller, which is then checked for NaN/Inf in the rows it skips;
2. computes the gradients from those rows alone: :func:`linear_backward` through the
   implementation that :func:`sebp_jax.cost_model.choose_implementation` picks,
   :func:`embedding_backward` by a scatter of the kept rows into the table.

Arguments are assumed valid here: the public ops check them once, at their boundary.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sebp_jax.cost_model import choose_implementation
from sebp_jax.implementations import accumulation_dtype, gather_rows, get_implementation
from sebp_jax.selection import select_active_rows

Array = jax.Array


@jax.custom_jvp
def first_order_only(dy: Array) -> Array:
  """``dy`` as is, but refusing to be differentiated.

  The backward keeps rows chosen from dY's values: differentiated again, it would treat that
  choice as fixed and drop the tangents of the rows it skips, a silently wrong second order.
  """
  return dy


@first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
  raise NotImplementedError(
      "SEBP's backward cannot be differentiated (grad of grad, jax.hessian): its rows are "
      "chosen from dY's values, so its derivative would drop the tangents of the rows it "
      "skips. Differentiate twice with flax's own Dense/Embed (outside use_sebp).")


def nan_if_not_finite(dy: Array) -> Array:
  """A float32 scalar: 0 if every element of ``dy: [T, F]`` is finite, else NaN.

  A max over each row and a max of those: one read of dY that fuses with its producer. It
  relies on XLA's max propagating NaN, its default (the GPU flag
  ``--xla_gpu_enable_fast_min_max`` would break that).
  """
  # NaN propagates through max; |Inf| * 0 is NaN. The initial 0 is below every |value| and
  # lets an empty dY through.
  row_max = jnp.max(jnp.abs(dy), axis=1, initial=0)
  # Multiplied before the cast, so that a finite float64 value past float32's range stays 0.
  return (jnp.max(row_max, initial=0) * 0).astype(jnp.float32)


def kept_rows(dy: Array, *, top_n: int, threshold: float,
              active_rows: Array | None) -> tuple[Array, Array | None]:
  """``(rows, poison)``: the ``int32[K]`` index of the rows of ``dy: [T, F]`` to keep (sorted,
  padded with the sentinel T) and the NaN check its gradients must carry, or None.

  Without ``active_rows`` the top ``top_n`` rows are selected from dY; a row holding NaN/Inf
  is always kept, so nothing needs checking. A given index never looks at dY, so a NaN/Inf in
  a row it skips would vanish: the poison makes dW and db NaN instead.
  """
  if active_rows is None:
    return select_active_rows(dy, top_n, threshold), None
  return active_rows, nan_if_not_finite(dy)


def linear_backward(x: Array, kernel: Array, dy: Array, *, top_n: int, threshold: float = 0.0,
                    active_rows: Array | None = None, backend: str = "auto",
                    with_bias: bool, precision: Any = None, dkernel_dtype: Any = None):
  """dX, dW and db of ``y = x @ kernel + b`` from the kept rows of dY.

  Args:
    x: ``[T, D]`` forward input.
    kernel: ``[D, N]``.
    dy: ``[T, N]`` output gradient.
    top_n: rows kept when selecting from dY (a static positive int).
    threshold: a row is active when its max ``|value|`` exceeds this.
    active_rows: optional ``int32[K]`` index of the rows to keep (sorted, padded with T),
      ``K >= 1``. An implementation that keeps every row (``"dense"``) has no use for it.
    backend: ``"auto"`` or a registered implementation (:mod:`sebp_jax.implementations`).
    with_bias: whether to return db.
    precision: ``lax.Precision`` of the dots.
    dkernel_dtype: dtype of dW; default the accumulation dtype.

  Returns:
    ``(dx [T, D] in x's dtype, dkernel [D, N], dbias [N] in the accumulation dtype or None)``.
  """
  num_rows, in_features = x.shape
  name = choose_implementation(
      backend, num_rows=num_rows, in_features=in_features, out_features=kernel.shape[1],
      top_n=top_n if active_rows is None else active_rows.shape[0],
      itemsize=dy.dtype.itemsize, index_given=active_rows is not None)
  implementation = get_implementation(name)
  rows, poison = None, None
  if implementation.takes_index:
    dy = first_order_only(dy)
    rows, poison = kept_rows(dy, top_n=top_n, threshold=threshold, active_rows=active_rows)
  return implementation.backward(x, kernel, dy, rows, with_bias=with_bias, precision=precision,
                                 poison=poison, dkernel_dtype=dkernel_dtype)


def embedding_backward(ids: Array, dy: Array, *, num_embeddings: int, top_n: int,
                       threshold: float = 0.0, active_rows: Array | None = None) -> Array:
  """The gradient of ``table[ids]`` with respect to the table, from the kept rows of dY.

  Args:
    ids: ``int[T]`` token ids.
    dy: ``[T, F]`` output gradient.
    num_embeddings: rows of the table.
    top_n, threshold, active_rows: as in :func:`linear_backward`.

  Returns:
    ``[num_embeddings, F]`` in the accumulation dtype (float32 for 16-bit dY): the
    scatter-add of the kept rows of dY at their ids.
  """
  accumulate = accumulation_dtype(dy.dtype)
  if dy.shape[0] == 0:  # No rows: nothing to gather from.
    return jnp.zeros((num_embeddings, dy.shape[1]), accumulate)
  dy = first_order_only(dy)
  rows, poison = kept_rows(dy, top_n=top_n, threshold=threshold, active_rows=active_rows)
  # Sentinel slots read the out-of-range id num_embeddings, which the scatter drops; the ids
  # are widened first so that the sentinel fits their dtype (int8 / uint8 ids).
  ids = ids.astype(jnp.promote_types(ids.dtype, jnp.int32))
  kept_ids = jnp.take(ids, rows, mode="fill", fill_value=num_embeddings)
  # The poison fills the whole table gradient, at no cost: the fill writes the table anyway.
  fill = 0 if poison is None else poison.astype(accumulate)
  return jnp.full((num_embeddings, dy.shape[1]), fill, accumulate).at[kept_ids].add(
      gather_rows(dy, rows).astype(accumulate), mode="drop")
