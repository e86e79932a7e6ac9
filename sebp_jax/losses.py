"""Losses for padded batches whose padding must not reach the gradient."""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sebp_jax.ops import validate_top_n
from sebp_jax.outputs import LinearHead, head_of, packed_rows_of
from sebp_jax.packing import check_token_flags, gather_tokens, invalid_slots
from sebp_jax.sharding import check_devices_weighed_alike, vary_alike

#: ``head_chunk="auto"``: a packed LM head's ``[C, V]`` float32 logits above this many bytes
#: are computed in chunks of rows, each at most :data:`HEAD_CHUNK_BYTES`.
HEAD_CHUNK_ABOVE_BYTES = 1 << 33
HEAD_CHUNK_BYTES = 1 << 28


def masked_causal_lm_loss(logits: jax.Array, input_ids: jax.Array, attention_mask: jax.Array, *,
                          capacity: int | None = None,
                          head_chunk: int | str | None = "auto") -> jax.Array:
  """Mean next-token cross-entropy over real tokens only.

  Args:
    logits: ``[B, L, V]`` predictions for each position. Where they are the output of an LM
      head run on the real tokens (``use_sebp(packed=True)``, or
      :meth:`~sebp_jax.packing.PackedDecoderInputs.unpack`), the loss reads the head's
      ``[C, V]`` packed rows instead: the ``[B, L, V]`` logits are then never made (unless
      something else reads them), and the value is the same. Padding was not computed
      there, so a loss mask that counts a prediction from a position the model's mask calls
      padding makes the loss and its gradient NaN: the loss mask must be a part of the
      model's (a prompt left out, say).
    input_ids: ``[B, L]`` tokens, padded anywhere (right, left, holes). Padding may hold any
      id (0, -100, the vocabulary size); a real target's id out of ``[0, V)`` makes the loss
      and its gradient NaN.
    attention_mask: ``[B, L]``, 1 (or True) for real tokens, 0 for padding; a concrete mask
      with other values (weights) raises.
    capacity: optional static count of rows for the log-softmax over the vocabulary: the
      positions whose target is real are gathered into ``[capacity, V]`` and only those are
      normalised (forward and backward) instead of every position, padding included (the
      logits elsewhere are not read: a NaN there stays out of the loss and gradient). The
      real tokens of the batch (``attention_mask.sum()``) always suffice. Packed logits have
      their rows already, and ignore it. A batch with more such positions than
      ``capacity`` gets a NaN loss and gradient, never a silently partial one (an exact
      fallback would be a run-time branch, ``lax.cond``, in every step, which stalls the
      GPU's queue; :func:`sebp_jax.token_capacity` picks a capacity on the host).
    head_chunk: where the logits are a packed Dense LM head's (``use_sebp(packed=True,
      lm_head=...)`` on a Linen model), compute them from the head's inputs and kernel this
      many rows at a time (:func:`linear_cross_entropy`), so that the ``[C, V]`` logits are
      never held at once either: an int, ``"auto"`` (default: chunks of at most
      :data:`HEAD_CHUNK_BYTES` of float32 logits where all of them would pass
      :data:`HEAD_CHUNK_ABOVE_BYTES`), or None (the packed rows, whole). Other logits are
      read whole, but for those of a head whose vocabulary is split over devices
      (:func:`sebp_jax.sharding.fsdp_loss`), packed or not: they are computed on each
      device's columns (:func:`vocab_split_cross_entropy`), all rows at once, unless
      ``head_chunk`` chunks packed ones (then the kernel is gathered whole for the chunks).

  Returns:
    Scalar: position t predicts token t + 1, counted where tokens t and t + 1 are real. Padding
    positions get exactly zero weight, so their rows of every layer's output gradient are
    exactly zero (what SEBP with a shared mask index relies on).
  """
  if np.ndim(logits) != 3:
    raise ValueError(f"logits must be [B, L, V], got shape {np.shape(logits)}")
  batch, length, vocab = logits.shape
  for name, array in (("input_ids", input_ids), ("attention_mask", attention_mask)):
    if np.shape(array) != (batch, length):
      raise ValueError(f"{name} must be [B, L] = {(batch, length)}, the logits' first two "
                       f"dimensions (position t's logits predict token t + 1 of the same "
                       f"[B, L]), got shape {np.shape(array)}")
  input_ids = _token_ids(input_ids, "input_ids")
  check_devices_weighed_alike("masked_causal_lm_loss", "causal_lm_target_count")
  if head_chunk is not None and head_chunk != "auto" and not (
      isinstance(head_chunk, numbers.Integral) and not isinstance(head_chunk, bool)
      and head_chunk > 0):
    raise ValueError(f"head_chunk must be a positive int, 'auto' or None, got {head_chunk!r}")
  # Targets and weights on all L positions (the last one weighs 0), so that the logits are
  # read in place rather than copied without their last column.
  labels = jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1)))
  weights = _target_weights(attention_mask)
  packed = packed_rows_of(logits)
  if packed is not None:
    # A target out of the vocabulary makes the loss NaN (below, per row), here also one that
    # the packed rows do not hold (a loss mask other than the model's may count it): NaN
    # weights for its row, a reduction along the row, which no device boundary splits.
    out_of_vocab = ((labels < 0) | (labels >= vocab)) & (weights != 0)
    weights = jnp.where(jnp.any(out_of_vocab, axis=1, keepdims=True), jnp.nan, weights)
    # A target at a position the packing left out (padding of the model's mask): the padded
    # batch computed logits there, the packed rows hold none. Its NaN weight makes the count
    # of targets NaN, and so the loss and every gradient.
    weights = jnp.where((weights != 0) & ~packed.layout.mask, jnp.nan, weights)
  num_targets = jnp.sum(weights)
  poison = jnp.float32(0)
  if capacity is not None:
    capacity = validate_top_n(capacity, "capacity")
    if packed is None:
      # Counted as integers: a float32 sum stops counting one by one past 2**24 targets.
      poison = jnp.where(jnp.count_nonzero(weights) > capacity, jnp.nan, 0.0)
  head = None
  if packed is not None:
    layout = packed.layout
    rows, head = packed.rows[0], packed.head
    # Each packed row's label and weight (filler: label 0, weight 0), NaN where the batch
    # (a shard of it) overflowed the packing capacity: the scattered logits would be NaN.
    labels, weights = (gather_tokens(a, layout)[0] for a in (labels, weights))
    poison = poison + invalid_slots(layout)
  else:
    labels, weights = labels.reshape(-1), weights.reshape(-1)
    rows = logits.reshape(batch * length, vocab)
    head = head_of(logits)
    if capacity is not None:
      # Unused slots read row R (out of range): zero logits, label 0, weight 0.
      (positions,) = jnp.nonzero(weights, size=capacity, fill_value=weights.shape[0])
      take = lambda a: (jnp.take(a, positions, axis=0, mode="fill", fill_value=0,
                                 indices_are_sorted=True) if a.shape[0]
                        else jnp.zeros((capacity, *a.shape[1:]), a.dtype))  # An empty batch.
      rows, labels, weights = take(rows), take(labels), take(weights)
      if head is not None:
        head = head.replace(inputs=take(head.inputs))
  weights = weights + poison  # NaN: the loss and every gradient behind it
  labels, weights = _labels_in_vocabulary(labels, weights, vocab)
  chunk = _head_chunk(head_chunk, head if packed is not None else None, rows.shape[0], vocab)
  if head is not None and head.vocab_axis is not None and chunk is None:
    total = vocab_split_cross_entropy(head, labels, weights)
  elif chunk is not None:
    if head.vocab_axis is not None:  # Every chunk reads every column: the kernel, gathered.
      gather = lambda a: jax.lax.all_gather(a, head.vocab_axis, axis=a.ndim - 1, tiled=True)
      head = head.replace(kernel=gather(head.kernel),
                          bias=None if head.bias is None else gather(head.bias),
                          vocab_axis=None)
    total = linear_cross_entropy(head.inputs, head.kernel, head.bias, labels, weights,
                                 chunk=chunk, precision=head.precision)
  else:
    token_loss = optax.softmax_cross_entropy_with_integer_labels(
        rows.astype(_loss_dtype(rows.dtype)), labels)
    total = _weighted_sum(token_loss, weights)
  return total / jnp.maximum(num_targets, 1.0)


