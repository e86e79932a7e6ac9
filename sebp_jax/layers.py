"""Linen layers with the SEBP backward: ``SEBPDense`` and ``SEBPEmbed``.

Each is a drop-in for its flax layer (same attributes, parameters and forward). The functions
:func:`sebp_dense_call`, :func:`sebp_conv1d_call` (transformers' ``FlaxConv1D``) and
:func:`sebp_embed_call` run a layer's ``__call__`` through the SEBP ops; they serve these
classes and the unmodified layers that ``use_sebp`` intercepts.
"""

from __future__ import annotations

import dataclasses
import fractions
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen.dtypes import canonicalize_dtype, promote_dtype

from sebp_jax.ops import sebp_embed_lookup, sebp_linear
from sebp_jax.outputs import LinearHead, linear_head_reason
from sebp_jax.report import RowLog

Array = jax.Array


def resolve_top_n(top_n: int | float | str, num_rows: int) -> int | str:
  """``top_n`` as ``"auto"`` or a row count for ``num_rows`` rows of dY.

  ``"auto"`` and an int (a row count of the flattened batch) are passed on for the op to
  check; a float in ``(0, 1]`` is the kept fraction, rounded up, so ``0.25`` keeps a quarter
  of the rows. All are static: fractions resolve from array shapes, never from data.
  """
  if isinstance(top_n, (float, np.floating)):
    top_n = _as_written(top_n)
    if not 0.0 < top_n <= 1.0:
      raise ValueError(f"top_n as a kept fraction must lie in (0, 1], got {top_n}")
    # The fraction as written: 0.07 of 100 rows is 7, where the float product is 7.000...01.
    return max(1, math.ceil(fractions.Fraction(repr(top_n)) * num_rows))
  return top_n


def _as_written(fraction: float | np.floating) -> float:
  """The Python float of ``fraction`` as written: numpy's str of its scalar is
  (``np.float32(0.07)`` is 0.07000000029... as a float)."""
  return float(str(fraction)) if isinstance(fraction, np.floating) else float(fraction)


class KeptFraction(float):
  """A float ``top_n`` of a layer, the kept fraction, never equal to nor hashed as an int
  row count (``1.0``, every row, against ``1``, one row): layers that differ there are
  different static arguments of a jitted step."""

  def __eq__(self, other):
    return isinstance(other, float) and float(self) == float(other)

  def __ne__(self, other):
    return not self.__eq__(other)

  def __hash__(self):
    return hash((KeptFraction, float(self)))


def kept_top_n(top_n: int | float | str) -> int | float | str:
  """A layer's ``top_n`` as it keeps it: a float as a :class:`KeptFraction`, else as given."""
  if isinstance(top_n, (float, np.floating)) and not isinstance(top_n, KeptFraction):
    return KeptFraction(_as_written(top_n))
  return top_n


def _fraction_as_kept(module: nn.Module) -> None:
  """In a layer's ``__post_init__``: a float ``top_n`` as a :class:`KeptFraction`."""
  object.__setattr__(module, "top_n", kept_top_n(module.top_n))


def promotion_for_sebp(module: nn.Module, *arrays: Array | None, inexact: bool = True):
  """``(arrays, dtype)`` to hand an SEBP op, which casts ``arrays`` to ``dtype`` inside.

  With flax's own ``promote_dtype`` (the default of ``nn.Dense`` and ``nn.Embed``) the arrays
  go in uncast, so that the op returns their gradients in their own dtypes. A module with a
  custom ``promote_dtype`` gets it applied here, as in its own forward, and the op casts
  nothing.
  """
  if module.promote_dtype is promote_dtype:
    return arrays, canonicalize_dtype(*arrays, dtype=module.dtype, inexact=inexact)
  return tuple(module.promote_dtype(*arrays, dtype=module.dtype, inexact=inexact)), None


def module_path(module: nn.Module) -> str:
  """A bound module's path joined with ``/``. A module with none, applied on its own through
  ``.apply`` inside another one (a head tied to the embeddings), goes by its name
  (``"lm_head"``); a top-level one without a name is ``"<root>"``."""
  return "/".join(module.path) or module.name or "<root>"


