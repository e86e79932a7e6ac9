"""The SEBP embedding lookup and `SEBPEmbed`, against jax.grad and a float64 numpy reference."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sebp_jax import SEBPEmbed, active_rows_from_mask, sebp_embed_lookup
from tests.reference import (random_sparse_rows, reference_active_rows, reference_table_grad,
                             reference_take_grad)


def _problem(rng, shape=(3, 8), vocab=11, features=5, num_nonzero=7, dtype=np.float32):
  # Few ids for many rows: repeated ids must add up, as padding ids do in a real batch.
  ids = rng.integers(0, vocab, size=shape).astype(np.int32)
  table = rng.standard_normal((vocab, features)).astype(dtype)
  dy = random_sparse_rows(rng, ids.size, features, num_nonzero, dtype)
  return table, ids, dy


def _table_grad(table, ids, dy, **kwargs):
  loss = lambda t: jnp.sum(sebp_embed_lookup(t, ids, **kwargs) * dy.reshape(ids.shape + (-1,)))
  return jax.jit(jax.grad(loss))(table)


@pytest.mark.parametrize("shape", [(24,), (3, 8), (2, 3, 5)])
@pytest.mark.parametrize("top_n", [3, 7, 30, "auto"])
@pytest.mark.parametrize("overflow", ["exact", "drop"])
def test_gradient_equals_reference(shape, top_n, overflow):
  rng = np.random.default_rng(len(shape))
  table, ids, dy = _problem(rng, shape)
  got = _table_grad(table, ids, dy, top_n=top_n, overflow=overflow, threshold=1e-9)
  dropping = overflow == "drop" and top_n != "auto"
  rows = reference_active_rows(dy, top_n if dropping else len(dy))
  np.testing.assert_allclose(got, reference_table_grad(11, ids.reshape(-1), dy, rows),
                             rtol=1e-6, atol=1e-6)
  if not dropping or top_n >= 7:  # Every non-zero row kept: the dense gradient, exactly.
    want = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0) * dy.reshape(ids.shape + (-1,))))(
        table)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype,tolerance", [
    (jnp.float32, 1e-6), (jnp.bfloat16, 1e-2), (jnp.float16, 1e-3)])
def test_forward_is_the_take_and_dtypes_are_kept(dtype, tolerance):
  rng = np.random.default_rng(1)
  table, ids, dy = _problem(rng)
  # A negative and an out-of-range id on rows that carry gradient: both behave as in jnp.take
  # (the first wraps around, the second reads NaN and gets no gradient).
  nonzero_rows = np.flatnonzero(dy.any(axis=1))
  ids.reshape(-1)[nonzero_rows[:2]] = (-2, 11)
  table, dy = jnp.asarray(table, dtype), jnp.asarray(dy, dtype)
  got = sebp_embed_lookup(table, ids, top_n=4)
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(jnp.take(table, ids, axis=0), np.float32))
  d_table = _table_grad(table, ids, dy, top_n=7)
  assert d_table.dtype == dtype
  want = jax.grad(lambda t: jnp.sum(jnp.take(t, ids, axis=0).astype(jnp.float32)
                                    * dy.reshape(ids.shape + (-1,))))(table)
  np.testing.assert_allclose(np.asarray(d_table, np.float32), np.asarray(want, np.float32),
                             rtol=tolerance, atol=tolerance)
  assert np.any(np.asarray(d_table[9], np.float32))  # id -2's row did receive its gradient


@pytest.mark.parametrize("id_dtype", [jnp.int8, jnp.uint8, jnp.int32])
def test_narrow_id_dtypes_with_a_large_table(id_dtype):
  # The sentinel id (V = 300) does not fit int8 / uint8; it must neither overflow nor wrap.
  rng = np.random.default_rng(6)
  table = rng.standard_normal((300, 4)).astype(np.float32)
  ids = jnp.asarray(rng.integers(0, 100, size=(12,)), id_dtype)
  dy = random_sparse_rows(rng, 12, 4, 5)
  got = _table_grad(table, ids, dy, top_n=8)  # 3 sentinel slots
  want = reference_table_grad(300, np.asarray(ids, np.int64), dy, np.flatnonzero(dy.any(1)))
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def _ids_at_the_limits(dtype, num_embeddings, rng):
  """Ids of ``dtype``, in range and out of it on both sides, its extremes included."""
  limits = np.iinfo(dtype)
  candidates = [0, 1, num_embeddings - 1, num_embeddings, -1, -num_embeddings,
                -num_embeddings - 1, limits.min, limits.max, limits.max - 5, 2**31, 2**32 - 1]
  chosen = [c for c in candidates if limits.min <= c <= limits.max]
  chosen += [int(i) for i in rng.integers(0, min(num_embeddings, limits.max + 1),
                                          size=24 - len(chosen))]
  return np.asarray(chosen, dtype)


@pytest.mark.parametrize("id_dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32,
                                      np.uint32, np.int64, np.uint64])
@pytest.mark.parametrize("options", [{"threshold": 1e-3},
                                     {"active_rows": active_rows_from_mask(np.ones(24), 24)}],
                         ids=["threshold", "index"])
def test_ids_of_any_integer_dtype_get_the_gradient_of_take(id_dtype, options):
  """Ids at their dtype's extremes get the gradient of ``jnp.take`` (the forward), in float64
  numpy: an id out of range none, none wrapped into a row by a cast (a uint32 id of 2**31 or
  more to int32), the table's size not wrapped in a narrow dtype's comparison (uint8 ids of a
  300-row table), and a negative id's row as take reads it (int8 ids of a 300-row table)."""
  rng = np.random.default_rng(np.dtype(id_dtype).itemsize)
  with jax.enable_x64(np.dtype(id_dtype).itemsize == 8):
    for num_embeddings in (100, 300):
      ids = jnp.asarray(_ids_at_the_limits(id_dtype, num_embeddings, rng))
      table = jnp.asarray(rng.standard_normal((num_embeddings, 3)), jnp.float32)
      dy = rng.standard_normal((ids.size, 3)).astype(np.float32)
      got = _table_grad(table, ids, dy, **options)
      want = reference_take_grad(num_embeddings, ids, dy)
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_shared_index_and_nan_in_a_skipped_row():
  rng = np.random.default_rng(2)
  table, ids, dy = _problem(rng, shape=(4, 6))
  mask = dy.any(axis=1).reshape(ids.shape)
  active_rows = active_rows_from_mask(mask, 7)
  got = _table_grad(table, ids, dy, top_n=7, active_rows=active_rows)
  np.testing.assert_allclose(got, reference_table_grad(11, ids.reshape(-1), dy,
                                                       np.flatnonzero(mask)), rtol=1e-6)
  skipped = int(np.flatnonzero(~mask.reshape(-1))[0])
  for bad in (np.nan, np.inf, -np.inf):
    dy[skipped, 3] = bad
    assert np.isnan(_table_grad(table, ids, dy, top_n=7, active_rows=active_rows)).all(), bad


