"""`use_sebp(packed=True)` end to end on transformers' Flax BERT (and its copies), DistilBERT,
ALBERT, RoFormer, Llama, Mistral, Gemma, GPT-2, GPT-Neo, GPT-J, OPT, XGLM and Bloom: the loss
and every parameter's gradient equal dense `jax.grad` of the unmodified model.

The losses read real positions only: [CLS] (position 0, always real) for the classifiers;
for the decoders the next-token loss of `masked_causal_lm_loss`, counted where a real token
predicts a real token."""

import functools
import inspect
import re
from contextlib import nullcontext

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from transformers import (BertConfig, BloomConfig, FlaxBertForSequenceClassification,
                          FlaxBertForTokenClassification, FlaxBertModel, FlaxBloomForCausalLM,
                          FlaxGemmaForCausalLM,
                          FlaxGPT2LMHeadModel, FlaxGPTJForCausalLM, FlaxGPTNeoForCausalLM,
                          FlaxLlamaForCausalLM, FlaxMistralForCausalLM, FlaxOPTForCausalLM,
                          FlaxRobertaForSequenceClassification, FlaxXGLMForCausalLM,
                          GemmaConfig, GPT2Config, GPTJConfig, GPTNeoConfig, LlamaConfig,
                          MistralConfig, OPTConfig, RobertaConfig, XGLMConfig)

from sebp_jax import losses, token_capacity, use_sebp
from sebp_jax.losses import masked_causal_lm_loss

VOCAB, BATCH, LENGTH = 72, 3, 12


def _encoder_config(cls, layers=2, **overrides):
  return cls(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=layers, num_attention_heads=2,
             intermediate_size=32, max_position_embeddings=32, **overrides)


def _decoder_config(cls, layers=2, **overrides):
  return cls(**{**dict(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=32,
                       max_position_embeddings=64), **overrides})


@pytest.fixture(scope="module")
def tiny_bert():
  return FlaxBertForSequenceClassification(_encoder_config(BertConfig), seed=0)


@pytest.fixture(scope="module")
def tiny_roberta():
  config = _encoder_config(RobertaConfig, layers=1, pad_token_id=1)
  return FlaxRobertaForSequenceClassification(config, seed=1)


@pytest.fixture(scope="module")
def tiny_llama():
  return FlaxLlamaForCausalLM(_decoder_config(LlamaConfig), seed=2)


@pytest.fixture(scope="module")
def tiny_mistral():
  config = _decoder_config(MistralConfig, layers=1, sliding_window=3)
  return FlaxMistralForCausalLM(config, seed=3)


def _mask(rng, layout, min_length=2, max_tokens=None):
  """A random ``[B, L]`` mask: right or left padding, or holes with position 0 real; at most
  ``max_tokens`` real tokens."""
  while True:
    cols = np.arange(LENGTH)[None]
    lengths = rng.integers(min_length, LENGTH + 1, size=(BATCH, 1))
    if layout == "right":
      mask = cols < lengths
    elif layout == "left":
      mask = cols >= LENGTH - lengths
    else:
      mask = rng.random((BATCH, LENGTH)) < 0.6
      mask[:, :min_length] = True
    if max_tokens is None or mask.sum() <= max_tokens:
      return mask.astype(np.int32)


def _ids(rng, mask, pad_id=0):
  """Random tokens (never ``pad_id``) at real positions, ``pad_id`` at padding."""
  ids = rng.integers(3, VOCAB, size=mask.shape)
  return np.where(mask != 0, ids, pad_id).astype(np.int32)


def _classifier_batch(rng, model, mask, pad_id=0, head_mask=None):
  """``(ids, mask, labels, head_mask)``; the head mask all ones unless given."""
  if head_mask is None:
    head_mask = np.ones((model.config.num_hidden_layers, model.config.num_attention_heads),
                        np.float32)
  return _ids(rng, mask, pad_id), mask, rng.integers(0, 2, size=BATCH), head_mask


def _positions(mask):
  """Each token's position in its own sequence, whatever the padding."""
  return np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int32)


def _packing(capacity, mask, reports, attention="auto"):
  if capacity is None:
    return nullcontext()
  context = use_sebp(top_n=capacity, active_mask=mask, packed=True, backend="xla",
                     attention=attention)
  reports.append(context.report)
  return context


def classifier_loss(model, capacity=None, reports=None, attention="auto", **call_kwargs):
  """``(params, ids, mask, labels, head_mask) -> loss``, packed in ``capacity`` slots."""
  def loss(params, ids, mask, labels, head_mask):
    with _packing(capacity, mask, reports, attention):
      logits = model(ids, attention_mask=mask, head_mask=head_mask, params=params,
                     **call_kwargs).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss


def lm_loss(model, capacity=None, reports=None, loss_capacity=None, attention="auto"):
  """``(params, ids, mask, positions) -> masked_causal_lm_loss``; the positions go to models
  that take them (not Bloom's: ALiBi counts each row's real tokens)."""
  takes_positions = "position_ids" in inspect.signature(model.__call__).parameters

  def loss(params, ids, mask, positions):
    positions = {"position_ids": positions} if takes_positions else {}
    with _packing(capacity, mask, reports, attention):
      logits = model(ids, attention_mask=mask, params=params, **positions).logits
    return masked_causal_lm_loss(logits, ids, mask, capacity=loss_capacity)
  return loss


def packed_grad(loss_builder, model, capacity, reports, **kwargs):
  """The jitted value and gradient of the loss under use_sebp(packed=True)."""
  return jax.jit(jax.value_and_grad(loss_builder(model, capacity, reports, **kwargs)))


@functools.cache
def dense_grad(loss_builder, model):
  """The jitted value and gradient of the loss without use_sebp (one per model)."""
  return jax.jit(jax.value_and_grad(loss_builder(model)))


def _max_error(got, want):
  """max |got - want| over every leaf, relative to the largest |want| entry of the tree."""
  scale = max(float(np.max(np.abs(leaf))) for leaf in jax.tree.leaves(want))
  assert scale > 0
  return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))) / scale


def assert_matches_dense(got, want, rtol=1e-5):
  """Same loss; every leaf's gradient within rtol of the largest dense gradient entry (true
  gradients can be exactly zero, e.g. BERT's key bias, so per-leaf ratios mean nothing)."""
  (got_value, got_grad), (want_value, want_grad) = got, want
  np.testing.assert_allclose(got_value, want_value, rtol=1e-5)
  assert jax.tree.structure(got_grad) == jax.tree.structure(want_grad)
  scale = max(float(np.max(np.abs(leaf))) for leaf in jax.tree.leaves(want_grad))
  assert scale > 0
  flat, _ = jax.tree_util.tree_flatten_with_path(got_grad)
  for (path, a), b in zip(flat, jax.tree.leaves(want_grad)):
    error = float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
    assert error <= rtol * scale, f"{jax.tree_util.keystr(path)}: {error} > {rtol} * {scale}"


@pytest.fixture(scope="module")
def packed_bert(tiny_bert):
  """A right-padded batch and the jitted packed loss in exactly as many slots as its real
  tokens, shared by the tests that run it."""
  rng = np.random.default_rng(10)
  mask = _mask(rng, "right", max_tokens=BATCH * LENGTH - 2)
  capacity = int(mask.sum())
  reports = []
  return (_classifier_batch(rng, tiny_bert, mask), capacity, reports,
          packed_grad(classifier_loss, tiny_bert, capacity, reports))


@pytest.mark.parametrize("attention", ["mask", "rows"])
def test_bert_packed_gradients_equal_dense(tiny_bert, packed_bert, attention):
  """Right padding in exactly full slots; holes with a random head mask in the same compiled
  function, with spare slots. The traced mask packs under jit; attention over the packed
  sequence or in rows of their own."""
  right, capacity, reports, packed = packed_bert
  if attention == "rows":
    reports = []
    packed = packed_grad(classifier_loss, tiny_bert, capacity, reports, attention="rows")
  dense = dense_grad(classifier_loss, tiny_bert)
  rng = np.random.default_rng(11)
  holes = _mask(rng, "holes", min_length=1, max_tokens=capacity - 2)
  head_mask = rng.uniform(0.2, 1.0, size=(2, 2)).astype(np.float32)
  for batch in (right, _classifier_batch(rng, tiny_bert, holes, head_mask=head_mask)):
    assert_matches_dense(packed(tiny_bert.params, *batch), dense(tiny_bert.params, *batch))
  (report,) = reports
  assert report.packed == ["bert/encoder"] and report.capacity == capacity


