"""The model families whose attention packing runs per sequence: the transformers Flax models
that ``use_sebp(packed=True)`` runs on real tokens only, and the NNX attention modules that
:class:`sebp_jax.nnx.use_packed_attention` runs on inputs packed by
:func:`sebp_jax.pack_decoder_inputs`.

Each family names a *region*, the module whose call runs packed (its token input gathered into
``[1, C]`` on entry, its outputs scattered back to ``[B, L]`` on exit), and the attention
modules inside it, whose call is replaced by the same projections and
:func:`sebp_jax.packing.packed_attention`. Every other module in the region (Dense, norms,
MLPs, embeddings) runs its own code on the packed rows. Modules are recognised by class name
and by a class module under ``transformers.models.``, so importing this module does not import
transformers.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from sebp_jax.packing import PackedLayout, checked_against, gather_tokens, scatter_tokens


def _refuse(family: str, what: str) -> None:
  raise ValueError(f"use_sebp(packed=True) cannot pack {family} with {what}; use_sebp "
                   "without packed=True runs it")


def _refuse_cache(module: nn.Module, arguments: dict) -> None:
  if arguments.get("init_cache") or module.has_variable("cache", "cached_key"):
    _refuse("a decoder", "a decoding cache (init_cache)")


#: ``(query [.., T, H, d], key, value [.., T, K, d], *, causal, window, dropout_rng,
#: dropout_rate[, broadcast_dropout, alibi_slopes]) -> [.., T, H, d]``: the attention of one
#: layout of tokens, e.g. :func:`sebp_jax.packing.packed_attention` with its layout bound.
AttentionCore = Callable[..., Any]


def _heads(projected, heads: int):
  """``[.., T, heads * d]`` -> ``[.., T, heads, d]``."""
  return projected.reshape(*projected.shape[:-1], heads, projected.shape[-1] // heads)


def _merged(out):
  """``[.., T, H, d]`` -> ``[.., T, H * d]``."""
  return out.reshape(*out.shape[:-2], out.shape[-2] * out.shape[-1])


def _attend(module: nn.Module, attention_core: AttentionCore, arguments: dict, query, key,
            value, *, dropout_rate: float, causal: bool, window: int | None = None, **options):
  """``attention_core`` of ``module``'s q, k, v, with its dropout of the attention
  probabilities (``dropout_rate``) where the module would draw it."""
  if arguments.get("deterministic", True) or dropout_rate == 0.0:
    rng, dropout_rate = None, 0.0
  else:
    rng = module.make_rng("dropout")
  return attention_core(query, key, value, causal=causal, window=window, dropout_rng=rng,
                        dropout_rate=dropout_rate, **options)


def bert_self_attention(module: nn.Module, attention_core: AttentionCore,
                        arguments: dict) -> tuple:
  """A BERT-style self-attention (``FlaxBertSelfAttention`` and its copies) with
  ``attention_core``."""
  if arguments.get("key_value_states") is not None or module.causal:
    _refuse("a BERT-style model", "cross-attention or causal (decoder) attention")
  if arguments.get("init_cache"):
    _refuse("a BERT-style model", "a decoding cache (init_cache)")
  return _encoder_self_attention(module, attention_core, arguments)


def roformer_self_attention(module: nn.Module, attention_core: AttentionCore,
                            arguments: dict) -> tuple:
  """``FlaxRoFormerSelfAttention`` with ``attention_core``: its rotary embeddings (on values
  too with ``rotary_value``) at each token's sinusoidal position, then as BERT's."""
  positions = arguments["sinusoidal_pos"]
  if positions is None:
    return _encoder_self_attention(module, attention_core, arguments)

  def rotate(query, key, value):
    rotated = module.apply_rotary_position_embeddings(
        positions, query, key, value if module.rotary_value else None)
    if not module.rotary_value:
      rotated = (*rotated, value)
    # The table is float32: the model's attention computes in its own dtype all the same.
    return tuple(x.astype(module.dtype) for x in rotated)

  return _encoder_self_attention(module, attention_core, arguments, rotate)


def _encoder_self_attention(module: nn.Module, attention_core: AttentionCore, arguments: dict,
                            rotate: Callable | None = None) -> tuple:
  """An encoder's self-attention: its query, key and value projections (``rotate``d where
  given), ``attention_core`` and the layer's head mask."""
  config = module.config
  hidden = arguments["hidden_states"]
  query, key, value = (_heads(projection(hidden), config.num_attention_heads)
                       for projection in (module.query, module.key, module.value))
  if rotate is not None:
    query, key, value = rotate(query, key, value)
  out = _attend(module, attention_core, arguments, query, key, value,
                dropout_rate=config.attention_probs_dropout_prob, causal=False)
  head_mask = arguments.get("layer_head_mask")
  if head_mask is not None:
    # Scaling a head's probabilities scales its output alike (transformers passes ones).
    out = out * head_mask[:, None].astype(out.dtype)
  return (_merged(out),)


