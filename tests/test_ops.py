"""`sebp_linear`: gradients against `jax.grad` of the dense function and the numpy reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.ad_checkpoint import print_saved_residuals

import sebp_jax
from sebp_jax import SEBP_CHECKPOINT_NAME
from tests.reference import (random_sparse_rows, reference_active_rows, reference_backward,
                             relative_error)

# The SEBP backward under test. "auto" would run the dense backward on a GPU for layers this
# small (see sebp_jax.cost_model), keeping every row.
sebp_linear = functools.partial(sebp_jax.sebp_linear, backend="xla")


def dense_linear(x, kernel, bias=None):
  y = x @ kernel
  return y if bias is None else y + bias


def _problem(rng, lead_shape, in_features, out_features, num_nonzero, dtype=np.float32):
  """x, kernel, bias and an upstream gradient g with only `num_nonzero` non-zero rows."""
  num_rows = int(np.prod(lead_shape))
  x = rng.standard_normal((*lead_shape, in_features)).astype(dtype)
  kernel = rng.standard_normal((in_features, out_features)).astype(dtype)
  bias = rng.standard_normal(out_features).astype(dtype)
  g = random_sparse_rows(rng, num_rows, out_features, num_nonzero, dtype)
  return x, kernel, bias, g.reshape(*lead_shape, out_features)


def _grads(fn, x, kernel, bias, g, **kwargs):
  """Gradients of <fn(x, kernel, bias), g> w.r.t. all three, under jit."""
  loss = lambda x, k, b: jnp.sum(fn(x, k, b, **kwargs) * g)
  return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, kernel, bias)


@pytest.mark.parametrize("lead_shape", [(24,), (3, 8), (2, 3, 5)])
@pytest.mark.parametrize("use_bias", [True, False])
def test_exact_when_top_n_covers_nonzero_rows(lead_shape, use_bias):
  rng = np.random.default_rng(sum(lead_shape))
  num_rows = int(np.prod(lead_shape))
  x, kernel, bias, g = _problem(rng, lead_shape, 16, 12, num_nonzero=num_rows // 3)
  bias = bias if use_bias else None

  def sebp(x, k, b):
    return sebp_linear(x, k, b, top_n=num_rows // 3)

  def loss(fn):
    return lambda x, k, b: jnp.sum(fn(x, k, b) * g)

  want = jax.grad(loss(dense_linear), argnums=(0, 1) + ((2,) if use_bias else ()))(
      x, kernel, bias)
  got = jax.jit(jax.grad(loss(sebp), argnums=(0, 1) + ((2,) if use_bias else ())))(
      x, kernel, bias)
  for a, b in zip(got, want):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_float64_exact():
  with jax.enable_x64(True):
    rng = np.random.default_rng(3)
    x, kernel, bias, g = _problem(rng, (4, 10), 9, 7, num_nonzero=15, dtype=np.float64)
    got = _grads(sebp_linear, x, kernel, bias, g, top_n=15)
    want = _grads(dense_linear, x, kernel, bias, g)
    for a, b in zip(got, want):
      assert a.dtype == jnp.float64
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scale", [1e-45, 1e-200])
def test_float64_rows_below_float32s_range_are_active(scale):
  """float64 dY is scored in float64: a row of 1e-200 is no zero (in float32 it would be)."""
  with jax.enable_x64(True):
    rng = np.random.default_rng(13)
    x, kernel, bias, g = _problem(rng, (3, 8), 5, 4, num_nonzero=6, dtype=np.float64)
    g = g * scale
    for options in (dict(top_n=8), dict(top_n="auto"), dict(top_n=4, overflow="drop")):
      got = _grads(sebp_linear, x, kernel, bias, g, **options)
      want = _grads(dense_linear, x, kernel, bias, g)
      kept = reference_active_rows(g.reshape(24, 4), options["top_n"] if options.get(
          "overflow") == "drop" else 24)
      assert len(kept) == (4 if options.get("overflow") == "drop" else 6)
      ref = reference_backward(x.reshape(24, 5), kernel, g.reshape(24, 4), kept)
      for a, b in zip(got, (ref[0].reshape(x.shape), ref[1], ref[2])):
        assert a.dtype == jnp.float64 and np.any(a != 0)
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)
      if "overflow" not in options:
        for a, b in zip(got, want):
          np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)


def test_top_n_below_nonzero_rows_drops_the_rest_only_when_asked():
  rng = np.random.default_rng(4)
  x, kernel, bias, g = _problem(rng, (6, 8), 20, 10, num_nonzero=30)
  # The default is exact: more active rows than top_n run the dense backward.
  for got, want in zip(_grads(sebp_linear, x, kernel, bias, g, top_n=11),
                       _grads(dense_linear, x, kernel, bias, g)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  dx, dkernel, dbias = _grads(sebp_linear, x, kernel, bias, g, top_n=11, overflow="drop")
  x2d, g2d = x.reshape(48, 20), g.reshape(48, 10)
  kept = reference_active_rows(g2d, 11)
  assert len(kept) == 11
  ref_dx, ref_dkernel, ref_dbias = reference_backward(x2d, kernel, g2d, kept)
  np.testing.assert_allclose(dx.reshape(48, 20), ref_dx, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dkernel, ref_dkernel, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(dbias, ref_dbias, rtol=1e-5, atol=1e-5)
  # What is missing from the dense gradient is exactly the dropped rows' contribution.
  dense = _grads(dense_linear, x, kernel, bias, g)
  dropped = np.setdiff1d(np.flatnonzero(g2d.any(axis=1)), kept)
  _, dropped_dkernel, dropped_dbias = reference_backward(x2d, kernel, g2d, dropped)
  np.testing.assert_allclose(dense[1] - dkernel, dropped_dkernel, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dense[2] - dbias, dropped_dbias, rtol=1e-4, atol=1e-4)


def test_top_n_at_least_rows_is_the_dense_backward():
  rng = np.random.default_rng(5)
  x, kernel, bias, g = _problem(rng, (3, 4), 5, 6, num_nonzero=12)
  got = _grads(sebp_linear, x, kernel, bias, g, top_n=100)
  want = _grads(dense_linear, x, kernel, bias, g)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype,tolerance", [(jnp.bfloat16, 1e-2), (jnp.float16, 2e-3)])
def test_low_precision_dtypes(dtype, tolerance):
  rng = np.random.default_rng(6)
  x, kernel, bias, g = _problem(rng, (4, 16), 32, 24, num_nonzero=20)
  args = [jnp.asarray(a, dtype) for a in (x, kernel, bias, g)]
  grads = _grads(sebp_linear, *args, top_n=24)
  # JAX would silently accept a float32 cotangent for a low-precision primal: check the dtypes.
  assert [a.dtype for a in grads] == [dtype] * 3
  x64, k64, g64 = (np.asarray(a, np.float64) for a in (args[0], args[1], args[3]))
  rows = np.flatnonzero(g64.reshape(64, 24).any(axis=1))
  expected = reference_backward(x64.reshape(64, 32), k64, g64.reshape(64, 24), rows)
  assert relative_error(grads[0].reshape(64, 32), expected[0]) <= tolerance
  assert relative_error(grads[1], expected[1]) <= tolerance
  assert relative_error(grads[2], expected[2]) <= tolerance


def test_mixed_dtypes_promote_like_flax_dense():
  x = jnp.ones((4, 3), jnp.bfloat16)
  kernel = jnp.ones((3, 2), jnp.float32)
  y = sebp_linear(x, kernel, top_n=2)
  assert y.dtype == jnp.float32
  dx, dkernel = jax.grad(lambda x, k: jnp.sum(sebp_linear(x, k, top_n=2)), (0, 1))(x, kernel)
  assert dx.dtype == jnp.bfloat16 and dkernel.dtype == jnp.float32
  # Integer inputs are cast up front (they have no gradient of their own dtype).
  ints = jnp.arange(12, dtype=jnp.int32).reshape(4, 3)
  np.testing.assert_array_equal(sebp_linear(ints, kernel, top_n=2), ints @ kernel)
  dkernel = jax.grad(lambda k: jnp.sum(sebp_linear(ints, k, top_n=4)))(kernel)
  np.testing.assert_allclose(dkernel, np.repeat(ints.sum(0)[:, None], 2, 1).astype(np.float32))


def test_nan_in_a_padding_row_stays_visible():
  rng = np.random.default_rng(8)
  x, kernel, bias, g = _problem(rng, (2, 8), 6, 5, num_nonzero=4)
  g2d = g.reshape(16, 5)
  padding_row = int(np.flatnonzero(~g2d.any(axis=1))[0])
  g2d[padding_row, 2] = np.nan
  grads = _grads(sebp_linear, x, kernel, bias, g2d.reshape(g.shape), top_n=4)
  assert np.isnan(np.asarray(grads[0]).reshape(16, 6)[padding_row]).all()
  assert np.isnan(np.asarray(grads[1])[:, 2]).all()
  assert np.isnan(np.asarray(grads[2])[2])


def test_vmap_applies_top_n_per_instance():
  rng = np.random.default_rng(9)
  xs = rng.standard_normal((3, 10, 4)).astype(np.float32)
  kernel = rng.standard_normal((4, 5)).astype(np.float32)
  gs = rng.standard_normal((3, 10, 5)).astype(np.float32)
  grad_one = jax.grad(lambda x, k, g: jnp.sum(sebp_linear(x, k, top_n=3, overflow="drop") * g),
                      argnums=(0, 1))
  batched = jax.jit(jax.vmap(grad_one, in_axes=(0, None, 0)))(xs, kernel, gs)
  for i in range(3):
    rows = reference_active_rows(gs[i], 3)
    ref_dx, ref_dkernel, _ = reference_backward(xs[i], kernel, gs[i], rows)
    np.testing.assert_allclose(batched[0][i], ref_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(batched[1][i], ref_dkernel, rtol=1e-5, atol=1e-5)


def test_checkpoint_name_lets_remat_save_the_output(capsys):
  rng = np.random.default_rng(10)
  x, kernel, bias, g = _problem(rng, (8,), 6, 4, num_nonzero=5)

  def f(x, k):
    return jnp.sum(jnp.tanh(sebp_linear(x, k, top_n=5)) * g)

  saving = jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names(
      SEBP_CHECKPOINT_NAME))
  print_saved_residuals(saving, x, kernel)
  assert f"named '{SEBP_CHECKPOINT_NAME}'" in capsys.readouterr().out
  print_saved_residuals(jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable),
                        x, kernel)
  assert f"named '{SEBP_CHECKPOINT_NAME}'" not in capsys.readouterr().out
  for fn in (saving, jax.checkpoint(f)):
    got = jax.jit(jax.grad(fn, argnums=(0, 1)))(x, kernel)
    want = jax.grad(lambda x, k: jnp.sum(jnp.tanh(x @ k) * g), argnums=(0, 1))(x, kernel)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_optax_update_matches_dense():
  rng = np.random.default_rng(11)
  x, kernel, bias, g = _problem(rng, (4, 6), 8, 3, num_nonzero=10)
  optimizer = optax.adamw(1e-2)
  params = {"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)}

  def step(linear, **kwargs):
    loss = lambda p: jnp.sum(linear(x, p["kernel"], p["bias"], **kwargs) * g)
    grads = jax.grad(loss)(params)
    updates, _ = optimizer.update(grads, optimizer.init(params), params)
    return optax.apply_updates(params, updates)

  got, want = step(sebp_linear, top_n=10), step(dense_linear)
  for name in params:
    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)
    assert not np.allclose(got[name], params[name])


@pytest.mark.parametrize("top_n,match", [
    (0, "top_n must be a positive"), (-3, "top_n must be a positive"),
    (2.5, "top_n must be a positive"), (True, "top_n must be a positive"),
    ("4", "top_n must be a positive")])
def test_bad_top_n(top_n, match):
  with pytest.raises(ValueError, match=match):
    sebp_linear(jnp.ones((4, 3)), jnp.ones((3, 2)), top_n=top_n)


def test_traced_top_n_is_rejected():
  with pytest.raises(ValueError, match="top_n must be a static"):
    jax.jit(lambda x, n: sebp_linear(x, jnp.ones((3, 2)), top_n=n))(jnp.ones((4, 3)), 2)


@pytest.mark.parametrize("threshold", [-1.0, float("nan"), float("inf"), "0.1", True])
def test_bad_threshold(threshold):
  with pytest.raises(ValueError, match="threshold must be"):
    sebp_linear(jnp.ones((4, 3)), jnp.ones((3, 2)), top_n=2, threshold=threshold)


@pytest.mark.parametrize("x_shape,kernel_shape,bias_shape,match", [
    ((4, 3), (5, 2), None, r"x has shape \(4, 3\), kernel has shape \(5, 2\)"),
    ((4, 3), (3, 2, 1), None, r"kernel must be 2-D.*\(3, 2, 1\)"),
    ((4, 3), (3, 2), (3,), r"bias must have shape \(2,\).*\(3,\)"),
])
def test_shape_errors_name_both_shapes(x_shape, kernel_shape, bias_shape, match):
  bias = None if bias_shape is None else jnp.ones(bias_shape)
  with pytest.raises(ValueError, match=match):
    sebp_linear(jnp.ones(x_shape), jnp.ones(kernel_shape), bias, top_n=2)


def test_unknown_backend():
  with pytest.raises(ValueError, match="backend must be"):
    sebp_linear(jnp.ones((4, 3)), jnp.ones((3, 2)), top_n=2, backend="triton")


@settings(max_examples=20, deadline=None)
@given(lead=st.lists(st.integers(1, 6), min_size=1, max_size=3),
       in_features=st.integers(1, 9), out_features=st.integers(1, 9), data=st.data())
def test_property_gradients_match_reference(lead, in_features, out_features, data):
  num_rows = int(np.prod(lead))
  top_n = data.draw(st.one_of(st.integers(1, num_rows + 2), st.just("auto")), label="top_n")
  overflow = data.draw(st.sampled_from(["exact", "nan", "drop"]), label="overflow")
  num_nonzero = data.draw(st.integers(0, num_rows), label="num_nonzero")
  rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1), label="seed"))
  x, kernel, bias, g = _problem(rng, tuple(lead), in_features, out_features, num_nonzero)
  dx, dkernel, dbias = _grads(sebp_linear, x, kernel, bias, g, top_n=top_n, overflow=overflow)
  g2d = g.reshape(num_rows, out_features)
  rows = np.flatnonzero(g2d.any(axis=1))
  if top_n != "auto" and len(rows) > top_n:
    if overflow == "nan":
      assert all(np.all(np.isnan(grad)) for grad in (dx, dkernel, dbias))
      return
    if overflow == "drop":
      rows = reference_active_rows(g2d, top_n)
  ref = reference_backward(x.reshape(num_rows, in_features), kernel, g2d, rows)
  np.testing.assert_allclose(dx.reshape(num_rows, in_features), ref[0], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dkernel, ref[1], rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(dbias, ref[2], rtol=1e-4, atol=1e-5)


def test_nan_in_a_row_outside_a_given_index_poisons_dkernel_and_dbias():
  """A NaN/Inf, or any value not zero, in a row the index leaves out makes dW and db NaN and
  that row's dX (as jax.grad's for a NaN row); the kept rows' dX is theirs alone."""
  rng = np.random.default_rng(12)
  x, kernel, bias, g = _problem(rng, (16,), 6, 5, num_nonzero=4)
  kept = np.flatnonzero(g.any(axis=1))
  skipped = int(np.setdiff1d(np.arange(16), kept)[0])
  active_rows = jnp.asarray(kept, jnp.int32)

  def grads(g, overflow):
    loss = lambda x, k, b: jnp.sum(sebp_linear(x, k, b, top_n=4, active_rows=active_rows,
                                               overflow=overflow) * g)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, kernel, bias)

  for overflow in ("exact", "nan"):
    bad = g.copy()
    clean = grads(bad, overflow)
    ref = reference_backward(x, kernel, bad, kept)
    for got, want in zip(clean, ref):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    others = np.arange(16) != skipped
    for value in (np.nan, np.inf, -0.5):
      bad[skipped, 1] = value
      poisoned = grads(bad, overflow)
      assert np.isnan(np.asarray(poisoned[1])).all() and np.isnan(np.asarray(poisoned[2])).all()
      assert np.isnan(np.asarray(poisoned[0])[skipped]).all()
      np.testing.assert_array_equal(np.asarray(poisoned[0])[others], np.asarray(clean[0])[others])


