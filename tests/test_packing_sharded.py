"""Packing a batch split over devices (`use_sebp(packed=True, batch_axes=...)`): each shard
packs its own rows, the gradient is one device's dense gradient, and the step has the dense
step's collectives. 4 forced host devices (tests/conftest.py)."""

import contextlib
import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
from transformers import (BertConfig, FlaxBertForSequenceClassification, FlaxLlamaForCausalLM,
                          LlamaConfig)

from benchmarks.harness import free_port
from sebp_jax import losses, pack_decoder_inputs, token_capacity, use_sebp
from sebp_jax.losses import causal_lm_target_count, masked_causal_lm_loss
from sebp_jax.packing import gather_tokens, pack_layout, packed_attention, scatter_tokens
from sebp_jax.sharding import (collective_bytes, collective_counts, collective_sizes, fsdp_loss,
                               fsdp_specs, row_sharding)
from tests.model_testing import assert_every_gradient_close, assert_tables_cross_as_rows

CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 host devices (tests/conftest.py)")
VOCAB, BATCH, LENGTH, SHARDS = 256, 8, 12, 4


@pytest.fixture(scope="module")
def models():
  return tiny_models()


def tiny_models():
  llama = FlaxLlamaForCausalLM(LlamaConfig(
      vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, intermediate_size=32, max_position_embeddings=64), seed=2)
  bert = FlaxBertForSequenceClassification(BertConfig(
      vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
      intermediate_size=32, max_position_embeddings=32), seed=0)
  return {"llama": llama, "bert": bert}


def _mesh(axis_type=AxisType.Auto, shards=SHARDS):
  return jax.make_mesh((shards,), ("data",), axis_types=(axis_type,), devices=CPUS[:shards])


#: Mesh types and sizes: an Explicit mesh of one device (a script written for several run on
#: one) still types the arrays as split.
MESHES = [(AxisType.Auto, SHARDS), (AxisType.Explicit, SHARDS), (AxisType.Explicit, 1)]


def _batch(seed, layout="right"):
  """Lengths 2..L, so the shards' real tokens differ; ids, mask and sentence labels."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, LENGTH + 1, size=BATCH)
  mask = (np.arange(LENGTH)[None] < lengths[:, None]).astype(np.int32)
  if layout == "left":
    mask = mask[:, ::-1].copy()
  elif layout == "holes":
    mask[::2, 1] = 0
  ids = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype(np.int32) * mask
  return ids, mask, rng.integers(0, 2, BATCH).astype(np.int32)


def _loss(model, kind, capacity=None, sebp=None):
  """The model's loss; with ``capacity``, packed per shard into that many slots each."""
  def loss(params, ids, mask, labels):
    if capacity is None:
      out = model(ids, attention_mask=mask, params=params).logits
    else:
      with use_sebp(top_n=capacity, active_mask=mask, packed=True, backend="xla",
                    **sebp) as report:
        out = model(ids, attention_mask=mask, params=params).logits
      assert report.packed
    if kind in ("llama", "bloom"):
      return masked_causal_lm_loss(out, ids, mask)
    return optax.softmax_cross_entropy_with_integer_labels(out, labels).mean()
  return loss


# Both attention methods on the right-padded Llama; each other layout with one of them.
@pytest.mark.parametrize("kind,layout,attention", [
    ("bert", "right", "rows"), ("llama", "right", "mask"), ("llama", "right", "rows"),
    ("llama", "left", "rows"), ("llama", "holes", "mask")])
