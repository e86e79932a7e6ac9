"""Selection per shard: SEBP on a batch split over devices.

Selecting the top rows of a batch that is split over devices is a global question (which rows
of the whole batch?), and asking it of XLA's partitioner gathers dY or the mask across devices
in every layer's backward, a collective the dense step does not have; on a mesh of ``Explicit``
axes it does not even trace (a cumsum over a sharded axis). Each shard holds its own rows,
though, and the kept rows of one shard never meet another's until dW is summed. So each shard
selects among its own rows, at a capacity per shard, inside a ``jax.shard_map`` over the axes
that split the batch:

* the rows' outputs (dX) come back split as the rows came in;
* the sums over rows (dW, db, an embedding table's gradient) come back as one partial sum per
  shard, stacked, and are summed outside the ``shard_map``, so that XLA reduces them across
  devices exactly as it reduces the dense backward's: an all-reduce for a replicated parameter,
  a reduce-scatter for one sharded FSDP-style. The partial sums cross devices in the compute
  dtype, as the dense backward's do (bfloat16 for a float32 weight used in bfloat16: half the
  bytes of float32), and the total is cast to the parameter's dtype after;
* except an embedding table's gradient where all shards' kept rows are at most the
  table's: each shard's kept rows of dY and their ids are gathered to every device, which
  sums them per id in a fixed order and scatters the sums into the table itself
  (:func:`gather_row_shards`), moving those rows where a sum would move the table;
* parameters enter whole (replicated), as the dense backward needs them for dX.

A step may instead be written per device, its loss in a ``jax.shard_map`` whose every device
runs the one-device loss on its own rows (:func:`fsdp_loss`, FSDP with the gathers and
reduce-scatters placed there); the ops then see one device's rows, and :func:`vary_alike`
sums a replicated weight's gradient over the devices. A split embedding table need not be
gathered there: :func:`split_table_lookup` looks each device's ids up where the rows are;
nor an LM head split by its vocabulary, whose logits each device computes on its own columns
(:func:`sebp_jax.losses.vocab_split_cross_entropy`).

A :class:`RowSharding` says how a layer's rows are split: over the mesh axes of its first
(batch) dimension. Under an ``Explicit`` mesh the array's type tells; under an ``Auto`` mesh the
types carry no sharding, and ``use_sebp(batch_axes=...)`` says which axes split the batch.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import math
import re
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec as P

from sebp_jax.backward import table_row_ids
from sebp_jax.implementations import explicit_axes, varying_axes
from sebp_jax.outputs import (LinearHead, linear_head_reason, packed_rows_of, remember_head,
                              remember_packed)
from sebp_jax.selection import validate_top_n

logger = logging.getLogger("sebp_jax")

Array = jax.Array


def _axis_names(entry: Any) -> tuple[str, ...]:
  """A PartitionSpec entry (None, a name or a tuple of names) as a tuple of names."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def normalize_batch_axes(batch_axes: Any) -> tuple[str, ...] | None:
  """``batch_axes`` as a tuple of mesh axis names (None stays None), or ValueError."""
  if batch_axes is None:
    return None
  axes = (batch_axes,) if isinstance(batch_axes, str) else batch_axes
  if (not isinstance(axes, (tuple, list)) or not axes
      or not all(isinstance(a, str) for a in axes)):
    raise ValueError(f"batch_axes must be a mesh axis name or a tuple of them, got "
                     f"{batch_axes!r}")
  return tuple(axes)


@dataclasses.dataclass(frozen=True)
class RowSharding:
  """The mesh axes that split a layer's rows along their first dimension: each shard selects
  its own rows, at its capacity."""
  mesh: Any  # jax.sharding.Mesh or AbstractMesh
  axes: tuple[str, ...]
  #: The axes are ``Explicit``: arrays carry the split in their types.
  explicit: bool

  @property
  def num_shards(self) -> int:
    return math.prod(self.mesh.shape[axis] for axis in self.axes)

  def rows_spec(self, ndim: int) -> P:
    """The spec of an array of rows: its first dimension split, the others whole."""
    return P(self.axes, *(None,) * (ndim - 1))

  def split_rows(self, array: Array | None) -> Array | None:
    """``array`` as a ``jax.shard_map`` over these axes takes rows: under ``Explicit`` axes,
    typed as split along its first dimension only (gathered along others, a sequence axis);
    under ``Auto`` axes as it is."""
    if array is None or not self.explicit:
      return array
    return jax.sharding.reshard(array, self.rows_spec(jnp.ndim(array)))

  def whole(self, array: Array | None) -> Array | None:
    """``array`` whole on every device: under ``Explicit`` axes typed as replicated (as a
    ``jax.shard_map`` takes what every shard reads, or an operand that meets the rows along
    another dimension); under ``Auto`` axes as it is."""
    if array is None or not self.explicit:
      return array
    return jax.sharding.reshard(array, P())


