"""The backward entry point: which rows it keeps at every capacity and overflow mode, the NaN
check of a given index, the row log, and the gradients it returns through each
implementation, against the float64 numpy reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params

from sebp_jax import RowLog, cost_model
from sebp_jax import backward as backward_module
from sebp_jax.backward import (capacities, embedding_rows, index_poison, linear_backward,
                               row_max_abs, scatter_into_table, stray_rows)
from sebp_jax.selection import capacity_ladder
from tests.model_testing import branches
from tests.reference import (random_sparse_rows, reference_active_rows, reference_backward,
                             reference_table_grad, relative_error)

NUM_ROWS = 64


def _table_gradient(ids, dy, *, num_embeddings, **options):
  """The embedding backward as the op runs it on one device: the kept rows, scattered."""
  return scatter_into_table(*embedding_rows(ids, dy, num_embeddings=num_embeddings, **options),
                            num_embeddings=num_embeddings)


def _problem(seed, num_nonzero=9, num_rows=NUM_ROWS, in_features=16, out_features=24):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((num_rows, in_features)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((in_features, out_features)), jnp.float32)
  dy = jnp.asarray(random_sparse_rows(rng, num_rows, out_features, num_nonzero))
  return x, kernel, dy


def _backward(x, kernel, dy, **options):
  return jax.jit(lambda x, kernel, dy: linear_backward(x, kernel, dy, with_bias=True,
                                                       **options))(x, kernel, dy)


def _assert_grads_of_rows(grads, x, kernel, dy, rows, tolerance=1e-5):
  for got, want in zip(grads, reference_backward(x, kernel, dy, rows)):
    assert relative_error(got, want) <= tolerance


def test_index_poison_and_stray_rows():
  """Stray: a row the index leaves out that is above the threshold or not finite. The poison
  of dW and db: NaN for a NaN/Inf anywhere or a stray row; 0 where the rows left out are
  zero (or below the threshold)."""
  listed = jnp.array([True, False, True])

  def check(dy, stray, threshold=0.0):
    row_max = row_max_abs(dy)
    got = stray_rows(row_max, listed, threshold)
    np.testing.assert_array_equal(got, [False, stray, False])
    return index_poison(row_max, got)

  dy = jnp.ones((3, 4)).at[1].set(0)
  assert check(dy, False) == 0
  assert np.isnan(check(dy.at[2, 1].set(jnp.inf), False))
  assert np.isnan(check(dy.at[0, 3].set(-jnp.nan), False))
  assert np.isnan(check(dy.at[1, 3].set(-jnp.nan), True))
  assert np.isnan(check(dy.at[1, 2].set(-1e-3), True))
  # At the threshold, not above it: 1e-3 in float32 is above 1e-3 itself.
  at = float(np.float32(1e-3))
  assert check(dy.at[1, 2].set(-at), False, threshold=at) == 0
  assert np.isnan(check(dy.at[1, 2].set(-1e-3), True, threshold=1e-3))
  assert index_poison(jnp.zeros((0,)), jnp.zeros((0,), bool)) == 0
  if jax.config.jax_enable_x64:
    assert check(jnp.full((3, 2), 1e300, jnp.float64).at[1].set(0), False) == 0


def test_capacities():
  assert capacity_ladder(64) == (8, 16, 32)
  assert capacity_ladder(1000) == (64, 128, 256, 504)
  assert capacity_ladder(4) == ()
  assert capacities("auto", "exact", 64) == (8, 16, 32, 64)
  assert capacities(10, "exact", 64) == (10, 64)
  assert capacities(10, "nan", 64) == capacities(10, "drop", 64) == (10,)
  assert capacities(100, "drop", 64) == (64,)


@pytest.mark.parametrize("backend", ["xla", "pallas", "dense", "auto"])
@pytest.mark.parametrize("num_nonzero", [3, 12, 20, 40, 64])
@pytest.mark.parametrize("top_n", ["auto", 10])
def test_exact_keeps_every_active_row_at_any_count(backend, num_nonzero, top_n):
  x, kernel, dy = _problem(num_nonzero, num_nonzero=num_nonzero)
  grads = _backward(x, kernel, dy, top_n=top_n, backend=backend)
  _assert_grads_of_rows(grads, x, kernel, dy, np.arange(NUM_ROWS))


# Every count the "auto" ladder of 64 rows (8, 16, 32) can meet: none, one, each rung and its
# neighbours, every row.
COUNTS = [0, 1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64]


@pytest.mark.parametrize("options", [dict(top_n="auto"), dict(top_n=10),
                                     dict(top_n="auto", index=True),
                                     dict(top_n="auto", threshold=0.1)])
def test_pallas_runs_one_branch_free_program_for_every_count(options):
  """Where the capacity would be chosen at run time, the Pallas kernels (whose work follows
  the rows listed) run once on an index of every candidate row: no cond, and the gradient of
  every active row at every count."""
  options = dict(options)
  index = jnp.arange(NUM_ROWS, dtype=jnp.int32) if options.pop("index", False) else None

  def backward(x, kernel, dy):
    return linear_backward(x, kernel, dy, with_bias=True, backend="pallas",
                           active_rows=index, **options)

  x, kernel, dy = _problem(0)
  assert branches(jax.make_jaxpr(backward)(x, kernel, dy).jaxpr) == []
  xla_plan = jax.make_jaxpr(lambda *a: linear_backward(*a, with_bias=True, backend="xla",
                                                       active_rows=index, **options))
  assert "cond" in branches(xla_plan(x, kernel, dy).jaxpr)
  compiled = jax.jit(backward)
  for count in COUNTS:
    x, kernel, dy = _problem(100 + count, num_nonzero=count)
    _assert_grads_of_rows(compiled(x, kernel, dy), x, kernel, dy, np.arange(NUM_ROWS))


def test_pallas_mosaic_runs_one_branch_free_program_for_every_count():
  """The Mosaic GPU route (interpreted on CPU) at top_n="auto": no cond, and every active row's
  gradient at every count around each rung of the ladder of 256 rows (16, 32, 64, 128; 128 is
  also its tiles' edge: copy blocks, dX row tiles), none, one and all."""
  as_bf16 = lambda *arrays: [a.astype(jnp.bfloat16) for a in arrays]  # noqa: E731

  def backward(x, kernel, dy):
    return linear_backward(x, kernel, dy, with_bias=True, backend="pallas_mosaic", top_n="auto")

  shape = dict(num_rows=256, in_features=128, out_features=128)
  x, kernel, dy = as_bf16(*_problem(0, **shape))
  assert branches(jax.make_jaxpr(backward)(x, kernel, dy).jaxpr) == []
  compiled = jax.jit(backward)
  for count in (0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 256):
    x, kernel, dy = as_bf16(*_problem(400 + count, num_nonzero=count, **shape))
    _assert_grads_of_rows(compiled(x, kernel, dy), x, kernel, dy, np.arange(256),
                          tolerance=1e-2)


@pytest.mark.parametrize("count", [5, 130])
def test_counted_dx_never_reads_the_slots_the_kernel_leaves_unwritten(count):
  """An index of 384 slots spans several of the dX kernel's row blocks; those of sentinels
  alone are left unwritten (NaN when interpreted), and dX is still exact and finite."""
  x, kernel, dy = _problem(300 + count, num_nonzero=count, num_rows=384)
  grads = _backward(x, kernel, dy, top_n="auto", backend="pallas")
  assert all(np.all(np.isfinite(g)) for g in grads)
  _assert_grads_of_rows(grads, x, kernel, dy, np.arange(384))


def test_auto_on_a_gpu_runs_the_counted_kernels_where_the_cost_model_says(monkeypatch):
  """``backend="auto"`` takes the branch-free Pallas path for 16-bit operands on a GPU (the
  platform faked for the choice alone: the kernels run interpreted here), exact at every
  count; float32 keeps the branch."""
  monkeypatch.setattr(backward_module, "choose_counted",
                      functools.partial(cost_model.choose_counted, platform="gpu"))

  def backward(x, kernel, dy):
    return linear_backward(x, kernel, dy, with_bias=True, backend="auto", top_n="auto")

  x, kernel, dy = _problem(0)
  assert "cond" in branches(jax.make_jaxpr(backward)(x, kernel, dy).jaxpr)
  as_bf16 = lambda *arrays: [a.astype(jnp.bfloat16) for a in arrays]  # noqa: E731
  assert branches(jax.make_jaxpr(backward)(*as_bf16(x, kernel, dy)).jaxpr) == []
  compiled = jax.jit(backward)
  for count in (0, 1, 9, 33, 64):
    x, kernel, dy = as_bf16(*_problem(200 + count, num_nonzero=count))
    _assert_grads_of_rows(compiled(x, kernel, dy), x, kernel, dy, np.arange(NUM_ROWS),
                          tolerance=1e-2)


@pytest.mark.parametrize("split", [True, False], ids=["rows_split", "replicated"])
def test_auto_inside_a_shard_map_checking_varying_axes_keeps_the_xla_branches(monkeypatch,
                                                                               split):
  """In a ``jax.shard_map`` with ``check_vma=True`` (``fsdp_loss``'s) a ``pallas_call`` needs
  its outputs' varying axes, which the kernels do not give, even where no operand varies:
  there ``"auto"`` keeps XLA's branches on a GPU too (the platform faked), and the gradient
  is the dense one."""
  from jax.sharding import PartitionSpec as P

  from sebp_jax.ops import sebp_linear
  monkeypatch.setattr(backward_module, "choose_counted",
                      functools.partial(cost_model.choose_counted, platform="gpu"))
  x, kernel, dy = (a.astype(jnp.bfloat16) for a in _problem(3, num_nonzero=40, num_rows=256))
  mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices("cpu")[:2])

  def grads(x, kernel, dy, sebp):
    def loss(x, kernel):
      y = sebp_linear(x, kernel, backend="auto") if sebp else x @ kernel
      return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1))(x, kernel)

  rows = P("data") if split else P()
  step = jax.jit(jax.shard_map(functools.partial(grads, sebp=True), mesh=mesh,
                               in_specs=(rows, P(), rows), out_specs=(rows, P()),
                               check_vma=True))
  assert branches(jax.make_jaxpr(step)(x, kernel, dy).jaxpr)  # XLA's run-time branches
  for got, want in zip(step(x, kernel, dy), grads(x, kernel, dy, sebp=False)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2e-2, atol=5e-2)


