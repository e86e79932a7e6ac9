"""SEBP for token embeddings: an exact lookup whose backward scatters only the kept rows.

An embedding lookup ``y = table[ids]`` is a linear layer whose input is one-hot, so the SEBP
argument carries over: the backward ``d_table = scatter_add(ids, dY)`` only needs the rows of dY
that carry signal. The dense backward scatters all ``T`` rows, on a GPU with an atomic add per
element, many of them into the same rows (every padding token has the padding id; BERT's
token-type table has two rows). In transformers' Flax BERT-base (32x512, SST-2 lengths, H200)
the embedding-gradient scatter was the largest kernel of the backward; keeping only the real
tokens' rows took the whole SEBP backward from 1.14x to 2.14x of dense
(``benchmarks/RESULTS.md``).

Selection is the linear layers' (:mod:`sebp_jax.selection`): per lookup from dY, or one index
shared by every layer (``active_rows``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from sebp_jax.backends import accumulation_dtype
from sebp_jax.layers import promotion_for_sebp, resolve_top_n
from sebp_jax.ops import (nan_if_not_finite, validate_active_rows, validate_threshold,
                          validate_top_n)
from sebp_jax.selection import select_active_rows

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class _LookupConfig:
  top_n: int
  threshold: float
  #: The compute dtype, as ``nn.Embed.dtype``: the table is cast to it inside the op.
  dtype: Any


def _lookup(table, ids, dtype=None):
  # What nn.Embed does (cast, then take), so the forward is identical.
  return jnp.take(jnp.asarray(table, dtype), ids, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sebp_lookup(table, ids, active_rows, config: _LookupConfig):
  del active_rows  # Only the backward uses it.
  return _lookup(table, ids, config.dtype)


def _sebp_lookup_fwd(table, ids, active_rows, config: _LookupConfig):
  # The table as given is the residual (a parameter, alive anyway) for its shape and dtype.
  return _lookup(table, ids, config.dtype), (table, ids, active_rows)


def _sebp_lookup_bwd(config: _LookupConfig, residuals, dy):
  table, ids, active_rows = residuals
  num_embeddings, features = table.shape
  num_rows = ids.size
  dy2d = dy.reshape(num_rows, features)
  index_given = active_rows is not None
  if not index_given:
    active_rows = select_active_rows(dy2d, config.top_n, config.threshold)
  # Sentinel slots (row T) read the out-of-range id num_embeddings, which the scatter drops;
  # the ids are widened first so that the sentinel fits their dtype (int8 / uint8 ids).
  flat_ids = ids.reshape(num_rows).astype(jnp.promote_types(ids.dtype, jnp.int32))
  kept_ids = jnp.take(flat_ids, active_rows, mode="fill", fill_value=num_embeddings)
  dy_kept = jnp.take(dy2d, active_rows, axis=0, mode="fill", fill_value=0)
  # float32 accumulation for 16-bit tables, as in the linear layers. It also measured faster
  # (the scatter's atomic adds collide on repeated ids: BERT's token-type table has two rows
  # for every token): BERT-base on an H200, backward 2.19x (2.08x in a second run) of dense
  # with float32 against 1.97x with bf16 accumulation. The sums are cast once, to the dtype of
  # the table as given (a float32 table used in bf16 gets them as they are).
  accumulate = accumulation_dtype(dy.dtype)
  # A given index never scores dY: a NaN/Inf in a skipped row fills the whole table gradient
  # instead of vanishing, at no cost (the fill writes the table once either way).
  fill = nan_if_not_finite(dy2d).astype(accumulate) if index_given else 0
  d_table = jnp.full(table.shape, fill, accumulate).at[kept_ids].add(
      dy_kept.astype(accumulate), mode="drop")
  return d_table.astype(table.dtype), None, None


_sebp_lookup.defvjp(_sebp_lookup_fwd, _sebp_lookup_bwd)


def sebp_embed_lookup(table: Array, ids: Array, *, top_n: int, threshold: float = 0.0,
                      active_rows: Array | None = None, dtype: Any = None) -> Array:
  """``table[ids]`` with a backward that scatters only ``top_n`` rows of dY into ``d_table``.

  Args:
    table: ``[V, F]`` embedding table.
    ids: integer ``[...]`` token ids; every element is a row, ``T = ids.size``. Ids out of
      ``[-V, V)`` read NaN in the forward and get no gradient, as with ``jnp.take``.
    top_n: rows of dY (flattened to ``[T, F]``) the backward keeps (static positive int);
      ``top_n >= T`` without ``active_rows`` runs the dense backward.
    threshold: a row of dY is active when its max ``|value|`` exceeds this.
    active_rows: optional ``int32[top_n]`` shared index (sorted, padded with the sentinel
      ``T``), as for :func:`sebp_jax.sebp_linear`. Given, dY is not scored; a NaN/Inf in a
      skipped row makes ``d_table`` NaN.
    dtype: the compute dtype, as ``nn.Embed``'s ``dtype``: the table is cast to it for the
      lookup (None: no cast); its gradient comes back in the table's own dtype, rounded once
      from the float32 sums. (With ``top_n >= T`` and no index, the plain lookup runs and
      autodiff accumulates in the compute dtype, as for ``nn.Embed``.)

  Returns:
    ``[..., F]``, bit-identical to ``jnp.take(table.astype(dtype), ids, axis=0)``.
  """
  top_n = validate_top_n(top_n)
  threshold = validate_threshold(threshold)
  table, ids = jnp.asarray(table), jnp.asarray(ids)
  if table.ndim != 2:
    raise ValueError(f"table must be 2-D [num_embeddings, features], got shape {table.shape}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"ids must be integer token ids, got dtype {ids.dtype}")
  active_rows = validate_active_rows(active_rows, top_n)
  if active_rows is None and top_n >= ids.size:
    return _lookup(table, ids, dtype)
  return _sebp_lookup(table, ids, active_rows, _LookupConfig(top_n, threshold, dtype))


class SEBPEmbed(nn.Embed):
  """A drop-in for ``flax.linen.Embed`` whose backward keeps only the top-N rows of dY.

  Same attributes, parameter (``embedding``) and forward as ``nn.Embed``; ``attend`` is
  unchanged (a dense matmul over the whole table). Additional attributes:

  Attributes:
    top_n: rows of dY kept in the backward, counted over every element of ``inputs``: an int,
      or a float in (0, 1] for a kept fraction. Cover the non-padding tokens.
    threshold: rows of dY whose max ``|value|`` is at most this count as zero (default 0.0).
  """

  top_n: int | float = dataclasses.field(kw_only=True)
  threshold: float = dataclasses.field(default=0.0, kw_only=True)

  def __call__(self, inputs: Array) -> Array:
    """Embeds the integer ``inputs: [...]`` into ``[..., features]``."""
    return sebp_embed_call(self, inputs, top_n=self.top_n, threshold=self.threshold)


def sebp_embed_call(module: nn.Embed, inputs: Array, *, top_n: int | float, threshold: float,
                    active_rows: Array | None = None) -> Array:
  """``nn.Embed.__call__`` of ``module`` with :func:`sebp_embed_lookup` in place of the take."""
  inputs = jnp.asarray(inputs)
  if not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError(f"inputs of {type(module).__name__} must be integer token ids, "
                     f"got dtype {inputs.dtype}")
  (table,), dtype = promotion_for_sebp(module, module.embedding, inexact=False)
  if module.num_embeddings == 1:  # nn.Embed broadcasts its single row: nothing to select.
    return jnp.broadcast_to(jnp.asarray(table, dtype), inputs.shape + (module.features,))
  return sebp_embed_lookup(table, inputs, top_n=resolve_top_n(top_n, inputs.size),
                           threshold=threshold, active_rows=active_rows, dtype=dtype)
