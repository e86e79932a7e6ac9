"""Model-level benchmark: dense vs SEBP in unmodified transformers Flax BERT, DistilBERT,
RoFormer, Llama, GPT-2, GPT-Neo, OPT, XGLM and Bloom (Linen), and in Tunix's NNX Llama 3
(``--model llama_nnx``, ``sebp_jax.nnx.use_sebp``).

Random weights at real shapes, real sequence lengths (``benchmarks/lengths/``: the token counts
of SST-2 dev and WikiText-2 valid, as carried in ``data/``), bf16 compute. Side by side in one
run, for each mode: forward, backward (forward + backward minus forward) and a whole AdamW
step, timed in ``--rounds`` interleaved rounds (every mode once a round, ``--repeats`` calls
each: the median of the rounds, and the ratios to dense with their spread over the rounds),
and the peak device memory of the compiled step (XLA's memory analysis: arguments + outputs +
temporaries - aliased).

With ``--devices 1,2``, data parallel over that many devices in turn (a mesh axis ``"data"``
of ``Auto`` type; ``--fsdp`` splits the weight matrices too, and the step gathers them whole
at its start, with ``--fsdp layer`` where XLA's partitioner places the gathers, by the
layer that uses them, or with ``--fsdp shard_map`` in :func:`sebp_jax.sharding.fsdp_loss`,
each device running the one-device loss on its rows with every collective written out, its
embedding tables looked up in place where that moves fewer rows and its LM head split by
its vocabulary, with ``shard_map_gathered_head`` the head gathered as the rest, or with
``shard_map_gathered_tables`` the tables too; a comma list of these runs side by side):
every device gets the setup's batch, SEBP selects per shard (``use_sebp(batch_axes="data")``)
at the fullest shard's real tokens, and each record carries the compiled step's collectives,
its weak-scaling efficiency (one device's step time over this one's) and the share of one
device's speedup over dense it keeps. Packing packs each device's rows on that device
(``use_sebp(packed=True, batch_axes="data")``, the fullest shard's capacity). Every device
holds the one-device batch's lengths (``--shard-lengths drawn``: its own, and ``--balance``
evens them); ``--processes 4 --devices 4`` runs one process per GPU (``jax.distributed``) in
place of one process driving all four, measured against the one-device records already in
``--out`` (a ``--devices 1`` run before). Each call is synced before the next (the host's
dispatch timed too) unless ``--calls-per-repeat`` dispatches several back to back, as a
training loop does, and ``--donate`` feeds the step its own results, its params and
optimizer state donated (each record has the host's time a step call takes to return,
``step_dispatch_ms``); ``--stages step`` times the step alone; ``--compiler-option`` passes XLA
options to the runs on several devices, and ``--pgle-runs`` compiles their steps again for
XLA's profile-guided latency estimator.

Modes:
  dense          fixed padding, dense backward
  dense_fast_attention  fixed padding, dense, the attention core replaced by a length-aware
                 fused one (cuDNN flash attention given each sequence's length on NVIDIA
                 GPUs; XLA elsewhere): what a user gets without this library
  sebp_packed    ``use_sebp(packed=True)``: the encoder / decoder stack and the LM head on the
                 real tokens only (capacity: ``token_capacity``, real tokens rounded up to
                 128), the loss's log-softmax on real rows (``masked_causal_lm_loss(capacity=)``;
                 ``head_chunk="auto"``: the head's ``[C, V]`` logits whole unless very large)
  sebp_packed_chunked_head  sebp_packed with the head's logits computed in chunks of rows
                 whatever their size (``head_chunk=head_chunk_rows(V)``)
  sebp_layer     fixed padding, SEBP with per-layer selection (top_n = real tokens of the batch,
                 ``overflow="drop"``: the paper's rule)
  sebp_layer_auto  per-layer selection, ``top_n="auto"``: each layer branches at run time
  sebp_shared    fixed padding, SEBP with one index from the attention mask, top_n = the
                 batch's real tokens, picked on the host (``overflow="nan"``: no branch)
  sebp_exact     the same top_n with ``overflow="exact"`` (the default) and the mask traced:
                 each layer branches at run time between top_n and the dense backward
  sebp_auto      ``top_n="auto"`` (the default), the mask traced: each layer branches at run
                 time between T/16, T/8, T/4, T/2 and the dense backward
  sebp_auto_host ``top_n="auto"`` with the mask known on the host while tracing: the rung
                 that holds the batch is picked then, no branch
  sebp_dense_only  the same, with the embedding lookups left dense (SEBP on Dense layers only)
  sebp_floor     fixed padding, SEBP with a shared index of only 16 rows: the fixed cost of
                 the SEBP path (not a valid gradient; a diagnostic)
  bound          fixed padding, backward with every swapped linear layer's matmuls removed
                 (dX still written as zeros) and the embeddings on SEBP's shared index: no SEBP
                 backward can be faster than this
  sebp_lm_head   sebp_shared with the LM head swapped too (``use_sebp(lm_head=True)``; exact
                 under the masked causal-LM loss; Llama: GPT-2's head, tied, stays dense)
  bound_lm_head  the bound of sebp_lm_head: the LM head's matmuls removed too (Llama)
  longest_<mode> the batch padded only to its longest sequence (rounded up to 64), in <mode>
                 (dense, dense_fast_attention, sebp_shared, sebp_packed)

    python -m benchmarks.model --model bert --out bert.jsonl
    python -m benchmarks.model --model llama --out llama.jsonl
    python -m benchmarks.model --model llama --model llama_nnx --modes dense,sebp_shared,bound
    python -m benchmarks.model --model bert --tiny     # a CPU smoke run at toy sizes
    python -m benchmarks.model --model bert --devices 1,2 --modes dense,sebp_shared,bound

The NNX model runs the modes of :data:`NNX_MODES` in bfloat16 (``sebp_packed``: its inputs
packed by :func:`sebp_jax.pack_decoder_inputs`, no layer swapped). Tunix's Llama
computes in its weights' dtype: ``llama_nnx`` keeps float32 weights and casts them in the loss
(so every gradient of a weight takes one more pass, float32 from bfloat16, that Linen's SEBP
layers do not take: they cast inside the op), ``llama_nnx_bf16`` keeps bfloat16 weights.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import pathlib
import sys
from typing import Any, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

from benchmarks.harness import (append_json_lines, data_parallel_mesh, join_processes,
                                launch_processes, median_ms, non_negative_int,
                                parse_compiler_option, parse_positive_ints, parse_subset,
                                positive_int, profile_guided, read_json_lines, record)
from sebp_jax import balanced_shard_order, model_families, use_sebp
from sebp_jax import nnx as sebp_nnx
from sebp_jax.implementations import implementation_names
from sebp_jax.losses import causal_lm_target_count, head_chunk_rows, masked_causal_lm_loss
from sebp_jax.packing import alibi_bias, fused_attention_implementation, token_capacity
from sebp_jax.sharding import (collective_bytes, collective_counts, fsdp_loss, fsdp_specs,
                               shard_row_counts)

LENGTHS_DIR = pathlib.Path(__file__).parent / "lengths"
LONGEST = "longest_"
#: What a mode's record can time: the loss, its gradient, a whole AdamW step.
STAGES = ("forward", "grad", "step")
FSDP_KINDS = ("start", "layer", "shard_map", "shard_map_gathered_head",
              "shard_map_gathered_tables")
#: sebp_jax.sharding.fsdp_loss; the tables looked up in place for the first two.
PER_DEVICE_FSDP = ("shard_map", "shard_map_gathered_head", "shard_map_gathered_tables")
MODES = ("dense", "dense_fast_attention", "sebp_layer", "sebp_layer_auto", "sebp_shared",
         "sebp_exact", "sebp_auto", "sebp_auto_host", "sebp_dense_only",
         "sebp_floor", "bound", "sebp_lm_head", "bound_lm_head", "sebp_packed",
         "sebp_packed_chunked_head",
         *(LONGEST + m for m in ("dense", "dense_fast_attention", "sebp_shared", "sebp_packed")))
#: Modes that need a language-model head.
LM_HEAD_MODES = ("sebp_lm_head", "bound_lm_head", "sebp_packed_chunked_head")
#: Modes that pack the batch's real tokens.
PACKED_MODES = ("sebp_packed", "sebp_packed_chunked_head")
#: The modes of the NNX model.
NNX_MODES = ("dense", "sebp_layer", "sebp_layer_auto", "sebp_shared", "sebp_exact", "sebp_auto",
             "sebp_auto_host", "sebp_floor", "bound", "sebp_packed")
FLOOR_ROWS = 16


@dataclasses.dataclass(frozen=True)
class Setup:
  """One model at benchmark shapes: how to build it and which lengths its batches have."""
  name: str
  batch_size: int
  length: int
  lengths_file: str
  has_lm_head: bool
  #: A sequence classifier (its loss over the rows' labels), not a causal LM.
  classifier: bool = False
  #: The LM head is the token embeddings' (applied through .apply, no path): never swapped.
  tied_lm_head: bool = False
  nnx: bool = False
  #: The NNX model's weights: float32 (cast to bfloat16 in the loss) or bfloat16.
  param_dtype: Any = jnp.float32


SETUPS = {
    "bert": Setup("bert-base (BertConfig(), classification head)", 32, 512,
                  "sst2_dev_bert_wordpiece.json", has_lm_head=False, classifier=True),
    "distilbert": Setup("distilbert-base (DistilBertConfig(), classification head)", 32, 512,
                        "sst2_dev_bert_wordpiece.json", has_lm_head=False, classifier=True),
    "roformer": Setup("roformer-base shapes (RoFormerConfig(), classification head)", 32, 512,
                      "sst2_dev_bert_wordpiece.json", has_lm_head=False, classifier=True),
    "albert": Setup("albert-base-v2 shapes (one layer's weights shared by 12; classification "
                    "head)", 32, 512, "sst2_dev_bert_wordpiece.json", has_lm_head=False,
                    classifier=True),
    "llama": Setup("Llama-3.2-1B shapes", 4, 1024, "wikitext2_valid_smollm2_bpe.json",
                   has_lm_head=True),
    # The paper's larger model.
    "llama_3b": Setup("Llama-3.2-3B shapes", 4, 1024, "wikitext2_valid_smollm2_bpe.json",
                      has_lm_head=True),
    # Long context: WikiText-2 sections (mean about 500 tokens, a tail past 2,000), about
    # 8k real tokens a batch.
    "llama_long": Setup("Llama-3.2-1B shapes, long context (WikiText-2 sections)", 16, 2560,
                        "wikitext2_valid_sections_smollm2_bpe.json", has_lm_head=True),
    # Byte-level BPE as SmolLM2's: WikiText-2 paragraphs of about the same token counts.
    "gpt2": Setup("GPT-2 small shapes (GPT2Config(), LM head tied to the embeddings)", 8, 1024,
                  "wikitext2_valid_smollm2_bpe.json", has_lm_head=True, tied_lm_head=True),
    "gpt_neo": Setup("GPT-Neo 125M shapes (global and local layers, window 256; tied head)", 8,
                     1024, "wikitext2_valid_smollm2_bpe.json", has_lm_head=True,
                     tied_lm_head=True),
    "opt": Setup("OPT-1.3B shapes (LM head tied to the embeddings)", 4, 1024,
                 "wikitext2_valid_smollm2_bpe.json", has_lm_head=True, tied_lm_head=True),
    "xglm": Setup("XGLM-564M shapes (XGLMConfig(), LM head tied to the embeddings)", 8, 1024,
                  "wikitext2_valid_smollm2_bpe.json", has_lm_head=True, tied_lm_head=True),
    "bloom": Setup("Bloom-560m shapes (ALiBi; LM head tied to the embeddings)", 8, 1024,
                   "wikitext2_valid_smollm2_bpe.json", has_lm_head=True, tied_lm_head=True),
    # Tied embeddings: the LM head is the embedding's decode, a plain matmul.
    "llama_nnx": Setup("Llama-3.2-1B shapes, Tunix NNX Llama 3", 4, 1024,
                       "wikitext2_valid_smollm2_bpe.json", has_lm_head=False, nnx=True),
    "llama_nnx_bf16": Setup("Llama-3.2-1B shapes, Tunix NNX Llama 3, bfloat16 weights", 4,
                            1024, "wikitext2_valid_smollm2_bpe.json", has_lm_head=False,
                            nnx=True, param_dtype=jnp.bfloat16),
}


def setup_for(kind: str, tiny: bool, batch_size: int | None = None) -> Setup:
  """The benchmark shapes of ``kind``; toy batch shapes with ``tiny``; ``batch_size`` in place
  of the setup's."""
  setup = SETUPS[kind]
  if tiny:
    setup = dataclasses.replace(setup, batch_size=4, length=64)
  return dataclasses.replace(setup, batch_size=batch_size) if batch_size else setup


