"""SEBP on a batch split over devices: each shard selects its own rows.

Four host devices (tests/conftest.py) on a mesh of ``Auto`` or ``Explicit`` axes; gradients
against one device's ``jax.grad`` of the dense model, and the compiled step's collectives
against the dense step's (no all-gather, no all-reduce that the dense step does not have).
Tests comparing SEBP with dense ask for backend="xla" (on a GPU "auto" runs tiny layers
dense)."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from sebp_jax import (RowLog, pack_decoder_inputs, sebp_embed_lookup, sebp_linear, token_capacity,
                      use_sebp)
from sebp_jax import nnx as sebp_nnx
from sebp_jax.backward import scatter_into_table, sum_rows_of_equal_ids
from sebp_jax.losses import causal_lm_target_count, linear_cross_entropy, masked_causal_lm_loss
from sebp_jax.sharding import (collective_counts, collective_sizes, fsdp_loss, fsdp_specs,
                               row_sharding, shard_row_counts, split_table_lookup)
from tests.model_testing import assert_every_gradient_close
from tests.reference import reference_take_grad

CPUS = jax.devices("cpu")
pytestmark = pytest.mark.skipif(len(CPUS) < 4, reason="needs 4 host devices (tests/conftest.py)")
AXIS_TYPES = [AxisType.Auto, AxisType.Explicit]
#: Mesh types and sizes: an Explicit mesh of one device (a script written for several run on
#: one) still types the arrays as split.
MESHES = [(AxisType.Auto, 4), (AxisType.Explicit, 4), (AxisType.Explicit, 1)]
BATCH, LENGTH, FEATURES = 8, 16, 32


def _mesh(axis_type, shape=(4,), names=("data",)):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                       devices=CPUS[:np.prod(shape)])


def _put(tree, mesh, spec):
  return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, spec)), tree)


def _mask(seed=0, batch=BATCH, length=LENGTH):
  """Right padding, lengths 1..length-1, the shards' counts unequal."""
  lengths = np.random.default_rng(seed).integers(1, length, size=(batch, 1))
  return np.arange(length)[None] < lengths


class _Tagger(nn.Module):
  """Dense layers on [B, L, D] rows, and an embedding when given ids."""

  @nn.compact
  def __call__(self, inputs):
    h = nn.Embed(50, FEATURES)(inputs) if jnp.issubdtype(inputs.dtype, jnp.integer) else inputs
    h = nn.gelu(nn.Dense(64)(h))
    return nn.Dense(8)(h)


def _masked_loss(outputs, mask):
  return jnp.sum(jnp.where(mask[..., None], jnp.sin(outputs), 0.0))


def _linen_case(axis_type):
  """The model, its params and inputs: ids under Auto; features under Explicit, where a
  lookup of sharded ids needs an out_sharding that nn.Embed does not take, dense or not."""
  keys = jax.random.split(jax.random.key(0), 2)
  if axis_type == AxisType.Auto:
    inputs = jax.random.randint(keys[0], (BATCH, LENGTH), 0, 50)
  else:
    inputs = jax.random.normal(keys[0], (BATCH, LENGTH, FEATURES))
  model = _Tagger()
  return model, model.init(keys[1], inputs), inputs


def _step(model, options_of):
  """The gradient of the masked loss, SEBP as ``options_of(mask)`` says (None: dense)."""
  def loss(params, inputs, mask):
    options = options_of(mask)
    if options is None:
      return _masked_loss(model.apply(params, inputs), mask)
    with use_sebp(backend="xla", **options):
      outputs = model.apply(params, inputs)
    return _masked_loss(outputs, mask)
  return jax.jit(jax.grad(loss))