def test_nan_in_a_padding_row_is_selected_and_visible():
  rng = np.random.default_rng(3)
  table, ids, dy = _problem(rng, shape=(20,))
  padding_row = int(np.flatnonzero(~dy.any(axis=1))[0])
  dy[padding_row, 1] = np.inf
  got = np.asarray(_table_grad(table, ids, dy, top_n=7))
  assert np.isinf(got[ids[padding_row], 1])


def test_top_n_covering_every_row_is_the_dense_backward():
  rng = np.random.default_rng(4)
  table, ids, dy = _problem(rng, shape=(10,), num_nonzero=10)
  got = _table_grad(table, ids, dy, top_n=10)
  np.testing.assert_allclose(got, reference_table_grad(11, ids, dy, np.arange(10)), rtol=1e-6)


def test_bad_arguments_name_what_was_expected():
  table, ids = jnp.ones((5, 3)), jnp.zeros((4,), jnp.int32)
  with pytest.raises(ValueError, match="ids must be integer"):
    sebp_embed_lookup(table, ids.astype(jnp.float32), top_n=2)
  with pytest.raises(ValueError, match="table must be 2-D"):
    sebp_embed_lookup(jnp.ones((5,)), ids, top_n=2)
  with pytest.raises(ValueError, match="active_rows must be a non-empty 1-D integer array"):
    sebp_embed_lookup(table, ids, top_n=2, active_rows=jnp.zeros((3, 1), jnp.int32))
  with pytest.raises(ValueError, match="overflow must be one of"):
    sebp_embed_lookup(table, ids, overflow="clip")
  with pytest.raises(ValueError, match="top_n"):
    sebp_embed_lookup(table, ids, top_n=0)
  with pytest.raises(ValueError, match="integer token ids"):
    SEBPEmbed(5, 3, top_n=2).init(jax.random.key(0), jnp.ones((4,)))


def test_float32_table_computed_in_bf16_gets_its_gradient_rounded_once():
  rng = np.random.default_rng(6)
  table, ids, dy = _problem(rng, shape=(4, 6))
  dy = jnp.asarray(dy, jnp.bfloat16)
  lookup = lambda t: sebp_embed_lookup(t, ids, top_n=12, dtype=jnp.bfloat16)
  y, vjp = jax.vjp(lookup, jnp.asarray(table))
  np.testing.assert_array_equal(y, jnp.take(jnp.asarray(table, jnp.bfloat16), ids, axis=0))
  (d_table,) = vjp(dy.reshape(y.shape))
  assert d_table.dtype == jnp.float32
  want = reference_table_grad(11, ids.reshape(-1), dy, np.flatnonzero(np.asarray(
      dy, np.float32).any(axis=1)))
  np.testing.assert_allclose(d_table, want, rtol=1e-6, atol=1e-7)


def test_sebp_embed_is_a_drop_in_for_nn_embed():
  embed_fields = {f.name: f.default for f in dataclasses.fields(nn.Embed)}
  sebp_fields = {f.name: f.default for f in dataclasses.fields(SEBPEmbed)}
  assert {k: sebp_fields[k] for k in embed_fields} == embed_fields
  rng = np.random.default_rng(5)
  ids = jnp.asarray(rng.integers(0, 13, size=(2, 9)), jnp.int32)
  dense, sebp = nn.Embed(13, 6, dtype=jnp.bfloat16), SEBPEmbed(13, 6, dtype=jnp.bfloat16, top_n=0.5)
  params = dense.init(jax.random.key(0), ids)
  np.testing.assert_array_equal(np.asarray(sebp.apply(params, ids), np.float32),
                                np.asarray(dense.apply(params, ids), np.float32))
  dy = random_sparse_rows(rng, 18, 6, 9).reshape(2, 9, 6)
  grad = lambda m: jax.grad(lambda p: jnp.sum(m.apply(p, ids).astype(jnp.float32) * dy))(params)
  np.testing.assert_allclose(grad(sebp)["params"]["embedding"],
                             grad(dense)["params"]["embedding"], rtol=1e-2, atol=1e-2)
  single = SEBPEmbed(1, 4, top_n=2)  # nn.Embed broadcasts a one-row table.
  np.testing.assert_array_equal(single.apply(single.init(jax.random.key(1), ids), ids).shape,
                                (2, 9, 4))
