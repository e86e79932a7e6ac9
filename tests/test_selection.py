"""Row selection against the float64 numpy rule in tests/reference.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sebp_jax import active_rows_from_mask, row_scores, sebp_linear, select_active_rows
from tests.reference import random_sparse_rows, reference_active_rows


def _kept(active_rows, num_rows):
  active_rows = np.asarray(active_rows)
  return active_rows[active_rows < num_rows]


@pytest.mark.parametrize("num_nonzero,top_n", [(5, 8), (8, 8), (20, 8), (0, 4), (37, 40)])
def test_matches_reference_rule(num_nonzero, top_n):
  rng = np.random.default_rng(num_nonzero * 100 + top_n)
  dy = random_sparse_rows(rng, 37, 12, num_nonzero)
  active_rows = jax.jit(select_active_rows, static_argnums=1)(jnp.asarray(dy), top_n)
  assert active_rows.shape == (top_n,) and active_rows.dtype == jnp.int32
  np.testing.assert_array_equal(_kept(active_rows, 37), reference_active_rows(dy, top_n))
  # Sorted, and every unused slot holds the out-of-range sentinel T (never a valid row).
  assert np.all(np.diff(np.asarray(active_rows)) >= 0)
  num_kept = min(num_nonzero, top_n)
  np.testing.assert_array_equal(np.asarray(active_rows)[num_kept:], 37)


def test_threshold_counts_small_rows_as_zero():
  rng = np.random.default_rng(1)
  dy = rng.standard_normal((16, 8)).astype(np.float32)
  dy[::2] *= 1e-6  # noise rows, below the threshold
  active_rows = select_active_rows(jnp.asarray(dy), 16, threshold=1e-3)
  np.testing.assert_array_equal(_kept(active_rows, 16), np.arange(1, 16, 2))
  np.testing.assert_array_equal(_kept(active_rows, 16),
                                reference_active_rows(dy, 16, threshold=1e-3))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
def test_a_row_just_above_the_threshold_is_active_in_every_dtype(dtype):
  """The threshold is a Python float; rounded to the nearest float32 it can land on a row's
  value above it (0.1 rounds up to 0.10000000149), which a plain comparison calls inactive."""
  rng = np.random.default_rng(3)
  threshold = float(rng.uniform(0.05, 0.5))
  # The dtype's smallest value above the threshold, and the one before it.
  at = jnp.asarray(threshold, dtype)
  above = at if float(at) > threshold else jnp.nextafter(at, jnp.asarray(1, dtype))
  below = jnp.nextafter(above, jnp.asarray(0, dtype))
  dy = jnp.zeros((4, 3), dtype).at[0, 1].set(above).at[2, 0].set(below).at[3, 2].set(-above)
  expected = [i for i in range(4) if float(jnp.max(jnp.abs(dy[i].astype(jnp.float32))))
              > threshold]
  active_rows = select_active_rows(dy, 4, threshold=threshold)
  np.testing.assert_array_equal(_kept(active_rows, 4), expected)
  assert expected[0] == 0 and expected[-1] == 3
  for value in (0.1, 0.3, 1 / 3):
    rows = jnp.asarray([[np.float32(value)], [np.float32(0)]])
    assert list(_kept(select_active_rows(rows, 2, threshold=value), 2)) == (
        [0] if float(np.float32(value)) > value else [])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_rows_are_active_and_rank_first(bad):
  rng = np.random.default_rng(2)
  dy = random_sparse_rows(rng, 32, 8, 20)
  zero_row = int(np.flatnonzero(~dy.any(axis=1))[0])
  dy[zero_row, 3] = bad  # a "padding" row that carries a broken gradient
  active_rows = select_active_rows(jnp.asarray(dy), 4)
  assert zero_row in _kept(active_rows, 32)
  np.testing.assert_array_equal(_kept(active_rows, 32), reference_active_rows(dy, 4))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_row_ranks_above_a_finite_row_whose_squares_overflow(dtype, bad):
  """Rows of 1e20 square past float32's range: they rank after a NaN or Inf row, which
  "drop" keeps (its gradients not finite), not dropped on a tie in row order."""
  dy = np.zeros((16, 4), np.float32)
  dy[0], dy[1], dy[5, 2], dy[7] = 1e20, 3e20, bad, 1.0
  dy = jnp.asarray(dy, dtype)
  np.testing.assert_array_equal(select_active_rows(dy, 1), [5])
  np.testing.assert_array_equal(select_active_rows(dy, 3), [0, 1, 5])
  x, kernel = jnp.ones((16, 3), dtype), jnp.ones((3, 4), dtype)
  grads = jax.vjp(lambda x, kernel: sebp_linear(x, kernel, top_n=1, overflow="drop"),
                  x, kernel)[1](dy)
  assert all(not np.isfinite(np.asarray(g, np.float32)).all() for g in grads)


def test_scores():
  dy = jnp.array([[3.0, 4.0], [0.0, 0.0], [jnp.nan, 0.0], [0.0, 1e-4]])
  scores, active = row_scores(dy, threshold=1e-3)
  np.testing.assert_array_equal(active, [True, False, True, False])
  np.testing.assert_allclose(scores, [25.0, -1.0, np.inf, -1.0])


def test_ties_go_to_the_lower_index():
  dy = jnp.ones((10, 4))
  np.testing.assert_array_equal(select_active_rows(dy, 3), [0, 1, 2])


@settings(max_examples=25, deadline=None)
@given(num_rows=st.integers(1, 48), width=st.integers(1, 9), data=st.data())
def test_property_matches_reference(num_rows, width, data):
  top_n = data.draw(st.integers(1, num_rows + 3), label="top_n")
  num_nonzero = data.draw(st.integers(0, num_rows), label="num_nonzero")
  seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
  dy = random_sparse_rows(np.random.default_rng(seed), num_rows, width, num_nonzero)
  active_rows = select_active_rows(jnp.asarray(dy), top_n)
  np.testing.assert_array_equal(_kept(active_rows, num_rows), reference_active_rows(dy, top_n))
  assert np.all(np.asarray(active_rows)[len(_kept(active_rows, num_rows)):] == num_rows)


def test_complex_rows_count_their_imaginary_parts():
  dy = jnp.asarray([[0, 0], [3j, 0], [0, 1 + 1j], [0, 0]], jnp.complex64)
  scores, active = row_scores(dy, 0.0)
  np.testing.assert_array_equal(active, [False, True, True, False])
  np.testing.assert_allclose(scores, [-1, 9, 2, -1], rtol=1e-6)
  np.testing.assert_array_equal(select_active_rows(dy, 1), [1])
  np.testing.assert_array_equal(reference_active_rows(dy, 1), [1])


def test_bad_arguments_raise_naming_them():
  """A NaN threshold would count every finite row inactive (an index of none, dW zero):
  the public selection checks its arguments as the ops do."""
  dy = jnp.ones((4, 3))
  for threshold in (np.nan, -1.0, True):
    with pytest.raises(ValueError, match="threshold must be a finite non-negative"):
      select_active_rows(dy, 2, threshold=threshold)
    with pytest.raises(ValueError, match="threshold must be a finite non-negative"):
      row_scores(dy, threshold)
  for top_n in (0, -1, 1.5, True):
    with pytest.raises(ValueError, match="top_n must be a positive Python int"):
      select_active_rows(dy, top_n)
  with pytest.raises(ValueError, match=r"dy must be \[rows, features\]"):
    select_active_rows(jnp.ones(4), 2)
  with pytest.raises(ValueError, match="top_n must be a non-negative Python int"):
    active_rows_from_mask(np.ones((2, 3)), -1)
  assert active_rows_from_mask(np.zeros((0, 3)), 0).shape == (0,)
