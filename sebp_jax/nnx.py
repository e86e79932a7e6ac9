"""Flax NNX: ``SEBPLinear``, ``SEBPEmbed``, and ``use_sebp(model)`` for an existing model.

``SEBPLinear`` and ``SEBPEmbed`` are drop-ins for ``nnx.Linear`` and ``nnx.Embed``: same
constructor, Variables and forward, with the SEBP backward.

NNX has no method interception, so ``use_sebp(model)`` swaps classes: each chosen
``nnx.Linear``, ``nnx.Einsum`` or ``nnx.Embed`` of the model (and each einsum layer of a model
library registered with :func:`register_einsum`) gets a subclass of its own class whose
``__call__`` runs the SEBP op on the same Variables, and its class back on exit. The class and
the swap's options are part of the module's graph definition, so ``nnx.jit``, ``nnx.grad``,
``nnx.scan`` and ``nnx.remat``, which split the model and merge it inside their traces, rebuild
the swapped layers there; and ``nnx.jit`` caches the SEBP program apart from the dense one, so
entering the context outside a jitted step works too.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import threading
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn import dtypes as nnx_dtypes

from sebp_jax import context as context_lib
from sebp_jax import model_families
from sebp_jax.context import DEFAULT_EXCLUDE, DEFAULT_INCLUDE, SEBPContext, SEBPReport, record
from sebp_jax.layers import kept_top_n, resolve_top_n
from sebp_jax.outputs import unread_parameters_reason
from sebp_jax.packing import (ATTENTION_METHODS, PackedLayout, checked_decoder_mask,
                              invalid_slots, packed_attention)
from sebp_jax.ops import (sebp_embed_lookup, sebp_linear, validate_backend, validate_capacity,
                          validate_overflow, validate_threshold)
from sebp_jax.report import RowLog

Array = jax.Array

__all__ = ["EinsumLayer", "LayerSwap", "SEBPEmbed", "SEBPLinear", "SEBPReport", "dense_forward",
           "register_einsum", "use_packed_attention", "use_sebp"]


@dataclasses.dataclass(frozen=True)
class EinsumLayer:
  """Where an einsum layer keeps its parts: ``y = einsum(self.<einsum_str>, x,
  self.<kernel>) (+ self.<bias>)``, attribute names."""
  kernel: str = "kernel"
  bias: str | None = "bias"
  einsum_str: str = "einsum_str"


_EINSUM_LAYERS: dict[type, EinsumLayer] = {nnx.Einsum: EinsumLayer()}


def register_einsum(cls: type, *, kernel: str = "kernel", bias: str | None = None,
                    einsum_str: str = "einsum_str") -> None:
  """Lets :class:`use_sebp` swap ``cls``, a model library's own einsum layer.

  ``cls.__call__(self, x)`` must compute ``jnp.einsum(getattr(self, einsum_str), x,
  getattr(self, kernel)[...])``, plus ``getattr(self, bias)[...]`` broadcast over the output's
  kernel dims when ``bias`` is given, and nothing else: use_sebp runs that computation in its
  place. An einsum that is a linear map of rows (``"BTD,DNH->BTNH"``, ``"BTNH,NHD->BTD"``:
  the input's leading dims are rows, its trailing dims contract with the kernel's leading
  ones) is swapped; another one is left dense, with the reason in the report.
  """
  if not (isinstance(cls, type) and issubclass(cls, nnx.Module)):
    raise ValueError(f"register_einsum: cls must be an nnx.Module subclass, got {cls!r}")
  _EINSUM_LAYERS[cls] = EinsumLayer(kernel, bias, einsum_str)


@dataclasses.dataclass(frozen=True)
class _RowMap:
  """A linear layer as a matmul of rows: the input's first ``row_dims`` dims are rows, the
  rest contract with the kernel's first ``contracted_dims`` dims."""
  row_dims: int
  contracted_dims: int


def einsum_row_map(spec: str) -> _RowMap | str:
  """``spec`` (``"BTD,DNH->BTNH"``) as a :class:`_RowMap`, or why it is not a linear map of
  rows."""
  spec = spec.replace(" ", "")
  if "..." in spec or "->" not in spec or spec.count(",") != 1:
    return f"einsum {spec!r} is not of the form 'x,kernel->y' without an ellipsis"
  operands, out = spec.split("->")
  lhs, rhs = operands.split(",")
  if any(len(set(s)) != len(s) for s in (lhs, rhs, out)):
    return f"einsum {spec!r} repeats an index within an operand"
  rows = "".join(c for c in lhs if c in out)
  contracted = "".join(c for c in lhs if c not in out)
  features = "".join(c for c in rhs if c in out)
  if not (contracted and lhs == rows + contracted and rhs == contracted + features
          and out == rows + features):
    return (f"einsum {spec!r} is not a linear map of rows (input dims = rows + contracted, "
            "kernel dims = contracted + features, output dims = rows + features)")
  return _RowMap(len(rows), len(contracted))


