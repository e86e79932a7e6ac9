"""Flax NNX: `SEBPLinear` / `SEBPEmbed` as drop-ins, and `sebp_jax.nnx.use_sebp` on NNX models
whose code it does not touch, under nnx.jit / nnx.grad / nnx.scan / nnx.remat.

Tests comparing SEBP with dense ask for backend="xla" (on a GPU "auto" runs tiny layers
dense)."""

import collections
import contextlib

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sebp_jax import RowLog
from sebp_jax import nnx as sebp_nnx
from sebp_jax import use_sebp as linen_use_sebp
from tests.model_testing import assert_every_gradient_close
from tests.reference import (random_sparse_rows, reference_active_rows, reference_backward,
                             reference_table_grad, relative_error)


def _grads(model, loss, *args):
  return nnx.state(nnx.grad(loss)(model, *args), nnx.Param)


@pytest.mark.parametrize("use_bias", [True, False])
@pytest.mark.parametrize("top_n", ["auto", 30, 0.5])
def test_sebp_linear_is_a_drop_in_with_the_reference_backward(use_bias, top_n):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((3, 20, 16)), jnp.float32)
  dy = jnp.asarray(random_sparse_rows(rng, 60, 8, 25).reshape(3, 20, 8))
  dense = nnx.Linear(16, 8, use_bias=use_bias, rngs=nnx.Rngs(1))
  sebp = sebp_nnx.SEBPLinear(16, 8, use_bias=use_bias, top_n=top_n, backend="xla",
                             rngs=nnx.Rngs(1))
  assert isinstance(sebp, nnx.Linear)
  for a, b in zip(jax.tree.leaves(nnx.state(dense)), jax.tree.leaves(nnx.state(sebp))):
    np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(sebp(x), dense(x))

  _, vjp = jax.vjp(lambda s, x: nnx.merge(nnx.graphdef(sebp), s)(x), nnx.state(sebp), x)
  d_state, dx = vjp(dy)
  rows = np.flatnonzero(np.asarray(dy).reshape(60, 8).any(axis=1))
  want_dx, want_dw, want_db = reference_backward(np.asarray(x).reshape(60, 16),
                                                 np.asarray(sebp.kernel[...]),
                                                 np.asarray(dy).reshape(60, 8), rows)
  assert relative_error(dx.reshape(60, 16), want_dx) < 1e-6
  assert relative_error(d_state["kernel"][...], want_dw) < 1e-6
  if use_bias:
    assert relative_error(d_state["bias"][...], want_db) < 1e-6


def test_an_empty_batch_gives_empty_outputs_and_zero_gradients():
  """A batch of no rows, as `nnx.Linear` takes it: `SEBPLinear` and a `use_sebp` model give
  its empty outputs and the dense gradients, zero."""
  x = jnp.ones((0, 7, 3))
  for top_n in ("auto", 4):
    layer = sebp_nnx.SEBPLinear(3, 4, top_n=top_n, backend="xla", rngs=nnx.Rngs(0))
    assert layer(x).shape == (0, 7, 4)
  model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1)))

  def loss(model, sebp):
    if not sebp:
      return jnp.sum(model(x))
    with sebp_nnx.use_sebp(model, backend="xla"):
      return jnp.sum(model(x))

  want = _grads(model, loss, False)
  got = _grads(model, loss, True)
  assert_every_gradient_close(got, want)
  assert all(not np.any(g) for g in jax.tree.leaves(got))


def test_sebp_linear_with_a_small_capacity_drops_as_the_paper_does():
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((40, 12)), jnp.float32)
  dy = jnp.asarray(random_sparse_rows(rng, 40, 6, 30))
  layer = sebp_nnx.SEBPLinear(12, 6, top_n=8, overflow="drop", backend="xla", rngs=nnx.Rngs(0))
  _, vjp = jax.vjp(lambda s: nnx.merge(nnx.graphdef(layer), s)(x), nnx.state(layer))
  (d_state,) = vjp(dy)
  rows = reference_active_rows(np.asarray(dy), 8)
  _, want_dw, want_db = reference_backward(np.asarray(x), np.asarray(layer.kernel[...]),
                                           np.asarray(dy), rows)
  assert relative_error(d_state["kernel"][...], want_dw) < 1e-6
  assert relative_error(d_state["bias"][...], want_db) < 1e-6


