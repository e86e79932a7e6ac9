"""Losses for padded batches whose padding must not reach the gradient."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from sebp_jax.ops import validate_top_n
from sebp_jax.packing import packed_rows_of


def masked_causal_lm_loss(logits: jax.Array, input_ids: jax.Array, attention_mask: jax.Array, *,
                          capacity: int | None = None) -> jax.Array:
  """Mean next-token cross-entropy over real tokens only.

  Args:
    logits: ``[B, L, V]`` predictions for each position. Where they are the output of an LM
      head that ``use_sebp(packed=True)`` ran on the real tokens, the loss reads that head's
      ``[C, V]`` packed rows instead: the ``[B, L, V]`` logits are then never made (unless
      something else reads them), and the value is the same.
    input_ids: ``[B, L]`` tokens, padded anywhere (right, left, holes). Padding may hold any
      id (0, -100, the vocabulary size); a real token's id out of ``[0, V)`` makes the loss
      NaN.
    attention_mask: ``[B, L]``, 1 for real tokens, 0 for padding.
    capacity: optional static count of rows for the log-softmax over the vocabulary: the
      positions whose target is real are gathered into ``[capacity, V]`` and only those are
      normalised (forward and backward) instead of every position, padding included. The
      real tokens of the batch (``attention_mask.sum()``, the packing capacity of
      ``use_sebp(packed=True)``) always suffice. A batch with more such positions than
      ``capacity`` gets a NaN loss and gradient, never a silently partial one (an exact
      fallback would be a run-time branch, ``lax.cond``, in every step, which stalls the
      GPU's queue; :func:`sebp_jax.token_capacity` picks a capacity on the host).

  Returns:
    Scalar: position t predicts token t + 1, counted where tokens t and t + 1 are real. Padding
    positions get exactly zero weight, so their rows of every layer's output gradient are
    exactly zero (what SEBP with a shared mask index relies on).
  """
  batch, length, vocab = logits.shape
  # Targets and weights on all L positions (the last one weighs 0), so that the logits are
  # read in place rather than copied without their last column.
  labels = jnp.pad(input_ids[:, 1:], ((0, 0), (0, 1))).reshape(-1)
  # A prediction counts when both its position and its target are real tokens: with left
  # padding or holes, a padding position before a real token predicts nothing.
  real = attention_mask != 0
  weights = jnp.pad(real[:, 1:] & real[:, :-1], ((0, 0), (0, 1))).reshape(-1)
  weights = weights.astype(jnp.float32)
  num_targets = jnp.sum(weights)
  poison = jnp.float32(0)
  if capacity is not None:
    capacity = validate_top_n(capacity, "capacity")
    poison = jnp.where(num_targets > capacity, jnp.nan, 0.0)
  packed = packed_rows_of(logits)
  if packed is not None:
    rows, layout = packed[0][0], packed[1]
    positions = layout.token_rows  # filler out of range: label 0, weight 0
    # The batch overflowed the packing capacity: the scattered logits would be NaN.
    poison = poison + jnp.where(layout.invalid, jnp.nan, 0.0)
  elif capacity is not None:
    # Unused slots read row R (out of range): zero logits, label 0, weight 0.
    (positions,) = jnp.nonzero(weights, size=capacity, fill_value=weights.shape[0])
    rows = jnp.take(logits.reshape(batch * length, vocab), positions, axis=0, mode="fill",
                    fill_value=0, indices_are_sorted=True)
  else:
    positions, rows = None, logits.reshape(batch * length, vocab)
  if positions is not None:
    take = lambda a: jnp.take(a, positions, mode="fill", fill_value=0, indices_are_sorted=True)
    labels, weights = take(labels), take(weights)
  weights = weights + poison  # NaN: the loss and every gradient behind it
  # Padding may hold any id (-100, the vocabulary size): an id out of the vocabulary reads
  # class 0, so that its loss is finite and a zero weight cancels it (NaN x 0 would be NaN);
  # at a real target it makes the loss NaN.
  in_vocab = (labels >= 0) & (labels < vocab)
  token_loss = optax.softmax_cross_entropy_with_integer_labels(rows.astype(jnp.float32),
                                                               jnp.where(in_vocab, labels, 0))
  token_loss = jnp.where(in_vocab, token_loss, jnp.nan)
  total = jnp.sum(jnp.where(weights == 0, 0.0, token_loss * weights))
  if packed is not None:
    # Targets of positions the packing left out (not in its mask): their logits are zeros
    # in the scattered output, log V each.
    total += (num_targets - jnp.sum(weights)) * math.log(vocab)
  return total / jnp.maximum(num_targets, 1.0)