def distilbert_attention(module: nn.Module, attention_core: AttentionCore,
                         arguments: dict) -> tuple:
  """DistilBERT's ``FlaxMultiHeadSelfAttention`` with ``attention_core``: self-attention
  only (its query, key and value the same hidden states)."""
  config = module.config
  hidden = arguments["query"]
  if arguments["key"] is not hidden or arguments["value"] is not hidden:
    _refuse("DistilBERT", "attention whose keys or values are not its queries' tokens")
  query, key, value = (_heads(projection(hidden), config.n_heads)
                       for projection in (module.q_lin, module.k_lin, module.v_lin))
  # nn.Dropout on the probabilities: a mask of its own for every head.
  out = _attend(module, attention_core, arguments, query, key, value,
                dropout_rate=config.attention_dropout, causal=False, broadcast_dropout=False)
  return (module.out_lin(_merged(out)),)


def albert_attention(module: nn.Module, attention_core: AttentionCore, arguments: dict) -> tuple:
  """``FlaxAlbertSelfAttention`` with ``attention_core``: its projections, then its output
  projection, dropout and the residual's LayerNorm, which ALBERT keeps inside the module."""
  config = module.config
  hidden = arguments["hidden_states"]
  query, key, value = (_heads(projection(hidden), config.num_attention_heads)
                       for projection in (module.query, module.key, module.value))
  out = _attend(module, attention_core, arguments, query, key, value,
                dropout_rate=config.attention_probs_dropout_prob, causal=False)
  out = module.dropout(module.dense(_merged(out)), deterministic=arguments["deterministic"])
  return (module.LayerNorm(out + hidden),)


def llama_attention(module: nn.Module, attention_core: AttentionCore, arguments: dict) -> tuple:
  """``FlaxLlamaAttention`` / ``FlaxMistralAttention`` / ``FlaxGemmaAttention`` with
  ``attention_core``: rotary embeddings at each token's own position ids, causal, Mistral's
  sliding window."""
  config = module.config
  _refuse_cache(module, arguments)
  hidden, positions = arguments["hidden_states"], arguments["position_ids"]
  # The module's own head counts: Gemma's head size is its config's, not hidden_size // heads.
  query = _heads(module.q_proj(hidden), module.num_heads)
  key, value = (_heads(projection(hidden), module.num_key_value_heads)
                for projection in (module.k_proj, module.v_proj))
  key, query = module.rotary_emb(key, query, positions)
  # As the model's own causal mask, triu(causal, -(sliding_window or 0)): with no window
  # configured, transformers' Flax Mistral lets each token attend to itself only.
  window = (config.sliding_window or 0) if "Mistral" in type(module).__name__ else None
  out = _attend(module, attention_core, arguments, query, key, value,
                dropout_rate=config.attention_dropout, causal=True, window=window)
  return (module.o_proj(_merged(out)),)


def gpt2_attention(module: nn.Module, attention_core: AttentionCore, arguments: dict) -> tuple:
  """``FlaxGPT2Attention`` with ``attention_core``: its fused q/k/v projection, causal (the
  positions are the embeddings', outside it), its output projection and residual dropout."""
  config = module.config
  if arguments.get("key_value_states") is not None or not module.causal:
    _refuse("GPT-2", "cross-attention")
  _refuse_cache(module, arguments)
  hidden = arguments["hidden_states"]
  query, key, value = (_heads(part, config.num_attention_heads)
                       for part in jnp.split(module.c_attn(hidden), 3, axis=2))
  out = _attend(module, attention_core, arguments, query, key, value,
                dropout_rate=config.attn_pdrop, causal=True)
  out = module.c_proj(_merged(out))
  return (module.resid_dropout(out, deterministic=arguments["deterministic"]),)


