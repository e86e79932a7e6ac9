"""Shared by the model tests: loss builders (dense, or under `use_sebp` when given its kwargs),
the gradient comparison, and the branches of a jaxpr."""

import contextlib

import jax
import numpy as np
import optax
from jax.extend.core import jaxprs_in_params

from sebp_jax import use_sebp
from sebp_jax.losses import masked_causal_lm_loss


def _context(sebp_kwargs):
  return use_sebp(**sebp_kwargs) if sebp_kwargs is not None else contextlib.nullcontext()


def classification_loss(model, ids, mask, labels, sebp_kwargs=None):
  def loss(params):
    with _context(sebp_kwargs):
      logits = model(ids, attention_mask=mask, params=params).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
  return loss


def causal_lm_loss(model, ids, mask, sebp_kwargs=None, capacity=None):
  def loss(params):
    with _context(sebp_kwargs):
      logits = model(ids, attention_mask=mask, params=params).logits
    return masked_causal_lm_loss(logits, ids, mask, capacity=capacity)
  return loss


def assert_every_gradient_close(got, want, rtol=1e-4):
  """rtol per parameter; the atol (1e-6 of the largest gradient) only absorbs float32 noise
  around gradients that are zero in exact arithmetic (e.g. the attention key bias)."""
  scale = max(float(np.max(np.abs(leaf))) for leaf in jax.tree.leaves(want))
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-6 * scale)


def branches(jaxpr) -> list[str]:
  """The ``cond`` / ``while`` primitives of a jaxpr and its sub-jaxprs, outside Pallas kernels
  (a branch inside a kernel is the kernel's own, not one between XLA programs; a Mosaic GPU
  kernel traces as a ``core_map`` / ``mpmd_map`` over its SMs)."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("pallas_call", "core_map", "mpmd_map"):
      continue
    if eqn.primitive.name in ("cond", "while"):
      found.append(eqn.primitive.name)
    for sub in jaxprs_in_params(eqn.params):
      found += branches(sub)
  return found


def assert_tables_cross_as_rows(sebp: tuple[dict, dict], dense: tuple[dict, dict],
                                table_bytes: int, scalar_bytes: int = 0) -> None:
  """``(collective counts, collective bytes)`` of a compiled SEBP step and of the dense one
  (:func:`sebp_jax.sharding.collective_counts` / ``collective_bytes``): the same, except that
  tables of ``table_bytes`` in all get their gradients from the devices' kept rows of dY,
  gathered: all-gathers added, the all-reduces as many and smaller by those tables (give or
  take ``scalar_bytes`` of scalars summed), the rows gathered far fewer bytes than the
  tables."""
  (sebp_counts, sebp_bytes), (dense_counts, dense_bytes) = sebp, dense
  assert ({kind: n for kind, n in sebp_counts.items() if kind != "all-gather"}
          == {kind: n for kind, n in dense_counts.items() if kind != "all-gather"})
  assert sebp_counts["all-gather"] > dense_counts.get("all-gather", 0)
  assert abs(dense_bytes["all-reduce"] - sebp_bytes["all-reduce"] - table_bytes) <= scalar_bytes
  gathered = sebp_bytes["all-gather"] - dense_bytes.get("all-gather", 0)
  assert 0 < gathered < table_bytes / 2