def _promotion(module: nnx.Module, arrays: tuple, inexact: bool = True):
  """``(arrays, dtype)`` for an SEBP op, which casts to ``dtype`` inside (so gradients come
  back in each array's own dtype); a custom ``promote_dtype`` is applied here instead."""
  promote = getattr(module, "promote_dtype", None)
  present = [a for a in arrays if a is not None]
  if promote is None:  # A registered einsum layer: jnp.einsum's own promotion.
    return arrays, jnp.result_type(*present)
  if promote is nnx_dtypes.promote_dtype:
    return arrays, nnx_dtypes.canonicalize_dtype(*present, dtype=module.dtype,
                                                 inexact=inexact)
  # Called as the flax layers call it: nnx.Embed alone passes inexact (False).
  options = {} if inexact else {"inexact": False}
  return tuple(promote(arrays, dtype=module.dtype, **options)), None


def _row_log_entry(row_log: RowLog | None, path: str):
  return None if row_log is None else row_log.for_layer(path)


def _linear_forward(module, inputs: Array, kernel: Array, bias: Array | None, row_map: _RowMap,
                    *, top_n, threshold: float, overflow: str, backend: str,
                    active_rows: Array | None, row_log, batch_axes=None, mesh=None,
                    spec: str | None = None) -> Array:
  """The linear layer as :func:`sebp_linear` on rows: ``[*rows, *contracted] @ [*contracted,
  *features] -> [*rows, *features]``, reshaped in and out; an einsum layer's forward is its
  ``spec``'s."""
  contracted_shape = jnp.shape(kernel)[:row_map.contracted_dims]
  if jnp.shape(inputs)[row_map.row_dims:] != contracted_shape:
    # A reshape to rows would accept any dims of the same total size, read in another order.
    raise ValueError(f"{type(module).__name__}: inputs of shape {jnp.shape(inputs)} do not "
                     f"end in the kernel's contracted dims {contracted_shape}")
  (inputs, kernel, bias), dtype = _promotion(module, (inputs, kernel, bias))
  row_shape = jnp.shape(inputs)[:row_map.row_dims]
  feature_shape = jnp.shape(kernel)[row_map.contracted_dims:]
  rows = inputs.reshape(*row_shape, math.prod(contracted_shape))  # -1 fails on 0 rows.
  matrix = kernel.reshape(-1, math.prod(feature_shape))
  out = sebp_linear(rows, matrix, None if bias is None else bias.reshape(-1),
                    top_n=resolve_top_n(top_n, math.prod(row_shape)), threshold=threshold,
                    overflow=overflow, precision=getattr(module, "precision", None),
                    backend=backend, active_rows=active_rows, dtype=dtype, row_log=row_log,
                    batch_axes=batch_axes, mesh=mesh,
                    einsum=None if spec is None else (spec.replace(" ", ""), contracted_shape,
                                                      feature_shape))
  return out.reshape(*row_shape, *feature_shape)


def _embed_forward(module: nnx.Embed, inputs: Array, *, top_n, threshold: float, overflow: str,
                   active_rows: Array | None, row_log, batch_axes=None, mesh=None) -> Array:
  """``nnx.Embed.__call__`` with :func:`sebp_embed_lookup` in place of the take."""
  if not jnp.issubdtype(inputs.dtype, jnp.integer):
    raise ValueError("Input type must be an integer or unsigned integer.")
  (table,), dtype = _promotion(module, (module.embedding[...],), inexact=False)
  if module.num_embeddings == 1:  # nnx.Embed broadcasts its single row: nothing to select.
    return jnp.broadcast_to(jnp.asarray(table, dtype), inputs.shape + (module.features,))
  return sebp_embed_lookup(table, inputs, top_n=resolve_top_n(top_n, inputs.size),
                           threshold=threshold, overflow=overflow, active_rows=active_rows,
                           dtype=dtype, row_log=row_log, batch_axes=batch_axes, mesh=mesh)


def _validated_options(top_n, threshold, overflow, backend, row_log) -> None:
  validate_capacity(resolve_top_n(top_n, 1))
  validate_threshold(threshold)
  validate_overflow(overflow)
  validate_backend(backend)
  if row_log is not None and not isinstance(row_log, RowLog):
    raise ValueError(f"row_log must be a sebp_jax.RowLog, got {type(row_log).__name__}")


