"""Token packing: run a model's layers on the real tokens of a padded batch only.

A padded batch ``[B, L]`` with mask ``m`` holds ``n = sum(m)`` real tokens. Packing gathers them,
in row-major order, into one sequence of static capacity ``C >= n`` (``[1, C]``), runs the
layers there, and scatters the result back to ``[B, L]`` (zeros at padding). Linear layers,
norms and activations act row by row, so on the packed rows they compute exactly what they
compute on those rows in the padded batch; attention is the one layer that mixes rows, and
:func:`packed_attention` keeps it per sequence: a token attends only to tokens of its own row
(and, for a decoder, only to earlier columns), exactly the keys the padding mask allows.

The ``C - n`` unused slots (*filler*) read zeros, form a segment of their own and are dropped
when scattering back, so nothing reaches a real token or the gradient from them.

A batch with more real tokens than ``C`` cannot be packed. When the mask is known at trace
time that raises at once; under ``jit`` every packed output turns to NaN, and so the loss and
every gradient behind it: no token is ever dropped silently. A run-time error would need a
run-time branch in every step, which stalls the GPU's queue; choose ``C`` on the host instead
(:func:`token_capacity`).

Attention runs over the packed sequence with one ``[C, C]`` mask (``C^2``: cheap for a few
thousand tokens), or, where cuDNN runs it and it pays, with each sequence in a row of its own
given the lengths (:func:`row_attention`: the sum of the squared lengths), chosen by
:func:`attention_method`.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, Callable

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from sebp_jax.ops import validate_top_n
from sebp_jax.outputs import remember_packed
from sebp_jax.selection import active_rows_from_mask
from sebp_jax.sharding import (RowSharding, normalize_batch_axes, row_sharding,
                               shard_row_counts)

Array = jax.Array


@flax.struct.dataclass
class PackedLayout:
  """Where the real tokens of a ``[B, L]`` batch sit in a packed ``[1, C]`` sequence.

  Attributes:
    batch_shape: ``(B, L)``.
    token_rows: ``int32[C]``, the flat index ``b * L + l`` of each packed token, ascending;
      filler slot ``i`` holds ``B * L + i`` (out of range, distinct, so scatters drop it).
    segment_ids: ``int32[C]``, the batch row ``b`` of each token; ``B`` for filler.
    columns: ``int32[C]``, the column ``l`` of each token in its row (filler: its slot).
    num_tokens: ``int32[]``, the real tokens of the batch (may exceed ``C``: overflow).
    mask: ``bool[B, L]``, the real tokens.
    invalid: ``bool[]``, the packed outputs must not be used: the batch overflowed ``C``, or
      the model was given another attention mask (:func:`checked_against`).
    ranks: ``int32[C]``, each token's place among its row's real tokens (filler: its slot).
    row_lengths: ``int32[B]``, the real tokens of each row.
    row_width: the columns of the batch of rows that :func:`row_attention` attends in: at
      least the longest row (static; ``min(L, C)``, or the longest row of a concrete mask).
    contiguous: whether each row's real tokens are known to sit side by side (no holes:
      right or left padding), so that a distance in ranks is one in columns; False where
      the mask is traced or has holes.
    shards: None for one packed sequence; for a batch split over devices, how it is split
      (its first dimension): each shard packs its own rows into ``C / shards`` slots, the
      per-slot fields hold each shard's layout of its block (indices within the block), one
      block after another, ``num_tokens`` and ``invalid`` one entry per shard, and every
      operation on the layout runs per shard (:func:`map_shards`).
    window: the sliding window (in columns) of the decoder mask :func:`pack_decoder_inputs`
      made, which :class:`sebp_jax.nnx.use_packed_attention` attends with; None for none.
  """
  batch_shape: tuple[int, int] = flax.struct.field(pytree_node=False)
  token_rows: Array
  segment_ids: Array
  columns: Array
  num_tokens: Array
  mask: Array
  invalid: Array
  ranks: Array
  row_lengths: Array
  row_width: int = flax.struct.field(pytree_node=False)
  contiguous: bool = flax.struct.field(pytree_node=False)
  shards: RowSharding | None = flax.struct.field(pytree_node=False, default=None)
  window: int | None = flax.struct.field(pytree_node=False, default=None)

  @property
  def capacity(self) -> int:
    """Slots of the packed sequence, of all shards together."""
    return self.token_rows.shape[0]

  @property
  def overflow(self) -> Array:
    """``bool[]`` (one per shard where split): more real tokens than slots."""
    num_shards = 1 if self.shards is None else self.shards.num_shards
    return self.num_tokens > self.capacity // num_shards


def token_capacity(mask, multiple: int = 128, num_shards: int = 1,
                   buckets: tuple[int, ...] | None = None) -> int:
  """A capacity for a host-side ``mask``: its real tokens rounded up to ``multiple``, or with
  ``buckets`` (:func:`capacity_buckets`) the smallest bucket that holds them (ValueError where
  none does); at most ``mask.size``, as many slots as the batch has tokens. Bucketing bounds
  the number of compiled shapes: pass it as a static argument of the jitted step. With the
  batch split into ``num_shards`` shards along its first dimension, the capacity of each
  shard (``use_sebp(top_n=...)`` counts per shard): the fullest shard's real tokens, rounded
  up, at most a shard's rows."""
  multiple = validate_top_n(multiple, "multiple")
  num_shards = validate_top_n(num_shards, "num_shards")
  mask = np.asarray(mask)
  num_tokens = max(1, int(shard_row_counts(mask, num_shards).max()))
  if buckets is not None:
    if isinstance(buckets, (str, bytes)) or not np.iterable(buckets) or not len(buckets):
      raise ValueError(f"buckets must be a non-empty tuple of capacities (capacity_buckets), "
                       f"got {buckets!r}")
    buckets = tuple(validate_top_n(bucket, "each of buckets") for bucket in buckets)
    fitting = [bucket for bucket in buckets if bucket >= num_tokens]
    if not fitting:
      raise ValueError(f"buckets {tuple(buckets)} hold at most {max(buckets)} tokens, and the "
                       f"mask has {num_tokens}{' in a shard' if num_shards > 1 else ''}")
    return min(mask.size // num_shards, min(fitting))
  return min(mask.size // num_shards, -(-num_tokens // multiple) * multiple)


def capacity_buckets(largest: int, count: int = 4, multiple: int = 128) -> tuple[int, ...]:
  """A short geometric ladder of capacities for a run whose fullest batch has ``largest`` real
  tokens: ``largest`` rounded up to ``multiple``, then the half of each rung rounded up to
  ``multiple``, down to ``multiple`` (at most ``count`` of them, ascending). With
  :func:`token_capacity`'s ``buckets`` every batch of the run packs into one of them: at most
  ``count`` compiles, and no batch padded to more than twice its real tokens (but the
  smallest bucket's): a batch too large for a rung, half the one above or more, fills over
  half of the one it takes."""
  largest, count, multiple = (validate_top_n(value, name) for value, name in (
      (largest, "largest"), (count, "count"), (multiple, "multiple")))
  rungs = [-(-largest // multiple) * multiple]
  while len(rungs) < count and rungs[-1] > multiple:
    rungs.append(-(-rungs[-1] // 2 // multiple) * multiple)
  return tuple(reversed(rungs))


def token_budget_batches(lengths, token_budget: int, max_rows: int) -> list[list[int]]:
  """Groups examples of token counts ``lengths`` (in the order given: shuffle first) into
  batches of at most ``max_rows`` examples and ``token_budget`` tokens, each batch filled
  until the next example would not fit. Padded to ``[max_rows, L]`` (empty rows: mask 0), every
  batch packs into the one capacity ``token_budget``: one compile for the whole run, and the
  padding packing leaves is only the budget's unfilled end.

  Returns:
    each batch's example indices, in order. ValueError for an example longer than the
    budget.
  """
  token_budget = validate_top_n(token_budget, "token_budget")
  max_rows = validate_top_n(max_rows, "max_rows")
  lengths = np.asarray(lengths)
  if lengths.size and (not np.issubdtype(lengths.dtype, np.integer) or lengths.min() < 0):
    raise ValueError(f"lengths must be token counts (non-negative integers), got dtype "
                     f"{lengths.dtype}, smallest {lengths.min()}")
  batches, current, tokens = [], [], 0
  for index, length in enumerate(int(n) for n in lengths.reshape(-1)):
    if length > token_budget:
      raise ValueError(f"example {index} has {length} tokens, more than token_budget="
                       f"{token_budget}")
    if current and (tokens + length > token_budget or len(current) == max_rows):
      batches.append(current)
      current, tokens = [], 0
    current.append(index)
    tokens += length
  if current:
    batches.append(current)
  return batches


def balanced_shard_order(lengths, num_shards: int) -> np.ndarray:
  """An order of a batch's rows (token counts ``lengths``, a multiple of ``num_shards`` of
  them) whose ``num_shards`` contiguous blocks, one per device of a batch split along its
  first dimension, hold about equal real tokens: the longest rows first, each to the block
  with the fewest tokens that has room. Every device packs into the fullest block's
  capacity, so the others wait on it; in this order it holds at most the longest row more
  than the least full (``batch[order]`` on the host, before splitting).

  Returns:
    ``int[B]``, a permutation of the rows, block after block.
  """
  lengths = np.asarray(lengths).reshape(-1)
  if num_shards < 1 or len(lengths) % num_shards:
    raise ValueError(f"{len(lengths)} rows do not split into num_shards={num_shards} blocks "
                     "of equal rows")
  rows_per_shard = len(lengths) // num_shards
  blocks = [[] for _ in range(num_shards)]
  tokens = np.zeros(num_shards, dtype=np.int64)
  for row in np.argsort(-lengths, kind="stable"):
    open_blocks = [b for b in range(num_shards) if len(blocks[b]) < rows_per_shard]
    block = min(open_blocks, key=lambda b: (tokens[b], b))
    blocks[block].append(row)
    tokens[block] += lengths[row]
  return np.concatenate([np.asarray(sorted(b), dtype=np.int64) for b in blocks])


def check_token_flags(mask: Any, name: str, why: str) -> Array | None:
  """Raises naming ``name`` where ``mask`` is concrete and holds other values than 0 and 1
  (``why``: what those would change); for a traced mask, returns a bool array of its shape,
  True at such values, for the caller to make its outputs NaN with."""
  if isinstance(mask, jax.core.Tracer):
    return (mask != 0) & (mask != 1)
  values = np.asarray(mask)
  if not np.all((values == 0) | (values == 1)):
    raise ValueError(f"{name} must hold 1 (or True) for real tokens and 0 for padding, got "
                     f"the values {np.unique(values)[:8].tolist()}: {why}")
  return None


_PACKING_FLAGS = ("active_mask for packing", "packing takes every non-zero as a token, a model "
                  "may not (BERT attends where the mask is above 0)")


def pack_layout(mask: Array, capacity: int,
                sharding: RowSharding | None = None) -> PackedLayout:
  """The packed layout of the non-zero entries of ``mask: [B, L]`` in ``capacity`` slots.

  Any mask works (right or left padding, holes): tokens keep their row and column, and attention
  follows them. A concrete mask with more than ``capacity`` real tokens raises ValueError, as
  does one of other values than 0 and 1 (a traced one makes the layout ``invalid``).
  With ``sharding`` (the batch split over devices along its first dimension), each shard
  packs its own block of rows into ``capacity`` slots of its own, on its device.
  """
  if jnp.ndim(mask) != 2:
    raise ValueError(f"active_mask for packing must be [batch, length], got shape "
                     f"{jnp.shape(mask)}")
  batch, length = jnp.shape(mask)
  num_shards = 1 if sharding is None else sharding.num_shards
  # Rows of row_attention: as long as a row can be (no longer than the capacity), even for
  # cuDNN's backward.
  row_width, contiguous = min(length, capacity), False
  check_token_flags(mask, *_PACKING_FLAGS)  # Raises for a concrete mask.
  traced = isinstance(mask, jax.core.Tracer)
  if not traced:
    host = np.asarray(mask) != 0
    num_tokens = int(shard_row_counts(host, num_shards).max())
    if num_tokens > capacity:
      where = "a shard of the mask" if num_shards > 1 else "the mask"
      raise ValueError(
          f"packing capacity {capacity} is smaller than the {num_tokens} real tokens of "
          f"{where} [{batch}, {length}]: give a capacity (use_sebp's top_n) of at least "
          f"{num_tokens}.")
    lengths = host.sum(axis=1)
    row_width = int(max(lengths.max(initial=0), 1))
    # No holes: the real tokens of each row span as many columns as they are.
    spans = np.where(host.any(axis=1), length - host[:, ::-1].argmax(axis=1)
                     - host.argmax(axis=1), 0)
    contiguous = bool(np.all(spans == lengths))
  row_width += row_width % 2
  if sharding is None:
    return _pack_block(mask, capacity, row_width, contiguous, traced)

  def block(local_mask):
    return _shard_leaves(_pack_block(local_mask, capacity, row_width, contiguous, traced))

  leaves = jax.shard_map(block, mesh=sharding.mesh, in_specs=P(sharding.axes),
                         out_specs=P(sharding.axes), axis_names=frozenset(sharding.axes),
                         check_vma=False)(sharding.split_rows(jnp.asarray(mask)))
  return PackedLayout(batch_shape=(batch, length), **leaves, row_width=row_width,
                      contiguous=contiguous, shards=sharding)


def _pack_block(mask: Array, capacity: int, row_width: int, contiguous: bool,
                check_values: bool) -> PackedLayout:
  """:func:`pack_layout` of one device's mask, its static fields given; ``check_values``: a
  traced mask, whose values other than 0 and 1 make the layout ``invalid``."""
  batch, length = jnp.shape(mask)
  flat = jnp.reshape(mask, (-1,)) != 0
  num_rows = flat.shape[0]
  slots = jnp.arange(capacity, dtype=jnp.int32)
  num_tokens = jnp.sum(flat, dtype=jnp.int32)
  real = slots < num_tokens
  # The shared SEBP index of the mask, its one sentinel made distinct per slot.
  rows = jnp.where(real, active_rows_from_mask(flat, capacity), num_rows + slots)
  grid = jnp.reshape(flat, (batch, length))
  ranks = jnp.reshape(jnp.cumsum(grid, axis=1, dtype=jnp.int32) - 1, (-1,))
  invalid = num_tokens > capacity
  if check_values:
    invalid |= jnp.any(check_token_flags(mask, *_PACKING_FLAGS))
  return PackedLayout(
      batch_shape=(batch, length),
      token_rows=rows,
      segment_ids=jnp.where(real, rows // length, batch),
      columns=jnp.where(real, rows % length, slots),
      num_tokens=num_tokens,
      mask=grid,
      invalid=invalid,
      ranks=jnp.where(real, jnp.take(ranks, rows, mode="fill", fill_value=0), slots),
      row_lengths=jnp.sum(grid, axis=1, dtype=jnp.int32),
      row_width=row_width,
      contiguous=contiguous)


#: The fields of a :class:`PackedLayout` that hold one value per shard (per-slot and per-row
#: fields hold a block per shard).
_PER_SHARD = ("num_tokens", "invalid")


def _shard_leaves(layout: PackedLayout) -> dict[str, Array]:
  """One shard's layout as the arrays its block of a sharded layout holds."""
  return {field.name: jnp.reshape(getattr(layout, field.name), (-1,))
          if field.name in _PER_SHARD else getattr(layout, field.name)
          for field in dataclasses.fields(layout) if field.metadata.get("pytree_node", True)}


def _block_layout(layout: PackedLayout, leaves: dict[str, Array]) -> PackedLayout:
  """The layout of one shard inside :func:`map_shards`, from its blocks of ``layout``."""
  batch, length = layout.batch_shape
  fields = {name: value[0] if name in _PER_SHARD else value for name, value in leaves.items()}
  return PackedLayout(batch_shape=(batch // layout.shards.num_shards, length), **fields,
                      row_width=layout.row_width, contiguous=layout.contiguous,
                      window=layout.window)


#: How :func:`map_shards` splits an array: ``"rows"``, along its first dimension (``[B, L,
#: ...]``, the batch); ``"packed"``, along its second (``[1, C, ...]``, the packed tokens).
_SPLIT_DIM = {"rows": 0, "packed": 1}


def map_shards(fn: Callable, layout: PackedLayout, arrays: tuple, splits: tuple[str, ...],
               out_splits: Any) -> Any:
  """``fn(block_layout, *blocks)`` on each shard of a sharded ``layout``, on its device: each
  array split as ``splits`` says (see :data:`_SPLIT_DIM`), the outputs joined as
  ``out_splits`` says (a pytree prefix of the outputs, of split names). No collective: every
  shard's tokens stay on its device."""
  sharding = layout.shards
  axes = sharding.axes
  spec = lambda split: P(*(None,) * _SPLIT_DIM[split], axes)

  def body(leaves, *blocks):
    return fn(_block_layout(layout, leaves), *blocks)

  leaves = _shard_leaves(layout)
  in_specs = ({name: P(axes) for name in leaves}, *(spec(split) for split in splits))
  out_specs = jax.tree.map(spec, out_splits)
  arrays = tuple(sharding.split_rows(a) if split == "rows" else a
                 for split, a in zip(splits, arrays))
  return jax.shard_map(body, mesh=sharding.mesh, in_specs=in_specs, out_specs=out_specs,
                       axis_names=frozenset(axes), check_vma=False)(leaves, *arrays)


def checked_against(layout: PackedLayout, attention_mask) -> PackedLayout:
  """``layout``, for a model called with ``attention_mask``: packing attends over the real
  tokens of the layout's mask, so another mask (a loss mask given as ``active_mask``, a second
  batch in one context) would change the model, and so would values other than 0 and 1, which
  transformers' models read: they cast the mask to int32 (0.5 masks a token), BERT's encoders
  mask where it is below 1, DistilBERT scales its scores by it, OPT's positions and Bloom's
  ALiBi sum it. A concrete mismatch raises; a traced one makes the packed outputs NaN."""
  if attention_mask is None:
    return layout
  if jnp.shape(attention_mask) != layout.batch_shape:
    raise ValueError(f"the model's attention_mask has shape {jnp.shape(attention_mask)}, "
                     f"use_sebp's active_mask {layout.batch_shape}: packing needs the same mask")
  concrete = not any(isinstance(a, jax.core.Tracer) for a in (attention_mask, layout.mask))
  if concrete:
    given = np.asarray(attention_mask)
    if np.any((given != 0) != np.asarray(layout.mask)):
      raise ValueError("the model's attention_mask (all ones where it is given none) differs "
                       "from use_sebp's active_mask: packing attends over the tokens of "
                       "active_mask, so pass the model's attention mask as active_mask")
    if np.any((given != 0) & (given != 1)):
      raise ValueError("the model's attention_mask holds values other than 0 and 1, which the "
                       "model reads (cast to int32, compared with 0, summed into positions: "
                       "each family its own way), while packing sees only where it is 0: "
                       "pass a mask of 0 and 1")
    return layout

  def differs(block, given):
    return (block.invalid | jnp.any((given != 0) != block.mask)
            | jnp.any((given != 0) & (given != 1)))

  if layout.shards is None:
    return layout.replace(invalid=differs(layout, jnp.asarray(attention_mask)))
  invalid = map_shards(lambda block, given: differs(block, given)[None], layout,
                       (jnp.asarray(attention_mask),), ("rows",), "rows")
  return layout.replace(invalid=invalid)


def gather_tokens(x: Array, layout: PackedLayout, *, filler: str = "zero",
                  check_padding: bool = True) -> Array:
  """``x: [B, L, ...]`` -> ``[1, C, ...]``: the real tokens, filler slots zero, or
  (``filler="token"``, for the token ids a model embeds) the batch's first real token's: an
  id the padded batch reads too, where id 0 may be one it never reads (a non-finite table row
  would reach the real tokens through attention's zero weights, and every weight gradient
  through the filler rows' zero cotangents).

  With ``check_padding`` (:func:`scatter_tokens`'s partner), a non-finite cotangent of the
  packed values makes ``x``'s NaN everywhere, that of a filler slot too, which the gather's
  transpose drops. The check is a ``custom_vjp``, which forward-mode autodiff refuses:
  ``check_padding=False`` lets it through, unchecked."""
  if filler not in ("zero", "token"):
    raise ValueError(f"filler must be 'zero' or 'token', got {filler!r}")
  x = jnp.asarray(x)  # A module applied on numpy ids gets them as they are.
  batch, length = layout.batch_shape
  if x.shape[:2] != (batch, length):
    raise ValueError(f"packing expected an array of the leading shape {(batch, length)} of "
                     f"active_mask, got {x.shape}")
  if layout.shards is not None:
    return map_shards(lambda block, x: gather_tokens(x, block, filler=filler,
                                                     check_padding=check_padding),
                      layout, (x,), ("rows",), "packed")
  flat = x.reshape(batch * length, *x.shape[2:])
  packed = jnp.take(flat, layout.token_rows, axis=0, mode="fill", fill_value=0,
                    indices_are_sorted=True, unique_indices=True)
  if filler == "token" and flat.shape[0]:
    real = (layout.token_rows < flat.shape[0]).reshape(-1, *[1] * (x.ndim - 2))
    first = flat[jnp.minimum(layout.token_rows[0], flat.shape[0] - 1)]
    packed = jnp.where(real, packed, first)
  if check_padding and jnp.issubdtype(x.dtype, jnp.inexact):
    packed = _spare_slots_unread(packed, x)
  return packed[None]


@jax.custom_vjp
def _spare_slots_unread(packed: Array, x: Array) -> Array:
  """``packed: [C, ...]``, gathered from ``x: [B, L, ...]``, as is; a non-finite cotangent of
  it makes ``x``'s NaN everywhere. The gather's transpose drops the spare slots' cotangent,
  and a shard without real tokens passes a loss's read of its padding
  (:func:`_padding_unread`) to the weights through its spare slots only."""
  del x
  return packed


def _spare_slots_unread_fwd(packed, x):
  return packed, jnp.zeros_like(x)


def _spare_slots_unread_bwd(x_zeros, d_packed):
  poison = jnp.where(jnp.all(jnp.isfinite(d_packed)), 0, jnp.nan).astype(x_zeros.dtype)
  return d_packed, x_zeros + poison


_spare_slots_unread.defvjp(_spare_slots_unread_fwd, _spare_slots_unread_bwd)


def checked_column_tokens(hidden: Array, layout: PackedLayout, host_mask: Any, reader: str,
                          column: int = 0, empty_rows: bool = False) -> Array:
  """``hidden: [B, L, ...]``, a packed region's outputs (or what a layer reads of them), for a
  head that reads one ``column`` of each row: the first (BERT's pooler), or the last (-1,
  RoFormer's multiple choice). Packing computes the real tokens only: a row that holds real
  tokens but padding in that column would read zeros where the padded batch has the padding
  token's state. A concrete ``host_mask`` with such a row raises ValueError; otherwise those
  rows turn NaN, and so every gradient behind them. A row without real tokens reads zeros
  (weigh it 0), but with ``empty_rows`` (a multiple-choice model's choices, scored together)
  it is checked as the others."""
  if host_mask is not None:
    host = np.asarray(host_mask) != 0
    rows = np.flatnonzero(~host[:, column] & (host.any(axis=1) | empty_rows))
    if rows.size:
      which = {0: "first", -1: "last"}.get(column, f"{column}th")
      padding, fix = ("left", "Pad on the right") if column == 0 else ("right", "Pad on the left")
      holding = ("that hold real tokens or none (each row a choice, scored with the others: "
                 "give each one a token)" if empty_rows else "that hold real tokens")
      raise ValueError(
          f"packed=True: {reader} reads the {which} column of each row, and active_mask has "
          f"padding there in row(s) {rows[:8].tolist()} {holding} ({padding} padding?): "
          f"packing computes the real tokens only. {fix}, or leave packed off.")
    return hidden
  reads_padding = ~layout.mask[:, column] & (jnp.any(layout.mask, axis=1) | empty_rows)
  reads_padding = reads_padding.reshape(-1, *(1,) * (hidden.ndim - 1))
  # NaN times the row's outputs, not a NaN constant: the gradient of the row's real tokens,
  # and so of every weight behind them, turns NaN too (a padding slot's gradient is dropped).
  poison = jnp.where(reads_padding, jnp.nan, 0).astype(hidden.dtype)
  return jnp.where(reads_padding, poison * jnp.sum(hidden, axis=1, keepdims=True), hidden)


@jax.custom_vjp
def _padding_unread(out: Array, real: Array, packed: Array) -> Array:
  """``out: [B, L, ...]`` as is, scattered from ``packed: [C, ...]``; where its cotangent is
  not zero at a position that ``real: bool[B, L]`` calls padding, the cotangent comes back NaN
  everywhere, and ``packed``'s NaN at every slot: a shard without real tokens has no slot that
  the scatter's transpose would read, and its NaN must still reach the weights."""
  del real, packed
  return out


def _padding_unread_fwd(out, real, packed):
  return out, (real, jnp.zeros_like(packed))


def _padding_unread_bwd(residuals, d_out):
  real, packed_zeros = residuals
  real = real.reshape(real.shape + (1,) * (d_out.ndim - real.ndim))
  # NaN != 0 too: a NaN read only at padding is not dropped either.
  read = jnp.any(~real & (d_out != 0))
  poison = jnp.where(read, jnp.nan, 0)
  return (d_out + poison.astype(d_out.dtype), None,
          packed_zeros + poison.astype(packed_zeros.dtype))


_padding_unread.defvjp(_padding_unread_fwd, _padding_unread_bwd)


def scatter_tokens(packed: Array, layout: PackedLayout, *, check_padding: bool = True) -> Array:
  """``packed: [1, C, ...]`` -> ``[B, L, ...]``, zeros at padding; all NaN (inexact dtypes),
  and so every gradient behind it, when the layout is ``invalid`` (the batch overflowed
  ``C``; sharded, the shard that overflowed): no token is dropped silently.

  Padding was not computed, so with ``check_padding`` a loss that reads it (a gradient there
  that is not zero) makes every gradient behind it NaN: the padded batch's value there is not
  the zero it reads. The check is a ``custom_vjp``, which forward-mode autodiff (``jax.jvp``)
  refuses: ``check_padding=False`` lets it through, unchecked."""
  if layout.shards is not None:
    scatter = functools.partial(scatter_tokens, check_padding=check_padding)
    return map_shards(lambda block, packed: scatter(packed, block), layout, (packed,),
                      ("packed",), "rows")
  batch, length = layout.batch_shape
  values = packed[0]
  fill = 0
  if jnp.issubdtype(values.dtype, jnp.inexact):
    # Every position NaN, the real tokens that did not fit included. A factor, not a
    # selection or a term, so that the gradients behind it are NaN too, also behind a ReLU
    # (whose gradient at NaN is 0), rather than zero; times 1 where the layout is valid.
    fill = jnp.where(layout.invalid, jnp.nan, 0).astype(values.dtype)
    values = values * (1 + fill)
  out = jnp.full((batch * length, *values.shape[1:]), fill, values.dtype)
  out = out.at[layout.token_rows].set(values, mode="drop", indices_are_sorted=True,
                                      unique_indices=True)
  out = out.reshape(batch, length, *values.shape[1:])
  if check_padding and jnp.issubdtype(out.dtype, jnp.inexact):
    return _padding_unread(out, layout.mask, values)
  return out


def invalid_slots(layout: PackedLayout) -> Array:
  """``float32[C]``: NaN at the slots of a layout (or, sharded, a shard) that overflowed its
  capacity or was given another mask (``invalid``), else 0: what is read at the slots turns
  NaN with it (added, or as a factor ``1 +`` it), and every gradient behind it."""
  if layout.shards is not None:
    return map_shards(lambda block: invalid_slots(block)[None], layout, (), (),
                      "packed")[0]
  return jnp.full((layout.capacity,), jnp.where(layout.invalid, jnp.nan, 0.0), jnp.float32)


def attention_mask(layout: PackedLayout, *, causal: bool,
                   window: int | None = None) -> Array:
  """``bool[1, 1, C, C]``: query token i may attend to key token j.

  Same row (segment) always; with ``causal`` only ``column_j <= column_i``; with ``window``
  only ``column_j >= column_i - window`` too (sliding-window attention). Filler slots attend
  to filler only, so no softmax row is empty. Sharded, one mask over every shard's slots,
  each shard's segments apart from the others' (a model that reads it attends across
  devices: :func:`packed_attention` does not).
  """
  seg, col = layout.segment_ids, layout.columns
  if layout.shards is not None:
    # Segment ids are per shard (0..B/n, filler B/n): each shard's own range.
    offset = lambda block: (block.segment_ids + jax.lax.axis_index(layout.shards.axes)
                            * (block.batch_shape[0] + 1))[None]
    seg = map_shards(offset, layout, (), (), "packed")[0]
  key_seg, key_col = seg, col
  if layout.shards is not None:
    # The queries stay split; under Explicit axes the keys' side is typed whole.
    key_seg, key_col = layout.shards.whole(seg), layout.shards.whole(col)
  allowed = seg[:, None] == key_seg[None, :]
  if causal:
    allowed &= key_col[None, :] <= col[:, None]
  if window is not None:
    allowed &= key_col[None, :] >= col[:, None] - window
  return allowed[None, None]


def _first_attended_slots(layout: PackedLayout) -> Array:
  """``int32[C]``: the first slot each slot attends to in the decoder mask of ``layout``
  (:func:`attention_mask`, causal, ``layout.window``). A row's tokens sit side by side in
  ascending columns, so a slot attends to every slot from that one to itself."""
  if layout.shards is not None:
    axes = layout.shards.axes
    first = lambda block: (_first_attended_slots(block)
                           + jax.lax.axis_index(axes) * block.capacity)[None]
    return map_shards(first, layout, (), (), "packed")[0]
  reach = layout.columns if layout.window is None else jnp.minimum(layout.columns,
                                                                   layout.window)
  # token_rows ascend (filler past every real token), and a row's columns with them.
  return jnp.searchsorted(layout.token_rows, layout.token_rows - reach,
                          side="left").astype(jnp.int32)


def checked_decoder_mask(layout: PackedLayout, given: Array | None) -> Array | None:
  """Whether ``given``, the ``[1, C, C]`` mask a decoder was called with, is the one
  :func:`pack_decoder_inputs` made with ``layout``, for attention that reads the layout in
  its place (another batch's mask, or another window, would attend otherwise).

  Read at three entries per slot, not ``C²``: true at the first slot it attends to, false
  just before that and just after itself. A mask of another layout (a run of slots ending at
  each slot) then equals it, and a plain causal or a bidirectional mask fails. A concrete
  mismatch raises; a traced one is returned as a ``bool[]`` (True: it matches) for the
  caller to poison its outputs with; None where nothing was given or all is concrete, and
  where the layout is split over devices and the mask traced (its entries would cross
  devices: that case goes unchecked)."""
  traced = any(isinstance(a, jax.core.Tracer) for a in (given, *jax.tree.leaves(layout)))
  if given is None or (traced and layout.shards is not None):
    return None
  capacity = layout.capacity
  if jnp.shape(given) != (1, capacity, capacity):
    raise ValueError(f"the decoder's attention mask has shape {jnp.shape(given)}, not (1, "
                     f"{capacity}, {capacity}) of the packed inputs: pass the "
                     "pack_decoder_inputs(...).attention_mask that made the layout")
  slots = jnp.arange(capacity)
  first = _first_attended_slots(layout)
  given = jnp.asarray(given)[0] != 0
  matches = (jnp.all(given[slots, first])
             & ~jnp.any(given[slots, jnp.maximum(first - 1, 0)] & (first > 0))
             & ~jnp.any(given[slots[:-1], slots[1:]]))
  if isinstance(matches, jax.core.Tracer):
    return matches
  if not matches:
    raise ValueError(
        "the decoder's attention mask is not the one pack_decoder_inputs made with "
        "use_packed_attention's layout (another batch's, or another window than "
        f"window={layout.window}): enter the context with the layout of the inputs the model "
        "runs on")
  return None


@flax.struct.dataclass
class PackedDecoderInputs:
  """A padded batch's real tokens packed into one sequence, as the inputs of a decoder that
  takes token positions and an attention mask (Tunix's NNX Llama 3 and most NNX decoders):
  packing them needs no change to the model, only to its inputs.

  Attributes:
    layout: where each token sits (:class:`PackedLayout`).
    input_ids: ``[1, C]``, the real tokens; filler slots 0.
    positions: ``int32[1, C]``, each token's position: by default its place among its row's
      real tokens (for right padding, its column).
    attention_mask: ``bool[1, C, C]``: causal within each row of the batch (and the window);
      filler attends to filler only.
  """
  layout: PackedLayout
  input_ids: Array
  positions: Array
  attention_mask: Array

  def unpack(self, outputs: Array, *, check_padding: bool = True) -> Array:
    """The decoder's ``[1, C, ...]`` outputs back at ``[B, L, ...]``, zeros at padding (all
    NaN where the batch overflowed the capacity), a loss that reads them at padding making
    the gradients NaN (``check_padding``: see :func:`scatter_tokens`). Remembered with their
    packed rows (:func:`remember_packed`): ``masked_causal_lm_loss`` of unpacked logits reads
    the ``[C, V]`` rows, and the ``[B, L, V]`` logits are never made."""
    return remember_packed(scatter_tokens(outputs, self.layout, check_padding=check_padding),
                           outputs, self.layout)


def pack_decoder_inputs(input_ids: Array, mask: Array, capacity: int, *,
                        positions: Array | None = None, window: int | None = None,
                        batch_axes: Any = None, mesh: Any = None) -> PackedDecoderInputs:
  """The real tokens of ``input_ids: [B, L]`` (``mask != 0``) packed into ``capacity`` slots,
  with their positions and a per-row causal attention mask, for a decoder called as
  ``model(input_ids, positions, ..., attention_mask)``.

  The decoder then computes on ``C`` rows instead of ``B * L``, forward and backward, and its
  outputs at real tokens equal those of the padded batch: every layer but attention acts row
  by row, and the mask keeps attention within each row. ``positions`` default to each
  token's index among its row's real tokens (its column, for right padding); give the padded
  call's own if it uses others. ``window``: sliding-window attention. Pick ``capacity`` on
  the host (:func:`token_capacity`); a batch with more real tokens unpacks to NaN.

  A decoder's own attention over the packed sequence costs ``C²`` whatever the mask; inside
  :class:`sebp_jax.nnx.use_packed_attention` (Tunix's Llama 3) it runs per sequence.

  ``batch_axes`` / ``mesh``: the batch is split over devices (as ``use_sebp``'s; under an
  ``Explicit`` mesh the mask's type tells): each shard packs its own rows into ``capacity``
  slots of its own (:func:`token_capacity` with ``num_shards``), and the packed inputs are
  ``[1, shards * capacity]``, split along the tokens.
  """
  capacity = validate_top_n(capacity, "capacity")
  if window is not None and (isinstance(window, (bool, np.bool_))
                             or not isinstance(window, numbers.Integral) or window < 0):
    raise ValueError(f"window must be None or a non-negative int (columns before each token "
                     f"that it attends to), got {window!r}")
  sharding = row_sharding(mask, 2, mesh=mesh,
                          batch_axes=normalize_batch_axes(batch_axes))
  layout = pack_layout(mask, capacity, sharding).replace(window=window)
  if positions is None:
    real = jnp.asarray(mask) != 0
    # Along each row, so that a batch split over devices needs no collective.
    positions = jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0)
  positions = jnp.asarray(positions)
  if not jnp.issubdtype(positions.dtype, jnp.integer) or positions.shape != layout.batch_shape:
    raise ValueError(f"positions must be integer token positions of the mask's shape "
                     f"{layout.batch_shape}, got {positions.dtype}{list(positions.shape)}")
  return PackedDecoderInputs(
      layout=layout, input_ids=gather_tokens(jnp.asarray(input_ids), layout, filler="token"),
      positions=gather_tokens(positions.astype(jnp.int32), layout),
      attention_mask=attention_mask(layout, causal=True, window=window)[0])


def fused_attention_implementation(query: Array) -> str:
  """``"cudnn"`` (flash attention) where it runs on A100 and H100 alike: an NVIDIA GPU, 16-bit
  inputs, a head size that is a multiple of 8 up to 128, an even sequence length (cuDNN's
  backward with a bias or mask needs one); ``"xla"`` otherwise."""
  length, head_dim = query.shape[-3], query.shape[-1]
  on_cuda = jax.default_backend() == "gpu" and "NVIDIA" in jax.devices()[0].device_kind
  if (on_cuda and query.dtype in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0
      and head_dim <= 128 and length % 2 == 0):
    return "cudnn"
  return "xla"


#: How :func:`packed_attention` runs: ``"rows"`` (:func:`row_attention`, each sequence in a
#: row of its own, attended with the row lengths: what cuDNN computes follows the squared
#: lengths), ``"mask"`` (over the packed sequence, one ``[C, C]`` mask: ``C²``), or
#: ``"auto"`` (:func:`attention_method`).
ATTENTION_METHODS = ("auto", "rows", "mask")


def _covers_every_row(window: int | None, layout: PackedLayout) -> bool:
  """Whether ``window`` (in columns) leaves every pair of a row's tokens in: it spans the
  padded length, or, in rows without holes, the longest row. With holes a row of few tokens
  may spread over more columns than the longest row has tokens."""
  return (window is None or window >= layout.batch_shape[1] - 1
          or (layout.contiguous and window >= layout.row_width - 1))


def _window_in_rows(window: int | None, layout: PackedLayout) -> bool:
  """Whether :func:`row_attention` keeps ``window`` (in columns): none, one that covers every
  row, or rows without holes, where a distance in ranks is one in columns."""
  return _covers_every_row(window, layout) or layout.contiguous


def _row_window(window: int | None, layout: PackedLayout) -> int | None:
  """``window`` in ranks for :func:`row_attention`, None where it covers every row; a
  ValueError where holes could make a distance in ranks differ from one in columns."""
  if _covers_every_row(window, layout):
    return None
  if not _window_in_rows(window, layout):
    raise ValueError(
        f"row attention with a sliding window ({window}) needs rows without holes, known "
        "from a concrete mask: with a traced mask, or holes, use the 'mask' attention")
  return window


#: :func:`attention_method` takes the rows where their ``B·W`` slots, times this, are fewer
#: than the ``C²`` pairs of the mask: copying a slot in and out costs about as much as
#: attending this many pairs.
ROW_SLOT_COST = 64


def attention_method(query: Array, layout: PackedLayout, *, window: int | None,
                     dropout: bool) -> str:
  """``"rows"`` where cuDNN runs :func:`row_attention` (:func:`fused_attention_implementation`
  of its rows) with no dropout and a window it can keep, and where it costs less: its
  ``B·W`` slots (each copied in and out) against the ``C²`` pairs of the mask
  (:data:`ROW_SLOT_COST`), so many short sequences of a traced mask (``W = min(L, C)``) keep
  the mask; ``"mask"`` elsewhere, the exact XLA path of CPUs, where attention over the rows
  would cost their full padded squares."""
  batch, width = layout.batch_shape[0], layout.row_width
  rows = jax.ShapeDtypeStruct((batch, width, *query.shape[2:]), query.dtype)
  if (dropout or fused_attention_implementation(rows) != "cudnn"
      or not _window_in_rows(window, layout)
      or ROW_SLOT_COST * batch * width >= layout.capacity ** 2):
    return "mask"
  return "rows"


def alibi_bias(alibi_slopes: tuple[float, ...] | None, key_ranks: Array, query: Array,
                num_keys: int) -> Array | None:
  """``[1, H, T, S]`` for ``query [.., T, H, d]``: ALiBi's bias of each key, its head's slope
  times the key's rank ``key_ranks [S]`` (its sequence's real tokens before it), in the
  query's dtype, as Bloom's own bias; None without slopes. A bias of the key alone is exact:
  softmax drops the query's own term of the distance. Broadcast whole, as cuDNN needs it."""
  if alibi_slopes is None:
    return None
  heads, length = query.shape[-2], query.shape[-3]
  if len(alibi_slopes) != heads:
    raise ValueError(f"alibi_slopes must hold one slope per query head ({heads}), got "
                     f"{len(alibi_slopes)}")
  slopes = jnp.asarray(alibi_slopes, jnp.float32)[:, None]
  bias = (slopes * key_ranks.astype(jnp.float32)[None]).astype(query.dtype)
  return jnp.broadcast_to(bias[None, :, None, :], (1, heads, length, num_keys))


def row_attention(query: Array, key: Array, value: Array, layout: PackedLayout, *,
                  causal: bool, window: int | None = None,
                  alibi_slopes: tuple[float, ...] | None = None,
                  implementation: str | None = None) -> Array:
  """Per-sequence attention of packed tokens, each sequence in a row of its own.

  The packed q, k, v are scattered to ``[B, W, ...]`` (``W = layout.row_width``), each row's
  real tokens first and in order, attended there with the row lengths
  (``jax.nn.dot_product_attention``'s ``query_seq_lengths``; cuDNN skips what lies past
  them, so its work follows the sum of the squared lengths), and gathered back: copies of
  ``O(B·W·D)``. A token attends to the tokens of its own row, and with ``causal`` to those
  before it: the keys the padding mask leaves it, whatever the padding (left, right,
  holes). A ``window`` counts real tokens: rows without holes only (:func:`_row_window`).

  Args and returns: as :func:`packed_attention`; filler slots come back zero.
  """
  batch = layout.batch_shape[0]
  width, capacity = layout.row_width, layout.capacity
  # Each token's slot in the rows; filler out of range (distinct), dropped and read as 0.
  slots = jnp.where(layout.segment_ids < batch, layout.segment_ids * width + layout.ranks,
                    batch * width + jnp.arange(capacity, dtype=jnp.int32))

  def to_rows(packed):
    rows = jnp.zeros((batch * width, *packed.shape[2:]), packed.dtype)
    rows = rows.at[slots].set(packed[0], mode="drop", indices_are_sorted=True,
                              unique_indices=True)
    return rows.reshape(batch, width, *packed.shape[2:])

  query_rows = to_rows(query)
  window = _row_window(window, layout)
  # A row without tokens attends to one zero slot: finite, and never read.
  lengths = jnp.maximum(layout.row_lengths, 1)
  # A row's tokens sit at their ranks: a key's rank is its slot in the row.
  bias = alibi_bias(alibi_slopes, jnp.arange(width), query_rows, width)
  out = jax.nn.dot_product_attention(
      query_rows, to_rows(key), to_rows(value), bias=bias, is_causal=causal,
      query_seq_lengths=lengths, key_value_seq_lengths=lengths,
      local_window_size=None if window is None else (window, 0),
      implementation=implementation or fused_attention_implementation(query_rows))
  out = jnp.take(out.reshape(batch * width, *out.shape[2:]), slots, axis=0, mode="fill",
                 fill_value=0, indices_are_sorted=True, unique_indices=True)
  return out[None]


def packed_attention(query: Array, key: Array, value: Array, layout: PackedLayout, *,
                     causal: bool, window: int | None = None,
                     alibi_slopes: tuple[float, ...] | None = None,
                     dropout_rng: Array | None = None, dropout_rate: float = 0.0,
                     broadcast_dropout: bool = True, implementation: str | None = None,
                     method: str = "auto") -> Array:
  """Per-sequence attention of packed tokens.

  Args:
    query: ``[1, C, H, d]``.
    key, value: ``[1, C, K, d]``, ``H`` a multiple of ``K`` (grouped-query attention).
    layout: the batch's :class:`PackedLayout`.
    causal: decoder attention (by column within each row).
    window: sliding window, in columns (Mistral), or None.
    alibi_slopes: ALiBi (Bloom): one slope per query head (static floats); each logit gains
      its head's slope times the key's rank in its sequence, minus the query's, or None.
    dropout_rng, dropout_rate: dropout on the attention probabilities, as flax's
      ``dot_product_attention_weights`` applies it; its random mask falls on other positions
      than in the padded batch.
    broadcast_dropout: one dropout mask for every head (flax's default, BERT's), or one per
      head (DistilBERT's ``nn.Dropout`` on the probabilities).
    implementation: ``"xla"``, ``"cudnn"``, or None for
      :func:`fused_attention_implementation`.
    method: one of :data:`ATTENTION_METHODS`: :func:`row_attention` (``"rows"``), or over the
      packed sequence with a ``[C, C]`` mask (``"mask"``).

  Returns:
    ``[1, C, H, d]``, softmax(q k^T / sqrt(d)) v over the allowed keys, in float32 logits.
  """
  if method not in ATTENTION_METHODS:
    raise ValueError(f"method must be one of {ATTENTION_METHODS}, got {method!r}")
  dropout = dropout_rng is not None and dropout_rate > 0.0
  if layout.shards is not None:
    if dropout:
      raise ValueError("packing a batch split over devices has no attention dropout: run "
                       "the model deterministic, or on one device")
    attend = functools.partial(packed_attention, causal=causal, window=window,
                               alibi_slopes=alibi_slopes, implementation=implementation,
                               method=method)
    return map_shards(lambda block, q, k, v: attend(q, k, v, block), layout,
                      (query, key, value), ("packed",) * 3, "packed")
  if method == "auto":
    method = attention_method(query, layout, window=window, dropout=dropout)
  if method == "rows":
    if dropout:
      raise ValueError("row attention has no dropout: use the 'mask' attention")
    return row_attention(query, key, value, layout, causal=causal, window=window,
                         alibi_slopes=alibi_slopes, implementation=implementation)
  mask = attention_mask(layout, causal=causal, window=window)
  bias = alibi_bias(alibi_slopes, layout.ranks, query, layout.capacity)
  if dropout:
    # The fused kernels have no dropout: the probabilities are materialised.
    groups = query.shape[2] // key.shape[2]
    key, value = (jnp.repeat(a, groups, axis=2) for a in (key, value))
    bias = jnp.where(mask, 0.0 if bias is None else bias, jnp.finfo(jnp.float32).min)
    weights = nn.dot_product_attention_weights(
        query, key, bias=bias, dropout_rng=dropout_rng, dropout_rate=dropout_rate,
        broadcast_dropout=broadcast_dropout, deterministic=False, dtype=jnp.float32)
    return jnp.einsum("...hqk,...khd->...qhd", weights.astype(value.dtype), value)
  implementation = implementation or fused_attention_implementation(query)
  return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask,
                                      is_causal=causal, implementation=implementation)