@pytest.mark.parametrize("options", [
    {}, {"top_n": 4}, {"top_n": 4, "overflow": "nan"}, {"top_n": 4, "overflow": "drop"},
    {"threshold": 1e-3}, {"active_rows": "kept"}, {"backend": "pallas"},
    {"backend": "dense", "top_n": 4}], ids=str)
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_non_finite_x_in_a_skipped_row_makes_dkernel_nan(options, value):
  """jax.grad's dW = xᵀ·dY multiplies a NaN/Inf of x by the zero dY of its row: NaN. The
  backward that skips the row must make dW NaN too, whatever its path; db and dX are
  jax.grad's. In a kept row the NaN/Inf reaches dW as in jax.grad, no further."""
  rng = np.random.default_rng(21)
  x, kernel, bias, g = _problem(rng, (16,), 6, 5, num_nonzero=4)
  kept = np.flatnonzero(g.any(axis=1))
  if options.get("active_rows") == "kept":
    options = {"active_rows": jnp.asarray(kept, jnp.int32), "top_n": 4}
  skipped = int(np.setdiff1d(np.arange(16), kept)[0])
  dense = lambda x, k, b: x @ k + b
  for row, everywhere in ((skipped, True), (int(kept[1]), False)):
    bad_x = x.copy()
    bad_x[row, 2] = value
    got = _grads(sebp_linear, bad_x, kernel, bias, g, **options)
    want = _grads(dense, bad_x, kernel, bias, g)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-5, atol=1e-6)
    dkernel = np.asarray(got[1])
    if everywhere:
      assert np.isnan(dkernel).all()
    else:
      np.testing.assert_array_equal(np.isfinite(dkernel), np.isfinite(np.asarray(want[1])))