class SEBPLinear(nnx.Linear):
  """A drop-in for ``nnx.Linear`` whose backward keeps only the top-N rows of dY.

  Same constructor, Variables (``kernel``, ``bias``) and forward as ``nnx.Linear``, plus the
  keyword options of :class:`sebp_jax.SEBPDense`: ``top_n`` (``"auto"``, an int, or a kept
  fraction in (0, 1]), ``threshold``, ``overflow``, ``backend`` and ``row_log``. Rows are
  counted over all leading dims of the input. An NNX layer does not know its path, so its
  ``row_log`` records are named by its class; ``use_sebp(model, row_log=...)`` names them by
  path.
  """

  def __init__(self, in_features: int, out_features: int, *, top_n: int | float | str = "auto",
               threshold: float = 0.0, overflow: str = "exact", backend: str = "auto",
               row_log: RowLog | None = None, **linear_kwargs):
    _validated_options(top_n, threshold, overflow, backend, row_log)
    if linear_kwargs.get("dot_general", jax.lax.dot_general) is not jax.lax.dot_general:
      raise ValueError("SEBPLinear computes its own backward and cannot use a custom "
                       "dot_general (e.g. fp8 or quantized); use nnx.Linear for such layers")
    if linear_kwargs.get("preferred_element_type") is not None:
      raise ValueError("SEBPLinear computes in its inputs' promoted dtype and cannot take a "
                       "preferred_element_type; use nnx.Linear for such layers")
    super().__init__(in_features, out_features, **linear_kwargs)
    # A fraction never equal to a row count (1.0 against 1) in the graph definition.
    self.top_n, self.threshold, self.overflow = kept_top_n(top_n), threshold, overflow
    self.backend, self.row_log = backend, row_log

  def __call__(self, inputs: Array, out_sharding=None) -> Array:
    """``inputs @ kernel + bias`` over the last dimension of ``inputs: [..., D]``."""
    if out_sharding is not None:
      raise ValueError("SEBPLinear does not take out_sharding; shard its input instead")
    return _linear_forward(
        self, inputs, self.kernel[...], None if self.bias is None else self.bias[...],
        _RowMap(inputs.ndim - 1, 1), top_n=self.top_n, threshold=self.threshold,
        overflow=self.overflow, backend=self.backend, active_rows=None,
        row_log=_row_log_entry(self.row_log, type(self).__name__))


class SEBPEmbed(nnx.Embed):
  """A drop-in for ``nnx.Embed`` whose lookup's backward scatters only the top-N rows of dY.

  Same constructor, Variable (``embedding``), forward and ``attend`` as ``nnx.Embed``, plus
  ``top_n``, ``threshold``, ``overflow`` and ``row_log`` as for :class:`SEBPLinear`, rows
  counted over every element of the ids.
  """

  def __init__(self, num_embeddings: int, features: int, *,
               top_n: int | float | str = "auto", threshold: float = 0.0,
               overflow: str = "exact", row_log: RowLog | None = None, **embed_kwargs):
    _validated_options(top_n, threshold, overflow, "auto", row_log)
    super().__init__(num_embeddings, features, **embed_kwargs)
    self.top_n, self.threshold = kept_top_n(top_n), threshold
    self.overflow, self.row_log = overflow, row_log

  def __call__(self, inputs: Array, out_sharding=None) -> Array:
    """Embeds the integer ``inputs: [...]`` into ``[..., features]``."""
    if out_sharding is not None:
      raise ValueError("SEBPEmbed does not take out_sharding; shard its ids instead")
    return _embed_forward(self, inputs, top_n=self.top_n, threshold=self.threshold,
                          overflow=self.overflow, active_rows=None,
                          row_log=_row_log_entry(self.row_log, type(self).__name__))


@dataclasses.dataclass(frozen=True)
class LayerSwap:
  """What a swapped layer runs (handed to :meth:`use_sebp.run_layer`), stored on it as a
  static attribute: part of its graph definition, so that nnx.jit compiles anew when any of
  it changes."""
  path: str
  kind: str  # "linear", "einsum" or "embed"
  row_map: _RowMap | None
  einsum: EinsumLayer | None
  top_n: Any
  threshold: float
  overflow: str
  backend: str
  row_log: RowLog | None
  # The mask's contents when the shared index is a constant (a numpy or concrete mask), so
  # that a jitted step compiled for one mask never runs with another's index.
  mask_key: Any
  batch_axes: tuple[str, ...] | None = None
  mesh: Any = None
  #: What the model family of the layer's owner says of its rows
  #: (:func:`sebp_jax.model_families.input_layout`).
  layout: str | None = None


_SWAP_ATTR = "_sebp_swap"


