"""The README's quick start runs as written, and its gradients are the dense ones."""

import pathlib
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

from sebp_jax.losses import masked_causal_lm_loss
from tests.model_testing import assert_every_gradient_close

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks(heading: str) -> list[str]:
  section = README.read_text().split(heading + "\n", 1)[1].split("\n#", 1)[0]
  return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.slow
def test_quick_start_and_the_several_gpus_snippets_after_it_run_and_are_exact():
  """The quick start's gradients are the dense ones. Then, on the test machine's 4 host
  devices (tests/conftest.py), the several-GPUs snippets run on its batch (one run of the
  quick start for both: its BERT's compiles are most of the cost): one device's gradients,
  with each device selecting its rows, with each packing them, and with FSDP (`fsdp_loss`),
  the gradients then split as their params, and a Llama's FSDP with packing and its head
  split by its vocabulary."""
  blocks = _python_blocks("## Quick start")
  assert len(blocks) == 2
  scope = {}
  exec(compile("".join(blocks), str(README), "exec"), scope)
  model, params, ids, mask, labels = (scope[k] for k in ("model", "params", "ids", "mask",
                                                          "labels"))

  def dense_loss(params):
    logits = model.apply(params, ids)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    return jnp.sum(losses * mask) / jnp.sum(mask)

  assert_every_gradient_close(scope["grads"], jax.jit(jax.grad(dense_loss))(params))
  bert, input_ids, sentiment = scope["bert"], scope["input_ids"], scope["sentiment"]

  def bert_dense_loss(params):
    logits = bert(input_ids, attention_mask=mask, params=params).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, sentiment).mean()

  assert_every_gradient_close(scope["bert_grads"], jax.jit(jax.grad(bert_dense_loss))(
      bert.params))

  data_parallel, fsdp, decoder_fsdp = _python_blocks("### Several GPUs: `batch_axes`")
  exec(compile(data_parallel + fsdp + decoder_fsdp, str(README), "exec"), scope)
  assert scope["mesh"].size == jax.device_count() > 1
  assert_every_gradient_close(scope["dp_grads"], scope["grads"])
  assert_every_gradient_close(scope["packed_dp_grads"], scope["bert_grads"], rtol=2e-5)
  assert_every_gradient_close(scope["fsdp_grads"], scope["bert_grads"], rtol=2e-5)
  split = [g for g in jax.tree.leaves(scope["fsdp_grads"]) if not g.sharding.is_fully_replicated]
  assert split and all(g.sharding.spec[0] == "data" for g in split)
  llama = scope["llama"]

  def llama_dense_loss(params):
    logits = llama(input_ids, attention_mask=mask, params=params).logits
    return masked_causal_lm_loss(logits, input_ids, mask)

  assert_every_gradient_close(scope["lm_grads"], jax.jit(jax.grad(llama_dense_loss))(
      llama.params), rtol=2e-5)
  assert scope["lm_grads"]["lm_head"]["kernel"].sharding.spec == P(None, "data")


def test_the_ops_snippet_runs_after_the_quick_start():
  scope = {}
  exec(compile(_python_blocks("## Quick start")[0], str(README), "exec"), scope)
  (ops,) = _python_blocks("### The ops and layers")
  exec(compile(ops, str(README), "exec"), scope)
  x, kernel, bias = scope["x"], scope["kernel"], scope["bias"]
  assert jnp.array_equal(scope["y"], x @ kernel + bias)
  table = scope["params"]["params"]["Embed_0"]["embedding"]
  assert jnp.array_equal(scope["h"], table[scope["ids"]])


def test_the_nnx_snippet_runs_after_the_quick_start_and_is_exact():
  from flax import nnx

  scope = {}
  exec(compile(_python_blocks("## Quick start")[0], str(README), "exec"), scope)
  (snippet,) = _python_blocks("### Flax NNX: `sebp_jax.nnx`")
  exec(compile(snippet, str(README), "exec"), scope)
  tagger, ids, mask, labels = (scope[k] for k in ("tagger", "ids", "mask", "labels"))

  def dense_loss(model):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(ids), labels)
    return jnp.sum(losses * mask) / jnp.sum(mask)

  want = nnx.state(nnx.grad(dense_loss)(tagger), nnx.Param)
  assert_every_gradient_close(nnx.state(scope["nnx_grads"], nnx.Param), want)