LINEN_CASES = {
    # The shared index of a traced mask, capacity 7/8 of a shard's rows (28 of 32 on 4).
    "shared_traced": lambda mask, shards: dict(active_mask=mask, overflow="nan",
                                               top_n=BATCH * LENGTH // shards * 7 // 8),
    # A host mask: the rung of the fullest shard, picked while tracing.
    "shared_host": lambda mask, shards: dict(active_mask=_mask(), top_n="auto"),
    "shared_traced_auto": lambda mask, shards: dict(active_mask=mask),
    "per_layer": lambda mask, shards: dict(top_n=16),
    "per_layer_auto": lambda mask, shards: dict(),
}


@pytest.mark.parametrize("case", sorted(LINEN_CASES))
@pytest.mark.parametrize("axis_type,num_devices", MESHES, ids=str)
def test_linen_gradient_equals_one_device_and_adds_no_collective(axis_type, num_devices, case):
  model, params, inputs = _linen_case(axis_type)
  mask = _mask()
  want = _step(model, lambda m: None)(params, inputs, mask)
  mesh = _mesh(axis_type, shape=(num_devices,))
  with jax.set_mesh(mesh):
    args = (_put(params, mesh, P()), *_put((inputs, mask), mesh, P("data")))
    # Explicit: from the types, but for a host mask, which has no split of its own.
    batch_axes = "data" if axis_type == AxisType.Auto or case == "shared_host" else None
    sebp = _step(model, lambda m: dict(LINEN_CASES[case](m, num_devices),
                                       batch_axes=batch_axes))
    assert_every_gradient_close(sebp(*args), want, rtol=2e-5)
    dense = _step(model, lambda m: None)
    assert (collective_counts(sebp.lower(*args).compile())
            == collective_counts(dense.lower(*args).compile()))


def _all_eqns(jaxpr):
  """Every equation of ``jaxpr``, nested ones included."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _all_eqns(sub)


def _shard_map_outputs(jaxpr):
  """The output avals of every shard_map in ``jaxpr``, nested ones included."""
  return (v.aval for eqn in _all_eqns(jaxpr) if eqn.primitive.name == "shard_map"
          for v in eqn.outvars)


@pytest.mark.parametrize("shared", [True, False], ids=["shared_index", "per_layer"])
def test_weight_gradients_cross_devices_in_the_compute_dtype(shared):
  """float32 weights used in bfloat16: each shard's partial dW and db leave its shard_map in
  bfloat16, to be summed across devices as the dense backward's are, not in float32 (twice
  the bytes); the gradients come back float32."""
  class Bf16Tagger(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, dtype=jnp.bfloat16)(nn.Dense(64, dtype=jnp.bfloat16)(x))

  model = Bf16Tagger()
  inputs = jax.random.normal(jax.random.key(6), (BATCH, LENGTH, FEATURES))
  params = model.init(jax.random.key(7), inputs)
  mask = _mask(6)
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    args = (_put(params, mesh, P()), *_put((inputs, mask), mesh, P("data")))
    options = dict(active_mask=mask, top_n=64) if shared else dict(top_n=16)
    sebp = _step(model, lambda m: dict(options, batch_axes="data"))
    stacked = {(aval.shape[1:], aval.dtype.name)
               for aval in _shard_map_outputs(jax.make_jaxpr(sebp)(*args).jaxpr)
               if aval.shape[0] == 4}  # One partial sum per shard.
    grads = sebp(*args)
  weights = {(FEATURES, 64), (64,), (64, 8), (8,)}
  assert {(shape, "bfloat16") for shape in weights} <= stacked
  assert not {(shape, "float32") for shape in weights} & stacked
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
def test_fsdp_params_communicate_as_the_dense_step(axis_type):
  """Kernels split over the batch's axis: gathered for the forward and dX, their gradients
  reduced into the same split, as the dense step does."""
  model, params, inputs = _linen_case(AxisType.Explicit)
  mask = _mask(1)
  want = _step(model, lambda m: None)(params, inputs, mask)
  mesh = _mesh(axis_type)
  specs = jax.tree.map(lambda a: P("data") if a.ndim == 2 else P(), params)
  shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs)

  def step_of(options_of):
    def loss(params, inputs, mask):
      if axis_type == AxisType.Explicit:  # Explicit FSDP: the step gathers its weights.
        params = jax.tree.map(lambda p: jax.sharding.reshard(p, P()), params)
      options = options_of(mask, 4)
      if options is None:
        return _masked_loss(model.apply(params, inputs), mask)
      with use_sebp(backend="xla", batch_axes="data", **options):
        return _masked_loss(model.apply(params, inputs), mask)
    return jax.jit(jax.grad(loss), out_shardings=shardings)

  with jax.set_mesh(mesh):
    args = (jax.device_put(params, shardings), *_put((inputs, mask), mesh, P("data")))
    dense = collective_counts(step_of(lambda m, shards: None).lower(*args).compile())
    assert dense.get("all-gather", 0) > 0  # The weights are gathered, as FSDP does.
    for options_of in (LINEN_CASES["shared_traced"], LINEN_CASES["per_layer"]):
      sebp = step_of(options_of)
      got = sebp(*args)
      assert_every_gradient_close(got, want, rtol=2e-5)
      assert jax.tree.map(lambda g: g.sharding.spec, got) == specs
      assert collective_counts(sebp.lower(*args).compile()) == dense


@pytest.mark.parametrize("backend", ["xla", "pallas", "dense"])
@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
def test_ops_select_per_shard(axis_type, backend):
  """sebp_linear and sebp_embed_lookup with rows split over 4 shards, each shard's index of
  its own rows: the gradients of one device."""
  if backend == "pallas" and jax.default_backend() != "cpu":
    pytest.skip("the kernels interpret only where the default backend is the CPU; "
                "test_data_parallel_on_gpus runs them on GPUs")
  keys = jax.random.split(jax.random.key(1), 4)
  x = jax.random.normal(keys[0], (BATCH, LENGTH, FEATURES))
  kernel, bias = jax.random.normal(keys[1], (FEATURES, 24)), jax.random.normal(keys[2], (24,))
  mask = _mask(2)
  # Each shard's index: its real tokens, local flat positions, sentinel = its 32 rows.
  local_rows = np.full((4, 24), 2 * LENGTH, np.int32)
  for shard, block in enumerate(mask.reshape(4, -1)):
    (real,) = np.nonzero(block)
    local_rows[shard, :len(real)] = real

  def loss(x, kernel, bias, sebp):
    if sebp:
      y = sebp_linear(x, kernel, bias, top_n=24, overflow="nan", backend=backend,
                      active_rows=jnp.asarray(local_rows.reshape(-1)))
    else:
      y = x @ kernel + bias
    return _masked_loss(y, mask)

  want = jax.grad(loss, argnums=(0, 1, 2))(x, kernel, bias, False)
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh):
    xs = _put(x, mesh, P("data"))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    if axis_type == AxisType.Auto:
      grad = jax.jit(jax.grad(lambda x, k, b: _masked_loss(sebp_linear(
          x, k, b, top_n=24, overflow="nan", backend=backend, batch_axes="data",
          active_rows=jnp.asarray(local_rows.reshape(-1))), mask), argnums=(0, 1, 2)))
      got = grad(xs, kernel, bias)
    else:
      got = grad(xs, kernel, bias, True)
  assert_every_gradient_close(got, want, rtol=2e-5)

  ids = jax.random.randint(keys[3], (BATCH, LENGTH), 0, 50)
  table = jax.random.normal(keys[0], (50, FEATURES))

  def embed_loss(table, sebp):
    rows = (sebp_embed_lookup(table, ids_in, top_n=24, overflow="nan", batch_axes="data",
                              active_rows=jnp.asarray(local_rows.reshape(-1)))
            if sebp else jnp.take(table, ids_in, axis=0))
    return _masked_loss(rows, mask)

  if axis_type == AxisType.Auto:  # Under Explicit a lookup of split ids needs out_sharding.
    ids_in = ids
    want_table = jax.grad(embed_loss)(table, False)
    with jax.set_mesh(mesh):
      ids_in = _put(ids, mesh, P("data"))
      got_table = jax.jit(jax.grad(embed_loss), static_argnums=1)(table, True)
    np.testing.assert_allclose(got_table, want_table, rtol=2e-5, atol=1e-5)


@pytest.mark.parametrize("num_embeddings", [48, 400])
def test_embedding_gradient_gathers_the_kept_rows_where_fewer_bytes(num_embeddings):
  """4 shards of 24 kept rows (an Auto mesh: under Explicit axes a lookup of split ids needs
  an out_sharding, dense or not): a table of 400 rows gets its gradient from the 96 kept rows
  of dY gathered to every device (all-gathers; no all-reduce for a table kept whole), one of
  48 as the sum of each shard's scatter (an all-reduce); one device's gradient either way,
  the table whole or split by rows. A NaN in one shard's skipped row makes every element
  NaN."""
  keys = jax.random.split(jax.random.key(7), 3)
  ids = jax.random.randint(keys[0], (BATCH, LENGTH), 0, num_embeddings)
  table = jax.random.normal(keys[1], (num_embeddings, FEATURES))
  mask = _mask(2)
  weights = jax.random.normal(keys[2], (BATCH, LENGTH, FEATURES)) * mask[..., None]
  local_rows = np.full((4, 24), 2 * LENGTH, np.int32)
  for shard, block in enumerate(mask.reshape(4, -1)):
    (real,) = np.nonzero(block)
    local_rows[shard, :len(real)] = real
  padding = np.argwhere(~mask[2:4])[0] + (2, 0)  # A padding token of shard 1.

  def loss(table, ids, weights, sebp):
    if sebp:
      rows = sebp_embed_lookup(table, ids, top_n=24, overflow="nan",
                               batch_axes="data",
                               active_rows=jnp.asarray(local_rows.reshape(-1)))
    else:
      rows = jnp.take(table, ids, axis=0)
    return jnp.sum(jnp.sin(rows) * weights)

  want = jax.grad(loss)(table, ids, weights, False)
  mesh = _mesh(AxisType.Auto)
  for table_spec in (P(), P("data")):
    with jax.set_mesh(mesh):
      args = (_put(table, mesh, table_spec), *_put((ids, weights), mesh, P("data")))
      grad = jax.jit(jax.grad(loss), static_argnums=3)
      np.testing.assert_allclose(grad(*args, True), want, rtol=2e-5, atol=1e-5)
      sebp, dense = (grad.lower(*args, sebp).compile() for sebp in (True, False))
      if num_embeddings == 48:
        assert collective_counts(sebp) == collective_counts(dense)
      else:  # The dense step sums a table; nothing that large crosses in the SEBP one.
        assert max(size for _, size in collective_sizes(dense)) >= table.size * 4
        assert max(size for _, size in collective_sizes(sebp)) < table.size * 4 // 2
        assert ("all-reduce" in collective_counts(sebp)) == (table_spec != P())
      poisoned = args[2].at[tuple(padding)].set(jnp.nan)
      assert np.isnan(np.asarray(grad(*args[:2], poisoned, True))).all()


@pytest.mark.parametrize("length", [LENGTH, 0])
def test_gathered_rows_drop_ids_out_of_range_and_take_an_empty_batch(length):
  """The gathered rows' ids keep their range: uint32 ids of 2**31 and more, out of range, get
  no gradient (none wraps into a row by a cast to int32); a batch of no tokens gives a zero
  table."""
  rng = np.random.default_rng(5)
  table = jnp.asarray(rng.normal(size=(400, FEATURES)), jnp.float32)
  ids = rng.integers(0, 400, size=(BATCH, length))
  ids.flat[::5] = rng.choice([400, 2**31, 2**32 - 1, 2**32 - 6], size=ids.flat[::5].shape)
  ids = jnp.asarray(ids.astype(np.uint32))
  dy = jnp.asarray(rng.normal(size=(BATCH, length, FEATURES)), jnp.float32)
  want = jax.vjp(lambda t: jnp.take(t, ids, axis=0), table)[1](dy)[0]
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    sharded = _put((ids, dy), mesh, P("data"))
    got = jax.jit(lambda t, i, d: jax.vjp(
        lambda t: sebp_embed_lookup(t, i, batch_axes="data"), t)[1](d)[0])(table, *sharded)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_gathered_rows_give_the_table_on_explicit_axes_and_to_second_order():
  """The gathered rows' table takes the parameter's own sharding under Explicit axes (a
  2x2 mesh, the table split by features, the ids split over "data" by batch_axes); and with
  every row kept and none selected the lookup's gradient is differentiable again (a
  Hessian-vector product equals the dense lookup's), gathered or not."""
  keys = jax.random.split(jax.random.key(11), 4)
  ids = jax.random.randint(keys[0], (BATCH, LENGTH), -400, 400)
  table = jax.random.normal(keys[1], (400, 8))
  mask = _mask(2)
  weights = jax.random.normal(keys[2], (BATCH, LENGTH, 8)) * mask[..., None]
  tangent = jax.random.normal(keys[3], table.shape)
  top_n = token_capacity(mask, multiple=1, num_shards=2)  # The fullest shard's real rows.
  assert top_n < BATCH * LENGTH // 2

  def loss(table, lookup):
    return jnp.sum(jnp.sin(lookup(table)) * weights)

  dense = lambda t: jnp.take(t, ids, axis=0)  # noqa: E731
  want = jax.grad(loss)(table, dense)
  mesh = _mesh(AxisType.Explicit, shape=(2, 2), names=("data", "model"))
  with jax.set_mesh(mesh):
    split = _put(table, mesh, P(None, "model"))
    sebp = lambda t: sebp_embed_lookup(t, ids, top_n=top_n, overflow="nan",  # noqa: E731
                                       batch_axes="data")
    got = jax.jit(jax.grad(loss), static_argnums=1)(split, sebp)
  assert got.sharding.spec == P(None, "model")
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)

  def hvp(lookup):
    return jax.jvp(lambda t: jax.grad(loss)(t, lookup), (table,), (tangent,))[1]

  want_hvp = hvp(dense)
  for rows in (400, 40):  # Gathered, and summed over the shards.
    mesh = _mesh(AxisType.Auto)
    with jax.set_mesh(mesh):
      lookup = lambda t, rows=rows: sebp_embed_lookup(  # noqa: E731
          t[:rows], jnp.where(ids % rows == ids, ids, 0), batch_axes="data")
      dense_rows = lambda t, rows=rows: jnp.take(  # noqa: E731
          t[:rows], jnp.where(ids % rows == ids, ids, 0), axis=0)
      np.testing.assert_allclose(jax.jit(hvp, static_argnums=0)(lookup), hvp(dense_rows),
                                 rtol=2e-5, atol=1e-5)
  assert np.abs(want_hvp).max() > 0


