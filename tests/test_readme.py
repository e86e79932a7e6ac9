"""The README's quick start runs as written, and its gradients are the dense ones."""

import pathlib
import re

import jax
import jax.numpy as jnp
import optax

from tests.model_testing import assert_every_gradient_close

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _quick_start_blocks() -> list[str]:
  section = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_quick_start_runs_and_is_exact():
  blocks = _quick_start_blocks()
  assert len(blocks) == 2
  scope = {}
  exec(compile("".join(blocks), str(README), "exec"), scope)
  model, params, ids, mask, labels = (scope[k] for k in ("model", "params", "ids", "mask",
                                                          "labels"))

  def dense_loss(params):
    logits = model.apply(params, ids)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(losses * mask) / jnp.sum(mask)

  assert_every_gradient_close(scope["grads"], jax.grad(dense_loss)(params))
  bert, input_ids, sentiment = scope["bert"], scope["input_ids"], scope["sentiment"]

  def bert_dense_loss(params):
    logits = bert(input_ids, attention_mask=mask, params=params).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, sentiment).mean()

  assert_every_gradient_close(scope["bert_grads"], jax.grad(bert_dense_loss)(bert.params))
