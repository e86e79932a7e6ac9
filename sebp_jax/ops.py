"""The SEBP ops: a dense, exact forward and a backward from the kept rows of dY.

* :func:`sebp_linear`: ``x @ kernel + bias``, computed as ``flax.linen.Dense`` computes it;
* :func:`sebp_embed_lookup`: ``table[ids]``, as ``flax.linen.Embed`` computes it.

Each is a ``jax.custom_vjp`` (JAX never differentiates through the kernels) whose backward
flattens dY to ``[T, F]`` and hands it to :mod:`sebp_jax.backward`. The arguments are checked
here, once.

Why the choices:

* ``top_n`` is static (``"auto"`` or a Python int), so that every array in the backward has a
  fixed shape: jit compiles once, and no host round trip is needed to learn how many rows are
  active. Where more rows are active than a capacity holds, ``overflow`` says what happens;
  the default runs a larger capacity chosen at run time, so the gradient is always exact.
* The residuals are the dense backward's (the inputs in the compute dtype), plus the
  ``[top_n]`` index when one is given (and the bias, whose type its gradient takes, under
  Explicit mesh axes).
* The cast to the compute dtype happens inside the op, so that the gradients come back in the
  arguments' own dtypes straight from the float32 sums: a float32 kernel used in bf16 gets
  its dW rounded once, not first to bf16 as autodiff through the cast would round it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import canonicalize_dtype, promote_dtype
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from sebp_jax.backward import (OVERFLOW_MODES, embedding_kept_count, embedding_rows,
                               linear_backward, scatter_into_table, sum_rows_of_equal_ids)
from sebp_jax.implementations import (explicit_axes_in_context, implementation_names,
                                      with_explicit_axes_auto)
from sebp_jax.selection import validate_threshold, validate_top_n
from sebp_jax.sharding import (RowSharding, gather_row_shards, map_row_shards,
                               normalize_batch_axes, row_sharding, vary_alike)

Array = jax.Array

#: Name given to every SEBP linear output with ``jax.ad_checkpoint.checkpoint_name``. A remat
#: policy such as ``dots_saveable`` does not recognise a custom_vjp output as a dot; save SEBP
#: outputs with ``jax.checkpoint_policies.save_only_these_names(SEBP_CHECKPOINT_NAME)``.
SEBP_CHECKPOINT_NAME = "sebp_linear"


# ---------------------------------------------------------------------------------------------
# Arguments, checked once.
# ---------------------------------------------------------------------------------------------


def validate_capacity(top_n: Any) -> int | str:
  """``top_n`` as ``"auto"`` or a positive Python int, or ValueError saying what was expected."""
  if isinstance(top_n, str) and top_n == "auto":
    return top_n
  return validate_top_n(top_n)


def validate_overflow(overflow: Any) -> str:
  if overflow not in OVERFLOW_MODES:
    raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
  return overflow


def validate_backend(backend: Any) -> str:
  """``backend`` if it is ``"auto"`` or a registered implementation, else ValueError."""
  choices = ("auto", *implementation_names())
  if backend not in choices:
    raise ValueError(f"backend must be one of {choices}, got {backend!r}")
  return backend


def validate_active_rows(active_rows: Any, num_rows: int,
                         num_shards: int = 1) -> Array | None:
  """``active_rows`` as ``int32[K]`` (None stays None), or ValueError.

  The contract: row indices in ``[0, num_rows)``, strictly ascending, then the sentinel
  ``num_rows`` in every unused slot. A concrete index is checked against it; a traced one
  cannot be: the backward sorts it, counts a row listed twice once and drops entries out of
  ``[0, num_rows)`` (a nonzero row it then misses makes dW and db NaN, as any row the index
  skips). With rows split into ``num_shards`` shards, the index is one such block per shard,
  of its own rows.
  """
  if active_rows is None:
    return None
  # A concrete index is checked as given: jnp.asarray would wrap int64 entries into int32.
  traced = isinstance(active_rows, jax.core.Tracer)
  given = active_rows if traced else np.asarray(active_rows)
  if (given.ndim != 1 or given.size == 0 or given.size % num_shards
      or not jnp.issubdtype(given.dtype, jnp.integer)):
    raise ValueError(f"active_rows must be a non-empty 1-D integer array (row indices), "
                     f"one block of equal size per shard ({num_shards}), "
                     f"got {given.dtype}{list(given.shape)}")
  if not traced:
    shard_rows = num_rows // num_shards
    for rows in given.astype(np.int64).reshape(num_shards, -1):
      real = rows[rows != shard_rows]
      if (np.any(rows < 0) or np.any(rows > shard_rows) or np.any(np.diff(real) <= 0)
          or np.any(rows[len(real):] != shard_rows)):
        raise ValueError(
            f"active_rows must hold row indices in [0, {shard_rows}) in strictly ascending "
            f"order, then the sentinel {shard_rows} in unused slots"
            f"{' (in each shard)' if num_shards > 1 else ''}, got {rows.tolist()}")
  return jnp.asarray(active_rows).astype(jnp.int32)


def _check_linear_shapes(x: Array, kernel: Array, bias: Array | None) -> None:
  if kernel.ndim != 2:
    raise ValueError(f"kernel must be 2-D [in_features, out_features], got shape {kernel.shape}")
  if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"x's last dimension must equal kernel's first: x has shape {x.shape}, "
                     f"kernel has shape {kernel.shape}")
  if bias is not None and bias.shape != (kernel.shape[1],):
    raise ValueError(f"bias must have shape ({kernel.shape[1]},) to match kernel of shape "
                     f"{kernel.shape}, got bias of shape {bias.shape}")


# ---------------------------------------------------------------------------------------------
# The linear op.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _LinearConfig:
  """The static arguments of the linear op; hashable for ``custom_vjp``."""
  top_n: int | str
  threshold: float
  overflow: str
  #: A :class:`sebp_jax.report.LayerEntry` (or any hashable callable), or None.
  row_log: Any
  precision: Any
  backend: str
  #: The compute dtype, as ``nn.Dense.dtype``: x, kernel and bias are cast to it inside.
  dtype: Any
  #: The dtypes of x, kernel and bias as given (None without bias): their gradients'.
  grad_dtypes: tuple[Any, Any, Any]
  #: How the rows are split over devices (each shard selects its own), or None.
  sharding: RowSharding | None = None
  #: ``(spec, contracted_shape, feature_shape)`` of an einsum layer whose rows these are
  #: (:mod:`sebp_jax.nnx`): its forward, or None for ``nn.Dense``'s.
  einsum: tuple[str, tuple[int, ...], tuple[int, ...]] | None = None


def _dense_forward(x, kernel, bias, precision, einsum=None):
  """``flax.linen.Dense``'s forward, op for op, so that the result is bit-identical; with
  ``einsum``, that of ``nnx.Einsum`` (``jnp.einsum`` on the unflattened operands: it orders
  the contracted dims its own way, so a matmul of the flattened rows would sum in another
  order)."""
  if einsum is not None:
    spec, contracted, features = einsum
    rows = x.shape[:-1]
    y = jnp.einsum(spec, x.reshape(*rows, *contracted), kernel.reshape(*contracted, *features),
                   precision=precision)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * len(rows) + tuple(features))
    return y.reshape(*rows, math.prod(features))
  y = lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=precision)
  if bias is not None:
    y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
  return y


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _sebp_linear(x, kernel, bias, active_rows, config: _LinearConfig):
  del active_rows  # Only the backward uses it.
  return _dense_forward(*promote_dtype(x, kernel, bias, dtype=config.dtype), config.precision,
                        config.einsum)


def _sebp_linear_fwd(x, kernel, bias, active_rows, config: _LinearConfig):
  x, kernel, bias = promote_dtype(x, kernel, bias, dtype=config.dtype)
  # Which rows of x are finite, for the backward (linear_backward's finite_x_rows): reduced
  # here, where XLA can fuse the pass with whatever wrote x.
  finite_x_rows = jnp.all(jnp.isfinite(x), axis=-1)
  # The bias only types its gradient, under Explicit mesh axes.
  explicit = (config.sharding is not None and config.sharding.explicit
              or explicit_axes_in_context())
  typed_bias = bias if explicit else None
  return (_dense_forward(x, kernel, bias, config.precision, config.einsum),
          (x, kernel, typed_bias, active_rows, finite_x_rows))


def _linear_grads(config: _LinearConfig, rows, whole):
  """dX (rows) and dW, db (sums over rows) of the rows given."""
  (x, dy, active_rows, finite_x_rows), (kernel,) = rows, whole
  num_rows = math.prod(x.shape[:-1])
  dx, dkernel, dbias = linear_backward(
      x.reshape(num_rows, x.shape[-1]), kernel, dy.reshape(num_rows, dy.shape[-1]),
      top_n=config.top_n, threshold=config.threshold, overflow=config.overflow,
      active_rows=active_rows, finite_x_rows=finite_x_rows.reshape(num_rows),
      backend=config.backend,
      with_bias=config.grad_dtypes[2] is not None, precision=config.precision,
      # A shard's partial dW crosses devices in the compute dtype (the residual kernel's).
      dkernel_dtype=config.grad_dtypes[1] if config.sharding is None else kernel.dtype,
      row_log=config.row_log)
  return (dx.reshape(x.shape),), (dkernel, dbias)


def _sebp_linear_bwd(config: _LinearConfig, residuals, dy):
  x, kernel, bias, active_rows, finite_x_rows = residuals
  grads = functools.partial(_linear_grads, config)
  if config.sharding is None:
    def run(x, dy, active_rows, finite_x_rows, kernel):
      return grads((x, dy, active_rows, finite_x_rows), (kernel,))
    # Rows not split over the Explicit axes, if any (weights or features split, tensor or
    # sequence parallel): XLA partitions the backward, each gradient typed as its array.
    spec = lambda a: None if a is None else jax.typeof(a).sharding.spec  # noqa: E731
    run = with_explicit_axes_auto(run, ((spec(x),), (spec(kernel), spec(bias))))
    (dx,), (dkernel, dbias) = run(x, dy, active_rows, finite_x_rows, kernel)
  else:
    (dx,), (dkernel, dbias) = map_row_shards(
        grads, config.sharding, rows=(x, dy, active_rows, finite_x_rows), whole=(kernel,),
        sums_like=(kernel, bias), sums_dtype=kernel.dtype)
    if config.sharding.explicit:  # The shards' rows come back split by their first dim only.
      dx = jax.sharding.reshard(dx, jax.typeof(x).sharding.spec)
  dx, dkernel, dbias = (None if g is None else g.astype(dtype)
                        for g, dtype in zip((dx, dkernel, dbias), config.grad_dtypes))
  return dx, dkernel, dbias, None


_sebp_linear.defvjp(_sebp_linear_fwd, _sebp_linear_bwd)


def sebp_linear(x: Array, kernel: Array, bias: Array | None = None, *,
                top_n: int | str = "auto", threshold: float = 0.0, overflow: str = "exact",
                precision: Any = None, backend: str = "auto", active_rows: Array | None = None,
                dtype: Any = None, row_log: Any = None, batch_axes: Any = None,
                mesh: Any = None, einsum: Any = None) -> Array:
  """``x @ kernel + bias`` with a backward from the active rows of dY only.

  A row of dY is *active* when its max ``|value|`` exceeds ``threshold`` or it holds NaN/Inf
  (and, with ``active_rows``, it is listed there); the backward computes dX, dW and db from the
  active rows, at a static capacity of kept rows.

  Args:
    x: ``[..., D]``; every leading dimension counts as rows, ``T = prod(x.shape[:-1])``.
    kernel: ``[D, N]``.
    bias: ``[N]`` or None.
    top_n: the capacity, static: ``"auto"`` (default) compiles T/16, T/8, T/4, T/2 and the
      dense backward, and runs the smallest that holds every active row; a positive int is
      one capacity (``top_n >= T``: the dense backward of the active rows).
    threshold: a row of dY is active when its max ``|value|`` exceeds this (0.0: any
      non-zero); the same rows are active whatever the capacity.
    overflow: when more rows are active than an int ``top_n``: ``"exact"`` (default) runs the
      dense backward of the active rows instead, chosen at run time (a ``lax.switch``, which
      costs a device-to-host sync per layer on GPUs); ``"nan"`` makes dX, dW and db NaN (no
      branch: the fast choice when ``top_n`` is known to suffice); ``"drop"`` keeps the
      ``top_n`` rows of largest L2 norm, NaN/Inf rows first (the SEBP paper's rule).
    precision: ``lax.Precision`` of the forward and backward dots, as in ``nn.Dense``.
    backend: ``"auto"``, or an implementation by name: ``"dense"``, ``"xla"`` (gather, dots,
      gather in jnp), ``"pallas"`` (kernels: Mosaic GPU on Hopper for 16-bit operands, else
      Triton on GPU; interpreted on CPU; ``"pallas_mosaic"`` and ``"pallas_triton"`` name
      one of the two, :mod:`sebp_jax.implementations`). ``"auto"``
      runs ``"xla"``, except that on GPU it runs the dense backward where a cost model of the
      layer's static shapes predicts SEBP slower (:mod:`sebp_jax.cost_model`). ``"pallas"``
      needs no run-time branch: where a capacity would be chosen at run time it takes an
      index of every candidate row, its kernels' work following the rows listed; ``"auto"``
      takes that path too on GPU, for 16-bit operands, where the cost model predicts it
      ahead of the branch.
    active_rows: optional ``int32[K]`` index of the rows that may be active, sorted and padded
      with the sentinel ``T`` (e.g. from :func:`sebp_jax.active_rows_from_mask`), so that
      several layers can share one selection from a token mask: the backward reads the
      listed rows only, and ``top_n`` and ``overflow`` apply to the listed active rows. The
      rows not listed must be inactive: dY is still read once, so that a NaN/Inf or an active
      row (above ``threshold``) among them makes dW, db and its row of dX NaN rather than
      vanish; and a NaN/Inf of x in a row that the backward skips makes dW NaN (jax.grad's
      dW has NaN there too, 0 * Inf, in that feature's row; this one in all of dW).
    dtype: the compute dtype, as ``nn.Dense``'s ``dtype``: x, kernel and bias are cast to it
      (None: to their promoted type, as ``flax.linen.dtypes.promote_dtype`` does).
    row_log: optional hashable callable, e.g. ``RowLog().for_layer(name)``
      (:mod:`sebp_jax.report`): each backward sends it, through ``jax.debug.callback``, its
      active and kept rows, capacity and dropped share of dY's norm.
    batch_axes: the mesh axes that split x's first dimension, where its type does not say
      (an ``Auto`` mesh; an ``Explicit`` one is read from the type): each shard then selects
      among its own rows, ``top_n`` and ``active_rows`` are per shard
      (:mod:`sebp_jax.sharding`).
    mesh: the mesh of ``batch_axes``; None: the one of ``jax.set_mesh``.
    einsum: ``(spec, contracted_shape, feature_shape)`` when x and kernel are an einsum
      layer's operands flattened to rows (:mod:`sebp_jax.nnx`): the forward is then
      ``jnp.einsum(spec, ...)`` on the unflattened operands, bit-identical to ``nnx.Einsum``.

  Returns:
    ``y: [..., N]``, bit-identical to ``flax.linen.Dense`` with the same params and dtype.
    The gradients of x, kernel and bias come in their own dtypes, those of kernel and bias
    rounded once from the float32 sums.

  Under ``jax.vmap`` the top-N applies to each mapped instance separately. The output is named
  ``SEBP_CHECKPOINT_NAME`` for remat policies.
  """
  top_n = validate_capacity(top_n)
  threshold = validate_threshold(threshold)
  overflow = validate_overflow(overflow)
  backend = validate_backend(backend)
  x, kernel, bias = (None if a is None else jnp.asarray(a) for a in (x, kernel, bias))
  _check_linear_shapes(x, kernel, bias)
  dtype = canonicalize_dtype(x, kernel, bias, dtype=dtype)
  # Integer arguments have no gradient of their own dtype to come back in: cast them here.
  x, kernel, bias = (a if a is None or jnp.issubdtype(a.dtype, jnp.inexact) else a.astype(dtype)
                     for a in (x, kernel, bias))
  sharding = row_sharding(x, x.ndim - 1, mesh=mesh, batch_axes=normalize_batch_axes(batch_axes))
  active_rows = validate_active_rows(active_rows, math.prod(x.shape[:-1]),
                                     sharding.num_shards if sharding else 1)
  x, kernel, bias, active_rows = vary_alike(x, kernel, bias, active_rows, dtype=dtype)
  if backend.startswith("pallas") and jnp.issubdtype(dtype, jnp.complexfloating):
    raise ValueError(f"backend {backend!r} has no kernels for complex dtypes, got {dtype}: "
                     "use backend 'xla' or 'auto'")
  config = _LinearConfig(top_n=top_n, threshold=threshold, overflow=overflow,
                         row_log=row_log, precision=precision,
                         backend=backend, dtype=dtype,
                         grad_dtypes=(x.dtype, kernel.dtype, None if bias is None else bias.dtype),
                         sharding=sharding, einsum=einsum)
  return checkpoint_name(_sebp_linear(x, kernel, bias, active_rows, config),
                         SEBP_CHECKPOINT_NAME)


# ---------------------------------------------------------------------------------------------
# The embedding lookup.
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _LookupConfig:
  top_n: int | str
  threshold: float
  overflow: str
  row_log: Any
  #: The compute dtype, as ``nn.Embed.dtype``: the table is cast to it inside the op.
  dtype: Any
  sharding: RowSharding | None = None


def _lookup(table, ids, dtype=None):
  # What nn.Embed does (cast, then take), so that the forward is identical.
  return jnp.take(jnp.asarray(table, dtype), ids, axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _sebp_lookup(table, ids, active_rows, config: _LookupConfig):
  del active_rows  # Only the backward uses it.
  return _lookup(table, ids, config.dtype)


def _sebp_lookup_fwd(table, ids, active_rows, config: _LookupConfig):
  # The table as given (a parameter, alive anyway) tells the gradient's shape and dtype.
  return _lookup(table, ids, config.dtype), (table, ids, active_rows)


def _kept_rows(config: _LookupConfig, table_shape, rows):
  """The kept rows of dY and their ids (:func:`sebp_jax.backward.embedding_rows`)."""
  ids, dy, active_rows = rows
  return embedding_rows(
      ids.reshape(-1), dy.reshape(ids.size, table_shape[1]), num_embeddings=table_shape[0],
      top_n=config.top_n, threshold=config.threshold, overflow=config.overflow,
      active_rows=active_rows, row_log=config.row_log)


def _lookup_grads(config: _LookupConfig, table_shape, rows, whole):
  """The table's gradient: a sum over the rows given."""
  del whole
  return (), (scatter_into_table(*_kept_rows(config, table_shape, rows),
                                 num_embeddings=table_shape[0]),)


def _table_from_gathered_rows(kept_ids, kept_dy, poison, *, num_embeddings: int):
  """The table's gradient from every shard's kept rows, the same on every device."""
  return scatter_into_table(*sum_rows_of_equal_ids(kept_ids, kept_dy,
                                                   num_embeddings=num_embeddings),
                            poison, num_embeddings=num_embeddings)


def _gathers_kept_rows(sharding: RowSharding | None, top_n: int | str, overflow: str,
                       num_embeddings: int, num_candidates: int) -> bool:
  """Whether the shards' kept rows of dY (of ``num_candidates`` in all), gathered, cross
  devices in fewer bytes than the table's gradient summed. Over n shards of K kept rows
  each, an all-reduce of a V-row table sends 2(n-1)/n·V rows from each device and a gather
  (n-1)·K rows and their ids, fewer when n·K < 2V; asking n·K <= V leaves room for the ids
  and for the sort and scatter every device then runs. A table split by rows is summed by a
  reduce-scatter, (n-1)/n·V rows: there n·K <= V is about even."""
  if sharding is None:
    return False
  shards = sharding.num_shards
  return shards * embedding_kept_count(num_candidates // shards, top_n,
                                       overflow) <= num_embeddings


def _sebp_lookup_bwd(config: _LookupConfig, residuals, dy):
  table, ids, active_rows = residuals
  # The gradient needs the table's shape, none of its values.
  if config.sharding is None:
    _, (d_table,) = _lookup_grads(config, table.shape, (ids, dy, active_rows), ())
  elif _gathers_kept_rows(config.sharding, config.top_n, config.overflow, table.shape[0],
                          ids.size if active_rows is None else active_rows.shape[0]):
    d_table = gather_row_shards(
        functools.partial(_kept_rows, config, table.shape),
        functools.partial(_table_from_gathered_rows, num_embeddings=table.shape[0]),
        config.sharding, rows=(ids, dy, active_rows), like=table)
  else:
    _, (d_table,) = map_row_shards(
        functools.partial(_lookup_grads, config, table.shape), config.sharding,
        rows=(ids, dy, active_rows), whole=(), sums_like=(table,),
        sums_dtype=config.dtype or table.dtype)
  return d_table.astype(table.dtype), None, None


_sebp_lookup.defvjp(_sebp_lookup_fwd, _sebp_lookup_bwd)


def sebp_embed_lookup(table: Array, ids: Array, *, top_n: int | str = "auto",
                      threshold: float = 0.0, overflow: str = "exact",
                      active_rows: Array | None = None, dtype: Any = None,
                      row_log: Any = None, batch_axes: Any = None, mesh: Any = None) -> Array:
  """``table[ids]`` with a backward that scatters only ``top_n`` rows of dY into ``d_table``.

  An embedding lookup is a linear layer whose input is one-hot: its dense backward scatters
  all T rows of dY into the table (on a GPU with atomic adds, every padding token into the
  same row); this one scatters the kept rows only.

  Args:
    table: ``[V, F]`` embedding table.
    ids: integer ``[...]`` token ids; every element is a row, ``T = ids.size``. Ids out of
      ``[-V, V)`` read NaN in the forward and get no gradient, as with ``jnp.take``.
    top_n, threshold, overflow, active_rows, row_log, batch_axes, mesh: as for
      :func:`sebp_linear` (rows of dY
      flattened to ``[T, F]``), except that ``"exact"`` and ``"auto"`` scatter every active
      row at once, with no run-time branch. With the rows split over devices, each
      shard's kept rows of dY and their ids are gathered to every device, which scatters
      them into the table, where that moves fewer bytes than summing the shards' tables
      (all shards' kept rows at most the table's rows). Otherwise, where the backward would
      keep every non-zero row (no index, no threshold, no log, no cast), the plain lookup
      runs, with autodiff's backward.
    dtype: the compute dtype, as ``nn.Embed``'s ``dtype``: the table is cast to it for the
      lookup (None: no cast); its gradient comes back in the table's own dtype, rounded once
      from the float32 sums.

  Returns:
    ``[..., F]``, bit-identical to ``jnp.take(table.astype(dtype), ids, axis=0)``.
  """
  top_n = validate_capacity(top_n)
  threshold = validate_threshold(threshold)
  overflow = validate_overflow(overflow)
  table, ids = jnp.asarray(table), jnp.asarray(ids)
  if table.ndim != 2:
    raise ValueError(f"table must be 2-D [num_embeddings, features], got shape {table.shape}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"ids must be integer token ids, got dtype {ids.dtype}")
  sharding = row_sharding(ids, ids.ndim, mesh=mesh, batch_axes=normalize_batch_axes(batch_axes))
  active_rows = validate_active_rows(active_rows, ids.size,
                                     sharding.num_shards if sharding else 1)
  keeps_every_row = top_n == "auto" or overflow == "exact" or top_n >= ids.size
  # The plain lookup where it keeps the same rows; not across a cast, where autodiff would
  # round the table's gradient in the compute dtype first, nor where the shards' rows cross
  # devices in fewer bytes than the table would.
  if (active_rows is None and threshold == 0 and row_log is None and keeps_every_row
      and (dtype is None or jnp.dtype(dtype) == table.dtype)
      and not _gathers_kept_rows(sharding, top_n, overflow, table.shape[0], ids.size)):
    return _lookup(table, ids, dtype)
  table, ids, active_rows = vary_alike(table, ids, active_rows, dtype=dtype)
  return _sebp_lookup(table, ids, active_rows,
                      _LookupConfig(top_n, threshold, overflow, row_log, dtype, sharding))
