"""The masked causal-LM loss against a float64 numpy reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from sebp_jax.losses import linear_cross_entropy, masked_causal_lm_loss


def _reference(logits, ids, mask):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  total, count = 0.0, 0
  for b in range(ids.shape[0]):
    for t in range(ids.shape[1] - 1):
      if mask[b, t] and mask[b, t + 1]:
        total -= log_probs[b, t, ids[b, t + 1]]
        count += 1
  return total / max(count, 1)


def test_matches_the_reference_and_ignores_padding():
  rng = np.random.default_rng(0)
  logits = rng.standard_normal((3, 7, 11)).astype(np.float32) * 3
  ids = rng.integers(0, 11, size=(3, 7)).astype(np.int32)
  mask = (np.arange(7)[None] < np.array([[7], [4], [1]])).astype(np.int32)
  loss = masked_causal_lm_loss(jnp.asarray(logits), ids, mask)
  np.testing.assert_allclose(loss, _reference(logits, ids, mask), rtol=1e-6)
  # Whatever sits at padded positions changes neither the loss nor its gradient's real rows,
  # and the gradient of the padded rows' logits is exactly zero.
  noisy = logits.copy()
  noisy[1, 4:] = rng.standard_normal((3, 11)) * 100
  ids_noisy = ids.copy()
  ids_noisy[2, 1:] = 0
  np.testing.assert_allclose(masked_causal_lm_loss(noisy, ids_noisy, mask), loss, rtol=1e-6)
  grad = jax.grad(masked_causal_lm_loss)(jnp.asarray(logits), ids, mask)
  assert not np.any(grad[1, 3:]) and not np.any(grad[2])  # predicts no real token
  assert np.all(np.any(grad[0, :-1] != 0, axis=-1))


@pytest.mark.parametrize("capacity", [None, 16])
@pytest.mark.parametrize("padding_id", [-100, 11, 10**6])
def test_padding_may_hold_any_id(padding_id, capacity):
  rng = np.random.default_rng(2)
  logits = rng.standard_normal((3, 7, 11)).astype(np.float32)
  ids = rng.integers(0, 11, size=(3, 7)).astype(np.int32)
  mask = (np.arange(7)[None] < np.array([[7], [4], [2]])).astype(np.int32)
  padded = np.where(mask, ids, padding_id).astype(np.int32)
  loss, grad = jax.value_and_grad(masked_causal_lm_loss)(jnp.asarray(logits), padded, mask,
                                                         capacity=capacity)
  np.testing.assert_allclose(loss, _reference(logits, ids, mask), rtol=1e-6)
  want = jax.grad(masked_causal_lm_loss)(jnp.asarray(logits), ids, mask, capacity=capacity)
  np.testing.assert_allclose(grad, want, rtol=1e-6, atol=1e-8)
  # A real token out of the vocabulary is an error of the data: the loss says so.
  broken = padded.copy()
  broken[0, 3] = padding_id
  assert np.isnan(masked_causal_lm_loss(jnp.asarray(logits), broken, mask, capacity=capacity))


def test_bf16_logits_are_summed_in_float32():
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.standard_normal((2, 5, 9)), jnp.bfloat16)
  ids = rng.integers(0, 9, size=(2, 5)).astype(np.int32)
  mask = np.ones((2, 5), np.int32)
  loss = masked_causal_lm_loss(logits, ids, mask)
  assert loss.dtype == jnp.float32
  np.testing.assert_allclose(loss, _reference(np.asarray(logits, np.float32), ids, mask),
                             rtol=1e-5)


def test_no_real_target_gives_zero_not_nan():
  logits = jnp.ones((2, 4, 6))
  ids = np.zeros((2, 4), np.int32)
  mask = np.array([[1, 0, 0, 0], [0, 0, 0, 0]], np.int32)
  assert masked_causal_lm_loss(logits, ids, mask) == 0


@pytest.mark.parametrize("capacity", [None, 3])
def test_an_empty_batch_and_a_mask_given_as_nested_lists(capacity):
  loss = functools.partial(masked_causal_lm_loss, capacity=capacity)
  value, grad = jax.value_and_grad(loss)(jnp.ones((0, 4, 5)), np.zeros((0, 4), np.int32),
                                         np.zeros((0, 4), np.int32))
  assert value == 0 and grad.shape == (0, 4, 5)
  rng = np.random.default_rng(15)
  logits = rng.standard_normal((2, 4, 5)).astype(np.float32)
  ids, mask = [[1, 2, 3, 0], [4, 1, 0, 0]], [[1, 1, 1, 0], [1, 1, 0, 0]]
  np.testing.assert_allclose(loss(logits, ids, mask),
                             _reference(logits, np.array(ids), np.array(mask)), rtol=1e-6)


def test_left_padding_and_holes_count_real_pairs_only():
  """A padding position before a real token predicts nothing: with left padding or holes,
  only predictions from a real token of a real token count, and padding gets no gradient."""
  rng = np.random.default_rng(5)
  logits = jnp.asarray(rng.standard_normal((3, 8, 11)) * 2, jnp.float32)
  ids = rng.integers(0, 11, size=(3, 8)).astype(np.int32)
  mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0, 0, 0]],
                  np.int32)
  want = _reference(logits, ids, mask)
  for capacity in (None, int(mask.sum())):
    loss_fn = functools.partial(masked_causal_lm_loss, capacity=capacity)
    np.testing.assert_allclose(loss_fn(logits, ids, mask), want, rtol=1e-6)
    grad = jax.grad(loss_fn)(logits, ids, mask)
    assert not np.any(np.asarray(grad)[mask == 0])


@pytest.mark.parametrize("capacity", [9, 10, 30])
def test_capacity_gives_the_same_loss_and_gradient(capacity):
  """Rows of real targets gathered into `capacity` slots (9 real targets here): the loss and
  its gradient are those of every row, zero on padding."""
  rng = np.random.default_rng(capacity)
  logits = jnp.asarray(rng.standard_normal((3, 7, 11)) * 3, jnp.float32)
  ids = rng.integers(0, 11, size=(3, 7)).astype(np.int32)
  mask = (np.arange(7)[None] < np.array([[6], [4], [2]])).astype(np.int32)
  assert mask[:, 1:].sum() == 9
  loss = jax.jit(functools.partial(masked_causal_lm_loss, capacity=capacity))
  np.testing.assert_allclose(loss(logits, ids, mask), _reference(logits, ids, mask), rtol=1e-6)
  got = jax.jit(jax.grad(functools.partial(masked_causal_lm_loss, capacity=capacity)))(
      logits, ids, mask)
  np.testing.assert_allclose(got, jax.grad(masked_causal_lm_loss)(logits, ids, mask),
                             rtol=1e-6, atol=1e-7)
  assert not np.any(got[1, 3:]) and not np.any(got[2, 1:])


@pytest.mark.parametrize("capacity", [1, 8])
def test_capacity_too_small_gives_nan_not_a_partial_loss(capacity):
  """More real targets (9) than slots: the loss and its gradient are NaN, not a loss over
  the targets that fit."""
  rng = np.random.default_rng(capacity)
  logits = jnp.asarray(rng.standard_normal((3, 7, 11)), jnp.float32)
  ids = rng.integers(0, 11, size=(3, 7)).astype(np.int32)
  mask = (np.arange(7)[None] < np.array([[6], [4], [2]])).astype(np.int32)
  loss_fn = jax.jit(functools.partial(masked_causal_lm_loss, capacity=capacity))
  assert np.isnan(loss_fn(logits, ids, mask))
  assert np.isnan(jax.grad(loss_fn)(logits, ids, mask)).any()


def test_capacity_must_be_a_static_positive_int():
  logits, ids, mask = jnp.ones((1, 3, 4)), np.zeros((1, 3), np.int32), np.ones((1, 3), np.int32)
  for capacity in (0, 2.5):
    with pytest.raises(ValueError, match="capacity must be a positive Python int"):
      masked_causal_lm_loss(logits, ids, mask, capacity=capacity)
  for head_chunk in ("nonsense", 0, -1, 2.5, True):  # Checked even where no head is read.
    with pytest.raises(ValueError, match="head_chunk must be a positive int, 'auto' or None"):
      masked_causal_lm_loss(logits, ids, mask, head_chunk=head_chunk)


def _head_reference(inputs, kernel, bias, labels, weights):
  """float64 numpy: the weighted cross-entropy sum and its gradients (inputs, kernel, bias)."""
  inputs, kernel = np.asarray(inputs, np.float64), np.asarray(kernel, np.float64)
  logits = inputs @ kernel + (0.0 if bias is None else np.asarray(bias, np.float64))
  shifted = logits - logits.max(-1, keepdims=True)
  probs = np.exp(shifted) / np.exp(shifted).sum(-1, keepdims=True)
  rows = np.arange(len(labels))
  loss = -np.log(probs[rows, labels])
  weights = np.asarray(weights, np.float64)
  logits_grad = weights[:, None] * (probs - np.eye(kernel.shape[1])[labels])
  return ((weights * loss).sum(), logits_grad @ kernel.T, inputs.T @ logits_grad,
          logits_grad.sum(0))


@pytest.mark.parametrize("chunk", [1, 7, 40, 64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_cross_entropy_matches_float64_at_any_chunk(chunk, with_bias):
  """Chunks that divide the rows, leave a remainder, or exceed them: the value and the three
  gradients of the unchunked float64 computation; zero-weight rows count for nothing."""
  rng = np.random.default_rng(chunk)
  rows, features, vocab = 40, 16, 50
  inputs = rng.normal(size=(rows, features)).astype(np.float32)
  kernel = rng.normal(size=(features, vocab)).astype(np.float32) / 4
  bias = rng.normal(size=vocab).astype(np.float32) if with_bias else None
  labels = rng.integers(0, vocab, rows).astype(np.int32)
  weights = (rng.random(rows) < 0.7).astype(np.float32) * rng.uniform(0.5, 2.0, rows)
  weights = weights.astype(np.float32)

  def total(inputs, kernel, bias):
    return linear_cross_entropy(inputs, kernel, bias, labels, weights, chunk=chunk)

  with jax.default_matmul_precision("highest"):
    argnums = (0, 1, 2) if with_bias else (0, 1)
    value, grads = jax.value_and_grad(total, argnums)(inputs, kernel, bias)
    plain = jax.jit(total)(inputs, kernel, bias)  # not differentiated: the value only
  want = _head_reference(inputs, kernel, bias, labels, weights)
  np.testing.assert_allclose(value, want[0], rtol=1e-5)
  np.testing.assert_allclose(plain, want[0], rtol=1e-5)
  for got, expected in zip(grads, want[1:]):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_linear_cross_entropy_nan_weight_poisons_every_gradient_and_keeps_dtypes():
  rng = np.random.default_rng(3)
  inputs = jnp.asarray(rng.normal(size=(12, 8)), jnp.bfloat16)
  kernel = jnp.asarray(rng.normal(size=(8, 30)), jnp.bfloat16)
  bias = jnp.asarray(rng.normal(size=30), jnp.bfloat16)
  labels = rng.integers(0, 30, 12).astype(np.int32)
  weights = np.ones(12, np.float32)
  grad = jax.grad(lambda *a: linear_cross_entropy(*a, labels, weights, chunk=5), (0, 1, 2))
  grads = grad(inputs, kernel, bias)
  assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
  assert all(jnp.isfinite(g).all() for g in grads)
  # Against autodiff of the unchunked bf16 head, as flax's Dense and the loss compute it.
  unchunked = lambda i, k, b: optax.softmax_cross_entropy_with_integer_labels(
      (i @ k + b).astype(jnp.float32), labels).sum()
  want = jax.grad(unchunked, (0, 1, 2))(inputs, kernel, bias)
  for got, expected in zip(grads, want):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                               rtol=0.05, atol=0.05)
  weights[4] = np.nan
  value, grads = jax.value_and_grad(
      lambda *a: linear_cross_entropy(*a, labels, weights, chunk=5), (0, 1, 2))(
          inputs, kernel, bias)
  assert np.isnan(value) and all(jnp.isnan(g).any() for g in grads)


def test_linear_cross_entropy_labels_out_of_the_vocabulary_and_the_weights_gradient():
  """A label out of [0, V) at a non-zero weight makes the value and every gradient NaN (also
  at -1, which an unchecked take would read as class V - 1), and is ignored at weight 0;
  the weights' gradient is each row's cross-entropy, as jax.grad of the plain sum gives."""
  rng = np.random.default_rng(5)
  inputs = rng.normal(size=(9, 6)).astype(np.float32)
  kernel = rng.normal(size=(6, 13)).astype(np.float32)
  labels = rng.integers(0, 13, 9).astype(np.int32)
  weights = rng.uniform(0.5, 2.0, 9).astype(np.float32)
  run = jax.value_and_grad(functools.partial(linear_cross_entropy, chunk=4), (0, 1, 4))
  for bad in (-1, -5, 13, 100):
    broken = labels.copy()
    broken[2] = bad
    value, grads = run(inputs, kernel, None, broken, weights)
    assert np.isnan(value) and np.isnan(grads[0][2]).all() and np.isnan(grads[1]).all()
    unweighted = weights.copy()
    unweighted[2] = 0
    value, grads = run(inputs, kernel, None, broken, unweighted)
    assert np.isfinite(value) and all(np.isfinite(np.asarray(g)).all() for g in grads)

  def plain(inputs, kernel, weights):
    losses = optax.softmax_cross_entropy_with_integer_labels(inputs @ kernel, labels)
    return jnp.sum(weights * losses)

  with jax.default_matmul_precision("highest"):
    value, grads = run(inputs, kernel, None, labels, weights)
    want_value, want = jax.value_and_grad(plain, (0, 1, 2))(inputs, kernel, weights)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for got, expected in zip(grads, want):
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_linear_cross_entropy_float16_sums_the_kernel_gradient_within_range():
  """A mean over 4,096 rows of features about 60 in float16: the kernel's gradient summed over
  the rows passes float16's range where the mean's does not; it stays finite, as jax.grad of
  the unchunked float16 head gives it, and equal to float64. A small one keeps what a loss
  scale saves from float16's underflow."""
  rng = np.random.default_rng(11)
  rows, features, vocab = 4096, 8, 16
  inputs = jnp.asarray(56 + 8 * np.abs(rng.normal(size=(rows, features))), jnp.float16)
  kernel = jnp.asarray(rng.normal(size=(features, vocab)) / 1000, jnp.float16)
  labels = rng.integers(0, vocab, rows).astype(np.int32)
  labels[: rows // 2] = 3
  weights = np.ones(rows, np.float32)
  mean = lambda kernel: linear_cross_entropy(inputs, kernel, None, labels, weights,
                                             chunk=512) / rows
  got = np.asarray(jax.grad(mean)(kernel), np.float64)
  want = _head_reference(inputs, kernel, None, labels, weights)[2] / rows
  assert np.abs(want).max() > 20 and np.isfinite(got).all()
  np.testing.assert_allclose(got, want, rtol=0.01, atol=0.01 * np.abs(want).max())
  # A mean gradient of about 2e-5 a weight, under float16's normal range: a loss scale of
  # 2**14 keeps it there, as it does for jax.grad, when it is applied before the rounding.
  inputs = jnp.asarray(rng.normal(size=(rows, 64)) / 20, jnp.float16)
  kernel = jnp.asarray(rng.normal(size=(64, 512)) / 20, jnp.float16)
  labels = rng.integers(0, 512, rows).astype(np.int32)
  scaled = lambda kernel: 2.0**14 * linear_cross_entropy(inputs, kernel, None, labels, weights,
                                                         chunk=512) / rows
  got = np.asarray(jax.grad(scaled)(kernel), np.float64)
  want = 2.0**14 * _head_reference(inputs, kernel, None, labels, weights)[2] / rows
  assert np.median(np.abs(want)) / 2.0**14 < 6e-5 and np.all(got != 0)
  np.testing.assert_allclose(got, want, rtol=0.02, atol=1e-3 * np.abs(want).max())


def test_float64_is_computed_in_float64_under_x64():
  """float64 inputs and weights (jax_enable_x64): the value and gradients of float64, to
  float64's rounding, where float32 logits would lose them (a gap of 1 between logits of
  1e8: float32 holds them equal)."""
  rng = np.random.default_rng(13)
  inputs, kernel = rng.normal(size=(10, 6)), rng.normal(size=(6, 9))
  inputs[:, 0] = 1e8
  kernel[0] = 1.0
  labels, weights = rng.integers(0, 9, 10), rng.uniform(0.5, 2.0, 10)
  with jax.enable_x64(True):
    value, grads = jax.value_and_grad(
        lambda i, k: linear_cross_entropy(i, k, None, labels, weights, chunk=4), (0, 1))(
            jnp.asarray(inputs), jnp.asarray(kernel))
    logits = np.stack([np.full(4, 1e8), 1e8 + np.arange(4.0)], axis=1)[None]
    ids, mask = np.array([[0, 1, 0, 1]]), np.ones((1, 4), np.int32)
    loss, logits_grad = jax.value_and_grad(masked_causal_lm_loss)(jnp.asarray(logits), ids,
                                                                   mask)
    # A float32 head with numpy's float64 weights: read in float32, the head's dtype.
    narrow = jax.grad(lambda i: linear_cross_entropy(i, jnp.asarray(kernel, jnp.float32), None,
                                                     labels, weights, chunk=4))(
                                                         jnp.asarray(inputs, jnp.float32))
  assert narrow.dtype == jnp.float32 and np.isfinite(narrow).all()
  want = _head_reference(inputs, kernel, None, labels, weights)
  assert value.dtype == jnp.float64 and grads[0].dtype == grads[1].dtype == jnp.float64
  np.testing.assert_allclose(value, want[0], rtol=1e-8)
  for got, expected in zip(grads, want[1:3]):
    np.testing.assert_allclose(got, expected, rtol=1e-7, atol=1e-7)
  assert loss.dtype == jnp.float64
  np.testing.assert_allclose(loss, _reference(logits, ids, mask), rtol=1e-7)
  # A mean over 3 targets; logits 1e8, 1e8 predicting 1, then 1e8, 1e8 + 1 predicting 0.
  np.testing.assert_allclose(logits_grad[0, 0], [0.5 / 3, -0.5 / 3], rtol=1e-7)
  np.testing.assert_allclose(logits_grad[0, 1, 0], -np.e / (1 + np.e) / 3, rtol=1e-7)


def test_linear_cross_entropy_checks_its_arguments_and_promotes_as_the_head_does():
  """Shapes other than [N, D], [D, V], [V], [N], [N] and a chunk other than a positive int
  raise naming the argument (an [B, L, D] input once paired rows with other rows' labels);
  mixed dtypes are computed in their common dtype, as a Dense head computes them, and each
  gradient comes back in its own; a chunk past the rows holds no more logits than the rows."""
  rng = np.random.default_rng(14)
  inputs = rng.normal(size=(6, 4)).astype(np.float32)
  kernel = rng.normal(size=(4, 7)).astype(np.float32)
  labels, weights = rng.integers(0, 7, 6).astype(np.int32), np.ones(6, np.float32)
  call = functools.partial(linear_cross_entropy, inputs, kernel, None, labels, weights, chunk=4)
  for bad, match in ((dict(inputs=inputs.reshape(2, 3, 4)), "inputs must be .N, D."),
                     (dict(kernel=kernel[:3]), "kernel .D, V."),
                     (dict(bias=np.zeros(6)), r"bias must be \[V\] = \(7,\)"),
                     (dict(labels=labels[:4]), r"labels must be \[N\] = \(6,\)"),
                     (dict(weights=weights[:, None]), r"weights must be \[N\] = \(6,\)")):
    arguments = dict(inputs=inputs, kernel=kernel, bias=None, labels=labels, weights=weights)
    with pytest.raises(ValueError, match=match):
      linear_cross_entropy(**(arguments | bad), chunk=4)
  for chunk in (0, -1, 2.5, None, "auto", True):
    with pytest.raises(ValueError, match="chunk must be a positive int"):
      linear_cross_entropy(inputs, kernel, None, labels, weights, chunk=chunk)
  assert "4096" not in str(jax.make_jaxpr(lambda: call(chunk=4096))())
  half = jnp.asarray(kernel, jnp.bfloat16)

  def dense(inputs, kernel):
    logits = (inputs @ kernel.astype(jnp.float32))
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).sum()

  got = jax.grad(lambda i, k: linear_cross_entropy(i, k, None, labels, weights, chunk=4),
                 (0, 1))(inputs, half)
  want = jax.grad(dense, (0, 1))(inputs, half)
  assert got[0].dtype == jnp.float32 and got[1].dtype == jnp.bfloat16
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[1], np.float32), np.asarray(want[1], np.float32),
                             rtol=1e-2)