def test_each_shard_packs_its_rows_exactly_with_the_dense_collectives_but_the_table(
    models, kind, layout, attention):
  """One device's loss and gradient; the dense step's collectives, but for the word table,
  looked up on the batch's rows (BERT's) or on the packed tokens (Llama's), whose gradient
  comes from the devices' rows, gathered."""
  model = models[kind]
  ids, mask, labels = _batch(3, layout)
  capacity = token_capacity(mask, multiple=8, num_shards=SHARDS)
  want = jax.value_and_grad(_loss(model, kind))(model.params, ids, mask, labels)
  mesh = _mesh()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(model.params, P()), *(put(a, P("data")) for a in (ids, mask, labels)))
  sebp = dict(batch_axes="data", mesh=mesh, attention=attention)
  packed = jax.jit(jax.value_and_grad(_loss(model, kind, capacity, sebp)))
  got = packed(*args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert_every_gradient_close(got[1], want[1], rtol=2e-5)
  dense = jax.jit(jax.value_and_grad(_loss(model, kind)))
  packed, dense = (step.lower(*args).compile() for step in (packed, dense))
  table = (model.params["bert"]["embeddings"]["word_embeddings"] if kind == "bert"
           else model.params["model"]["embed_tokens"])["embedding"]
  # The packed Llama loss sums one scalar more across the devices than the dense one.
  assert_tables_cross_as_rows((collective_counts(packed), collective_bytes(packed)),
                              (collective_counts(dense), collective_bytes(dense)),
                              table_bytes=table.nbytes, scalar_bytes=4 * (kind == "llama"))


@pytest.mark.parametrize("kind", ["roformer", "bloom"])
def test_positions_by_column_and_alibi_pack_per_shard(kind):
  """RoFormer (its rotary positions taken at each token's column) and Bloom (ALiBi over each
  sequence's real tokens, left padding) packed per shard, holes in RoFormer's rows: one
  device's loss and gradient."""
  from transformers import (BloomConfig, FlaxBloomForCausalLM,
                            FlaxRoFormerForSequenceClassification, RoFormerConfig)
  model = (FlaxBloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=16, n_layer=2,
                                            n_head=2, initializer_range=0.2), seed=3)
           if kind == "bloom" else FlaxRoFormerForSequenceClassification(RoFormerConfig(
               vocab_size=VOCAB, hidden_size=16, embedding_size=16, num_hidden_layers=2,
               num_attention_heads=2, intermediate_size=32, max_position_embeddings=32), seed=3))
  ids, mask, labels = _batch(4, "left" if kind == "bloom" else "holes")
  capacity = token_capacity(mask, multiple=8, num_shards=SHARDS)
  want = jax.value_and_grad(_loss(model, kind))(model.params, ids, mask, labels)
  mesh = _mesh()
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(model.params, P()), *(put(a, P("data")) for a in (ids, mask, labels)))
  got = jax.jit(jax.value_and_grad(_loss(model, kind, capacity,
                                         dict(batch_axes="data", mesh=mesh))))(*args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert_every_gradient_close(got[1], want[1], rtol=2e-5)


def test_packing_runs_with_one_process_per_pair_of_devices(models, tmp_path):
  """`jax.distributed`: 2 processes of 2 host devices each (Gloo collectives), every process
  holding the whole batch and placing its own shards, pack per device and give one device's
  gradient, as one process of 4 devices does."""
  model = models["llama"]
  ids, mask, labels = _batch(3)
  want_loss, want = jax.value_and_grad(_loss(model, "llama"))(model.params, ids, mask, labels)
  port = free_port()
  out = tmp_path / "grads.npz"
  env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
  workers = [subprocess.Popen([sys.executable, "-m", "tests.multiprocess_packing", str(rank),
                               "2", str(port), str(out)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
  logs = [worker.communicate(timeout=600)[0] for worker in workers]
  assert [worker.returncode for worker in workers] == [0, 0], logs
  got = np.load(out)
  np.testing.assert_allclose(got["loss"], want_loss, rtol=1e-5)
  leaves = jax.tree.leaves(want)
  assert_every_gradient_close([got[f"leaf_{i}"] for i in range(len(leaves))], leaves,
                              rtol=2e-5)


def test_fsdp_with_packing_communicates_as_the_dense_fsdp_step(models):
  """Weight matrices split over the batch's axis (gathered by XLA where used): the packed
  step's gradient is one device's, comes back split, and its collectives are the dense FSDP
  step's, each of the same size, and one more: the gathered ids of the devices' rows of dY,
  into the split word table (whose rows XLA gathers for the dense step's lookup too)."""
  model = models["llama"]
  ids, mask, labels = _batch(4)
  capacity = token_capacity(mask, multiple=8, num_shards=SHARDS)
  want = jax.grad(_loss(model, "llama"))(model.params, ids, mask, labels)
  mesh = _mesh()
  specs = jax.tree.map(lambda a: P("data") if a.ndim == 2 and a.shape[0] % SHARDS == 0
                       else P(), model.params)
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)
  args = (jax.device_put(model.params, shardings),
          *(jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (ids, mask, labels)))
  step = lambda loss: jax.jit(jax.grad(loss), out_shardings=shardings)
  packed = step(_loss(model, "llama", capacity, dict(batch_axes="data", mesh=mesh)))
  got = packed(*args)
  assert_every_gradient_close(got, want, rtol=2e-5)
  assert jax.tree.map(lambda g: g.sharding.spec, got) == specs
  dense = collective_sizes(step(_loss(model, "llama")).lower(*args).compile())
  assert any(kind == "all-gather" for kind, _ in dense)
  ids_gathered = ("all-gather", SHARDS * capacity * 4)
  assert sorted(collective_sizes(packed.lower(*args).compile())) == sorted(dense + [ids_gathered])


def test_fsdp_loss_chunks_a_packed_head_split_by_its_vocabulary_on_its_gathered_kernel(
    models, monkeypatch):
  """`head_chunk` on a packed LM head that `fsdp_loss` splits by its vocabulary: every chunk
  reads every column, so the chunks run on the kernel gathered whole; loss and gradient are
  one device's."""
  model = models["llama"]
  ids, mask, _ = _batch(7)
  capacity = token_capacity(mask, multiple=8, num_shards=SHARDS)
  kernels = []  # The kernels the chunked loss reads.
  chunked_cross_entropy = losses.linear_cross_entropy
  monkeypatch.setattr(losses, "linear_cross_entropy",
                      lambda inputs, kernel, *a, **k: kernels.append(kernel.shape)
                      or chunked_cross_entropy(inputs, kernel, *a, **k))

  def loss(params, batch, packed=True):
    ids, mask = batch
    with (use_sebp(top_n=capacity, active_mask=mask, packed=True, backend="xla") if packed
          else contextlib.nullcontext()):
      logits = model(ids, attention_mask=mask, params=params).logits
    return masked_causal_lm_loss(logits, ids, mask, head_chunk=8)

  want = jax.jit(jax.value_and_grad(functools.partial(loss, packed=False)))(model.params,
                                                                          (ids, mask))
  assert kernels == []  # Unpacked logits are read whole.
  mesh = _mesh()
  specs = fsdp_specs(model.params, mesh)
  assert specs["lm_head"]["kernel"] == P(None, "data")  # Split by its vocabulary.
  args = (jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)),
                       model.params, specs),
          jax.device_put((ids, mask), NamedSharding(mesh, P("data"))))
  got = jax.jit(jax.value_and_grad(fsdp_loss(
      loss, mesh, specs, weight_fn=lambda batch: causal_lm_target_count(batch[1]))))(*args)
  assert kernels == [model.params["lm_head"]["kernel"].shape]
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert_every_gradient_close(got[1], want[1], rtol=2e-5)