@pytest.mark.parametrize("layer", ["SEBPLinear", "SEBPEmbed"])
def test_a_fraction_and_a_row_count_of_equal_value_are_different_drop_ins(layer):
  """`top_n=1.0` (every row) and `top_n=1` (one row) make different graph definitions, so
  `nnx.jit` compiles each: every row's gradient is `nnx.grad`'s of the plain layer after one
  row's was compiled, which drops the others."""
  rng = np.random.default_rng(11)
  if layer == "SEBPLinear":
    make = lambda cls, **kw: cls(8, 4, rngs=nnx.Rngs(0), **kw)
    plain, sebp = nnx.Linear, sebp_nnx.SEBPLinear
    inputs = jnp.asarray(rng.standard_normal((6, 8)), jnp.float32)
  else:
    make = lambda cls, **kw: cls(12, 4, rngs=nnx.Rngs(0), **kw)
    plain, sebp = nnx.Embed, sebp_nnx.SEBPEmbed
    inputs = jnp.asarray(rng.integers(0, 12, 6), jnp.int32)
  weights = jnp.asarray(rng.standard_normal((6, 4)), jnp.float32)
  loss = lambda module, inputs: jnp.sum(jnp.sin(module(inputs)) * weights)
  step = nnx.jit(nnx.grad(loss))
  one, every = (make(sebp, top_n=top_n, overflow="drop") for top_n in (1, 1.0))
  assert nnx.graphdef(one) != nnx.graphdef(every)
  want = nnx.grad(loss)(make(plain), inputs)
  starved = step(one, inputs)
  got = step(every, inputs)
  for got_leaf, want_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-6)
  assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(starved),
                                                   jax.tree.leaves(want)))


def test_sebp_embed_is_a_drop_in_with_the_reference_backward():
  rng = np.random.default_rng(2)
  ids = jnp.asarray(rng.integers(0, 30, (4, 9)))
  dy = jnp.asarray(random_sparse_rows(rng, 36, 5, 12).reshape(4, 9, 5))
  dense = nnx.Embed(30, 5, rngs=nnx.Rngs(3))
  sebp = sebp_nnx.SEBPEmbed(30, 5, top_n=16, rngs=nnx.Rngs(3))
  np.testing.assert_array_equal(sebp(ids), dense(ids))
  np.testing.assert_array_equal(sebp.attend(jnp.ones((2, 5))), dense.attend(jnp.ones((2, 5))))
  _, vjp = jax.vjp(lambda s: nnx.merge(nnx.graphdef(sebp), s)(ids), nnx.state(sebp))
  (d_state,) = vjp(dy)
  rows = np.flatnonzero(np.asarray(dy).reshape(36, 5).any(axis=1))
  want = reference_table_grad(30, np.asarray(ids).reshape(-1), np.asarray(dy).reshape(36, 5),
                              rows)
  assert relative_error(d_state["embedding"][...], want) < 1e-6
  with pytest.raises(ValueError, match="integer"):
    sebp(jnp.ones((2,), jnp.float32))


def test_the_layers_log_their_rows_under_nnx_jit():
  log = RowLog()
  layer = sebp_nnx.SEBPLinear(8, 4, top_n=16, backend="xla", row_log=log, rngs=nnx.Rngs(0))
  embed = sebp_nnx.SEBPEmbed(20, 8, top_n=16, row_log=log, rngs=nnx.Rngs(1))
  ids = jnp.asarray(np.random.default_rng(3).integers(0, 20, (2, 12)))
  loss = lambda layer, embed: jnp.sum(layer(embed(ids))[:, :5] ** 2)
  nnx.jit(nnx.grad(loss, argnums=(0, 1)))(layer, embed)
  jax.effects_barrier()
  assert [(r["layer"], r["active"], r["kept"]) for r in log.records] == [
      ("SEBPLinear", 10, 10), ("SEBPEmbed", 10, 10)]