def gpt_neo_attention(module: nn.Module, attention_core: AttentionCore,
                      arguments: dict) -> tuple:
  """``FlaxGPTNeoSelfAttention`` with ``attention_core``: causal, its local layers' window,
  queries unscaled (the model multiplies them by sqrt(d) before a core that divides)."""
  config = module.config
  _refuse_cache(module, arguments)
  local = module.attention_type == "local"
  if local and config.window_size < 1:
    _refuse("GPT-Neo", f"window_size={config.window_size} (its local layers attend to no key)")
  hidden = arguments["hidden_states"]
  query = module.q_proj(hidden) * jnp.sqrt(module.head_dim).astype(module.dtype)
  query, key, value = (_heads(projected, module.num_heads)
                       for projected in (query, module.k_proj(hidden), module.v_proj(hidden)))
  # The model's local mask keeps keys fewer than window_size columns back.
  window = config.window_size - 1 if local else None
  out = _attend(module, attention_core, arguments, query, key, value,
                dropout_rate=config.attention_dropout, causal=True, window=window)
  out = module.out_proj(_merged(out))
  return (module.resid_dropout(out, deterministic=arguments["deterministic"]),)


def gptj_attention(module: nn.Module, attention_core: AttentionCore, arguments: dict) -> tuple:
  """``FlaxGPTJAttention`` with ``attention_core``: rotary embeddings (the model's own, on
  its first ``rotary_dim`` features) at each token's position ids, causal."""
  config = module.config
  _refuse_cache(module, arguments)
  gptj = sys.modules[_original_class(module).__module__]
  hidden, positions = arguments["hidden_states"], arguments["position_ids"]
  query, key, value = (_heads(projection(hidden), module.num_heads)
                       for projection in (module.q_proj, module.k_proj, module.v_proj))
  sincos = jnp.split(jnp.take(module.embed_positions, positions, axis=0), 2, axis=-1)
  rotary = module.rotary_dim or query.shape[-1]
  # The rotary table is float32: the model's attention casts q and k back to its dtype.
  query, key = (jnp.concatenate([gptj.apply_rotary_pos_emb(x[..., :rotary], sincos),
                                 x[..., rotary:]], axis=-1).astype(module.dtype)
                for x in (query, key))
  out = _attend(module, attention_core, arguments, query, key, value,
                dropout_rate=config.attn_pdrop, causal=True)
  out = module.out_proj(_merged(out))
  return (module.resid_dropout(out, deterministic=arguments["deterministic"]),)


def bart_style_decoder_attention(module: nn.Module, attention_core: AttentionCore,
                                 arguments: dict) -> tuple:
  """transformers' BART-style attention of a decoder (``FlaxOPTAttention``,
  ``FlaxXGLMAttention``) with ``attention_core``: causal self-attention (the positions are
  the embeddings', outside it); no attention weights (``None`` in their place)."""
  if arguments.get("key_value_states") is not None or not module.causal:
    _refuse("a BART-style decoder", "cross-attention or attention that is not causal")
  _refuse_cache(module, arguments)
  hidden = arguments["hidden_states"]
  query, key, value = (_heads(projection(hidden), module.num_heads)
                       for projection in (module.q_proj, module.k_proj, module.v_proj))
  out = _attend(module, attention_core, arguments, query, key, value,
                dropout_rate=module.dropout, causal=True)
  return module.out_proj(_merged(out)), None