def test_rows_summed_per_id_scatter_each_row_of_the_table_once():
  """The gathered rows summed per id (repeats, negative and out-of-range ids, the sentinel):
  every id the scatter keeps is distinct, and the table is the float64 sum of the rows."""
  rng = np.random.default_rng(12)
  ids = np.concatenate([rng.integers(-10, 10, 60), [10, 10, -11, 25, 3]]).astype(np.int32)
  rows = rng.normal(size=(ids.size, 5)).astype(np.float32)
  summed_ids, sums = sum_rows_of_equal_ids(jnp.asarray(ids), jnp.asarray(rows),
                                           num_embeddings=10)
  kept = np.asarray(summed_ids)[np.asarray(summed_ids) < 10]
  assert len(set(kept.tolist())) == kept.size == len(set((ids[(ids >= -10) & (ids < 10)]
                                                          % 10).tolist()))
  want = np.zeros((10, 5))
  for i, row in zip(ids, rows.astype(np.float64)):
    if -10 <= i < 10:
      want[i % 10] += row
  table = scatter_into_table(summed_ids, sums, None, num_embeddings=10)
  np.testing.assert_allclose(table, want, rtol=1e-5, atol=1e-5)


def test_top_n_counts_per_shard():
  """An int top_n is each shard's capacity: enough for the fullest shard is exact even when
  the batch holds more real tokens; one fewer makes a host mask raise."""
  model, params, inputs = _linen_case(AxisType.Auto)
  mask = _mask(3)
  per_shard = int(shard_row_counts(mask, 4).max())
  assert per_shard == token_capacity(mask, multiple=1, num_shards=4)
  assert per_shard < mask.sum()
  want = _step(model, lambda m: None)(params, inputs, mask)
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    args = (params, *_put((inputs, mask), mesh, P("data")))
    sebp = _step(model, lambda m: dict(active_mask=m, top_n=per_shard, overflow="nan",
                                       batch_axes="data"))
    assert_every_gradient_close(sebp(*args), want, rtol=2e-5)
    too_small = _step(model, lambda m: dict(active_mask=mask, top_n=per_shard - 1,
                                            overflow="nan", batch_axes="data"))
    with pytest.raises(ValueError, match=f"more than top_n={per_shard - 1}"):
      too_small(*args)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=str)
def test_overflow_nan_counts_the_real_tokens_a_shards_index_cuts(axis_type):
  """One shard holds more real tokens than top_n, but as many active ones, some of its real
  tokens weighing nothing: the tokens its index cuts make every gradient NaN."""
  model, params, inputs = _linen_case(axis_type)
  mask = np.zeros((BATCH, LENGTH), bool)
  mask[:, :5] = True
  mask[2:4, :12] = True  # The second shard: 24 real tokens, the others 10.
  weights = mask.copy()
  weights[2, :4] = False  # of which 20 weigh anything

  def loss(params, inputs, mask, top_n):
    with use_sebp(backend="xla", active_mask=mask, top_n=top_n, overflow="nan",
                  batch_axes="data" if axis_type == AxisType.Auto else None):
      outputs = model.apply(params, inputs)
    return _masked_loss(outputs, weights)

  want = jax.grad(lambda p: _masked_loss(model.apply(p, inputs), weights))(params)
  mesh = _mesh(axis_type)
  with jax.set_mesh(mesh):
    args = (_put(params, mesh, P()), *_put((inputs, mask), mesh, P("data")))
    grad = jax.jit(jax.grad(loss), static_argnums=3)
    assert all(np.isnan(np.asarray(g)).all() for g in jax.tree.leaves(grad(*args, 20)))
    assert_every_gradient_close(grad(*args, 24), want, rtol=2e-5)


def test_auto_capacity_from_a_host_mask_is_the_fullest_shards_rung():
  """"auto" with a host mask: every shard runs the rung that holds the fullest shard's real
  tokens (the row log's capacity), not the whole batch's."""
  model, params, inputs = _linen_case(AxisType.Auto)
  mask = np.zeros((BATCH, LENGTH), bool)
  mask[:2, :3] = True  # The first shard: 6 real tokens of its 32 rows; the others none.
  log = RowLog()
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    args = (params, *_put((inputs, mask), mesh, P("data")))
    sebp = _step(model, lambda m: dict(active_mask=mask, batch_axes="data", row_log=log))
    jax.block_until_ready(sebp(*args))
  records = log.records
  assert records and {r["capacity"] for r in records} == {8}  # T/4 of a shard's 32 rows.
  assert sorted(r["active"] for r in records if r["layer"] == "Dense_0") == [0, 0, 0, 6]


def test_a_nan_row_in_one_shard_stays_visible():
  keys = jax.random.split(jax.random.key(4), 2)
  x = jax.random.normal(keys[0], (BATCH, LENGTH, FEATURES))
  kernel = jax.random.normal(keys[1], (FEATURES, 8))
  dy = jnp.zeros((BATCH, LENGTH, 8)).at[5, 3].set(jnp.nan).at[0, 0].set(1.0)
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh):
    _, vjp = jax.vjp(lambda x, k: sebp_linear(x, k, top_n=8, overflow="drop", backend="xla",
                                              batch_axes="data"), _put(x, mesh, P("data")),
                     kernel)
    dx, dkernel = vjp(_put(dy, mesh, P("data")))
  assert np.isnan(np.asarray(dkernel)).all()
  assert np.isnan(np.asarray(dx[5, 3])).all() and np.isfinite(np.asarray(dx[:4])).all()


class _NNXTagger(nnx.Module):

  def __init__(self, rngs, with_embed):
    self.embed = nnx.Embed(50, FEATURES, rngs=rngs) if with_embed else None
    self.up = nnx.Linear(FEATURES, 64, rngs=rngs)
    self.heads = nnx.Einsum("btd,dnh->btnh", (64, 2, 8), (2, 8), rngs=rngs)

  def __call__(self, inputs):
    h = self.embed(inputs) if self.embed is not None else inputs
    return self.heads(nnx.gelu(self.up(h)))