def _log_entry(row_log: RowLog | None, module: nn.Module):
  if row_log is None:
    return None
  if not isinstance(row_log, RowLog):
    raise ValueError(f"row_log must be a sebp_jax.RowLog, got {type(row_log).__name__}")
  return row_log.for_layer(module_path(module))


def sebp_dense_call(module: nn.Dense, inputs: Array, **options) -> Array:
  """``nn.Dense.__call__`` of ``module`` with :func:`sebp_linear` in place of dot and bias add.

  Creates or reads the module's ``kernel`` and ``bias`` exactly as ``nn.Dense`` does;
  ``options`` as :func:`_sebp_linear_of`'s.
  """
  kernel = module.param("kernel", module.kernel_init, (jnp.shape(inputs)[-1], module.features),
                        module.param_dtype)
  bias = (module.param("bias", module.bias_init, (module.features,), module.param_dtype)
          if module.use_bias else None)
  (inputs, kernel, bias), dtype = promotion_for_sebp(module, inputs, kernel, bias)
  return _sebp_linear_of(module, inputs, kernel, bias, dtype, **options)


def sebp_conv1d_call(module: nn.Module, inputs: Array, **options) -> Array:
  """transformers' ``FlaxConv1D.__call__`` (GPT-2's linear layer, its kernel held as
  ``[N, D]``) of ``module``, its parameters created already, through :func:`sebp_linear`: the
  input, kernel and bias cast to the module's dtype, as its own call does."""
  # Read as the layer reads them, so that a missing or misshapen one raises as there; the
  # initializer only gives the expected shape (a layer being initialized runs its own call).
  zeros_of = lambda *shape: lambda key: jnp.zeros(shape)
  kernel = module.param("kernel", zeros_of(module.features, jnp.shape(inputs)[-1]))
  bias = module.param("bias", zeros_of(module.features)) if module.use_bias else None
  return _sebp_linear_of(module, inputs, kernel.T, bias, module.dtype, **options)


def _sebp_linear_of(module: nn.Module, inputs: Array, kernel: Array, bias: Array | None,
                    dtype, *, top_n: int | float | str, threshold: float, backend: str,
                    overflow: str = "exact", active_rows: Array | None = None,
                    row_log: RowLog | None = None, batch_axes=None, mesh=None) -> Array:
  """A linear layer's output through :func:`sebp_linear`, with the layer's precision and
  row log. A fraction ``top_n`` counts all rows: ``use_sebp`` resolves it per shard first."""
  num_rows = math.prod(jnp.shape(inputs)[:-1])
  return sebp_linear(inputs, kernel, bias, top_n=resolve_top_n(top_n, num_rows),
                     threshold=threshold, overflow=overflow, precision=module.precision,
                     backend=backend, active_rows=active_rows, dtype=dtype,
                     row_log=_log_entry(row_log, module), batch_axes=batch_axes, mesh=mesh)


def linear_head(module: nn.Dense, inputs: Array) -> LinearHead | None:
  """``module``, a Dense layer that has run, as the :class:`LinearHead` of its output on
  ``inputs: [C, D]`` (its forward's promotion applied); None where its output is more than
  its kernel's and bias's (:func:`linear_head_reason`)."""
  if type(module).__call__ is not nn.Dense.__call__ or linear_head_reason(module) is not None:
    return None
  # Unboxed as module.param would: nn.with_partitioning wraps a param in its metadata.
  kernel = nn.meta.unbox(module.get_variable("params", "kernel"))
  bias = nn.meta.unbox(module.get_variable("params", "bias")) if module.use_bias else None
  inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  return LinearHead(inputs, kernel, bias, module.precision)


