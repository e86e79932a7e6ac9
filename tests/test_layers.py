"""`SEBPDense` as a drop-in for `flax.linen.Dense` inside Flax models."""

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sebp_jax import SEBPDense, SEBPEmbed, resolve_top_n
from tests.reference import random_sparse_rows, reference_backward, relative_error


def test_has_every_dense_attribute_with_the_same_defaults():
  dense_fields = {f.name: f for f in dataclasses.fields(nn.Dense)}
  sebp_fields = {f.name: f for f in dataclasses.fields(SEBPDense)}
  for name, field in dense_fields.items():
    assert name in sebp_fields
    assert sebp_fields[name].default == field.default
  assert {"top_n", "threshold", "backend"} <= set(sebp_fields)


@pytest.mark.parametrize("dtype,param_dtype", [
    (None, jnp.float32), (jnp.bfloat16, jnp.float32), (jnp.float16, jnp.float16)])
@pytest.mark.parametrize("use_bias", [True, False])
def test_forward_is_bit_identical_and_params_interchange(dtype, param_dtype, use_bias):
  x = jax.random.normal(jax.random.key(0), (3, 7, 20))
  dense = nn.Dense(9, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype)
  sebp = SEBPDense(9, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, top_n=5)
  params = dense.init(jax.random.key(1), x)
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, sebp.init(
      jax.random.key(1), x))
  for apply in (lambda m: m.apply(params, x), lambda m: jax.jit(m.apply)(params, x)):
    want, got = apply(dense), apply(sebp)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_float32_params_computed_in_low_precision_get_gradients_rounded_once(dtype):
  # The cast to the compute dtype happens inside the op: dW and db come back in float32
  # straight from the float32 sums, where autodiff through nn.Dense's cast rounds them to
  # the compute dtype first. dX stays in the dtype of x.
  rng = np.random.default_rng(4)
  x = jnp.asarray(rng.standard_normal((2, 24, 16)), dtype)
  dy = random_sparse_rows(rng, 48, 12, 20, np.float32).reshape(2, 24, 12)
  dy = jnp.asarray(dy, dtype)
  module = SEBPDense(12, dtype=dtype, top_n=24, backend="xla")
  params = module.init(jax.random.key(0), x)
  _, vjp = jax.vjp(lambda p, x: module.apply(p, x), params, x)
  d_params, dx = vjp(dy)
  d_kernel, d_bias = d_params["params"]["kernel"], d_params["params"]["bias"]
  assert (dx.dtype, d_kernel.dtype, d_bias.dtype) == (dtype, jnp.float32, jnp.float32)
  kernel = jnp.asarray(params["params"]["kernel"], dtype)
  rows = np.flatnonzero(np.asarray(dy, np.float32).reshape(48, 12).any(axis=1))
  want = reference_backward(x.reshape(48, 16), kernel, dy.reshape(48, 12), rows)
  # Products of two 16-bit floats are exact in float32: only float32 summation error is left.
  assert relative_error(d_kernel, want[1]) <= 1e-6
  assert relative_error(d_bias, want[2]) <= 1e-6
  assert relative_error(dx.reshape(48, 16), want[0]) <= {jnp.bfloat16: 1e-2,
                                                         jnp.float16: 2e-3}[dtype]
  _, dense_vjp = jax.vjp(lambda p: nn.Dense(12, dtype=dtype).apply(p, x), params)
  (dense_params,) = dense_vjp(dy)  # rounded to the compute dtype, then widened
  assert relative_error(dense_params["params"]["kernel"], want[1]) > 1e-5


def test_low_precision_params_computed_in_float32_get_gradients_rounded_once():
  # The reverse of the test above: the matmul stores dW in the bf16 parameter dtype straight
  # from the float32 sums, each element within half a bf16 ulp of them.
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((48, 16)), jnp.float32)
  dy = jnp.asarray(random_sparse_rows(rng, 48, 12, 20, np.float32))
  module = SEBPDense(12, dtype=jnp.float32, param_dtype=jnp.bfloat16, top_n=24, backend="xla")
  params = module.init(jax.random.key(0), x)
  _, vjp = jax.vjp(lambda p, x: module.apply(p, x), params, x)
  d_params, dx = vjp(dy)
  d_kernel, d_bias = d_params["params"]["kernel"], d_params["params"]["bias"]
  assert (dx.dtype, d_kernel.dtype, d_bias.dtype) == (jnp.float32, jnp.bfloat16, jnp.bfloat16)
  kernel = jnp.asarray(params["params"]["kernel"], jnp.float32)
  rows = np.flatnonzero(np.asarray(dy).any(axis=1))
  want = reference_backward(x, kernel, dy, rows)
  assert np.all(np.abs(np.asarray(d_kernel, np.float64) - want[1])
                <= 2.0**-8 * np.abs(want[1]) + 1e-6)
  assert relative_error(dx, want[0]) <= 1e-5