def test_a_token_classifier_runs_on_the_packed_rows():
  """BERT token classification: the classifier after the packed encoder runs on the packed
  rows. A token loss masked on padding gives the dense gradient; one that reads the logits at
  padding (not computed) makes every gradient NaN, the classifier's too."""
  model = FlaxBertForTokenClassification(_encoder_config(BertConfig, num_labels=3), seed=4)
  rng = np.random.default_rng(31)
  mask = _mask(rng, "left")
  ids, labels = _ids(rng, mask), rng.integers(0, 3, size=mask.shape)
  capacity = int(mask.sum()) + 2

  def loss(params, mask, packed, weights):
    reports = []
    with _packing(capacity if packed else None, mask, reports):
      logits = model(ids, attention_mask=mask, params=params).logits
    assert not packed or reports[0].packed == ["bert/encoder", "classifier"]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(losses * weights) / jnp.sum(weights)

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=2)
  assert_matches_dense(grad(model.params, mask, True, mask),
                       grad(model.params, mask, False, mask))
  value, grads = grad(model.params, mask, True, np.ones_like(mask))
  assert np.isfinite(value)  # the zeros it read: the gradients say what they cost
  assert all(np.isnan(g).all() for g in jax.tree.leaves(grads["classifier"]))
  assert all(np.isnan(g).any() for g in jax.tree.leaves(grads))


class _PositionBiasedDense(nn.Dense):
  """A token head with a learned bias per position: its own ``__call__`` reads columns."""
  max_length: int = LENGTH

  @nn.compact
  def __call__(self, inputs):
    bias = self.param("position_bias", nn.initializers.normal(1.0),
                      (self.max_length, self.features))
    return super().__call__(inputs) + bias[:inputs.shape[-2]]


class _Tagger(nn.Module):
  @nn.compact
  def __call__(self, hidden):
    return _PositionBiasedDense(3, name="tagger")(hidden)


def test_a_dense_subclass_of_its_own_after_the_region_runs_as_it_is():
  """A Dense subclass with its own ``__call__`` on the packed encoder's outputs runs on the
  ``[B, L]`` outputs, as the report says (left alone), not on the packed rows, where its
  position bias would read slots for columns."""
  encoder = FlaxBertModel(_encoder_config(BertConfig), seed=5)
  head = _Tagger()
  rng = np.random.default_rng(32)
  mask = _mask(rng, "right")
  ids, labels = _ids(rng, mask), rng.integers(0, 3, size=mask.shape)
  head_params = head.init(jax.random.key(1), jnp.zeros((BATCH, LENGTH, 16)))

  def loss(params, packed):
    reports = []
    with _packing(int(mask.sum()) if packed else None, mask, reports):
      hidden = encoder(ids, attention_mask=mask, params=params[0]).last_hidden_state
      logits = head.apply(params[1], hidden)
    assert not packed or (reports[0].packed == ["encoder"]
                          and reports[0].skipped["tagger"] == "a subclass with its own __call__")
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(losses * mask) / jnp.sum(mask)

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  params = (encoder.params, head_params)
  assert_matches_dense(grad(params, True), grad(params, False))


def test_traced_overflow_is_loud(tiny_bert, packed_bert):
  """More real tokens than slots under jit: the loss and gradients are NaN, never those of a
  batch cut short."""
  (ids, mask, *others), capacity, _, packed = packed_bert
  over = mask.copy()
  over[tuple(np.argwhere(mask == 0)[:2].T)] = 1
  value, grad = packed(tiny_bert.params, ids, over, *others)
  assert np.isnan(float(value))
  # Inside the packed encoder too: a zero gradient there would let an optimizer step on.
  layer = grad["bert"]["encoder"]["layer"]["0"]
  assert np.isnan(grad["classifier"]["kernel"]).all()
  assert np.isnan(layer["attention"]["self"]["query"]["kernel"]).all()
  assert np.isnan(layer["output"]["dense"]["kernel"]).all()


@pytest.mark.parametrize("model_name, pad_id, head", [
    ("tiny_bert", 0, "FlaxBertPooler"), ("tiny_roberta", 1, "FlaxRobertaClassificationHead")])
def test_a_head_reading_the_first_column_refuses_padding_there(request, model_name, pad_id,
                                                               head):
  """BERT's pooler and RoBERTa's classification head read each row's first column, which
  packing does not compute where it is padding: with left padding a concrete mask raises and a
  traced one makes the loss and every gradient NaN. A row without real tokens reads zeros
  there: weighed 0 in the loss, the gradient is the dense one."""
  model = request.getfixturevalue(model_name)
  rng = np.random.default_rng(12)
  right = _mask(rng, "right", max_tokens=BATCH * LENGTH - 2)
  capacity = int(right.sum())
  ids, _, labels, head_mask = _classifier_batch(rng, model, right, pad_id)
  left, left_ids = right[:, ::-1].copy(), ids[:, ::-1].copy()
  loss = classifier_loss(model, capacity, [])
  padded_first = re.escape(f"row(s) {np.flatnonzero(left[:, 0] == 0).tolist()}")
  with pytest.raises(ValueError, match=f"{head} reads the first column .* {padded_first}"):
    jax.eval_shape(lambda p: loss(p, left_ids, left, labels, head_mask), model.params)
  value, grad = jax.jit(jax.value_and_grad(loss))(model.params, left_ids, left, labels,
                                                  head_mask)
  assert np.isnan(float(value)) and all(np.isnan(leaf).any() for leaf in jax.tree.leaves(grad))

  def weighed(capacity):
    def loss(params, ids, mask, labels):
      with _packing(capacity, mask, []):
        logits = model(ids, attention_mask=mask, params=params).logits
      per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
      return jnp.sum(per_row * mask.any(axis=1)) / BATCH
    return jax.value_and_grad(loss)

  empty = right.copy()
  empty[1] = 0
  empty_ids = np.where(empty != 0, ids, pad_id).astype(np.int32)
  dense = jax.jit(weighed(None))(model.params, empty_ids, empty, labels)
  # The mask concrete inside the trace (closed over), then traced.
  concrete = jax.jit(lambda params: weighed(capacity)(params, empty_ids, empty, labels))
  assert_matches_dense(concrete(model.params), dense)
  assert_matches_dense(jax.jit(weighed(capacity))(model.params, empty_ids, empty, labels),
                       dense)


def test_traced_overflow_of_a_decoder_is_loud(tiny_llama):
  """The same for a decoder and its LM head, the loss on real rows."""
  rng = np.random.default_rng(23)
  ids, mask, positions = _decoder_batch(rng, "right")
  capacity = int(mask.sum()) - 3
  value, grad = packed_grad(lm_loss, tiny_llama, capacity, [], loss_capacity=capacity)(
      tiny_llama.params, ids, mask, positions)
  assert np.isnan(float(value))
  # Every parameter; the embedding in the rows of the batch's tokens (the others get none).
  assert all(np.isnan(leaf).any() for leaf in jax.tree.leaves(grad))
  assert np.isnan(grad["model"]["layers"]["0"]["mlp"]["up_proj"]["kernel"]).all()


def test_the_model_mask_must_be_the_active_mask(tiny_bert):
  """Packing attends over active_mask's tokens: a model called with another attention mask
  (a loss mask given as active_mask) raises when both are known, and is NaN under jit."""
  rng = np.random.default_rng(24)
  ids, mask, labels, head_mask = _classifier_batch(rng, tiny_bert, _mask(rng, "right"))
  loss_mask = mask.copy()
  loss_mask[:, 0] = 0

  def loss(params, attention_mask, active_mask):
    with use_sebp(top_n=int(mask.sum()), active_mask=active_mask, packed=True):
      logits = tiny_bert(ids, attention_mask=attention_mask, params=params).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  with pytest.raises(ValueError, match="attention_mask .* differs from use_sebp.s active_mask"):
    loss(tiny_bert.params, mask, loss_mask)
  assert np.isnan(float(jax.jit(loss)(tiny_bert.params, mask, loss_mask)))
  assert np.isfinite(float(jax.jit(loss)(tiny_bert.params, mask, mask)))