@pytest.mark.parametrize("shared", [True, False], ids=["shared_index", "per_layer"])
@pytest.mark.parametrize("axis_type,num_devices", MESHES, ids=str)
def test_nnx_gradient_equals_one_device_and_adds_no_collective(axis_type, num_devices, shared):
  explicit = axis_type == AxisType.Explicit
  _, _, inputs = _linen_case(axis_type)
  model = _NNXTagger(nnx.Rngs(0), with_embed=not explicit)
  mask = _mask(5)

  def loss(model, inputs, mask, sebp):
    if not sebp:
      return _masked_loss(model(inputs).reshape(BATCH, LENGTH, -1), mask)
    options = (dict(active_mask=mask, overflow="nan",
                    top_n=token_capacity(_mask(5), multiple=8, num_shards=num_devices))
               if shared else dict(top_n=16))
    with sebp_nnx.use_sebp(model, backend="xla", batch_axes=None if explicit else "data",
                           **options) as report:
      outputs = model(inputs)
    assert len(report.per_shard) == len(report.swapped) + len(report.embeddings) == 3 - explicit
    return _masked_loss(outputs.reshape(BATCH, LENGTH, -1), mask)

  def grads(model, *args, sebp):
    return nnx.state(nnx.grad(loss)(model, *args, sebp), nnx.Param)

  want = grads(model, inputs, mask, sebp=False)
  mesh = _mesh(axis_type, shape=(num_devices,))
  with jax.set_mesh(mesh):
    args = _put((inputs, mask), mesh, P("data"))
    step = nnx.jit(grads, static_argnames="sebp")
    assert_every_gradient_close(step(model, *args, sebp=True), want, rtol=2e-5)
    graphdef, state = nnx.split(model)

    def compiled(sebp):
      pure = jax.jit(lambda state, *args: grads(nnx.merge(graphdef, state), *args, sebp=sebp))
      return collective_counts(pure.lower(state, *args).compile())
    assert compiled(True) == compiled(False)


def test_errors_name_the_argument(caplog):
  x = jnp.ones((BATCH, LENGTH, FEATURES))
  kernel = jnp.ones((FEATURES, 4))
  with pytest.raises(ValueError, match="batch_axes=.*needs a mesh"):
    sebp_linear(x, kernel, batch_axes="data")
  mesh = _mesh(AxisType.Auto)
  with pytest.raises(ValueError, match=r"names axes \['model'\]"):
    sebp_linear(x, kernel, batch_axes="model", mesh=mesh)
  with pytest.raises(ValueError, match="batch_axes must be a mesh axis name"):
    sebp_linear(x, kernel, batch_axes=3, mesh=mesh)
  with pytest.raises(ValueError, match="give batch_axes too"):
    use_sebp(mesh=mesh)
  # A mesh's shape, axis names or devices in place of the mesh.
  with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh, got dict"):
    use_sebp(batch_axes="data", mesh=dict(mesh.shape))
  with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh, got tuple"):
    sebp_linear(x, kernel, batch_axes="data", mesh=mesh.axis_names)
  with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh, got ndarray"):
    pack_decoder_inputs(jnp.ones((BATCH, LENGTH), jnp.int32), jnp.ones((BATCH, LENGTH)), 64,
                        batch_axes="data", mesh=mesh.devices)
  explicit = _mesh(AxisType.Explicit, (2, 2), ("data", "model"))
  with jax.set_mesh(explicit):
    split = jax.device_put(x, NamedSharding(explicit, P("data")))
    with pytest.raises(ValueError, match="disagrees with the sharding"):
      row_sharding(split, 2, batch_axes=("model",))
  # An index of each shard's rows is one block per shard, sentinel a shard's row count.
  per_shard_index = np.tile(np.r_[np.arange(20), np.full(4, 32)], 4)
  with pytest.raises(ValueError, match="sentinel 128"):
    sebp_linear(x, kernel, active_rows=per_shard_index)
  sebp_linear(x, kernel, active_rows=per_shard_index, batch_axes="data", mesh=mesh)
  with pytest.raises(ValueError, match=r"sentinel 32 in unused slots \(in each shard\)"):
    sebp_linear(x, kernel, active_rows=per_shard_index[::-1].copy(), batch_axes="data",
                mesh=mesh)
  # Rows the shards do not divide evenly select over the whole batch, with a warning (packed
  # rows [1, shards * C] among them).
  with caplog.at_level(logging.WARNING, logger="sebp_jax"):
    assert row_sharding(jnp.ones((3, 7, 2)), 2, batch_axes=("data",), mesh=mesh) is None
  assert "not divided by the 4 shards" in caplog.text


def test_ops_in_a_shard_map_sum_a_replicated_input_gradient_over_devices():
  """The ops called inside a user's ``jax.shard_map`` on each device's rows, with weights that
  every device holds whole: each weight's gradient is the sum over the devices, as the dense
  ops give it (not a per-device value, which JAX refuses for an input that does not vary)."""
  rng = np.random.default_rng(4)
  x = rng.normal(size=(BATCH, FEATURES)).astype(np.float32)
  ids = rng.integers(0, 10, BATCH)
  kernel, bias, table = (rng.normal(size=shape) for shape in ((FEATURES, 6), 6, (10, 6)))
  head, labels = rng.normal(size=(6, 5)), rng.integers(0, 5, BATCH)
  weights = rng.uniform(size=BATCH).astype(np.float32)
  params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), (kernel, bias, table, head))

  def loss(params, x, ids, labels, weights, sebp):
    kernel, bias, table, head = params
    rows = x.shape[0]
    if sebp:
      h = sebp_linear(x, kernel, bias, top_n=rows) + sebp_embed_lookup(table, ids, top_n=rows)
    else:
      h = x @ kernel + bias + table[ids]
    return jnp.sum(jnp.sin(h)) + linear_cross_entropy(h, head, None, labels, weights, chunk=2)

  want = jax.grad(loss)(params, x, ids, labels, weights, False)
  mesh = _mesh(AxisType.Auto)
  per_device = jax.shard_map(
      lambda *args: jax.lax.psum(loss(*args, sebp=True), "data"), mesh=mesh,
      in_specs=(P(), P("data"), P("data"), P("data"), P("data")), out_specs=P())
  got = jax.jit(jax.grad(per_device))(params, x, ids, labels, weights)
  assert_every_gradient_close(got, want, rtol=1e-5)

  # float32 weights used in bfloat16: their sums cross devices in bfloat16, as the dense ops'.
  def bf16_loss(params, x, ids):
    kernel, bias, table, _ = params
    h = (sebp_linear(x, kernel, bias, top_n=2, dtype=jnp.bfloat16)
         + sebp_embed_lookup(table, ids, top_n=2, dtype=jnp.bfloat16))
    return jax.lax.psum(jnp.sum(h.astype(jnp.float32)), "data")

  per_device = jax.shard_map(bf16_loss, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                             out_specs=P())
  jaxpr = jax.make_jaxpr(jax.grad(per_device))(params, x, ids).jaxpr
  sums = [eqn.invars[0].aval for eqn in _all_eqns(jaxpr)
          if "psum" in eqn.primitive.name and eqn.invars[0].aval.ndim]
  assert sorted(aval.shape for aval in sums) == sorted([(6,), (FEATURES, 6), (10, 6)])
  assert {aval.dtype for aval in sums} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("id_dtype,num_embeddings", [(np.int32, 16), (np.uint8, 260),
                                                     (np.int8, 300), (np.uint32, 16)])