def test_capacity_counts_per_shard(models):
  """``top_n`` is each shard's capacity: "auto" (a host mask) takes the fullest shard's,
  rounded; a concrete mask over it raises naming the shard; a traced one makes the loss and
  every gradient NaN, even where only one shard overflows."""
  model = models["llama"]
  ids, mask, labels = _batch(5)
  counts = mask.reshape(SHARDS, -1).sum(axis=1)
  assert len(set(counts)) > 1
  mesh = _mesh()
  sebp = dict(batch_axes="data", mesh=mesh)
  forward = lambda: jax.eval_shape(lambda: model(ids, attention_mask=mask))
  with use_sebp(top_n="auto", active_mask=mask, packed=True, **sebp) as report:
    forward()
  assert report.capacity == token_capacity(mask, num_shards=SHARDS) == mask.size // SHARDS
  with pytest.raises(ValueError, match=f"{counts.max()} real tokens of a shard"):
    with use_sebp(top_n=int(counts.max()) - 1, overflow="nan", active_mask=mask,
                  packed=True, **sebp):
      forward()
  put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
  loss, grads = jax.jit(jax.value_and_grad(_loss(model, "llama", int(counts.max()) - 1, sebp)))(
      jax.device_put(model.params, NamedSharding(mesh, P())), put(ids), put(mask), put(labels))
  assert np.isnan(loss)
  assert all(np.isnan(np.asarray(g)).any() for g in jax.tree.leaves(grads))


