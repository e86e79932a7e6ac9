"""What the Linen and NNX ``use_sebp`` contexts share.

Both pick layers by module path (``include`` / ``exclude`` / ``lm_head``), compute the shared
index of ``active_mask``'s tokens once, hand each layer its rows and capacity, keep a
:class:`SEBPReport`, and refuse to nest. They differ only in how a layer gets the SEBP backward:
Linen intercepts methods (:mod:`sebp_jax.intercept`), NNX swaps classes
(:mod:`sebp_jax.nnx`).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import itertools
import logging
import math
import re
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

from sebp_jax.layers import resolve_top_n
from sebp_jax.model_families import BATCH_MAJOR, ENCODER_DECODER
from sebp_jax.ops import (validate_backend, validate_capacity, validate_overflow,
                          validate_threshold)
from sebp_jax.report import RowLog
from sebp_jax.selection import active_rows_from_mask, capacity_ladder
from sebp_jax.sharding import (RowSharding, map_row_shards, normalize_batch_axes, row_sharding,
                               shard_row_counts, validate_mesh, vary_alike)

logger = logging.getLogger("sebp_jax")

#: Per thread (as flax's interceptors are), the use_sebp context entered and not yet exited.
_ACTIVE = threading.local()

#: Part of every ``jax.jit`` cache key: the options and the constant index of the use_sebp
#: context the thread is in (None outside one). A function traced and compiled inside one
#: context is traced again in another, or outside any, instead of running its program there.
_JIT_KEY = jax.make_user_context(None)
#: The reports of recent contexts that traced layers, by jit key, each distinct one once, the
#: latest last: a context entered around a call whose program was compiled under an equal key
#: (so ran exactly its SEBP) takes that trace's report instead of raising that nothing was
#: swapped.
_TRACED_REPORTS: collections.OrderedDict = collections.OrderedDict()
_TRACED_REPORTS_SIZE = 1024
_TRACED_REPORTS_LOCK = threading.Lock()
_UNIQUE = itertools.count()


def contents_key(*arrays) -> tuple:
  """What a program compiled with ``arrays`` as constants depends on, hashable: their shapes,
  dtypes and contents where all are concrete; where one is traced, a key no other shares."""
  if any(isinstance(a, jax.core.Tracer) for a in arrays):
    return ("traced", next(_UNIQUE))
  host = [np.asarray(a) for a in arrays]
  digest = hashlib.sha256()
  for a in host:
    digest.update(a.tobytes())
  return (tuple((a.shape, str(a.dtype)) for a in host), digest.hexdigest())


#: Every linear layer, less :data:`DEFAULT_EXCLUDE`: in BERT- and Llama-style models that is
#: the attention projections and MLP layers, the layers the SEBP paper swaps.
DEFAULT_INCLUDE = r".*"
#: Language-model heads: the layers under a path component ``lm_head`` (Llama, Mistral,
#: RoBERTa) or ``cls/predictions`` (BERT). They see every token, and under a loss masked on
#: padding their dY rows of padding are exactly zero, but the paper leaves them dense;
#: ``use_sebp(lm_head=True)`` swaps them.
LM_HEAD = r"(^|/)(lm_head|cls/predictions)(/|$)"
_LM_HEAD = re.compile(LM_HEAD)
#: Poolers and classification heads by their names in transformers' models: they see one row
#: per sequence, so there are no rows to skip. Language-model heads are left dense too unless
#: ``lm_head=True``.
DEFAULT_EXCLUDE = rf"(^|/)(pooler|classifier|score|qa_outputs)(/|$)|{LM_HEAD}"


def validate_switch(value: Any, name: str) -> bool:
  """``value`` as a bool, or ValueError naming ``name``: a string such as "False" would be
  true."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be True or False, got {value!r}")
  return bool(value)


def _compiled_pattern(pattern: Any, name: str) -> re.Pattern:
  try:
    return re.compile(pattern)
  except (TypeError, re.error) as error:
    raise ValueError(f"{name} must be a regular expression (a str), got {pattern!r}: "
                     f"{error}") from None