def _target_weights(attention_mask: jax.Array) -> jax.Array:
  """``[B, L]`` float32: 1 where position t predicts a real token t + 1. A prediction counts
  when both its position and its target are real tokens: with left padding or holes, a
  padding position before a real token predicts nothing."""
  weighted = check_token_flags(attention_mask, "attention_mask",
                               "the loss counts real tokens, it does not weigh them")
  real = jnp.asarray(attention_mask) != 0
  weights = jnp.pad(real[:, 1:] & real[:, :-1], ((0, 0), (0, 1))).astype(jnp.float32)
  if weighted is None:
    return weights
  # NaN at each such value (no reduction: a batch split over devices needs no collective),
  # and so the count of targets, the loss and every gradient.
  return jnp.where(weighted | jnp.pad(weighted[:, 1:], ((0, 0), (0, 1))), jnp.nan, weights)


def causal_lm_target_count(attention_mask: jax.Array) -> jax.Array:
  """The predictions :func:`masked_causal_lm_loss` averages over (a float32 scalar): a
  batch's weight among others, such as each device's in :func:`sebp_jax.sharding.fsdp_loss`."""
  return jnp.sum(_target_weights(attention_mask))


def _head_chunk(head_chunk, head: LinearHead | None, num_rows: int, vocab: int) -> int | None:
  """The rows per chunk of :func:`linear_cross_entropy` for ``head_chunk``, or None: the
  packed rows whole."""
  if head_chunk is None or head is None:
    return None
  if head_chunk == "auto":
    return None if num_rows * vocab * 4 <= HEAD_CHUNK_ABOVE_BYTES else head_chunk_rows(vocab)
  return int(head_chunk)  # Checked by the caller.


