"""``use_sebp``: run every ``flax.linen.Dense`` of an unmodified model through SEBP.

The interceptor (``flax.linen.intercept_methods``) replaces the ``__call__`` of each selected
``nn.Dense`` by :func:`sebp_jax.layers.sebp_dense_call` (of transformers' ``FlaxConv1D``,
GPT-2's linear layer, by :func:`sebp_jax.layers.sebp_conv1d_call`) and, unless
``embeddings=False``, of each ``nn.Embed`` by :func:`sebp_jax.layers.sebp_embed_call`: same
params, same forward, SEBP backward. Nothing in the model's code or its params changes.

It acts while a function is *traced*. Its options and a concrete mask's contents are part of
``jax.jit``'s cache key (:data:`sebp_jax.context._JIT_KEY`), so a function jitted outside the
context is traced again inside it, and one traced inside it is traced again outside (dense) or
in another context; an equal context runs the program compiled before. Only a program compiled
ahead of time runs what it was compiled with: the context raises when no layer went through
it, unless an equal context traced layers before (it then takes that trace's report, which it
cannot tell from the program's). Entering it inside the function being jitted (or decorating
that function with it) gives each batch of a traced mask its index with one compile.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from sebp_jax import model_families
from sebp_jax.context import (DEFAULT_EXCLUDE, DEFAULT_INCLUDE, LM_HEAD, SEBPContext,
                              SEBPReport, record, validate_switch)
from sebp_jax.layers import (SEBPDense, SEBPEmbed, linear_head, module_path, resolve_top_n,
                             sebp_conv1d_call, sebp_dense_call, sebp_embed_call)
from sebp_jax.ops import validate_top_n
from sebp_jax.outputs import remember_packed, unread_parameters_reason
from sebp_jax.packing import (ATTENTION_METHODS, PackedLayout, checked_column_tokens,
                              gather_tokens, pack_layout, packed_attention, scatter_tokens,
                              token_capacity)
from sebp_jax.report import RowLog
from sebp_jax.selection import active_rows_from_mask
from sebp_jax.sharding import shard_row_counts

logger = logging.getLogger("sebp_jax")

_NOT_PACKED = object()

# Why a context may trace no layer although the model ran in it.
_NOTHING_TRACED = (
    ", or what ran in it was compiled before, elsewhere: jax.jit traces again in a new "
    "use_sebp context, so that is a program compiled ahead of time "
    "(jax.jit(f).lower(...).compile()) or a function jitted by other means, which ran "
    "whatever it was compiled with")

__all__ = ["DEFAULT_EXCLUDE", "DEFAULT_INCLUDE", "LM_HEAD", "SEBPReport", "use_sebp"]


class use_sebp(SEBPContext):
  """Runs the selected ``nn.Dense`` layers of any linen model with the SEBP backward.

  Use it inside the function that is traced, or as a decorator of it::

      def loss_fn(params, batch):
        with use_sebp(top_n=0.25) as report:
          logits = model(**batch, params=params).logits
        ...

      loss_fn = use_sebp(top_n=2048)(loss_fn)

  Args:
    top_n: each layer's capacity of kept rows of its flattened dY: ``"auto"`` (default), an
      int, or a float in (0, 1] for a kept fraction of that layer's rows. ``"auto"`` takes the
      smallest of T/16, T/8, T/4, T/2 (else every row) that holds the active rows: from the
      mask on the host when ``active_mask`` is concrete (no run-time branch), else at run time
      in each layer's backward (a ``lax.switch``).
    threshold: rows of dY whose max ``|value|`` is at most this count as zero.
    overflow: what happens when more rows are active than an int ``top_n`` holds:
      ``"exact"`` (default) runs a larger capacity (the dense backward of the active rows),
      decided on the host from a concrete ``active_mask``, else by a run-time branch in each
      layer; ``"nan"`` makes the gradients NaN instead, with no branch: the fast choice when
      ``top_n`` comes from the batch on the host (:func:`sebp_jax.token_capacity`). With
      ``active_mask`` it counts the mask's real tokens, active or not: more than ``top_n``
      raise at once for a concrete mask and make every gradient NaN for a traced one.
      ``"drop"`` keeps the ``top_n`` rows of largest L2 norm, as the SEBP paper does.
    row_log: a :class:`sebp_jax.RowLog` that every swapped layer's backward reports to (active
      and kept rows, capacity, dropped share of dY's norm), through ``jax.debug.callback``.
    include: regex searched in the module path (``"bert/encoder/layer/0/attention/self/query"``,
      ``"Dense_0"``); a Dense layer is swapped when it matches ``include`` and not ``exclude``.
      Default: every Dense layer. Subclasses of ``nn.Dense`` / ``nn.Embed`` with their own
      ``__call__`` are always left alone.
    exclude: regex of paths left dense; default: poolers and classification / LM heads named
      as in transformers' models. Name your own model's head in it (or give the head a name
      that matches) when the head sees one row per sequence.
    lm_head: also swap the language-model head's Dense layers (paths matching
      :data:`LM_HEAD`), whatever ``include`` and ``exclude`` say. Exact with ``active_mask``
      when the loss is masked on padding (:func:`sebp_jax.losses.masked_causal_lm_loss`), and
      the head is a large layer (vocabulary x hidden size). A head that a model applies
      through ``.apply`` with the embedding's weights (tied GPT-2, a tied BERT/RoBERTa MLM
      decoder) is a module of its own with no path (its name in the report) and is not
      covered; Flax Llama has its own ``lm_head`` even when the checkpoint ties it.
    active_mask: optional token mask (e.g. ``attention_mask: [B, L]``). Given, one static-size
      index of the real tokens is computed once and every layer whose input has the mask's
      shape as its leading dims (embedding ids: the mask's shape) reuses it instead of
      scoring dY itself. A layer with as many rows in another layout selects its own (where
      the mask's dims are equal, any layer outside transformers' and Tunix's models, whose
      layers are known to be batch-major: ``report.own_rows``); a layer with another number
      of rows (a head on one row per sequence) is left dense: the mask says nothing about
      its rows. An encoder-decoder model raises, as does a model's cross-attention (GPT-2,
      BERT, XGLM with ``add_cross_attention``) called with encoder states: its stacks see
      different tokens, and one mask would serve both; leave ``active_mask`` out. Exact when
      the gradient rows of the masked tokens are exactly zero: BERT classification
      (attention masks padding keys, the loss reads [CLS] only) and a causal LM whose loss is
      masked on padding. Not exact when
      the loss or a pooling reads padding positions, or when a real token is masked out. A
      NaN/Inf in a masked-out row of dY makes that layer's dW and db NaN rather than vanish.
    backend: ``"auto"`` or an implementation name (``"xla"``, ``"pallas"``, ``"dense"``, or
      one registered with :func:`sebp_jax.register_implementation`).
    embeddings: also give ``nn.Embed`` lookups (not ``attend``) the SEBP backward: the table's
      gradient is a scatter of the kept rows of dY only (:func:`sebp_jax.sebp_embed_lookup`), same
      ``top_n``, index and exactness as the Dense layers. ``exclude`` applies to them too.
    packed: run the model on the real tokens of ``active_mask`` only (needs it): the encoder
      (BERT and its copies, DistilBERT, ALBERT, RoFormer's layers) or decoder stack (Llama,
      Mistral, Gemma, GPT-2, GPT-Neo, GPT-J, OPT, XGLM, Bloom; embeddings and final norm
      included)
      gathers them once into one sequence of ``top_n`` slots, attends per sequence (causal
      for decoders, each token at its own position; see ``attention``) and scatters its
      outputs back, so they keep their shapes, with zeros at padding. Language-model heads
      (:data:`LM_HEAD`) run on those tokens too, as does any Dense on every token after it
      that an ``exclude`` of the user's own does not name. Layers outside (BERT's
      embeddings, poolers, heads) keep what the other options say. Exact under the
      conditions of the shared index: the outputs are read at real tokens only. Any mask
      layout works (left padding,
      holes), but a head that reads one column of each row (BERT's pooler, DistilBERT's
      classifiers: the first; RoFormer's multiple choice: the last) needs a real token there
      (:func:`sebp_jax.packing.checked_column_tokens`). A batch with more real
      tokens than ``top_n`` is never cut: a concrete mask raises at once, and under ``jit``
      the packed outputs are NaN. Pick ``top_n`` on the
      host with :func:`sebp_jax.token_capacity` and pass it to the jitted step as a static
      argument. Dropout draws its random masks on the packed rows, so they fall elsewhere
      than in the padded batch; the attention probabilities are then materialised (no fused
      kernel has dropout). ``output_attentions``, decoding caches and cross-attention are
      refused.
    attention: how packed attention runs (:data:`sebp_jax.packing.ATTENTION_METHODS`):
      ``"rows"``, each sequence in a row of its own with cuDNN given the lengths, its cost
      the sum of the squared lengths (:func:`sebp_jax.packing.row_attention`); ``"mask"``,
      over the packed sequence with one ``[C, C]`` mask, its cost ``C²``; ``"auto"``
      (default): ``"rows"`` where cuDNN runs it (NVIDIA GPUs, 16-bit), else ``"mask"``,
      XLA's exact path on CPUs.
    batch_axes: the mesh axes that split the batch (the first dimension of ``active_mask``
      and of the layers' inputs) when the step is sharded over several devices on a mesh of
      ``Auto`` axes; under ``Explicit`` axes the arrays' types say it, and this may be left
      out. Each shard then selects among its own rows, with the dense step's collectives
      (:mod:`sebp_jax.sharding`) but for an embedding table with more rows than all shards
      keep, whose gradient comes from those rows, gathered, in place of the shards' tables
      summed; ``top_n`` counts per shard: an int is
      each shard's capacity, a fraction is of each shard's rows, ``"auto"`` takes the rung
      that holds the fullest shard's real tokens (from a concrete mask), or each shard its
      own at run time. With ``packed``, each shard packs its own rows into ``top_n`` slots
      of its own (:func:`sebp_jax.token_capacity` with ``num_shards``), and its attention,
      gathers and scatters run on its device (``jax.shard_map``): the step's collectives
      are the dense step's, the word table's rows aside.
    mesh: the mesh of ``batch_axes``; None: the one entered with ``jax.set_mesh``.
    require_swaps: raise when the context ends without having swapped any layer, with an
      ``include`` of one's own that matched no Dense layer (the sign of an already-compiled
      function, or of patterns that match nothing), or with an ``active_mask`` that no layer
      used; with ``packed=True``, when no supported model was packed.

  Contexts do not nest: entering one while another is active raises.
  """

  def __init__(self, top_n: int | float | str = "auto", threshold: float = 0.0, *,
               overflow: str = "exact", include: str = DEFAULT_INCLUDE,
               exclude: str | None = DEFAULT_EXCLUDE, active_mask: jax.Array | None = None,
               backend: str = "auto", embeddings: bool = True, lm_head: bool = False,
               packed: bool = False, attention: str = "auto", row_log: RowLog | None = None,
               require_swaps: bool = True, batch_axes: Any = None, mesh: Any = None):
    super().__init__(top_n, threshold, overflow=overflow, include=include, exclude=exclude,
                     active_mask=active_mask, backend=backend, embeddings=embeddings,
                     lm_head=lm_head, row_log=row_log, require_swaps=require_swaps,
                     batch_axes=batch_axes, mesh=mesh)
    packed = validate_switch(packed, "packed")
    if packed and active_mask is None:
      raise ValueError("use_sebp(packed=True) needs active_mask: the [B, L] mask of the real "
                       "tokens to pack")
    if packed and overflow == "drop":
      raise ValueError("use_sebp(packed=True) cannot drop tokens: overflow must be 'exact' or "
                       "'nan'")
    if attention not in ATTENTION_METHODS:
      raise ValueError(f"attention must be one of {ATTENTION_METHODS}, got {attention!r}")
    self.packed = packed
    self.attention = attention

  def reset(self) -> None:
    super().reset()
    self._stack: contextlib.ExitStack | None = None
    self._layout: PackedLayout | None = None
    # The family whose region is running, and the one whose region ran in this context.
    self._region_family: model_families.PackedFamily | None = None
    self._packed_family: model_families.PackedFamily | None = None

  def jit_key(self) -> tuple:
    return (*super().jit_key(), self.packed, self.attention)

  def _fresh_copy(self) -> "use_sebp":
    # Each call of a decorated function gets its own context and report.
    fresh = use_sebp.__new__(use_sebp)
    fresh.__dict__.update(self.__dict__)
    fresh.reset()
    return fresh

  def __call__(self, fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
      with self._fresh_copy():
        return fn(*args, **kwargs)
    return wrapped

  def __enter__(self) -> SEBPReport:
    self.activate()
    self._stack = contextlib.ExitStack()
    self._stack.enter_context(nn.intercept_methods(self._intercept))
    return self.report

  def __exit__(self, exc_type, exc, tb) -> None:
    self._stack.close()
    self.deactivate()
    if exc_type is not None:
      return
    if self.remember_or_reuse_report():
      return  # A program compiled under an equal context ran: its trace's report.
    logger.info(self.report.summary())
    if self.packed and self.require_swaps and self._packed_family is None:
      raise RuntimeError(
          "use_sebp(packed=True) packed nothing: no module of a supported model ran "
          f"(transformers' {model_families.SUPPORTED}){_NOTHING_TRACED}. Use it around "
          "such a model's call, inside the traced function.")
    if self._packed_family is None:
      self.check_swaps("Dense layer", f"No Dense layer was traced in it{_NOTHING_TRACED}. "
                       if not self.layers_seen else "")

  def share_mask_index(self) -> None:
    """The shared index of ``active_mask``; with ``packed``, the packed layout too: per
    shard where the batch is split over devices (each packs its own rows, ``top_n`` slots
    each)."""
    if not self.packed:
      super().share_mask_index()
      return
    sharding = self.sharding_of(self.active_mask, jnp.ndim(self.active_mask))
    num_shards = sharding.num_shards if sharding else 1
    top_n = resolve_top_n(self.top_n, math.prod(jnp.shape(self.active_mask)) // num_shards)
    concrete = not isinstance(self.active_mask, jax.core.Tracer)
    if concrete and (top_n == "auto" or (
        self.overflow == "exact"
        and shard_row_counts(self.active_mask, num_shards).max() > top_n)):
      top_n = token_capacity(self.active_mask, num_shards=num_shards)
    elif top_n == "auto":
      raise ValueError(
          "use_sebp(packed=True) packs into a static capacity, and active_mask is traced: "
          "pick it on the host, top_n=sebp_jax.token_capacity(mask), and pass it as a static "
          "argument of the jitted function")
    # The mask as given: a numpy mask is checked against the capacity now, even in a trace.
    self._layout = pack_layout(self.active_mask, validate_top_n(top_n), sharding)
    self.report.capacity = top_n
    (self._shared_rows,) = self.per_shard_of_mask(
        lambda mask: (active_rows_from_mask(mask, top_n),), sharding)
    self._shared_top_n = top_n
    self._mask_sharding = sharding

  def skip_reason(self, module: nn.Module) -> str | None:
    """Why this context leaves ``module`` (a bound ``nn.Dense``, ``nn.Embed`` or transformers'
    ``FlaxConv1D``, as its interceptor sees it) as it is, or None when it gives it the SEBP
    backward."""
    is_dense = isinstance(module, nn.Dense)
    is_linear = is_dense or model_families.is_conv1d(module)
    # Only modules that run nn.Dense's / nn.Embed's own __call__ are swapped: a subclass with
    # its own __call__ (SEBPDense, SEBPEmbed, or any other) would lose its code. FlaxConv1D is
    # matched by its own class.
    if is_dense and type(module).__call__ is not nn.Dense.__call__ or (
        not is_linear and type(module).__call__ is not nn.Embed.__call__):
      return "a subclass with its own __call__"
    path = module_path(module)
    if not module.path:
      # A module applied through .apply inside another one (a head tied to an embedding's
      # weights): nothing tells what it is or what its rows are.
      return "no path of its own (applied through .apply)"
    reason = self.path_skip_reason(path, is_linear)
    if reason:
      return reason
    if is_linear and not is_dense and not module.has_variable("params", "kernel"):
      return "being initialized: its own call creates its parameters"
    if is_dense and (module.dot_general is not None or module.dot_general_cls is not None):
      return "custom dot_general (e.g. fp8/quantized)"
    if not is_linear and module.num_embeddings == 1:
      return "one-row embedding (a broadcast, no lookup)"
    return unread_parameters_reason(
        module.variables.get("params", {}),
        ("kernel", "bias") if is_linear else ("embedding",))

  def _intercept_packed(self, next_fun, args, kwargs, context) -> Any:
    """The packed path: a region runs on packed tokens, its attention per sequence, every
    other module inside it as it is; an LM head outside it on the real tokens.
    :data:`_NOT_PACKED` for a module packing leaves to :meth:`_intercept`."""
    module = context.module
    if context.method_name != "__call__":
      return _NOT_PACKED
    if self._region_family is not None:
      if model_families.attention_family(module) is self._region_family:
        return model_families.run_attention(
            self._region_family, module, args, kwargs,
            functools.partial(packed_attention, layout=self._layout, method=self.attention))
      if (self._layout.shards is not None and self.embeddings
          and isinstance(module, nn.Embed) and self.skip_reason(module) is None):
        return self._packed_lookup(module, args, kwargs)
      return next_fun(*args, **kwargs)
    family = model_families.region_family(module)
    if family is not None:
      record(self.report.packed, module_path(module))
      self.layers_seen += 1
      self._region_family = self._packed_family = family
      try:
        return model_families.run_region(family, module, next_fun, args, kwargs, self._layout)
      finally:
        self._region_family = None
    if (self._packed_family is not None
        and model_families.reads_first_tokens(self._packed_family, module)):
      bound = model_families.bind_arguments(module, args, kwargs)
      bound.arguments["hidden_states"] = self._checked_column_tokens(
          bound.arguments["hidden_states"], type(module).__name__,
          empty_rows=model_families.scores_a_choice(module))
      return model_families.call_bound(next_fun, bound)
    path = module_path(module)
    # A Dense on every token after a packed region (an LM head; token classification's
    # classifier, QA's qa_outputs) acts row by row: it runs on the packed rows, and a loss
    # that reads its outputs at padding, which packing did not compute, makes its gradients
    # NaN too (scatter_tokens), not only the region's. A model packing does not know (Bart,
    # T5) has no packed region. One that the user's exclude names, or a subclass with its own
    # __call__ (which may read positions), runs as it is: it may not read the region's
    # outputs at all. A head tied to the embeddings (GPT-2's) is a Dense applied through
    # .apply, with no path: row by row all the same.
    if (self._packed_family is not None and isinstance(module, nn.Dense)
        and type(module).__call__ is nn.Dense.__call__ and not self.excluded_by_user(path)):
      (inputs,) = args or (kwargs["inputs"],)
      if jnp.shape(inputs)[:-1] == self._layout.batch_shape:
        record(self.report.packed, path)
        hidden = gather_tokens(inputs, self._layout)
        packed = next_fun(hidden)
        # A loss may read the packed rows, or compute them a few at a time from the head
        # (masked_causal_lm_loss does): the [B, L, V] logits are then never made. A batch
        # split over devices (batch_axes) reads the packed rows whole: chunks would cross
        # the shards. A head split by its vocabulary (fsdp_loss's interceptor, outside this
        # one) gets its split kernel there.
        head = linear_head(module, hidden[0]) if self._layout.shards is None else None
        return remember_packed(scatter_tokens(packed, self._layout), packed, self._layout,
                               head)
    return _NOT_PACKED

  def _checked_column_tokens(self, hidden: jax.Array, reader: str, column: int = 0,
                             empty_rows: bool = False) -> jax.Array:
    host_mask = None if isinstance(self.active_mask, jax.core.Tracer) else self.active_mask
    return checked_column_tokens(hidden, self._layout, host_mask, reader, column, empty_rows)

  def _packed_lookup(self, module: nn.Embed, args, kwargs) -> jax.Array:
    """A region's lookup of the packed tokens, split over devices: every slot kept, so that
    where the shards' rows weigh less than the table, its gradient comes from them gathered
    (:func:`sebp_jax.sebp_embed_lookup`) rather than from the shards' tables summed. Part of
    the packed region, it is not listed apart in the report."""
    (ids,) = args or (kwargs["inputs"],)
    shards = self._layout.shards
    looked_up = sebp_embed_call(module, jnp.reshape(ids, (-1,)), top_n="auto", threshold=0.0,
                                overflow="exact", active_rows=None, row_log=None,
                                batch_axes=shards.axes, mesh=shards.mesh)
    return jnp.reshape(looked_up, (*jnp.shape(ids), looked_up.shape[-1]))

  def _column_checked(self, module: nn.Module, args, kwargs) -> tuple[tuple, dict]:
    """The call's arguments, the input checked (:func:`checked_column_tokens`) where
    ``module`` is a layer that its model's own code gives one column of each row of a packed
    region's outputs (a family's ``column_layers``)."""
    reader = (None if self._packed_family is None
              else model_families.column_layer(self._packed_family, module))
    if reader is None:
      return args, kwargs
    (inputs,) = args or (kwargs["inputs"],)
    return (self._checked_column_tokens(inputs, *reader,
                                        empty_rows=model_families.scores_a_choice(module)),), {}

  def _intercept(self, next_fun, args, kwargs, context) -> Any:
    if self._layout is not None:
      if context.method_name == "__call__":
        args, kwargs = self._column_checked(context.module, args, kwargs)
      out = self._intercept_packed(next_fun, args, kwargs, context)
      if out is not _NOT_PACKED:
        return out
    module = context.module
    is_conv1d = model_families.is_conv1d(module)
    is_linear = is_conv1d or isinstance(module, nn.Dense)
    is_embed = isinstance(module, nn.Embed)
    if context.method_name != "__call__" or not (is_linear or is_embed):
      return next_fun(*args, **kwargs)
    if is_embed and not self.embeddings:
      if not isinstance(module, SEBPEmbed):
        self.report.skipped[module_path(module)] = "embeddings=False"
      return next_fun(*args, **kwargs)
    self.layers_seen += 1
    path = module_path(module)
    reason = self.skip_reason(module)
    if reason:
      if not isinstance(module, (SEBPDense, SEBPEmbed)):  # These run SEBP themselves.
        self.report.skipped[path] = reason
      return next_fun(*args, **kwargs)
    (inputs,) = args or (kwargs["inputs"],)
    parent = module.parent if isinstance(module.parent, nn.Module) else None
    rows = self.rows_to_keep(path, inputs, jnp.ndim(inputs) - (0 if is_embed else 1),
                             layout=model_families.input_layout(parent))
    if isinstance(rows, str):
      self.report.skipped[path] = rows
      return next_fun(*args, **kwargs)
    active_rows, top_n = rows
    options = dict(top_n=top_n, threshold=self.threshold, overflow=self.overflow,
                   active_rows=active_rows, row_log=self.row_log, **self.sharding_options)
    if is_embed:
      record(self.report.embeddings, path)
      out = sebp_embed_call(module, inputs, **options)
    else:
      record(self.report.swapped, path)
      linear_call = sebp_conv1d_call if is_conv1d else sebp_dense_call
      out = linear_call(module, inputs, backend=self.backend, **options)
    return self.shared_output(out, active_rows)