def test_outputs_keep_their_structure(tiny_bert):
  """return_dict=False and output_hidden_states: every hidden state comes back [B, L, D],
  equal to the dense model's at real tokens and zero at padding."""
  rng = np.random.default_rng(25)
  ids, mask, _, _ = _classifier_batch(rng, tiny_bert, _mask(rng, "holes"))
  call = lambda: tiny_bert.module.apply({"params": tiny_bert.params}, ids, mask, None, None,
                                        None, output_hidden_states=True, return_dict=False)
  want = call()
  with use_sebp(top_n=int(mask.sum()) + 2, active_mask=mask, packed=True):
    got = call()
  assert isinstance(got, tuple) and len(got) == len(want)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)  # logits from [CLS]
  hidden_got, hidden_want = got[1], want[1]
  assert len(hidden_got) == len(hidden_want) == tiny_bert.config.num_hidden_layers + 1
  for g, w in zip(hidden_got, hidden_want):
    assert g.shape == w.shape
    np.testing.assert_allclose(g[mask == 1], w[mask == 1], rtol=1e-5, atol=1e-5)
  for g in hidden_got[1:]:  # the encoder's, packed; the embeddings' are its input
    assert not np.any(g[mask == 0])


def test_a_head_alone_is_not_packed():
  """An lm_head of a model packing does not know (its rows need not be the mask's tokens):
  left as it is, and the context says it packed nothing."""
  class Seq2SeqLike(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(5, name="lm_head")(nn.Dense(8)(x))

  rng = np.random.default_rng(26)
  mask = _mask(rng, "right")
  x = jnp.asarray(rng.standard_normal((BATCH, LENGTH, 4)), jnp.float32)
  params = Seq2SeqLike().init(jax.random.key(0), x)
  context = use_sebp(top_n=int(mask.sum()), active_mask=mask, packed=True)
  with pytest.raises(RuntimeError, match="packed nothing"):
    with context:
      y = Seq2SeqLike().apply(params, x)
  assert context.report.packed == []
  np.testing.assert_allclose(y, Seq2SeqLike().apply(params, x), rtol=1e-6)


def test_a_numpy_mask_over_capacity_raises_inside_jit(tiny_bert):
  """A numpy mask is known when the function is traced, jit or not: with overflow="nan", too
  many real tokens raise at once, with the counts; by default the capacity grows to hold
  them."""
  rng = np.random.default_rng(21)
  ids, mask, labels, _ = _classifier_batch(rng, tiny_bert, _mask(rng, "right"))
  capacity = int(mask.sum()) - 1

  def loss(params, overflow):
    with use_sebp(top_n=capacity, overflow=overflow, active_mask=mask, packed=True) as report:
      logits = tiny_bert(ids, attention_mask=mask, params=params).logits
    assert report.capacity == (capacity if overflow == "nan" else token_capacity(mask))
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  with pytest.raises(ValueError, match=f"capacity {capacity} .* {capacity + 1} real tokens"):
    jax.jit(jax.grad(loss), static_argnums=1)(tiny_bert.params, "nan")
  jax.jit(jax.grad(loss), static_argnums=1)(tiny_bert.params, "exact")


def test_mistral_without_a_window_follows_the_model(tiny_mistral):
  """sliding_window=None: packed attention follows the model's own causal mask as
  transformers builds it, so the gradients equal the dense model's."""
  model = FlaxMistralForCausalLM(_decoder_config(MistralConfig, layers=1, sliding_window=None),
                                 _do_init=False)
  rng = np.random.default_rng(22)
  batch = _decoder_batch(rng, "right")
  capacity = int(batch[1].sum())
  assert_matches_dense(packed_grad(lm_loss, model, capacity, [])(tiny_mistral.params, *batch),
                       dense_grad(lm_loss, model)(tiny_mistral.params, *batch))


@pytest.mark.slow
def test_bert_packed_gradients_equal_dense_eagerly(tiny_bert):
  """Without jit, on a concrete mask with spare slots."""
  rng = np.random.default_rng(12)
  batch = _classifier_batch(rng, tiny_bert, _mask(rng, "right"))
  capacity = int(batch[1].sum()) + 5
  reports = []
  got = jax.value_and_grad(classifier_loss(tiny_bert, capacity, reports))(tiny_bert.params,
                                                                          *batch)
  assert_matches_dense(got, dense_grad(classifier_loss, tiny_bert)(tiny_bert.params, *batch))
  assert reports[0].packed == ["bert/encoder"] and reports[0].capacity == capacity


def test_bert_gradient_checkpointing_and_a_context_around_jit(tiny_bert):
  """Layers under nn.remat (gradient_checkpointing=True) pack the same, with the context
  entered around jit on a concrete mask."""
  rng = np.random.default_rng(13)
  remat_bert = FlaxBertForSequenceClassification(tiny_bert.config, _do_init=False,
                                                 gradient_checkpointing=True)
  batch = _classifier_batch(rng, tiny_bert, _mask(rng, "right"))
  capacity = int(batch[1].sum()) + 2
  with use_sebp(top_n=capacity, active_mask=batch[1], packed=True, backend="xla") as report:
    got = jax.jit(jax.value_and_grad(classifier_loss(remat_bert)))(tiny_bert.params, *batch)
  assert_matches_dense(got, dense_grad(classifier_loss, tiny_bert)(tiny_bert.params, *batch))
  assert report.packed == ["bert/encoder"] and report.capacity == capacity


def test_roberta_packed_gradients_equal_dense(tiny_roberta):
  """pad_token_id=1 at padding, so RoBERTa's position ids skip it; slots exactly full, then
  spare."""
  rng = np.random.default_rng(14)
  mask = _mask(rng, "right")
  capacity = int(mask.sum())
  reports = []
  packed = packed_grad(classifier_loss, tiny_roberta, capacity, reports)
  dense = dense_grad(classifier_loss, tiny_roberta)
  for batch_mask in (mask, _mask(rng, "right", max_tokens=capacity - 3)):
    batch = _classifier_batch(rng, tiny_roberta, batch_mask, pad_id=1)
    assert_matches_dense(packed(tiny_roberta.params, *batch),
                         dense(tiny_roberta.params, *batch))
  assert reports[0].packed == ["roberta/encoder"] and reports[0].capacity == capacity


@pytest.mark.parametrize("family", ["XLMRoberta", "RobertaPreLayerNorm", "Electra", "RoFormer"])
def test_transformers_copies_of_bert_pack(family):
  """XLM-RoBERTa, RoBERTa-PreLayerNorm (its last norm after the encoder) and ELECTRA copy
  BERT's encoder, RoFormer's is BERT's with rotary embeddings: packed, their gradients are the
  dense ones; their heads that read the first column refuse a mask with padding there."""
  import transformers
  config = _encoder_config(getattr(transformers, f"{family}Config"), pad_token_id=1,
                           **({"embedding_size": 8} if family == "Electra" else
                              {"embedding_size": 16} if family == "RoFormer" else {}))
  model = getattr(transformers, f"Flax{family}ForSequenceClassification")(config, seed=4)
  rng = np.random.default_rng(15)
  mask = _mask(rng, "right")
  reports = []
  batch = _classifier_batch(rng, model, mask, pad_id=1)
  packed = packed_grad(classifier_loss, model, int(mask.sum()), reports)
  assert_matches_dense(packed(model.params, *batch), dense_grad(classifier_loss, model)(
      model.params, *batch))
  (packed_region,) = reports[0].packed
  assert packed_region.endswith("/encoder" if family != "RoFormer" else "/encoder/layer")
  ids, _, labels, head_mask = batch
  with pytest.raises(ValueError, match=f"Flax{family}ClassificationHead reads the first column"):
    jax.eval_shape(lambda p: classifier_loss(model, int(mask.sum()), [])(
        p, ids[:, ::-1], mask[:, ::-1].copy(), labels, head_mask), model.params)


def test_distilbert_packs_and_its_classifier_refuses_padding_in_the_first_column():
  """DistilBERT's encoder packs, its gradients the dense ones; its classifier reads each row's
  first column in its own code (no head module): with left padding a concrete mask raises and
  a traced one makes the loss and every gradient NaN."""
  from transformers import DistilBertConfig, FlaxDistilBertForSequenceClassification
  model = FlaxDistilBertForSequenceClassification(
      DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=32,
                       max_position_embeddings=32), seed=7)
  rng = np.random.default_rng(42)
  capacity = BATCH * LENGTH - 4
  reports = []

  def loss(params, ids, mask, labels):
    with _packing(capacity, mask, reports):
      logits = model(ids, attention_mask=mask, params=params).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  dense = jax.jit(jax.value_and_grad(lambda p, ids, mask, labels: (
      optax.softmax_cross_entropy_with_integer_labels(
          model(ids, attention_mask=mask, params=p).logits, labels).mean())))
  packed = jax.jit(jax.value_and_grad(loss))
  for layout in ("right", "holes"):
    mask = _mask(rng, layout, max_tokens=capacity)
    batch = (_ids(rng, mask), mask, rng.integers(0, 2, size=BATCH))
    assert_matches_dense(packed(model.params, *batch), dense(model.params, *batch))
  assert reports[0].packed == ["distilbert/transformer/layer"]
  left = _mask(rng, "right", max_tokens=capacity)[:, ::-1].copy()
  left[0] = 1  # one full row: the others start with padding
  left[1:, -1] = 1
  batch = (_ids(rng, left), left, rng.integers(0, 2, size=BATCH))
  with pytest.raises(ValueError, match="FlaxDistilBertForSequenceClassificationModule."
                                       r"pre_classifier reads the first column .* "
                                       r"row\(s\) \[1, 2\]"):
    jax.eval_shape(lambda p: loss(p, *batch), model.params)
  value, grad = packed(model.params, *batch)
  # Every weight of the model's NaN; the pre-classifier's bias, behind a ReLU whose gradient
  # at NaN is 0, may stay finite.
  assert np.isnan(float(value))
  assert all(np.isnan(leaf).any() for leaf in jax.tree.leaves(
      (grad["distilbert"], grad["classifier"], grad["pre_classifier"]["kernel"])))
  # The classifier's encoder run on its own (no classifier's call around it) reads no first
  # column: left padding packs, exactly.
  def token_loss(params, ids, mask, packed):
    with _packing(capacity if packed else None, mask, []):
      hidden = model.module.apply({"params": params}, ids, mask,
                                  method=lambda m, *a: m.distilbert(*a).last_hidden_state)
    return jnp.sum(jnp.where(mask[..., None] != 0, hidden, 0) ** 2)

  token_grad = jax.jit(jax.value_and_grad(token_loss), static_argnums=3)
  assert_matches_dense(token_grad(model.params, *batch[:2], True),
                       token_grad(model.params, *batch[:2], False))
  # A traced mask over the capacity: the same, the encoder's gradients NaN behind the ReLU
  # too (not zero).
  full = np.ones((BATCH, LENGTH), np.int32)
  value, grad = packed(model.params, _ids(rng, full), full, rng.integers(0, 2, size=BATCH))
  assert np.isnan(float(value))
  assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(grad["distilbert"]))