def _batch_with_an_empty_shard(seed):
  ids, mask, labels = _batch(seed)
  empty = slice(BATCH // SHARDS, 2 * BATCH // SHARDS)
  ids[empty], mask[empty] = 0, 0
  return ids, mask, labels


def _empty_rows_read(logits, ids, mask, empty_weight):
  """The masked causal-LM loss, and the logits of the rows without real tokens read with
  ``empty_weight``."""
  empty_rows = ~jnp.any(mask != 0, axis=1)
  return (masked_causal_lm_loss(logits, ids, mask)
          + empty_weight * jnp.sum(jnp.where(empty_rows, logits[:, 0, 0], 0)))


def _nan_but_row_attention_inputs(grads, attention: str, spared: tuple[str, ...]):
  """Every gradient has NaN but, with the row attention (whose spare slots are in no row: a
  NaN there reaches no query, key or value, and checking for one cost 0.5-0.9% of the packed
  step), those of the modules named in ``spared``: the attention's projections, and a norm
  that feeds them only."""
  for path, grad in jax.tree_util.tree_leaves_with_path(grads):
    name = jax.tree_util.keystr(path)
    finite = attention == "rows" and any(f"'{part}'" in name for part in spared)
    assert finite != np.isnan(np.asarray(grad)).any(), name


@pytest.mark.parametrize("kind,attention", [("bert", "rows"), ("llama", "rows"),
                                            ("llama", "mask")])
def test_a_shard_without_real_tokens(models, kind, attention):
  """A device whose rows are all padding: a loss that leaves them out (weighted 0; masked)
  gets one device's gradient; one that reads them (their padding was not computed) makes
  the gradients behind the packed region NaN, as on one device, though the shard has no
  real token through which the read would reach the weights: its spare slots carry it, but
  for the row attention's query, key and value (:func:`_nan_but_row_attention_inputs`)."""
  model = models[kind]
  ids, mask, labels = _batch_with_an_empty_shard(7)
  capacity = token_capacity(mask, multiple=8, num_shards=SHARDS)
  mesh = _mesh()
  sebp = dict(batch_axes="data", mesh=mesh, attention=attention)

  def loss(params, ids, mask, empty_weight, packed):
    with use_sebp(top_n=capacity, active_mask=mask, packed=True, backend="xla",
                  **sebp) if packed else contextlib.nullcontext():
      out = model(ids, attention_mask=mask, params=params).logits
    if kind == "llama":
      return _empty_rows_read(out, ids, mask, empty_weight)
    weights = jnp.where(jnp.any(mask != 0, axis=1), 1.0, empty_weight)
    return jnp.sum(weights * optax.softmax_cross_entropy_with_integer_labels(out, labels))

  put = lambda a, spec=P("data"): jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(model.params, P()), put(ids), put(mask))
  grad = jax.jit(jax.value_and_grad(loss), static_argnums=4)
  want = grad(model.params, ids, mask, 0.0, False)
  got = grad(*args, 0.0, True)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert_every_gradient_close(got[1], want[1], rtol=2e-5)
  got = grad(*args, 1.0, True)[1]
  region = got["bert"]["encoder"] if kind == "bert" else got["model"]
  _nan_but_row_attention_inputs(region, attention, ("query", "key", "value") if kind == "bert"
                                else ("q_proj", "k_proj", "v_proj", "input_layernorm"))