@dataclasses.dataclass
class SEBPReport:
  """What one ``use_sebp`` context did, layer by layer (module paths joined with ``/``; a
  module with none, applied through ``.apply``, by its name).

  ``swapped`` lists the linear layers, ``embeddings`` the embedding lookups that run with the
  SEBP backward, ``shared_index`` those of both on the mask's index, ``skipped`` the linear
  layers (and embeddings) left dense, with the reason, ``per_shard`` the swapped ones whose
  rows are split over devices, each shard selecting its own, ``own_rows`` the swapped ones
  that select their own rows although their shape is the mask's. With ``packed=True`` (Linen),
  ``packed`` lists the modules run on the real tokens only (a model's encoder or decoder
  stack, its language-model head) in ``capacity`` slots; the layers inside them are not listed
  apart. A layer called more than once decides per call: one run on the tokens and again on
  pooled rows (a shared projection) is listed both as swapped and as skipped, with the reason.
  """
  swapped: list[str] = dataclasses.field(default_factory=list)
  embeddings: list[str] = dataclasses.field(default_factory=list)
  shared_index: list[str] = dataclasses.field(default_factory=list)
  skipped: dict[str, str] = dataclasses.field(default_factory=dict)
  per_shard: list[str] = dataclasses.field(default_factory=list)
  packed: list[str] = dataclasses.field(default_factory=list)
  capacity: int | None = None
  #: Swapped layers that select their own rows although ``active_mask`` has their shape,
  #: with the reason (the shape cannot tell ``[B, L]`` from ``[L, B]``).
  own_rows: dict[str, str] = dataclasses.field(default_factory=dict)

  @property
  def num_swapped(self) -> int:
    """Linear layers swapped (embeddings not counted)."""
    return len(self.swapped)

  def summary(self) -> str:
    packed = (f"{', '.join(self.packed)} packed into {self.capacity} token slots; "
              if self.packed else "")
    per_shard = f", {len(self.per_shard)} selecting per shard" if self.per_shard else ""
    return (f"use_sebp: {packed}{self.num_swapped} linear layers and {len(self.embeddings)} "
            f"embeddings swapped ({len(self.shared_index)} on the shared mask index"
            f"{per_shard}), {len(self.skipped)} left dense")


def _split(sharding: RowSharding | None) -> tuple | None:
  return None if sharding is None else (sharding.axes, sharding.num_shards)


def record(bucket: list[str], path: str) -> None:
  if path not in bucket:
    bucket.append(path)


def validate_active_mask(active_mask: Any) -> Any:
  """``active_mask`` as an array (a list becomes a numpy array), or ValueError naming it."""
  if active_mask is None or isinstance(active_mask, (jax.Array, np.ndarray)):
    array = active_mask
  else:
    try:
      array = np.asarray(active_mask)
    except (TypeError, ValueError) as error:
      raise ValueError(f"active_mask must be an array of token flags such as attention_mask "
                       f"[B, L], got {type(active_mask).__name__}: {error}") from None
  if array is not None and (jnp.ndim(array) < 1 or not (
      jnp.issubdtype(array.dtype, jnp.bool_) or jnp.issubdtype(array.dtype, jnp.number))):
    raise ValueError(f"active_mask must be an array of token flags such as attention_mask "
                     f"[B, L] (bool or numbers, at least 1-D), got {array.dtype}"
                     f"{list(jnp.shape(array))}")
  return array


@jax.custom_vjp
def poison_cotangent(y: jax.Array, poison: jax.Array) -> jax.Array:
  """``y`` as is; its cotangent comes back plus ``poison`` (0 or NaN, of ``y``'s leading
  shape or a scalar), so that a layer's backward sees a NaN dY where its index was cut."""
  del poison
  return y


def _poison_cotangent_fwd(y, poison):
  return y, poison


