"""Every backend of the sparse backward against the float64 numpy reference.

Written once for all backends; the Pallas backend runs interpreted on CPU and through Triton on
a GPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from reference import random_sparse_rows, reference_backward, relative_error
from sebp_jax import select_active_rows, sparse_backward
from sebp_jax.backends import choose_backend, dense_backward, sum_rows

BACKENDS = ["xla", "pallas"]
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}


def _run(backend, x, kernel, dy, active_rows, with_bias=True):
  fn = jax.jit(lambda *a: sparse_backward(*a, with_bias=with_bias, backend=backend))
  return fn(x, kernel, dy, active_rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("num_rows,in_features,out_features,num_nonzero,top_n", [
    (64, 32, 48, 10, 16),   # padded slots: fewer active rows than top_n
    (37, 50, 24, 30, 12),   # more active rows than top_n; odd sizes
    (40, 16, 16, 0, 8),     # no active row at all
])
def test_matches_float64_reference(backend, dtype, num_rows, in_features, out_features,
                                   num_nonzero, top_n):
  rng = np.random.default_rng(num_rows + top_n)
  x = rng.standard_normal((num_rows, in_features)).astype(np.float32)
  kernel = rng.standard_normal((in_features, out_features)).astype(np.float32)
  dy = random_sparse_rows(rng, num_rows, out_features, num_nonzero)
  x, kernel, dy = (jnp.asarray(a, dtype) for a in (x, kernel, dy))
  active_rows = select_active_rows(dy, top_n)
  dx, dkernel, dbias = _run(backend, x, kernel, dy, active_rows)
  # dW and db stay in the float32 sums, for the caller to cast once to the params' dtypes.
  assert (dx.dtype, dkernel.dtype, dbias.dtype) == (dtype, jnp.float32, jnp.float32)
  assert (dx.shape, dkernel.shape, dbias.shape) == (
      (num_rows, in_features), (in_features, out_features), (out_features,))

  rows = np.asarray(active_rows)[np.asarray(active_rows) < num_rows]
  expected = reference_backward(x, kernel, dy, rows)
  for actual, want in zip((dx, dkernel, dbias), expected):
    assert np.all(np.isfinite(np.asarray(actual, np.float64)))
    assert relative_error(actual, want) <= TOLERANCE[dtype]
  # Every row that was not kept is exactly zero in dX (and was written: no garbage, no NaN).
  dropped = np.setdiff1d(np.arange(num_rows), rows)
  assert np.all(np.asarray(dx, np.float64)[dropped] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_bias(backend):
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((24, 16)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
  dy = jnp.asarray(random_sparse_rows(rng, 24, 32, 6))
  dx, dkernel, dbias = _run(backend, x, kernel, dy, select_active_rows(dy, 8), with_bias=False)
  assert dbias is None
  rows = np.flatnonzero(np.asarray(dy).any(axis=1))
  expected_dx, expected_dkernel, _ = reference_backward(x, kernel, dy, rows)
  assert relative_error(dx, expected_dx) <= 1e-5
  assert relative_error(dkernel, expected_dkernel) <= 1e-5


@pytest.mark.parametrize("backend", [*BACKENDS, "dense"])
def test_dkernel_dtype_is_rounded_once_from_the_float32_sums(backend):
  """bf16 parameters get dkernel stored as bf16 by its matmul: each element within half a
  bf16 ulp of the float32 sums (a bf16 accumulation would be far off)."""
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.standard_normal((96, 32)), jnp.bfloat16)
  kernel = jnp.asarray(rng.standard_normal((32, 40)), jnp.bfloat16)
  dy = jnp.asarray(random_sparse_rows(rng, 96, 40, 60), jnp.bfloat16)
  active_rows = select_active_rows(dy, 64)

  def run(dkernel_dtype):
    options = dict(with_bias=True, precision=None, dkernel_dtype=dkernel_dtype)
    if backend == "dense":
      return jax.jit(lambda: dense_backward(x, kernel, dy, **options))()
    return jax.jit(lambda: sparse_backward(x, kernel, dy, active_rows, backend=backend,
                                           **options))()

  dx, dkernel, dbias = run(jnp.bfloat16)
  _, sums, _ = run(None)
  assert (dx.dtype, dkernel.dtype, dbias.dtype, sums.dtype) == (
      jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32)
  sums = np.asarray(sums, np.float64)
  assert np.all(np.abs(np.asarray(dkernel, np.float64) - sums) <= 2.0**-8 * np.abs(sums))
  rows = np.flatnonzero(np.asarray(dy, np.float32).any(axis=1))
  expected = reference_backward(x, kernel, dy, rows)
  assert relative_error(sums, expected[1]) <= 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_poison_reaches_dkernel_and_dbias(backend):
  rng = np.random.default_rng(11)
  x = jnp.asarray(rng.standard_normal((32, 16)), jnp.bfloat16)
  kernel = jnp.asarray(rng.standard_normal((16, 24)), jnp.bfloat16)
  dy = jnp.asarray(random_sparse_rows(rng, 32, 24, 5), jnp.bfloat16)
  active_rows = select_active_rows(dy, 8)  # 5 active rows, 3 sentinel slots
  run = jax.jit(lambda poison: sparse_backward(x, kernel, dy, active_rows, with_bias=True,
                                                backend=backend, poison=poison))
  clean = _run(backend, x, kernel, dy, active_rows)
  for got, want in zip(run(jnp.float32(0)), clean):  # a zero poison changes nothing
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  _, dkernel, dbias = run(jnp.float32(jnp.nan))
  assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))
  # Even with no kept row at all (every slot a sentinel).
  empty = jnp.full((8,), 32, jnp.int32)
  _, dkernel, dbias = jax.jit(lambda: sparse_backward(
      x, kernel, dy, empty, with_bias=True, backend=backend, poison=jnp.float32(jnp.nan)))()
  assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_index_of_no_slots(backend):
  """A static index of size 0: zero gradients, and a NaN poison still reaches dW and db."""
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((20, 16)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((16, 24)), jnp.float32)
  dy = jnp.asarray(rng.standard_normal((20, 24)), jnp.float32)
  no_slots = jnp.zeros((0,), jnp.int32)
  run = jax.jit(lambda poison: sparse_backward(x, kernel, dy, no_slots, with_bias=True,
                                                backend=backend, poison=poison))
  dx, dkernel, dbias = run(jnp.float32(0))
  assert (dx.shape, dkernel.shape, dbias.shape) == ((20, 16), (16, 24), (24,))
  assert not np.any(dx) and not np.any(dkernel) and not np.any(dbias)
  _, dkernel, dbias = run(jnp.float32(jnp.nan))
  assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))


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


def test_unknown_backend_is_rejected():
  x = jnp.ones((4, 2))
  with pytest.raises(ValueError, match="backend"):
    sparse_backward(x, jnp.ones((2, 3)), jnp.ones((4, 3)), jnp.arange(2), with_bias=False,
                    backend="cuda")


def test_auto_choice():
  shapes = dict(in_features=768, out_features=768, itemsize=2)
  # Off GPU: the jnp reference; with nothing to skip: dense, whatever was asked.
  assert choose_backend("auto", num_rows=4096, top_n=800, index_given=False,
                        platform="cpu", **shapes) == "xla"
  assert choose_backend("pallas", num_rows=4096, top_n=4096, index_given=False,
                        platform="cpu", **shapes) == "dense"
  assert choose_backend("xla", num_rows=4096, top_n=800, index_given=False,
                        platform="gpu", **shapes) == "xla"
  # On GPU, measured: a bert-base layer at T=4096 with 20% kept loses to dense (RESULTS.md)...
  assert choose_backend("auto", num_rows=4096, top_n=820, index_given=False,
                        platform="gpu", **shapes) == "dense"
  # ... while a Llama MLP layer at T=16384 with 20% kept wins, and so does a bert layer whose
  # index comes from the padding mask (3% of the rows: SST-2 padded to 512); both through XLA.
  assert choose_backend("auto", num_rows=16384, in_features=2048, out_features=8192,
                        top_n=3277, itemsize=2, index_given=False, platform="gpu") == "xla"
  assert choose_backend("auto", num_rows=16384, top_n=430, index_given=True,
                        platform="gpu", **shapes) == "xla"
  # H100, T=4096, half the rows kept: SEBP still wins a Llama MLP layer (1.36x selected,
  # 1.57x given) and loses a bert-base one (0.50x selected).
  llama_mlp = dict(num_rows=4096, in_features=3072, out_features=8192, top_n=2048, itemsize=2,
                   platform="gpu")
  assert choose_backend("auto", index_given=False, **llama_mlp) == "xla"
  assert choose_backend("auto", index_given=True, **llama_mlp) == "xla"
  assert choose_backend("auto", num_rows=4096, top_n=2048, index_given=False,
                        platform="gpu", **shapes) == "dense"
  # ... and, with the kept rows' matmuls at 700 TFLOP/s, a Llama up-projection with the index
  # selected (XLA 1.05-1.22x ahead) and a 2048x2048 layer with it given (1.11-1.27x).
  assert choose_backend("auto", num_rows=4096, in_features=2048, out_features=8192, top_n=2048,
                        itemsize=2, index_given=False, platform="gpu") == "xla"
  assert choose_backend("auto", num_rows=4096, in_features=2048, out_features=2048, top_n=2048,
                        itemsize=2, index_given=True, platform="gpu") == "xla"
  with pytest.raises(ValueError, match="backend must be one of"):
    choose_backend("triton", num_rows=8, top_n=2, index_given=False, **shapes)