def head_chunk_rows(vocab: int) -> int:
  """Rows per chunk of ``head_chunk="auto"``: at most :data:`HEAD_CHUNK_BYTES` of float32
  logits, a multiple of 8."""
  return max(8, HEAD_CHUNK_BYTES // (4 * vocab) // 8 * 8)


def _token_ids(ids: jax.Array, name: str) -> jax.Array:
  """``ids`` of an integer dtype, at least 32 bits wide: compared with a vocabulary size, a
  narrower dtype would wrap it (256 is 0 as a uint8)."""
  if not isinstance(ids, jax.Array):
    host = np.asarray(ids)
    if np.issubdtype(host.dtype, np.integer) and host.dtype.itemsize > 4:
      # A tokenizer's int64 ids become int32 without x64: one past int32's range would wrap
      # to another id, maybe a valid one. It is out of every vocabulary: -1 says so. (Passed
      # to a jitted step, JAX narrows them at its boundary, before this sees them.)
      info = np.iinfo(np.int32)
      fits = (host >= info.min) & (host <= info.max)
      ids = np.where(fits, host, 0).astype(np.int64)
      ids[~fits] = -1
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be integer token ids, got dtype {ids.dtype}")
  return ids.astype(jnp.int32) if ids.dtype.itemsize < 4 else ids


def _labels_in_vocabulary(labels: jax.Array, weights: jax.Array,
                          vocab: int) -> tuple[jax.Array, jax.Array]:
  """``(labels, weights)`` with each label out of ``[0, vocab)`` read as class 0: padding may
  hold any id (-100, the vocabulary size) at its zero weight; a row of non-zero weight with
  such a label weighs NaN, so the loss and every gradient are NaN."""
  in_vocab = (labels >= 0) & (labels < vocab)
  return (jnp.where(in_vocab, labels, 0),
          jnp.where(in_vocab | (weights == 0), weights, jnp.nan))


def _weighted_sum(token_loss: jax.Array, weights: jax.Array) -> jax.Array:
  """``sum(weights * token_loss)`` over the rows of non-zero weight (a NaN weight counts)."""
  return jnp.sum(jnp.where(weights == 0, 0.0, token_loss * weights))


def vocab_split_cross_entropy(head: LinearHead, labels: jax.Array,
                              weights: jax.Array) -> jax.Array:
  """``sum_r weights[r] * cross_entropy(logits[r], labels[r])`` over this device's rows of
  non-zero weight, for logits ``head.inputs @ kernel + bias`` of a head whose kernel's columns
  (the vocabulary) are split over the devices of ``head.vocab_axis``, in a ``jax.shard_map``.

  Each device computes its columns' logits for every device's rows: the rows' inputs and
  labels are gathered (``[devices * N, D]``, where the kernel is ``[D, V]``), and what
  crosses devices after is per row: the maximum, the sum of exponentials and the label's
  logit. Under ``jax.grad`` the inputs' gradient is reduce-scattered back to the rows'
  devices and the kernel's stays on its own.

  Args:
    head: ``inputs [N, D]`` (this device's rows), ``kernel [D, V / devices]`` and ``bias``
      (this device's columns), ``vocab_axis``.
    labels: ``int[N]`` in ``[0, V)``.
    weights: ``float32[N]``; a NaN weight makes the sum and every gradient NaN.
  """
  axis = head.vocab_axis
  gather = functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)
  to_owners = functools.partial(jax.lax.psum_scatter, axis_name=axis, tiled=True)
  logits = jnp.dot(gather(head.inputs), head.kernel, precision=head.precision)
  if head.bias is not None:
    logits = logits + head.bias
  logits = logits.astype(_loss_dtype(logits.dtype))
  columns = logits.shape[-1]
  device = jax.lax.axis_index(axis)
  local_labels = gather(labels) - device * columns
  owned = (local_labels >= 0) & (local_labels < columns)
  label_logits = jnp.take_along_axis(logits, jnp.where(owned, local_labels, 0)[:, None],
                                     axis=-1)[:, 0]
  # The rows' maxima over the whole vocabulary keep the exponentials finite; they cancel
  # out of the value, so they carry no gradient.
  top = jax.lax.pmax(jax.lax.stop_gradient(jnp.max(logits, axis=-1)), axis)
  exp_sums = to_owners(jnp.sum(jnp.exp(logits - top[:, None]), axis=-1))
  label_logits = to_owners(jnp.where(owned, label_logits, 0.0))
  own_top = top.reshape(-1, labels.shape[0])[device]
  return _weighted_sum(own_top + jnp.log(exp_sums) - label_logits, weights)


