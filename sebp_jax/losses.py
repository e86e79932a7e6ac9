"""Losses for padded batches whose padding must not reach the gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax import lax

from sebp_jax.ops import validate_top_n


def masked_causal_lm_loss(logits: jax.Array, input_ids: jax.Array, attention_mask: jax.Array, *,
                          capacity: int | None = None) -> jax.Array:
  """Mean next-token cross-entropy over real tokens only.

  Args:
    logits: ``[B, L, V]`` predictions for each position.
    input_ids: ``[B, L]`` tokens, right-padded.
    attention_mask: ``[B, L]``, 1 for real tokens, 0 for padding.
    capacity: optional static count of rows (of the ``B * (L - 1)`` predictions) for the
      log-softmax over the vocabulary: the rows whose target is real are gathered into
      ``[capacity, V]`` and only those are normalised, instead of every row, padding
      included. A batch with more such rows than ``capacity`` takes the computation over
      every row instead (``lax.cond``), so the loss is exact for any batch. The real tokens
      of the batch (``attention_mask.sum()``) always suffice.

  Returns:
    Scalar: position t predicts token t + 1, counted where token t + 1 is real. Padding
    positions get exactly zero weight, so their rows of every layer's output gradient are
    exactly zero (what SEBP with a shared mask index relies on).
  """
  logits, labels = logits[:, :-1], input_ids[:, 1:]
  weights = attention_mask[:, 1:].astype(jnp.float32)
  count = jnp.maximum(jnp.sum(weights), 1.0)

  def on_every_row():
    token_loss = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32),
                                                                 labels)
    return jnp.sum(token_loss * weights)

  if capacity is None:
    return on_every_row() / count
  capacity = validate_top_n(capacity, "capacity")
  num_rows = weights.size

  def on_real_rows():
    # Sentinel slots (row num_rows) read zero logits, label 0 and weight 0.
    (rows,) = jnp.nonzero(weights.reshape(num_rows), size=capacity, fill_value=num_rows)
    kept = lambda a: jnp.take(a.reshape(num_rows, -1), rows, axis=0, mode="fill", fill_value=0)
    token_loss = optax.softmax_cross_entropy_with_integer_labels(
        kept(logits).astype(jnp.float32), kept(labels)[:, 0])
    return jnp.sum(token_loss * kept(weights)[:, 0])

  total = lax.cond(jnp.sum(weights) <= capacity, on_real_rows, on_every_row)
  return total / count
