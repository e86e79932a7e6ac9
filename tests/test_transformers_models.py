"""`use_sebp(active_mask=mask)` on more of transformers' Flax models than the BERT, RoBERTa,
Llama, Mistral and GPT-2 of the other tests, each unmodified, tiny and random: every
parameter's gradient equals dense `jax.grad`, and the layers it swaps are the model's linear
layers less its heads. The losses read real positions only: the first token ([CLS]) for the
classifiers, `masked_causal_lm_loss` for the causal LMs."""

from contextlib import nullcontext

import jax
import numpy as np
import optax
import pytest
import transformers

from sebp_jax import use_sebp
from sebp_jax.losses import masked_causal_lm_loss
from tests.model_testing import assert_every_gradient_close

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, max_position_embeddings=32)

# name: (classifier or causal LM, model class, config class, its tiny config, linear layers
# swapped). ALBERT's layer is shared by its two layers: listed once.
MODELS = {
    "DistilBERT": ("classifier", "FlaxDistilBertForSequenceClassification", "DistilBertConfig",
                   dict(dim=16, n_layers=2, n_heads=2, hidden_dim=32), 12),
    "ALBERT": ("classifier", "FlaxAlbertForSequenceClassification", "AlbertConfig",
               dict(embedding_size=8, hidden_size=16, num_hidden_layers=2,
                    num_attention_heads=2, intermediate_size=32), 7),
    "RoFormer": ("classifier", "FlaxRoFormerForSequenceClassification", "RoFormerConfig",
                 dict(embedding_size=16, hidden_size=16, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=32), 12),
    "BigBird": ("classifier", "FlaxBigBirdForSequenceClassification", "BigBirdConfig",
                dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, attention_type="original_full"), 12),
    "GPT-Neo": ("lm", "FlaxGPTNeoForCausalLM", "GPTNeoConfig",
                dict(hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                     attention_types=[[["global", "local"], 1]], window_size=4), 12),
    "GPT-J": ("lm", "FlaxGPTJForCausalLM", "GPTJConfig",
              dict(n_positions=32, n_embd=16, n_layer=2, n_head=2, rotary_dim=4), 12),
    "OPT": ("lm", "FlaxOPTForCausalLM", "OPTConfig",
            dict(hidden_size=16, num_hidden_layers=2, ffn_dim=32, num_attention_heads=2,
                 word_embed_proj_dim=16), 12),
    "Bloom": ("lm", "FlaxBloomForCausalLM", "BloomConfig",
              dict(hidden_size=16, n_layer=2, n_head=2), 8),
    "Gemma": ("lm", "FlaxGemmaForCausalLM", "GemmaConfig",
              dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                   hidden_activation="gelu_pytorch_tanh"), 14),
    "XGLM": ("lm", "FlaxXGLMForCausalLM", "XGLMConfig",
             dict(d_model=16, num_layers=2, attention_heads=2, ffn_dim=32), 12),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradients_equal_dense(name):
  kind, model_class, config_class, sizes, num_linear = MODELS[name]
  config = getattr(transformers, config_class)(**{**SMALL, **sizes})
  model = getattr(transformers, model_class)(config, seed=0)
  rng = np.random.default_rng(sorted(MODELS).index(name))
  lengths = rng.integers(2, 9, size=(3, 1))
  lengths[0] = 8  # one full row, the others padded
  mask = (np.arange(8)[None] < lengths).astype(np.int32)
  ids = np.where(mask != 0, rng.integers(3, VOCAB, mask.shape), 1).astype(np.int32)
  labels = rng.integers(0, 2, size=3)
  reports = []

  def loss(params, sebp):
    with use_sebp(active_mask=mask) if sebp else nullcontext() as report:
      reports.append(report)
      logits = model(ids, attention_mask=mask, params=params).logits
    if kind == "classifier":
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return masked_causal_lm_loss(logits, ids, mask)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  assert_every_gradient_close(grad(model.params, True), grad(model.params, False))
  report = reports[0]
  assert len(report.swapped) == num_linear, report.swapped
  assert report.embeddings and report.embeddings[0] in report.shared_index