def _loss_dtype(dtype) -> jnp.dtype:
  """The dtype logits of ``dtype`` are normalised in: float32, or float64 for float64."""
  return jnp.promote_types(dtype, jnp.float32)


def _padded_chunks(array: jax.Array, chunk: int) -> jax.Array:
  """``array: [N, ...]`` as ``[ceil(N / chunk), chunk, ...]``, zeros past its end."""
  extra = -array.shape[0] % chunk
  array = jnp.pad(array, ((0, extra),) + ((0, 0),) * (array.ndim - 1))
  return array.reshape(-1, chunk, *array.shape[1:])


def _chunk_cross_entropy(rows, labels, kernel, bias, precision):
  """``(logits, log_norm, loss)`` of one chunk: its logits as the Dense head computes them
  (its dtype), normalised in float32 (float64 for float64 logits)."""
  logits = jnp.dot(rows, kernel, precision=precision)
  if bias is not None:
    logits = logits + bias
  logits = logits.astype(_loss_dtype(logits.dtype))
  log_norm = jax.nn.logsumexp(logits, axis=-1)
  label_logits = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
  return logits, log_norm, log_norm - label_logits


def linear_cross_entropy(inputs: jax.Array, kernel: jax.Array, bias: jax.Array | None,
                         labels: jax.Array, weights: jax.Array, *, chunk: int,
                         precision=None) -> jax.Array:
  """``sum_r weights[r] * cross_entropy(inputs[r] @ kernel + bias, labels[r])`` over the rows
  of non-zero weight, ``chunk`` rows at a time: no ``[N, V]`` logits are held at once.

  Args:
    inputs: ``[N, D]``, in the head's dtype (bf16 logits are computed as the head does, then
      normalised in float32).
    kernel: ``[D, V]``; bias: ``[V]`` or None.
    labels: ``int[N]`` in ``[0, V)``; one outside it at a non-zero weight makes the sum and
      every gradient NaN.
    weights: ``[N]``, read in float32 (float64 for a float64 head); a NaN weight makes the
      sum and every gradient NaN. Their gradient is each row's cross-entropy.
    chunk: rows per chunk.
    precision: of the matmuls.

  The gradients (of ``inputs``, ``kernel``, ``bias``) are computed with the value, chunk by
  chunk, so each chunk's logits are made once; a call that is not differentiated computes
  the value only.
  """
  if np.ndim(inputs) != 2 or np.ndim(kernel) != 2 or np.shape(kernel)[0] != np.shape(
      inputs)[1]:
    raise ValueError(f"inputs must be [N, D] and kernel [D, V], got shapes "
                     f"{np.shape(inputs)} and {np.shape(kernel)}")
  num_rows, vocab = np.shape(inputs)[0], np.shape(kernel)[1]
  if bias is not None and np.shape(bias) != (vocab,):
    raise ValueError(f"bias must be [V] = {(vocab,)} or None, got shape {np.shape(bias)}")
  for name, array in (("labels", labels), ("weights", weights)):
    if np.shape(array) != (num_rows,):
      raise ValueError(f"{name} must be [N] = {(num_rows,)}, one per row of inputs, got shape "
                       f"{np.shape(array)}")
  if not (isinstance(chunk, numbers.Integral) and not isinstance(chunk, bool) and chunk > 0):
    raise ValueError(f"chunk must be a positive int, got {chunk!r}")
  # As the Dense head computes: in the operands' common dtype (the backward casts back).
  dtype = jnp.result_type(*(a for a in (inputs, kernel, bias) if a is not None))
  inputs, kernel, bias = (None if a is None else jnp.asarray(a, dtype)
                          for a in (inputs, kernel, bias))
  weights = jnp.asarray(weights, _loss_dtype(dtype))
  labels, weights = _labels_in_vocabulary(_token_ids(labels, "labels"), weights, vocab)
  return _linear_cross_entropy(*vary_alike(inputs, kernel, bias, labels, weights),
                               min(int(chunk), max(num_rows, 1)), precision)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _linear_cross_entropy(inputs, kernel, bias, labels, weights, chunk, precision):
  def chunk_sum(total, chunk_of):
    rows, chunk_labels, chunk_weights = chunk_of
    _, _, loss = _chunk_cross_entropy(rows, chunk_labels, kernel, bias, precision)
    return total + _weighted_sum(loss, chunk_weights), None

  chunks = tuple(_padded_chunks(a, chunk) for a in (inputs, labels, weights))
  # In a shard_map the sums vary as the rows.
  start, _ = vary_alike(jnp.zeros((), _loss_dtype(inputs.dtype)), inputs)
  total, _ = jax.lax.scan(chunk_sum, start, chunks)
  return total