def test_albert_packs_and_its_pooler_refuses_padding_in_the_first_column():
  """ALBERT's encoder (its layers shared, its embeddings narrower than the stack) packs, its
  gradients the dense ones. Its model reads each row's first column for the pooler in its own
  code: with left padding a concrete mask raises and a traced one makes the loss and every
  gradient NaN. Built without the pooler (token classification), or its pooler's output
  unread, left padding packs, exactly."""
  from transformers import (AlbertConfig, FlaxAlbertForSequenceClassification,
                            FlaxAlbertForTokenClassification, FlaxAlbertModel)
  config = AlbertConfig(vocab_size=VOCAB, embedding_size=8, hidden_size=16,
                        num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=32)
  rng = np.random.default_rng(44)
  capacity = BATCH * LENGTH - 4
  reports = []

  def loss_of(model, per_token):
    def loss(params, ids, mask, labels, packed):
      with _packing(capacity if packed else None, mask, reports):
        logits = model(ids, attention_mask=mask, params=params).logits
      if per_token:
        per_row = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return jnp.sum(jnp.where(mask != 0, per_row, 0))
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss

  classifier = FlaxAlbertForSequenceClassification(config, seed=12)
  grad = jax.jit(jax.value_and_grad(loss_of(classifier, per_token=False)), static_argnums=4)
  for layout in ("right", "holes"):
    mask = _mask(rng, layout, max_tokens=capacity)
    batch = (_ids(rng, mask), mask, rng.integers(0, 2, size=BATCH))
    assert_matches_dense(grad(classifier.params, *batch, True),
                         grad(classifier.params, *batch, False))
  assert reports[0].packed == ["albert/encoder"]
  left = _mask(rng, "right", max_tokens=capacity)[:, ::-1].copy()
  left[0] = 1  # one full row: the others start with padding
  left[1:, -1] = 1
  batch = (_ids(rng, left), left, rng.integers(0, 2, size=BATCH))
  with pytest.raises(ValueError, match=r"FlaxAlbertModule.pooler reads the first column .* "
                                       r"row\(s\) \[1, 2\]"):
    jax.eval_shape(lambda p: loss_of(classifier, False)(p, *batch, True), classifier.params)
  value, grads = grad(classifier.params, *batch, True)
  assert np.isnan(float(value)) and all(np.isnan(leaf).any() for leaf in jax.tree.leaves(grads))
  tagger = FlaxAlbertForTokenClassification(config, seed=13)
  grad = jax.jit(jax.value_and_grad(loss_of(tagger, per_token=True)), static_argnums=4)
  tags = (batch[0], left, rng.integers(0, 2, size=left.shape))
  assert_matches_dense(grad(tagger.params, *tags, True), grad(tagger.params, *tags, False))
  # The bare model runs its pooler, but a loss on the tokens alone does not read it: with a
  # traced mask (no refusal) left padding packs, exactly.
  bare = FlaxAlbertModel(config, seed=14)

  def token_loss(params, ids, mask, packed):
    with _packing(capacity if packed else None, mask, []):
      hidden = bare(ids, attention_mask=mask, params=params).last_hidden_state
    return jnp.sum(jnp.where(mask[..., None] != 0, hidden, 0) ** 2)

  grad = jax.jit(jax.value_and_grad(token_loss), static_argnums=3)
  assert_matches_dense(grad(bare.params, batch[0], left, True),
                       grad(bare.params, batch[0], left, False))


@pytest.mark.parametrize("rotary_value", [False, True])
def test_roformer_packs_its_layers_with_positions_by_column(rotary_value):
  """RoFormer's encoder slices its sinusoidal positions by column: its layers run packed,
  each token rotated at its own column (its values too with rotary_value), the masked-LM
  head on the packed rows; right and left padding and holes, exact."""
  from transformers import FlaxRoFormerForMaskedLM, RoFormerConfig
  model = FlaxRoFormerForMaskedLM(_encoder_config(
      RoFormerConfig, embedding_size=16, rotary_value=rotary_value, initializer_range=0.2), seed=14)
  rng = np.random.default_rng(45)
  reports = []

  def loss(params, ids, mask, labels, packed):
    with _packing(BATCH * LENGTH - 4 if packed else None, mask, reports):
      logits = model(ids, attention_mask=mask, params=params).logits
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(jnp.where(mask != 0, per_token, 0))

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=4)
  for layout in ("right", "left", "holes"):
    mask = _mask(rng, layout, max_tokens=BATCH * LENGTH - 4)
    batch = (_ids(rng, mask), mask, rng.integers(3, VOCAB, mask.shape))
    assert_matches_dense(grad(model.params, *batch, True), grad(model.params, *batch, False))
  assert reports[0].packed == ["roformer/encoder/layer", "cls/predictions/transform/dense",
                               "decoder"]


