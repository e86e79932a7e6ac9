"""The one place that decides and runs an SEBP backward, for both ops and the benchmarks.

Each backward takes the output gradient flattened to ``dy: [T, F]`` and

1. finds the active rows (:func:`candidate_rows`): those whose max ``|value|`` exceeds the
   threshold (or that hold NaN/Inf), among every row or among an index given by the caller,
   whose skipped rows are then checked for NaN/Inf; one pass over dY's rows
   (:func:`sebp_jax.selection.row_statistics`) gives the count, the rows, their scores for
   ``overflow="drop"`` and the row log's statistics;
2. picks, from static shapes, the capacities it may run at (:func:`capacities`): with
   ``overflow="exact"`` one that holds every active row is taken at run time (a
   ``lax.switch``), the last being the dense backward of the active rows; except where
   :func:`sebp_jax.cost_model.choose_counted` picks a backend whose cost follows the rows
   its index lists (``follows_count``, the Pallas kernels: asked for, or on a GPU where the
   cost model predicts it ahead): then one index as long as every candidate row serves
   every count, with no branch;
3. computes the gradients from the kept rows alone: :func:`linear_backward` through the
   implementation that :func:`sebp_jax.cost_model.choose_implementation` picks,
   :func:`embedding_rows` and :func:`scatter_into_table` by a scatter of the kept rows into
   the table.

Whatever the capacity, the gradient is that of the same rows: the kept set depends on dY, the
threshold and the index, never on the shapes (except where ``overflow="drop"`` drops rows).

Arguments are assumed valid here: the public ops check them once, at their boundary.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sebp_jax.cost_model import choose_counted, choose_implementation
from sebp_jax.implementations import (accumulation_dtype, gather_rows, get_implementation,
                                      checks_varying_axes, with_poison)
from sebp_jax.selection import (RowStatistics, capacity_ladder, nan_as_inf, row_statistics,
                                select_from_scores, threshold_below)

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


def row_max_abs(dy: Array) -> Array:
  """Each row's max ``|value|`` of ``dy: [T, F]``: one read of dY that fuses with its
  producer. Inf where a row holds NaN or Inf (:func:`nan_as_inf`)."""
  # The initial 0 is below every |value| and lets an empty dY through.
  return jnp.max(nan_as_inf(jnp.abs(dy)), axis=1, initial=0)


def stray_rows(row_max: Array, listed: Array, threshold: float) -> Array:
  """``bool[T]``: the rows that an index of the rows that may be active (``listed``) leaves
  out and that are active (max ``|value|`` above ``threshold``, or not finite). The index
  promises there are none (padding under a masked loss); a model that breaks the promise (a
  pooling over every position, padding included) must get NaN, not a partial gradient."""
  return ~listed & ~(row_max <= threshold_below(threshold, row_max.dtype))


def index_poison(row_max: Array, stray: Array) -> Array:
  """A float32 scalar for dW and db: NaN where a row is not finite or ``stray``
  (:func:`stray_rows`), else 0."""
  # Inf * 0 is NaN (row_max holds no NaN). Multiplied before the cast, so that a finite
  # float64 value past float32's range stays 0.
  not_finite = (jnp.max(row_max, initial=0) * 0).astype(jnp.float32)
  return jnp.where(jnp.any(stray), jnp.nan, not_finite).astype(jnp.float32)


#: What the backward does when more rows are active than ``top_n``: ``"exact"`` runs a larger
#: capacity (the dense backward last) chosen at run time; ``"nan"`` makes the gradients NaN;
#: ``"drop"`` keeps the ``top_n`` of largest L2 norm (the SEBP paper's rule).
OVERFLOW_MODES = ("exact", "nan", "drop")


def capacities(top_n: int | str, overflow: str, num_candidates: int) -> tuple[int, ...]:
  """The static capacities (kept-row counts) a backward over ``num_candidates`` candidate rows
  may run at, smallest first. Only ``"exact"`` and ``"auto"`` give more than one: the last
  holds every candidate."""
  if top_n == "auto":
    return (*capacity_ladder(num_candidates), num_candidates)
  if top_n >= num_candidates:
    return (num_candidates,)
  return (top_n, num_candidates) if overflow == "exact" else (top_n,)


def candidate_rows(dy: Array, *, threshold: float, active_rows: Array | None, size: int,
                   check_listed: bool) -> tuple[Array, Array, Array, Array | None,
                                                Array | None, RowStatistics | None]:
  """``(rows, active, count, poison, stray, statistics)`` for ``dy: [T, F]``.

  ``rows``: ``int32[size]``, the active rows in ascending order, then the sentinel T (the
  first ``size`` of them when more are active); with ``active_rows`` given, its entries that
  are active (``size`` is then its length; with ``check_listed=False`` and no threshold, every
  entry counts as active, as zero rows add nothing to the gradients: for callers that need
  no count). ``active``: ``bool[T]``, every active row.
  ``count``: how many rows are active. ``poison``:
  None, or, with an index, :func:`index_poison`: a NaN/Inf or an active row that the index
  skips must still show in dW and db. ``stray``: None, or, with an index,
  :func:`stray_rows`. ``statistics``: every row's
  (:func:`sebp_jax.selection.row_statistics`), from the one pass over dY that gives all of
  the above where the rows are checked; None where only the poison is needed.
  """
  num_rows = dy.shape[0]
  statistics = (row_statistics(dy, threshold)
                if active_rows is None or threshold > 0 or check_listed else None)
  if active_rows is None:
    (rows,) = jnp.nonzero(statistics.active, size=size, fill_value=num_rows)
    return (rows.astype(jnp.int32), statistics.active,
            jnp.sum(statistics.active, dtype=jnp.int32), None, None, statistics)
  # The contract (strictly ascending, then sentinels) is checked where the index is concrete
  # only. A traced one that breaks it is made to keep it: sorted, entries out of [0, T) and
  # repeats as sentinels (the kernels follow a sorted count; a repeat would count twice); a
  # nonzero row it misses shows as stray.
  rows = jnp.sort(jnp.where((active_rows >= 0) & (active_rows < num_rows), active_rows,
                            num_rows))
  row_max = row_max_abs(dy) if statistics is None else statistics.max_abs
  stray = stray_rows(row_max, rows_mask(rows, num_rows), threshold)
  # Each listed row once (and, where the rows are checked, only the active ones), sorted again
  # in one pass.
  kept = jnp.concatenate([jnp.ones((1,), bool), rows[1:] != rows[:-1]])
  if statistics is not None:
    kept &= jnp.take(statistics.active, rows, mode="fill", fill_value=False)
  rows = jnp.sort(jnp.where(kept, rows, num_rows))
  return (rows, rows_mask(rows, num_rows), jnp.sum(rows < num_rows, dtype=jnp.int32),
          index_poison(row_max, stray), stray, statistics)


def largest_rows(rows: Array, top_n: int, statistics: RowStatistics) -> Array:
  """The ``top_n`` of ``rows`` with the largest L2 norm (NaN/Inf first) by ``statistics``,
  sorted; inactive entries (and sentinels) rank last and come back as the sentinel."""
  num_rows = statistics.scores.shape[0]
  scores = jnp.take(statistics.scores, rows, mode="fill", fill_value=-1)
  best_scores, slots = lax.top_k(scores, top_n)
  return jnp.sort(jnp.where(best_scores >= 0, rows[slots], num_rows))


def rows_mask(rows: Array, num_rows: int) -> Array:
  """``bool[num_rows]``, True at the rows listed in ``rows`` (sentinels ignored)."""
  return jnp.zeros((num_rows,), bool).at[rows].set(True, mode="drop")


def overflow_poison(count: Array, capacity: int) -> Array:
  """float32 NaN when ``count`` active rows do not fit in ``capacity``, else 0."""
  return jnp.where(count > capacity, jnp.nan, 0.0).astype(jnp.float32)


def _add(poison: Array | None, more: Array | None) -> Array | None:
  return more if poison is None else poison if more is None else poison + more


def _record(row_log, statistics: RowStatistics, kept: Array, count: Array | None,
            capacity: Array) -> None:
  """Sends one layer's row statistics to ``row_log`` (a :class:`sebp_jax.report.RowLog` entry
  point) from inside the trace: active (``count``; None: every active row) and kept rows,
  capacity run, dropped norm share, and each row's max ``|value|`` and squared L2 norm."""
  if count is None:
    count = jnp.sum(statistics.active, dtype=jnp.int32)
  squared = statistics.squared_norm
  total = jnp.sum(squared)
  dropped = jnp.sum(jnp.where(kept, 0.0, squared))
  # NaN where dY is not finite; 0 where it is all zeros (nothing to drop).
  share = jnp.where(total == 0, 0.0, dropped / jnp.where(total == 0, 1.0, total))
  share = jnp.where(jnp.isfinite(total), share, jnp.nan)
  jax.debug.callback(row_log, count, jnp.sum(kept, dtype=jnp.int32), capacity, share,
                     squared.shape[0], statistics.max_abs, squared)