def test_layer_options_are_checked():
  with pytest.raises(ValueError, match="overflow"):
    sebp_nnx.SEBPLinear(4, 4, overflow="clip", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dot_general"):
    sebp_nnx.SEBPLinear(4, 4, dot_general=lambda *a, **k: None, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="kept fraction"):
    sebp_nnx.SEBPEmbed(4, 4, top_n=2.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="row_log"):
    sebp_nnx.SEBPLinear(4, 4, row_log="log", rngs=nnx.Rngs(0))
  # nnx.Linear would give float32 out of bfloat16 params; SEBPLinear would silently not.
  with pytest.raises(ValueError, match="preferred_element_type"):
    sebp_nnx.SEBPLinear(4, 4, preferred_element_type=jnp.float32, rngs=nnx.Rngs(0))


def test_inputs_whose_contracted_dims_differ_from_the_kernels_raise():
  """[H, N] where the kernel contracts [N, H], of the same size: the dense einsum refuses it,
  and so does the swapped one, where a reshape to rows would read it in the wrong order."""
  einsum = nnx.Einsum("BTNH,NHD->BTD", (2, 4, 8), rngs=nnx.Rngs(0))
  transposed = jnp.ones((2, 3, 4, 2))
  with pytest.raises(ValueError):
    einsum(transposed)
  with sebp_nnx.use_sebp(einsum, top_n=6, backend="xla"):
    with pytest.raises(ValueError, match=r"inputs of shape \(2, 3, 4, 2\) do not end in the "
                                         r"kernel's contracted dims \(2, 4\)"):
      einsum(transposed)
    assert einsum(jnp.ones((2, 3, 2, 4))).shape == (2, 3, 8)
  linear = sebp_nnx.SEBPLinear(4, 3, top_n=2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="contracted dims"):
    linear(jnp.ones((2, 5)))


@pytest.mark.parametrize("spec,expected", [
    ("BTD,DNH->BTNH", (2, 1)), ("BTNH,NHD->BTD", (2, 2)), ("td,df->tf", (1, 1)),
    ("B T D , D V -> B T V", (2, 1)),
])
def test_einsums_that_are_linear_maps_of_rows(spec, expected):
  row_map = sebp_nnx.einsum_row_map(spec)
  assert (row_map.row_dims, row_map.contracted_dims) == expected


@pytest.mark.parametrize("spec", [
    "BTD,NHD->BTNH",   # kernel's contracted dim is not its leading one
    "BTD,DH->BHT",     # output dims reordered
    "BTD,BDH->BTH",    # a batch dim in the kernel (per-example weights)
    "...D,DH->...H",   # ellipsis
    "BTD,DH",          # implicit output
    "BTDD,DH->BTH",    # repeated index
    "BT,H->BTH",       # nothing contracted: an outer product
])
def test_other_einsums_are_not(spec):
  assert isinstance(sebp_nnx.einsum_row_map(spec), str)


class Block(nnx.Module):
  """Attention-like einsums with heads and an MLP of nnx.Linear: every swappable kind."""

  def __init__(self, dim, rngs):
    self.q = nnx.Einsum("BTD,DNH->BTNH", (dim, 2, dim // 2), (2, dim // 2), rngs=rngs)
    self.o = nnx.Einsum("BTNH,NHD->BTD", (2, dim // 2, dim), rngs=rngs)
    self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
    self.down = nnx.Linear(2 * dim, dim, use_bias=False, rngs=rngs)

  def __call__(self, x):
    x = x + self.o(jnp.tanh(self.q(x)))
    return x + self.down(jax.nn.gelu(self.up(x)))


class TinyLM(nnx.Module):
  """Embedding, `num_layers` blocks created with nnx.vmap and run with nnx.scan (optionally
  under nnx.remat), and an LM head."""

  def __init__(self, rngs, dim=16, vocab=40, num_layers=3, remat=False):
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)

    @nnx.split_rngs(splits=num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return Block(dim, rngs)

    self.blocks = make_blocks(rngs)
    self.lm_head = nnx.Linear(dim, vocab, rngs=rngs)
    self.remat = remat

  def __call__(self, ids):
    def step(x, block):
      return block(x)

    step = nnx.remat(step) if self.remat else step
    x = nnx.scan(step, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(self.embed(ids), self.blocks)
    return self.lm_head(x)


def _batch(seed, batch=3, length=10, vocab=40):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, length, size=batch)
  mask = np.arange(length)[None] < lengths[:, None]
  return jnp.asarray(rng.integers(0, vocab, (batch, length)) * mask), mask


def _masked_loss(model, ids, mask, sebp_kwargs=None):
  """Squared logits summed over real tokens: dY rows of padding are exactly zero."""
  if sebp_kwargs is None:
    logits = model(ids)
  else:
    with sebp_nnx.use_sebp(model, **sebp_kwargs):
      logits = model(ids)
  return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2) / 100


@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("shared_index", [False, True])
@pytest.mark.parametrize("top_n", ["auto", 12])
def test_gradients_equal_nnx_grad_under_jit_scan_and_remat(remat, shared_index, top_n):
  model = TinyLM(nnx.Rngs(0), remat=remat)
  ids, mask = _batch(1)
  kwargs = dict(top_n=top_n, lm_head=True, backend="xla",
                active_mask=mask if shared_index else None)
  want = _grads(model, _masked_loss, ids, mask)
  got = nnx.jit(lambda m: _grads(m, _masked_loss, ids, mask, kwargs))(model)
  assert_every_gradient_close(got, want)


def test_the_model_is_exactly_as_it_was_afterwards():
  model = TinyLM(nnx.Rngs(0))
  ids, mask = _batch(2)
  graphdef, state = nnx.split(model)
  variables = {path: var for path, var in nnx.iter_graph(model) if isinstance(var, nnx.Variable)}
  classes = {path: type(node) for path, node in nnx.iter_modules(model)}
  with sebp_nnx.use_sebp(model, active_mask=mask, lm_head=True, backend="xla") as report:
    assert type(model.lm_head).__name__ == "SEBPSwappedLinear"
    assert isinstance(model.lm_head, nnx.Linear)
    model(ids)
  assert nnx.graphdef(model) == graphdef
  assert {path: type(node) for path, node in nnx.iter_modules(model)} == classes
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Variable):
      assert var is variables[path]
  jax.tree.map(np.testing.assert_array_equal, nnx.state(model), state)
  assert report.swapped == ["blocks/down", "blocks/o", "blocks/q", "blocks/up", "lm_head"]
  assert report.embeddings == ["embed"]
  assert sorted(report.shared_index) == sorted(report.swapped + report.embeddings)
  # Also when the model's forward raises.
  with pytest.raises(ZeroDivisionError):
    with sebp_nnx.use_sebp(model):
      raise ZeroDivisionError
  assert nnx.graphdef(model) == graphdef


def test_the_default_leaves_the_lm_head_dense_and_exclude_picks_layers():
  model = TinyLM(nnx.Rngs(0))
  ids, _ = _batch(3)
  with sebp_nnx.use_sebp(model, exclude=r"(^|/)(up|lm_head)$", embeddings=False) as report:
    model(ids)
  assert report.swapped == ["blocks/down", "blocks/o", "blocks/q"]
  assert report.skipped == {"blocks/up": "matched by exclude", "lm_head": "matched by exclude"}
  assert report.embeddings == []
  with sebp_nnx.use_sebp(model) as report:
    model(ids)
  assert report.skipped == {"lm_head": "matched by exclude"}


def test_entered_outside_nnx_jit_it_compiles_per_mask_and_options():
  model = TinyLM(nnx.Rngs(4))
  ids, mask = _batch(4)
  traces = []

  @nnx.jit
  def grads(model, ids, mask):
    traces.append(1)
    return _grads(model, _masked_loss, ids, mask)

  want = grads(model, ids, mask)
  for _ in range(2):  # The second time from the cache: same classes, options and mask.
    with sebp_nnx.use_sebp(model, active_mask=mask, backend="xla"):
      got = grads(model, ids, mask)
    assert_every_gradient_close(got, want)
  assert len(traces) == 2
  # Another mask: a new program, not the first one's index.
  other = mask.copy()
  other[0, :] = True
  with sebp_nnx.use_sebp(model, active_mask=other, backend="xla"):
    got = grads(model, ids, other)
  assert_every_gradient_close(got, _grads(model, _masked_loss, ids, other))
  assert len(traces) == 3
  # The dense program again after the context: the cached dense one.
  grads(model, ids, mask)
  assert len(traces) == 3


def test_a_registered_einsum_layer_of_another_library():
  class LibraryEinsum(nnx.Module):  # as in Tunix: its own einsum layer, weight `w`
    def __init__(self, spec, shape, rngs):
      self.spec = spec
      self.w = nnx.Param(jax.random.normal(rngs.params(), shape))

    def __call__(self, x):
      return jnp.einsum(self.spec, x, self.w[...])

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(40, 8, rngs=rngs)
      self.proj = LibraryEinsum("BTD,DNH->BTNH", (8, 2, 4), rngs)
      self.out = LibraryEinsum("BTNH,NHV->BTV", (2, 4, 40), rngs)

    def __call__(self, ids):
      return self.out(jnp.tanh(self.proj(self.embed(ids))))

  model = Model(nnx.Rngs(5))
  ids, mask = _batch(5)
  with sebp_nnx.use_sebp(model, embeddings=False, require_swaps=False) as report:
    model(ids)
  assert report.swapped == []
  sebp_nnx.register_einsum(LibraryEinsum, kernel="w", einsum_str="spec")
  want = _grads(model, _masked_loss, ids, mask)
  got = _grads(model, _masked_loss, ids, mask, dict(active_mask=mask, backend="xla"))
  assert_every_gradient_close(got, want)
  with sebp_nnx.use_sebp(model, active_mask=mask) as report:
    model(ids)
  assert report.swapped == ["out", "proj"]
  with pytest.raises(ValueError, match="nnx.Module subclass"):
    sebp_nnx.register_einsum(int)


class _DoubledEinsum(nnx.Einsum):
  def __call__(self, inputs):
    return 2 * super().__call__(inputs)


def test_layers_it_cannot_run_stay_dense_with_the_reason():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.custom = nnx.Linear(8, 8, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k),
                               rngs=rngs)
      self.transposed = nnx.Einsum("BTD,DH->BHT", (8, 4), rngs=rngs)
      self.plain = nnx.Linear(8, 8, rngs=rngs)
      self.sharded = nnx.Linear(8, 8, rngs=rngs)
      self.lora = nnx.LoRALinear(8, 8, lora_rank=2, rngs=rngs)
      self.general = nnx.LinearGeneral(8, (2, 4), rngs=rngs)
      self.doubled = _DoubledEinsum("BTD,DF->BTF", (8, 8), rngs=rngs)

    def __call__(self, x):
      y = self.plain(self.custom(x)) + self.lora(x) + self.general(x).reshape(x.shape)
      y = y + self.doubled(x)
      return self.sharded(y, out_sharding=None) + jnp.sum(self.transposed(x))

  model = Model(nnx.Rngs(0))
  x = jnp.ones((2, 3, 8))
  with sebp_nnx.use_sebp(model) as report:
    model(x)
  assert report.skipped["custom"] == "custom dot_general (e.g. fp8/quantized)"
  assert "not a linear map of rows" in report.skipped["transposed"]
  assert report.skipped["lora"] == "a subclass with its own __call__"
  assert report.skipped["general"] == "nnx.LinearGeneral (not swapped)"
  assert report.skipped["doubled"] == "a subclass with its own __call__"
  assert report.swapped == ["plain", "sharded"]


class _Tagger(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(40, 16, rngs=rngs)
    self.up = nnx.Linear(16, 32, rngs=rngs)
    self.down = nnx.Linear(32, 16, rngs=rngs)

  def __call__(self, ids):
    return self.down(jnp.tanh(self.up(self.embed(ids))))


def test_layers_holding_parameters_they_do_not_read_stay_dense():
  """qwix's LoRA (Tunix's) puts its adapters on the layer and adds their term to its output
  by intercepting its ops: the SEBP backward, which knows the kernel and bias alone, would
  drop that term's part of dX (the base weights' gradients silently off with the adapters
  frozen, a leaked tracer with them trained). Such layers stay dense, with the reason."""
  qwix = pytest.importorskip("qwix")
  ids, mask = _batch(8)
  model = qwix.apply_lora_to_model(
      _Tagger(nnx.Rngs(0)), qwix.LoraProvider(module_path=".*(up|down)", rank=2, alpha=2.0),
      ids, rngs=nnx.Rngs(1))
  keys = iter(jax.random.split(jax.random.key(2), 4))
  for _, variable in nnx.iter_graph(model):
    if isinstance(variable, nnx.LoRAParam):  # Adapters that change the output.
      variable[...] = jax.random.normal(next(keys), variable[...].shape)
  reports = []

  def loss(model, sebp):
    with sebp_nnx.use_sebp(model, active_mask=mask, backend="xla") if sebp else (
        contextlib.nullcontext()) as report:
      reports.append(report)
      logits = model(ids)
    return jnp.sum(jnp.where(mask[..., None], logits, 0.0) ** 2) / 100

  for trained in (nnx.LoRAParam, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))):
    grads = lambda sebp: nnx.state(
        nnx.grad(loss, argnums=nnx.DiffState(0, trained))(model, sebp), nnx.Param)
    assert_every_gradient_close(grads(True), grads(False))
  assert reports[0].swapped == [] and reports[0].embeddings == ["embed"]
  for path in ("up", "down"):
    assert reports[0].skipped[path].startswith(
        "parameters its computation does not read (kernel_lora_a, kernel_lora_b)")
  plain = _Tagger(nnx.Rngs(0))
  plain.up.scale = nnx.Param(jnp.ones(()))  # Any parameter the layer's own code leaves unread.
  with sebp_nnx.use_sebp(plain) as report:
    plain(ids)
  assert report.swapped == ["down"] and "(scale)" in report.skipped["up"]


def test_layers_are_called_as_their_own_call_takes_them():
  """A custom promote_dtype written to flax's signature (no ``inexact``), the input given by
  keyword under the name of the layer's own ``__call__``, and extra arguments given by
  position (left dense, named in the report)."""
  def promote(arrays, *, dtype):
    return tuple(None if a is None else jnp.asarray(a, dtype or jnp.float32) for a in arrays)

  class LibraryEinsum(nnx.Module):
    def __init__(self, rngs):
      self.spec = "BTD,DF->BTF"
      self.w = nnx.Param(jax.random.normal(rngs.params(), (16, 16)))

    def __call__(self, x, scale=None):
      return jnp.einsum(self.spec, x, self.w[...]) * (1 if scale is None else scale)

  class StarredEinsum(LibraryEinsum):  # Its input among *inputs: no argument of its own.
    def __call__(self, *inputs):
      return jnp.einsum(self.spec, inputs[0], self.w[...])

  for cls in (LibraryEinsum, StarredEinsum):
    sebp_nnx.register_einsum(cls, kernel="w", einsum_str="spec")

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(40, 16, rngs=rngs)
      self.linear = nnx.Linear(16, 16, promote_dtype=promote, rngs=rngs)
      self.einsum = nnx.Einsum("BTD,DF->BTF", (16, 16), (16,), promote_dtype=promote,
                               rngs=rngs)
      self.library = LibraryEinsum(rngs)
      self.scaled = LibraryEinsum(rngs)
      self.starred = StarredEinsum(rngs)

    def __call__(self, ids):
      h = self.embed(ids)
      h = jnp.tanh(self.linear(inputs=h)) + self.einsum(h)
      return self.library(x=h) + self.scaled(h, 2.0) + self.starred(h)

  model = Model(nnx.Rngs(3))
  ids, mask = _batch(9)
  want = _grads(model, _masked_loss, ids, mask)
  got = _grads(model, _masked_loss, ids, mask, dict(active_mask=mask, backend="xla"))
  assert_every_gradient_close(got, want)
  with sebp_nnx.use_sebp(model, active_mask=mask) as report:
    model(ids)
  assert report.swapped == ["einsum", "library", "linear", "scaled", "starred"]
  assert report.skipped == {"scaled": "called with extra arguments ['scale']",
                            "starred": "called without an input argument of its own to read"}


def test_the_drop_ins_run_their_own_sebp_inside_a_context():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = sebp_nnx.SEBPEmbed(40, 16, top_n=30, rngs=rngs)
      self.own = sebp_nnx.SEBPLinear(16, 16, top_n=30, rngs=rngs)
      self.plain = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, ids):
      return self.plain(jnp.tanh(self.own(self.embed(ids))))

  model = Model(nnx.Rngs(4))
  ids, mask = _batch(10)
  exact = _grads(model, _masked_loss, ids, mask)
  got = _grads(model, _masked_loss, ids, mask, dict(active_mask=mask, backend="xla"))
  assert_every_gradient_close(got, exact)
  # Their own options: a capacity that drops rows changes the drop-in's gradient alike, in a
  # context and outside it.
  model.own.top_n, model.own.overflow = 2, "drop"
  dropped = _grads(model, _masked_loss, ids, mask)
  got = _grads(model, _masked_loss, ids, mask, dict(active_mask=mask, backend="xla"))
  assert_every_gradient_close(got, dropped)
  assert not np.allclose(dropped["own"]["kernel"][...], exact["own"]["kernel"][...])
  with sebp_nnx.use_sebp(model, active_mask=mask) as report:
    model(ids)
  assert report.swapped == ["plain"] and report.embeddings == [] and report.skipped == {}