def bloom_attention(module: nn.Module, attention_core: AttentionCore, arguments: dict) -> tuple:
  """``FlaxBloomAttention`` with ``attention_core``: its fused q/k/v projection (each head's
  q, k and v side by side), causal, ALiBi with the model's slopes (the core counts a key's
  rank in its own sequence, as the model's bias built from the mask does), then its output
  projection, residual dropout and residual."""
  config = module.config
  _refuse_cache(module, arguments)
  hidden = arguments["hidden_states"]
  query, key, value = jnp.split(_heads(module.query_key_value(hidden), config.n_head), 3,
                                axis=-1)
  out = _attend(module, attention_core, arguments, query, key, value,
                dropout_rate=config.attention_dropout, causal=True,
                alibi_slopes=_alibi_slopes(_original_class(module).__module__, config.n_head))
  out = module.resid_dropout(module.dense(_merged(out)), deterministic=arguments["deterministic"])
  return (out + arguments["residual"],)


@functools.cache
def _alibi_slopes(model_module: str, heads: int) -> tuple[float, ...]:
  """Each head's ALiBi slope, from the model's own ``build_alibi_tensor`` (a key's bias is
  its slope times its rank: rank 1 of a two-token mask)."""
  with jax.ensure_compile_time_eval():
    alibi = sys.modules[model_module].build_alibi_tensor(jnp.ones((1, 2), jnp.int32), heads,
                                                         jnp.float32)
  return tuple(float(slope) for slope in np.asarray(alibi)[0, :, 0, 1])


@dataclasses.dataclass(frozen=True)
class PackedFamily:
  """One model family: which module runs packed, what it gathers, how its attention runs.

  Attributes:
    name: for messages and the report.
    regions: class names of the modules run on packed tokens.
    tokens_argument: the region's argument gathered on entry (``[B, L]`` ids or ``[B, L, D]``
      hidden states); ``position_ids`` is gathered too where given, ``attention_mask`` becomes
      ones over the capacity (the packed attention ignores it).
    attention_classes: class names of the attention modules inside the region.
    attend: ``(module, attention_core, arguments) -> outputs`` in place of an attention
      module's call: its own projections (and rotary embeddings) around ``attention_core``.
    first_token_heads: class names of the heads that read the region's outputs at each row's
      first column (BERT's [CLS]), their argument ``hidden_states``.
    column_layers: ``("<model class>.<layer name>", column)`` of the layers that a model's own
      code gives one column of each row of the region's outputs (DistilBERT's
      pre-classifier and ALBERT's pooler the first, 0; RoFormer's multiple choice the last,
      -1): their input is checked as a first-token head's is, at that column.
    column_arguments: the region's arguments indexed by column (``[L, ...]``: RoFormer's
      sinusoidal positions), taken at each packed token's column.
  """
  name: str
  regions: tuple[str, ...]
  tokens_argument: str
  attention_classes: tuple[str, ...]
  attend: Callable[[nn.Module, AttentionCore, dict], Any]
  first_token_heads: tuple[str, ...] = ()
  column_layers: tuple[tuple[str, int], ...] = ()
  column_arguments: tuple[str, ...] = ()