def test_differentiating_the_backward_again_is_refused():
  rng = np.random.default_rng(13)
  x, kernel, bias, g = _problem(rng, (12,), 4, 3, num_nonzero=5)
  row_mask = jnp.asarray(g.any(axis=1, keepdims=True), jnp.float32)  # 5 rows carry loss
  loss_of = lambda linear: lambda k: jnp.sum(jnp.tanh(linear(x, k, bias)) ** 2 * row_mask)
  loss = loss_of(functools.partial(sebp_linear, top_n=6))
  np.testing.assert_allclose(jax.grad(loss)(kernel), jax.grad(loss_of(dense_linear))(kernel),
                             rtol=2e-5, atol=1e-6)  # first order: every active row kept
  # Keeping every row, the backward is the dense one, and its own derivative is exact.
  np.testing.assert_allclose(jax.hessian(loss_of(functools.partial(sebp_linear, top_n=12)))(
      kernel), jax.hessian(loss_of(dense_linear))(kernel), rtol=2e-5, atol=1e-6)
  with pytest.raises(NotImplementedError, match="cannot be differentiated"):
    jax.hessian(loss)(kernel)
  with pytest.raises(NotImplementedError, match="cannot be differentiated"):
    jax.grad(lambda k: jnp.sum(jax.grad(loss)(k) ** 2))(kernel)
  lookup = lambda overflow: lambda t: jnp.sum(sebp_jax.sebp_embed_lookup(
      t, jnp.array([0, 2, 2]), top_n=2, overflow=overflow) ** 3)
  with pytest.raises(NotImplementedError, match="cannot be differentiated"):
    jax.hessian(lookup("drop"))(jnp.ones((4, 2)))
  # Keeping every row with no threshold, the lookup is the plain one, exact to any order.
  plain = lambda t: jnp.sum(jnp.take(t, jnp.array([0, 2, 2]), axis=0) ** 3)
  np.testing.assert_allclose(jax.hessian(lookup("exact"))(jnp.ones((4, 2))),
                             jax.hessian(plain)(jnp.ones((4, 2))))