def test_roformer_in_bfloat16_is_as_close_to_float32_as_dense():
  """A bf16 RoFormer (its sinusoidal table float32) packed is as close to the float32 dense
  model as the dense bf16 model."""
  from transformers import FlaxRoFormerForSequenceClassification, RoFormerConfig
  model = FlaxRoFormerForSequenceClassification(
      _encoder_config(RoFormerConfig, embedding_size=16), seed=16)
  bf16_model = type(model)(model.config, dtype=jnp.bfloat16, _do_init=False)
  rng = np.random.default_rng(47)
  batch = _classifier_batch(rng, model, _mask(rng, "holes"))
  capacity = int(batch[1].sum()) + 3
  reference = dense_grad(classifier_loss, model)(model.params, *batch)
  dense_bf16 = dense_grad(classifier_loss, bf16_model)(model.params, *batch)
  packed_bf16 = packed_grad(classifier_loss, bf16_model, capacity, [])(model.params, *batch)
  dense_error = _max_error(dense_bf16[1], reference[1])
  assert 1e-5 < dense_error < 0.05
  assert _max_error(packed_bf16[1], reference[1]) <= 2 * dense_error


def test_roformer_longer_than_its_positions_raises_as_dense():
  """A batch longer than RoFormer's sinusoidal table: the dense model fails on the shapes,
  and packing, which takes the table by column, raises rather than reuse its last row."""
  from transformers import FlaxRoFormerForMaskedLM, RoFormerConfig
  config = _encoder_config(RoFormerConfig, embedding_size=16)
  config.max_position_embeddings = LENGTH - 4
  model = FlaxRoFormerForMaskedLM(config, seed=17)
  mask = _mask(np.random.default_rng(49), "right")
  ids = _ids(np.random.default_rng(49), mask)
  with pytest.raises(ValueError):
    model(ids, attention_mask=mask)
  with pytest.raises(ValueError, match="sinusoidal_pos holds 8 columns and the batch 12"):
    with _packing(BATCH * LENGTH, mask, []):
      model(ids, attention_mask=mask)


def test_roformer_multiple_choice_reads_the_last_column():
  """RoFormer's multiple-choice model reads each row's last column: left padding packs
  exactly; right padding raises for a concrete mask and is NaN under jit, and so does a
  choice without tokens (scored with the others, it cannot be weighed 0)."""
  from transformers import FlaxRoFormerForMultipleChoice, RoFormerConfig
  model = FlaxRoFormerForMultipleChoice(_encoder_config(RoFormerConfig, embedding_size=16),
                                        seed=15)
  rng = np.random.default_rng(46)
  choices = 2
  capacity = choices * BATCH * LENGTH - 6
  right = _mask(rng, "right", max_tokens=capacity // choices)
  right = np.concatenate([right, right[::-1]])  # [choices * B, L], a choice a block
  left = right[:, ::-1].copy()
  labels = rng.integers(0, choices, size=BATCH)

  def loss(params, ids, mask, packed):
    with _packing(capacity if packed else None, mask, []):
      logits = model(ids.reshape(BATCH, choices, LENGTH),
                     attention_mask=mask.reshape(BATCH, choices, LENGTH), params=params).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=3)
  ids = _ids(rng, left)
  assert_matches_dense(grad(model.params, ids, left, True), grad(model.params, ids, left, False))
  ids = _ids(rng, right)
  with pytest.raises(ValueError, match="FlaxRoFormerForMultipleChoiceModule.classifier reads "
                                       "the last column .* Pad on the left"):
    jax.eval_shape(functools.partial(loss, packed=True, mask=right), model.params, ids)
  assert np.isnan(float(grad(model.params, ids, right, True)[0]))
  empty_choice = left.copy()
  empty_choice[1] = 0
  ids = _ids(rng, empty_choice)
  with pytest.raises(ValueError, match=r"row\(s\) \[1\] that hold real tokens or none"):
    jax.eval_shape(functools.partial(loss, packed=True, mask=empty_choice), model.params, ids)
  assert np.isnan(float(grad(model.params, ids, empty_choice, True)[0]))


def _decoder_batch(rng, layout, capacity=BATCH * LENGTH, mask=None):
  """``(ids, mask, positions)``. Right padding and holes: the default positions; left
  padding: each token's position in its sequence."""
  if mask is None:
    mask = _mask(rng, layout, min_length=4, max_tokens=capacity)
  if layout == "left":
    positions = _positions(mask)
  else:
    positions = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), mask.shape)
  return _ids(rng, mask), mask, positions


@pytest.mark.parametrize("attention", ["mask", "rows"])
def test_llama_packed_gradients_equal_dense(tiny_llama, attention):
  """Grouped-query Llama: right padding in exactly full slots, left padding and holes with
  spare ones, in one compiled function."""
  rng = np.random.default_rng(15)
  mask = _mask(rng, "right", min_length=4, max_tokens=BATCH * LENGTH - 4)
  capacity = int(mask.sum())
  reports = []
  packed = packed_grad(lm_loss, tiny_llama, capacity, reports, attention=attention)
  dense = dense_grad(lm_loss, tiny_llama)
  batches = [_decoder_batch(rng, "right", mask=mask), _decoder_batch(rng, "left", capacity),
             _decoder_batch(rng, "holes", capacity)]
  for batch in batches:
    assert_matches_dense(packed(tiny_llama.params, *batch), dense(tiny_llama.params, *batch))
  assert reports[0].packed == ["model", "lm_head"] and reports[0].capacity == capacity


@pytest.mark.parametrize("attention", ["mask", "rows"])
def test_spare_slots_read_an_id_the_batch_reads(tiny_llama, attention):
  """Spare slots embed the batch's first real token, not id 0: a table whose row 0 is Inf,
  an id the batch never reads (padding is id 5), leaves the padded model finite, and so the
  packed one (0 attention weight times an Inf, and an Inf row of x times a zero dY row, would
  be NaN)."""
  rng = np.random.default_rng(19)
  mask = _mask(rng, "right", min_length=4, max_tokens=BATCH * LENGTH - 8)
  ids = np.where(mask != 0, rng.integers(6, VOCAB, mask.shape), 5).astype(np.int32)
  params = jax.tree.map(lambda a: a, tiny_llama.params)
  table = params["model"]["embed_tokens"]["embedding"]
  params["model"]["embed_tokens"]["embedding"] = table.at[0].set(jnp.inf)
  batch = (ids, mask, _positions(mask))
  want = dense_grad(lm_loss, tiny_llama)(params, *batch)
  got = packed_grad(lm_loss, tiny_llama, int(mask.sum()) + 8, [], attention=attention)(
      params, *batch)
  assert np.isfinite(want[0]) and all(np.isfinite(g).all() for g in jax.tree.leaves(want[1]))
  assert_matches_dense(got, want)


def test_mistral_sliding_window_gradients_equal_dense(tiny_mistral):
  """Mistral with a window of 3 columns, sequences of 4 to 12 tokens, and the loss over
  masked_causal_lm_loss(capacity=C)."""
  rng = np.random.default_rng(16)
  capacity = BATCH * LENGTH - 6
  reports = []
  packed = packed_grad(lm_loss, tiny_mistral, capacity, reports, loss_capacity=capacity)
  dense = dense_grad(lm_loss, tiny_mistral)
  for layout in ("right", "left", "holes"):
    batch = _decoder_batch(rng, layout, capacity)
    assert_matches_dense(packed(tiny_mistral.params, *batch), dense(tiny_mistral.params, *batch))
  assert reports[0].packed == ["model", "lm_head"] and reports[0].capacity == capacity