@dataclasses.dataclass(frozen=True)
class NNXModel:
  """An NNX model split for ``jax.jit``: its ``params`` apart from the rest of its state."""
  graphdef: Any
  params: Any
  rest: Any
  config: Any

  def merge(self, params, dtype) -> nnx.Module:
    return nnx.merge(self.graphdef, jax.tree.map(lambda p: p.astype(dtype), params), self.rest)


def build_nnx_llama(tiny: bool, param_dtype) -> NNXModel:
  """Tunix's NNX Llama 3 with random ``param_dtype`` weights (normal, std 0.02: Tunix
  initialises its MLP kernels to zero) at Llama-3.2-1B shapes, or toy ones with ``tiny``."""
  from examples.pretrained import tunix_llama3
  llama3 = tunix_llama3()
  config = llama3.ModelConfig.llama3p2_1b()
  if tiny:
    config = dataclasses.replace(config, num_layers=2, vocab_size=1000, embed_dim=64,
                                 hidden_dim=128, num_heads=4, head_dim=16, num_kv_heads=2)

  abstract = nnx.eval_shape(lambda: llama3.Llama3(config, rngs=nnx.Rngs(0)))
  graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)
  if jax.tree.leaves(rest):
    raise ValueError("expected a Llama 3 whose only state is its params")
  shapes, treedef = jax.tree.flatten(abstract_params)

  @jax.jit
  def init(key):
    keys = jax.random.split(key, len(shapes))
    return [0.02 * jax.random.normal(k, p.shape, param_dtype) for k, p in zip(keys, shapes)]

  params = jax.tree.unflatten(treedef, init(jax.random.key(0)))
  return NNXModel(graphdef, params, rest, config)