def test_split_table_lookup_is_take_with_the_table_left_split(id_dtype, num_embeddings):
  """`split_table_lookup` in a `shard_map` over 4 devices, the table split by rows and each
  device with ids of its own (negative ones, and ids out of range, up to the dtype's largest;
  uint8 ids of a 260-row table, int8 ids of a 300-row one): `jnp.take` of the whole table,
  NaN where an id is out of range and where a row read holds one; its gradient is take's
  (float64 numpy), and comes back split as the table."""
  mesh = _mesh(AxisType.Auto)
  rng = np.random.default_rng(3)
  table = jnp.asarray(rng.normal(size=(num_embeddings, 5)), jnp.float32).at[6, 2].set(jnp.nan)
  lowest = -num_embeddings if np.issubdtype(id_dtype, np.signedinteger) else 0
  ids = rng.integers(lowest, min(num_embeddings, np.iinfo(id_dtype).max + 1), size=(8, 3))
  largest = np.iinfo(id_dtype).max
  ids[2, 2], ids[3, 1] = 6, largest  # uint8: 255, a row of the table.
  if num_embeddings <= largest:
    ids[1, 1] = num_embeddings
  if lowest:
    ids[5, 0] = -num_embeddings - 1
  ids = jnp.asarray(ids.astype(id_dtype))
  dy = jnp.asarray(rng.normal(size=(8, 3, 5)), jnp.float32)
  lookup = jax.jit(jax.shard_map(
      lambda t, i: split_table_lookup(t, i, "data", num_embeddings), mesh=mesh,
      in_specs=(P("data"), P("data")), out_specs=P("data")))
  split_table = jax.device_put(table, NamedSharding(mesh, P("data")))
  got, got_vjp = jax.vjp(lambda t: lookup(t, ids), split_table)
  np.testing.assert_array_equal(got, jnp.take(table, ids, axis=0))
  assert np.isnan(got[2, 2, 2])
  assert np.isnan(got[3, 1]).all() == (largest >= num_embeddings)
  (got_grad,) = got_vjp(dy)
  np.testing.assert_allclose(got_grad, reference_take_grad(num_embeddings, ids, dy),
                             rtol=1e-6, atol=1e-6)
  assert got_grad.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 2)


def test_fsdp_loss_looks_a_table_up_in_place_where_that_moves_fewer_rows():
  """`fsdp_loss(lookups_in_place="auto")` on a Linen model with two split tables: the large
  one (256 rows, 4 devices of 6 ids) is looked up in place (its ids and dY's rows gathered,
  the rows reduce-scattered), the small one (16 rows) gathered and its gradient
  reduce-scattered; loss and gradient are one device's."""
  class TwoTables(nn.Module):
    @nn.compact
    def __call__(self, ids):
      return nn.Embed(256, 8, name="large")(ids) * nn.Embed(16, 8, name="small")(ids % 16)

  rng = np.random.default_rng(4)
  ids = jnp.asarray(rng.integers(0, 256, size=(8, 3)), jnp.int32)
  net = TwoTables()
  params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype),
                        net.init(jax.random.key(0), ids)["params"])
  loss = lambda params, ids: jnp.mean(net.apply({"params": params}, ids) ** 2)
  want = jax.value_and_grad(loss)(params, ids)
  mesh = _mesh(AxisType.Auto)
  specs = jax.tree.map(lambda _: P("data"), params)
  args = (jax.device_put(params, NamedSharding(mesh, P("data"))),
          jax.device_put(ids, NamedSharding(mesh, P("data"))))
  step = jax.jit(jax.value_and_grad(fsdp_loss(loss, mesh, specs)))
  got = step(*args)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  assert_every_gradient_close(got[1], want[1], rtol=1e-5)
  assert collective_counts(step.lower(*args).compile()) == {
      "all-gather": 3, "reduce-scatter": 2, "all-reduce": 2}


def test_fsdp_loss_looks_a_table_up_in_place_through_its_own_promote_dtype():
  """An `nn.Embed` with a `promote_dtype` of its own (a cast to bfloat16) looked up in place
  reads its rows through it, as its own forward does: one device's loss and gradient."""
  def to_bf16(*arrays, dtype=None, inexact=True):
    return tuple(None if a is None else jnp.asarray(a, jnp.bfloat16) for a in arrays)

  net = nn.Embed(64, 8, promote_dtype=to_bf16)
  rng = np.random.default_rng(6)
  ids = jnp.asarray(rng.integers(0, 64, size=(8, 1)), jnp.int32)
  params = {"embedding": jnp.asarray(rng.normal(size=(64, 8)) + 1 / 3, jnp.float32)}
  loss = lambda params, ids: jnp.mean(net.apply({"params": params}, ids).astype(jnp.float32))
  want = jax.value_and_grad(loss)(params, ids)
  mesh = _mesh(AxisType.Auto)
  args = (_put(params, mesh, P("data")), _put(ids, mesh, P("data")))
  for lookups in ("auto", True):
    got = jax.jit(jax.value_and_grad(fsdp_loss(loss, mesh, {"embedding": P("data")},
                                                lookups_in_place=lookups)))(*args)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1]["embedding"], want[1]["embedding"])


def test_collective_sizes_read_every_element_type_and_async_start():
  """The bytes of a collective's result in each XLA element type, complex and 8- and 4-bit
  floats and ints included."""
  class Compiled:
    def __init__(self, text):
      self.text = text

    def as_text(self):
      return self.text

  for element, size in [("f32", 4), ("bf16", 2), ("pred", 1), ("c64", 8), ("c128", 16),
                        ("f8e4m3fn", 1), ("f8e5m2", 1), ("s4", 0.5), ("u8", 1), ("f64", 8)]:
    hlo = (f"  %g = {element}[16,8]{{1,0}} all-gather({element}[4,8]{{1,0}} %p), "
           f"dimensions={{0}}\n"
           f"  %s = ((f32[4]{{0}}), {element}[2,4]{{1,0}}) all-gather-start(%q)\n"
           f"  %r = {element}[2,4]{{1,0}} all-reduce-start({element}[2,4]{{1,0}} %q)\n")
    assert collective_sizes(Compiled(hlo)) == [("all-gather", int(128 * size)),
                                                ("all-gather", int(8 * size)),
                                                ("all-reduce", int(8 * size))], element
  # Async starts as XLA writes them: all-reduce-start's type is its results (a combined one's
  # tuple), all-gather-start's (operands, results), collective-permute-start's (operand,
  # result, contexts).
  hlo = ("  %a = (f32[1024]{0}, bf16[64,64]{1,0}) all-reduce-start(f32[1024]{0} %p, "
         "bf16[64,64]{1,0} %q), to_apply=%add\n"
         "  %b = ((f32[4]{0}, bf16[2,3]{1,0}), (f32[16]{0}, bf16[8,3]{1,0})) "
         "all-gather-start(f32[4]{0} %p, bf16[2,3]{1,0} %q), dimensions={0}\n"
         "  %c = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start(f32[8]{0} %p)\n")
  assert collective_sizes(Compiled(hlo)) == [
      ("all-reduce", 4096 + 8192), ("all-gather", 64 + 48), ("collective-permute", 32)]
  lowered = jax.jit(lambda x: x * 2).lower(jnp.ones(4))
  with pytest.raises(ValueError, match="needs a compiled program"):
    collective_counts(lowered)


@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("x_spec,kernel_spec,bias_spec", [
    (P("data"), P(None, "model"), P("model")),  # The kernel's columns and bias split.
    (P("data", "model"), P(), P()),  # A sequence axis split too.
    # Rows not split over "data": the backward runs with the Explicit axes made Auto.
    (P(), P(), P()),
    (P(None, "model"), P(), P()),  # Sequence parallel: rows flattened across a split dim.
    (P(), P("model"), P()),  # The contracted dim split (tensor parallel, row-split kernel).
    (P(), P(None, "model"), P()),  # The kernel's columns split, the bias not.
], ids=str)
def test_ops_on_a_two_dimensional_explicit_mesh_give_grads_typed_as_their_inputs(
    x_spec, kernel_spec, bias_spec, backend):
  """sebp_linear on an Explicit data x model mesh, rows split over "data" (the shard_map
  leaves "model" Explicit) or not split: one device's gradients, each typed as the array it
  is the gradient of, wherever the dense layer runs. The Pallas kernels too (interpreted on
  CPU): a pallas_call refuses operands typed as split, and JAX's interpreter fails under an
  Explicit axis, unless the backend makes the axes Auto around them."""
  if backend == "pallas" and jax.default_backend() != "cpu":
    pytest.skip("the kernels interpret only where the default backend is the CPU")
  keys = jax.random.split(jax.random.key(7), 3)
  x = jax.random.normal(keys[0], (BATCH, 4, 6))
  kernel, bias = jax.random.normal(keys[1], (6, 8)), jax.random.normal(keys[2], (8,))
  mask = _mask(5, length=4)

  def loss(x, kernel, bias, sebp):
    y = (sebp_linear(x, kernel, bias, top_n=3, backend=backend) if sebp
         else jnp.einsum("bld,dn->bln", x, kernel) + bias)
    return _masked_loss(y, mask)

  want = jax.grad(loss, argnums=(0, 1, 2))(x, kernel, bias, False)
  mesh = _mesh(AxisType.Explicit, (2, 2), ("data", "model"))
  with jax.set_mesh(mesh):
    args = tuple(_put(a, mesh, spec) for a, spec in
                 zip((x, kernel, bias), (x_spec, kernel_spec, bias_spec)))
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)(*args, True)
  assert_every_gradient_close(got, want, rtol=2e-5)
  for grad, arg in zip(got, args):
    assert jax.typeof(grad).sharding.spec == jax.typeof(arg).sharding.spec


