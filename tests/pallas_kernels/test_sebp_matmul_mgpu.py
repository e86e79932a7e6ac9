"""Tests of the count-following Mosaic GPU SEBP backward against a float64 numpy reference.

On CPU both of its backends run interpreted (Triton's and Mosaic GPU's interpreters); on a
Hopper GPU (or INTERPRET=0 there) the same tests run compiled.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sebp_matmul_mgpu import MatmulTiles
from pallas_kernels.sebp_matmul_mgpu import MosaicBlockSizes
from pallas_kernels.sebp_matmul_mgpu import kept_rows_backward
from pallas_kernels.sebp_matmul_mgpu import kept_rows_backward_reference
from pallas_kernels.sebp_matmul_mgpu import supports_shapes

INTERPRET = os.environ.get(
    "INTERPRET", "1" if jax.default_backend() == "cpu" else "0") != "0"
TOLERANCE = {jnp.bfloat16: 1e-2, jnp.float16: 2e-3}

# The smallest tiles, so that a few hundred rows span several copy blocks, row tiles and
# reduction steps.
SMALL_TILES = MatmulTiles(block_m=64, block_n=64, block_k=64, max_concurrent_steps=2)
SMALL = MosaicBlockSizes(copy_rows=128, dx=SMALL_TILES, dw=SMALL_TILES)
SPLIT = MosaicBlockSizes(copy_rows=128, dx=SMALL_TILES,
                         dw=MatmulTiles(block_m=64, block_n=64, block_k=64,
                                        max_concurrent_steps=2, split_k=3))


def _f64(a):
  return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def _relative_error(actual, expected):
  return np.linalg.norm(_f64(actual) - expected) / max(np.linalg.norm(expected), 1e-30)


def _inputs(seed, num_rows, d, n, dtype):
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape), dtype)
               for shape in ((num_rows, d), (d, n), (num_rows, n))), rng


def _index(rng, num_rows, num_slots, count):
  rows = np.sort(rng.choice(num_rows, count, replace=False))
  return jnp.asarray(np.concatenate([rows, np.full(num_slots - count, num_rows)]),
                     jnp.int32), rows


# (T, slots, listed rows, blocks, dtype): counts 0, 1, one below / at / above a block edge,
# every row, an index shorter than T and not a whole copy block, and a split reduction; float16
# on two of them (each interpreted case costs seconds).
CASES = [
    *(pytest.param(300, 300, count, SMALL, jnp.bfloat16, id=f"count-{count}")
      for count in (0, 1, 63, 128, 129)),
    pytest.param(300, 300, 300, SMALL, jnp.bfloat16, id="every-row"),
    pytest.param(300, 200, 150, SMALL, jnp.bfloat16, id="short-index"),
    pytest.param(300, 300, 200, SPLIT, jnp.bfloat16, id="split-k"),
    pytest.param(300, 300, 129, SMALL, jnp.float16, id="count-129-float16"),
    pytest.param(300, 300, 200, SPLIT, jnp.float16, id="split-k-float16"),
]


@pytest.mark.parametrize("num_rows,num_slots,count,blocks,dtype", CASES)
def test_kept_rows_backward_matches_float64(num_rows, num_slots, count, blocks, dtype):
  d, n = 128, 192
  (x, kernel, dy), rng = _inputs([num_rows, count, blocks.dw.split_k], num_rows, d, n, dtype)
  active_rows, rows = _index(rng, num_rows, num_slots, count)

  dx_kept, dw, db = kept_rows_backward(
      x, kernel, dy, active_rows, with_bias=True, dw_dtype=jnp.float32,
      db_dtype=jnp.float32, block_sizes=blocks, interpret=INTERPRET)

  assert dx_kept.shape[0] >= num_slots and dx_kept.shape[1] == d and dx_kept.dtype == dtype
  assert dw.dtype == db.dtype == jnp.float32
  x64, kernel64, dy64 = _f64(x)[rows], _f64(kernel), _f64(dy)[rows]
  if count:
    assert _relative_error(dx_kept[:count], dy64 @ kernel64.T) < TOLERANCE[dtype]
    assert _relative_error(dw, x64.T @ dy64) < 1e-5
    assert _relative_error(db, dy64.sum(axis=0)) < 1e-5
  else:
    assert np.all(_f64(dw) == 0) and np.all(_f64(db) == 0)


def test_reference_agrees_with_float64():
  """The jnp reference used elsewhere is the same function as the float64 sums."""
  (x, kernel, dy), rng = _inputs(3, 100, 128, 64, jnp.bfloat16)
  active_rows, rows = _index(rng, 100, 64, 40)
  dx, dw, db = kept_rows_backward_reference(x, kernel, dy, active_rows, with_bias=True)
  assert _relative_error(dx[:40], _f64(dy)[rows] @ _f64(kernel).T) < 1e-5
  assert np.all(_f64(dx[40:]) == 0)
  assert _relative_error(dw, _f64(x)[rows].T @ _f64(dy)[rows]) < 1e-5
  assert _relative_error(db, _f64(dy)[rows].sum(axis=0)) < 1e-5


def test_inf_in_a_listed_row_stays_visible():
  (x, kernel, dy), rng = _inputs(5, 200, 128, 128, jnp.bfloat16)
  active_rows, rows = _index(rng, 200, 200, 90)
  dy = dy.at[rows[17], 3].set(jnp.inf)
  dx_kept, dw, db = kept_rows_backward(x, kernel, dy, active_rows, with_bias=True,
                                       block_sizes=SMALL, interpret=INTERPRET)
  assert not np.all(np.isfinite(_f64(dx_kept[17])))
  assert not np.all(np.isfinite(_f64(dw[:, 3]))) and np.isinf(_f64(db[3]))


def test_without_bias_returns_no_db():
  (x, kernel, dy), rng = _inputs(6, 130, 64, 128, jnp.bfloat16)
  active_rows, rows = _index(rng, 130, 130, 40)
  _, dw, db = kept_rows_backward(x, kernel, dy, active_rows, with_bias=False,
                                 block_sizes=SMALL, interpret=INTERPRET)
  assert db is None
  assert _relative_error(dw, _f64(x)[rows].T @ _f64(dy)[rows]) < 1e-2


def test_rejects_what_the_kernels_cannot_take():
  x = jnp.zeros((64, 96), jnp.bfloat16)
  with pytest.raises(ValueError, match="16-bit dtype"):
    kept_rows_backward(x, jnp.zeros((96, 128), jnp.bfloat16),
                       jnp.zeros((64, 128), jnp.bfloat16), jnp.arange(8, dtype=jnp.int32),
                       with_bias=False, interpret=True)
  with pytest.raises(ValueError, match="linear layer"):
    kept_rows_backward(jnp.zeros((64, 128), jnp.bfloat16), jnp.zeros((128, 64), jnp.bfloat16),
                       jnp.zeros((64, 128), jnp.bfloat16), jnp.arange(8, dtype=jnp.int32),
                       with_bias=False, interpret=True)
  assert not supports_shapes(128, 128, jnp.float32)
  assert not supports_shapes(0, 128, jnp.bfloat16) and not supports_shapes(128, 0, jnp.bfloat16)
  assert supports_shapes(768, 3072, jnp.bfloat16)
  with pytest.raises(ValueError, match="active_rows must be a 1-D integer index"):
    square = jnp.zeros((128, 128), jnp.bfloat16)
    kept_rows_backward(square[:64], square, square[:64], jnp.arange(8, dtype=jnp.float32),
                       with_bias=False, interpret=True)
  with pytest.raises(ValueError, match="copy_rows"):
    MosaicBlockSizes(copy_rows=64, dx=MatmulTiles(block_m=128))
  with pytest.raises(ValueError, match="dx.split_k"):
    MosaicBlockSizes(dx=MatmulTiles(split_k=2))
  with pytest.raises(ValueError, match="max_concurrent_steps"):
    MatmulTiles(max_concurrent_steps=1)
  with pytest.raises(ValueError, match="block_k"):
    MatmulTiles(block_k=96)


def test_default_tiles_split_dw_where_its_tiles_are_too_few():
  from pallas_kernels.sebp_matmul_mgpu import MAX_SPLIT_K, default_block_sizes
  assert default_block_sizes(768, 768, 132).dw.split_k == 3  # 36 tiles
  assert default_block_sizes(256, 256, 132).dw.split_k == MAX_SPLIT_K
  assert default_block_sizes(768, 3072, 132).dw.split_k == 1  # 144 tiles
  assert default_block_sizes(768, 768, 132).dx == MosaicBlockSizes().dx
