"""`sebp_jax.nnx.use_sebp` on a model nobody here wrote: Tunix's NNX Llama 3 (its own einsum
attention projections, nnx.Linear MLP, nnx.remat of its blocks), gradients equal `nnx.grad`."""

import re
import threading
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from examples.pretrained import tunix_llama3, tunix_logits
from sebp_jax import nnx as sebp_nnx
from sebp_jax import pack_decoder_inputs
from sebp_jax.losses import masked_causal_lm_loss
from tests.model_testing import assert_every_gradient_close

llama3 = tunix_llama3()


def _tiny_llama(weight_tying: bool, remat: str, vocab_size: int = 96):
  config = llama3.ModelConfig(
      num_layers=2, vocab_size=vocab_size, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
      num_kv_heads=2, rope_theta=10000, norm_eps=1e-5, weight_tying=weight_tying,
      remat_config=llama3.RematConfig[remat])
  model = llama3.Llama3(config, rngs=nnx.Rngs(0))
  # Tunix initialises its MLP kernels to zero (weights are meant to be loaded): random ones,
  # so that every layer's dY is non-zero.
  state = nnx.state(model, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(state))))
  nnx.update(model, jax.tree.map(
      lambda p: 0.2 * jax.random.normal(next(keys), p.shape, p.dtype), state))
  return model


def _batch(seed, batch=3, length=12, vocab=96):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(3, length, size=batch)
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  return rng.integers(1, vocab, (batch, length)).astype(np.int32) * mask, mask


def _loss(model, ids, mask, sebp_kwargs=None):
  if sebp_kwargs is None:
    logits = tunix_logits(model, ids, mask)
  else:
    with sebp_nnx.use_sebp(model, **sebp_kwargs):
      logits = tunix_logits(model, ids, mask)
  return masked_causal_lm_loss(logits, ids, mask)


def _loss_grad(model, ids, mask, sebp_kwargs=None):
  """``nnx.grad(_loss)`` compiled (``nnx.jit``), the batch and options closed over."""
  return nnx.jit(lambda m: nnx.grad(_loss)(m, ids, mask, sebp_kwargs))(model)


# Each way of tying and remat with the shared index; the own rows of each layer once.
@pytest.mark.parametrize("weight_tying,remat,shared_index", [
    (False, "NONE", False), (False, "NONE", True), (True, "BLOCK", True),
    (False, "DECODER", True)])
def test_tunix_llama_gradients_equal_nnx_grad(weight_tying, remat, shared_index):
  model = _tiny_llama(weight_tying, remat)
  ids, mask = _batch(0)
  kwargs = dict(top_n=int(mask.sum()), lm_head=True, backend="xla",
                active_mask=mask if shared_index else None)
  want = nnx.state(_loss_grad(model, ids, mask), nnx.Param)
  got = nnx.state(_loss_grad(model, ids, mask, kwargs), nnx.Param)
  assert_every_gradient_close(got, want)


def test_every_projection_of_the_tunix_llama_is_swapped():
  model = _tiny_llama(weight_tying=False, remat="NONE")
  ids, mask = _batch(1)
  graphdef = nnx.graphdef(model)
  with sebp_nnx.use_sebp(model, active_mask=mask, lm_head=True) as report:
    tunix_logits(model, ids, mask)
  projections = [f"layers/{i}/{block}/{name}" for i in range(2) for block, names in (
      ("attn", ("k_proj", "o_proj", "q_proj", "v_proj")),
      ("mlp", ("down_proj", "gate_proj", "up_proj"))) for name in names]
  assert report.swapped == projections + ["lm_head"]
  assert sorted(report.shared_index) == sorted(report.swapped)
  assert report.skipped == {}
  assert nnx.graphdef(model) == graphdef
  with sebp_nnx.use_sebp(model) as report:  # the default leaves the LM head dense
    tunix_logits(model, ids, mask)
  assert report.skipped == {"lm_head": "matched by exclude"}