def _swapped_call(self, *args, **kwargs) -> Array:
  """``__call__`` of a swapped layer: its context's :meth:`use_sebp.run_layer`."""
  swap: LayerSwap = vars(self)[_SWAP_ATTR]
  context = getattr(context_lib._ACTIVE, "context", None)
  if not (isinstance(context, use_sebp) and context.swapped_with(swap)):
    # Another thread, outside the context that swapped the layer (which is per thread, as
    # Linen's is), or a copy of the model kept from inside it: the layer's own forward.
    return dense_forward(self, *args, **kwargs)
  context.layers_seen += 1
  called = _call_arguments(type(self).__base__, self, args, kwargs)
  if isinstance(called, str):
    # out_sharding, or an einsum_str given at call time: the layer's own code (and its own
    # error for arguments it does not take).
    context.report.skipped[swap.path] = called
    return dense_forward(self, *args, **kwargs)
  return context.run_layer(self, swap, called)


def _call_arguments(cls: type, module: nnx.Module, args: tuple, kwargs: dict) -> Array | str:
  """The input of a call of ``cls.__call__``: its first argument, given by position or by
  name; or why the call is left to the layer's own code (the names of other arguments given
  other than None, or no input to read)."""
  signature = _call_signature(cls)
  try:
    bound = signature.bind(module, *args, **kwargs)
  except TypeError:
    return "called with arguments its __call__ does not take"
  parameters = list(signature.parameters.values())[1:]  # After self.
  if (not parameters or parameters[0].kind is inspect.Parameter.VAR_POSITIONAL
      or parameters[0].name not in bound.arguments):
    return "called without an input argument of its own to read"
  first, *others = parameters
  extra = []
  for parameter in others:
    value = bound.arguments.get(parameter.name)
    if parameter.kind is inspect.Parameter.VAR_KEYWORD:
      extra += [name for name, item in (value or {}).items() if item is not None]
    elif parameter.kind is inspect.Parameter.VAR_POSITIONAL:
      extra += [f"*{parameter.name}"] if value else []
    elif value is not None:
      extra.append(parameter.name)
  return f"called with extra arguments {extra}" if extra else bound.arguments[first.name]


@functools.cache
def _call_signature(cls: type) -> inspect.Signature:
  return inspect.signature(cls.__call__)


def dense_forward(module: nnx.Module, *args, **kwargs) -> Array:
  """The layer's own forward (its class's ``__call__``), also while swapped."""
  cls = type(module)
  if cls in _SWAPPED_CLASSES.values():
    cls = cls.__base__
  return cls.__call__(module, *args, **kwargs)


_SWAPPED_CLASSES: dict[type, type] = {}


def _swapped_class(cls: type) -> type:
  """The class a layer of class ``cls`` has while swapped: ``cls`` with the SEBP forward.

  Made once per class, so that graph definitions (and nnx.jit's cache) see the same type each
  time; a direct subclass, so that instances can change class both ways.
  """
  if cls not in _SWAPPED_CLASSES:
    _SWAPPED_CLASSES[cls] = type(f"SEBPSwapped{cls.__name__}", (cls,),
                                 {"__module__": __name__, "__call__": _swapped_call})
  return _SWAPPED_CLASSES[cls]


def _unread_parameters(module: nnx.Module, read: tuple[str | None, ...]) -> str | None:
  return unread_parameters_reason(
      (name for name, value in vars(module).items() if isinstance(value, nnx.Param)), read)


def _einsum_layer(cls: type) -> EinsumLayer | str | None:
  """The einsum layer ``cls`` is, "a subclass with its own __call__" (which may compute
  something else), or None."""
  for base in cls.__mro__:
    if base in _EINSUM_LAYERS:
      return (_EINSUM_LAYERS[base] if cls.__call__ is base.__call__
              else "a subclass with its own __call__")
  return None