def _tied_decoder(name):
  if name == "GPT-2":
    return FlaxGPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16,
                                          n_layer=2, n_head=2), seed=5)
  if name == "GPT-Neo":  # A global layer, then a local one of 3 columns.
    return FlaxGPTNeoForCausalLM(GPTNeoConfig(
        vocab_size=VOCAB, max_position_embeddings=32, hidden_size=16, num_layers=2,
        attention_types=[[["global", "local"], 1]], num_heads=2, intermediate_size=32,
        window_size=3), seed=9)
  if name == "GPT-J":  # Rotary embeddings on 4 of a head's 8 features; its own LM head.
    return FlaxGPTJForCausalLM(GPTJConfig(vocab_size=VOCAB, n_positions=64, n_embd=16,
                                          n_layer=2, n_head=2, rotary_dim=4), seed=10)
  if name == "OPT":  # Embeddings narrower than the stack: project_in and project_out.
    return FlaxOPTForCausalLM(OPTConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
        num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=8), seed=11)
  if name == "XGLM":  # Sinusoidal positions at an offset, embeddings scaled.
    return FlaxXGLMForCausalLM(XGLMConfig(
        vocab_size=VOCAB, max_position_embeddings=32, d_model=16, ffn_dim=32, num_layers=2,
        attention_heads=2), seed=13)
  if name == "Bloom":  # ALiBi; weights large enough that its bias moves the gradient.
    return FlaxBloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2,
                                            n_head=4, initializer_range=0.2), seed=12)
  # A head size of Gemma's own, not hidden_size // heads.
  config = GemmaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, max_position_embeddings=64,
                       hidden_activation="gelu_pytorch_tanh")
  return FlaxGemmaForCausalLM(config, seed=6)


@pytest.mark.parametrize("name, attention", [
    ("GPT-2", "mask"), ("GPT-2", "rows"), ("Gemma", "rows"), ("GPT-Neo", "mask"),
    ("GPT-J", "rows"), ("OPT", "mask"), ("XGLM", "rows"), ("Bloom", "mask"), ("Bloom", "rows")])
def test_decoders_with_tied_heads_packed_gradients_equal_dense(name, attention):
  """GPT-2 (learned positions, its fused q/k/v projection in transformers' FlaxConv1D),
  Gemma (grouped-query, a head size of its own), GPT-Neo (unscaled queries, a local layer's
  window), GPT-J (partial rotary embeddings), OPT (learned positions at an offset, its
  projections in and out), XGLM (sinusoidal positions at an offset) and Bloom (ALiBi over
  each row's real tokens): their LM heads, tied to the token embeddings (a Dense applied
  through .apply, with no path of its own: its name, lm_head, in the report and for exclude)
  but GPT-J's, run on the packed rows too, the loss over masked_causal_lm_loss(capacity=C)."""
  model = _tied_decoder(name)
  rng = np.random.default_rng(38)
  capacity = BATCH * LENGTH - 6
  reports = []
  packed = packed_grad(lm_loss, model, capacity, reports, loss_capacity=capacity,
                       attention=attention)
  dense = dense_grad(lm_loss, model)
  for layout in ("right", "left", "holes"):
    batch = _decoder_batch(rng, layout, capacity)
    assert_matches_dense(packed(model.params, *batch), dense(model.params, *batch))
  assert reports[0].packed[1] == "lm_head" and reports[0].capacity == capacity
  ids, mask, _ = batch
  with use_sebp(top_n=capacity, active_mask=mask, packed=True, exclude="lm_head") as report:
    jax.eval_shape(lambda p: model(ids, attention_mask=mask, params=p), model.params)
  assert len(report.packed) == 1


def _distilbert_classifier():
  from transformers import DistilBertConfig, FlaxDistilBertForSequenceClassification
  return FlaxDistilBertForSequenceClassification(
      DistilBertConfig(vocab_size=VOCAB, dim=16, n_layers=2, n_heads=2, hidden_dim=32,
                       max_position_embeddings=32, initializer_range=0.2), seed=7)


@pytest.mark.parametrize("name, value", [
    ("BERT", -1), ("DistilBERT", 2), ("OPT", 2), ("Bloom", 2), ("Llama", 0.5)], ids=str)
def test_a_model_mask_of_other_values_than_0_and_1_is_refused(name, value):
  """transformers' models read their mask's values, packing only where it is 0: BERT masks a
  -1, DistilBERT scales its scores by a 2, OPT's positions and Bloom's ALiBi sum a mask of
  1s and 2s (segment ids), and every model casts the mask to int32 (a Llama masks a 0.5).
  Given such a mask, active_mask its non-zero tokens, packing raises for a concrete mask and
  makes the loss NaN for a traced one; the dense model's output moves with the value (the
  check is not vacuous), and the 0/1 mask packs to the dense loss."""
  model = {"BERT": lambda: FlaxBertForSequenceClassification(_encoder_config(
               BertConfig, initializer_range=0.2), seed=0),
           "DistilBERT": _distilbert_classifier,
           "Llama": lambda: FlaxLlamaForCausalLM(_decoder_config(LlamaConfig), seed=2)
           }.get(name, lambda: _tied_decoder(name))()
  rng = np.random.default_rng(48)
  capacity = BATCH * LENGTH - 6
  ids, mask, _ = _decoder_batch(rng, "right", capacity)
  valued = mask * np.where(np.arange(LENGTH) >= 4, value, 1)
  weights = rng.standard_normal((BATCH, LENGTH, VOCAB))

  def loss(params, active, model_mask, packed=True):
    with _packing(capacity if packed else None, active, []):
      logits = model(ids, attention_mask=model_mask, params=params).logits
    if logits.ndim == 2:  # A classifier: its rows' first column.
      return jnp.sum(logits ** 2)
    return jnp.sum(jnp.where(active[..., None] != 0, logits, 0) * weights)

  dense_valued = jax.jit(functools.partial(loss, packed=False))(model.params, mask, valued)
  dense = jax.jit(functools.partial(loss, packed=False))(model.params, mask, mask)
  assert abs(float(dense_valued) - float(dense)) > 1e-4 * abs(float(dense))
  # A 0.5 is 0 once cast: the mask the model reads is not active_mask.
  with pytest.raises(ValueError, match="values other than 0 and 1|differs from use_sebp"):
    loss(model.params, mask, valued)
  assert np.isnan(float(jax.jit(loss)(model.params, mask, valued)))
  np.testing.assert_allclose(jax.jit(loss)(model.params, mask, mask), dense, rtol=1e-5)


def test_bloom_packed_without_alibi_is_not_dense(monkeypatch):
  """The Bloom rows above can tell: packed with every ALiBi slope 0, the gradient is not
  dense's."""
  from sebp_jax import model_families
  monkeypatch.setattr(model_families, "_alibi_slopes", lambda module, heads: (0.0,) * heads)
  model = _tied_decoder("Bloom")
  batch = _decoder_batch(np.random.default_rng(38), "holes", BATCH * LENGTH - 6)
  got = packed_grad(lm_loss, model, BATCH * LENGTH - 6, [])(model.params, *batch)
  want = dense_grad(lm_loss, model)(model.params, *batch)
  assert _max_error(got[1], want[1]) > 1e-3


@pytest.mark.parametrize("family, packed_layers", [
    ("Bert", ["bert/encoder", "cls/predictions/transform/dense", "decoder"]),
    ("Albert", ["albert/encoder", "predictions/dense", "decoder"])])
def test_masked_lm_with_its_decoder_tied_packs(family, packed_layers):
  """BERT's and ALBERT's masked-LM decoders, tied to the word embeddings (applied through
  .apply), run on the packed rows too: the loss over real tokens and every gradient are
  dense's."""
  import transformers
  config = _encoder_config(getattr(transformers, f"{family}Config"), layers=1,
                           **({"embedding_size": 8} if family == "Albert" else {}))
  model = getattr(transformers, f"Flax{family}ForMaskedLM")(config, seed=8)
  rng = np.random.default_rng(43)
  mask = _mask(rng, "holes")
  ids, labels = _ids(rng, mask), rng.integers(3, VOCAB, mask.shape)
  capacity = token_capacity(mask)
  reports = []

  def loss(params, packed):
    with _packing(capacity if packed else None, mask, reports):
      logits = model(ids, attention_mask=mask, params=params).logits
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(jnp.where(mask != 0, per_token, 0))

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  assert_matches_dense(grad(model.params, True), grad(model.params, False))
  assert reports[0].packed == packed_layers


