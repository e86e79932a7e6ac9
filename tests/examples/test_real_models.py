"""SEBP in the real pretrained models, unmodified: gradients equal `jax.grad` of the dense model.

top_n covers the non-padding tokens, so SEBP must drop only rows that are exactly zero. The
backend is "xla" explicitly: "auto" may pick the dense backward for these small shapes on a GPU.
"""

import jax
import numpy as np
import pytest

from examples.datasets import encode_fixed_length, load_sst2, load_wikitext2
from sebp_jax import use_sebp
from tests.model_testing import assert_every_gradient_close, causal_lm_loss, classification_loss


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
  """The decoder and LM head packed onto the real tokens, the loss on real rows."""
  model, params, tokenizer = smollm2
  paragraphs = [p for p in load_wikitext2()[40:120] if 10 < len(p.split()) < 40][:3]
  batch = encode_fixed_length(tokenizer, paragraphs, 80)
  ids, mask = batch["input_ids"], batch["attention_mask"]
  kwargs = dict(top_n=int(mask.sum()), active_mask=mask, packed=True)
  want = jax.jit(jax.grad(causal_lm_loss(model, ids, mask)))(params)
  got = jax.jit(jax.grad(causal_lm_loss(model, ids, mask, kwargs, capacity=int(mask.sum()))))(
      params)
  assert_every_gradient_close(got, want)
  with use_sebp(**kwargs) as report:
    jax.eval_shape(lambda p: model(ids, attention_mask=mask, params=p), params)
  assert report.packed == ["model", "lm_head"] and report.capacity == int(mask.sum())


@pytest.mark.slow
def test_smollm2_wikitext_gradients(smollm2):
  model, params, tokenizer = smollm2
  paragraphs = [p for p in load_wikitext2()[:40] if 20 < len(p.split()) < 40][:2]
  batch = encode_fixed_length(tokenizer, paragraphs, 96)
  ids, mask = batch["input_ids"], batch["attention_mask"]
  assert 0 < mask.sum() < mask.size
  # The LM head too: under the masked loss its padding rows of dY are exactly zero as well.
  kwargs = dict(top_n=int(mask.sum()), active_mask=mask, lm_head=True, backend="xla")
  want = jax.jit(jax.grad(causal_lm_loss(model, ids, mask)))(params)
  got = jax.jit(jax.grad(causal_lm_loss(model, ids, mask, kwargs)))(params)
  assert_every_gradient_close(got, want)
  with use_sebp(**kwargs) as report:
    jax.eval_shape(lambda p: model(ids, attention_mask=mask, params=p), params)
  assert "lm_head" in report.shared_index and report.num_swapped == 30 * 7 + 1