@pytest.mark.parametrize("axis_type,shards", MESHES, ids=str)
def test_sharded_layout_runs_each_shard_on_its_own_layout(axis_type, shards):
  """gather, scatter and attention with a sharded layout equal each shard's own packing of
  its block, under either mesh type (transformers' Flax models do not run on an Explicit mesh
  with split ids, dense or not: their lookups take no out_sharding); each shard overflows
  its own capacity."""
  ids, mask, _ = _batch(6, "holes")
  capacity = 32 * SHARDS // shards
  counts = mask.reshape(shards, -1).sum(axis=1)
  small = int(counts.max()) - 1
  mesh = _mesh(axis_type, shards)
  rng = np.random.default_rng(6)
  x = rng.normal(size=(BATCH, LENGTH, 8)).astype(np.float32)
  qkv = [rng.normal(size=(1, shards * capacity, 4, 8)).astype(np.float32) for _ in range(3)]

  def run(x, mask, q, k, v):
    layout = pack_layout(mask, capacity, row_sharding(mask, 2, batch_axes=("data",)))
    out = packed_attention(q, k, v, layout, causal=True, method="rows",
                           implementation="xla")
    small_layout = pack_layout(mask, small, row_sharding(mask, 2, batch_axes=("data",)))
    return gather_tokens(x, layout), scatter_tokens(out, layout), out, small_layout.overflow

  with jax.set_mesh(mesh):
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
    got = [np.asarray(a) for a in jax.jit(run)(put(x, P("data")), put(mask, P("data")),
                                               *(put(a, P(None, "data")) for a in qkv))]
  np.testing.assert_array_equal(got[3], counts > small)
  per = BATCH // shards
  for shard in range(shards):
    block = slice(shard * per, (shard + 1) * per)
    slots = slice(shard * capacity, (shard + 1) * capacity)
    layout = pack_layout(mask[block], capacity)
    out = packed_attention(*(a[:, slots] for a in qkv), layout, causal=True, method="rows",
                           implementation="xla")
    np.testing.assert_allclose(got[0][:, slots], gather_tokens(x[block], layout), rtol=1e-6)
    np.testing.assert_allclose(got[1][block], scatter_tokens(out, layout), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(got[2][:, slots], out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis_type,shards", MESHES, ids=str)
def test_decoder_inputs_packed_per_shard_under_either_mesh_type(axis_type, shards):
  """`pack_decoder_inputs` on a batch split over devices, under either mesh type (an Explicit
  one read from the mask's type): each shard's slots hold its block's own packing, and the
  one mask over every shard's slots keeps the shards' sequences apart."""
  ids, mask, _ = _batch(8, "holes")
  capacity, window = 32 * SHARDS // shards, 3
  mesh = _mesh(axis_type, shards)
  axes = {} if axis_type == AxisType.Explicit else dict(batch_axes="data", mesh=mesh)

  def pack(ids, mask):
    inputs = pack_decoder_inputs(ids, mask, capacity, window=window, **axes)
    return inputs.input_ids, inputs.positions, inputs.attention_mask

  with jax.set_mesh(mesh):
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
    got = [np.asarray(a) for a in jax.jit(pack)(put(ids), put(mask))]
  assert got[2].shape == (1, shards * capacity, shards * capacity)
  per = BATCH // shards
  for shard in range(shards):
    block = slice(shard * per, (shard + 1) * per)
    slots = slice(shard * capacity, (shard + 1) * capacity)
    want = pack_decoder_inputs(ids[block], mask[block], capacity, window=window)
    np.testing.assert_array_equal(got[0][:, slots], want.input_ids)
    np.testing.assert_array_equal(got[1][:, slots], want.positions)
    np.testing.assert_array_equal(got[2][:, slots, slots], want.attention_mask)
    others = np.ones(shards * capacity, bool)
    others[slots] = False
    assert not got[2][:, slots][..., others].any()


def tiny_nnx_llama():
  """Tunix's NNX Llama at toy sizes, random weights: ``(graphdef, params)``."""
  from flax import nnx

  from examples.pretrained import tunix_llama3
  llama3 = tunix_llama3()
  config = llama3.ModelConfig(
      num_layers=2, vocab_size=VOCAB, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
      num_kv_heads=2, rope_theta=10000, norm_eps=1e-5, weight_tying=False,
      remat_config=llama3.RematConfig.NONE)
  model = llama3.Llama3(config, rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(state))))
  nnx.update(model, jax.tree.map(
      lambda p: 0.2 * jax.random.normal(next(keys), p.shape, p.dtype), state))
  return nnx.split(model)