def linear_backward(x: Array, kernel: Array, dy: Array, *, top_n: int | str,
                    threshold: float = 0.0, overflow: str = "exact",
                    active_rows: Array | None = None, finite_x_rows: Array | None = None,
                    backend: str = "auto", with_bias: bool, precision: Any = None,
                    dkernel_dtype: Any = None, row_log=None):
  """dX, dW and db of ``y = x @ kernel + b`` from the kept rows of dY.

  Args:
    x: ``[T, D]`` forward input.
    kernel: ``[D, N]``.
    dy: ``[T, N]`` output gradient.
    top_n: ``"auto"`` or the capacity, a static positive int.
    threshold: a row is active when its max ``|value|`` exceeds this.
    overflow: one of :data:`OVERFLOW_MODES`.
    active_rows: optional ``int32[K]`` index of the rows that may be active (sorted, padded
      with T), ``K >= 1``: the others must be inactive; one that is not makes dW, db and
      its row of dX NaN (:func:`stray_rows`).
    finite_x_rows: optional ``bool[T]``, whether each row of x is finite: a row that is not
      and that the backward skips makes all of dW NaN, where jax.grad's dW = xᵀ·dY has NaN
      (0 * Inf) in the rows of the features that are not finite (None: x is not checked).
    backend: ``"auto"`` or a registered implementation (:mod:`sebp_jax.implementations`).
    with_bias: whether to return db.
    precision: ``lax.Precision`` of the dots.
    dkernel_dtype: dtype of dW; default the accumulation dtype.
    row_log: optional callable of ``(active, kept, capacity, share_dropped, rows,
      row_max_abs, row_squared_norm)``, called through ``jax.debug.callback`` once per
      backward.

  Returns:
    ``(dx [T, D] in x's dtype, dkernel [D, N], dbias [N] in the accumulation dtype or None)``.
  """
  num_rows, in_features = x.shape
  overflowed = None  # NaN where "nan" overflowed: dX too misses the rows left out.
  stray = None  # Rows the index left out that are not zero: dX misses them.
  if top_n == "auto":
    overflow = "exact"  # Its last capacity holds every row: nothing can overflow.
  num_candidates = num_rows if active_rows is None else active_rows.shape[0]
  plan = capacities(top_n, overflow, num_candidates)
  if num_rows == 0 or (plan == (num_rows,) and active_rows is None and threshold == 0
                       and row_log is None):
    # Every row, none chosen from dY's values: the dense backward, differentiable again.
    return get_implementation("dense").backward(
        x, kernel, dy, None, with_bias=with_bias, precision=precision,
        dkernel_dtype=dkernel_dtype)
  dy = first_order_only(dy)
  # A backend whose cost follows the listed rows runs once, on an index of every candidate.
  counted_backend = choose_counted(backend, plan=plan, num_rows=num_rows,
                                   in_features=in_features, out_features=kernel.shape[1],
                                   itemsize=dy.dtype.itemsize,
                                   varying=checks_varying_axes(x, kernel, dy))
  counted = counted_backend is not None
  if counted:
    plan = (num_candidates,)
  # ``active``: every active row, or None where ``rows`` are the kept rows and all of them.
  # ``statistics``: the one pass over dY's rows that the selection and the row log share.
  if overflow == "drop" and active_rows is None and plan[0] < num_rows:
    statistics = row_statistics(dy, threshold)
    rows = select_from_scores(statistics.scores, statistics.active, plan[0])
    active, count, poison = None, None, None
  else:
    # The largest capacity below every row is the most any branch gathers.
    size = (max([c for c in plan if c < num_rows] or [1])
            if active_rows is None and not counted else num_candidates)
    overflows = overflow != "exact" and plan[0] < num_candidates
    rows, active, count, poison, stray, statistics = candidate_rows(
        dy, threshold=threshold, active_rows=active_rows, size=size,
        check_listed=len(plan) > 1 or overflows or row_log is not None)
    if overflows:
      if overflow == "drop":
        rows = largest_rows(rows, plan[0], statistics)
      else:
        overflowed = overflow_poison(count, plan[0])
        poison = _add(poison, overflowed)
        rows = rows[:plan[0]]
      active = None
  # Rows that a dense backward must zero: those the threshold, the index or a drop leaves out.
  masked = active_rows is not None or threshold > 0 or active is None

  def run_at(capacity: int):
    if counted:
      name = counted_backend
    elif capacity >= num_rows:
      name = "dense"
    else:
      name = choose_implementation(
          backend, num_rows=num_rows, in_features=in_features, out_features=kernel.shape[1],
          top_n=capacity, itemsize=dy.dtype.itemsize, index_given=active_rows is not None)
    implementation = get_implementation(name)
    if implementation.takes_index:
      return implementation.backward(x, kernel, dy, rows[:capacity], with_bias=with_bias,
                                     precision=precision, poison=poison,
                                     dkernel_dtype=dkernel_dtype)
    if masked:
      kept = active if active is not None and capacity > rows.shape[0] else rows_mask(
          rows[:capacity], num_rows)
      dy_kept = jnp.where(kept[:, None], dy, 0)
    else:
      dy_kept = dy
    dx, dkernel, dbias = implementation.backward(x, kernel, dy_kept, None, with_bias=with_bias,
                                                 precision=precision,
                                                 dkernel_dtype=dkernel_dtype)
    return (dx, *with_poison(dkernel, dbias, poison))

  if len(plan) == 1:
    capacity = jnp.int32(plan[0])
    dx, dkernel, dbias = run_at(plan[0])
  else:
    # The smallest capacity that holds every active row.
    branch = jnp.sum(count > jnp.asarray(plan[:-1]), dtype=jnp.int32)
    capacity = jnp.asarray(plan, jnp.int32)[branch]
    dx, dkernel, dbias = lax.switch(branch, [functools.partial(run_at, c) for c in plan])
  if overflowed is not None:
    dx = dx + overflowed.astype(dx.dtype)
  if stray is not None:
    # NaN in those rows, as jax.grad's dX has for a NaN row of dY: it reaches the layers
    # below, whose index leaves the rows out too.
    dx = jnp.where(stray[:, None], jnp.nan, dx)
  kept = lambda: rows_mask(rows, num_rows) if active is None else active
  if finite_x_rows is not None:
    skipped_not_finite = jnp.any(~finite_x_rows & ~kept())
    dkernel = dkernel + jnp.where(skipped_not_finite, jnp.nan, 0).astype(dkernel.dtype)
  if row_log is not None:
    _record(row_log, statistics, kept(), count, capacity)
  return dx, dkernel, dbias