def _linear_cross_entropy_fwd(inputs, kernel, bias, labels, weights, chunk, precision):
  def chunk_step(carry, chunk_of):
    total, kernel_grad, bias_grad = carry
    rows, chunk_labels, chunk_weights = chunk_of
    logits, log_norm, loss = _chunk_cross_entropy(rows, chunk_labels, kernel, bias, precision)
    total = total + _weighted_sum(loss, chunk_weights)
    # d(weight * cross-entropy) / d(logits) = weight * (softmax - one_hot), zero where the
    # weight is (a NaN weight stays NaN).
    scale = jnp.where(chunk_weights == 0, 0.0, chunk_weights)[:, None]
    logits_grad = scale * (jnp.exp(logits - log_norm[:, None])
                           - jax.nn.one_hot(chunk_labels, logits.shape[-1], dtype=logits.dtype))
    bias_grad = bias_grad + jnp.sum(logits_grad, axis=0)
    logits_grad = logits_grad.astype(kernel.dtype)
    kernel_grad = kernel_grad + jnp.dot(rows.T, logits_grad, precision=precision,
                                        preferred_element_type=kernel_grad.dtype)
    rows_grad = jnp.dot(logits_grad, kernel.T, precision=precision).astype(rows.dtype)
    return (total, kernel_grad, bias_grad), (rows_grad, loss)

  chunks = tuple(_padded_chunks(a, chunk) for a in (inputs, labels, weights))
  sum_dtype = _loss_dtype(kernel.dtype)
  *start, _ = vary_alike(jnp.zeros((), _loss_dtype(inputs.dtype)),
                        jnp.zeros(kernel.shape, sum_dtype), jnp.zeros(kernel.shape[-1:], sum_dtype),
                        inputs)
  (total, kernel_grad, bias_grad), (rows_grad, row_loss) = jax.lax.scan(
      chunk_step, tuple(start), chunks)
  num_rows = inputs.shape[0]
  inputs_grad = rows_grad.reshape(-1, inputs.shape[-1])[:num_rows]
  # The gradients of a unit cotangent, in each input's dtype but for the kernel's and bias's
  # sums over the rows in a dtype of float32's range: the backward scales them (a mean's
  # 1/count, a loss scale) and then rounds, as jax.grad would; float16's sum of thousands of
  # rows would overflow first.
  grads = (inputs_grad, kernel_grad.astype(_sum_dtype(kernel.dtype)),
           None if bias is None else bias_grad.astype(_sum_dtype(bias.dtype)),
           row_loss.reshape(-1)[:num_rows].astype(weights.dtype))
  # Scalars of the inputs' dtypes, which the backward rounds to (residuals are arrays).
  dtypes = tuple(None if a is None else jnp.zeros((), a.dtype)
                 for a in (inputs, kernel, bias, weights))
  return total, (grads, labels, dtypes)


def _sum_dtype(dtype):
  """``dtype``, or float32 where ``dtype`` has a narrower range (float16)."""
  narrow = jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp
  return jnp.float32 if narrow else dtype


def _linear_cross_entropy_bwd(chunk, precision, residuals, total_grad):
  grads, labels, dtypes = residuals
  inputs_grad, kernel_grad, bias_grad, weights_grad = (
      None if g is None else (total_grad * g).astype(like.dtype)
      for g, like in zip(grads, dtypes))
  return (inputs_grad, kernel_grad, bias_grad, np.zeros(labels.shape, jax.dtypes.float0),
          weights_grad)


_linear_cross_entropy.defvjp(_linear_cross_entropy_fwd, _linear_cross_entropy_bwd)
