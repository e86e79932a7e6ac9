"""Every registered implementation of the linear backward against the float64 reference.

Written once for all implementations; the Pallas one runs interpreted on CPU and through
Triton on a GPU. "dense" keeps every row, so its reference keeps every row too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebp_jax
from sebp_jax import implementations, register_implementation, select_active_rows
from sebp_jax.implementations import (dense_backward, get_implementation, implementation_names,
                                      sum_rows)
from tests.reference import random_sparse_rows, reference_backward, relative_error

IMPLEMENTATIONS = ["dense", "xla", "pallas"]
SPARSE = ["xla", "pallas"]
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _run(name, x, kernel, dy, active_rows, with_bias=True, poison=None, dkernel_dtype=None):
  implementation = get_implementation(name)
  rows = active_rows if implementation.takes_index else None
  return jax.jit(lambda *a: implementation.backward(
      *a, with_bias=with_bias, precision=None, poison=poison, dkernel_dtype=dkernel_dtype))(
          x, kernel, dy, rows)


def _kept(name, active_rows, num_rows):
  """The rows an implementation keeps: the index's real entries, or every row for dense."""
  if not get_implementation(name).takes_index:
    return np.arange(num_rows)
  rows = np.asarray(active_rows)
  return rows[rows < num_rows]