def sebp_embed_call(module: nn.Embed, inputs: Array, *, top_n: int | float | str,
                    threshold: float, overflow: str = "exact",
                    active_rows: Array | None = None, row_log: RowLog | None = None,
                    batch_axes=None, mesh=None) -> Array:
  """``nn.Embed.__call__`` of ``module`` with :func:`sebp_embed_lookup` in place of the take."""
  (table,), dtype = promotion_for_sebp(module, module.embedding, inexact=False)
  if not jnp.issubdtype(jnp.result_type(inputs), jnp.integer):
    raise ValueError(f"ids must be integer token ids, got dtype {jnp.result_type(inputs)}")
  if module.num_embeddings == 1:  # nn.Embed broadcasts its single row: nothing to select.
    return jnp.broadcast_to(jnp.asarray(table, dtype), jnp.shape(inputs) + (module.features,))
  return sebp_embed_lookup(table, inputs, top_n=resolve_top_n(top_n, inputs.size),
                           threshold=threshold, overflow=overflow, active_rows=active_rows,
                           dtype=dtype, row_log=_log_entry(row_log, module),
                           batch_axes=batch_axes, mesh=mesh)


class SEBPDense(nn.Dense):
  """A drop-in for ``flax.linen.Dense`` whose backward keeps only the top-N rows of dY.

  Same attributes, defaults, parameter names (``kernel``, ``bias``) and shapes as ``nn.Dense``,
  so that a checkpoint loads into either, and a bit-identical forward. Additional attributes:

  Attributes:
    top_n: the backward's capacity of kept rows, counted over all leading dims of the input:
      ``"auto"`` (default: the smallest of T/16, T/8, T/4, T/2 that holds every active row,
      else the dense backward), an int, or a float in (0, 1] for a kept fraction.
    threshold: rows of dY whose max ``|value|`` is at most this count as zero (default 0.0).
    overflow: more active rows than an int ``top_n``: ``"exact"`` (default), ``"nan"`` or
      ``"drop"``, see :func:`sebp_jax.sebp_linear`.
    backend: ``"auto"`` or an implementation name, see :func:`sebp_jax.sebp_linear`.
    row_log: optional :class:`sebp_jax.RowLog` that each backward reports to.
  """

  top_n: int | float | str = dataclasses.field(default="auto", kw_only=True)
  threshold: float = dataclasses.field(default=0.0, kw_only=True)
  overflow: str = dataclasses.field(default="exact", kw_only=True)
  backend: str = dataclasses.field(default="auto", kw_only=True)
  row_log: RowLog | None = dataclasses.field(default=None, kw_only=True)

  def __post_init__(self):
    _fraction_as_kept(self)
    super().__post_init__()

  @nn.compact
  def __call__(self, inputs: Array) -> Array:
    """Applies ``inputs @ kernel + bias`` over the last dimension of ``inputs: [..., D]``."""
    if self.dot_general is not None or self.dot_general_cls is not None:
      raise ValueError(
          "SEBPDense computes its own backward and cannot use a custom dot_general / "
          "dot_general_cls (e.g. fp8 or quantized); use flax.linen.Dense for such layers")
    return sebp_dense_call(self, inputs, top_n=self.top_n, threshold=self.threshold,
                           backend=self.backend, overflow=self.overflow, row_log=self.row_log)


class SEBPEmbed(nn.Embed):
  """A drop-in for ``flax.linen.Embed`` whose backward keeps only the top-N rows of dY.

  Same attributes, parameter (``embedding``) and forward as ``nn.Embed``; ``attend`` is
  unchanged (a dense matmul over the whole table). Additional attributes:

  Attributes:
    top_n, threshold, overflow, row_log: as for :class:`SEBPDense`, rows counted over every
      element of ``inputs``.
  """

  top_n: int | float | str = dataclasses.field(default="auto", kw_only=True)
  threshold: float = dataclasses.field(default=0.0, kw_only=True)
  overflow: str = dataclasses.field(default="exact", kw_only=True)
  row_log: RowLog | None = dataclasses.field(default=None, kw_only=True)

  def __post_init__(self):
    _fraction_as_kept(self)
    super().__post_init__()

  def __call__(self, inputs: Array) -> Array:
    """Embeds the integer ``inputs: [...]`` into ``[..., features]``."""
    return sebp_embed_call(self, inputs, top_n=self.top_n, threshold=self.threshold,
                           overflow=self.overflow, row_log=self.row_log)
