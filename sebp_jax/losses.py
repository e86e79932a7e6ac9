"""Losses for padded batches whose padding must not reach the gradient."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def masked_causal_lm_loss(logits: jax.Array, input_ids: jax.Array,
                          attention_mask: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy over real tokens only.

  Args:
    logits: ``[B, L, V]`` predictions for each position.
    input_ids: ``[B, L]`` tokens, right-padded.
    attention_mask: ``[B, L]``, 1 for real tokens, 0 for padding.

  Returns:
    Scalar: position t predicts token t + 1, counted where token t + 1 is real. Padding
    positions get exactly zero weight, so their rows of every layer's output gradient are
    exactly zero (what SEBP with a shared mask index relies on).
  """
  token_loss = optax.softmax_cross_entropy_with_integer_labels(
      logits[:, :-1].astype(jnp.float32), input_ids[:, 1:])
  weights = attention_mask[:, 1:].astype(jnp.float32)
  return jnp.sum(token_loss * weights) / jnp.maximum(jnp.sum(weights), 1.0)