def table_row_ids(ids: Array, num_embeddings: int) -> Array:
  """``int32`` row of a ``num_embeddings``-row table that each of ``ids`` reads, as
  ``jnp.take`` (and so ``nn.Embed``, and autodiff's gradient) reads it: a negative id plus
  the table's size, added in the ids' own dtype (where the size does not fit a narrow dtype,
  it wraps there as it does in ``jnp.take``), and ``num_embeddings``, the row past the end
  that a scatter drops, for an id still out of range. The bounds are compared in the ids'
  own dtype: ``num_embeddings`` cast to uint8 ids would wrap, and so would a uint32 id of
  2**31 or more cast to int32."""
  ids = jnp.asarray(ids)
  limits = jnp.iinfo(ids.dtype)
  if limits.min < 0:
    ids = jnp.where(ids < 0, ids + np.array(num_embeddings).astype(ids.dtype), ids)
  in_range = ids >= 0
  if num_embeddings <= limits.max:
    in_range = in_range & (ids < num_embeddings)
  return jnp.where(in_range, jnp.where(in_range, ids, 0).astype(jnp.int32), num_embeddings)


def embedding_kept_count(num_candidates: int, top_n: int | str, overflow: str) -> int:
  """Rows :func:`embedding_rows` keeps of ``num_candidates``: every one for ``"exact"`` and
  ``"auto"`` (a scatter of all of them costs little more than of ``top_n``, and needs no
  run-time branch), else at most ``top_n``."""
  if top_n == "auto" or overflow == "exact":
    return num_candidates
  return min(top_n, num_candidates)