def build_model(kind: str, tiny: bool, dtype):
  """transformers Flax model with random weights: real shapes, or toy ones with ``tiny``."""
  from transformers import (AlbertConfig, BertConfig, BloomConfig, DistilBertConfig,
                            FlaxAlbertForSequenceClassification,
                            FlaxBertForSequenceClassification, FlaxBloomForCausalLM,
                            FlaxDistilBertForSequenceClassification, FlaxGPT2LMHeadModel,
                            FlaxGPTNeoForCausalLM, FlaxLlamaForCausalLM, FlaxOPTForCausalLM,
                            FlaxRoFormerForSequenceClassification, FlaxXGLMForCausalLM,
                            GPT2Config, GPTNeoConfig, LlamaConfig, OPTConfig, RoFormerConfig,
                            XGLMConfig)
  if SETUPS[kind].nnx:
    return build_nnx_llama(tiny, SETUPS[kind].param_dtype)
  if kind == "distilbert":
    config = (DistilBertConfig(num_labels=2, dim=64, n_layers=2, n_heads=2, hidden_dim=128)
              if tiny else DistilBertConfig(num_labels=2))
    return FlaxDistilBertForSequenceClassification(config, seed=0, dtype=dtype)
  if kind == "albert":
    config = (AlbertConfig(num_labels=2, embedding_size=32, hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=128)
              if tiny else AlbertConfig(num_labels=2, hidden_size=768, num_attention_heads=12,
                                        intermediate_size=3072))
    return FlaxAlbertForSequenceClassification(config, seed=0, dtype=dtype)
  if kind == "gpt2":
    config = (GPT2Config(vocab_size=1000, n_positions=128, n_embd=64, n_layer=2, n_head=4)
              if tiny else GPT2Config())
    return FlaxGPT2LMHeadModel(config, seed=0, dtype=dtype)
  if kind == "gpt_neo":
    config = (GPTNeoConfig(vocab_size=1000, max_position_embeddings=128, hidden_size=64,
                           num_layers=2, attention_types=[[["global", "local"], 1]],
                           num_heads=4, window_size=16)
              if tiny else GPTNeoConfig(hidden_size=768, num_layers=12, num_heads=12,
                                        attention_types=[[["global", "local"], 6]]))
    return FlaxGPTNeoForCausalLM(config, seed=0, dtype=dtype)
  if kind == "opt":
    config = (OPTConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                        num_attention_heads=4, max_position_embeddings=128,
                        word_embed_proj_dim=64)
              if tiny else OPTConfig(hidden_size=2048, num_hidden_layers=24, ffn_dim=8192,
                                     num_attention_heads=32, word_embed_proj_dim=2048,
                                     max_position_embeddings=2048))
    return FlaxOPTForCausalLM(config, seed=0, dtype=dtype)
  if kind == "roformer":
    config = (RoFormerConfig(num_labels=2, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=2, intermediate_size=128)
              if tiny else RoFormerConfig(num_labels=2))
    return FlaxRoFormerForSequenceClassification(config, seed=0, dtype=dtype)
  if kind == "xglm":
    config = (XGLMConfig(vocab_size=1000, max_position_embeddings=128, d_model=64, ffn_dim=128,
                         num_layers=2, attention_heads=4)
              if tiny else XGLMConfig())
    return FlaxXGLMForCausalLM(config, seed=0, dtype=dtype)
  if kind == "bloom":
    config = (BloomConfig(vocab_size=1000, hidden_size=64, n_layer=2, n_head=4)
              if tiny else BloomConfig(vocab_size=250880, hidden_size=1024, n_layer=24,
                                       n_head=16))
    return FlaxBloomForCausalLM(config, seed=0, dtype=dtype)
  if kind == "bert":
    config = BertConfig(num_labels=2)
    if tiny:
      config = BertConfig(num_labels=2, hidden_size=64, num_hidden_layers=2,
                          num_attention_heads=2, intermediate_size=128)
    return FlaxBertForSequenceClassification(config, seed=0, dtype=dtype)
  wide = kind == "llama_3b"
  config = LlamaConfig(hidden_size=3072 if wide else 2048,
                       num_hidden_layers=28 if wide else 16,
                       num_attention_heads=24 if wide else 32, num_key_value_heads=8,
                       intermediate_size=8192, vocab_size=128256,
                       max_position_embeddings=SETUPS[kind].length, rope_theta=500000.0,
                       tie_word_embeddings=True)
  if tiny:
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, vocab_size=1000,
                         max_position_embeddings=128)
  return FlaxLlamaForCausalLM(config, seed=0, dtype=dtype)


def make_batch(kind: str, model, setup: Setup, seed: int, shards: int = 1,
               shard_lengths: str = "drawn") -> dict[str, np.ndarray]:
  """Random tokens with real lengths (drawn from the lengths file), right-padded to the length;
  with ``shards``, one such batch per shard (seeds ``seed``, ``seed + 1``, ...), stacked, so
  that the first shard's is the one-device batch. ``shard_lengths``: each shard's lengths
  drawn anew (``"drawn"``), or the first shard's on every shard, each with tokens of its own
  (``"same"``: every device holds as many real tokens as the one-device batch)."""
  if shard_lengths not in ("drawn", "same"):
    raise ValueError(f"shard_lengths must be 'drawn' or 'same', got {shard_lengths!r}")
  first = _random_batch(kind, model, setup, seed)
  lengths = first["attention_mask"].sum(axis=1) if shard_lengths == "same" else None
  parts = [first] + [_random_batch(kind, model, setup, seed + shard, lengths)
                     for shard in range(1, shards)]
  return {key: np.concatenate([part[key] for part in parts]) for key in first}


def _random_batch(kind: str, model, setup: Setup, seed: int, lengths=None):
  rng = np.random.default_rng(seed)
  if lengths is None:
    drawn = np.asarray(json.loads((LENGTHS_DIR / setup.lengths_file).read_text())["lengths"])
    lengths = np.minimum(rng.choice(drawn, setup.batch_size), setup.length)
  mask = (np.arange(setup.length)[None] < lengths[:, None]).astype(np.int32)
  ids = rng.integers(5, model.config.vocab_size, size=mask.shape).astype(np.int32) * mask
  batch = {"input_ids": ids, "attention_mask": mask}
  if setup.classifier:
    batch["labels"] = rng.integers(0, 2, size=setup.batch_size).astype(np.int32)
  return batch


def balanced_batch(batch: dict[str, np.ndarray], shards: int) -> dict[str, np.ndarray]:
  """``batch`` with its rows reordered so that each of ``shards`` blocks holds about equal
  real tokens (:func:`sebp_jax.balanced_shard_order`)."""
  order = balanced_shard_order(batch["attention_mask"].sum(axis=1), shards)
  return {key: value[order] for key, value in batch.items()}


