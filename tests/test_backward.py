"""The backward entry point: which rows it keeps, the NaN check of a given index, and the
gradients it returns through each implementation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sebp_jax import select_active_rows
from sebp_jax.backward import embedding_backward, kept_rows, linear_backward, nan_if_not_finite
from tests.reference import (random_sparse_rows, reference_active_rows, reference_backward,
                             reference_table_grad, relative_error)


def _problem(seed, num_rows=40, in_features=16, out_features=24, num_nonzero=9):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((num_rows, in_features)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((in_features, out_features)), jnp.float32)
  dy = jnp.asarray(random_sparse_rows(rng, num_rows, out_features, num_nonzero))
  return x, kernel, dy


def test_nan_if_not_finite():
  assert nan_if_not_finite(jnp.ones((3, 4))) == 0
  assert np.isnan(nan_if_not_finite(jnp.ones((3, 4)).at[2, 1].set(jnp.inf)))
  assert np.isnan(nan_if_not_finite(jnp.ones((3, 4)).at[0, 3].set(-jnp.nan)))
  if jax.config.jax_enable_x64:
    assert nan_if_not_finite(jnp.full((2, 2), 1e300, jnp.float64)) == 0


def test_kept_rows_selected_from_dy_need_no_check():
  _, _, dy = _problem(0)
  rows, poison = kept_rows(dy, top_n=12, threshold=0.0, active_rows=None)
  assert poison is None
  np.testing.assert_array_equal(rows, select_active_rows(dy, 12))


def test_a_given_index_is_used_as_is_and_checked():
  _, _, dy = _problem(1)
  given = jnp.array([0, 5, 40], jnp.int32)
  rows, poison = kept_rows(dy, top_n=3, threshold=0.0, active_rows=given)
  np.testing.assert_array_equal(rows, given)
  assert poison == 0
  _, poison = kept_rows(dy.at[7, 2].set(jnp.nan), top_n=3, threshold=0.0, active_rows=given)
  assert np.isnan(poison)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_selected_rows_match_the_float64_reference(backend):
  x, kernel, dy = _problem(2, num_nonzero=15)
  dx, dkernel, dbias = jax.jit(lambda *a: linear_backward(
      *a, top_n=10, backend=backend, with_bias=True))(x, kernel, dy)
  rows = reference_active_rows(dy, 10)
  for got, want in zip((dx, dkernel, dbias), reference_backward(x, kernel, dy, rows)):
    assert relative_error(got, want) <= 1e-5


def test_dense_keeps_every_row():
  x, kernel, dy = _problem(3, num_nonzero=30)
  grads = linear_backward(x, kernel, dy, top_n=10, backend="dense", with_bias=True)
  for got, want in zip(grads, reference_backward(x, kernel, dy, np.arange(40))):
    assert relative_error(got, want) <= 1e-5


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_nan_outside_a_given_index_poisons_dkernel_and_dbias(backend):
  x, kernel, dy = _problem(4)
  index = select_active_rows(dy, 12)
  skipped = int(np.setdiff1d(np.arange(40), np.asarray(index))[0])
  run = jax.jit(lambda dy: linear_backward(x, kernel, dy, top_n=12, active_rows=index,
                                           backend=backend, with_bias=True))
  dx, dkernel, dbias = run(dy)
  rows = np.asarray(index)[np.asarray(index) < 40]
  for got, want in zip((dx, dkernel, dbias), reference_backward(x, kernel, dy, rows)):
    assert relative_error(got, want) <= 1e-5
  _, dkernel, dbias = run(dy.at[skipped, 0].set(jnp.inf))
  assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))


def test_no_rows_at_all():
  dx, dkernel, dbias = linear_backward(jnp.ones((0, 3)), jnp.ones((3, 2)), jnp.ones((0, 2)),
                                       top_n=4, with_bias=True)
  assert dx.shape == (0, 3) and not np.any(dkernel) and not np.any(dbias)


def test_embedding_backward_scatters_the_kept_rows():
  rng = np.random.default_rng(5)
  ids = jnp.asarray(rng.integers(0, 7, 30), jnp.int8)
  dy = jnp.asarray(random_sparse_rows(rng, 30, 4, 12), jnp.bfloat16)
  d_table = embedding_backward(ids, dy, num_embeddings=7, top_n=8)
  assert d_table.dtype == jnp.float32 and d_table.shape == (7, 4)
  expected = reference_table_grad(7, np.asarray(ids), dy, reference_active_rows(dy, 8))
  np.testing.assert_allclose(d_table, expected, rtol=1e-6, atol=1e-6)
  # A given index skips scoring; a NaN in a row it skips fills the whole table gradient.
  index = jnp.array([0, 1, 30], jnp.int32)
  assert not np.any(np.isnan(embedding_backward(ids, dy, num_embeddings=7, top_n=3,
                                                active_rows=index)))
  poisoned = embedding_backward(ids, dy.at[20, 0].set(jnp.nan), num_embeddings=7, top_n=3,
                                active_rows=index)
  assert np.all(np.isnan(poisoned))


def test_empty_batches_with_an_index():
  index = jnp.zeros((2,), jnp.int32)  # every slot the sentinel T = 0
  dx, dkernel, _ = linear_backward(jnp.ones((0, 3)), jnp.ones((3, 2)), jnp.ones((0, 2)),
                                   top_n=2, active_rows=index, with_bias=True)
  assert dx.shape == (0, 3) and not np.any(dkernel)
  d_table = embedding_backward(jnp.zeros((0,), jnp.int32), jnp.ones((0, 2)), num_embeddings=4,
                               top_n=2, active_rows=index)
  assert d_table.shape == (4, 2) and not np.any(d_table)