def embedding_rows(ids: Array, dy: Array, *, num_embeddings: int, top_n: int | str,
                   threshold: float = 0.0, overflow: str = "exact",
                   active_rows: Array | None = None, row_log=None
                   ) -> tuple[Array, Array, Array | None]:
  """The kept rows of dY and their ids, which :func:`scatter_into_table` adds into the table.

  Args:
    ids: ``int[T]`` token ids.
    dy: ``[T, F]`` output gradient.
    num_embeddings: rows of the table.
    top_n, threshold, overflow, active_rows, row_log: as in :func:`linear_backward`, except
      that ``"exact"`` and ``"auto"`` keep every active row (:func:`embedding_kept_count`).

  Returns:
    ``(kept_ids, kept_dy, poison)``: the rows' ids as :func:`table_row_ids` writes them
    (``num_embeddings`` also in slots that hold no row), ``[K, F]`` rows of dY (zeros there),
    and
    None or a float32 ``[1]`` that is NaN where the gradient must be (a NaN/Inf in a skipped
    row, an overflow under ``"nan"``), else 0. Where every row is kept and none selected
    (no index, no threshold, no log), they are every row's id and ``dy`` itself.
  """
  num_rows = dy.shape[0]
  if num_rows == 0:  # No rows: nothing to gather from.
    return jnp.zeros((0,), jnp.int32), jnp.zeros((0, dy.shape[1]), dy.dtype), None
  ids = table_row_ids(ids, num_embeddings)
  num_candidates = num_rows if active_rows is None else active_rows.shape[0]
  capacity = embedding_kept_count(num_candidates, top_n, overflow)
  if active_rows is None and threshold == 0 and capacity == num_rows and row_log is None:
    # Every row kept, none selected: the lookup's own backward, exact to any order.
    return ids, dy, None
  dy = first_order_only(dy)
  if overflow == "drop" and active_rows is None and capacity < num_rows:
    statistics = row_statistics(dy, threshold)
    rows = select_from_scores(statistics.scores, statistics.active, capacity)
    count, poison = None, None
  else:
    rows, _, count, poison, _, statistics = candidate_rows(
        dy, threshold=threshold, active_rows=active_rows, size=num_candidates,
        check_listed=capacity < num_candidates or row_log is not None)
    if overflow == "drop" and capacity < rows.shape[0]:
      rows = largest_rows(rows, capacity, statistics)
    elif overflow == "nan" and capacity < rows.shape[0]:
      poison = _add(poison, overflow_poison(count, capacity))
      rows = rows[:capacity]
  if row_log is not None:
    _record(row_log, statistics, rows_mask(rows, num_rows), count, jnp.int32(rows.shape[0]))
  # Sentinel slots read the out-of-range id num_embeddings, which the scatter drops.
  kept_ids = jnp.take(ids, rows, mode="fill", fill_value=num_embeddings)
  poison = None if poison is None else jnp.reshape(poison, (1,)).astype(jnp.float32)
  return kept_ids, gather_rows(dy, rows), poison