_BERT_STYLE = ("Bert", "Roberta", "XLMRoberta", "RobertaPreLayerNorm", "Electra")
FAMILIES = (
    # transformers' copies of BERT's encoder: RoBERTa, XLM-RoBERTa, RoBERTa-PreLayerNorm
    # (its final norm outside the encoder), ELECTRA.
    PackedFamily("BERT-style encoder",
                 tuple(f"Flax{name}Encoder" for name in _BERT_STYLE),
                 "hidden_states", tuple(f"Flax{name}SelfAttention" for name in _BERT_STYLE),
                 bert_self_attention,
                 tuple(f"Flax{name}{head}" for name in _BERT_STYLE
                       for head in ("Pooler", "ClassificationHead", "SequenceSummary"))),
    PackedFamily("DistilBERT encoder", ("FlaxTransformer",), "hidden_states",
                 ("FlaxMultiHeadSelfAttention",), distilbert_attention,
                 column_layers=(
                     ("FlaxDistilBertForSequenceClassificationModule.pre_classifier", 0),
                     ("FlaxDistilBertForMultipleChoiceModule.pre_classifier", 0))),
    PackedFamily("ALBERT encoder", ("FlaxAlbertEncoder",), "hidden_states",
                 ("FlaxAlbertSelfAttention",), albert_attention,
                 column_layers=(("FlaxAlbertModule.pooler", 0),)),
    # Its encoder slices its sinusoidal positions by column: the layers run packed, below it.
    PackedFamily("RoFormer encoder", ("FlaxRoFormerLayerCollection",), "hidden_states",
                 ("FlaxRoFormerSelfAttention",), roformer_self_attention,
                 ("FlaxRoFormerClassificationHead",),
                 column_layers=(("FlaxRoFormerForMultipleChoiceModule.classifier", -1),),
                 column_arguments=("sinusoidal_pos",)),
    PackedFamily("Llama/Mistral/Gemma decoder",
                 ("FlaxLlamaModule", "FlaxMistralModule", "FlaxGemmaModule"), "input_ids",
                 ("FlaxLlamaAttention", "FlaxMistralAttention", "FlaxGemmaAttention"),
                 llama_attention),
    PackedFamily("GPT-2 decoder", ("FlaxGPT2Module",), "input_ids", ("FlaxGPT2Attention",),
                 gpt2_attention),
    PackedFamily("GPT-Neo decoder", ("FlaxGPTNeoModule",), "input_ids",
                 ("FlaxGPTNeoSelfAttention",), gpt_neo_attention),
    PackedFamily("GPT-J decoder", ("FlaxGPTJModule",), "input_ids", ("FlaxGPTJAttention",),
                 gptj_attention),
    PackedFamily("OPT decoder", ("FlaxOPTModule",), "input_ids", ("FlaxOPTAttention",),
                 bart_style_decoder_attention),
    PackedFamily("XGLM decoder", ("FlaxXGLMModule",), "input_ids", ("FlaxXGLMAttention",),
                 bart_style_decoder_attention),
    PackedFamily("Bloom decoder", ("FlaxBloomModule",), "input_ids", ("FlaxBloomAttention",),
                 bloom_attention),
)
#: The packed regions by family, for messages: "DistilBERT encoder: FlaxTransformer; ...".
SUPPORTED = "; ".join(f"{family.name}: {', '.join(family.regions)}" for family in FAMILIES)


def tunix_llama3_attention(module, attention_core: AttentionCore, arguments: dict) -> tuple:
  """Tunix's Llama 3 ``Attention.block`` with ``attention_core``: its projections (and their
  activation sharding), rotary embeddings at the given positions, causal, no cache; the core
  keeps each sequence apart (and the packed inputs' window) in place of ``attn_mask``."""
  if arguments.get("cache") is not None:
    raise ValueError("use_packed_attention cannot run Tunix's Llama 3 with a decoding cache; "
                     "call the model without one")
  llama3 = sys.modules[_original_class(module).__module__]
  hidden, positions = arguments["x"], arguments["segment_pos"]
  sharding = module.shd_config
  query, key, value = (llama3.shard(projection(hidden), sharding.act_btnh)
                       for projection in (module.q_proj, module.k_proj, module.v_proj))
  query = llama3.apply_rope(query, positions, head_dim=module.head_dim)
  key = llama3.apply_rope(key, positions, head_dim=module.head_dim)
  out = attention_core(query, key, value, causal=True, window=None, dropout_rng=None,
                       dropout_rate=0.0)
  return None, llama3.shard(module.o_proj(out), sharding.act_btd)


def _original_class(module) -> type:
  """The model library's class of ``module``, also while a context has swapped it for a
  subclass of its own."""
  return next(c for c in type(module).__mro__ if not c.__module__.startswith("sebp_jax."))


@dataclasses.dataclass(frozen=True)
class NNXAttention:
  """An NNX model library's attention module that packing runs per sequence.

  Attributes:
    name: for messages.
    module: the class's module (``"tunix.models.llama3.model"``).
    class_name: the class's name.
    method: the method replaced (one the class's ``__call__`` reaches, so that the model's
      own remat still wraps it).
    attend: ``(module, attention_core, arguments) -> outputs`` in place of ``method``, its
      arguments bound by name.
    mask_argument: the name of ``method``'s attention-mask argument, which the packed
      attention checks against its layout instead of attending with it.
  """
  name: str
  module: str
  class_name: str
  method: str
  attend: Callable[[Any, AttentionCore, dict], Any]
  mask_argument: str