def test_a_custom_promote_dtype_is_applied_as_in_dense():
  def promote_to_float16(*args, dtype=None, inexact=True):
    del dtype, inexact
    return [None if a is None else jnp.asarray(a, jnp.float16) for a in args]

  x = jax.random.normal(jax.random.key(0), (4, 6, 10))
  dense = nn.Dense(5, promote_dtype=promote_to_float16)
  # 12 of the 24 rows reach the loss: the sparse path runs, and keeps exactly those.
  sebp = SEBPDense(5, promote_dtype=promote_to_float16, top_n=12, backend="xla")
  params = dense.init(jax.random.key(1), x)
  want, got = dense.apply(params, x), sebp.apply(params, x)
  assert got.dtype == want.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
  grad = lambda m: jax.grad(lambda p: jnp.sum(
      m.apply(p, x)[:2].astype(jnp.float32) ** 2))(params)
  for a, b in zip(jax.tree.leaves(grad(sebp)), jax.tree.leaves(grad(dense))):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=2e-2, atol=2e-2)


class Classifier(nn.Module):
  """Token features -> two linear layers -> masked mean-pool -> logits; padding is masked."""
  dense_cls: type = nn.Dense
  top_n: int | float | str = 1.0
  overflow: str = "exact"

  def _dense(self, features, name):
    if self.dense_cls is SEBPDense:  # "xla": "auto" runs such small layers dense on a GPU.
      return SEBPDense(features, top_n=self.top_n, overflow=self.overflow, backend="xla",
                       name=name)
    return nn.Dense(features, name=name)

  @nn.compact
  def __call__(self, tokens, mask):
    h = nn.gelu(self._dense(32, "up")(tokens))
    h = self._dense(16, "down")(h)
    pooled = jnp.sum(h * mask[..., None], axis=1) / jnp.sum(mask, axis=1, keepdims=True)
    return nn.Dense(2, name="head")(pooled)


def _classifier_data(seed=0, batch=4, length=12, features=8):
  rng = np.random.default_rng(seed)
  tokens = rng.standard_normal((batch, length, features)).astype(np.float32)
  lengths = rng.integers(1, length // 2, size=batch)
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.float32)
  labels = rng.integers(0, 2, size=batch)
  return tokens, mask, labels, int(lengths.sum())


def test_gradients_equal_dense_in_a_masked_model():
  tokens, mask, labels, num_real = _classifier_data()
  params = Classifier().init(jax.random.key(0), tokens, mask)

  def loss(params, model):
    logits = model.apply(params, tokens, mask)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  want = jax.grad(loss)(params, Classifier())
  got = jax.jit(jax.grad(loss), static_argnums=1)(
      params, Classifier(dense_cls=SEBPDense, top_n=num_real))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got, want)
  # Exact by default whatever top_n; and the padding rows really are zero in dY, so dropping
  # one more row must change something.
  for top_n in ("auto", num_real - 1):
    exact = jax.grad(loss)(params, Classifier(dense_cls=SEBPDense, top_n=top_n))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), exact,
                 want)
  fewer = jax.grad(loss)(params, Classifier(dense_cls=SEBPDense, top_n=num_real - 1,
                                            overflow="drop"))
  assert not np.allclose(fewer["params"]["up"]["kernel"], want["params"]["up"]["kernel"])


class ResidualLayer(nn.Module):
  """h + tanh(Dense(h)), in the (carry, x) -> (carry, y) form that `nn.scan` expects."""
  dense_cls: type = nn.Dense
  top_n: int = 1

  @nn.compact
  def __call__(self, h, _):
    kwargs = {"top_n": self.top_n, "backend": "xla"} if self.dense_cls is SEBPDense else {}
    return h + nn.tanh(self.dense_cls(h.shape[-1], name="dense", **kwargs)(h)), None


class ScannedStack(nn.Module):
  """`num_layers` residual linear layers under `nn.scan` (and optionally `nn.remat`)."""
  dense_cls: type = nn.Dense
  top_n: int = 1
  remat: bool = False
  num_layers: int = 3

  @nn.compact
  def __call__(self, h):
    layer = nn.remat(ResidualLayer) if self.remat else ResidualLayer
    scanned = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=self.num_layers)
    h, _ = scanned(self.dense_cls, self.top_n, name="layers")(h, None)
    return h