@pytest.mark.parametrize("bias_spec,head_chunk", [(P(), None), (P("data"), None), (P(), 4)],
                         ids=str)
def test_fsdp_loss_computes_a_head_split_by_its_vocabulary_on_each_devices_columns(
    bias_spec, head_chunk):
  """An LM head's kernel split over 4 devices by its columns (the vocabulary, 64 columns),
  its bias replicated or split: `masked_causal_lm_loss` computes each device's columns'
  logits for every device's rows (`capacity=` picking the real targets first, labels on
  both sides of each device's block), and the kernel is neither gathered nor
  reduce-scattered (`head_chunk` chunks packed logits only). Loss and gradient are one
  device's. A target out of the vocabulary (a row's last token: no
  prediction reads its embedding) makes the loss and every gradient NaN."""
  class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
      hidden = jnp.tanh(nn.Dense(8)(nn.Embed(64, 8)(ids)))
      return nn.Dense(64, name="lm_head")(hidden)

  rng = np.random.default_rng(5)
  mask = (np.arange(6)[None] < rng.integers(1, 7, size=(8, 1))).astype(np.int32)
  ids = rng.integers(0, 64, size=(8, 6))
  ids[:, 1] = [15, 16, 31, 32, 47, 48, 63, 0]  # Targets where rows reach position 1.
  ids = jnp.asarray(ids * mask, jnp.int32)
  net = TinyLM()
  params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype),
                        net.init(jax.random.key(0), ids)["params"])

  def loss(params, batch, capacity=12):  # A device's 2 rows have at most 10 targets.
    ids, mask = batch
    return masked_causal_lm_loss(net.apply({"params": params}, ids), ids, mask,
                                 capacity=capacity, head_chunk=head_chunk)

  mesh = _mesh(AxisType.Auto)
  specs = {"Embed_0": {"embedding": P()}, "Dense_0": {"kernel": P("data"), "bias": P()},
           "lm_head": {"kernel": P(None, "data"), "bias": bias_spec}}
  params_split = jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)),
                              params, specs)
  step = jax.jit(jax.value_and_grad(fsdp_loss(
      loss, mesh, specs, weight_fn=lambda batch: causal_lm_target_count(batch[1]))))
  # The last real token of a row of two or more: a target, never a predicting position.
  row = int(np.argmax(mask.sum(1) >= 2))
  for poisoned in (False, True):
    batch_ids = ids.at[row, mask[row].sum() - 1].set(64) if poisoned else ids
    args = (params_split, jax.device_put((batch_ids, mask), NamedSharding(mesh, P("data"))))
    got = step(*args)
    want = jax.value_and_grad(loss)(params, (batch_ids, mask), None)
    if poisoned:  # NaN where one device has it, and in every parameter's gradient.
      assert np.isnan(got[0]) and np.isnan(want[0])
      for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_array_equal(np.isnan(g), np.isnan(w))
        assert np.isnan(g).any()
      continue
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_every_gradient_close(got[1], want[1], rtol=1e-5)
    assert got[1]["lm_head"]["kernel"].sharding.is_equivalent_to(
        NamedSharding(mesh, P(None, "data")), 2)
  moved = [size for kind, size in collective_sizes(step.lower(*args).compile())
           if kind in ("all-gather", "reduce-scatter")]
  assert moved and max(moved) < params["lm_head"]["kernel"].nbytes


@pytest.mark.parametrize("adapter", ["lora", "quantized", "odml_quantized"])
def test_fsdp_loss_computes_an_adapted_head_split_by_its_vocabulary_as_the_head_does(adapter):
  """qwix's LoRA or quantization-aware training (its own, or ODML's, which learns which
  operand is the weight in the layer's call) on an LM head split by its vocabulary: the
  loss reads the head's own logits (its kernel gathered), not each device's columns of the
  kernel alone, which would leave the adapter or the quantization out. Loss and gradient are
  one device's, the adapter's too."""
  qwix = pytest.importorskip("qwix")

  class TinyLM(nn.Module):
    @nn.compact
    def __call__(self, ids):
      return nn.Dense(64, name="lm_head")(jnp.tanh(nn.Embed(64, 8)(ids)))

  if adapter == "lora":
    net = qwix.apply_lora_to_model(TinyLM(), qwix.LoraProvider(module_path="lm_head", rank=2,
                                                                alpha=2.0))
  elif adapter == "quantized":
    net = qwix.quantize_model(TinyLM(), qwix.QtProvider(
        [qwix.QtRule(module_path="lm_head", weight_qtype="int4")]))
  else:
    net = qwix.quantize_model(TinyLM(), qwix.OdmlQatProvider(
        [qwix.QuantizationRule(module_path="lm_head", weight_qtype="int8")], strict=False))
  rng = np.random.default_rng(6)
  mask = (np.arange(6)[None] < rng.integers(2, 7, size=(8, 1))).astype(np.int32)
  ids = jnp.asarray(rng.integers(0, 64, size=(8, 6)) * mask, jnp.int32)
  params = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype),
                        net.init(jax.random.key(0), ids)["params"])

  def loss(params, batch):
    ids, mask = batch
    return masked_causal_lm_loss(net.apply({"params": params}, ids), ids, mask)

  mesh = _mesh(AxisType.Auto)
  specs = jax.tree.map(lambda a: P(), params)
  specs["lm_head"]["kernel"] = P(None, "data")
  step = jax.jit(jax.value_and_grad(fsdp_loss(
      loss, mesh, specs, weight_fn=lambda batch: causal_lm_target_count(batch[1]))))
  got = step(jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)),
                          params, specs),
             jax.device_put((ids, mask), NamedSharding(mesh, P("data"))))
  want = jax.value_and_grad(loss)(params, (ids, mask))
  np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
  assert_every_gradient_close(got[1], want[1], rtol=1e-5)


def test_fsdp_loss_refuses_a_token_mean_weighed_by_rows():
  """`masked_causal_lm_loss` in `fsdp_loss` without `weight_fn`: each device would weigh by
  its rows while averaging over its targets, which devices hold unequally here, a loss and
  gradient that are not the whole batch's. It raises, naming `weight_fn`; a `weight_fn` that
  counts rows on purpose gets the mean of the devices' means, and the targets' count one
  device's loss. A jitted loss traced first in an fsdp_loss with a weight_fn raises too in
  one without (not reused from jit's cache)."""
  net = nn.Sequential([nn.Embed(32, 4), nn.Dense(32)])
  rng = np.random.default_rng(11)
  lengths = np.array([6, 6, 2, 2, 6, 1, 3, 6])  # Each device's 2 rows: 10, 3, 6, 8 targets.
  mask = (np.arange(6)[None] < lengths[:, None]).astype(np.int32)
  ids = jnp.asarray(rng.integers(0, 32, size=(8, 6)) * mask, jnp.int32)
  params = net.init(jax.random.key(1), ids)["params"]
  loss = lambda params, batch: masked_causal_lm_loss(net.apply({"params": params}, batch[0]),
                                                     *batch)
  mesh = _mesh(AxisType.Auto)
  specs = jax.tree.map(lambda _: P(), params)
  batch = jax.device_put((ids, mask), NamedSharding(mesh, P("data")))
  with pytest.raises(ValueError, match="no weight_fn.*causal_lm_target_count"):
    jax.jit(fsdp_loss(loss, mesh, specs))(params, batch)
  by_rows = jax.jit(fsdp_loss(loss, mesh, specs, weight_fn=lambda batch: len(batch[0])))
  by_targets = jax.jit(fsdp_loss(loss, mesh, specs,
                                 weight_fn=lambda batch: causal_lm_target_count(batch[1])))
  device_means = [loss(params, (ids[i:i + 2], mask[i:i + 2])) for i in range(0, 8, 2)]
  np.testing.assert_allclose(by_rows(params, batch), np.mean(device_means), rtol=1e-6)
  np.testing.assert_allclose(by_targets(params, batch), loss(params, (ids, mask)), rtol=1e-6)
  assert abs(np.mean(device_means) - loss(params, (ids, mask))) > 1e-3
  jitted = jax.jit(loss)
  jax.jit(fsdp_loss(jitted, mesh, specs, weight_fn=lambda batch: len(batch[0])))(params, batch)
  with pytest.raises(ValueError, match="no weight_fn"):
    jax.jit(fsdp_loss(jitted, mesh, specs))(params, batch)