def test_wide_host_ids_past_int32_are_out_of_the_vocabulary():
  """int64 ids from the host (a tokenizer's), narrowed to int32 without x64: an id of
  2**32 + 7 at a real target is out of the vocabulary (the loss and gradients NaN), not id 7;
  at padding it is ignored, as any id."""
  rng = np.random.default_rng(12)
  logits = jnp.asarray(rng.standard_normal((2, 5, 11)), jnp.float32)
  mask = (np.arange(5)[None] < np.array([[5], [3]])).astype(np.int32)
  ids = rng.integers(0, 11, size=(2, 5)).astype(np.int64)
  want = _reference(logits, ids, mask)
  for capacity in (None, 8):
    loss = functools.partial(masked_causal_lm_loss, capacity=capacity)
    wide = ids.copy()
    wide[1, 4] = 2**32 + 7  # padding
    np.testing.assert_allclose(loss(logits, wide, mask), want, rtol=1e-6)
    wide[0, 2] = 2**32 + int(ids[0, 2])  # a real target
    value, grad = jax.value_and_grad(loss)(logits, wide, mask)
    assert np.isnan(value) and np.isnan(np.asarray(grad)).any()
  inputs = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=(6, 11)), jnp.float32)
  labels = np.array([1, 2**33 + 1, 3, 4], np.uint64)
  value = linear_cross_entropy(inputs, kernel, None, labels, np.ones(4, np.float32), chunk=2)
  assert np.isnan(value)