def test_a_dropped_row_changes_the_gradient():
  # The rows of padding, and of each sequence's last token (it predicts nothing), are exactly
  # zero: one row fewer than the others must cost something.
  model = _tiny_llama(weight_tying=True, remat="NONE")
  ids, mask = _batch(2)
  nonzero_rows = int(mask.sum()) - len(ids)
  want = _loss_grad(model, ids, mask)
  same = _loss_grad(model, ids, mask, dict(top_n=nonzero_rows, overflow="drop",
                                           backend="xla", active_mask=mask))
  assert_every_gradient_close(nnx.state(same, nnx.Param), nnx.state(want, nnx.Param))
  fewer = _loss_grad(model, ids, mask, dict(top_n=nonzero_rows - 1, overflow="drop",
                                            backend="xla", active_mask=mask))
  kernel = lambda g: np.asarray(g.layers[0].mlp.up_proj.kernel[...])
  assert not np.allclose(kernel(fewer), kernel(want), rtol=1e-4)
  assert jnp.isfinite(kernel(fewer)).all()


# Both attention methods on right padding; each other padding with one of them. The methods
# of one padding share its padded logits and dense gradient, compiled once.
@pytest.mark.parametrize("padding,attentions", [
    ("right", ("mask", "rows")), ("left", ("rows",)), ("holes", ("mask",))],
    ids=["right-mask-rows", "left-rows", "holes-mask"])
def test_packed_inputs_give_the_padded_logits_and_gradients(padding, attentions):
  """Tunix's Llama on the real tokens only (`pack_decoder_inputs`, through `tunix_logits`
  with a capacity), its attention per sequence by either method: the padded batch's logits
  at real tokens, zeros at padding, and the loss's gradient; with SEBP on the packed rows
  too."""
  model = _tiny_llama(weight_tying=True, remat="BLOCK")
  ids, mask = _batch(3)
  if padding == "left":
    ids, mask = ids[:, ::-1].copy(), mask[:, ::-1].copy()
  elif padding == "holes":
    mask[:, 1] = 0
    ids = ids * mask
  capacity = int(mask.sum()) + 5  # Filler slots too.
  logits = nnx.jit(tunix_logits, static_argnames=("capacity", "attention"))
  padded = logits(model, ids, mask)
  want = nnx.state(_loss_grad(model, ids, mask), nnx.Param)
  real = mask.astype(bool)
  for attention in attentions:
    packed = logits(model, ids, mask, capacity=capacity, attention=attention)
    np.testing.assert_allclose(packed[real], padded[real], rtol=1e-5, atol=1e-5)
    assert not np.any(packed[~real])

    def packed_loss(model):
      logits = tunix_logits(model, ids, mask, capacity=capacity, attention=attention)
      return masked_causal_lm_loss(logits, ids, mask, capacity=capacity)

    assert_every_gradient_close(nnx.state(nnx.jit(nnx.grad(packed_loss))(model), nnx.Param),
                                want)

    def packed_sebp_loss(model):
      with sebp_nnx.use_sebp(model, top_n=capacity, lm_head=True, backend="xla") as report:
        logits = tunix_logits(model, ids, mask, capacity=capacity, attention=attention)
      assert len(report.swapped) == 14  # Tied: the LM head is the embedding's decode.
      return masked_causal_lm_loss(logits, ids, mask, capacity=capacity)

    assert_every_gradient_close(
        nnx.state(nnx.jit(nnx.grad(packed_sebp_loss))(model), nnx.Param), want)


def test_packed_inputs_overflowing_the_capacity_give_nan():
  """A traced mask of more real tokens than the capacity: the logits NaN, and so the packed
  outputs the model gives under `use_packed_attention` (a loss read there, not unpacked,
  counts no token less) and every gradient of a loss of them."""
  model = _tiny_llama(weight_tying=False, remat="NONE")
  ids, mask = _batch(4)
  logits = nnx.jit(lambda m, ids, mask: tunix_logits(m, ids, mask, capacity=4))(
      model, ids, mask)
  assert np.isnan(np.asarray(logits)).all()

  capacity = int(np.sum(mask)) - 1

  def packed_loss(model, ids, mask):
    packed = pack_decoder_inputs(ids, mask, capacity)
    with sebp_nnx.use_packed_attention(model, packed.layout):
      logits, _ = model(packed.input_ids, packed.positions, None, packed.attention_mask)
    return jnp.mean(logits[0, :4])  # The first slots, whose tokens are all real.

  loss, grads = nnx.jit(nnx.value_and_grad(packed_loss))(model, ids, mask)
  assert np.isnan(np.asarray(loss))
  for grad in jax.tree.leaves(nnx.state(grads, nnx.Param)):  # The table's read rows only.
    assert np.isnan(np.asarray(grad)).any()


