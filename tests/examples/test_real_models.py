"""SEBP in the real pretrained models, unmodified: gradients equal `jax.grad` (`nnx.grad` for
the NNX one) of the dense model.

top_n covers the non-padding tokens, so SEBP must drop only rows that are exactly zero. The
backend is "xla" explicitly: "auto" may pick the dense backward for these small shapes on a GPU.
"""

from contextlib import nullcontext

import jax
import numpy as np
import pytest
from flax import nnx

from examples.datasets import encode_fixed_length, load_sst2, load_wikitext2
from examples.pretrained import tunix_logits
from sebp_jax import nnx as sebp_nnx
from sebp_jax import use_sebp
from sebp_jax.losses import masked_causal_lm_loss
from tests.model_testing import assert_every_gradient_close, causal_lm_loss, classification_loss
from tests.reference import relative_error


@pytest.mark.parametrize("shared_index", [False, True], ids=["per-layer", "shared-index"])
def test_minilm_sst2_gradients(bert, shared_index):
  model, params, tokenizer = bert
  sentences = load_sst2("train", limit=4)
  batch = encode_fixed_length(tokenizer, [s for s, _ in sentences], 48)
  ids, mask = batch["input_ids"], batch["attention_mask"]
  labels = np.array([label for _, label in sentences], np.int32)
  assert mask.sum() < mask.size // 2  # mostly padding: the regime SEBP is for
  kwargs = dict(top_n=int(mask.sum()), active_mask=mask if shared_index else None, backend="xla")
  want = jax.jit(jax.grad(classification_loss(model, ids, mask, labels)))(params)
  got = jax.jit(jax.grad(classification_loss(model, ids, mask, labels, kwargs)))(params)
  assert_every_gradient_close(got, want)


def test_minilm_sst2_packed_gradients(bert):
  """The encoder packed onto the real tokens: the same gradients as the padded dense model."""
  model, params, tokenizer = bert
  sentences = load_sst2("train", limit=6)[2:]
  batch = encode_fixed_length(tokenizer, [s for s, _ in sentences], 48)
  ids, mask = batch["input_ids"], batch["attention_mask"]
  labels = np.array([label for _, label in sentences], np.int32)
  kwargs = dict(top_n=int(mask.sum()), active_mask=mask, packed=True)
  want = jax.jit(jax.grad(classification_loss(model, ids, mask, labels)))(params)
  got = jax.jit(jax.grad(classification_loss(model, ids, mask, labels, kwargs)))(params)
  assert_every_gradient_close(got, want)


@pytest.mark.slow
def test_smollm2_wikitext_packed_gradients(smollm2):
  """The decoder and LM head packed onto the real tokens (the loss on real rows): the dense
  gradients. (The mask's shared index on this model runs in Tunix's NNX Llama below; in
  Linen, on the real MiniLM above and on the tiny Llamas of tests/test_intercept.py.)"""
  model, params, tokenizer = smollm2
  paragraphs = [p for p in load_wikitext2()[:40] if 20 < len(p.split()) < 40][:2]
  batch = encode_fixed_length(tokenizer, paragraphs, 96)
  ids, mask = batch["input_ids"], batch["attention_mask"]
  assert 0 < mask.sum() < mask.size
  want = jax.jit(jax.grad(causal_lm_loss(model, ids, mask)))(params)
  kwargs = dict(top_n=int(mask.sum()), active_mask=mask, packed=True)
  got = jax.jit(jax.grad(causal_lm_loss(model, ids, mask, kwargs, capacity=int(mask.sum()))))(
      params)
  # float32 sums through 30 layers, packed and padded in different orders: up to about 2e-4
  # apart on a few elements.
  assert_every_gradient_close(got, want, rtol=4e-4)
  with use_sebp(**kwargs) as report:
    jax.eval_shape(lambda p: model(ids, attention_mask=mask, params=p), params)
  assert report.packed == ["model", "lm_head"] and report.capacity == int(mask.sum())


def test_smollm2_in_tunix_computes_what_transformers_does(smollm2, smollm2_nnx):
  """The NNX conversion (Tunix's Llama 3) against the Linen one (transformers' FlaxLlama)."""
  model, params, tokenizer = smollm2
  nnx_model, _ = smollm2_nnx
  paragraphs = [p for p in load_wikitext2()[:40] if 20 < len(p.split()) < 40][:2]
  batch = encode_fixed_length(tokenizer, paragraphs, 48)
  ids, mask = batch["input_ids"], batch["attention_mask"]
  want = model(ids, attention_mask=mask, params=params).logits
  got = tunix_logits(nnx_model, ids, mask)
  real = mask.astype(bool)
  scale = float(np.abs(want[real]).max())
  np.testing.assert_allclose(got[real], want[real], rtol=0, atol=1e-5 * scale)


@pytest.mark.slow
def test_smollm2_tunix_wikitext_gradients(smollm2_nnx):
  """SEBP on every projection of the real SmolLM2 in Tunix's NNX Llama: `nnx.grad`'s
  gradients."""
  model, tokenizer = smollm2_nnx
  paragraphs = [p for p in load_wikitext2()[:40] if 20 < len(p.split()) < 40][:2]
  batch = encode_fixed_length(tokenizer, paragraphs, 96)
  ids, mask = batch["input_ids"], batch["attention_mask"]

  def loss(model, sebp_kwargs=None):
    with (sebp_nnx.use_sebp(model, **sebp_kwargs) if sebp_kwargs else nullcontext()):
      logits = tunix_logits(model, ids, mask)
    return masked_causal_lm_loss(logits, ids, mask)

  grads = lambda *args: nnx.state(nnx.jit(nnx.grad(loss), static_argnums=1)(*args), nnx.Param)
  want = grads(model, None)
  kwargs = dict(top_n=int(mask.sum()), active_mask=mask, backend="xla")
  got = nnx.jit(lambda m: nnx.state(nnx.grad(loss)(m, kwargs), nnx.Param))(model)
  # float32 sums in another order through 30 layers move a few single entries by more than
  # rtol=1e-4 (jit vs eager dense alone reaches 1e-5 per tensor): compared tensor by tensor.
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    assert relative_error(a, b) < 1e-4, jax.tree_util.keystr(path)