def test_a_copy_made_inside_a_context_is_listed_by_another():
  """nnx.clone inside a context keeps its swapped classes: another context's report lists the
  copy's layers as running dense, and its gradient is the dense one."""
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.first, self.second = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
      return self.second(jnp.tanh(self.first(x)))

  model = Model(nnx.Rngs(0))
  x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 5, 8)), jnp.float32)
  with sebp_nnx.use_sebp(model, include="^first$"):
    model(x)
    copy = nnx.clone(model)
  assert type(copy.first).__name__ == "SEBPSwappedLinear"
  want = nnx.grad(lambda m: jnp.sum(jnp.sin(m(x))))(model)
  reports = []

  def loss(m):
    with sebp_nnx.use_sebp(m, threshold=0.5) as report:
      reports.append(report)
      return jnp.sum(jnp.sin(m(x)))

  got = nnx.grad(loss)(copy)
  assert reports[0].swapped == ["second"]
  assert "a copy swapped by another use_sebp" in reports[0].skipped["first"]
  np.testing.assert_allclose(got.first.kernel[...], want.first.kernel[...], rtol=1e-6)


def test_bad_use_is_loud():
  model = TinyLM(nnx.Rngs(0))
  ids, mask = _batch(6)
  with pytest.raises(ValueError, match="nnx.Module"):
    sebp_nnx.use_sebp({"params": 1})
  with pytest.raises(RuntimeError, match="no linear layer to swap"):
    with sebp_nnx.use_sebp(model, include="no_such_layer"):
      pass
  assert nnx.graphdef(model) == nnx.graphdef(TinyLM(nnx.Rngs(0)))
  with pytest.raises(RuntimeError, match="do not nest"):
    with sebp_nnx.use_sebp(model):
      with linen_use_sebp():
        pass
  with pytest.raises(RuntimeError, match="matched no layer"):
    with sebp_nnx.use_sebp(model, active_mask=mask.T):
      model(ids)
  # nnx.grad hands the loss a copy: a context on the model outside it would leave the copy
  # dense while its report lists the outer model's layers.
  def loss_on_the_outer_model(copy):
    with sebp_nnx.use_sebp(model, active_mask=mask):
      return _masked_loss(copy, ids, mask)
  with pytest.raises(RuntimeError, match="none of them ran in the context"):
    nnx.grad(loss_on_the_outer_model)(model)
  # Options no other test uses: an equal context whose step compiled before would lend its
  # report (a cached program runs no layer).
  with pytest.raises(RuntimeError, match="none of them ran in the context"):
    with sebp_nnx.use_sebp(model, threshold=0.125):
      pass
  # Nor does a context on another model take the report of one whose layers ran.
  with sebp_nnx.use_sebp(model, threshold=0.375):
    model(ids)
  with pytest.raises(RuntimeError, match="none of them ran in the context"):
    with sebp_nnx.use_sebp(nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0))),
                           threshold=0.375):
      pass
  with sebp_nnx.use_sebp(model, require_swaps=False):
    kept = nnx.merge(*nnx.split(model.blocks))  # a copy of swapped layers, kept past it
  # Outside its context a swapped layer runs its own forward.
  run = nnx.scan(lambda x, b: b(x), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
  np.testing.assert_array_equal(run(jnp.ones((3, 10, 16)), kept),
                                run(jnp.ones((3, 10, 16)), model.blocks))


def test_overflow_and_the_row_log():
  model = TinyLM(nnx.Rngs(7))
  ids, mask = _batch(7)
  num_real = int(mask.sum())
  log = RowLog()
  with pytest.raises(ValueError, match="more than top_n"):
    with sebp_nnx.use_sebp(model, top_n=num_real - 1, overflow="nan", active_mask=mask):
      pass
  want = _grads(model, _masked_loss, ids, mask)
  got = _grads(model, _masked_loss, ids, mask,
               dict(top_n=num_real - 1, active_mask=jnp.asarray(mask), backend="xla",
                    row_log=log))
  # Exact by default whatever top_n.
  assert_every_gradient_close(got, want)
  jax.block_until_ready(got)
  layers = {record["layer"] for record in log.records}
  assert layers == {"blocks/down", "blocks/o", "blocks/q", "blocks/up", "embed"}
  assert all(record["active"] == num_real for record in log.records)
  nan = nnx.jit(lambda m, mask: _grads(m, _masked_loss, ids, mask, dict(
      top_n=num_real - 1, overflow="nan", active_mask=mask, backend="xla")))(model, mask)
  assert np.isnan(nan["blocks"]["up"]["kernel"][...]).all()


def _primitive_counts(closed_jaxpr) -> collections.Counter:
  counts = collections.Counter()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      counts[eqn.primitive.name] += 1
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(closed_jaxpr.jaxpr)
  return counts


def test_the_nnx_path_traces_the_program_of_the_linen_path():
  """The same model in Linen (nn.Embed, nn.Dense, intercepted) and NNX (nnx.Embed,
  nnx.Linear, swapped): gradients with the same primitives, so the NNX path costs what the
  Linen one does."""
  ids, mask = _batch(8)

  class LinenModel(linen.Module):
    @linen.compact
    def __call__(self, ids):
      h = jnp.tanh(linen.Dense(12)(linen.Embed(40, 16)(ids)))
      return linen.Dense(4)(h)

  class NNXModel(nnx.Module):
    def __init__(self, rngs):
      self.embed, self.up = nnx.Embed(40, 16, rngs=rngs), nnx.Linear(16, 12, rngs=rngs)
      self.down = nnx.Linear(12, 4, rngs=rngs)

    def __call__(self, ids):
      return self.down(jnp.tanh(self.up(self.embed(ids))))

  params = LinenModel().init(jax.random.key(0), ids)
  graphdef, state = nnx.split(NNXModel(nnx.Rngs(0)))

  def linen_loss(params):
    with linen_use_sebp(active_mask=mask, backend="xla"):
      return jnp.sum(LinenModel().apply(params, ids) ** 2)

  def nnx_loss(state):
    model = nnx.merge(graphdef, state)
    with sebp_nnx.use_sebp(model, active_mask=mask, backend="xla"):
      return jnp.sum(model(ids) ** 2)

  def dense_loss(params):
    return jnp.sum(LinenModel().apply(params, ids) ** 2)

  linen_counts = _primitive_counts(jax.make_jaxpr(jax.grad(linen_loss))(params))
  nnx_counts = _primitive_counts(jax.make_jaxpr(jax.grad(nnx_loss))(state))
  assert linen_counts != _primitive_counts(jax.make_jaxpr(jax.grad(dense_loss))(params))
  assert nnx_counts == linen_counts


def test_other_threads_run_the_model_dense_while_one_is_in_a_context():
  """A context is per thread, as Linen's is: the swapped classes run their own forward (and
  autodiff's backward) in a thread that did not enter it."""
  import threading

  model = TinyLM(nnx.Rngs(9))
  ids, mask = _batch(9)
  want = _grads(model, _masked_loss, ids, mask)
  entered, other_done = threading.Event(), threading.Event()
  results = {}

  # jax's config contexts are per thread: each thread asks for float32 dots itself (a GPU's
  # default is TF32).
  def sebp_thread():
    with (jax.default_matmul_precision("highest"),
          sebp_nnx.use_sebp(model, active_mask=mask, backend="xla") as report):
      entered.set()
      other_done.wait(timeout=120)
      results["sebp"] = _grads(model, _masked_loss, ids, mask)
    results["shared"] = report.shared_index

  def dense_thread():
    entered.wait(timeout=120)
    try:
      with jax.default_matmul_precision("highest"):
        results["dense"] = _grads(model, _masked_loss, ids, mask)
    finally:
      other_done.set()

  threads = [threading.Thread(target=sebp_thread), threading.Thread(target=dense_thread)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join(timeout=300)
  assert_every_gradient_close(results["dense"], want)
  assert_every_gradient_close(results["sebp"], want)
  assert "blocks/up" in results["shared"]  # the context's own thread ran SEBP


def test_overflow_nan_counts_the_real_tokens_a_traced_index_cuts():
  """Real tokens with a zero dY listed in the index must not hide the ones it cuts."""
  model = TinyLM(nnx.Rngs(10))
  ids, mask = _batch(10)
  num_real = int(mask.sum())
  weights = np.array(mask, np.float32)
  weights[np.argwhere(mask)[:3].T.tolist()] = 0  # three real tokens that weigh nothing

  def loss(model, mask, options=None):
    if options is None:
      logits = model(ids)
    else:
      with sebp_nnx.use_sebp(model, **options):
        logits = model(ids)
    return jnp.sum(weights[..., None] * logits ** 2) / 100

  grads = nnx.jit(lambda m, mask, top_n: nnx.state(nnx.grad(loss)(m, mask, dict(
      top_n=top_n, overflow="nan", active_mask=mask, lm_head=True, backend="xla")), nnx.Param),
      static_argnums=2)
  got = grads(model, jnp.asarray(mask), num_real - 3)
  assert all(np.all(np.isnan(g)) for g in jax.tree.leaves(got))
  assert_every_gradient_close(grads(model, jnp.asarray(mask), num_real),
                              nnx.state(nnx.grad(loss)(model, mask), nnx.Param))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_swapped_einsum_contracting_several_dims_gives_nnx_einsums_forward(dtype):
  """jnp.einsum orders the contracted dims by their letters ("NH" as H, N): the swapped layer
  runs that einsum, not a matmul of rows flattened in N, H order, which sums in another order.
  Eager against eager, jitted against jitted (a GPU may pick another GEMM under jit)."""
  rng = np.random.default_rng(0)
  layer = nnx.Einsum("BTNH,NHD->BTD", (8, 32, 256), (256,), param_dtype=dtype, rngs=nnx.Rngs(0))
  x = jnp.asarray(rng.standard_normal((4, 128, 8, 32)), dtype)
  call = lambda m, x: m(x)
  want, want_jitted = layer(x), nnx.jit(call)(layer, x)
  with sebp_nnx.use_sebp(layer, active_mask=jnp.ones((4, 128), bool), backend="xla"):
    np.testing.assert_array_equal(layer(x), want)
    np.testing.assert_array_equal(nnx.jit(call)(layer, x), want_jitted)