NNX_ATTENTION = (
    NNXAttention("Tunix Llama 3", "tunix.models.llama3.model", "Attention", "block",
                 tunix_llama3_attention, mask_argument="attn_mask"),
)
NNX_SUPPORTED = ", ".join(f"{a.module}.{a.class_name}" for a in NNX_ATTENTION)


def nnx_attention(module) -> NNXAttention | None:
  """The entry of :data:`NNX_ATTENTION` for ``module`` (its own class, not a subclass with
  the method replaced), or None."""
  cls = type(module)
  return next((a for a in NNX_ATTENTION if cls.__module__ == a.module
               and cls.__name__ == a.class_name), None)


def _from_transformers(module: nn.Module) -> bool:
  return type(module).__module__.startswith("transformers.models.")


#: What a layer's model family says of its rows (``SEBPContext.rows_to_keep``'s ``layout``):
#: ``BATCH_MAJOR``, ``[B, L, ...]`` as the mask's; ``ENCODER_DECODER``, a model whose encoder
#: and decoder see different tokens.
BATCH_MAJOR = "batch_major"
ENCODER_DECODER = "encoder_decoder"


def input_layout(owner: Any) -> str | None:
  """What the model family of ``owner``, the module that holds a layer, says of the layer's
  rows (:data:`BATCH_MAJOR`, :data:`ENCODER_DECODER`), or
  None where it is not known. transformers' Flax models feed every layer ``[B, L, ...]``
  rows, but an encoder-decoder's two stacks see different tokens: a layer is the
  encoder-decoder's where its owner's config says so, where it is part of a cross-attention
  (a module named ``crossattention`` or ``encoder_attn``), or where a module around it has a
  ``decoder`` and a config that says so (T5 hands its stacks configs that do not; its
  encoder-only model keeps an encoder-decoder's config, with no decoder); Tunix's NNX models
  are batch-major (``"BTD,DNH->BTNH"``)."""
  module = type(owner).__module__
  if module.startswith("transformers.models."):
    config = getattr(owner, "config", None)
    if getattr(config, "is_encoder_decoder", False) or (
        getattr(config, "is_decoder", False) and getattr(config, "add_cross_attention", False)):
      return ENCODER_DECODER
    around = owner
    while isinstance(around, nn.Module):
      # A cross-attention's key and value projections run on the encoder's tokens: Flax BERT
      # and GPT-2 (crossattention) and XGLM (encoder_attn) build one from
      # add_cross_attention alone, is_decoder or not.
      if around.name in ("crossattention", "encoder_attn") or (
          getattr(getattr(around, "config", None), "is_encoder_decoder", False)
          and hasattr(around, "decoder")):
        return ENCODER_DECODER
      around = around.parent
    return BATCH_MAJOR
  if module.startswith("tunix.models."):
    return BATCH_MAJOR
  return None


def is_conv1d(module: nn.Module) -> bool:
  """Whether ``module`` is transformers' ``FlaxConv1D`` (GPT-2's linear layer: a Dense whose
  kernel is held transposed, ``[N, D]``), its own class."""
  return _from_transformers(module) and type(module).__name__ == "FlaxConv1D"


def region_family(module: nn.Module) -> PackedFamily | None:
  """The family whose packed region ``module`` is, or None."""
  name = type(module).__name__
  if not _from_transformers(module):
    return None
  return next((family for family in FAMILIES if name in family.regions), None)


def reads_first_tokens(family: PackedFamily, module: nn.Module) -> bool:
  """Whether ``module`` is a head of ``family`` that reads each row's first column."""
  return _from_transformers(module) and type(module).__name__ in family.first_token_heads


def column_layer(family: PackedFamily, module: nn.Module) -> tuple[str, int] | None:
  """``("<model class>.<layer name>", column)`` where ``module`` is one of ``family``'s
  ``column_layers``, which its model's own code gives one column of each row; else None."""
  parent = module.parent
  if not (isinstance(parent, nn.Module) and _from_transformers(parent)):
    return None
  name = f"{type(parent).__name__}.{module.name}"
  return next(((name, column) for layer, column in family.column_layers if layer == name),
              None)