@pytest.mark.parametrize("remat", [False, True])
def test_scan_and_remat_over_layers(remat):
  tokens, mask, _, num_real = _classifier_data(seed=1)
  params = ScannedStack(remat=remat).init(jax.random.key(2), tokens)

  def loss(params, model):
    h = model.apply(params, tokens)
    return jnp.sum(jnp.sum(h, -1) * mask)  # padding positions carry no loss

  want = jax.grad(loss)(params, ScannedStack(remat=remat))
  got = jax.jit(jax.grad(loss), static_argnums=1)(
      params, ScannedStack(dense_cls=SEBPDense, top_n=num_real, remat=remat))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)


def test_kept_fraction():
  assert resolve_top_n(0.25, 10) == 3
  assert resolve_top_n(1.0, 10) == 10
  assert resolve_top_n(7, 10) == 7
  assert resolve_top_n(0.07, 100) == 7  # As written, where 0.07 * 100 is 7.000000000000001.
  for fraction in (np.float32(0.07), np.float16(0.07), np.float64(0.07)):
    assert resolve_top_n(fraction, 100) == 7
    assert resolve_top_n(SEBPDense(2, top_n=fraction).top_n, 100) == 7
  with pytest.raises(ValueError, match="kept fraction"):
    resolve_top_n(1.5, 10)
  x = jnp.ones((2, 4, 3))
  layer = SEBPDense(2, top_n=0.5)
  params = layer.init(jax.random.key(0), x)
  assert layer.apply(params, x).shape == (2, 4, 2)


@pytest.mark.parametrize("layer", [SEBPDense, functools.partial(SEBPEmbed, 12)])
def test_a_fraction_and_a_row_count_of_equal_value_are_different_layers(layer):
  """`top_n=1.0` (every row) and `top_n=1` (one row) neither compare nor hash equal, so a
  jitted step that takes the layer as a static argument compiles each: every row's gradient
  is the dense one, one row's drops the others."""
  every, one = layer(4, top_n=1.0, overflow="drop"), layer(4, top_n=1, overflow="drop")
  assert every != one and hash(every) != hash(one) and every.top_n == 1.0
  assert layer(4, top_n=0.5) == layer(4, top_n=0.5)
  rng = np.random.default_rng(9)
  dense_layer = nn.Dense(4) if layer is SEBPDense else nn.Embed(12, 4)
  inputs = (jnp.asarray(rng.standard_normal((6, 3)), jnp.float32) if layer is SEBPDense
            else jnp.asarray(rng.integers(0, 12, 6), jnp.int32))
  params = dense_layer.init(jax.random.key(0), inputs)
  weights = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)

  @functools.partial(jax.jit, static_argnums=0)
  def grads(module, params):
    return jax.grad(lambda p: jnp.sum(module.apply(p, inputs) * weights))(params)

  want = grads(dense_layer, params)
  starved = grads(one, params)
  for got, expected in zip(jax.tree.leaves(grads(every, params)), jax.tree.leaves(want)):
    np.testing.assert_allclose(got, expected, rtol=1e-6)
  assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(starved),
                                                   jax.tree.leaves(want)))


def test_top_n_defaults_to_auto_and_custom_dot_general_is_rejected():
  assert SEBPDense(4).top_n == SEBPEmbed(3, 4).top_n == "auto"
  assert SEBPDense(4).overflow == "exact"
  layer = SEBPDense(4, top_n=2, dot_general=jax.lax.dot_general)
  with pytest.raises(ValueError, match="dot_general"):
    layer.init(jax.random.key(0), jnp.ones((2, 3)))


def test_a_row_log_and_ids_of_the_wrong_kind_raise():
  """As nn.Embed, a one-row table takes integer ids only; a row log must be a RowLog."""
  with pytest.raises(ValueError, match="Input type must be an integer"):
    nn.Embed(1, 3).init(jax.random.key(0), jnp.zeros((2,)))
  with pytest.raises(ValueError, match="ids must be integer token ids"):
    SEBPEmbed(1, 3).init(jax.random.key(0), jnp.zeros((2,)))
  for layer, inputs in ((SEBPDense(4, row_log="log"), jnp.ones((2, 3))),
                        (SEBPEmbed(5, 3, row_log=1), jnp.zeros((2,), jnp.int32))):
    with pytest.raises(ValueError, match="row_log must be a sebp_jax.RowLog"):
      layer.init(jax.random.key(0), inputs)