@pytest.mark.parametrize("kind,axis_type", [
    ("bert", AxisType.Auto), ("llama", AxisType.Auto), ("llama", AxisType.Explicit),
    ("llama_nnx", AxisType.Auto), ("llama_nnx", AxisType.Explicit)], ids=str)
def test_fsdp_loss_packs_on_each_device_with_one_gather_and_scatter_per_matrix(models, kind,
                                                                              axis_type,
                                                                              monkeypatch):
  """`fsdp_loss`: the matrices split over the devices, each device packing its own rows as one
  device does (`use_sebp(packed=True)` without `batch_axes`, in the `shard_map`; for the
  decoders the first device holds padding only): the whole batch's loss and one device's
  gradient, laid out as the params, and the dense FSDP step's collectives, one all-gather and
  one reduce-scatter per split matrix, except that a split table that Linen's `nn.Embed`
  looks up is never gathered: its ids and dY's rows are (two all-gathers), and the rows it
  looks up are reduce-scattered. Llama's LM head is split by its vocabulary and never
  gathered either: the head's inputs and labels are gathered and each row's two sums
  scattered to its device, and in the backward the transposes of these (4 all-gathers and
  3 reduce-scatters in all). On an `Explicit` mesh too, where transformers' Flax models and
  Tunix's NNX Llama run inside the `shard_map` only."""
  from flax import nnx

  from examples.pretrained import tunix_logits
  ids, mask, labels = _batch(6)
  if kind != "bert":
    mask[:BATCH // SHARDS] = 0
    mask[:, LENGTH - 4:] = 0  # Fewer real tokens than rows on every device.
    ids *= mask
  capacity = token_capacity(mask, multiple=8, num_shards=SHARDS)
  heads = []  # The rows of each split head's logits, as the loss computes them.
  split_cross_entropy = losses.vocab_split_cross_entropy
  monkeypatch.setattr(losses, "vocab_split_cross_entropy",
                      lambda head, *a: heads.append(head.inputs.shape) or split_cross_entropy(
                          head, *a))
  if kind == "llama_nnx":
    graphdef, params = tiny_nnx_llama()

    def loss(params, batch, packed):
      ids, mask, _ = batch
      logits = tunix_logits(nnx.merge(graphdef, params), ids, mask,
                            capacity=capacity if packed else None, attention="rows")
      return masked_causal_lm_loss(logits, ids, mask)
  else:
    model, params = models[kind], models[kind].params
    loss = lambda params, batch, packed: _loss(model, kind, capacity if packed else None,
                                               {})(params, *batch)
  weight_fn = None if kind == "bert" else lambda batch: causal_lm_target_count(batch[1])
  want = jax.value_and_grad(loss)(params, (ids, mask, labels), False)
  mesh = _mesh(axis_type)

  specs = fsdp_specs(params, mesh)
  assert kind != "llama" or specs["lm_head"]["kernel"] == P(None, "data")
  args = (jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)), params,
                       specs),
          jax.device_put((ids, mask, labels), NamedSharding(mesh, P("data"))))
  step = lambda packed: jax.jit(jax.value_and_grad(fsdp_loss(
      functools.partial(loss, packed=packed), mesh, specs, weight_fn=weight_fn,
      lookups_in_place=True)))
  with jax.set_mesh(mesh):
    packed = step(True).lower(*args).compile()  # One compile: run and its collectives read.
    got = packed(*args)
    counts = collective_counts(packed)
    assert counts == collective_counts(step(False).lower(*args).compile())
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert_every_gradient_close(got[1], want[1], rtol=2e-5)
  assert all(g.sharding.is_equivalent_to(NamedSharding(mesh, spec), g.ndim)
             for g, spec in zip(jax.tree.leaves(got[1]), jax.tree.leaves(specs), strict=True))
  split = sum(spec == P("data") for spec in jax.tree.leaves(specs))
  tables = 0 if kind == "llama_nnx" else sum(
      spec == P("data") and path[-1].key == "embedding"
      for path, spec in jax.tree_util.tree_leaves_with_path(specs))
  assert tables == (2 if kind == "bert" else 1 if kind == "llama" else 0)
  head = kind == "llama"
  # The packed step's head runs on the packed rows, the dense one's on every position.
  hidden = model.config.hidden_size if head else None
  assert heads == ([(capacity, hidden), (BATCH // SHARDS * LENGTH, hidden)] if head else [])
  assert kind == "bert" or capacity < BATCH // SHARDS * LENGTH
  assert counts["reduce-scatter"] == split + 3 * head > 0
  assert counts["all-gather"] == split + tables + 4 * head


def test_nnx_decoder_inputs_packed_per_shard():
  """Tunix's NNX Llama on inputs packed per shard (`pack_decoder_inputs(batch_axes=)`), its
  attention per sequence on each device: one device's dense gradient, and the dense step's
  collectives; a shard without real tokens as in test_a_shard_without_real_tokens."""
  from flax import nnx

  from examples.pretrained import tunix_logits
  graphdef, params = tiny_nnx_llama()
  model = nnx.merge(graphdef, params)
  ids, mask, _ = _batch(7, "left")
  capacity = token_capacity(mask, multiple=8, num_shards=SHARDS)
  mesh = _mesh()

  def loss(params, ids, mask, packed):
    model = nnx.merge(graphdef, params)
    sharding = dict(batch_axes="data", mesh=mesh) if packed else {}
    logits = tunix_logits(model, ids, mask, capacity=capacity if packed else None,
                          attention="rows", **sharding)
    return masked_causal_lm_loss(logits, ids, mask)

  want = jax.value_and_grad(loss)(params, ids, mask, False)
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  args = (put(params, P()), put(ids, P("data")), put(mask, P("data")))
  packed = jax.jit(jax.value_and_grad(functools.partial(loss, packed=True)))
  got = packed(*args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert_every_gradient_close(got[1], want[1], rtol=2e-5)
  dense = jax.jit(jax.value_and_grad(functools.partial(loss, packed=False)))
  assert (collective_counts(packed.lower(*args).compile())
          == collective_counts(dense.lower(*args).compile()))

  # The model's own attention over one mask of every shard's slots: each shard's sequences
  # apart from the others'.
  @jax.jit
  def own_attention(params, ids, mask):
    inputs = pack_decoder_inputs(ids, mask, capacity, batch_axes="data", mesh=mesh)
    logits, _ = nnx.merge(graphdef, params)(inputs.input_ids, inputs.positions, None,
                                            inputs.attention_mask)
    return inputs.unpack(logits)

  real = mask.astype(bool)
  np.testing.assert_allclose(np.asarray(own_attention(*args))[real],
                             np.asarray(tunix_logits(model, ids, mask))[real],
                             rtol=1e-5, atol=1e-5)

  # A shard without real tokens: exact where the loss leaves it out, every gradient NaN
  # where it reads its logits.
  ids, mask, _ = _batch_with_an_empty_shard(7)
  capacity = token_capacity(mask, multiple=8, num_shards=SHARDS)

  def read_empty(params, ids, mask, empty_weight, packed):
    model = nnx.merge(graphdef, params)
    sharding = dict(batch_axes="data", mesh=mesh) if packed else {}
    logits = tunix_logits(model, ids, mask, capacity=capacity if packed else None,
                          attention="rows", **sharding)
    return _empty_rows_read(logits, ids, mask, empty_weight)

  want = jax.value_and_grad(read_empty)(params, ids, mask, 0.0, False)
  args = (put(params, P()), put(ids, P("data")), put(mask, P("data")))
  packed = jax.jit(jax.value_and_grad(functools.partial(read_empty, packed=True)))
  got = packed(*args, 0.0)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  assert_every_gradient_close(got[1], want[1], rtol=2e-5)
  _nan_but_row_attention_inputs(packed(*args, 1.0)[1], "rows",
                                ("q_proj", "k_proj", "v_proj", "input_layernorm"))