def _explicit_row_axes(x: Array) -> tuple[Any, tuple[str, ...]]:
  """``(mesh, axes)`` of the ``Explicit`` mesh axes that split ``x``'s first dimension
  (``axes`` empty where none does)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not mesh.shape:
    return None, ()
  spec = tuple(sharding.spec) + (None,) * (jnp.ndim(x) - len(sharding.spec))
  explicit = explicit_axes(mesh)
  first = tuple(a for a in _axis_names(spec[0]) if a in explicit)
  return mesh, first


def validate_mesh(mesh: Any) -> Any:
  """``mesh`` where it is None or a mesh (``jax.sharding.Mesh`` or ``AbstractMesh``), else
  ValueError."""
  if mesh is not None and not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__} {mesh!r}")
  return mesh


def _mesh_axis_size(mesh: Any, axis: str) -> int:
  """The devices along ``axis`` of ``mesh``, or ValueError naming what is wrong."""
  if validate_mesh(mesh) is None:
    raise ValueError("mesh must be a jax.sharding.Mesh, got None")
  if axis not in mesh.shape:
    raise ValueError(f"axis={axis!r} is not an axis of the mesh {dict(mesh.shape)}")
  return mesh.shape[axis]


def _mesh_for(mesh: Any, batch_axes: tuple[str, ...]) -> Any:
  """``mesh``, else the one of ``jax.set_mesh``, checked to have ``batch_axes``."""
  mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
  if mesh is None or not mesh.shape:
    raise ValueError(f"batch_axes={batch_axes} needs a mesh: pass mesh=..., or enter "
                     "jax.set_mesh(mesh) around the step")
  missing = [axis for axis in batch_axes if axis not in mesh.shape]
  if missing:
    raise ValueError(f"batch_axes={batch_axes} names axes {missing} that the mesh "
                     f"{dict(mesh.shape)} does not have")
  return mesh


def row_sharding(x: Array, num_row_dims: int, *, mesh: Any = None,
                 batch_axes: tuple[str, ...] | None = None) -> RowSharding | None:
  """How the rows of ``x`` (its first ``num_row_dims`` dims) are split over devices; None for
  rows on one device, or split in a way that per-shard selection does not serve (a first
  dimension the shards do not divide evenly). Over ``Explicit`` axes of one device in all it
  is one shard: the arrays are typed as split, which the selection's ops refuse outside the
  ``shard_map``.

  ``batch_axes`` (with ``mesh``, or the mesh of ``jax.set_mesh``) names the axes that split
  the first dimension where the types do not tell (an ``Auto`` mesh). Under an ``Explicit``
  mesh the type tells, and ``batch_axes`` must agree with it.
  """
  validate_mesh(mesh)
  if num_row_dims < 1:
    return None
  type_mesh, explicit_axes = _explicit_row_axes(x)
  if explicit_axes:
    if batch_axes is not None and tuple(batch_axes) != explicit_axes:
      raise ValueError(f"batch_axes={batch_axes} disagrees with the sharding of an array of "
                       f"type {jax.typeof(x)}: its first dimension is split over "
                       f"{explicit_axes}")
    sharding = RowSharding(type_mesh, explicit_axes, explicit=True)
  elif batch_axes is None:
    return None
  else:
    manual = set(batch_axes) & set(jax.sharding.get_abstract_mesh().manual_axes)
    if manual:
      raise ValueError(f"batch_axes={tuple(batch_axes)} names {tuple(sorted(manual))}, which "
                       "this code runs inside (a jax.shard_map, or fsdp_loss): each device "
                       "holds its own rows already; leave batch_axes out there")
    mesh = _mesh_for(mesh, batch_axes)
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    # An array not typed as split (a host mask) on Explicit axes: split it for shard_map.
    sharding = RowSharding(mesh, tuple(batch_axes), explicit=any(
        kinds[axis] == AxisType.Explicit for axis in batch_axes))
  if sharding.num_shards == 1 and not sharding.explicit:
    return None  # Arrays typed as split over a mesh of one device still need the shard_map.
  if jnp.shape(x)[0] % sharding.num_shards:
    _warn_undivided_rows(tuple(jnp.shape(x)[:num_row_dims]), sharding.axes,
                         sharding.num_shards)
    return None
  return sharding


@functools.lru_cache(maxsize=None)
def _warn_undivided_rows(shape: tuple[int, ...], axes: tuple[str, ...], num_shards: int) -> None:
  """Warns once per shape (every layer on the rows would)."""
  logger.warning(
      "rows of shape %s split over %s: their first dimension is not divided by the %d shards, "
      "so they select over every shard's rows at once (the rows gathered, top_n counting all "
      "of them). Packed rows [1, shards * C] select per shard only in use_sebp(packed=True), "
      "which packs them itself.", shape, axes, num_shards)


def _floating_as(array: Array, dtype: Any) -> Array:
  """``array`` cast to ``dtype`` where both are given and it is floating; else as it is."""
  if dtype is None or not jnp.issubdtype(array.dtype, jnp.floating):
    return array
  return array.astype(dtype)


def vary_alike(*arrays: Array | None, dtype: Any = None) -> tuple[Array | None, ...]:
  """``arrays`` (None passes through), each made to vary over every manual mesh axis that any
  of them varies over (in a ``jax.shard_map``; a no-op outside one). A ``custom_vjp`` must
  return each input's cotangent varying as that input does, while its backward computes them
  from inputs that vary together; called on the inputs first, a replicated one (a parameter
  used by every device) gets its cotangent summed over the devices, by ``pcast``'s
  transpose. With ``dtype`` (the op's compute dtype, which it casts to anyway), a floating
  array made to vary is cast to it first, so that the sum crosses devices in it, as the dense
  op's does."""
  axes = frozenset().union(*(varying_axes(a) for a in arrays if a is not None))
  return tuple(a if a is None or varying_axes(a) >= axes
               else jax.lax.pcast(_floating_as(a, dtype), tuple(sorted(axes - varying_axes(a))),
                                  to="varying")
               for a in arrays)


def map_row_shards(fn: Callable, sharding: RowSharding, rows: tuple[Array | None, ...],
                   whole: tuple[Array | None, ...], sums_like: tuple[Array | None, ...],
                   sums_dtype: Any = None) -> tuple[tuple, tuple]:
  """Runs ``fn(rows, whole) -> (row_outputs, sums)`` on each shard's block of ``rows``.

  Args:
    fn: the per-shard computation; ``rows`` are its blocks of the row arrays (first dimension
      split), ``whole`` the other arrays, replicated; ``sums`` are sums over its rows.
    rows: arrays split along their first dimension (None passes through).
    whole: arrays every shard sees whole (parameters).
    sums_like: for each of ``sums``, the array whose sharding the total takes (the parameter
      of a gradient), or None.
    sums_dtype: the dtype the partial sums are summed across devices in (None: their own).

  Returns:
    ``(row_outputs, sums)``: the row outputs joined along the first dimension, and each of
    ``sums`` summed over the shards, in the sharding of its ``sums_like``.
  """
  def block(rows, whole):
    row_outputs, sums = fn(rows, whole)
    return row_outputs, tuple(None if s is None else s.astype(sums_dtype or s.dtype)[None]
                              for s in sums)

  split = P(sharding.axes)  # The first dimension split, of any array.
  row_outputs, stacked = jax.shard_map(
      block, mesh=sharding.mesh, in_specs=(split, P()), out_specs=(split, split),
      axis_names=frozenset(sharding.axes), check_vma=False,
  )(tuple(sharding.split_rows(r) for r in rows), tuple(sharding.whole(w) for w in whole))
  sums = []
  for partial, like in zip(stacked, sums_like):
    if partial is None:
      sums.append(None)
      continue
    total = jnp.sum(partial, axis=0, dtype=partial.dtype)
    if sharding.explicit and like is not None:
      total = jax.sharding.reshard(total, jax.typeof(like).sharding.spec)
    sums.append(total)
  return row_outputs, tuple(sums)


def gather_row_shards(select: Callable, combine: Callable, sharding: RowSharding,
                      rows: tuple[Array | None, ...], like: Array | None = None) -> Array:
  """``combine`` of every shard's ``select``-ed pieces, the same on every device.

  Args:
    select: ``select(rows) -> pieces`` on each shard's block of ``rows`` (a tuple of arrays
      or None, each with a leading dimension to join the shards' along).
    combine: ``combine(*pieces) -> result`` on every shard's pieces, joined.
    sharding: how ``rows`` are split.
    rows: arrays split along their first dimension (None passes through).
    like: the array whose sharding the result takes under ``Explicit`` axes (a parameter,
      for its gradient).

  Returns:
    ``combine``'s result, whole on every device: each device gathers the pieces (an
    all-gather, where :func:`map_row_shards` sums partial results) and combines them itself,
    which must then give the same result on every device.
  """
  def block(rows):
    pieces = tuple(None if p is None else jax.lax.all_gather(p, sharding.axes, tiled=True)
                   for p in select(rows))
    return combine(*pieces)

  result = jax.shard_map(
      block, mesh=sharding.mesh, in_specs=(P(sharding.axes),), out_specs=P(),
      axis_names=frozenset(sharding.axes), check_vma=False,
  )(tuple(sharding.split_rows(r) for r in rows))
  if sharding.explicit and like is not None:
    result = jax.sharding.reshard(result, jax.typeof(like).sharding.spec)
  return result


def split_table_lookup(shard: Array, ids: Array, axis: str, num_embeddings: int) -> Array:
  """``table[ids]`` on each device of a ``jax.shard_map`` over ``axis``, for a ``table`` of
  ``num_embeddings`` rows split over ``axis`` by rows (``shard``: this device's block), each
  device with its own ``ids``: every device looks up every device's ids among its own rows and
  a reduce-scatter hands each device the rows of its ids. What crosses devices are the ids
  and the rows looked up, not the table; under ``jax.grad`` dY's rows are gathered back and
  the table's gradient stays split (a scatter-add into each device's own rows). Ids out of
  ``[-num_embeddings, num_embeddings)`` read NaN, as with ``jnp.take``."""
  if jnp.ndim(shard) != 2:
    raise ValueError(f"shard must be 2-D [rows, features], got shape {jnp.shape(shard)}")
  if not jnp.issubdtype(jnp.asarray(ids).dtype, jnp.integer):
    raise ValueError(f"ids must be integer token ids, got dtype {jnp.asarray(ids).dtype}")
  rows = shard.shape[0]
  if num_embeddings > rows * jax.lax.axis_size(axis):
    raise ValueError(f"num_embeddings ({num_embeddings}) must be at most the rows of the "
                     f"table split over {axis!r}: {rows} a device, "
                     f"{rows * jax.lax.axis_size(axis)} in all")
  # The ids cross in their own dtype, and each device reads them as jnp.take would.
  every = table_row_ids(jax.lax.all_gather(ids, axis), num_embeddings)  # [devices, *ids]
  local = every - jax.lax.axis_index(axis) * rows
  owned = (local >= 0) & (local < rows)
  # Another device's id reads zeros here, by an index past the end: the backward's
  # scatter-add then drops it, where any real row would take every such add, one at a time.
  found = jnp.take(shard, jnp.where(owned, local, rows), axis=0, mode="fill", fill_value=0)
  looked_up = jax.lax.psum_scatter(found, axis, scatter_dimension=0)
  valid = table_row_ids(ids, num_embeddings) < num_embeddings
  return jnp.where(valid[..., None], looked_up, jnp.array(jnp.nan, looked_up.dtype))


def _plain(module: nn.Module, kind: type) -> bool:
  """``module`` is a ``kind`` whose forward is Linen's own: a subclass's ``__call__`` (or a
  custom ``dot_general``) may read its parameters another way."""
  return (isinstance(module, kind) and type(module).__call__ is kind.__call__
          and getattr(module, "dot_general", None) is None
          and getattr(module, "dot_general_cls", None) is None)


def _split_dimension(spec: Any, axis: str) -> int | None:
  """The dimension ``spec`` splits over ``axis`` for :func:`fsdp_loss`: 0, 1 (a matrix's
  columns, say) or None (replicated)."""
  entries = tuple(spec) if isinstance(spec, P) else None
  while entries and entries[-1] is None:
    entries = entries[:-1]
  if entries in ((), (axis,), (None, axis)):
    return len(entries) - 1 if entries else None
  raise ValueError(f"param_specs: expected P({axis!r}) (split along the first dimension), "
                   f"P(None, {axis!r}) (a matrix split along its second) or P() "
                   f"(replicated) for every parameter, got {spec!r}")


def _computing_in_place(shards: dict[int, tuple[Array, int]], axis: str, devices: int,
                        lookups: bool | str) -> Callable:
  """A Linen interceptor for the modules whose parameters are split over ``axis`` (``shards``:
  {id of the gathered parameter: (this device's shard, the dimension split)}):

  * an ``nn.Embed`` lookup of a table split by rows runs :func:`split_table_lookup` on the
    shard, ``lookups is True`` or (``"auto"``) where the rows it moves are fewer than the
    table's;
  * an ``nn.Dense`` whose kernel is split by columns runs as it is (on the gathered kernel),
    its output remembered with the :class:`~sebp_jax.outputs.LinearHead` of this device's
    columns (the packed rows' head, where ``use_sebp(packed=True)``, an interceptor inside
    this one, ran it on them): a loss that reads the head (``masked_causal_lm_loss``)
    computes the logits on each device's columns, and the gathered kernel goes unused.

  Any other call runs as it is."""
  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if context.method_name != "__call__":
      return next_fun(*args, **kwargs)
    if _plain(module, nn.Embed) and lookups is not False:
      (inputs,) = args or (kwargs["inputs"],)
      shard, dimension = shards.get(id(module.embedding), (None, None))
      if (dimension != 0 or not jnp.issubdtype(jnp.asarray(inputs).dtype, jnp.integer)
          or (lookups == "auto" and devices * jnp.size(inputs) >= module.num_embeddings)):
        return next_fun(*args, **kwargs)
      (shard,) = module.promote_dtype(shard, dtype=module.dtype, inexact=False)
      return split_table_lookup(shard, inputs, axis, module.num_embeddings)
    if _plain(module, nn.Dense) and module.has_variable("params", "kernel"):
      kernel, dimension = shards.get(id(module.get_variable("params", "kernel")), (None, None))
      if dimension != 1:
        return next_fun(*args, **kwargs)
      bias = None
      if module.use_bias:
        whole_bias = module.get_variable("params", "bias")
        bias, bias_dimension = shards.get(id(whole_bias), (whole_bias, None))
        if bias_dimension is None:  # Replicated: this device's columns of it.
          bias = jax.lax.dynamic_slice_in_dim(
              bias, jax.lax.axis_index(axis) * kernel.shape[1], kernel.shape[1])
      outputs = next_fun(*args, **kwargs)
      packed = packed_rows_of(outputs)
      if packed is not None:  # use_sebp(packed=True) ran the head on the packed rows.
        if packed.head is None:  # linear_head_reason said why there.
          return outputs
        dtype = packed.head.kernel.dtype  # The forward's promotion, as the head has it.
        return remember_packed(outputs, packed.rows, packed.layout, packed.head.replace(
            kernel=kernel.astype(dtype), bias=None if bias is None else bias.astype(dtype),
            vocab_axis=axis))
      # Asked after the call: an op interceptor may learn in it which operand is the weight.
      if linear_head_reason(module) is not None:
        return outputs
      (inputs,) = args or (kwargs["inputs"],)
      inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
      return remember_head(outputs, LinearHead(
          jnp.reshape(inputs, (-1, inputs.shape[-1])), kernel, bias, module.precision,
          vocab_axis=axis))
    return next_fun(*args, **kwargs)
  return interceptor


def _unboxed(tree: Any) -> Any:
  """``tree`` with each Flax metadata box (``nn.with_partitioning``'s ``nn.Partitioned``,
  ``nn.LogicallyPartitioned``) replaced by its value, unconstrained: a box's own unboxing
  constrains the value to a sharding over the mesh's axes, which a ``shard_map`` has made
  manual."""
  def unbox(box):
    return (box.unbox(apply_constraint=False) if isinstance(box, nn.Partitioned)
            else box.unbox())
  return nn.meta.map_axis_meta(unbox, tree)


# Set while fsdp_loss runs a loss_fn whose devices weigh by their rows (weight_fn=None).
# Part of jax.jit's cache key: a function jitted inside fsdp_loss with a weight_fn is traced
# again, and checked, inside one without.
_devices_weighed_by_rows = jax.make_user_context(False)


def check_devices_weighed_alike(loss: str, count_fn: str) -> None:
  """Raise where ``loss``, a mean over a count other than the rows, runs in :func:`fsdp_loss`
  without a ``weight_fn``: each device would weigh by its rows, not by what it averages."""
  if _devices_weighed_by_rows.value:
    raise ValueError(
        f"{loss} averages over its target tokens, which devices hold unequally, but "
        f"fsdp_loss was given no weight_fn and weighs each device by its rows: the loss and "
        f"gradient would not be the whole batch's. Pass weight_fn=lambda batch: "
        f"{count_fn}(<the batch's attention mask>), or a weight_fn returning the rows to weigh "
        f"by rows on purpose.")


def fsdp_loss(loss_fn: Callable, mesh: Any, param_specs: Any, *, axis: str = "data",
              weight_fn: Callable | None = None, gather_dtype: Any = None,
              lookups_in_place: bool | str = "auto") -> Callable:
  """``loss_fn(params, batch)`` as the loss of a step over ``mesh``, written out per device:
  FSDP (ZeRO-3) whose every collective is placed here rather than left to XLA's partitioner.

  In a ``jax.shard_map`` over ``axis``, each device gathers the parameters split over it
  (``lax.all_gather``, each cast to ``gather_dtype`` on its own shard first) and runs
  ``loss_fn`` on its own rows of ``batch`` as one device would: ``use_sebp`` inside, without
  ``batch_axes``, selects or packs among that device's rows at that device's capacity. Under
  ``jax.grad`` each gathered parameter's gradient comes back as the gather's transpose, a
  reduce-scatter in ``gather_dtype``, and a replicated one's as an all-reduce; the optimizer
  then updates each device's shard only. Left to XLA's partitioner, the same split parameters
  may be gathered again for the backward and their gradients summed whole before being split
  (all-reduces): this form has one all-gather and one reduce-scatter per split parameter, the
  dense step and an SEBP or packed one alike. XLA combines small reduce-scatters up to a
  threshold; on a link where small collectives are slow (2 GPUs of one host in the README's
  measurements), compile the step with a larger one
  (``compiler_options={"xla_gpu_reduce_scatter_combine_threshold_bytes": 256 << 20}``).

  Two kinds of split parameter of a Linen model need not be gathered at all, and their
  all-gather at the step's start and reduce-scatter at its end, which nothing can overlap,
  become collectives of activations:

  * an embedding table split by rows that an ``nn.Embed`` looks up (a Llama's 128k-row
    vocabulary; ``lookups_in_place``): each device looks its rows up where they are
    (:func:`split_table_lookup`), so that the ids and the rows cross devices in place of the
    table, in the forward and in the backward;
  * an LM head's kernel ``[D, V]`` split by columns, the vocabulary (spec ``P(None, axis)``),
    where :func:`sebp_jax.losses.masked_causal_lm_loss` reads the head's logits: each device
    computes its columns' logits for every device's rows, whose inputs are gathered (``[D]``
    per row, where the kernel has ``V``), and only each row's sums over the columns cross
    devices; the inputs' gradient is reduce-scattered back, the kernel's never leaves its
    device. Whatever else reads the logits reads them as the gathered kernel makes them.

  A table also read whole (a tied head's ``attend``) is gathered for that use as before.

  Args:
    loss_fn: the one-device loss, ``loss_fn(params, batch) -> scalar``, an average over its
      batch.
    mesh: the devices.
    param_specs: PartitionSpecs shaped like the params: ``P(axis)`` for a parameter split
      along its first dimension, ``P(None, axis)`` for one split along its second (an LM
      head's kernel by its vocabulary), ``P()`` for a replicated one; :func:`fsdp_specs`
      writes them. Params boxed by ``nn.with_partitioning`` take specs boxed alike (as
      ``fsdp_specs`` writes them); ``loss_fn`` gets them unboxed, split as the specs say
      whatever names the boxes carry.
    axis: the mesh axis that splits every array of ``batch`` and the split parameters.
    weight_fn: ``weight_fn(batch) -> scalar``, how many items ``loss_fn`` averages over on a
      device's batch (None: its rows; :func:`sebp_jax.losses.causal_lm_target_count` for
      :func:`~sebp_jax.losses.masked_causal_lm_loss`, which raises when run here with None).
      Each device's loss weighs by its share, so that the value and the gradient are those of
      the whole batch on one device. A device
      of weight 0 (rows all padding) must still get a finite loss: a mean that divides by its
      count of 0 is NaN there, and NaN times its share of 0 makes every gradient NaN.
    gather_dtype: the dtype a split floating parameter is gathered in, the compute dtype it is
      cast to anyway (bfloat16 for float32 weights used in bfloat16: half the bytes both
      ways), or None (its own).
    lookups_in_place: where to look a split embedding table up in place rather than gather
      it (``nn.Embed`` of Linen models, given the table as ``loss_fn`` was): ``"auto"``
      (default) where the rows the lookup moves, devices times its ids, are fewer than the
      table's (a vocabulary, not BERT's 512 positions under a batch of 16k tokens), True for
      every such lookup, False for none.

  Returns:
    ``loss(params, batch) -> scalar``: the whole batch's loss, for params laid out as
    ``param_specs`` and a batch split over ``axis``; its gradient is laid out as the params.
  """
  _mesh_axis_size(mesh, axis)
  if not (isinstance(lookups_in_place, bool) or lookups_in_place == "auto"):
    raise ValueError(f"lookups_in_place must be 'auto', True or False, got {lookups_in_place!r}")
  split = P(axis)
  specs, params_tree = jax.tree.flatten(param_specs)
  dimensions = [_split_dimension(spec, axis) for spec in specs]  # Each parameter's split.

  def per_device(params, batch):
    shards = [p if dimension is None else _floating_as(p, gather_dtype)
              for p, dimension in zip(params_tree.flatten_up_to(params), dimensions)]
    whole = [shard if dimension is None
             else jax.lax.all_gather(shard, axis, axis=dimension, tiled=True)
             for shard, dimension in zip(shards, dimensions)]
    # A gathered parameter that only in-place computations read is left unused, and XLA
    # drops its gather.
    in_place = {id(w): (shard, dimension) for w, shard, dimension in zip(whole, shards, dimensions)
                if dimension is not None}
    weight = jnp.asarray(jax.tree.leaves(batch)[0].shape[0] if weight_fn is None
                         else weight_fn(batch))
    total = jax.lax.psum(weight, axis)  # Counts sum exactly, as integers.
    with (nn.intercept_methods(_computing_in_place(in_place, axis, mesh.shape[axis],
                                                   lookups_in_place)),
          _devices_weighed_by_rows(weight_fn is None)):
      loss = loss_fn(_unboxed(params_tree.unflatten(whole)), batch)
    # The share in the loss's precision (float64 under x64), float32 at least.
    dtype = jnp.promote_types(loss.dtype, jnp.float32)
    share = weight.astype(dtype) / jnp.where(total == 0, 1, total).astype(dtype)
    return jax.lax.psum(loss * share, axis)

  return jax.shard_map(per_device, mesh=mesh, in_specs=(param_specs, split), out_specs=P())



def fsdp_specs(params: Any, mesh: Any, *, axis: str = "data",
               heads: tuple[str, ...] = ("lm_head",), head_rows: int | None = None) -> Any:
  """PartitionSpecs for :func:`fsdp_loss`, shaped like ``params`` or anything that holds them
  (an optimizer's state, whose moments then split as their params do): an array of two or
  more dimensions split over ``axis`` along its first where the axis' devices divide it
  (``P(axis)``), any other replicated (``P()``: biases, norms' scales, a step count).

  An LM head's ``kernel`` ``[D, V]``, that of a Linen module named in ``heads`` (a path
  ending ``<head>/.../kernel``), is split by its columns instead, the vocabulary
  (``P(None, axis)``), where the devices divide ``V``: :func:`fsdp_loss` then moves the rows
  the head reads, ``D`` numbers each, in place of the kernel's ``V`` per feature.
  ``head_rows``: the rows a device's head reads (a packed step's capacity, a padded step's
  batch × length), the head split only where that moves fewer bytes, the devices times those
  rows fewer than ``V``; None splits it wherever the devices divide ``V``. ``heads=()`` splits
  every matrix by its rows, as it does an NNX model's (``fsdp_loss`` computes a split head in
  place for Linen models only). A param boxed by ``nn.with_partitioning`` gets its spec in a
  box alike, chosen as for its value (the box's names are not read).
  """
  devices = _mesh_axis_size(mesh, axis)
  if isinstance(heads, str):
    raise ValueError(f"heads must be a tuple of module names, got the string {heads!r}")
  if head_rows is not None:
    head_rows = validate_top_n(head_rows, "head_rows")

  def spec(path, param):
    if isinstance(param, nn.Partitioned):  # nn.with_partitioning's box: its value's spec.
      return param.replace(value=spec(path, param.value))
    names = [getattr(key, "key", getattr(key, "name", None)) for key in path]
    shape = np.shape(param)
    if (set(names) & set(heads) and names[-1] == "kernel" and len(shape) == 2
        and shape[1] % devices == 0 and (head_rows is None or devices * head_rows < shape[1])):
      return P(None, axis)
    return P(axis) if len(shape) >= 2 and shape[0] % devices == 0 else P()
  return jax.tree_util.tree_map_with_path(
      spec, params, is_leaf=lambda x: isinstance(x, nn.Partitioned))


def shard_row_counts(mask: Any, num_shards: int) -> np.ndarray:
  """The real tokens of each shard's block of a host ``mask`` split along its first dim."""
  mask = np.asarray(mask)
  if mask.shape[0] % num_shards:
    raise ValueError(f"a mask of shape {mask.shape} does not split evenly into {num_shards} "
                     "shards along its first dimension")
  return np.count_nonzero(mask.reshape(num_shards, -1), axis=1)


_COLLECTIVE = re.compile(
    r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\(")
# Every XLA element type: pred, s4-s64 and u4-u64, bf16, f16-f64, the f8 and f4 kinds
# (f8e4m3fn, ...), c64 and c128; the bits are the number after the first letters.
_ARRAY = re.compile(r"\b(pred|bf16|[suf]\d+(?:e\d+m\d+[a-z]*)?|c64|c128)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16}


def _tuple_elements(type_text: str) -> list[str]:
  """The elements of an HLO tuple type ``(a, b, ...)``; a type that is no tuple, as is."""
  if not type_text.startswith("("):
    return [type_text]
  elements, depth, start = [], 0, 1
  for position, char in enumerate(type_text):
    depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
    if (char == "," and depth == 1) or (char == ")" and depth == 0):
      elements.append(type_text[start:position].strip())
      start = position + 1
  return elements


def _result_type(type_text: str, kind: str, started: bool) -> str:
  """The result part of an HLO collective's type. An async start's type holds it: the whole
  type for ``all-reduce-start`` (its results), the last element for ``all-gather-start``
  ``(operands, results)``, the second for ``collective-permute-start`` ``(operand, result,
  contexts)``."""
  if not started or kind == "all-reduce":
    return type_text
  elements = _tuple_elements(type_text)
  return elements[1] if kind == "collective-permute" and len(elements) > 1 else elements[-1]


def collective_sizes(compiled: Any) -> list[tuple[str, int]]:
  """``(kind, bytes of its result)`` of each collective of a compiled program
  (``jax.jit(f).lower(...).compile()``), a combined one once: what crosses devices, one by
  one (an FSDP step's gathered weights, say). A lowered program, not yet compiled, has no
  collectives yet (XLA places them): ValueError."""
  if isinstance(compiled, jax.stages.Lowered):
    raise ValueError("collective_sizes needs a compiled program (.lower(...).compile()): a "
                     "lowered one has no collectives yet, XLA's partitioner places them")
  found = []
  for type_text, kind, started in _COLLECTIVE.findall(compiled.as_text()):
    size = 0
    for dtype, dims in _ARRAY.findall(_result_type(type_text, kind, bool(started))):
      bits = _BITS.get(dtype) or int(re.match(r"[a-z]+(\d+)", dtype)[1])
      size += math.prod(int(d) for d in dims.split(",") if d) * bits // 8
    found.append((kind, size))
  return found


def collective_counts(compiled: Any) -> dict[str, int]:
  """The collectives of a compiled program (``jax.jit(f).lower(...).compile()``) by kind
  (``all-gather``, ``all-reduce``, ``reduce-scatter``, ``all-to-all``,
  ``collective-permute``), counting a combined one once: to check that an SEBP step
  communicates no more than the dense one."""
  return dict(collections.Counter(kind for kind, _ in collective_sizes(compiled)))


def collective_bytes(compiled: Any) -> dict[str, int]:
  """The bytes the collectives of a compiled program produce, by kind."""
  totals = collections.Counter()
  for kind, size in collective_sizes(compiled):
    totals[kind] += size
  return dict(totals)