def scores_a_choice(module: nn.Module) -> bool:
  """Whether ``module`` is part of a multiple-choice model (a module of a
  ``...ForMultipleChoiceModule``): each row is a choice, scored in a softmax with the others,
  so a row without real tokens cannot be weighed 0 in the loss."""
  around = module.parent
  while isinstance(around, nn.Module):
    if _from_transformers(around) and type(around).__name__.endswith("ForMultipleChoiceModule"):
      return True
    around = around.parent
  return False


def attention_family(module: nn.Module) -> PackedFamily | None:
  """The family whose attention module ``module`` is, or None."""
  name = type(module).__name__
  if not _from_transformers(module):
    return None
  return next((family for family in FAMILIES if name in family.attention_classes), None)


def run_attention(family: PackedFamily, module: nn.Module, args, kwargs,
                  attention_core: AttentionCore):
  """An attention module's call, its attention computed by ``attention_core``."""
  return family.attend(module, attention_core, bind_arguments(module, args, kwargs).arguments)


def bind_arguments(module: nn.Module, args, kwargs) -> inspect.BoundArguments:
  """The call's arguments by name (``self`` first), defaults filled in."""
  bound = inspect.signature(type(module).__call__).bind(module, *args, **kwargs)
  bound.apply_defaults()
  return bound


def call_bound(next_fun, bound: inspect.BoundArguments):
  return next_fun(*bound.args[1:], **bound.kwargs)


def run_region(family: PackedFamily, module: nn.Module, next_fun, args, kwargs,
               layout: PackedLayout):
  """The region's call on the batch's real tokens, its outputs back in ``[B, L]`` shapes. The
  attention mask it is given must be the layout's (:func:`~sebp_jax.packing.checked_against`);
  none given is all ones, every token attended."""
  bound = bind_arguments(module, args, kwargs)
  arguments = bound.arguments
  if arguments.get("output_attentions"):
    _refuse(family.name, "output_attentions=True (packed attention has no [B, H, L, L] weights)")
  if arguments.get("encoder_hidden_states") is not None:
    _refuse(family.name, "cross-attention (encoder_hidden_states)")
  given = arguments.get("attention_mask")
  if given is None and "attention_mask" in arguments:
    # Called without a mask, the model attends over every token, padding included.
    given = np.ones(layout.batch_shape, np.int32)
  layout = checked_against(layout, given)
  tokens = arguments[family.tokens_argument]
  arguments[family.tokens_argument] = gather_tokens(
      tokens, layout, filler="token" if jnp.issubdtype(tokens.dtype, jnp.integer) else "zero")
  if arguments.get("position_ids") is not None:
    positions = jnp.broadcast_to(arguments["position_ids"], layout.batch_shape)
    arguments["position_ids"] = gather_tokens(positions, layout)
  for name in family.column_arguments:
    if arguments.get(name) is not None:
      if arguments[name].shape[0] < layout.batch_shape[1]:
        raise ValueError(
            f"{family.name}: the model's {name} holds {arguments[name].shape[0]} columns and "
            f"the batch {layout.batch_shape[1]} (longer than max_position_embeddings?)")
      # Filler slots' columns may pass the padded length: clipped, never read.
      arguments[name] = jnp.take(arguments[name], layout.columns, axis=0, mode="clip")
  if "attention_mask" in arguments:
    arguments["attention_mask"] = jnp.ones((1, layout.capacity), jnp.int32)
  return unpack_outputs(call_bound(next_fun, bound), layout)


def unpack_outputs(outputs: Any, layout: PackedLayout) -> Any:
  """:func:`scatter_tokens` on every array of leading shape ``(1, C)`` in a model's outputs:
  tuples, lists and transformers' ``ModelOutput`` (not a registered pytree)."""
  if isinstance(outputs, (tuple, list)):
    return type(outputs)(unpack_outputs(o, layout) for o in outputs)
  if hasattr(outputs, "items"):
    return type(outputs)(**{k: unpack_outputs(v, layout) for k, v in outputs.items()})
  shape = getattr(outputs, "shape", ())
  if tuple(shape[:2]) == (1, layout.capacity) and len(shape) >= 2:
    return scatter_tokens(outputs, layout)
  return outputs