def test_a_mask_of_other_values_than_zero_and_one_raises():
  logits = jnp.zeros((1, 4, 5))
  ids = jnp.ones((1, 4), jnp.int32)
  for mask in (np.array([[1, 1, 0.25, 0.25]]), np.array([[1, 1, -1, 0]])):
    with pytest.raises(ValueError, match="attention_mask must hold 1"):
      masked_causal_lm_loss(logits, ids, mask)
    # Traced: the loss and its gradient NaN (at every position that predicts a token).
    value, grad = jax.jit(jax.value_and_grad(masked_causal_lm_loss))(logits, ids, mask)
    assert np.isnan(value) and np.isnan(grad[0, :2]).all()
  for mask in (np.array([[True, True, False, False]]), np.array([[1.0, 1.0, 0.0, 0.0]])):
    np.testing.assert_allclose(masked_causal_lm_loss(logits, ids, mask), np.log(5), rtol=1e-6)


def test_ids_and_mask_must_be_the_logits_batch_and_length():
  """Positions are matched by place: ids or a mask of another shape (logits cut to
  ``[:, :-1]``, a mask broadcast over the batch, ``[L, B]`` of the same size) would read
  other positions' targets and weights, so they raise, with or without a capacity."""
  rng = np.random.default_rng(7)
  logits = jnp.asarray(rng.standard_normal((2, 3, 7)), jnp.float32)
  ids = rng.integers(0, 7, size=(2, 3)).astype(np.int32)
  mask = np.ones((2, 3), np.int32)
  for capacity in (None, 4):
    loss = functools.partial(masked_causal_lm_loss, capacity=capacity)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, L\] = \(2, 2\)"):
      loss(logits[:, :-1], ids, mask)
    with pytest.raises(ValueError, match=r"attention_mask must be \[B, L\] = \(2, 3\)"):
      loss(logits, ids, mask[:1])
    with pytest.raises(ValueError, match=r"input_ids must be \[B, L\] = \(2, 3\)"):
      loss(logits, ids.T, mask.T)
  with pytest.raises(ValueError, match=r"logits must be \[B, L, V\]"):
    masked_causal_lm_loss(logits[0], ids, mask)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.uint16])