def scatter_into_table(kept_ids: Array, kept_dy: Array, poison: Array | None, *,
                       num_embeddings: int) -> Array:
  """``[num_embeddings, F]`` in the accumulation dtype (float32 for 16-bit dY): the
  scatter-add of ``kept_dy``'s rows at ``kept_ids`` (out-of-range ids dropped), every
  element NaN where ``poison`` (any of its elements) is."""
  accumulate = accumulation_dtype(kept_dy.dtype)
  # The poison fills the whole table gradient, at no cost: the fill writes the table anyway.
  fill = 0 if poison is None else jnp.sum(poison).astype(accumulate)
  return jnp.full((num_embeddings, kept_dy.shape[1]), fill, accumulate).at[kept_ids].add(
      kept_dy.astype(accumulate), mode="drop")


def sum_rows_of_equal_ids(ids: Array, rows: Array, *,
                          num_embeddings: int) -> tuple[Array, Array]:
  """``(ids, sums)``: ``rows`` (``[K, F]``) summed per id in the accumulation dtype, in an order
  fixed by the ids alone, each sum in the last slot of its id (the slots sorted by id), every
  other slot given an out-of-range id of its own. A scatter-add of them touches each row of
  the table once, so it gives the same table wherever it runs; a scatter-add of repeated ids
  is free to add them in any order, and on a GPU its atomic adds do, differently from one
  device to the next."""
  accumulate = accumulation_dtype(rows.dtype)
  if ids.shape[0] == 0:
    return jnp.zeros((0,), jnp.int32), rows.astype(accumulate)
  ids = table_row_ids(ids, num_embeddings)  # One id per row of the table.
  order = jnp.argsort(ids, stable=True)
  ids, rows = ids[order], rows[order].astype(accumulate)
  starts = jnp.concatenate([jnp.ones((1,), bool), ids[1:] != ids[:-1]])

  def add_within_ids(earlier, later):  # A segmented sum: a new id starts over.
    (earlier_starts, earlier_sums), (later_starts, later_sums) = earlier, later
    return (earlier_starts | later_starts,
            jnp.where(later_starts[:, None], later_sums, earlier_sums + later_sums))

  _, sums = lax.associative_scan(add_within_ids, (starts, rows))
  ends = jnp.concatenate([ids[1:] != ids[:-1], jnp.ones((1,), bool)])
  return jnp.where(ends, ids, num_embeddings + jnp.arange(ids.size, dtype=ids.dtype)), sums