@pytest.mark.parametrize("lora", [False, True])
def test_a_module_applied_on_numpy_ids_packs_with_or_without_qwix_lora(lora):
  """Llama's Linen module applied on numpy ids (no transformers wrapper to make them jax
  arrays), and with qwix's LoRA on some of its layers: packing runs the layers' own code, the
  adapters included, so the gradient is dense's, the adapters' too."""
  from transformers.models.llama.modeling_flax_llama import FlaxLlamaForCausalLMModule
  module = FlaxLlamaForCausalLMModule(_decoder_config(LlamaConfig))
  if lora:
    qwix = pytest.importorskip("qwix")
    module = qwix.apply_lora_to_model(
        module, qwix.LoraProvider(module_path=".*(q_proj|v_proj|down_proj)", rank=2, alpha=2.0))
  rng = np.random.default_rng(39)
  ids, mask, positions = _decoder_batch(rng, "holes")
  params = module.init(jax.random.key(0), ids, mask, positions)
  keys = iter(jax.random.split(jax.random.key(1), 64))
  # Adapters that change the output (qwix starts B at zero).
  params = jax.tree_util.tree_map_with_path(
      lambda path, p: 0.3 * jax.random.normal(next(keys), p.shape) if "lora" in str(path) else p,
      params)
  assert ("lora" in str(jax.tree_util.tree_structure(params))) == lora
  capacity = token_capacity(mask)
  reports = []

  def loss(params, packed):
    with _packing(capacity if packed else None, mask, reports):
      logits = module.apply(params, ids, mask, positions).logits
    return masked_causal_lm_loss(logits, ids, mask, capacity=capacity if packed else None)

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  assert_matches_dense(grad(params, True), grad(params, False))
  assert reports[0].packed == ["model", "lm_head"]


@pytest.mark.parametrize("adapter", ["lora_on_the_head", "quantized_head", "lora_elsewhere"])
def test_a_chunked_head_computes_what_the_head_computes_under_qwix(adapter):
  """qwix's LoRA or quantization-aware training (int4 weights, no parameter added) on the LM
  head changes what it computes: the loss's chunks, which would compute the rows from the
  head's kernel alone, read its packed rows instead, and the value and every gradient are
  dense's. LoRA on other layers leaves the head's rows to the chunks."""
  qwix = pytest.importorskip("qwix")
  from transformers.models.llama.modeling_flax_llama import FlaxLlamaForCausalLMModule
  module = FlaxLlamaForCausalLMModule(_decoder_config(LlamaConfig))
  if adapter == "quantized_head":
    module = qwix.quantize_model(module, qwix.QtProvider(
        [qwix.QtRule(module_path=".*lm_head", weight_qtype="int4")]))
  else:
    adapted = ".*(q_proj|lm_head)" if adapter == "lora_on_the_head" else ".*(q_proj|v_proj)"
    module = qwix.apply_lora_to_model(
        module, qwix.LoraProvider(module_path=adapted, rank=2, alpha=2.0))
  rng = np.random.default_rng(44)
  ids, mask, positions = _decoder_batch(rng, "holes")
  params = module.init(jax.random.key(0), ids, mask, positions)
  keys = iter(jax.random.split(jax.random.key(1), 64))
  params = jax.tree_util.tree_map_with_path(  # qwix starts LoRA's B at zero.
      lambda path, p: 0.3 * jax.random.normal(next(keys), p.shape) if "lora" in str(path) else p,
      params)
  capacity = token_capacity(mask)

  def loss(params, packed):
    with _packing(capacity if packed else None, mask, []):
      logits = module.apply(params, ids, mask, positions).logits
    return masked_causal_lm_loss(logits, ids, mask, head_chunk=5 if packed else None)

  packed = jax.jit(jax.value_and_grad(functools.partial(loss, packed=True))).lower(
      params).compile()
  dense = jax.jit(jax.value_and_grad(functools.partial(loss, packed=False)))(params)
  assert_matches_dense(packed(params), dense)
  chunked = f"[{capacity},{VOCAB}]" not in packed.as_text()
  assert chunked == (adapter == "lora_elsewhere")


def test_the_loss_reads_the_packed_lm_heads_rows(tiny_llama):
  """masked_causal_lm_loss on a packed LM head's logits reads its [C, V] rows: the compiled
  step holds no [B, L, V] logits, and the value and gradient are those of the scattered
  logits, for a loss mask that is the model's or a part of it. A loss mask that counts
  padding (not computed) makes the gradient NaN either way, and the packed rows' value."""
  rng = np.random.default_rng(24)
  ids, mask, positions = _decoder_batch(rng, "holes")
  capacity = int(mask.sum()) + 2

  def loss(params, loss_mask, scattered, loss_ids=ids):
    with use_sebp(top_n=capacity, active_mask=mask, packed=True, backend="xla"):
      logits = tiny_llama(ids, attention_mask=mask, position_ids=positions,
                          params=params).logits
    # A copy is not the head's output: the loss reads it whole, as before packing.
    logits = logits + 0 if scattered else logits
    return masked_causal_lm_loss(logits, loss_ids, loss_mask)

  packed_rows, scattered = (jax.jit(jax.value_and_grad(functools.partial(loss, scattered=s)))
                            .lower(tiny_llama.params, mask).compile() for s in (False, True))

  def holds_full_logits(compiled):
    hlo = compiled.as_text()
    return f"[{BATCH},{LENGTH},{VOCAB}]" in hlo or f"[{BATCH * LENGTH},{VOCAB}]" in hlo

  assert not holds_full_logits(packed_rows) and holds_full_logits(scattered)
  part = mask.copy()
  part[:, :3] = 0  # a prompt the loss leaves out
  for loss_mask in (mask, part):
    assert_matches_dense(packed_rows(tiny_llama.params, loss_mask),
                         scattered(tiny_llama.params, loss_mask))
  more = np.ones_like(mask)  # padding counted too: the padded batch's logits there differ
  for compiled in (packed_rows, scattered):
    value, grads = compiled(tiny_llama.params, more)
    assert all(np.isnan(g).any() for g in jax.tree.leaves(grads))
  assert np.isnan(packed_rows(tiny_llama.params, more)[0])


def test_the_loss_computes_a_packed_heads_rows_in_chunks(tiny_llama, monkeypatch):
  """With ``head_chunk``, the loss computes the packed LM head's rows a few at a time from its
  inputs and kernel: the compiled step holds no [C, V] logits, and the value and gradient are
  the whole rows'; ``"auto"`` chunks only above its size."""
  rng = np.random.default_rng(25)
  ids, mask, positions = _decoder_batch(rng, "left")
  capacity = int(mask.sum()) + 3

  def loss(params, head_chunk):
    with use_sebp(top_n=capacity, active_mask=mask, packed=True, backend="xla"):
      logits = tiny_llama(ids, attention_mask=mask, position_ids=positions,
                          params=params).logits
    return masked_causal_lm_loss(logits, ids, mask, head_chunk=head_chunk)

  compiled = {chunk: jax.jit(jax.value_and_grad(functools.partial(loss, head_chunk=chunk)))
              .lower(tiny_llama.params).compile() for chunk in (None, 5)}
  holds_packed_logits = lambda c: f"[{capacity},{VOCAB}]" in c.as_text()
  assert holds_packed_logits(compiled[None]) and not holds_packed_logits(compiled[5])
  whole = compiled[None](tiny_llama.params)
  assert_matches_dense(compiled[5](tiny_llama.params), whole)
  # Compiled, not run op by op (many small compiles): below its size, no chunking.
  default = jax.jit(jax.value_and_grad(functools.partial(loss, head_chunk="auto"))).lower(
      tiny_llama.params).compile()
  assert holds_packed_logits(default)
  assert_matches_dense(default(tiny_llama.params), whole)
  monkeypatch.setattr(losses, "HEAD_CHUNK_ABOVE_BYTES", 4 * VOCAB * capacity - 1)
  monkeypatch.setattr(losses, "HEAD_CHUNK_BYTES", 4 * VOCAB * 8)
  auto = jax.jit(jax.value_and_grad(functools.partial(loss, head_chunk="auto"))).lower(
      tiny_llama.params).compile()
  assert not holds_packed_logits(auto) and f"[8,{VOCAB}]" in auto.as_text()
  assert_matches_dense(auto(tiny_llama.params), whole)