@pytest.mark.parametrize("attention", ["mask", "rows"])
def test_a_sliding_window_of_the_packed_inputs_is_the_one_attended(attention):
  """`pack_decoder_inputs(window=)` with the attention per sequence: the padded model's
  logits and gradient under the same windowed mask."""
  model = _tiny_llama(weight_tying=False, remat="NONE")
  ids, mask = _batch(11)
  window, capacity = 2, int(mask.sum()) + 3
  real = mask.astype(bool)
  positions = np.maximum(np.cumsum(real, axis=1) - 1, 0)
  columns = np.arange(mask.shape[1])
  offsets = columns[:, None] - columns[None, :]
  padded_mask = (offsets >= 0) & (offsets <= window) & real[:, None, :]

  def padded_loss(model):
    logits, _ = model(ids, positions, None, padded_mask)
    return masked_causal_lm_loss(logits, ids, mask)

  def packed_loss(model):
    packed = pack_decoder_inputs(ids, mask, capacity, window=window)
    with sebp_nnx.use_packed_attention(model, packed.layout, attention):
      logits, _ = model(packed.input_ids, packed.positions, None, packed.attention_mask)
    return masked_causal_lm_loss(packed.unpack(logits), ids, mask)

  want_loss, want = nnx.jit(nnx.value_and_grad(padded_loss))(model)
  got_loss, got = nnx.jit(nnx.value_and_grad(packed_loss))(model)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  assert_every_gradient_close(nnx.state(got, nnx.Param), nnx.state(want, nnx.Param))
  unwindowed = nnx.jit(nnx.value_and_grad(_loss))(model, ids, mask)[0]
  assert abs(float(unwindowed) - float(want_loss)) > 1e-4  # The window changes the loss.


def test_a_mask_of_other_packed_inputs_raises_or_gives_nan():
  """The model's packed mask is checked against the context's layout: another batch's (a
  second batch run in one context), or another window, raises where concrete and makes the
  logits NaN where traced; None skips the check."""
  model = _tiny_llama(weight_tying=False, remat="NONE")
  ids, mask = _batch(12)
  lengths = mask.sum(axis=1)
  other_mask = mask.copy()  # A token moved from row 0 to row 1: the same count.
  other_mask[0, lengths[0] - 1], other_mask[1, lengths[1]] = 0, 1
  capacity = int(max(mask.sum(), other_mask.sum())) + 2
  packed = pack_decoder_inputs(ids, mask, capacity)
  mismatches = {"another batch": pack_decoder_inputs(ids, other_mask, capacity),
                "another window": pack_decoder_inputs(ids, mask, capacity, window=1)}
  for other in mismatches.values():
    with sebp_nnx.use_packed_attention(model, packed.layout):
      with pytest.raises(ValueError, match="not the one pack_decoder_inputs made"):
        model(other.input_ids, other.positions, None, other.attention_mask)

  def run_on(model, given_mask):
    with sebp_nnx.use_packed_attention(model, packed.layout):
      logits, _ = model(packed.input_ids, packed.positions, None, given_mask)
    return logits

  run = nnx.jit(lambda given_mask: run_on(model, given_mask))
  good = run(packed.attention_mask)
  assert np.isfinite(np.asarray(good)).all()
  np.testing.assert_array_equal(run(None), good)
  for other in mismatches.values():
    assert np.isnan(np.asarray(run(other.attention_mask))).all()
  # Every gradient NaN too, not zero behind the attention.
  grads = nnx.jit(nnx.grad(lambda model, given: jnp.sum(run_on(model, given) ** 2)))(
      model, mismatches["another batch"].attention_mask)
  assert all(np.isnan(g).any() for g in jax.tree.leaves(nnx.state(grads, nnx.Param)))
  # A plain causal mask over the packed sequence attends across rows.
  causal = np.tril(np.ones((capacity, capacity), bool))[None]
  assert np.isnan(np.asarray(run(causal))).all()
  with pytest.raises(ValueError, match=r"has shape \(1, 3, 3\)"):
    run(np.ones((1, 3, 3), bool))


