"""The shipped checkpoints load into Flax with their real pretrained weights.

BERT (all-MiniLM-L6-v2): semantic similarity of mean-pooled embeddings. SmolLM2 (from Q4_1
GGUF): greedy predictions and WikiText-2 loss, which only come out right when the conversion
(dequantisation, layout, rotary permutation, rope theta, tokenizer) is right.
"""

import math

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.datasets import encode_fixed_length, load_sst2, load_wikitext2
from examples.pretrained import _undo_rope_row_permutation, load_smollm2

# WikiText-2 tokens scored per loss evaluation: enough for a stable average, few enough for a CPU.
LOSS_TOKENS = 128


def _mean_pooled_embeddings(bert, texts):
  """[len(texts), 384] mean of the encoder's last hidden state over real (unmasked) tokens."""
  model, params, tokenizer = bert
  encoded = encode_fixed_length(tokenizer, texts, max_length=32)
  outputs = model(encoded["input_ids"],
                  encoded["attention_mask"],
                  params=params,
                  output_hidden_states=True)
  mask = encoded["attention_mask"][..., None].astype(np.float32)
  return np.asarray(outputs.hidden_states[-1] * mask).sum(axis=1) / mask.sum(axis=1)


def _cosine(a, b):
  return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_bert_classifier_logits_on_sst2(bert):
  model, params, tokenizer = bert
  sentences = [sentence for sentence, _ in load_sst2("dev", limit=2)]
  encoded = encode_fixed_length(tokenizer, sentences, max_length=32)
  logits = model(encoded["input_ids"], encoded["attention_mask"], params=params).logits
  assert logits.shape == (2, 2)
  assert np.all(np.isfinite(np.asarray(logits)))
  assert params["classifier"]["kernel"].shape == (384, 2)


def test_bert_embeddings_are_pretrained(bert):
  # Random weights give near-identical similarities for any pair; the pretrained sentence encoder
  # separates a paraphrase from an unrelated sentence by a wide margin.
  embeddings = _mean_pooled_embeddings(
      bert,
      [
          "A man is playing the guitar.",
          "Someone plays a guitar.",
          "The central bank raised interest rates again.",
      ],
  )
  paraphrase = _cosine(embeddings[0], embeddings[1])
  unrelated = _cosine(embeddings[0], embeddings[2])
  assert paraphrase > unrelated + 0.4, (paraphrase, unrelated)


def test_smollm2_config_read_from_gguf(smollm2):
  model, params, _ = smollm2
  config = model.config
  assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (576, 30, 1536)
  assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (9, 3,
                                                                                         49152)
  assert config.rope_theta == 100000.0 and config.tie_word_embeddings
  assert math.isclose(config.rms_norm_eps, 1e-5, rel_tol=1e-6)
  layer = params["model"]["layers"]["0"]
  assert layer["self_attn"]["k_proj"]["kernel"].shape == (576, 192)
  assert layer["mlp"]["down_proj"]["kernel"].shape == (1536, 576)
  np.testing.assert_array_equal(params["lm_head"]["kernel"],
                                params["model"]["embed_tokens"]["embedding"].T)


def _greedy_continuation(smollm2, prompt, num_tokens):
  model, params, tokenizer = smollm2
  ids = tokenizer(prompt)["input_ids"]
  for _ in range(num_tokens):
    batch = np.asarray([ids], np.int32)
    logits = model(batch, np.ones_like(batch), params=params).logits
    ids.append(int(jnp.argmax(logits[0, -1])))
  return tokenizer.decode(ids[-num_tokens:])


@pytest.mark.parametrize(
    "prompt, num_tokens, expected",
    [
        ("The capital of France is", 1, " Paris"),
        ("The opposite of hot is", 1, " cold"),
        # The tokenizer splits digits from the spaces before them, so " 5" is two tokens.
        ("1, 2, 3, 4,", 2, " 5"),
    ],
)
def test_smollm2_greedy_predictions(smollm2, prompt, num_tokens, expected):
  assert _greedy_continuation(smollm2, prompt, num_tokens) == expected


def _wikitext_loss(model, params, tokenizer):
  """Mean next-token cross-entropy (nats) over the first LOSS_TOKENS tokens of WikiText-2."""
  ids = np.asarray([tokenizer(load_wikitext2()[0])["input_ids"][:LOSS_TOKENS]], np.int32)
  logits = model(ids, np.ones_like(ids), params=params).logits
  return float(optax.softmax_cross_entropy_with_integer_labels(logits[0, :-1], ids[0, 1:]).mean())


@pytest.fixture(scope="module")
def converted_wikitext_loss(smollm2):
  return _wikitext_loss(*smollm2)


def test_smollm2_wikitext_loss_far_below_uniform(converted_wikitext_loss):
  loss = converted_wikitext_loss
  # Uniform guessing costs log(49152) = 10.8 nats; a correct conversion stays under 4.
  assert loss < 4.0, loss


def test_smollm2_rotary_unpermutation_matters(converted_wikitext_loss):
  permuted_model, permuted_params, tokenizer = load_smollm2(undo_rope_permutation=False)
  permuted_loss = _wikitext_loss(permuted_model, permuted_params, tokenizer)
  # Leaving llama.cpp's pairwise rotary layout in pairs the wrong dims in every head's rotation.
  assert permuted_loss > converted_wikitext_loss + 1.0, (converted_wikitext_loss, permuted_loss)


def test_smollm2_right_padding_leaves_real_positions_unchanged(smollm2):
  # FlaxLlama's default position_ids are 0..T-1, which is correct for right padding; the mask must
  # keep the padded keys out of every real token's attention.
  model, params, tokenizer = smollm2
  prompts = ["The capital of France is", "Hello"]
  encoded = encode_fixed_length(tokenizer, prompts, max_length=8)
  padded_logits = np.asarray(
      model(encoded["input_ids"], encoded["attention_mask"], params=params).logits)
  for row, prompt in enumerate(prompts):
    ids = np.asarray([tokenizer(prompt)["input_ids"]], np.int32)
    alone_logits = np.asarray(model(ids, np.ones_like(ids), params=params).logits[0])
    np.testing.assert_allclose(padded_logits[row, :ids.shape[1]], alone_logits, atol=2e-3, rtol=0)


def test_smollm2_tokenizer_round_trips_text(smollm2):
  _, _, tokenizer = smollm2
  for paragraph in load_wikitext2()[:20]:
    assert tokenizer.decode(tokenizer(paragraph)["input_ids"]) == paragraph
  # Control tokens are atomic, not split into bytes.
  chat_ids = tokenizer("<|im_start|>user")["input_ids"]
  assert tokenizer.convert_ids_to_tokens(chat_ids) == ["<|im_start|>", "user"]


def test_undo_rope_row_permutation_inverts_llama_cpp_permute():
  num_heads, head_dim, in_features = 3, 8, 5
  hf_weight = np.arange(num_heads * head_dim * in_features,
                        dtype=np.float32).reshape(-1, in_features)
  # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, head_dim // 2, in).swapaxes(1, 2).
  gguf_weight = (hf_weight.reshape(num_heads, 2, head_dim // 2,
                                   in_features).swapaxes(1, 2).reshape(hf_weight.shape))
  # Head 0 interleaves its halves: rows 0, 4, 1, 5, ...
  np.testing.assert_array_equal(gguf_weight[:4, 0], hf_weight[[0, 4, 1, 5], 0])
  np.testing.assert_array_equal(_undo_rope_row_permutation(gguf_weight, num_heads), hf_weight)