@pytest.mark.parametrize("name", ["Mistral", "GPT-Neo"])
def test_sliding_window_in_rows_from_a_host_mask(request, name):
  """Row attention keeps a window of columns (Mistral's, GPT-Neo's local layer's) where the
  host mask shows rows without holes; with holes it refuses, and "auto" runs the mask
  there."""
  model = (request.getfixturevalue("tiny_mistral") if name == "Mistral"
           else _tied_decoder(name))
  rng = np.random.default_rng(17)
  capacity = BATCH * LENGTH - 6
  dense = dense_grad(lm_loss, model)
  for layout in ("right", "left"):
    ids, mask, positions = _decoder_batch(rng, layout, capacity)
    host = functools.partial(lm_loss(model, capacity, [], capacity, "rows"), mask=mask)
    got = jax.jit(jax.value_and_grad(lambda p: host(p, ids, positions=positions)))(
        model.params)
    assert_matches_dense(got, dense(model.params, ids, mask, positions))
  ids, mask, positions = _decoder_batch(rng, "holes", capacity)
  with pytest.raises(ValueError, match="sliding window .* needs rows without holes"):
    jax.grad(lm_loss(model, capacity, [], capacity, "rows"))(model.params, ids, mask,
                                                             positions)


def test_a_gpt_neo_local_layer_without_a_window_refuses():
  """window_size=0 leaves a local layer no key (its softmax spreads over every column,
  padding included): refused, not attended otherwise."""
  config = _tied_decoder("GPT-Neo").config
  model = FlaxGPTNeoForCausalLM(GPTNeoConfig(**{**config.to_dict(), "window_size": 0}),
                                seed=9)
  batch = _decoder_batch(np.random.default_rng(20), "right")
  with pytest.raises(ValueError, match="cannot pack GPT-Neo with window_size=0"):
    jax.eval_shape(lambda p: lm_loss(model, BATCH * LENGTH, [])(p, *batch), model.params)


def test_a_region_called_without_an_attention_mask_attends_over_every_token():
  """OPT's module applied with attention_mask=None attends over padding too: with padding in
  active_mask a concrete mask raises and a traced one makes the loss NaN; without padding it
  packs, exactly."""
  rng = np.random.default_rng(21)
  ids, mask, positions = _decoder_batch(rng, "left")
  opt = _tied_decoder("OPT")
  module = opt.module

  def loss(params, ids, mask, packed):
    with _packing(BATCH * LENGTH if packed else None, mask, []):
      logits = module.apply({"params": params}, ids, None, positions).logits
    return masked_causal_lm_loss(logits, ids, mask)

  with pytest.raises(ValueError, match="all ones where it is given none"):
    jax.eval_shape(lambda p: loss(p, ids, mask, True), opt.params)
  grad = jax.jit(jax.value_and_grad(loss), static_argnums=3)
  assert np.isnan(float(grad(opt.params, ids, mask, True)[0]))
  full = np.ones_like(mask)
  assert_matches_dense(grad(opt.params, ids, full, True), grad(opt.params, ids, full, False))


def test_long_packed_sequences_of_many_rows_are_exact():
  """Llama, 24 sequences of up to 200 tokens (about 2,400 real tokens in one packed
  sequence), attention over the packed sequence and in rows, against dense jax.grad."""
  rng = np.random.default_rng(19)
  model = FlaxLlamaForCausalLM(_decoder_config(LlamaConfig, layers=1,
                                               max_position_embeddings=256), seed=4)
  lengths = rng.integers(1, 201, size=(24, 1))
  mask = (np.arange(200)[None] < lengths).astype(np.int32)
  ids = _ids(rng, mask)
  positions = np.broadcast_to(np.arange(200, dtype=np.int32), mask.shape)
  capacity = token_capacity(mask)
  assert capacity > 2000
  want = dense_grad(lm_loss, model)(model.params, ids, mask, positions)
  for attention in ("mask", "rows"):
    got = packed_grad(lm_loss, model, capacity, [], loss_capacity=capacity,
                      attention=attention)(model.params, ids, mask, positions)
    assert_matches_dense(got, want)


@pytest.mark.parametrize("name", ["Mistral", "GPT-J", "Bloom"])
def test_bfloat16_error_no_larger_than_dense_bfloat16(request, name):
  """A bf16 Mistral, GPT-J (its rotary table float32) or Bloom (its ALiBi bias bf16) packed
  is as close to the float32 dense model as the dense bf16 model."""
  rng = np.random.default_rng(18)
  model = (request.getfixturevalue("tiny_mistral") if name == "Mistral"
           else _tied_decoder(name))
  bf16_model = type(model)(model.config, dtype=jnp.bfloat16, _do_init=False)
  batch = _decoder_batch(rng, "left")
  capacity = int(batch[1].sum()) + 3
  params = model.params
  reference = dense_grad(lm_loss, model)(params, *batch)
  dense_bf16 = dense_grad(lm_loss, bf16_model)(params, *batch)
  packed_bf16 = packed_grad(lm_loss, bf16_model, capacity, [], loss_capacity=capacity)(
      params, *batch)
  dense_error = _max_error(dense_bf16[1], reference[1])
  assert 1e-5 < dense_error < 0.05
  assert _max_error(packed_bf16[1], reference[1]) <= 2 * dense_error
  loss_error = lambda got: abs(float(got[0]) - float(reference[0]))
  # A slack far below bf16's resolution (2^-8): the dense bf16 loss may land close by chance.
  assert loss_error(packed_bf16) <= 2 * loss_error(dense_bf16) + 1e-4 * float(reference[0])


def test_dropout(tiny_bert):
  """train=True with a dropout rng packs: with attention dropout only, finite gradients
  other than the deterministic ones (the dropout acts on the packed probabilities); with
  every dropout probability 0, equal to dense."""
  rng = np.random.default_rng(19)
  batch = _classifier_batch(rng, tiny_bert, _mask(rng, "right"))
  capacity = int(batch[1].sum())
  key = jax.random.key(3)
  want = dense_grad(classifier_loss, tiny_bert)(tiny_bert.params, *batch)

  def train(hidden, attention):
    model = FlaxBertForSequenceClassification(
        _encoder_config(BertConfig, hidden_dropout_prob=hidden,
                        attention_probs_dropout_prob=attention), _do_init=False)
    return packed_grad(classifier_loss, model, capacity, [], train=True, dropout_rng=key)(
        tiny_bert.params, *batch)

  value, grad = train(0.0, 0.3)
  assert np.isfinite(float(value))
  assert all(np.all(np.isfinite(leaf)) for leaf in jax.tree.leaves(grad))
  assert _max_error(grad, want[1]) > 1e-3
  assert_matches_dense(train(0.0, 0.0), want)


def test_refusals_and_report(tiny_bert):
  """packed=True needs active_mask; output_attentions, a model with nothing to pack and a
  concrete mask over capacity are refused with clear errors; a traced BERT reports its
  encoder."""
  rng = np.random.default_rng(20)
  mask = _mask(rng, "right")
  ids = _ids(rng, mask)
  n = int(mask.sum())
  forward = lambda **kwargs: jax.eval_shape(
      lambda p: tiny_bert(ids, attention_mask=mask, params=p, **kwargs), tiny_bert.params)
  with pytest.raises(ValueError, match="needs active_mask"):
    use_sebp(top_n=8, packed=True)
  with pytest.raises(ValueError, match="output_attentions"):
    with use_sebp(top_n=n, active_mask=mask, packed=True):
      forward(output_attentions=True)
  with pytest.raises(ValueError, match=rf"packing capacity {n - 1} .* {n} real tokens"):
    with use_sebp(top_n=n - 1, overflow="nan", active_mask=mask, packed=True):
      pass

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(3)(x)

  x = jnp.asarray(rng.standard_normal((BATCH, LENGTH, 4)), jnp.float32)
  params = Plain().init(jax.random.key(0), x)
  with pytest.raises(RuntimeError, match="packed nothing.*DistilBERT encoder: FlaxTransformer;"):
    with use_sebp(top_n=n, active_mask=mask, packed=True):
      Plain().apply(params, x)
  with use_sebp(top_n=n, active_mask=mask, packed=True) as report:
    forward()
  assert report.packed == ["bert/encoder"] and report.capacity == n
  assert f"bert/encoder packed into {n} token slots" in report.summary()