def _passes_over_rows(jaxpr) -> int:
  """How many ``abs`` of a 2-D array (a pass that scores rows of dY) a jaxpr holds."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "abs" and eqn.invars[0].aval.ndim == 2
    for sub in jaxprs_in_params(eqn.params):
      count += _passes_over_rows(sub)
  return count


@pytest.mark.parametrize("options", [
    dict(top_n=10, overflow="drop"), dict(top_n="auto"), dict(top_n=10, overflow="drop",
                                                              index=True),
    dict(top_n="auto", index=True), dict(top_n=10, overflow="nan", index=True, threshold=0.1)])
@pytest.mark.parametrize("logged", [False, True])
def test_dy_is_scored_once_per_backward(options, logged):
  """The selection (candidates, largest rows, the NaN check of an index's skipped rows) and
  the row log share one pass over dY's rows; an embedding that keeps every row unselected
  (no index, no threshold, no log) makes none."""
  options = dict(options)
  index = jnp.arange(0, NUM_ROWS, 2, dtype=jnp.int32) if options.pop("index", False) else None
  x, kernel, dy = _problem(7, num_nonzero=20)
  row_log = RowLog().for_layer("dense") if logged else None
  backward = lambda x, kernel, dy: linear_backward(  # noqa: E731
      x, kernel, dy, with_bias=True, backend="xla", active_rows=index, row_log=row_log,
      **options)
  assert _passes_over_rows(jax.make_jaxpr(backward)(x, kernel, dy).jaxpr) == 1
  embed = lambda dy: _table_gradient(  # noqa: E731
      jnp.arange(NUM_ROWS) % 5, dy, num_embeddings=5, active_rows=index, row_log=row_log,
      **options)
  unselected = index is None and options == dict(top_n="auto") and not logged
  assert _passes_over_rows(jax.make_jaxpr(embed)(dy).jaxpr) == (0 if unselected else 1)


@pytest.mark.parametrize("backend", ["xla", "pallas", "dense"])
def test_drop_keeps_the_largest_rows(backend):
  x, kernel, dy = _problem(2, num_nonzero=15)
  grads = _backward(x, kernel, dy, top_n=10, overflow="drop", backend=backend)
  _assert_grads_of_rows(grads, x, kernel, dy, reference_active_rows(dy, 10))


@pytest.mark.parametrize("index_given", [False, True])
def test_nan_overflow_makes_every_gradient_nan(index_given):
  x, kernel, dy = _problem(3, num_nonzero=15)
  index = jnp.arange(NUM_ROWS, dtype=jnp.int32) if index_given else None
  grads = _backward(x, kernel, dy, top_n=10, overflow="nan", active_rows=index)
  assert all(np.all(np.isnan(g)) for g in grads)
  grads = _backward(x, kernel, dy, top_n=15, overflow="nan", active_rows=index)
  _assert_grads_of_rows(grads, x, kernel, dy, np.arange(NUM_ROWS))


def _rows_with_small_ones(seed):
  """dY with 6 rows of signal and 4 rows whose values lie below 0.1."""
  x, kernel, dy = _problem(seed, num_nonzero=0)
  rng = np.random.default_rng(seed)
  dy = np.array(dy)
  dy[[1, 9, 20, 33, 40, 63]] = rng.standard_normal((6, dy.shape[1])) + 3
  dy[[4, 21, 50, 51]] = rng.uniform(-0.05, 0.05, (4, dy.shape[1]))
  return x, kernel, jnp.asarray(dy)


@pytest.mark.parametrize("options", [
    dict(top_n=6), dict(top_n=7), dict(top_n=NUM_ROWS), dict(top_n="auto"),
    dict(top_n=6, overflow="nan"), dict(top_n=6, overflow="drop"), dict(top_n=1000),
    dict(top_n=6, backend="dense"), dict(top_n="auto", backend="pallas"),
    dict(top_n=6, active_rows=jnp.array([1, 4, 9, 20, 21, 33, 40, 50, 51, 63], jnp.int32)),
    dict(top_n="auto", active_rows=jnp.arange(NUM_ROWS, dtype=jnp.int32)),
    dict(top_n=12, active_rows=jnp.arange(NUM_ROWS, dtype=jnp.int32), overflow="drop"),
])
def test_threshold_means_the_same_at_every_capacity_and_with_an_index(options):
  x, kernel, dy = _rows_with_small_ones(4)
  grads = _backward(x, kernel, dy, threshold=0.1, **options)
  _assert_grads_of_rows(grads, x, kernel, dy, np.array([1, 9, 20, 33, 40, 63]))


def test_an_index_limits_the_active_rows():
  """The backward reads the listed rows only; a row the index leaves out that is not zero
  (the index's promise broken: a loss reading padding) makes dW and db NaN, whatever the
  capacity and overflow, never a gradient silently without it."""
  x, kernel, dy = _problem(5, num_nonzero=NUM_ROWS)
  rows = [2, 7, 30, 41]
  index = jnp.array([*rows, NUM_ROWS, NUM_ROWS], jnp.int32)
  listed_only = jnp.zeros_like(dy).at[jnp.array(rows)].set(dy[jnp.array(rows)])
  for options in (dict(top_n="auto"), dict(top_n=2), dict(top_n=2, overflow="drop"),
                  dict(top_n=6, threshold=0.1)):
    grads = _backward(x, kernel, listed_only, active_rows=index, **options)
    kept = rows
    if options.get("overflow") == "drop":
      norms = np.linalg.norm(np.asarray(dy)[rows], axis=1)
      kept = sorted(np.asarray(rows)[np.argsort(-norms, kind="stable")[:2]])
    _assert_grads_of_rows(grads, x, kernel, listed_only, kept)
    _, dkernel, dbias = _backward(x, kernel, listed_only.at[5, 3].set(0.5), active_rows=index,
                                  **options)
    assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))
  # Below the threshold, a row left out is noise, as any inactive row.
  grads = _backward(x, kernel, listed_only.at[5, 3].set(0.05), active_rows=index, top_n=6,
                    threshold=0.1)
  _assert_grads_of_rows(grads, x, kernel, listed_only, rows)


@pytest.mark.parametrize("backend", ["xla", "pallas", "dense"])
@pytest.mark.parametrize("top_n", ["auto", 12])
def test_nan_outside_a_given_index_poisons_dkernel_and_dbias(backend, top_n):
  x, kernel, dy = _problem(6)
  index = jnp.asarray(np.flatnonzero(np.any(np.asarray(dy) != 0, axis=1)), jnp.int32)
  skipped = int(np.setdiff1d(np.arange(NUM_ROWS), np.asarray(index))[0])
  grads = _backward(x, kernel, dy, top_n=top_n, active_rows=index, backend=backend)
  _assert_grads_of_rows(grads, x, kernel, dy, np.asarray(index))
  _, dkernel, dbias = _backward(x, kernel, dy.at[skipped, 0].set(jnp.inf), top_n=top_n,
                                active_rows=index, backend=backend)
  assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))


@pytest.mark.parametrize("index_given", [False, True])
@pytest.mark.parametrize("whole_row", [True, False])
def test_a_nan_row_is_not_finite_where_xla_cpus_max_drops_nan(index_given, whole_row):
  """Under jit, XLA:CPU's vectorized max drops NaN in rows of 512 features and more
  (openxla/xla#21461): a padding row all NaN (a loss made NaN on purpose) was read as a zero
  row, skipped, and every gradient came back finite."""
  x, kernel, dy = _problem(10, num_nonzero=20, num_rows=128, out_features=512)
  index = jnp.asarray(np.flatnonzero(np.any(np.asarray(dy) != 0, axis=1)), jnp.int32)
  padding = int(np.setdiff1d(np.arange(128), np.asarray(index))[0])
  dy = dy.at[padding].set(jnp.nan) if whole_row else dy.at[padding, 300].set(jnp.nan)
  assert not np.isfinite(np.asarray(jax.jit(row_max_abs)(dy))[padding])
  dx, dkernel, dbias = _backward(x, kernel, dy, top_n="auto",
                                 active_rows=index if index_given else None)
  if index_given:  # A non-finite row outside the index poisons dW and db whole.
    assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))
  else:  # The row is kept: NaN where jax.grad's gradients are.
    want = jax.vjp(lambda x, kernel: x @ kernel, x, kernel)[1](dy)
    for got, expected in zip((dx, dkernel), want):
      np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    assert np.isnan(np.asarray(dx)[padding]).all() and np.isnan(dbias).any()


@pytest.mark.parametrize("options, kept, capacity", [
    (dict(top_n="auto"), 20, 32), (dict(top_n=10), 20, NUM_ROWS),
    (dict(top_n=10, overflow="drop"), 10, 10), (dict(top_n=10, overflow="nan"), 10, 10)])
def test_the_row_log_reports_what_the_backward_did(options, kept, capacity):
  x, kernel, dy = _problem(7, num_nonzero=20)
  log = RowLog()
  _backward(x, kernel, dy, row_log=log.for_layer("dense"), **options)
  (record,) = log.records
  norms = np.sum(np.asarray(dy, np.float64) ** 2, axis=1)
  active_rows = reference_active_rows(dy, NUM_ROWS)
  # "nan" keeps the first rows (its gradients are NaN anyway), "drop" the largest.
  kept_rows = active_rows[:kept] if options.get("overflow") == "nan" else reference_active_rows(
      dy, kept)
  dropped = 1 - norms[kept_rows].sum() / norms.sum()
  assert record["layer"] == "dense" and record["step"] == 0 and record["rows"] == NUM_ROWS
  assert (record["active"], record["kept"], record["capacity"]) == (20, kept, capacity)
  np.testing.assert_allclose(record["dropped_share"], dropped, atol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_the_row_log_reports_a_nan_share_where_dy_is_not_finite(bad):
  x, kernel, dy = _problem(8, num_nonzero=20)
  log = RowLog()
  _backward(x, kernel, dy.at[3, 1].set(bad), top_n=10, overflow="drop",
            row_log=log.for_layer("dense"))
  (record,) = log.records
  assert np.isnan(record["dropped_share"])
  assert "nan" in log.summary()


def test_the_row_log_summary_shows_a_layers_largest_row_count():
  """A layer run on batches of several lengths (a capacity ladder, the last batch of an
  epoch) reads with its largest T, whichever step logged it."""
  log = RowLog()
  for rows in (64, 512, 32):
    log.append("dense", active=rows // 2, kept=rows // 2, capacity=rows, dropped_share=0.0,
               rows=rows, row_max_abs=None, row_squared_norm=None)
  header, line = log.summary().splitlines()
  assert line.split()[:3] == ["dense", "3", "512"]
  assert header.split()[:3] == ["layer", "steps", "rows"]


def test_no_rows_at_all():
  for top_n in ("auto", 4):
    dx, dkernel, dbias = linear_backward(jnp.ones((0, 3)), jnp.ones((3, 2)), jnp.ones((0, 2)),
                                         top_n=top_n, with_bias=True)
    assert dx.shape == (0, 3) and not np.any(dkernel) and not np.any(dbias)


@pytest.mark.parametrize("options", [dict(top_n="auto"), dict(top_n=8),
                                     dict(top_n=8, overflow="drop"), dict(top_n=12,
                                                                          threshold=0.5)])
def test_embedding_backward_scatters_the_kept_rows(options):
  rng = np.random.default_rng(8)
  ids = jnp.asarray(rng.integers(0, 7, 30), jnp.int8)
  dy = jnp.asarray(random_sparse_rows(rng, 30, 4, 12), jnp.bfloat16)
  d_table = _table_gradient(ids, dy, num_embeddings=7, **options)
  assert d_table.dtype == jnp.float32 and d_table.shape == (7, 4)
  top_n = 8 if options.get("overflow") == "drop" else 30
  rows = reference_active_rows(dy, top_n, options.get("threshold", 0.0))
  np.testing.assert_allclose(d_table, reference_table_grad(7, np.asarray(ids), dy, rows),
                             rtol=1e-6, atol=1e-6)


def test_embedding_backward_with_an_index():
  rng = np.random.default_rng(9)
  ids = jnp.asarray(rng.integers(0, 7, 30), jnp.int32)
  dy = jnp.asarray(random_sparse_rows(rng, 30, 4, 30)).at[2:].set(0)
  index = jnp.array([0, 1, 30], jnp.int32)
  d_table = _table_gradient(ids, dy, num_embeddings=7, top_n=3, active_rows=index)
  np.testing.assert_allclose(d_table, reference_table_grad(7, np.asarray(ids), dy, [0, 1]),
                             rtol=1e-6, atol=1e-6)
  for unlisted in (jnp.nan, 0.25):  # Not finite, or not zero: the index's promise broken.
    poisoned = _table_gradient(ids, dy.at[20, 0].set(unlisted), num_embeddings=7, top_n=3,
                               active_rows=index)
    assert np.all(np.isnan(poisoned))
  overflowed = _table_gradient(ids, dy, num_embeddings=7, top_n=1, overflow="nan",
                                  active_rows=index)
  assert np.all(np.isnan(overflowed))


def test_empty_batches_with_an_index():
  index = jnp.zeros((2,), jnp.int32)  # every slot the sentinel T = 0
  dx, dkernel, _ = linear_backward(jnp.ones((0, 3)), jnp.ones((3, 2)), jnp.ones((0, 2)),
                                   top_n=2, active_rows=index, with_bias=True)
  assert dx.shape == (0, 3) and not np.any(dkernel)
  d_table = _table_gradient(jnp.zeros((0,), jnp.int32), jnp.ones((0, 2)), num_embeddings=4,
                               top_n=2, active_rows=index)
  assert d_table.shape == (4, 2) and not np.any(d_table)