def cut_to_longest(batch: dict[str, np.ndarray], multiple: int = 64) -> dict[str, np.ndarray]:
  """The batch padded only to its longest sequence, rounded up to ``multiple``."""
  length = min(batch["attention_mask"].shape[1],
               -(-int(batch["attention_mask"].sum(1).max()) // multiple) * multiple)
  return {k: (v[:, :length] if v.ndim == 2 else v) for k, v in batch.items()}


@jax.custom_vjp
def _without_backward_matmuls(x, y):
  return y


def _fwd(x, y):
  return y, x


def _bwd(x, dy):
  # dX is still written; no dY @ W.T, no X.T @ dY. dX must read dY (one cheap reduction) and
  # not be a known zero: otherwise XLA removes, as dead or zero, the work that produces dY
  # (e.g. the whole attention backward behind q/k/v) and the bound drops far too low.
  touched = (jnp.sum(dy, dtype=jnp.float32) * 0).astype(x.dtype)
  return lax.optimization_barrier(jnp.zeros_like(x)) + touched, jnp.zeros_like(dy)


_without_backward_matmuls.defvjp(_fwd, _bwd)


@contextlib.contextmanager
def linear_backward_removed(lm_head: bool):
  """The lower bound: the layers ``use_sebp(lm_head=lm_head)`` would swap keep their forward
  but their backward does no matmul (their params get no gradient)."""
  # Never entered: it only answers which layers it would swap.
  selection = use_sebp(top_n=1, lm_head=lm_head)

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if (context.method_name == "__call__"
        and (isinstance(module, nn.Dense) or model_families.is_conv1d(module))
        and selection.skip_reason(module) is None):
      y = jax.lax.stop_gradient(next_fun(*args, **kwargs))
      return _without_backward_matmuls(args[0], y)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield


@contextlib.contextmanager
def length_aware_attention(lengths):
  """Every attention module of a supported transformers family computes its attention with
  ``jax.nn.dot_product_attention`` given each sequence's length (right padding), fused
  where :func:`~sebp_jax.packing.fused_attention_implementation` says it runs; ALiBi's bias
  counts columns, each row's real tokens first."""
  # broadcast_dropout only as the families pass it: this baseline has no dropout.
  def attention_core(query, key, value, *, causal, window, dropout_rng, dropout_rate,
                     broadcast_dropout=True, alibi_slopes=None):
    if dropout_rate:
      raise NotImplementedError("no dropout in this baseline")
    length = query.shape[1]
    return jax.nn.dot_product_attention(
        query, key, value, bias=alibi_bias(alibi_slopes, jnp.arange(length), query, length),
        is_causal=causal, query_seq_lengths=lengths,
        key_value_seq_lengths=lengths,
        local_window_size=None if window is None else (window, 0),
        implementation=fused_attention_implementation(query))

  def interceptor(next_fun, args, kwargs, context):
    family = model_families.attention_family(context.module)
    if context.method_name == "__call__" and family is not None:
      return model_families.run_attention(family, context.module, args, kwargs, attention_core)
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(interceptor):
    yield


class NNXBound(sebp_nnx.use_sebp):
  """The NNX lower bound: the layers ``sebp_jax.nnx.use_sebp`` swaps keep their forward but
  their backward does no matmul (as :func:`linear_backward_removed`); embeddings as SEBP runs
  them."""

  def run_layer(self, module, swap, inputs):
    if swap.kind == "embed":
      return super().run_layer(module, swap, inputs)
    y = jax.lax.stop_gradient(sebp_nnx.dense_forward(module, inputs))
    return _without_backward_matmuls(inputs, y)


def sebp_options(mode: str, mask, top_n: int, backend: str, host_mask,
                 sharding: dict) -> dict | None:
  """The ``use_sebp`` options of an SEBP mode, Linen and NNX alike (with ``sharding``: the
  batch axes and mesh of a data-parallel run); None for other modes."""
  options = _mode_options(mode, mask, top_n, backend, host_mask)
  return None if options is None else {**options, **sharding}


def _mode_options(mode: str, mask, top_n: int, backend: str, host_mask) -> dict | None:
  if mode in ("sebp_shared", "sebp_floor", "sebp_dense_only", "sebp_lm_head"):
    return dict(top_n=FLOOR_ROWS if mode == "sebp_floor" else top_n, overflow="nan",
                backend=backend, active_mask=mask, embeddings=mode != "sebp_dense_only",
                lm_head=mode == "sebp_lm_head")
  if mode == "sebp_exact":
    return dict(top_n=top_n, backend=backend, active_mask=mask)
  if mode in ("sebp_auto", "sebp_auto_host"):
    return dict(backend=backend, active_mask=host_mask if mode == "sebp_auto_host" else mask)
  if mode == "sebp_layer":
    return dict(top_n=top_n, overflow="drop", backend=backend)
  if mode == "sebp_layer_auto":
    return dict(backend=backend)
  return None


def make_loss(kind: str, model, mode: str, top_n: int, backend: str,
              capacity: int | None = None, host_mask: np.ndarray | None = None,
              sharding: dict | None = None):
  """The loss of ``mode``; ``top_n`` (real tokens, of the fullest shard) for SEBP,
  ``capacity`` (at least the real tokens) for packing, ``host_mask`` (the batch's mask as a
  host array) for ``sebp_auto_host``, ``sharding`` (``batch_axes`` and ``mesh``) for a batch
  split over devices."""
  mode = mode.removeprefix(LONGEST)
  sharding = sharding or {}
  num_shards = sharding["mesh"].size if sharding else 1
  if SETUPS[kind].nnx:
    return make_nnx_loss(model, mode, top_n, backend, host_mask, sharding, capacity)

  def context(batch):
    mask = batch["attention_mask"]
    options = sebp_options(mode, mask, top_n, backend, host_mask, sharding)
    if options is not None:
      return use_sebp(**options)
    if mode in PACKED_MODES:
      return use_sebp(top_n=capacity, backend=backend, active_mask=mask, packed=True,
                      **sharding)
    if mode == "dense_fast_attention":
      return length_aware_attention(jnp.sum(mask, axis=1, dtype=jnp.int32))
    if mode in ("bound", "bound_lm_head"):
      stack = contextlib.ExitStack()
      stack.enter_context(linear_backward_removed(lm_head=mode == "bound_lm_head"))
      # The embeddings as SEBP runs them (no Dense layer matches the include pattern).
      stack.enter_context(use_sebp(top_n=top_n, overflow="nan", active_mask=mask,
                                   include=r"(?!)", require_swaps=False, **sharding))
      return stack
    return contextlib.nullcontext()

  def loss_fn(params, batch):
    with context(batch):
      logits = model(batch["input_ids"], attention_mask=batch["attention_mask"],
                     params=params).logits
    if SETUPS[kind].classifier:
      return optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), batch["labels"]).mean()
    return masked_causal_lm_loss(
        logits, batch["input_ids"], batch["attention_mask"],
        capacity=capacity * num_shards if mode in PACKED_MODES else None,
        head_chunk=(head_chunk_rows(model.config.vocab_size)
                    if mode == "sebp_packed_chunked_head" else "auto"))
  return loss_fn


def make_nnx_loss(model: NNXModel, mode: str, top_n: int, backend: str, host_mask,
                  sharding: dict, capacity: int | None = None):
  """The loss of ``mode`` (one of :data:`NNX_MODES`) of the NNX Llama, a function of its
  params, computed in bfloat16; ``sebp_packed`` runs it on the real tokens packed into
  ``capacity`` slots (:func:`sebp_jax.pack_decoder_inputs`: Tunix's Llama takes its positions
  and attention mask as inputs)."""
  from examples.pretrained import tunix_logits

  def loss_fn(params, batch):
    module = model.merge(params, jnp.bfloat16)
    mask = batch["attention_mask"]
    options = sebp_options(mode, mask, top_n, backend, host_mask, sharding)
    if mode == "bound":
      context = NNXBound(module, top_n=top_n, overflow="nan", active_mask=mask,
                         require_swaps=False, **sharding)
    elif options is not None:
      context = sebp_nnx.use_sebp(module, **options)
    else:
      context = contextlib.nullcontext()
    packed = capacity if mode == "sebp_packed" else None
    with context:
      logits = tunix_logits(module, batch["input_ids"], mask, capacity=packed,
                            **(sharding if packed else {}))
    num_shards = sharding["mesh"].size if sharding else 1
    return masked_causal_lm_loss(logits, batch["input_ids"], mask,
                                 capacity=packed and packed * num_shards)
  return loss_fn


def split_mode(mode: str, backend: str) -> tuple[str, str]:
  """``(mode, backend)`` of a mode name, ``MODE`` or ``MODE@BACKEND`` (the SEBP backend of
  this mode alone, in place of ``backend``)."""
  name, _, own_backend = mode.partition("@")
  return name, own_backend or backend


def parse_modes(text: str) -> list[str]:
  """A comma list of distinct modes, each out of :data:`MODES`, optionally ``@BACKEND``."""
  backends = ("auto", *implementation_names())
  modes = [mode for mode in text.split(",") if mode]
  for mode in modes:
    name, backend = split_mode(mode, "auto")
    if name not in MODES or backend not in backends:
      raise argparse.ArgumentTypeError(
          f"{mode!r}: expected a mode out of {','.join(MODES)}, optionally @BACKEND with "
          f"BACKEND out of {','.join(backends)}")
  return parse_subset(text, choices=modes)