class use_sebp(SEBPContext):
  """Runs the chosen linear layers and embeddings of an NNX ``model`` with the SEBP backward.

  ::

      def loss_fn(model, batch):
        with sebp_jax.nnx.use_sebp(model, active_mask=batch["attention_mask"]) as report:
          logits = model(batch["input_ids"])
        ...

      grads = nnx.grad(loss_fn)(model, batch)   # inside nnx.jit, with nnx.scan / nnx.remat

  The layers it swaps: ``nnx.Linear``, ``nnx.Einsum`` whose einsum is a linear map of rows,
  the einsum layers registered with :func:`register_einsum`, and ``nnx.Embed`` lookups
  (``attend`` stays dense), subclasses included unless they have a ``__call__`` of their own.
  A layer with a custom ``dot_general`` / ``einsum_op`` or ``preferred_element_type``, one
  holding parameters its computation does not read (qwix's LoRA adapters), or one called with
  ``out_sharding`` is left dense; these, the subclasses left alone and ``nnx.LinearGeneral``
  layers are listed in ``report.skipped`` with the reason. The drop-ins :class:`SEBPLinear`
  and :class:`SEBPEmbed` run their own SEBP backward, with their own options. On exit
  every layer has its class back, with the same Variables: the model is as it was. A copy
  made inside the context (``nnx.clone``, a graph definition from ``nnx.split``) keeps the
  swapped classes, which run SEBP under an equal context only and dense under another (in
  its ``report.skipped``): make copies outside it.

  Enter it inside the function that is traced (the loss function under ``nnx.grad``), on the
  model that function received. Entered outside ``nnx.jit``, it works too: the swapped
  classes and options are part of the graph definition, so the step compiles for them. The
  classes change for every thread, but a swapped layer runs SEBP only in the thread that
  entered the context; in another it runs its own forward.

  Args: ``top_n``, ``threshold``, ``overflow``, ``include``, ``exclude``, ``lm_head``,
  ``active_mask``, ``backend``, ``embeddings``, ``row_log`` as for the Linen
  :class:`sebp_jax.use_sebp`, with module paths such as ``"layers/0/attn/q_proj"``.
  ``batch_axes`` and ``mesh`` too (a batch split over devices: each shard selects its own
  rows). ``require_swaps`` raises at once when no layer matched, and on exit when
  ``active_mask`` served no layer that ran. Packing is Linen only.

  Contexts do not nest: entering one while another (NNX or Linen) is active raises.
  """

  def __init__(self, model: nnx.Module, top_n: int | float | str = "auto",
               threshold: float = 0.0, *, overflow: str = "exact",
               include: str = DEFAULT_INCLUDE, exclude: str | None = DEFAULT_EXCLUDE,
               active_mask: Array | None = None, backend: str = "auto",
               embeddings: bool = True, lm_head: bool = False, row_log: RowLog | None = None,
               require_swaps: bool = True, batch_axes: Any = None, mesh: Any = None):
    if not isinstance(model, nnx.Module):
      raise ValueError(f"use_sebp: model must be an nnx.Module, got {type(model).__name__} "
                       "(for a Linen model, use sebp_jax.use_sebp)")
    super().__init__(top_n, threshold, overflow=overflow, include=include, exclude=exclude,
                     active_mask=active_mask, backend=backend, embeddings=embeddings,
                     lm_head=lm_head, row_log=row_log, require_swaps=require_swaps,
                     batch_axes=batch_axes, mesh=mesh)
    self.model = model
    self._swapped: list[tuple[nnx.Module, type]] = []

  def _swap_options(self) -> tuple:
    """The options a :class:`LayerSwap` records, in its field order from ``top_n``."""
    return (self.top_n, self.threshold, self.overflow, self.backend, self.row_log,
            self._mask_key_value, self.batch_axes, self.mesh)

  def swapped_with(self, swap: LayerSwap) -> bool:
    """Whether a layer swapped as ``swap`` says is this context's (a layer's class changes
    for every thread, a context is entered in one; nnx.jit rebuilds layers in its trace)."""
    return (swap.top_n, swap.threshold, swap.overflow, swap.backend, swap.row_log,
            swap.mask_key, swap.batch_axes, swap.mesh) == self._swap_options()

  def _layer_kind(self, module: nnx.Module) -> tuple[str, Any] | None:
    """``(kind, detail)`` of a layer this context could swap, ``detail`` being None, an
    einsum's ``(row map, EinsumLayer)``, or the reason it must stay dense; None for other
    modules."""
    cls = type(module)
    if cls in _SWAPPED_CLASSES.values():
      # A copy made inside another context: it runs SEBP under an equal one (as nnx.jit's
      # copies do), its own forward under any other.
      swap = vars(module).get(_SWAP_ATTR)
      if swap is None or self.swapped_with(swap):
        return None
      return swap.kind, "a copy swapped by another use_sebp (made inside it): runs dense"
    if isinstance(module, (SEBPLinear, SEBPEmbed)):
      return None  # The drop-ins run SEBP themselves, with their own options.
    if isinstance(module, nnx.Linear) and cls.__call__ is nnx.Linear.__call__:
      if module.dot_general is not jax.lax.dot_general:
        return "linear", "custom dot_general (e.g. fp8/quantized)"
      if module.preferred_element_type is not None:
        return "linear", "preferred_element_type set"
      return "linear", _unread_parameters(module, ("kernel", "bias"))
    if isinstance(module, nnx.Embed) and cls.__call__ is nnx.Embed.__call__:
      if not self.embeddings:
        return None
      if module.num_embeddings == 1:
        return "embed", "one-row embedding (a broadcast, no lookup)"
      return "embed", _unread_parameters(module, ("embedding",))
    # Listed with the reason they stay dense, as the Linen context lists them: a subclass's
    # own __call__ (LoRALinear, a drop-in) would be lost, and LinearGeneral's axes are not
    # rows and features.
    if isinstance(module, nnx.Linear) or (self.embeddings and isinstance(module, nnx.Embed)):
      return ("linear" if isinstance(module, nnx.Linear) else "embed",
              "a subclass with its own __call__")
    if isinstance(module, nnx.LinearGeneral):
      return "linear", "nnx.LinearGeneral (not swapped)"
    einsum = _einsum_layer(cls)
    if einsum is None:
      return None
    if isinstance(einsum, str):
      return "einsum", einsum
    if getattr(module, "einsum_op", jnp.einsum) is not jnp.einsum:
      return "einsum", "custom einsum_op"
    if getattr(module, "preferred_element_type", None) is not None:
      return "einsum", "preferred_element_type set"
    spec = getattr(module, einsum.einsum_str, None)
    if not isinstance(spec, str):
      return "einsum", "no einsum_str of its own (given at call time)"
    row_map = einsum_row_map(spec)
    if isinstance(row_map, str):
      return "einsum", row_map
    return "einsum", _unread_parameters(module, (einsum.kernel, einsum.bias)) or (row_map,
                                                                                 einsum)

  def layers_key(self) -> tuple:
    """The layers this context swapped: a report traced for another model is not this one's."""
    return tuple(self.report.swapped), tuple(self.report.embeddings)

  def run_layer(self, module: nnx.Module, swap: LayerSwap, inputs: Array) -> Array:
    """The forward of a swapped layer: its computation through the SEBP op on the rows and
    capacity this context gives it (dense where it gives none)."""
    if swap.kind == "embed":
      num_row_dims = jnp.ndim(inputs)
    else:
      row_map = swap.row_map or _RowMap(inputs.ndim - 1, 1)
      num_row_dims = row_map.row_dims
    rows = self.rows_to_keep(swap.path, inputs, num_row_dims, layout=swap.layout)
    if isinstance(rows, str):
      self.report.skipped[swap.path] = rows
      return dense_forward(module, inputs)
    active_rows, top_n = rows
    options = dict(top_n=top_n, threshold=swap.threshold, overflow=swap.overflow,
                   active_rows=active_rows, row_log=_row_log_entry(swap.row_log, swap.path),
                   batch_axes=swap.batch_axes, mesh=swap.mesh)
    if swap.kind == "embed":
      return self.shared_output(_embed_forward(module, inputs, **options), active_rows)
    if swap.kind == "linear":
      kernel, bias, spec = module.kernel, module.bias, None
    else:
      kernel = getattr(module, swap.einsum.kernel)
      bias = getattr(module, swap.einsum.bias) if swap.einsum.bias else None
      spec = getattr(module, swap.einsum.einsum_str)
    kernel, bias = kernel[...], None if bias is None else bias[...]
    # Checked here, not when swapping: a layer stacked for nnx.scan has its per-layer shapes
    # only inside the scan.
    if bias is not None and bias.size != math.prod(kernel.shape[row_map.contracted_dims:]):
      self.report.skipped[swap.path] = "bias not over the output's kernel dims"
      return dense_forward(module, inputs)
    return self.shared_output(_linear_forward(module, inputs, kernel, bias, row_map,
                                              backend=swap.backend, spec=spec, **options),
                              active_rows)

  def __enter__(self) -> SEBPReport:
    if self.active_mask is not None and getattr(_PACKED_ATTENTION, "context", None) is not None:
      raise ValueError(MASK_BESIDE_PACKING)
    self.activate()
    try:
      self._swap_layers()
    except BaseException:
      self._restore()
      self.deactivate()
      raise
    return self.report

  def _swap_layers(self) -> None:
    modules = dict(nnx.iter_modules(self.model))
    for path_parts, module in modules.items():
      found = self._layer_kind(module)
      if found is None:
        continue
      kind, detail = found
      path = "/".join(map(str, path_parts)) or "<root>"
      reason = detail if isinstance(detail, str) else self.path_skip_reason(
          path, kind != "embed")
      if reason:
        self.report.skipped[path] = reason
        continue
      row_map, einsum = detail if kind == "einsum" else (None, None)
      owner = modules.get(path_parts[:-1]) if path_parts else None
      swap = LayerSwap(path, kind, row_map, einsum, *self._swap_options(),
                       layout=model_families.input_layout(owner))
      self._swapped.append((module, type(module)))
      # Past nnx's __setattr__, which would record the swap as one of the module's own
      # attributes; the graph definition still holds the class and the swap.
      object.__setattr__(module, "__class__", _swapped_class(type(module)))
      vars(module)[_SWAP_ATTR] = swap
      record(self.report.embeddings if kind == "embed" else self.report.swapped, path)
    if self.require_swaps and not self.report.swapped and (self.include_given
                                                           or not self.report.embeddings):
      skipped = "; ".join(f"{p}: {why}" for p, why in list(self.report.skipped.items())[:5])
      raise RuntimeError(
          "use_sebp found no linear layer to swap in the model (nnx.Linear, nnx.Einsum, or "
          "an einsum layer registered with sebp_jax.nnx.register_einsum)"
          f"{': ' + skipped if skipped else ''}.")

  def _restore(self) -> None:
    for module, cls in reversed(self._swapped):
      object.__setattr__(module, "__class__", cls)
      vars(module).pop(_SWAP_ATTR, None)
    self._swapped.clear()

  def __exit__(self, exc_type, exc, tb) -> None:
    self._restore()
    self.deactivate()
    # No layer ran when a jitted step compiled before, under an equal context, ran.
    if exc_type is not None or self.remember_or_reuse_report():
      return
    if self.layers_seen:
      self.check_swaps("linear layer", "")
    elif self.require_swaps and (self.report.swapped or self.report.embeddings):
      swapped = len(self.report.swapped) + len(self.report.embeddings)
      raise RuntimeError(
          f"use_sebp swapped {swapped} layers of the model it was given, but none of them ran "
          "in the context: the model that ran was another one, or a copy. nnx.grad, nnx.jit "
          "and the other transforms hand the traced function a copy of the model, so enter "
          "use_sebp on the model that function received (loss_fn(model) with "
          "use_sebp(model)), not on one from outside it. Or the model was not called in the "
          "context, or what ran there was compiled before elsewhere (a program compiled "
          "ahead of time).")