def test_ids_of_a_narrow_integer_dtype_give_the_int32_loss(dtype):
  """A vocabulary of as many ids as the ids' dtype holds (256 for uint8): the ids are compared
  with its size as int32, where their own dtype would wrap it (to 0 for uint8)."""
  vocab = int(np.iinfo(dtype).max) + 1
  rng = np.random.default_rng(8)
  logits = jnp.asarray(rng.standard_normal((2, 6, vocab)), jnp.float32)
  ids = rng.integers(0, vocab, size=(2, 6))
  ids[0, 2] = vocab - 1
  mask = (np.arange(6)[None] < np.array([[6], [4]])).astype(np.int32)
  want = _reference(logits, ids, mask)
  for capacity in (None, 8):
    loss = functools.partial(masked_causal_lm_loss, capacity=capacity)
    np.testing.assert_allclose(loss(logits, ids.astype(dtype), mask), want, rtol=1e-6)
    np.testing.assert_array_equal(jax.grad(loss)(logits, ids.astype(dtype), mask),
                                  jax.grad(loss)(logits, ids.astype(np.int32), mask))
  x = jnp.asarray(rng.standard_normal((5, 4)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((4, vocab)), jnp.float32)
  labels, weights = ids.reshape(-1)[:5], jnp.ones(5)
  np.testing.assert_array_equal(
      linear_cross_entropy(x, kernel, None, labels.astype(dtype), weights, chunk=2),
      linear_cross_entropy(x, kernel, None, labels.astype(np.int32), weights, chunk=2))
  with pytest.raises(ValueError, match="input_ids must be integer token ids"):
    masked_causal_lm_loss(logits, ids.astype(np.float32), mask)


def test_a_capacity_one_short_of_more_than_2_to_the_24_targets_gives_nan():
  """The targets are counted as integers: a float32 sum of 2**24 + 1 ones is 2**24, which
  would let a capacity of 2**24 drop the last target silently."""
  length = 2**24 + 2
  loss = jax.jit(functools.partial(masked_causal_lm_loss, capacity=2**24))
  assert np.isnan(loss(jnp.zeros((1, length, 1)), jnp.zeros((1, length), jnp.int32),
                       jnp.ones((1, length), jnp.int8)))