@pytest.mark.parametrize("weighed", [False, True], ids=["by_rows", "by_weight_fn"])
def test_fsdp_loss_keeps_a_float64_loss_in_float64(weighed):
  """Under x64 a float64 loss is the whole batch's to float64 rounding: each device's share
  (1/3 of the rows on 3 devices, or its count of a `weight_fn`'s) is taken in the loss's
  dtype, not rounded to float32 (about 1e-8 off)."""
  rng = np.random.default_rng(21)
  with jax.enable_x64(True):
    params = {"w": jnp.asarray(rng.normal(size=(5, 3)))}
    x = jnp.asarray(rng.normal(size=(6, 5)))
    rows = jnp.asarray([1, 1, 1, 0, 1, 1], jnp.int32)

    def loss(params, batch):
      x, rows = batch
      per_row = jnp.sum(jnp.tanh(x @ params["w"]) ** 2, axis=1)
      return jnp.sum(per_row * rows) / jnp.maximum(jnp.sum(rows), 1)

    mesh = jax.make_mesh((3,), ("data",), axis_types=(AxisType.Auto,), devices=CPUS[:3])
    weight_fn = (lambda batch: jnp.sum(batch[1])) if weighed else None
    batch = (x, rows if weighed else jnp.ones_like(rows))
    want = jax.value_and_grad(loss)(params, batch)
    got = jax.jit(jax.value_and_grad(fsdp_loss(loss, mesh, {"w": P()}, weight_fn=weight_fn)))(
        _put(params, mesh, P()), _put(batch, mesh, P("data")))
    assert got[0].dtype == jnp.float64
    np.testing.assert_allclose(got[0], want[0], rtol=1e-13)
    np.testing.assert_allclose(got[1]["w"], want[1]["w"], rtol=1e-12)


def test_fsdp_loss_takes_params_boxed_by_with_partitioning():
  """A Linen LM whose table and kernels are made with `nn.with_partitioning` (names that are
  no axis of the mesh among them): `fsdp_specs` splits the boxed params as it does unboxed
  ones (the head by its vocabulary), and `fsdp_loss` runs the model on the gathered values
  (a box's own unboxing constrains it to the mesh's axes, which the `shard_map` made
  manual), with the table looked up in place and the head computed on each device's
  columns: one device's loss and gradient, the unboxed step's collectives."""
  def boxed(init, names, box):
    return nn.with_partitioning(init, names) if box else init

  class TinyLM(nn.Module):
    box: bool

    @nn.compact
    def __call__(self, ids):
      table = nn.Embed(256, 8, embedding_init=boxed(nn.initializers.normal(1.0),
                                                    ("vocab", None), self.box))
      hidden = nn.Dense(8, kernel_init=boxed(nn.initializers.lecun_normal(), ("data", None),
                                              self.box))(table(ids))
      return nn.Dense(64, name="lm_head", kernel_init=boxed(
          nn.initializers.lecun_normal(), (None, "data"), self.box))(jnp.tanh(hidden))

  rng = np.random.default_rng(8)
  mask = (np.arange(6)[None] < rng.integers(1, 7, size=(8, 1))).astype(np.int32)
  ids = jnp.asarray(rng.integers(0, 64, size=(8, 6)) * mask, jnp.int32)  # The head's.
  mesh = _mesh(AxisType.Auto)
  batch = jax.device_put((ids, mask), NamedSharding(mesh, P("data")))
  results = {}
  for box in (True, False):
    net = TinyLM(box)
    params = net.init(jax.random.key(0), ids)["params"]
    loss = lambda params, batch, net=net: masked_causal_lm_loss(
        net.apply({"params": params}, batch[0]), *batch)
    specs = fsdp_specs(params, mesh)
    split = jax.tree.map(lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec)),
                         params, specs)
    step = jax.jit(jax.value_and_grad(fsdp_loss(
        loss, mesh, specs, weight_fn=lambda batch: causal_lm_target_count(batch[1]))))
    got = step(split, batch)
    want = jax.value_and_grad(loss)(params, (ids, mask))
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    assert_every_gradient_close(got[1], want[1], rtol=1e-5)
    assert isinstance(got[1]["lm_head"]["kernel"], nn.Partitioned) == box
    results[box] = (nn.meta.unbox(specs), collective_sizes(step.lower(split, batch).compile()))
  assert results[True] == results[False]
  assert results[True][0]["lm_head"]["kernel"] == P(None, "data")
  assert results[True][0]["Embed_0"]["embedding"] == P("data")