# Per thread, the active use_packed_attention (the class swap is seen by every thread).
_PACKED_ATTENTION = threading.local()
# The active use_packed_attention's method and concrete layout, part of jax.jit's cache key: a
# step jitted outside the context (nnx.jit of a model whose attention it swapped) compiles
# again for another batch's layout instead of keeping the first one's.
_PACKED_JIT_KEY = jax.make_user_context(None)
_PACKED_CLASSES: dict[type, type] = {}


def _packed_attention_class(cls: type, entry: model_families.NNXAttention) -> type:
  """``cls`` with ``entry.method`` run per sequence while its thread's
  :class:`use_packed_attention` is active; made once per class (see :func:`_swapped_class`)."""
  if cls not in _PACKED_CLASSES:
    own = getattr(cls, entry.method)
    signature = inspect.signature(own)

    @functools.wraps(own)
    def per_sequence(self, *args, **kwargs):
      context = getattr(_PACKED_ATTENTION, "context", None)
      if context is None:
        return own(self, *args, **kwargs)
      bound = signature.bind(self, *args, **kwargs)
      bound.apply_defaults()
      core = context.attention_core(bound.arguments, entry.mask_argument)
      return entry.attend(self, core, bound.arguments)

    _PACKED_CLASSES[cls] = type(f"SEBPPacked{cls.__name__}", (cls,),
                                {"__module__": __name__, entry.method: per_sequence})
  return _PACKED_CLASSES[cls]