def test_the_implementations_are_registered():
  assert set(IMPLEMENTATIONS) | {"pallas_triton", "pallas_mosaic"} <= set(implementation_names())
  assert not get_implementation("dense").takes_index
  assert get_implementation("xla").takes_index and get_implementation("pallas").takes_index
  assert all(get_implementation(name).follows_count
             for name in ("pallas", "pallas_triton", "pallas_mosaic"))
  with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
    get_implementation("cuda")


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("num_rows,in_features,out_features,num_nonzero,top_n", [
    (64, 32, 48, 10, 16),   # padded slots: fewer active rows than top_n
    (37, 50, 24, 30, 12),   # more active rows than top_n; odd sizes
    (40, 16, 16, 0, 8),     # no active row at all
    (20, 0, 16, 5, 8),      # no input features: dX and dW empty, db not
])
def test_matches_float64_reference(name, dtype, num_rows, in_features, out_features,
                                   num_nonzero, top_n):
  rng = np.random.default_rng(num_rows + top_n)
  x = rng.standard_normal((num_rows, in_features)).astype(np.float32)
  kernel = rng.standard_normal((in_features, out_features)).astype(np.float32)
  dy = random_sparse_rows(rng, num_rows, out_features, num_nonzero)
  x, kernel, dy = (jnp.asarray(a, dtype) for a in (x, kernel, dy))
  active_rows = select_active_rows(dy, top_n)
  dx, dkernel, dbias = _run(name, x, kernel, dy, active_rows)
  # dW and db stay in the float32 sums, for the caller to cast once to the params' dtypes.
  assert (dx.dtype, dkernel.dtype, dbias.dtype) == (dtype, jnp.float32, jnp.float32)
  assert (dx.shape, dkernel.shape, dbias.shape) == (
      (num_rows, in_features), (in_features, out_features), (out_features,))

  rows = _kept(name, active_rows, num_rows)
  expected = reference_backward(x, kernel, dy, rows)
  for actual, want in zip((dx, dkernel, dbias), expected):
    assert np.all(np.isfinite(np.asarray(actual, np.float64)))
    assert relative_error(actual, want) <= TOLERANCE[dtype]
  # Every row that was not kept is exactly zero in dX (and was written: no garbage, no NaN).
  dropped = np.setdiff1d(np.arange(num_rows), rows)
  assert np.all(np.asarray(dx, np.float64)[dropped] == 0)


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_without_bias(name):
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((24, 16)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
  dy = jnp.asarray(random_sparse_rows(rng, 24, 32, 6))
  dx, dkernel, dbias = _run(name, x, kernel, dy, select_active_rows(dy, 8), with_bias=False)
  assert dbias is None
  rows = np.flatnonzero(np.asarray(dy).any(axis=1))
  expected_dx, expected_dkernel, _ = reference_backward(x, kernel, dy, rows)
  assert relative_error(dx, expected_dx) <= 1e-5
  assert relative_error(dkernel, expected_dkernel) <= 1e-5


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
def test_dkernel_dtype_is_rounded_once_from_the_float32_sums(name):
  """bf16 parameters get dkernel stored as bf16 by its matmul: each element within half a
  bf16 ulp of the float32 sums (a bf16 accumulation would be far off)."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((96, 32)), jnp.bfloat16)
  kernel = jnp.asarray(rng.standard_normal((32, 40)), jnp.bfloat16)
  dy = jnp.asarray(random_sparse_rows(rng, 96, 40, 60), jnp.bfloat16)
  active_rows = select_active_rows(dy, 64)
  dx, dkernel, dbias = _run(name, x, kernel, dy, active_rows, dkernel_dtype=jnp.bfloat16)
  _, sums, _ = _run(name, x, kernel, dy, active_rows)
  assert (dx.dtype, dkernel.dtype, dbias.dtype, sums.dtype) == (
      jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32)
  sums = np.asarray(sums, np.float64)
  assert np.all(np.abs(np.asarray(dkernel, np.float64) - sums) <= 2.0**-8 * np.abs(sums))
  rows = np.flatnonzero(np.asarray(dy, np.float32).any(axis=1))
  expected = reference_backward(x, kernel, dy, rows)
  assert relative_error(sums, expected[1]) <= 1e-5


@pytest.mark.parametrize("name", SPARSE)
def test_poison_reaches_dkernel_and_dbias(name):
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
  kernel = jnp.asarray(rng.standard_normal((16, 24)), jnp.bfloat16)
  dy = jnp.asarray(random_sparse_rows(rng, 32, 24, 5), jnp.bfloat16)
  active_rows = select_active_rows(dy, 8)  # 5 active rows, 3 sentinel slots
  clean = _run(name, x, kernel, dy, active_rows)
  zero_poison = _run(name, x, kernel, dy, active_rows, poison=jnp.float32(0))
  for got, want in zip(zero_poison, clean):  # a zero poison changes nothing
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  dx, dkernel, dbias = _run(name, x, kernel, dy, active_rows, poison=jnp.float32(jnp.nan))
  assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))
  # dX is the kept rows' own: a NaN in a row left out is not theirs.
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(clean[0], np.float32))
  # Even with no kept row at all (every slot a sentinel).
  empty = jnp.full((8,), 32, jnp.int32)
  _, dkernel, dbias = _run(name, x, kernel, dy, empty, poison=jnp.float32(jnp.nan))
  assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))


# Shapes the Mosaic GPU kernels' default tiles divide (128), with an index as long as T (the
# counted path) and a shorter one; 16-bit operands only.
@pytest.mark.parametrize("num_rows,num_nonzero,top_n,dtype", [
    (200, 70, 200, jnp.bfloat16), (160, 40, 64, jnp.float16)])
def test_pallas_mosaic_matches_float64_reference(dtype, num_rows, num_nonzero, top_n):
  rng = np.random.default_rng([num_rows, top_n])
  x = jnp.asarray(rng.standard_normal((num_rows, 128)), dtype)
  kernel = jnp.asarray(rng.standard_normal((128, 256)), dtype)
  dy = jnp.asarray(random_sparse_rows(rng, num_rows, 256, num_nonzero), dtype)
  active_rows = select_active_rows(dy, top_n)
  dx, dkernel, dbias = _run("pallas_mosaic", x, kernel, dy, active_rows)
  assert (dx.shape, dx.dtype, dkernel.dtype, dbias.dtype) == (
      x.shape, dtype, jnp.float32, jnp.float32)
  rows = _kept("pallas_mosaic", active_rows, num_rows)
  for actual, want in zip((dx, dkernel, dbias), reference_backward(x, kernel, dy, rows)):
    assert relative_error(actual, want) <= TOLERANCE[dtype]
  dropped = np.setdiff1d(np.arange(num_rows), rows)
  assert np.all(np.asarray(dx, np.float64)[dropped] == 0)


def test_pallas_mosaic_carries_the_poison():
  rng = np.random.default_rng(13)
  x = jnp.asarray(rng.standard_normal((130, 128)), jnp.bfloat16)
  kernel = jnp.asarray(rng.standard_normal((128, 128)), jnp.bfloat16)
  dy = jnp.asarray(random_sparse_rows(rng, 130, 128, 9), jnp.bfloat16)
  for active_rows in (select_active_rows(dy, 130), jnp.full((130,), 130, jnp.int32)):
    dx, dkernel, dbias = _run("pallas_mosaic", x, kernel, dy, active_rows,
                              poison=jnp.float32(jnp.nan))
    assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))
    clean_dx, _, _ = _run("pallas_mosaic", x, kernel, dy, active_rows)
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(clean_dx, np.float32))


def test_pallas_takes_the_mosaic_kernels_on_hopper_only(monkeypatch):
  """``"pallas"`` runs the Mosaic GPU route where the device is a Hopper GPU (faked here; on a
  CPU the kernels then run interpreted) and the Triton kernels elsewhere; the Mosaic route
  itself leaves operands its tiles do not divide, float32, and any operands under
  jax_enable_x64 to the Triton kernels."""
  from pallas_kernels import sebp_matmul_mgpu
  calls = []
  real = sebp_matmul_mgpu.kept_rows_backward
  monkeypatch.setattr(sebp_matmul_mgpu, "kept_rows_backward",
                      lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))
  rng = np.random.default_rng(14)

  def run(d, n, dtype):
    x = jnp.asarray(rng.standard_normal((64, d)), dtype)
    kernel = jnp.asarray(rng.standard_normal((d, n)), dtype)
    dy = jnp.asarray(random_sparse_rows(rng, 64, n, 20), dtype)
    return _run("pallas", x, kernel, dy, select_active_rows(dy, 64))

  monkeypatch.setattr(implementations, "on_hopper", lambda: False)
  run(128, 128, jnp.bfloat16)
  assert calls == []
  monkeypatch.setattr(implementations, "on_hopper", lambda: True)
  run(128, 128, jnp.bfloat16)
  assert calls == [(128, 128)]
  run(96, 128, jnp.bfloat16)
  run(128, 128, jnp.float32)
  with jax.enable_x64(True):  # Mosaic's pipeline mixes int64 and int32 step counts there.
    dx, dkernel, _ = run(128, 128, jnp.bfloat16)
  assert calls == [(128, 128)]
  assert np.isfinite(np.asarray(dkernel, np.float32)).all() and dx.shape == (64, 128)


def test_dense_carries_a_nan_of_any_row():
  rng = np.random.default_rng(12)
  x = jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
  dy = jnp.zeros((16, 4)).at[3, 1].set(jnp.nan)
  _, dkernel, dbias = _run("dense", x, kernel, dy, None)
  assert np.all(np.isnan(dkernel[:, 1])) and np.isnan(dbias[1])


def test_a_registered_implementation_runs_in_the_op(monkeypatch):
  """The registry is the extension point: an implementation registered by name is what
  ``backend=name`` runs."""
  # Registered into a copy, so that no other test sees it.
  monkeypatch.setattr(implementations, "_REGISTRY", dict(implementations._REGISTRY))
  calls = []

  def counting_dense(*args, **kwargs):
    calls.append(kwargs)
    return dense_backward(*args, **kwargs)

  register_implementation("counting_dense", counting_dense, takes_index=False)
  x, kernel = jnp.ones((6, 3)), jnp.ones((3, 2))
  grad = jax.grad(lambda k: sebp_jax.sebp_linear(x, k, top_n=2,
                                                 backend="counting_dense").sum())(kernel)
  assert len(calls) == 1
  np.testing.assert_allclose(grad, jax.grad(lambda k: (x @ k).sum())(kernel))
  with pytest.raises(ValueError, match="not an implementation name"):
    register_implementation("auto", counting_dense)
  with pytest.raises(ValueError, match="registered already"):
    register_implementation("dense", counting_dense)
  register_implementation("dense", counting_dense, takes_index=False, replace=True)
  jax.grad(lambda k: sebp_jax.sebp_linear(x, k, top_n=6).sum())(kernel)  # nothing to skip
  assert len(calls) == 2


def test_an_implementation_that_follows_the_count_gets_every_candidate_row(monkeypatch):
  """follows_count=True: where the capacity would be chosen at run time, the implementation
  runs once, handed an index as long as every row (the active ones first, then sentinels),
  and the gradient is exact; an implementation that takes no index cannot follow a count."""
  monkeypatch.setattr(implementations, "_REGISTRY", dict(implementations._REGISTRY))
  lengths = []

  def xla_spy(x, kernel, dy, active_rows, **kwargs):
    lengths.append(active_rows.shape[0])
    return implementations.xla_backward(x, kernel, dy, active_rows, **kwargs)

  register_implementation("xla_spy", xla_spy, follows_count=True)
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((64, 5)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((5, 7)), jnp.float32)
  dy = jnp.asarray(random_sparse_rows(rng, 64, 7, 11))
  for top_n in ("auto", 4):
    grads = jax.grad(lambda x, k: jnp.vdot(sebp_jax.sebp_linear(x, k, top_n=top_n,
                                                                backend="xla_spy"), dy),
                     argnums=(0, 1))(x, kernel)
    for got, want in zip(grads, reference_backward(x, kernel, dy, np.arange(64))):
      assert relative_error(got, want) <= 1e-5
  assert lengths == [64, 64]
  with pytest.raises(ValueError, match="needs an implementation that takes an index"):
    register_implementation("spy_dense", dense_backward, takes_index=False, follows_count=True)


@pytest.mark.parametrize("num_rows", [16384, 4096, 1000, 77, 6, 0])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_sum_rows_is_the_float32_sum(num_rows, dtype):
  """Any row count (64, 16 or 2 partial sums, one, no rows): the float64 sum up to float32
  rounding, where a sum in the 16-bit dtype would be off by its own ulps."""
  rng = np.random.default_rng(num_rows)
  a = jnp.asarray(rng.standard_normal((num_rows, 24)) + 1.0, dtype)
  got = sum_rows(a, jnp.float32)
  assert got.shape == (24,) and got.dtype == jnp.float32
  expected = np.asarray(a, np.float64).sum(axis=0)
  np.testing.assert_allclose(np.asarray(got, np.float64), expected, rtol=1e-6, atol=1e-6)