def test_fsdp_specs_split_matrices_by_rows_and_a_head_by_its_vocabulary_where_that_moves_less():
  """`fsdp_specs` on 4 devices: a matrix (or a 3-D kernel) the devices divide split by rows,
  vectors and a matrix they do not divide replicated; `lm_head`'s kernel [D, V] split by its
  columns where 4 × `head_rows` < V (or always, `head_rows=None`), by rows otherwise and with
  `heads=()`; an AdamW state's moments split as their params, its count replicated."""
  import optax
  mesh = _mesh(AxisType.Auto)
  shapes = {"embed": {"embedding": (64, 8)}, "layer": {"kernel": (8, 12), "bias": (12,),
                                                       "qkv": (8, 3, 4)},
            "odd": {"kernel": (6, 8)}, "norm": {"scale": (8,)},
            "lm_head": {"kernel": (8, 64), "bias": (64,)}}
  params = jax.tree.map(lambda shape: np.zeros(shape, np.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
  by_rows = {"embed": {"embedding": P("data")}, "layer": {"kernel": P("data"), "bias": P(),
                                                          "qkv": P("data")},
             "odd": {"kernel": P()}, "norm": {"scale": P()},
             "lm_head": {"kernel": P("data"), "bias": P()}}
  by_vocabulary = {**by_rows, "lm_head": {"kernel": P(None, "data"), "bias": P()}}
  assert fsdp_specs(params, mesh) == by_vocabulary
  assert fsdp_specs(params, mesh, head_rows=15) == by_vocabulary  # 60 rows < 64
  assert fsdp_specs(params, mesh, head_rows=16) == by_rows  # 64 rows: the kernel is no larger
  assert fsdp_specs(params, mesh, heads=()) == by_rows
  assert fsdp_specs(params, _mesh(AxisType.Auto, (2, 2), ("data", "model")),
                    axis="model")["lm_head"]["kernel"] == P(None, "model")
  adam = fsdp_specs(optax.adamw(1e-3).init(params), mesh)[0]
  assert adam.count == P() and adam.mu == adam.nu == by_vocabulary
  with pytest.raises(ValueError, match="axis='model' is not an axis of the mesh"):
    fsdp_specs(params, mesh, axis="model")
  for bad in (0, True, 0.5):
    with pytest.raises(ValueError, match="head_rows must be a positive Python int"):
      fsdp_specs(params, mesh, head_rows=bad)
  with pytest.raises(ValueError, match="heads must be a tuple of module names, got the string"):
    fsdp_specs(params, mesh, heads="lm_head")


def test_fsdp_step_compiles_with_the_readmes_reduce_scatter_threshold():
  """The compiler option the README gives for 2 GPUs compiles here too, and the step's value
  and gradient stay one device's (float64 numpy), two weight matrices split by rows."""
  rng = np.random.default_rng(7)
  x = rng.normal(size=(8, 16)).astype(np.float32)
  params = {"w1": rng.normal(size=(16, 12)).astype(np.float32) / 4,
            "w2": rng.normal(size=(12, 4)).astype(np.float32) / 4}
  loss = lambda params, x: jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"]) ** 2)

  def numpy_value_and_grad(params, x):
    x, w1, w2 = (np.asarray(a, np.float64) for a in (x, params["w1"], params["w2"]))
    hidden = np.tanh(x @ w1)
    out = hidden @ w2
    d_out = 2 * out / out.size
    d_hidden = d_out @ w2.T * (1 - hidden ** 2)
    return np.mean(out ** 2), {"w1": x.T @ d_hidden, "w2": hidden.T @ d_out}

  mesh = _mesh(AxisType.Auto)
  specs = {"w1": P("data"), "w2": P("data")}
  args = (jax.device_put(params, NamedSharding(mesh, P("data"))),
          jax.device_put(x, NamedSharding(mesh, P("data"))))
  step = jax.jit(jax.value_and_grad(fsdp_loss(loss, mesh, specs)),
                 compiler_options={"xla_gpu_reduce_scatter_combine_threshold_bytes": 256 << 20})
  value, grads = step(*args)
  want_value, want_grads = numpy_value_and_grad(params, x)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for name in want_grads:
    np.testing.assert_allclose(grads[name], want_grads[name], rtol=1e-4, atol=1e-7)


def test_fsdp_loss_errors_name_the_argument():
  mesh = _mesh(AxisType.Auto)
  loss = lambda params, batch: jnp.sum(batch @ params)
  with pytest.raises(ValueError, match=r"param_specs: expected P\('data'\).*got "
                                       r"(P|PartitionSpec)\(None, None, 'data'\)"):
    fsdp_loss(loss, mesh, P(None, None, "data"))
  with pytest.raises(ValueError, match=r"param_specs: expected P\('data'\).*got "
                                       r"(P|PartitionSpec)\('data', 'data'\)"):
    fsdp_loss(loss, mesh, {"kernel": P("data", "data")})
  with pytest.raises(ValueError, match="axis='model' is not an axis of the mesh"):
    fsdp_loss(loss, mesh, P("data"), axis="model")
  with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh, got str"):
    fsdp_loss(loss, "data", P("data"))
  with pytest.raises(ValueError, match="mesh must be a jax.sharding.Mesh, got None"):
    fsdp_specs({"kernel": jnp.zeros((4, 4))}, None)
  with pytest.raises(ValueError, match="lookups_in_place must be 'auto', True or False"):
    fsdp_loss(loss, mesh, P("data"), lookups_in_place="always")
  with pytest.raises(ValueError, match=r"shard must be 2-D \[rows, features\], got shape \(4,\)"):
    split_table_lookup(jnp.zeros(4), jnp.zeros(3, jnp.int32), "data", 16)
  with pytest.raises(ValueError, match="ids must be integer token ids, got dtype float32"):
    split_table_lookup(jnp.zeros((4, 2)), jnp.zeros(3), "data", 16)
  # More rows than the devices hold: an id past them would read zeros, not take's row or NaN.
  lookup = jax.shard_map(lambda table, ids: split_table_lookup(table, ids, "data", 20),
                         mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
  with pytest.raises(ValueError, match=r"num_embeddings \(20\) must be at most the rows of "
                                       r"the table split over 'data': 4 a device, 16 in all"):
    lookup(jnp.zeros((16, 2)), jnp.zeros((4, 3), jnp.int32))
  # Inside a shard_map over the batch axis each device's rows are its own already.
  inside = jax.shard_map(lambda x: sebp_linear(x, jnp.ones((2, 2)), top_n=1, batch_axes="data"),
                         mesh=mesh, in_specs=P("data"), out_specs=P("data"))
  with pytest.raises(ValueError, match=r"batch_axes=\('data',\) names \('data',\), which this "
                                       r"code runs inside \(a jax.shard_map, or fsdp_loss\)"):
    inside(jnp.ones((8, 2)))


def test_auto_mesh_without_batch_axes_warns(caplog):
  model, params, inputs = _linen_case(AxisType.Auto)
  mesh = _mesh(AxisType.Auto)
  with jax.set_mesh(mesh), caplog.at_level(logging.WARNING, logger="sebp_jax"):
    jax.eval_shape(_step(model, lambda m: dict(active_mask=m)), params, inputs, _mask())
  assert "no batch_axes" in caplog.text


GPUS = [device for device in jax.devices() if device.platform == "gpu"]


@pytest.mark.skipif(len(GPUS) < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("backend", ["xla", "pallas"])
@pytest.mark.parametrize("case", ["shared_traced", "per_layer"])
def test_data_parallel_on_gpus(case, backend):
  """The Linen tagger data parallel on 2 GPUs (each with half the batch): one device's
  gradient, and the dense step's collectives."""
  model, params, inputs = _linen_case(AxisType.Auto)
  mask = _mask()
  want = _step(model, lambda m: None)(params, inputs, mask)
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=GPUS[:2])
  args = (_put(params, mesh, P()), *_put((inputs, mask), mesh, P("data")))

  def options_of(traced_mask):
    options = (dict(active_mask=traced_mask, overflow="nan",
                    top_n=token_capacity(mask, multiple=8, num_shards=2))
               if case == "shared_traced" else dict(top_n=16))
    return dict(options, batch_axes="data", mesh=mesh, backend=backend)

  def loss(params, inputs, mask, sebp):
    if not sebp:
      return _masked_loss(model.apply(params, inputs), mask)
    with use_sebp(**options_of(mask)):
      return _masked_loss(model.apply(params, inputs), mask)

  sebp = jax.jit(jax.grad(loss), static_argnums=3)
  assert_every_gradient_close(sebp(*args, True), want, rtol=2e-5)
  assert (collective_counts(sebp.lower(*args, True).compile())
          == collective_counts(sebp.lower(*args, False).compile()))


@pytest.mark.skipif(not GPUS, reason="needs a GPU")
@pytest.mark.parametrize("backend", ["pallas", "pallas_triton"])
@pytest.mark.parametrize("x_spec,kernel_spec,bias_spec", [
    (P("data"), P(None, "model"), P("model")),  # Rows split: "model" Explicit in the shard_map.
    (P(), P(None, "model"), P()),  # Rows not split: the whole backward with the axes Auto.
], ids=str)
def test_compiled_kernels_on_an_explicit_mesh_of_one_gpu(x_spec, kernel_spec, bias_spec,
                                                          backend):
  """The compiled kernels (a pallas_call refuses operands typed as split) on a data x model
  Explicit mesh of one GPU, counted (top_n="auto"): the dense gradient, typed as the inputs."""
  keys = jax.random.split(jax.random.key(3), 3)
  x = jax.random.normal(keys[0], (BATCH, LENGTH, 64), jnp.bfloat16)
  kernel = jax.random.normal(keys[1], (64, 128), jnp.bfloat16) * 0.1
  bias = jax.random.normal(keys[2], (128,), jnp.bfloat16)
  mask = _mask(9)

  def loss(x, kernel, bias, sebp):
    y = (sebp_linear(x, kernel, bias, backend=backend) if sebp
         else jnp.einsum("bld,dn->bln", x, kernel) + bias)
    return _masked_loss(y.astype(jnp.float32), mask)

  mesh = jax.make_mesh((1, 1), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                       devices=GPUS[:1])
  with jax.set_mesh(mesh):
    args = tuple(_put(a, mesh, spec) for a, spec in
                 zip((x, kernel, bias), (x_spec, kernel_spec, bias_spec)))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)
    got, want = grad(*args, True), grad(*args, False)
  for g, w, arg in zip(got, want, args):
    g, w_values = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w_values, rtol=2e-2, atol=2e-2 * np.max(np.abs(w_values)))
  for g, arg in zip(got, args):
    assert jax.typeof(g).sharding.spec == jax.typeof(arg).sharding.spec