def _poison_cotangent_bwd(poison, dy):
  poison = poison.reshape(poison.shape + (1,) * (dy.ndim - poison.ndim))
  return dy + poison.astype(dy.dtype), None


poison_cotangent.defvjp(_poison_cotangent_fwd, _poison_cotangent_bwd)


class SEBPContext:
  """The options, layer choice, shared index and report of one ``use_sebp`` context.

  Subclasses hook the chosen layers in on :meth:`activate` and out on :meth:`deactivate`.
  """

  def __init__(self, top_n: int | float | str, threshold: float, *, overflow: str,
               include: str, exclude: str | None, active_mask: jax.Array | None,
               backend: str, embeddings: bool, lm_head: bool, row_log: RowLog | None,
               require_swaps: bool, batch_axes: Any = None, mesh: Any = None):
    validate_capacity(resolve_top_n(top_n, 1))  # Now rather than inside a trace.
    self.overflow = validate_overflow(overflow)
    if row_log is not None and not isinstance(row_log, RowLog):
      raise ValueError(f"row_log must be a sebp_jax.RowLog, got {type(row_log).__name__}")
    self.top_n = top_n
    self.row_log = row_log
    self.threshold = validate_threshold(threshold)
    self.include = _compiled_pattern(include, "include")
    self.exclude = None if exclude in (None, "") else _compiled_pattern(exclude, "exclude")
    self.lm_head = validate_switch(lm_head, "lm_head")
    self.active_mask = validate_active_mask(active_mask)
    self.backend = validate_backend(backend)
    self.embeddings = validate_switch(embeddings, "embeddings")
    self.require_swaps = validate_switch(require_swaps, "require_swaps")
    self.batch_axes = normalize_batch_axes(batch_axes)
    self.mesh = validate_mesh(mesh)
    if mesh is not None and self.batch_axes is None:
      raise ValueError("use_sebp(mesh=...) names the mesh of batch_axes: give batch_axes too")
    self.reset()

  def reset(self) -> None:
    """A fresh report and no shared index: the state of a context not yet entered."""
    self.report = SEBPReport()
    #: Dense / Embed / swapped layers this context saw traced: 0 when a compiled program ran.
    self.layers_seen = 0
    self._shared_rows: jax.Array | None = None
    self._shared_top_n: int | str | None = None
    self._mask_sharding: RowSharding | None = None
    # 0 or NaN per token (a scalar on one device): NaN where the shared index cut real tokens.
    self._index_poison: jax.Array | None = None
    self._mask_key_value: Any = None
    self._jit_key_value: tuple | None = None
    self._jit_key_context = None
    self._warned_ambiguous = False
    self._entered = False

  @property
  def include_given(self) -> bool:
    return self.include.pattern != DEFAULT_INCLUDE

  def excluded_by_user(self, path: str) -> bool:
    """``path`` matches an ``exclude`` of the user's own (not the default's heads)."""
    return (self.exclude is not None and self.exclude.pattern != DEFAULT_EXCLUDE
            and self.exclude.search(path) is not None)

  def activate(self) -> None:
    """Makes this the thread's context and computes the shared index of ``active_mask``."""
    if getattr(_ACTIVE, "context", None) is not None:
      # Two contexts would both claim every layer; the loser's report would be wrong.
      raise RuntimeError(
          "use_sebp is already active: contexts do not nest. Enter one use_sebp around the "
          "model call, with the options of all its layers (include/exclude pick layers).")
    # Entered again, a context starts afresh: a report and a packed region of before would
    # be taken for this use's. The first use fills the report made with the context.
    if self._entered:
      self.reset()
    self._entered = True
    if self.batch_axes is None and self.mesh is None:
      mesh = jax.sharding.get_abstract_mesh()
      if any(kind == AxisType.Auto and mesh.shape[name] > 1
             for name, kind in zip(mesh.axis_names, mesh.axis_types)):
        logger.warning(
            "use_sebp under a mesh with Auto axes %s and no batch_axes: the layers select "
            "rows over the whole batch, which gathers it across devices in every backward. "
            "Pass batch_axes (the mesh axes that split the batch).", dict(mesh.shape))
    if self.active_mask is not None and jnp.size(self.active_mask) > 0:
      # Computed here, in the trace that entered the context, so that layers traced inside
      # scan / remat close over it instead of leaking an inner tracer out.
      self.share_mask_index()
    self._mask_key_value = self.mask_key()
    self._jit_key_value = self.jit_key()
    self._jit_key_context = _JIT_KEY(self._jit_key_value)
    self._jit_key_context.__enter__()
    _ACTIVE.context = self

  def deactivate(self) -> None:
    _ACTIVE.context = None
    if self._jit_key_context is not None:
      self._jit_key_context.__exit__(None, None, None)
      self._jit_key_context = None

  def mask_key(self) -> Any:
    """What of ``active_mask`` a compiled program depends on: its contents when it is
    concrete (its index is then a constant of the program), else nothing shared with another
    context."""
    return None if self.active_mask is None else contents_key(self.active_mask)

  def jit_key(self) -> tuple:
    """Everything a program traced in this context depends on, hashable: the options and
    the mask (:meth:`mask_key`)."""
    # top_n with its type: 1.0 (every row) equals 1 (one row) as a key. Patterns with their
    # flags: re.I changes what they match.
    return (type(self).__name__, type(self.top_n), self.top_n, self.threshold, self.overflow,
            self.include.pattern, self.include.flags,
            self.exclude and (self.exclude.pattern, self.exclude.flags), self.lm_head,
            self.backend, self.embeddings, self.row_log, self.batch_axes, self.mesh,
            self._mask_key_value)

  def layers_key(self) -> Any:
    """What of the model the context's report depends on beyond :meth:`jit_key`, where it is
    known on entering: None here, where the report grows as layers are traced."""
    return None

  def _reusable_key(self) -> tuple | None:
    mask_key = self._mask_key_value
    if mask_key is not None and mask_key[0] == "traced":
      return None
    return self._jit_key_value, self.layers_key()

  def remember_or_reuse_report(self) -> bool:
    """On exit: remembers this context's report when it traced layers; when it traced none,
    takes the report of the trace whose program ran (one under an equal jit key) and returns
    True, else False."""
    key = self._reusable_key()
    if key is None:
      return False
    with _TRACED_REPORTS_LOCK:
      if self.layers_seen:
        reports = [r for r in _TRACED_REPORTS.pop(key, []) if r != self.report]
        _TRACED_REPORTS[key] = [*reports, copy.deepcopy(self.report)]
        while len(_TRACED_REPORTS) > _TRACED_REPORTS_SIZE:
          _TRACED_REPORTS.popitem(last=False)
        return False
      reports = _TRACED_REPORTS.get(key, [])
    if not reports:
      return False
    if len(reports) > 1:
      # Two programs (a training step and another function of the model, say) traced in
      # equal contexts: JAX does not say which of them ran.
      logger.warning(
          "use_sebp: no layer was traced in this context; equal contexts traced %d programs "
          "with different reports, and the report taken is the latest trace's, which need not "
          "be the program that ran. Enter the context inside the jitted function for a "
          "report of its own.", len(reports))
    vars(self.report).update(copy.deepcopy(vars(reports[-1])))
    return True

  def shared_output(self, y: jax.Array, active_rows: jax.Array | None) -> jax.Array:
    """A layer's output ``y``, its cotangent poisoned where it took the shared index and the
    index cut real tokens (``overflow="nan"`` with a traced mask)."""
    if active_rows is None or self._index_poison is None:
      return y
    return poison_cotangent(*vary_alike(y, self._index_poison))

  def sharding_of(self, rows: jax.Array, num_row_dims: int) -> RowSharding | None:
    """How the rows of ``rows`` (its first ``num_row_dims`` dims) are split over devices."""
    return row_sharding(rows, num_row_dims, mesh=self.mesh, batch_axes=self.batch_axes)

  @property
  def sharding_options(self) -> dict[str, Any]:
    """The options that tell the ops how rows are split."""
    return dict(batch_axes=self.batch_axes, mesh=self.mesh)

  def share_mask_index(self) -> None:
    """The index of ``active_mask``'s tokens that every layer on its rows shares, and the
    capacity those layers run at: per shard where the batch is split over devices."""
    sharding = self.sharding_of(self.active_mask, jnp.ndim(self.active_mask))
    num_shards = sharding.num_shards if sharding else 1
    num_rows = math.prod(jnp.shape(self.active_mask)) // num_shards
    top_n = resolve_top_n(self.top_n, num_rows)
    concrete = not isinstance(self.active_mask, jax.core.Tracer)
    if concrete and self.overflow != "drop":
      # Every real token fits: the index is complete, and no layer needs to branch.
      count = int(shard_row_counts(self.active_mask, num_shards).max())
      if self.overflow == "nan" and top_n != "auto" and count > top_n:
        where = "a shard of active_mask has" if sharding else "active_mask has"
        raise ValueError(f"{where} {count} real tokens, more than top_n={top_n} "
                         "(overflow='nan'): give a top_n of at least that")
      if top_n == "auto" or count > top_n:
        top_n = next((rung for rung in capacity_ladder(num_rows) if rung >= count), num_rows)
      size = top_n
    elif self.overflow == "nan" and top_n != "auto":
      # The first top_n real tokens; where a shard has more, its layers' dY turn NaN
      # (:meth:`shared_output`): the tokens cut may carry gradient, active or not.
      size = min(num_rows, top_n)
    else:
      size = num_rows  # Every real token: the layers choose their capacity at run time.
    cut = size < num_rows and not concrete and self.overflow == "nan"

    def index(mask):
      rows = active_rows_from_mask(mask, size)
      if not cut:
        return (rows,)
      overflowed = jnp.count_nonzero(mask) > size
      return rows, jnp.full(jnp.shape(mask), jnp.where(overflowed, jnp.nan, 0.0), jnp.float32)

    shared = self.per_shard_of_mask(index, sharding)
    self._shared_rows = shared[0]
    self._index_poison = shared[1] if cut else None
    self._shared_top_n = top_n
    self._mask_sharding = sharding

  def per_shard_of_mask(self, fn, sharding: RowSharding | None) -> tuple:
    """``fn(mask) -> tuple of arrays`` of ``active_mask``, or of each shard's block of it
    (the results joined along their first dimension) where ``sharding`` splits it."""
    mask = jnp.asarray(self.active_mask)
    if sharding is None:
      return fn(mask)
    out, () = map_row_shards(lambda rows, whole: (fn(rows[0]), ()), sharding, rows=(mask,),
                             whole=(), sums_like=())
    return out

  def rows_to_keep(self, path: str, rows: jax.Array, num_row_dims: int, *,
                   layout: str | None = None) -> tuple[jax.Array | None, Any] | str:
    """``(active_rows, top_n)`` for a layer whose rows are the first ``num_row_dims`` dims of
    ``rows`` (a linear layer's input, or embedding ids), or why it stays dense.

    With ``active_mask``, shapes and not only counts must agree for the shared index: a
    transposed batch of as many rows would take the index for rows it does not describe, so
    it selects its own; another number of rows is not the mask's tokens at all. So must the
    split over devices, for the index is one block per shard. Where the mask's dims are
    equal (B == L), the shape cannot tell ``[B, L]`` from ``[L, B]``: only a layer whose
    ``layout`` is :data:`BATCH_MAJOR` (a model family known to feed its layers batch-major
    rows) takes the index, any other selects its own. A layer of an
    :data:`ENCODER_DECODER` model raises: one mask cannot say whose tokens its rows are.
    """
    row_shape = tuple(jnp.shape(rows)[:num_row_dims])
    sharding = self.sharding_of(rows, num_row_dims)
    mask_shape = None if self.active_mask is None else tuple(jnp.shape(self.active_mask))
    if self._shared_rows is not None and layout == ENCODER_DECODER:
      raise ValueError(
          f"use_sebp(active_mask=...) on an encoder-decoder model, or one with cross-attention "
          f"(layer {path}): its encoder and decoder see different tokens, and where their "
          "lengths are equal no shape tells which a layer's rows are, so one mask would give "
          "the decoder the encoder's index. "
          "Leave active_mask out: every layer then selects its own rows from dY, exactly.")
    if self._shared_rows is None or math.prod(row_shape) == math.prod(mask_shape):
      # Same tokens; the shared index when in the same layout on the same shards.
      if sharding is not None:
        record(self.report.per_shard, path)
      if (self._shared_rows is not None and row_shape == mask_shape
          and _split(sharding) == _split(self._mask_sharding)):
        if layout == BATCH_MAJOR or len(set(mask_shape)) == len(mask_shape):
          record(self.report.shared_index, path)
          return self._shared_rows, self._shared_top_n
        self._note_ambiguous(path, mask_shape)
      # A kept fraction counts the rows of a shard.
      num_shards = sharding.num_shards if sharding else 1
      return None, resolve_top_n(self.top_n, math.prod(row_shape) // num_shards)
    return (f"{math.prod(row_shape)} rows, not the {math.prod(mask_shape)} tokens of "
            "active_mask")

  def _note_ambiguous(self, path: str, mask_shape: tuple[int, ...]) -> None:
    self.report.own_rows[path] = (
        f"rows of shape {mask_shape}, as active_mask's, whose equal dims cannot tell "
        "[B, L] from [L, B] outside a model family known to be batch-major")
    if not self._warned_ambiguous:
      self._warned_ambiguous = True
      logger.warning(
          "use_sebp: active_mask has shape %s, whose equal dims cannot tell a [B, L] batch "
          "from a transposed one, so layers outside the model families known to be "
          "batch-major (transformers' Flax models, Tunix's) select their own rows from dY "
          "(exact, without the shared index); e.g. %s. report.own_rows lists them.",
          mask_shape, path)

  def path_skip_reason(self, path: str, is_linear: bool) -> str | None:
    """Why ``include`` / ``exclude`` / ``lm_head`` leave the layer at ``path`` dense."""
    if is_linear and self.lm_head and _LM_HEAD.search(path):
      return None
    if self.exclude and self.exclude.search(path):
      return "matched by exclude"
    if is_linear and _LM_HEAD.search(path):  # an exclude of the user's own left it out
      return "a language-model head (lm_head=False)"
    if is_linear and not self.include.search(path):
      return "not matched by include"
    return None

  def check_swaps(self, what: str, cause: str) -> None:
    """Raises when ``require_swaps`` and this context gave no layer the SEBP backward, or
    when its ``active_mask`` served no layer. ``what`` names the layer kind, ``cause`` the
    likeliest reason besides include/exclude."""
    if not self.require_swaps:
      return
    # A model may have embeddings only; but an include of one's own that matches no linear
    # layer is a typo.
    if not self.report.swapped and (self.include_given or not self.report.embeddings):
      skipped = "; ".join(f"{p}: {why}" for p, why in list(self.report.skipped.items())[:5])
      raise RuntimeError(
          f"use_sebp swapped no {what}. {cause}Otherwise include/exclude matched no "
          f"layer{' (' + skipped + ')' if skipped else ''}.")
    if (self._shared_rows is not None and not self.report.shared_index
        and not self.report.own_rows):
      raise RuntimeError(
          f"use_sebp's active_mask of shape {jnp.shape(self.active_mask)} matched no layer: "
          "no linear layer's input had it as its leading dimensions and no embedding's ids "
          "had its shape and split over devices. Pass the mask of the tokens the layers see "
          "(e.g. attention_mask [B, L]); where their rows are split over devices and the "
          "mask is a host array, pass batch_axes too.")