def test_complex_rows_are_scored_by_their_magnitudes():
  """A row of dY whose entries are purely imaginary is as active as a real one."""
  rng = np.random.default_rng(14)
  x = jnp.asarray(rng.standard_normal((6, 3)) + 1j * rng.standard_normal((6, 3)), jnp.complex64)
  kernel = jnp.asarray(rng.standard_normal((3, 2)) + 1j * rng.standard_normal((3, 2)),
                       jnp.complex64)
  g = np.zeros((6, 2), np.complex64)
  g[1] = [2j, -1j]  # imaginary only
  g[4] = [1.0, 0.5 + 0.5j]
  _, vjp = jax.vjp(lambda x, k: sebp_linear(x, k, top_n=2), x, kernel)
  _, dense_vjp = jax.vjp(dense_linear, x, kernel)
  for got, want, reference in zip(vjp(jnp.asarray(g)), dense_vjp(jnp.asarray(g)),
                                  reference_backward(x, kernel, g, [1, 4])):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="no kernels for complex dtypes"):
    sebp_jax.sebp_linear(x, kernel, top_n=2, backend="pallas")


@pytest.mark.parametrize("rows,match", [
    ([3, 1, 6], "strictly ascending"),
    ([1, 1, 6], "strictly ascending"),
    ([-1, 2, 6], "in \\[0, 6\\)"),
    ([2, 7, 6], "in \\[0, 6\\)"),
    ([6, 2, 6], "sentinel 6 in unused slots"),
])
def test_a_concrete_index_is_checked_against_its_contract(rows, match):
  x, kernel = jnp.ones((6, 2)), jnp.ones((2, 3))
  with pytest.raises(ValueError, match=match):
    sebp_linear(x, kernel, top_n=3, active_rows=jnp.array(rows))
  sebp_linear(x, kernel, top_n=3, active_rows=jnp.array([0, 5, 6]))  # padded: accepted
  # Checked as given, before jnp narrows int64 entries to int32 (2**32 + 2 would read row 2).
  for wide in ([1, 2**32 + 2, 6], [1, 2, 2**32 + 6]):
    with pytest.raises(ValueError, match="in \\[0, 6\\)"):
      sebp_linear(x, kernel, top_n=3, active_rows=np.array(wide, np.int64))