#: Why :class:`use_sebp`'s ``active_mask`` and :class:`use_packed_attention` do not mix.
MASK_BESIDE_PACKING = (
    "use_sebp(active_mask=...) beside use_packed_attention: active_mask flags the padded "
    "batch's tokens [B, L], and the model runs on the packed ones [1, C] (where C == L its "
    "index would be taken for theirs). Leave active_mask out: the packed slots are the real "
    "tokens, and each layer selects its own rows from dY")


class use_packed_attention:
  """Runs the attention of an NNX decoder called on packed inputs per sequence.

  ::

      packed = sebp_jax.pack_decoder_inputs(input_ids, attention_mask, capacity)
      with sebp_jax.nnx.use_packed_attention(model, packed.layout):
        logits, _ = model(packed.input_ids, packed.positions, None, packed.attention_mask)
      logits = packed.unpack(logits)

  The model's attention over the packed sequence costs ``C²`` for ``C`` slots whatever it is
  given; inside this context each attention module it knows (:data:`sebp_jax.model_families.
  NNX_ATTENTION`: Tunix's Llama 3) runs :func:`sebp_jax.packing.packed_attention` with the
  layout instead (and the sliding window of ``pack_decoder_inputs(window=)``): each
  sequence in a row of its own where cuDNN runs (``"rows"``, a cost that follows the squared
  lengths), else one mask built from the layout. The model's own ``[1, C, C]`` mask is only
  checked against the layout, at three entries per slot: another batch's mask (a second
  batch run in the context) raises where it is concrete and makes the outputs NaN where it
  is traced (but for a batch split over devices, where a traced mask is not checked);
  ``None`` in its place skips the check. The outputs at real tokens are those of
  the padded batch; where a traced mask held more real tokens than the capacity, every
  output is NaN.

  Enter it where the packed inputs are made, best inside the traced function (the loss under
  ``nnx.grad``). Entered outside ``nnx.jit``, a concrete layout's contents are part of jit's
  cache key: each batch's layout compiles its own step. The attention modules get a subclass
  of their class while it is active (so the model's own remat still wraps the attention) and
  their class back on exit; a module runs its own attention in another thread.

  Args:
    model: the NNX model.
    layout: the packed inputs' :class:`~sebp_jax.packing.PackedLayout`.
    attention: one of :data:`~sebp_jax.packing.ATTENTION_METHODS` (as ``use_sebp``'s).
  """

  def __init__(self, model: nnx.Module, layout: PackedLayout, attention: str = "auto"):
    if not isinstance(model, nnx.Module):
      raise ValueError(f"use_packed_attention: model must be an nnx.Module, got "
                       f"{type(model).__name__}")
    if not isinstance(layout, PackedLayout):
      raise ValueError("use_packed_attention: layout must be a sebp_jax.packing.PackedLayout "
                       f"(pack_decoder_inputs(...).layout), got {type(layout).__name__}")
    if attention not in ATTENTION_METHODS:
      raise ValueError(f"attention must be one of {ATTENTION_METHODS}, got {attention!r}")
    self.model, self.layout, self.attention = model, layout, attention
    self._swapped: list[tuple[nnx.Module, type]] = []

  def attention_core(self, arguments: dict, mask_argument: str):
    """:func:`packed_attention` on this context's layout and its window, for a call with
    ``arguments``, the model's mask among them as ``mask_argument``: checked to be the
    layout's (:func:`~sebp_jax.packing.checked_decoder_mask`), a traced mismatch making the
    outputs NaN."""
    # The method's first argument after self is the attention's input.
    shape = jnp.shape(list(arguments.values())[1])
    layout = self.layout
    if tuple(shape[:2]) != (1, layout.capacity):
      raise ValueError(f"use_packed_attention: the attention's input has shape {shape}, not "
                       f"(1, {layout.capacity}, ...) of the layout: call the model on the "
                       "packed inputs")
    matches = checked_decoder_mask(layout, arguments.get(mask_argument))

    def core(query, key, value, *, window, **options):
      if window is not None:
        raise ValueError(f"use_packed_attention attends with the window of "
                         f"pack_decoder_inputs(window=), not the model's own ({window})")
      out = packed_attention(query, key, value, layout, window=layout.window,
                             method=self.attention, **options)
      # A layout that overflowed its capacity makes the packed outputs NaN, not only their
      # unpacking: a loss read on the packed slots would miss the tokens cut. A factor, not a
      # selection or a term, so that every gradient behind it is NaN too rather than zero,
      # also behind a ReLU.
      out = out * (1 + invalid_slots(layout)[:, None, None].astype(out.dtype))
      if matches is None:
        return out
      return out + jnp.where(matches, 0, jnp.nan).astype(out.dtype)
    return core

  def __enter__(self) -> "use_packed_attention":
    if getattr(_PACKED_ATTENTION, "context", None) is not None:
      raise RuntimeError("use_packed_attention contexts do not nest")
    sebp = getattr(context_lib._ACTIVE, "context", None)
    if isinstance(sebp, use_sebp) and sebp.active_mask is not None:
      raise ValueError(MASK_BESIDE_PACKING)
    for _, module in nnx.iter_modules(self.model):
      entry = model_families.nnx_attention(module)
      if entry is not None:
        self._swapped.append((module, type(module)))
        object.__setattr__(module, "__class__", _packed_attention_class(type(module), entry))
    if not self._swapped:
      raise ValueError("use_packed_attention found no attention module it can run per "
                       f"sequence in the model; supported: {model_families.NNX_SUPPORTED}")
    self._jit_key = _PACKED_JIT_KEY((self.attention, self._layout_key()))
    self._jit_key.__enter__()
    _PACKED_ATTENTION.context = self
    return self

  def _layout_key(self) -> tuple:
    """The layout's contents where they are concrete, else nothing shared with another."""
    layout = self.layout
    return (layout.batch_shape, layout.capacity, layout.row_width, layout.contiguous,
            layout.shards, layout.window, context_lib.contents_key(*jax.tree.leaves(layout)))

  def __exit__(self, exc_type, exc, tb) -> None:
    for module, cls in reversed(self._swapped):
      object.__setattr__(module, "__class__", cls)
    self._swapped.clear()
    _PACKED_ATTENTION.context = None
    self._jit_key.__exit__(None, None, None)