def mode_loss(kind: str, model, mode: str, batch: dict[str, np.ndarray], top_n: int,
              backend: str, sharding: dict | None = None, packed_capacity: int | None = None,
              num_shards: int | None = None):
  """``(batch, loss)`` of ``mode`` as the benchmark runs it: the host batch cut to its longest
  row for the ``longest_*`` modes, the loss with the capacity and host mask of that batch
  (``packed_capacity``: that capacity instead, where it holds the batch's real tokens, as
  one compile for every batch of a run would). ``MODE@BACKEND`` runs ``MODE`` with that SEBP
  backend in place of ``backend``. ``num_shards``: the devices the batch is split over, each
  packing into the fullest one's capacity (default: the size of ``sharding``'s mesh, else
  1)."""
  mode, backend = split_mode(mode, backend)
  host_batch = cut_to_longest(batch) if mode.startswith(LONGEST) else batch
  mask = host_batch["attention_mask"]
  if num_shards is None:
    num_shards = sharding["mesh"].size if sharding else 1
  capacity = packed_slots(mask, packed_capacity, num_shards)
  return host_batch, make_loss(kind, model, mode, top_n, backend, capacity, host_mask=mask,
                               sharding=sharding)


def packed_slots(mask: np.ndarray, packed_capacity: int | None, num_shards: int) -> int:
  """The capacity a packed mode runs a device's rows of ``mask`` at: theirs
  (:func:`token_capacity`), or ``packed_capacity`` where larger, at most their tokens."""
  return min(max(token_capacity(mask, num_shards=num_shards), packed_capacity or 0),
             mask.size // num_shards)


def loss_weight(kind: str):
  """What ``kind``'s loss averages over on a batch: its sentences (the classifiers), its predicted
  tokens (the causal LMs)."""
  if SETUPS[kind].classifier:
    return None
  return lambda batch: causal_lm_target_count(batch["attention_mask"])


def peak_bytes(compiled) -> int | None:
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
             + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)


def param_shardings(params, mesh, fsdp: str | None):
  """Replicated params (data parallel), or with ``fsdp`` as :func:`sebp_jax.sharding.fsdp_specs`
  splits them: each matrix along its first dimension over ``"data"`` where the devices divide
  it, and with ``fsdp="shard_map"`` an LM head's kernel by its columns, the vocabulary
  (``fsdp_loss`` computes the head's logits on each device's columns)."""
  if not fsdp:
    return jax.tree.map(lambda _: NamedSharding(mesh, P()), params)
  specs = fsdp_specs(params, mesh, heads=("lm_head",) if fsdp == "shard_map" else ())
  return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)


def gathering_params(loss_fn, mesh, specs, dtype=jnp.bfloat16):
  """``loss_fn`` of params split FSDP-style (those whose ``specs`` leaf is ``P("data")``),
  gathering them whole as its first step: the
  weights, not the activations, move between devices, and the activations stay on the
  batch's split (left to itself, XLA may split them along the weights' features instead).
  Each split matrix is cast to ``dtype`` (the compute dtype it is cast to anyway) on its own
  shard and gathered in it, inside a ``shard_map`` so that XLA cannot move the cast after the
  gather; its gradient comes back the same way, a sum over the devices split again (a
  reduce-scatter in ``dtype``). Every weight stays whole through the step (unlike ZeRO-3,
  which gathers layer by layer)."""
  def gather(param, spec):
    if spec != P("data"):
      return param
    return jax.shard_map(lambda shard: lax.all_gather(shard.astype(dtype), "data", tiled=True,
                                                       to="invarying"),
                         mesh=mesh, in_specs=P("data"), out_specs=P())(param)

  def loss(params, batch):
    return loss_fn(jax.tree.map(gather, params, specs), batch)
  return loss