@pytest.mark.parametrize("backend", ["xla", "pallas"])
def test_a_traced_index_out_of_order_reads_its_rows_in_every_backend(backend):
  """A traced index cannot be checked: out of order (sentinels first, rows shuffled), with an
  entry past T and rows listed twice, each backend reads its listed rows once (the
  reference's); an entry below 0 in place of a nonzero row leaves that row out, which makes
  dW and db NaN."""
  rng = np.random.default_rng(31)
  x, kernel, bias, g = _problem(rng, (40,), 6, 5, num_nonzero=8)
  kept = np.flatnonzero(g.any(axis=1))
  index = np.concatenate([[40, 40, 99], rng.permutation(kept), kept[[0, 3, 3]],
                          np.full(10, 40)])

  @jax.jit
  def grads(index, g):
    loss = lambda x, k, b: jnp.sum(sebp_jax.sebp_linear(
        x, k, b, top_n=24, active_rows=index, backend=backend) * g)
    return jax.grad(loss, argnums=(0, 1, 2))(x, kernel, bias)

  got = grads(jnp.asarray(index, jnp.int32), g)
  for got_one, want in zip(got, reference_backward(x, kernel, g, kept)):
    np.testing.assert_allclose(got_one, want, rtol=1e-5, atol=1e-6)
  index[index == kept[-1]] = kept[-1] - 40  # The same row, counted from the end.
  missed = grads(jnp.asarray(index, jnp.int32), g)
  assert np.isnan(np.asarray(missed[1])).all() and np.isnan(np.asarray(missed[2])).all()