def test_pack_decoder_inputs_takes_integer_positions_of_the_masks_shape():
  ids, mask = _batch(13)
  for positions in (np.zeros(mask.shape, np.float32), np.zeros(mask.shape[1:], np.int32)):
    with pytest.raises(ValueError, match="positions must be integer token positions"):
      pack_decoder_inputs(ids, mask, int(mask.sum()), positions=positions)


def _long_batch(seed, batch=24, length=160, vocab=96):
  """Many sequences of spread lengths, right-padded: about 2,000 real tokens."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(8, length + 1, size=batch)
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  return rng.integers(1, vocab, (batch, length)).astype(np.int32) * mask, mask


def test_row_attention_over_thousands_of_packed_tokens():
  """24 sequences, about 2,000 tokens packed, attention in rows: the padded model's loss and
  gradient, and the compiled step holds neither the model's [C, C] mask nor [B, L, V]
  logits (the loss reads the packed rows)."""
  model = _tiny_llama(weight_tying=False, remat="BLOCK")
  ids, mask = _long_batch(5)
  capacity = int(mask.sum()) + 3
  assert capacity > 1500

  def packed_loss(model):
    logits = tunix_logits(model, ids, mask, capacity=capacity, attention="rows")
    return masked_causal_lm_loss(logits, ids, mask, capacity=capacity)

  graphdef, state = nnx.split(model)
  step = jax.jit(lambda s: nnx.value_and_grad(packed_loss)(nnx.merge(graphdef, s))).lower(
      state).compile()
  loss, grads = step(state)
  want_loss, want = nnx.value_and_grad(_loss)(model, ids, mask)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  assert_every_gradient_close(nnx.state(grads, nnx.Param), nnx.state(want, nnx.Param))

  hlo = step.as_text()
  batch, length = ids.shape
  # The mask's check reads three entries per slot, fused into the mask's computation.
  assert f"{capacity},{capacity}]" not in _unfused(hlo)
  assert f"[{batch},{length},96]" not in hlo and f"[{batch * length},96]" not in hlo


def _unfused(hlo: str) -> str:
  """Compiled HLO text less the computations of its fusions, whose shapes no buffer holds."""
  fused = set(re.findall(r"kind=k\w+, calls=(%[\w.\-]+)", hlo))
  computations = re.split(r"\n(?=\S)", hlo)
  return "\n".join(c for c in computations if c.split(" ", 1)[0] not in fused)


def test_use_packed_attention_restores_the_model_and_refuses_misuse():
  model = _tiny_llama(weight_tying=False, remat="NONE")
  ids, mask = _batch(6)
  capacity = int(mask.sum())
  packed = pack_decoder_inputs(ids, mask, capacity)
  graphdef = nnx.graphdef(model)
  with sebp_nnx.use_packed_attention(model, packed.layout, "rows"):
    assert nnx.graphdef(model) != graphdef
    with pytest.raises(RuntimeError, match="do not nest"):
      sebp_nnx.use_packed_attention(model, packed.layout).__enter__()
    with pytest.raises(ValueError, match=r"not \(1, %d, ...\)" % capacity):
      model(ids, np.zeros_like(ids), None, None)
  assert nnx.graphdef(model) == graphdef
  with pytest.raises(ValueError, match="attention must be one of"):
    sebp_nnx.use_packed_attention(model, packed.layout, "flash")
  with pytest.raises(ValueError, match="layout must be"):
    sebp_nnx.use_packed_attention(model, mask)
  with pytest.raises(ValueError, match="no attention module .* supported: tunix"):
    with sebp_nnx.use_packed_attention(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), packed.layout):
      pass


def test_an_active_mask_beside_packed_inputs_is_refused():
  """use_sebp's active_mask flags the padded batch's tokens; the model runs on the packed ones.
  One row packed into L slots has the mask's shape, so the layers would take its index for
  the packed rows (every gradient NaN with left padding): either order of the two contexts
  raises, and use_sebp without active_mask runs beside the packed attention."""
  model = _tiny_llama(weight_tying=False, remat="NONE")
  mask = np.array([[0, 0, 0, 1, 1, 1, 1, 1]], np.int32)  # Left padding.
  ids = np.random.default_rng(7).integers(1, 96, mask.shape).astype(np.int32) * mask
  length = mask.shape[1]
  with sebp_nnx.use_sebp(model, active_mask=mask, lm_head=True, require_swaps=False):
    with pytest.raises(ValueError, match=r"active_mask=...\) beside use_packed_attention"):
      tunix_logits(model, ids, mask, capacity=length)
  packed = pack_decoder_inputs(ids, mask, length)
  with sebp_nnx.use_packed_attention(model, packed.layout):
    with pytest.raises(ValueError, match=r"active_mask=...\) beside use_packed_attention"):
      sebp_nnx.use_sebp(model, active_mask=mask).__enter__()

  def loss(model, sebp):
    with sebp_nnx.use_sebp(model, lm_head=True, backend="xla") if sebp else nullcontext():
      logits = tunix_logits(model, ids, mask, capacity=length)
    return masked_causal_lm_loss(logits, ids, mask)

  want = nnx.state(nnx.grad(loss)(model, False), nnx.Param)
  got = nnx.state(nnx.grad(loss)(model, True), nnx.Param)
  assert_every_gradient_close(got, want, rtol=2e-5)


def test_a_step_jitted_outside_the_context_compiles_for_each_layout():
  """Entered outside nnx.jit, each batch's concrete layout is part of the cache key: a second
  batch of the same shapes runs with its own layout, not the first one's."""
  model = _tiny_llama(weight_tying=False, remat="NONE")
  step = nnx.jit(lambda m, ids, positions: m(ids, positions, None, None)[0])
  for seed in (8, 9):
    ids, mask = _batch(seed)
    packed = pack_decoder_inputs(ids, mask, 36)
    with sebp_nnx.use_packed_attention(model, packed.layout, "rows"):
      logits = packed.unpack(step(model, packed.input_ids, packed.positions))
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[real],
                               np.asarray(tunix_logits(model, ids, mask))[real],
                               rtol=1e-5, atol=1e-5)


def test_another_thread_runs_the_models_own_attention():
  """The class swap is seen by every thread; only the thread that entered the context runs
  the model per sequence (here rows on the packed inputs, elsewhere the model's own
  attention on a padded batch)."""
  model = _tiny_llama(weight_tying=False, remat="NONE")
  ids, mask = _batch(7)
  packed = pack_decoder_inputs(ids, mask, int(mask.sum()))
  want = np.asarray(tunix_logits(model, ids, mask))
  entered, done = threading.Event(), threading.Event()
  got = {}

  def hold_the_context():
    # Config contexts are per thread: this one's matmuls as the test's (float32 on GPUs).
    with jax.default_matmul_precision("highest"), sebp_nnx.use_packed_attention(
        model, packed.layout, "rows"):
      entered.set()
      done.wait(60)
      got["packed"] = packed.unpack(model(packed.input_ids, packed.positions, None, None)[0])

  holder = threading.Thread(target=hold_the_context)
  holder.start()
  entered.wait(60)
  got["padded"] = tunix_logits(model, ids, mask)
  done.set()
  holder.join()
  real = mask.astype(bool)
  np.testing.assert_allclose(got["padded"], want, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got["packed"])[real], want[real], rtol=1e-5, atol=1e-5)