@dataclasses.dataclass
class DonatedStep:
  """A compiled step that donates its params and optimizer state and is fed its own results,
  as a training loop runs it: each call writes them where the last call's were. Called with
  the batch alone; it keeps a copy of the state it starts from, since a call deletes what it
  is given."""
  compiled: jax.stages.Compiled
  state: tuple

  @classmethod
  def start(cls, compiled, params, opt_state) -> "DonatedStep":
    return cls(compiled, jax.tree.map(jnp.copy, (params, opt_state)))

  def __call__(self, batch):
    self.state = self.compiled(*self.state, batch)
    return self.state


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a benchmark's step runs: one device, or data parallel over a mesh (params
  replicated, or split FSDP-style), with the AdamW state placed like the params."""
  params: Any
  opt_state: Any
  optimizer: Any
  mesh: jax.sharding.Mesh | None
  fsdp: str | None

  @classmethod
  def make(cls, params, devices: int, fsdp: str | None) -> "Placement":
    optimizer = optax.adamw(1e-5)
    mesh = data_parallel_mesh(devices)
    if mesh is not None:
      params = jax.device_put(params, param_shardings(params, mesh, fsdp))
    # The moments placed like the params, the step count replicated.
    opt_shardings = None if mesh is None else param_shardings(
        jax.eval_shape(optimizer.init, params), mesh, fsdp)
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    return cls(params, opt_state, optimizer, mesh, fsdp)

  @property
  def sebp_sharding(self) -> dict:
    """``use_sebp``'s arguments for the batch's split: none on one device, nor where each
    device runs the one-device loss on its own rows (``fsdp="shard_map"``)."""
    if self.mesh is None or self.fsdp in PER_DEVICE_FSDP:
      return {}
    return dict(batch_axes="data", mesh=self.mesh)

  def calls(self, loss_fn, host_batch, stages=STAGES, compiler_options=None,
            weight_fn=None, pgle_runs: int = 0, donate: bool = False) -> dict:
    """{stage: (jitted function, its arguments)} for ``stages`` of ``loss_fn`` on
    ``host_batch``, the batch split over the mesh; the step's function compiled (with
    ``pgle_runs``, for XLA's profile-guided latency estimator: :func:`profile_guided`), a
    :class:`DonatedStep` with ``donate``. ``weight_fn``: what the loss averages over on a
    batch (``fsdp_loss``'s)."""
    if donate and pgle_runs:
      raise ValueError("donate runs the step on its own results; pgle_runs would delete the "
                       "shared params: pass one of them")
    batch = host_batch
    if self.mesh is not None:
      batch = jax.device_put(host_batch, NamedSharding(self.mesh, P("data")))
      specs = lambda: jax.tree.map(lambda sharding: sharding.spec,
                                   param_shardings(self.params, self.mesh, self.fsdp))
      if self.fsdp == "start":
        loss_fn = gathering_params(loss_fn, self.mesh, specs())
      elif self.fsdp in PER_DEVICE_FSDP:
        loss_fn = fsdp_loss(loss_fn, self.mesh, specs(), weight_fn=weight_fn,
                            gather_dtype=jnp.bfloat16,
                            lookups_in_place=("auto" if self.fsdp in PER_DEVICE_FSDP[:2]
                                              else False))
    optimizer = self.optimizer

    def step(params, opt_state, batch):
      grads = jax.grad(loss_fn)(params, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    jit = functools.partial(jax.jit, compiler_options=compiler_options or None)
    calls = {"forward": (jit(loss_fn), (self.params, batch)),
             "grad": (jit(jax.grad(loss_fn)), (self.params, batch))}
    calls = {stage: call for stage, call in calls.items() if stage in stages}
    if "step" in stages:
      out_shardings = None if self.mesh is None else jax.tree.map(
          lambda a: a.sharding, (self.params, self.opt_state))
      arguments = (self.params, self.opt_state, batch)
      lowered = jit(step, out_shardings=out_shardings,
                    donate_argnums=(0, 1) if donate else ()).lower(*arguments)
      compiled_step = (profile_guided(lowered, arguments, pgle_runs) if pgle_runs
                       else lowered.compile())
      calls["step"] = ((DonatedStep.start(compiled_step, self.params, self.opt_state), (batch,))
                       if donate else (compiled_step, arguments))
    return calls


def run(kind: str, modes, repeats: int, tiny: bool, seed: int, backend: str, out=None,
        devices: int = 1, fsdp: str | Sequence[str] | None = None, baseline=(),
        rounds: int = 1,
        batch_size: int | None = None, balance: bool = False, shard_lengths: str = "same",
        stages=STAGES, compiler_options=None, calls_per_repeat: int = 1,
        packed_capacity: int | None = None, pgle_runs: int = 0, donate: bool = False):
  """Compiles every mode, then times them in ``rounds`` interleaved rounds (each round times
  every mode's forward, gradient and step once, ``repeats`` calls each, so that a change in
  the machine's load falls on all modes alike), and appends one record per mode to ``out``:
  each time the median of its rounds, the rounds themselves (``rounds_ms``), and the ratios
  to dense as the median of the rounds' ratios with their smallest and largest
  (``*_vs_dense_range``). A mode that runs out of memory is recorded as such and left out.

  With ``devices > 1``, data parallel: each device gets the setup's batch (``devices`` times
  the batch in all), SEBP selects per shard, params are replicated (split FSDP-style with
  ``fsdp``; several kinds of FSDP run side by side, each mode under each, interleaved in the
  rounds as the modes are, each compared with dense under the same kind, every kind's params
  and optimizer state on the devices at once); the last record of
  ``baseline`` (one device, same model, mode and batch size)
  gives the weak-scaling efficiency, one device's step time over this one's, and the share
  of one device's speedup over dense that this run keeps. ``batch_size``: in place of the
  setup's (per device). ``shard_lengths``: every device's rows with the one-device batch's
  lengths (``"same"``: weak scaling at equal work) or lengths drawn for each (``"drawn"``);
  ``balance``: the drawn batch's rows reordered so that the devices hold about equal real
  tokens (:func:`sebp_jax.balanced_shard_order`). ``stages``: which of forward, grad and step
  to time (the step always compiles: its memory and collectives are recorded).
  ``compiler_options``: XLA options every call on several devices compiles with (such as
  ``{"xla_gpu_enable_latency_hiding_scheduler": True}``). ``calls_per_repeat``: calls
  dispatched back to back before one sync, so that the host's dispatch of a call overlaps the
  device's work on the one before, as in a training loop (1: the host's dispatch is timed
  too). ``packed_capacity``: the packed modes' capacity, in place of the batch's own.
  ``pgle_runs``: on several devices, each step compiled again for XLA's profile-guided
  latency estimator, from a device trace of that many calls (:func:`profile_guided`).
  ``donate``: the step donates its params and optimizer state and is fed its results
  (:class:`DonatedStep`). Each record has the step's host time a call (``step_dispatch_ms``,
  until the calls of a repeat returned, before the sync)."""
  if balance and shard_lengths != "drawn":
    raise ValueError("balance reorders drawn lengths: pass shard_lengths='drawn'")
  unknown = set(stages) - set(STAGES)
  if unknown or "step" not in stages:
    raise ValueError(f"stages must include 'step' and be among {STAGES}, got {stages}")
  options = dict(compiler_options or {}) if devices > 1 else {}
  pgle_runs = pgle_runs if devices > 1 else 0
  setup = setup_for(kind, tiny, batch_size)
  model = build_model(kind, tiny, jnp.bfloat16)
  params = model.params
  batch = make_batch(kind, model, setup, seed, shards=devices, shard_lengths=shard_lengths)
  if balance:
    batch = balanced_batch(batch, devices)
  top_n = int(shard_row_counts(batch["attention_mask"], devices).max())
  num_params = sum(leaf.size for leaf in jax.tree.leaves(params))
  fsdp_kinds = tuple(dict.fromkeys([fsdp] if fsdp is None or isinstance(fsdp, str)
                                    else fsdp)) or (None,)
  # One device splits nothing: every kind runs the same.
  placements = {kind_: Placement.make(params, devices, kind_)
                for kind_ in fsdp_kinds[:1 if devices == 1 else None]}
  if not setup.has_lm_head:
    modes = [m for m in modes if split_mode(m, backend)[0] not in LM_HEAD_MODES]
  if setup.tied_lm_head:  # These would time sebp_shared and bound again.
    modes = [m for m in modes if split_mode(m, backend)[0] not in ("sebp_lm_head",
                                                                    "bound_lm_head")]
  if setup.nnx:
    modes = [m for m in modes if split_mode(m, backend)[0] in NNX_MODES]
  fields = dict(model=kind, setup=setup.name, tiny=tiny, batch_size=setup.batch_size, seed=seed,
                top_n=top_n, compute_dtype="bfloat16",
                param_dtype=jnp.dtype(setup.param_dtype).name, repeats=repeats, rounds=rounds,
                calls_per_repeat=calls_per_repeat,
                backend=backend, devices=devices, balanced=balance,
                shard_lengths=shard_lengths if devices > 1 else None, compiler_options=options,
                processes=jax.process_count(), packed_capacity=packed_capacity,
                pgle_runs=pgle_runs, donated=donate)

  def fields_of(fsdp_kind: str | None, mode: str) -> dict:
    return {**fields, "fsdp": fsdp_kind if devices > 1 else None,
            "backend": split_mode(mode, backend)[1]}

  quiet = jax.process_index() != 0  # Several processes: the first one speaks for all.
  prepared, rows = [], []
  runs = [(fsdp_kind, mode) for fsdp_kind in placements for mode in modes]
  for fsdp_kind, mode in tqdm(runs, desc=f"{kind} on {devices} device(s), compiling",
                              file=sys.stdout, disable=quiet):
    placement = placements[fsdp_kind]
    host_batch, loss_fn = mode_loss(kind, model, mode, batch, top_n, backend,
                                    placement.sebp_sharding, packed_capacity,
                                    num_shards=devices)
    try:
      calls = placement.calls(loss_fn, host_batch, stages, options, weight_fn=loss_weight(kind),
                              pgle_runs=pgle_runs, donate=donate)
      step_call = calls["step"][0]
      compiled_step = step_call.compiled if donate else step_call
      for fn, args in calls.values():
        for _ in range(2):  # compile and warm up
          jax.block_until_ready(fn(*args))
    except jax.errors.JaxRuntimeError as error:
      if "RESOURCE_EXHAUSTED" not in str(error):
        raise
      row = record(**fields_of(fsdp_kind, mode), mode=mode,
                   error=f"out of memory: {str(error).splitlines()[0]}")
      rows.append(row)
      append_json_lines(None if quiet else out, [row])
      continue
    prepared.append((fsdp_kind, mode, host_batch, compiled_step, calls))
  samples = {(fsdp_kind, mode): {stage: [] for stage in calls}
             for fsdp_kind, mode, _, _, calls in prepared}
  step_dispatch = {(fsdp_kind, mode): [] for fsdp_kind, mode, _, _, _ in prepared}
  for _ in tqdm(range(rounds), desc=f"{kind} on {devices} device(s), timing", unit="round",
                file=sys.stdout, disable=quiet):
    for fsdp_kind, mode, _, _, calls in prepared:
      for stage, (fn, args) in calls.items():
        dispatch = step_dispatch[fsdp_kind, mode] if stage == "step" else None
        samples[fsdp_kind, mode][stage].append(median_ms(fn, *args, repeats=repeats, warmup=0,
                                                         calls_per_repeat=calls_per_repeat,
                                                         dispatch_ms=dispatch))
  dense_peaks = {fsdp_kind: peak_bytes(step)
                 for fsdp_kind, mode, _, step, _ in prepared if mode == "dense"}
  for fsdp_kind, mode, host_batch, compiled_step, _ in prepared:
    timed = with_backward({f"{stage}_ms": np.asarray(ms)
                           for stage, ms in samples[fsdp_kind, mode].items()})
    dense = samples.get((fsdp_kind, "dense"))
    dense_peak = dense_peaks.get(fsdp_kind)
    row = record(
        **fields_of(fsdp_kind, mode), mode=mode, padded_length=host_batch["input_ids"].shape[1],
        real_tokens=int(np.count_nonzero(host_batch["attention_mask"])),
        rows=int(host_batch["input_ids"].size),
        **{name: float(np.median(ms)) for name, ms in timed.items()},
        rounds_ms={name: ms.tolist() for name, ms in timed.items()},
        step_dispatch_ms=float(np.median(step_dispatch[fsdp_kind, mode])),
        peak_bytes=peak_bytes(compiled_step), collectives=collective_counts(compiled_step),
        collective_bytes=collective_bytes(compiled_step))
    if "packed" in mode:
      row["capacity"] = packed_slots(host_batch["attention_mask"], packed_capacity, devices)
    row.update(real_token_throughput(row, num_params))
    # The one-device run of the same measurement: same batch, timing, library and device.
    one_device = next((r for r in reversed(baseline) if "step_ms" in r and all(
        r.get(name) == row.get(name) for name in BASELINE_FIELDS)), None)
    if dense is not None:
      dense_ms = with_backward({f"{stage}_ms": np.asarray(ms) for stage, ms in dense.items()})
      for stage in [s for s in ("backward", "grad", "step") if f"{s}_ms" in timed]:
        per_round = dense_ms[f"{stage}_ms"] / timed[f"{stage}_ms"]
        row[f"{stage}_speedup_vs_dense"] = float(np.median(per_round))
        row[f"{stage}_speedup_vs_dense_range"] = [float(per_round.min()),
                                                  float(per_round.max())]
      if dense_peak and row["peak_bytes"]:
        row["peak_memory_vs_dense"] = row["peak_bytes"] / dense_peak
    if one_device:
      row["scaling_efficiency"] = one_device["step_ms"] / row["step_ms"]
      if "step_speedup_vs_dense" in one_device and "step_speedup_vs_dense" in row:
        row["share_of_one_device_speedup"] = (row["step_speedup_vs_dense"]
                                              / one_device["step_speedup_vs_dense"])
    rows.append(row)
    append_json_lines(None if quiet else out, [row])
  return rows


#: What a one-device record must share with a run on several devices to be its baseline.
BASELINE_FIELDS = ("model", "mode", "tiny", "batch_size", "seed", "calls_per_repeat", "donated",
                   "backend", "packed_capacity", "device", "jax_version")


def with_backward(timed: dict) -> dict:
  """``timed`` (milliseconds by stage) with the backward's, the gradient's less the forward's,
  where both were timed."""
  if "grad_ms" in timed and "forward_ms" in timed:
    return {**timed, "backward_ms": timed["grad_ms"] - timed["forward_ms"]}
  return timed


#: Dense bf16 peak FLOP/s of the cards measured here, by a name in their device kind.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def real_token_throughput(row: dict, num_params: int) -> dict:
  """Real tokens a second of a step, and the real-token MFU: 6 · parameters · real tokens /
  step time / the card's peak bf16 FLOP/s (None on a card not in :data:`PEAK_BF16_FLOPS`)."""
  tokens_per_s = row["real_tokens"] / (row["step_ms"] / 1e3)  # every device's batch
  peak = next((flops for name, flops in PEAK_BF16_FLOPS.items() if name in row["device"]),
              None)
  return {"num_params": num_params, "real_tokens_per_s": tokens_per_s,
          "real_token_mfu": None if peak is None else 6 * num_params * tokens_per_s
          / (peak * row["devices"])}


def print_table(rows) -> None:
  header = (f"{'model':14} {'mode':28} {'dev':>3} {'batch':>5} {'fsdp':25} {'len':>5} "
            f"{'fwd ms':>8} {'bwd ms':>8} {'grad ms':>8} {'step ms':>8} {'bwd x':>6} "
            f"{'grad x':>6} {'step x (rounds)':>17} "
            f"{'mem/dense':>9} {'scaling':>7} {'x kept':>6}")
  print(header)
  print("-" * len(header))
  for r in rows:
    if "error" in r:
      print(f"{r['model']:14} {r['mode']:28} {r['devices']:3d} {r['batch_size']:5d} "
            f"{r.get('fsdp') or '-':25} {r['error'][:60]}")
      continue
    cell = functools.partial(_cell, r)
    low, high = r.get("step_speedup_vs_dense_range", (None, None))
    spread = ("" if low is None else f" ({low:4.2f}-{high:4.2f})").rjust(12)
    print(f"{r['model']:14} {r['mode']:28} {r['devices']:3d} {r['batch_size']:5d} "
          f"{r.get('fsdp') or '-':25} {r['padded_length']:5d} {cell('forward_ms', 8)} "
          f"{cell('backward_ms', 8)} {cell('grad_ms', 8)} {r['step_ms']:8.2f} "
          f"{cell('backward_speedup_vs_dense', 6)} {cell('grad_speedup_vs_dense', 6)} "
          f"{cell('step_speedup_vs_dense', 5)}{spread} "
          f"{cell('peak_memory_vs_dense', 9, 3)} {cell('scaling_efficiency', 7)} "
          f"{cell('share_of_one_device_speedup', 6)}")


def _cell(record: dict, key: str, width: int, digits: int = 2) -> str:
  """``record[key]`` in a column ``width`` wide, ``-`` where the run has none."""
  value = record.get(key)
  if value is None or value != value:
    return "-".rjust(width)
  return f"{value:{width}.{digits}f}"


def best_batches(rows) -> list[dict]:
  """Per model and mode, the batch size of the most real tokens a second, with that
  throughput over ``longest_dense_fast_attention``'s best (what a user gets without this
  library, each at its own best batch). Each batch size is a run of its own: the ratio
  compares medians of rounds that were not interleaved."""
  timed = [r for r in rows if "real_tokens_per_s" in r and r["devices"] == 1]
  best = {}
  for r in timed:
    key = (r["model"], r["mode"])
    if key not in best or r["real_tokens_per_s"] > best[key]["real_tokens_per_s"]:
      best[key] = r
  out = []
  for (kind, mode), r in best.items():
    baseline = best.get((kind, LONGEST + "dense_fast_attention"))
    out.append({"model": kind, "mode": mode, "batch_size": r["batch_size"],
                "batch_sizes": sorted({t["batch_size"] for t in timed
                                       if (t["model"], t["mode"]) == (kind, mode)}),
                "real_tokens_per_s": r["real_tokens_per_s"],
                "real_token_mfu": r.get("real_token_mfu"),
                "throughput_vs_longest_fast_attention": None if baseline is None
                else r["real_tokens_per_s"] / baseline["real_tokens_per_s"]})
  return out


def print_best_batches(best) -> None:
  print(f"{'model':14} {'mode':28} {'best batch':>10} {'real tok/s':>11} {'MFU':>5} "
        f"{'vs longest+fast attn':>20}")
  for b in best:
    ratio = b["throughput_vs_longest_fast_attention"]
    mfu = b["real_token_mfu"]
    print(f"{b['model']:14} {b['mode']:28} {b['batch_size']:10d} "
          f"{b['real_tokens_per_s']:11.0f} {'' if mfu is None else f'{mfu:5.2f}':>5} "
          f"{'' if ratio is None else f'{ratio:.2f}x':>20}")


def parse_fsdp_kinds(text: str) -> list[str]:
  """``--fsdp``: a comma list of :data:`FSDP_KINDS`."""
  kinds = text.split(",")
  unknown = [kind for kind in kinds if kind not in FSDP_KINDS]
  if unknown:
    raise argparse.ArgumentTypeError(f"unknown FSDP kind(s) {', '.join(unknown)}: expected a "
                                     f"comma list of {', '.join(FSDP_KINDS)}")
  return kinds


def main(argv=None) -> list[dict]:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.model",
                                   description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter,
                                   epilog=__doc__.split("\n\n", 1)[1])
  parser.add_argument("--model", choices=sorted(SETUPS), action="append",
                      help="model(s) to run (default: all)")
  parser.add_argument("--modes", type=parse_modes, default=list(MODES),
                      help=f"comma-separated subset of {','.join(MODES)}, each optionally "
                           "@BACKEND (that mode's SEBP backend, in place of --backend)")
  parser.add_argument("--backend", default="auto", choices=("auto", *implementation_names()),
                      help="SEBP backend of the sebp_* modes")
  parser.add_argument("--repeats", type=positive_int, default=3,
                      help="calls of each measurement in a round; their median is the round's")
  parser.add_argument("--calls-per-repeat", type=positive_int, default=1,
                      help="calls dispatched back to back before one sync (1: each call "
                           "synced, the host's dispatch timed too)")
  parser.add_argument("--rounds", type=positive_int, default=5,
                      help="interleaved rounds, every mode timed once in each; a record keeps "
                           "the median and the spread of the rounds")
  parser.add_argument("--seed", type=non_negative_int, default=0,
                      help="seed of the batch's tokens and lengths")
  parser.add_argument("--tiny", action="store_true", help="toy model sizes (CPU smoke run)")
  parser.add_argument("--devices", type=parse_positive_ints, default=[1],
                      help="comma list of device counts, each a data-parallel run with the "
                           "setup's batch on every device (e.g. 1,2: weak-scaling efficiency)")
  parser.add_argument("--fsdp", nargs="?", const=["start"], type=parse_fsdp_kinds,
                      default=None,
                      help="on several devices, split the weight matrices over them too, "
                           "gathered whole at the step's start (start, the default), where "
                           "XLA places the gathers, layer by layer (layer), or by each device "
                           "in a shard_map running the one-device loss on its rows "
                           "(shard_map: sebp_jax.sharding.fsdp_loss, embedding tables looked "
                           "up in place where that moves fewer rows, the LM head's kernel "
                           "split by its vocabulary, its logits computed on each device's "
                           "columns; shard_map_gathered_head: the head gathered as the "
                           "rest; shard_map_gathered_tables: the tables too); a comma list "
                           "runs the kinds side by side, interleaved in the rounds")
  parser.add_argument("--batch-sizes", type=parse_positive_ints, default=None,
                      help="comma list of batch sizes (per device), each a run of its own in "
                           "place of the setup's; prints each mode's best batch, by real "
                           "tokens a second")
  parser.add_argument("--shard-lengths", choices=("same", "drawn"), default="same",
                      help="on several devices, every device's rows with the one-device "
                           "batch's lengths (same: weak scaling at equal work) or lengths drawn "
                           "for each device (drawn)")
  parser.add_argument("--packed-capacity", type=positive_int, default=None,
                      help="the packed modes' capacity per device in place of each batch's "
                           "own (token_capacity), where it holds the batch: one compile for "
                           "every batch of a run")
  parser.add_argument("--balance", action="store_true",
                      help="with --shard-lengths drawn, reorder the batch's rows so that every "
                           "device holds about equal real tokens")
  parser.add_argument("--stages", type=functools.partial(parse_subset, choices=STAGES),
                      default=list(STAGES),
                      help="comma-separated stages to time (step always): forward,grad,step")
  parser.add_argument("--compiler-option", type=parse_compiler_option, action="append",
                      default=[], metavar="NAME=VALUE",
                      help="an XLA option the runs on several devices compile with, e.g. "
                           "xla_gpu_enable_latency_hiding_scheduler=true (repeatable)")
  parser.add_argument("--pgle-runs", type=non_negative_int, default=0,
                      help="on several devices, compile each step again for XLA's "
                           "profile-guided latency estimator, from a device trace of this "
                           "many calls (GPU; 0: the default compile)")
  parser.add_argument("--processes", type=positive_int, default=1,
                      help="run as this many processes of one device each (jax.distributed, "
                           "GPU i for process i), started here; --devices must then be the "
                           "processes' devices together")
  parser.add_argument("--process-id", type=int, default=None,
                      help="this process's rank among --processes started elsewhere (by a "
                           "cluster's launcher), with --coordinator")
  parser.add_argument("--coordinator", default=None,
                      help="HOST:PORT of the first process's coordinator, with --process-id")
  parser.add_argument("--donate", action="store_true",
                      help="the step donates its params and optimizer state and is fed its "
                           "own results, as a training loop runs it (jax.jit donate_argnums)")
  parser.add_argument("--out", default=None, help="append JSON lines here")
  args = parser.parse_args(argv)
  modes = args.modes
  if args.balance and args.shard_lengths != "drawn":
    parser.error("--balance reorders drawn lengths: add --shard-lengths drawn")
  if "step" not in args.stages:
    parser.error("--stages must include step")
  if args.donate and args.pgle_runs:
    parser.error("--donate and --pgle-runs go apart: the profiled runs share the params")
  if (args.compiler_option or args.pgle_runs) and max(args.devices) == 1:
    # One device's runs are the baseline that the options are measured against.
    parser.error("--compiler-option and --pgle-runs apply to the runs on several devices, and "
                 "--devices has none; for one device set XLA_FLAGS")
  if (args.process_id is None) != (args.coordinator is None):
    parser.error("--process-id and --coordinator go together")
  if args.process_id is None and args.processes > 1:
    written = len(read_json_lines(args.out))
    launch_processes("benchmarks.model", args.processes,
                     list(sys.argv[1:] if argv is None else argv))
    return read_json_lines(args.out)[written:]
  if args.process_id is not None:
    join_processes(args.coordinator, args.processes, args.process_id)
    if any(devices != jax.device_count() for devices in args.devices):
      parser.error(f"--devices {','.join(map(str, args.devices))}: with --processes every "
                   f"run spans all {jax.device_count()} devices of the processes")
  elif max(args.devices) > jax.device_count():
    parser.error(f"--devices {max(args.devices)}: this machine has {jax.device_count()} (on a "
                 "CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)")
  quiet = jax.process_index() != 0
  # One-device records already in --out are the baseline of runs on several devices made
  # apart from them (--processes runs span only the processes' devices).
  earlier = [r for r in read_json_lines(args.out) if r.get("devices") == 1]
  rows = []
  for kind in args.model or sorted(SETUPS):
    for batch_size in args.batch_sizes or [None]:
      one_device = earlier
      for devices in args.devices:
        runs = run(kind, modes, args.repeats, args.tiny, args.seed, args.backend, args.out,
                   devices=devices, fsdp=args.fsdp, baseline=one_device, rounds=args.rounds,
                   batch_size=batch_size, balance=args.balance,
                   shard_lengths=args.shard_lengths, stages=args.stages,
                   compiler_options=dict(args.compiler_option),
                   calls_per_repeat=args.calls_per_repeat,
                   packed_capacity=args.packed_capacity, pgle_runs=args.pgle_runs,
                   donate=args.donate)
        one_device = runs if devices == 1 else one_device
        rows += runs
  if not quiet:
    print_table(rows)
    if args.batch_sizes and len(args.batch_sizes) > 1:
      print_best_batches(best_batches(rows))
  return rows


if __name__ == "__main__":
  main()
