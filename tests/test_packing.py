"""Token packing (`sebp_jax.packing`) against float64 numpy references built from the padded
batch: layouts, gather/scatter and their gradient, attention masks, per-sequence attention,
and the capacity checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from sebp_jax.packing import (attention_mask, attention_method, balanced_shard_order,
                              capacity_buckets,
                              fused_attention_implementation, gather_tokens,
                              pack_decoder_inputs, pack_layout,
                              packed_attention, scatter_tokens, token_budget_batches,
                              token_capacity)


def _random_mask(rng, batch, length, kind):
  """A random ``[B, L]`` int mask: right or left padding, holes, with an empty row, full."""
  cols = np.arange(length)[None]
  lengths = rng.integers(1, length + 1, size=(batch, 1))
  if kind == "right":
    mask = cols < lengths
  elif kind == "left":
    mask = cols >= length - lengths
  elif kind == "holes":
    mask = rng.random((batch, length)) < 0.5
  elif kind == "empty_row":
    mask = cols < lengths
    mask[rng.integers(batch)] = False
  elif kind == "full":
    mask = np.ones((batch, length), bool)
  else:
    raise ValueError(kind)
  return mask.astype(np.int32)


def _reference_layout(mask, capacity):
  """``(token_rows, segment_ids, columns, num_tokens)`` of the packed layout, in numpy."""
  batch, length = mask.shape
  real = np.flatnonzero(mask.reshape(-1))
  n = len(real)
  filler = np.arange(n, capacity)
  token_rows = np.concatenate([real, batch * length + filler])
  segment_ids = np.concatenate([real // length, np.full(len(filler), batch)])
  columns = np.concatenate([real % length, filler])
  return token_rows, segment_ids, columns, n


@functools.partial(jax.jit, static_argnums=1)
def _layout_fields(mask, capacities):
  """``(token_rows, segment_ids, columns, num_tokens, overflow)`` for each capacity."""
  return [(layout.token_rows, layout.segment_ids, layout.columns, layout.num_tokens,
           layout.overflow)
          for layout in (pack_layout(mask, capacity) for capacity in capacities)]


MASK_CASES = [(seed, shape, kind)
              for seed, (shape, kind) in enumerate([
                  ((3, 7), "right"), ((4, 5), "left"), ((2, 9), "holes"), ((5, 4), "holes"),
                  ((3, 6), "empty_row"), ((2, 5), "full"), ((1, 8), "holes"), ((6, 3), "left")])]


@pytest.mark.parametrize("seed,shape,kind", MASK_CASES)
def test_pack_layout_matches_numpy(seed, shape, kind):
  """Real tokens in row-major order, then distinct out-of-range filler rows of segment B."""
  rng = np.random.default_rng(seed)
  mask = _random_mask(rng, *shape, kind)
  n = int(mask.sum())
  capacities = (max(n, 1), n + int(rng.integers(1, 6)))
  for capacity, got in zip(capacities, _layout_fields(mask, capacities)):
    want = _reference_layout(mask, capacity)
    for a, b in zip(got, want):
      np.testing.assert_array_equal(a, b)
    assert not got[4] and got[0].dtype == jnp.int32


def test_pack_layout_reads_float_and_bool_masks_and_is_the_same_under_jit():
  """Float and bool masks, eager (a concrete mask) and under jit. Values other than 0 and 1
  (which models read differently: BERT attends where the mask is above 0) raise eagerly and
  make the layout invalid under jit."""
  rng = np.random.default_rng(11)
  flags = rng.random((4, 6)) < 0.5
  capacity = int(np.count_nonzero(flags)) + 2
  want = _reference_layout(flags, capacity)
  for mask in (flags.astype(np.float32), flags):
    eager = pack_layout(mask, capacity)
    assert eager.batch_shape == (4, 6) and eager.capacity == capacity
    assert not eager.invalid
    eager = (eager.token_rows, eager.segment_ids, eager.columns, eager.num_tokens)
    for got in (eager, _layout_fields(mask, (capacity,))[0]):
      for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
  for weighted in (flags * rng.uniform(0.1, 3.0, (4, 6)), np.where(flags, 1, -1)):
    with pytest.raises(ValueError, match=r"must hold 1 \(or True\) for real tokens"):
      pack_layout(weighted, capacity)
    assert jax.jit(lambda m: pack_layout(m, capacity).invalid)(weighted)


def test_pack_layout_refuses_a_non_2d_mask():
  with pytest.raises(ValueError, match=r"\[batch, length\]"):
    pack_layout(jnp.ones((2, 3, 4)), 30)


@pytest.mark.parametrize("seed,shape,kind", MASK_CASES[:3])
def test_gather_scatter_round_trip(seed, shape, kind):
  """Gather puts the real rows in order (filler zero); scatter back restores them and
  writes zeros at padding, for float and int arrays (the first case eager, all under jit)."""
  rng = np.random.default_rng(100 + seed)
  mask = _random_mask(rng, *shape, kind)
  n = int(mask.sum())
  capacity = n + 3
  x = rng.standard_normal((*shape, 5)).astype(np.float32) + 10.0
  ids = rng.integers(1, 50, size=shape).astype(np.int32)
  real = np.flatnonzero(mask.reshape(-1))

  def round_trip(mask, x, ids):
    layout = pack_layout(mask, capacity)
    packed, packed_ids = gather_tokens(x, layout), gather_tokens(ids, layout)
    return packed, packed_ids, scatter_tokens(packed, layout), scatter_tokens(packed_ids, layout)

  for run in [jax.jit(round_trip)] + ([round_trip] if seed == 0 else []):
    packed, packed_ids, back, back_ids = run(mask, x, ids)
    assert packed.shape == (1, capacity, 5) and packed_ids.shape == (1, capacity)
    np.testing.assert_array_equal(packed[0, :n], x.reshape(-1, 5)[real])
    assert not np.any(packed[0, n:]) and not np.any(packed_ids[0, n:])
    np.testing.assert_array_equal(back, x * mask[..., None])
    np.testing.assert_array_equal(packed_ids[0, :n], ids.reshape(-1)[real])
    np.testing.assert_array_equal(back_ids, ids * mask)
    assert back_ids.dtype == jnp.int32


def test_gather_tokens_checks_the_leading_shape():
  layout = pack_layout(np.ones((2, 3), np.int32), 6)
  with pytest.raises(ValueError, match="leading shape"):
    gather_tokens(jnp.ones((3, 2, 4)), layout)


@pytest.mark.parametrize("seed,shape,kind", MASK_CASES[1:3])
def test_gradient_through_gather_and_scatter(seed, shape, kind):
  """d/dx sum(w_out * scatter(sin(gather(x)) * w_packed)) equals its numpy form: each real
  token's own slot weight, zero at padding. A w_out that is not zero at padding reads
  outputs that packing did not compute: every gradient NaN."""
  rng = np.random.default_rng(200 + seed)
  mask = _random_mask(rng, *shape, kind)
  n = int(mask.sum())
  capacity = n + 4
  layout = pack_layout(mask, capacity)
  x = rng.standard_normal((*shape, 3))
  reads_padding = rng.standard_normal((*shape, 3))
  w_out = reads_padding * mask[..., None]
  w_packed = rng.standard_normal((1, capacity, 3))

  def loss(x, w_out):
    return jnp.sum(w_out * scatter_tokens(jnp.sin(gather_tokens(x, layout)) * w_packed, layout))

  grad = jax.jit(jax.grad(loss))
  got = grad(jnp.asarray(x, jnp.float32), w_out)
  want = np.zeros((shape[0] * shape[1], 3))
  real = np.flatnonzero(mask.reshape(-1))
  flat_x, flat_w = x.reshape(-1, 3), w_out.reshape(-1, 3)
  want[real] = flat_w[real] * np.cos(flat_x[real]) * w_packed[0, :n]
  np.testing.assert_allclose(got, want.reshape(*shape, 3), rtol=1e-5, atol=1e-6)
  assert not np.any(np.asarray(got)[mask == 0])
  if not mask.all():  # NaN at every token it reaches.
    assert np.isnan(grad(jnp.asarray(x, jnp.float32), reads_padding)[mask == 1]).all()
  # The check is a custom_vjp, which forward mode refuses; without it jvp goes through.
  packed = jnp.asarray(w_packed, jnp.float32)
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(lambda p: scatter_tokens(p, layout), (packed,), (packed,))
  value, tangent = jax.jvp(lambda p: scatter_tokens(p, layout, check_padding=False),
                           (packed,), (packed,))
  np.testing.assert_array_equal(tangent, value)
  with pytest.raises(TypeError, match="forward-mode"):
    jax.jvp(lambda x: gather_tokens(x, layout), (jnp.asarray(x),), (jnp.asarray(x),))
  value, tangent = jax.jvp(lambda x: gather_tokens(x, layout, check_padding=False),
                           (jnp.asarray(x),), (jnp.asarray(x),))
  np.testing.assert_array_equal(tangent, value)


def _reference_allowed(mask, causal, window):
  """bool[B, L, L]: query (b, l) may attend to key (b, l') in the padded batch."""
  length = mask.shape[1]
  q, k = np.arange(length)[:, None], np.arange(length)[None, :]
  allowed = np.broadcast_to(mask[:, None, :] != 0, (mask.shape[0], length, length)).copy()
  if causal:
    allowed &= k <= q
  if window is not None:
    allowed &= k >= q - window
  return allowed


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 2), (False, 1)])
@pytest.mark.parametrize("seed,shape,kind", MASK_CASES[2:4])
def test_attention_mask_matches_the_padded_batch(seed, shape, kind, causal, window):
  """Between real tokens, the packed mask is the padded batch's (same row, real key, causal,
  window); real and filler never see each other; every filler row sees itself."""
  rng = np.random.default_rng(300 + seed)
  mask = _random_mask(rng, *shape, kind)
  n = int(mask.sum())
  capacity = n + 3
  layout = pack_layout(mask, capacity)
  got = np.asarray(attention_mask(layout, causal=causal, window=window))
  assert got.shape == (1, 1, capacity, capacity) and got.dtype == bool
  got = got[0, 0]
  batch, length = shape
  real = np.flatnonzero(mask.reshape(-1))
  dense = _reference_allowed(mask, causal, window)
  want = np.zeros((n, n), bool)
  for i, qi in enumerate(real):
    for j, kj in enumerate(real):
      bq, lq = divmod(qi, length)
      bk, lk = divmod(kj, length)
      want[i, j] = bq == bk and dense[bq, lq, lk]
  np.testing.assert_array_equal(got[:n, :n], want)
  assert not got[:n, n:].any() and not got[n:, :n].any()
  assert np.all(np.diag(got)[n:])


def _reference_attention(q, k, v, mask, causal, window, alibi_slopes=None):
  """float64 attention of each padded sequence over its own real keys: [B, L, H, d]. With
  ``alibi_slopes``, each logit gains its head's slope times the distance in real tokens from
  the query back to the key, negated (ALiBi)."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  batch, length, heads, dim = q.shape
  groups = heads // k.shape[2]
  allowed = _reference_allowed(mask, causal, window)
  ranks = np.cumsum(mask, axis=1)
  out = np.zeros_like(q)
  for b in range(batch):
    for h in range(heads):
      logits = q[b, :, h] @ k[b, :, h // groups].T / np.sqrt(dim)
      if alibi_slopes is not None:
        logits -= alibi_slopes[h] * (ranks[b][:, None] - ranks[b][None, :])
      logits = np.where(allowed[b], logits, -np.inf)
      with np.errstate(invalid="ignore"):
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
      out[b, :, h] = np.nan_to_num(weights) @ v[b, :, h // groups]
  return out


def _packed_qkv(rng, mask, capacity, heads=4, kv_heads=2, dim=8):
  """Random q/k/v of the padded batch and their packed form, filler slots holding garbage."""
  batch, length = mask.shape
  q = rng.standard_normal((batch, length, heads, dim))
  k = rng.standard_normal((batch, length, kv_heads, dim))
  v = rng.standard_normal((batch, length, kv_heads, dim))
  real = np.flatnonzero(mask.reshape(-1))
  n = len(real)

  def pack(a):
    packed = rng.standard_normal((capacity, *a.shape[2:])) * 50
    packed[:n] = a.reshape(batch * length, *a.shape[2:])[real]
    return jnp.asarray(packed[None], jnp.float32)

  return (q, k, v), tuple(pack(a) for a in (q, k, v)), real


@pytest.mark.parametrize("method", ["mask", "rows"])
@pytest.mark.parametrize("seed,kind,causal,window", [
    (0, "right", False, None), (1, "left", True, None), (2, "holes", True, 2),
    (3, "right", True, 2), (4, "holes", False, None), (5, "left", True, 3),
    (6, "holes", True, None)])
def test_packed_attention_matches_per_sequence_attention(seed, kind, causal, window, method):
  """Grouped-query attention (4 query heads, 2 kv heads) of the packed tokens equals a float64
  per-sequence attention of the padded batch at every real token, over the packed sequence
  and in rows; filler stays finite and does not leak into real tokens. A window in rows
  needs rows without holes."""
  rng = np.random.default_rng(400 + seed)
  mask = _random_mask(rng, 3, 7, kind)
  n = int(mask.sum())
  capacity = n + 5
  layout = pack_layout(mask, capacity)
  (q, k, v), packed, real = _packed_qkv(rng, mask, capacity)
  attend = jax.jit(lambda *qkv: packed_attention(*qkv, layout, causal=causal, window=window,
                                                 implementation="xla", method=method))
  if method == "rows" and kind == "holes" and window is not None:
    with pytest.raises(ValueError, match="needs rows without holes"):
      attend(*packed)
    return
  got = attend(*packed)
  assert got.shape == (1, capacity, 4, 8)
  want = _reference_attention(q, k, v, mask, causal, window).reshape(-1, 4, 8)[real]
  np.testing.assert_allclose(got[0, :n], want, rtol=1e-5, atol=1e-5)
  assert np.all(np.isfinite(got))


@pytest.mark.parametrize("method", ["mask", "rows"])
@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_alibi_counts_each_sequences_real_tokens(kind, method):
  """ALiBi (Bloom's bias: minus a head's slope times the distance in real tokens, holes
  not counted) over the packed sequence and in rows, against float64 per sequence; slopes of
  the wrong number of heads are refused."""
  rng = np.random.default_rng(420)
  mask = _random_mask(rng, 3, 9, kind)
  n = int(mask.sum())
  capacity = n + 3
  layout = pack_layout(mask, capacity)
  (q, k, v), packed, real = _packed_qkv(rng, mask, capacity)
  slopes = (0.5, 0.25, 0.125, 1.5)
  attend = jax.jit(lambda *qkv: packed_attention(*qkv, layout, causal=True,
                                                 alibi_slopes=slopes, implementation="xla",
                                                 method=method))
  want = _reference_attention(q, k, v, mask, True, None, slopes).reshape(-1, 4, 8)[real]
  np.testing.assert_allclose(attend(*packed)[0, :n], want, rtol=1e-5, atol=1e-5)
  without = _reference_attention(q, k, v, mask, True, None).reshape(-1, 4, 8)[real]
  assert np.max(np.abs(without - want)) > 1e-2
  with pytest.raises(ValueError, match=r"alibi_slopes must hold one slope per query head \(4\)"):
    packed_attention(*packed, layout, causal=True, alibi_slopes=slopes[:2], method=method)


@pytest.mark.parametrize("window", [3, 9])
def test_a_window_under_the_columns_of_a_row_with_holes_is_not_taken_as_covering_it(window):
  """Rows of at most 4 real tokens spread over up to 5 columns by their holes: a window of 3
  columns does not cover them (row attention refuses it, the mask applies it), one of the
  padded length (9 of 10 columns) does, in rows too."""
  mask = np.array([[1, 0, 0, 0, 1, 0, 0, 1, 1, 0],
                   [1, 1, 1, 0, 0, 0, 0, 0, 0, 0]], np.int32)
  rng = np.random.default_rng(410 + window)
  capacity = int(mask.sum()) + 2
  layout = pack_layout(mask, capacity)
  (q, k, v), packed, real = _packed_qkv(rng, mask, capacity)
  want = _reference_attention(q, k, v, mask, True, window).reshape(-1, 4, 8)[real]
  for method in ("mask", "rows"):
    attend = jax.jit(lambda *qkv: packed_attention(*qkv, layout, causal=True, window=window,
                                                   implementation="xla", method=method))
    if method == "rows" and window == 3:
      with pytest.raises(ValueError, match="needs rows without holes"):
        attend(*packed)
      continue
    np.testing.assert_allclose(attend(*packed)[0, :len(real)], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["right", "left", "holes"])
def test_row_attention_gradients_equal_the_masks(kind):
  """The gradients of q, k and v at real tokens, in rows and over the packed sequence, traced
  mask; filler gets none in rows."""
  rng = np.random.default_rng(450)
  mask = _random_mask(rng, 4, 9, kind)
  n = int(mask.sum())
  capacity = n + 3
  _, packed, _ = _packed_qkv(rng, mask, capacity)
  cotangent = jnp.asarray(rng.standard_normal((1, capacity, 4, 8)), jnp.float32)

  def grads(method):
    def attend(mask, *qkv):
      layout = pack_layout(mask, capacity)
      return packed_attention(*qkv, layout, causal=True, implementation="xla", method=method)
    out, vjp = jax.vjp(functools.partial(jax.jit(attend), jnp.asarray(mask)), *packed)
    return out, vjp(cotangent.at[0, n:].set(0))

  (rows_out, rows_grads), (mask_out, mask_grads) = grads("rows"), grads("mask")
  np.testing.assert_allclose(rows_out[0, :n], mask_out[0, :n], rtol=1e-5, atol=1e-6)
  assert not np.any(rows_out[0, n:])
  for got, want in zip(rows_grads, mask_grads):
    np.testing.assert_allclose(got[0, :n], want[0, :n], rtol=1e-5, atol=1e-6)
    assert not np.any(got[0, n:])


def test_the_layout_knows_each_rows_tokens():
  mask = np.array([[1, 1, 0, 0, 0], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0], [1, 0, 1, 0, 1]])
  layout = pack_layout(mask, 9)
  np.testing.assert_array_equal(layout.row_lengths, [2, 3, 0, 3])
  np.testing.assert_array_equal(layout.ranks, [0, 1, 0, 1, 2, 0, 1, 2, 8])
  assert layout.row_width == 4 and not layout.contiguous  # the longest row, made even
  assert pack_layout(mask[:3], 9).contiguous
  traced = jax.jit(lambda m: pack_layout(m, 9))(mask)
  assert traced.row_width == 6 and not traced.contiguous  # min(L, C), made even
  np.testing.assert_array_equal(traced.ranks, layout.ranks)


def test_attention_method_auto():
  """Rows where cuDNN runs them and their slots cost less than the mask's pairs, else the
  mask (XLA's exact path on CPUs)."""
  on_nvidia = jax.default_backend() == "gpu" and "NVIDIA" in jax.devices()[0].device_kind
  mask = np.zeros((3, 512), np.int32)
  mask[:, :300] = 1
  layout = pack_layout(mask, 1024)  # 3 rows of 300 (W = 300): 64 * 900 slots < 1024**2 pairs
  bf16 = jnp.zeros((1, 1024, 4, 64), jnp.bfloat16)
  assert attention_method(bf16, layout, window=None, dropout=False) == (
      "rows" if on_nvidia else "mask")
  many_short = jax.jit(lambda m: pack_layout(m, 384))(np.arange(512) < np.full((32, 1), 10))
  assert attention_method(bf16[:, :384], many_short, window=None, dropout=False) == "mask"
  assert attention_method(bf16, layout, window=None, dropout=True) == "mask"
  assert attention_method(bf16.astype(jnp.float32), layout, window=None, dropout=False) == "mask"
  with pytest.raises(ValueError, match="method must be one of"):
    packed_attention(bf16, bf16, bf16, layout, causal=True, method="flash")


def test_packed_attention_dropout():
  """Dropout acts only with an rng and a positive rate; the materialised path it takes
  computes the same attention (a negligible rate), and filler never reaches real tokens."""
  rng = np.random.default_rng(500)
  mask = _random_mask(rng, 3, 8, "holes")
  n = int(mask.sum())
  capacity = n + 4
  layout = pack_layout(mask, capacity)
  (q, k, v), packed, real = _packed_qkv(rng, mask, capacity)
  want = _reference_attention(q, k, v, mask, True, 3).reshape(-1, 4, 8)[real]
  attend = jax.jit(lambda *qkv, **kw: packed_attention(*qkv, layout, causal=True, window=3,
                                                       implementation="xla", **kw),
                   static_argnames=("dropout_rate", "broadcast_dropout"))
  key = jax.random.key(0)
  no_rng = attend(*packed, dropout_rng=None, dropout_rate=0.5)
  np.testing.assert_allclose(no_rng[0, :n], want, rtol=1e-5, atol=1e-5)
  tiny = attend(*packed, dropout_rng=key, dropout_rate=1e-7)
  np.testing.assert_allclose(tiny[0, :n], want, rtol=1e-5, atol=1e-5)
  dropped = attend(*packed, dropout_rng=key, dropout_rate=0.5)
  assert np.all(np.isfinite(dropped))
  assert np.max(np.abs(np.asarray(dropped[0, :n]) - want)) > 1e-2
  assert not np.allclose(dropped, attend(*packed, dropout_rng=jax.random.key(1),
                                         dropout_rate=0.5))
  other_filler = tuple(a.at[0, n:].set(-a[0, n:] * 3) for a in packed)
  np.testing.assert_array_equal(attend(*other_filler, dropout_rng=key, dropout_rate=0.5)[0, :n],
                                dropped[0, :n])
  # Every head alike in, alike out with one mask for every head; apart with one per head.
  alike = tuple(jnp.broadcast_to(a[:, :, :1], a.shape) for a in packed)
  one_mask = attend(*alike, dropout_rng=key, dropout_rate=0.5)
  np.testing.assert_array_equal(one_mask[0, :, 1:], jnp.broadcast_to(one_mask[0, :, :1],
                                                                      one_mask[0, :, 1:].shape))
  per_head = attend(*alike, dropout_rng=key, dropout_rate=0.5, broadcast_dropout=False)
  assert not np.allclose(per_head[0, :n, 1], per_head[0, :n, 0])


def test_fused_attention_implementation_on_this_backend():
  """cuDNN only for 16-bit inputs of a supported head size on an NVIDIA GPU."""
  on_nvidia = jax.default_backend() == "gpu" and "NVIDIA" in jax.devices()[0].device_kind
  assert fused_attention_implementation(jnp.zeros((1, 4, 2, 8), jnp.float32)) == "xla"
  assert fused_attention_implementation(jnp.zeros((1, 4, 2, 12), jnp.bfloat16)) == "xla"
  assert fused_attention_implementation(jnp.zeros((1, 4, 2, 256), jnp.bfloat16)) == "xla"
  assert fused_attention_implementation(jnp.zeros((1, 4, 2, 64), jnp.bfloat16)) == (
      "cudnn" if on_nvidia else "xla")


def test_a_concrete_mask_over_capacity_raises_with_the_counts():
  mask = _random_mask(np.random.default_rng(600), 4, 6, "holes")
  n = int(mask.sum())
  with pytest.raises(ValueError, match=rf"packing capacity {n - 1} .* {n} real tokens"):
    pack_layout(mask, n - 1)
  assert int(pack_layout(mask, n).num_tokens) == n
  ids = np.where(mask != 0, 5, 0)
  with pytest.raises(ValueError, match=rf"packing capacity {n - 1} .* of at least {n}"):
    pack_decoder_inputs(ids, mask, n - 1)
  for capacity in (0, True, 5.0):  # Checked under jit too, where the mask is traced.
    with pytest.raises(ValueError, match="capacity must be a positive Python int"):
      jax.jit(lambda i, m: pack_decoder_inputs(i, m, capacity).input_ids)(ids, mask)


def test_a_traced_mask_over_capacity_is_loud_under_jit():
  """Under jit the count is only known at run time: every output value turns to NaN, the
  real tokens that did not fit included, rather than tokens being dropped silently; the same
  compiled function runs a batch that fits."""
  rng = np.random.default_rng(700)
  capacity = 10
  fits = np.zeros((3, 6), np.int32)
  fits[0, :4] = fits[1, :6] = 1
  over = np.ones((3, 6), np.int32)
  over[2, 3:] = 0
  x = jnp.asarray(rng.standard_normal((3, 6, 2)), jnp.float32)

  @jax.jit
  def round_trip(mask, x):
    layout = pack_layout(mask, capacity)
    return scatter_tokens(gather_tokens(x, layout), layout), layout.overflow

  out, overflow = round_trip(fits, x)
  np.testing.assert_array_equal(out, x * fits[..., None])
  assert not overflow
  out, overflow = round_trip(over, x)
  assert overflow and np.all(np.isnan(np.asarray(out)))


@pytest.mark.parametrize("multiple", [1, 4, 128])
def test_token_capacity(multiple):
  """The real tokens rounded up to a multiple, at least one, at most the mask's size."""
  rng = np.random.default_rng(800 + multiple)
  for kind in ("right", "holes", "full"):
    mask = _random_mask(rng, 5, 9, kind)
    n = max(1, int(mask.sum()))
    want = min(mask.size, int(np.ceil(n / multiple)) * multiple)
    assert token_capacity(mask, multiple) == want
    assert token_capacity(mask, multiple) >= mask.sum()
  assert token_capacity(np.zeros((2, 3)), 4) == 4


def test_capacity_buckets_bound_the_compiles_and_the_padding():
  """A geometric ladder: at most ``count`` capacities, each batch in the smallest that holds
  it, at most twice its real tokens above the smallest bucket, whatever the largest."""
  buckets = capacity_buckets(1100, count=4)
  assert buckets == (256, 384, 640, 1152)
  assert capacity_buckets(257) == (128, 256, 384)
  rng = np.random.default_rng(850)
  for largest in (1100, 257, 513, 1031, *rng.integers(1, 5000, size=30)):
    buckets = capacity_buckets(int(largest), count=4)
    assert len(buckets) <= 4 and buckets[-1] >= largest and list(buckets) == sorted(buckets)
    for n in range(1, buckets[-1] + 1, 7):
      mask = np.arange(buckets[-1]) < n
      capacity = token_capacity(mask[None], buckets=buckets)
      assert capacity in buckets and capacity >= n
      assert capacity == buckets[0] or capacity <= 2 * n
  buckets = capacity_buckets(1100, count=4)
  with pytest.raises(ValueError, match="hold at most 1152 tokens, and the mask has 1200"):
    token_capacity(np.ones((6, 200)), buckets=buckets)
  assert capacity_buckets(100, count=3, multiple=8) == (32, 56, 104)
  with pytest.raises(ValueError, match="positive"):
    capacity_buckets(0)
  # No more slots than the batch has tokens (a 2x32 batch under a bucket of 128), per shard.
  mask = np.ones((2, 32))
  assert token_capacity(mask, buckets=(128,)) == 64
  assert token_capacity(mask, buckets=(128,), num_shards=2) == 32


def test_token_budget_batches_fill_a_fixed_capacity_in_order():
  """Every example once, in order; no batch over the budget or the rows; each batch closed only
  when the next example would not fit (so one capacity serves the run)."""
  rng = np.random.default_rng(870)
  lengths = rng.integers(1, 300, size=500)
  groups = token_budget_batches(lengths, token_budget=1024, max_rows=8)
  assert [i for group in groups for i in group] == list(range(500))
  for group, following in zip(groups, groups[1:] + [None]):
    tokens = int(lengths[group].sum())
    assert tokens <= 1024 and len(group) <= 8
    if following is not None:
      assert len(group) == 8 or tokens + lengths[following[0]] > 1024
  assert np.mean([lengths[g].sum() for g in groups[:-1]]) > 0.75 * 1024
  with pytest.raises(ValueError, match="example 1 has 2000 tokens, more than token_budget"):
    token_budget_batches([5, 2000], token_budget=1024, max_rows=8)
  with pytest.raises(ValueError, match="token_budget must be a positive"):
    token_budget_batches([5], token_budget=0, max_rows=8)
  for lengths in ([-3, 5, 5], [2.9, 3]):
    with pytest.raises(ValueError, match="lengths must be token counts"):
      token_budget_batches(lengths, token_budget=7, max_rows=8)


def test_capacity_arguments_are_checked():
  """A multiple, shard count, bucket or window that cannot be one raises, naming it."""
  mask = np.ones((2, 5))
  for name, value in (("multiple", -3), ("multiple", 2.5), ("multiple", 0), ("num_shards", 0)):
    with pytest.raises(ValueError, match=f"{name} must be a positive"):
      token_capacity(mask, **{name: value})
  with pytest.raises(ValueError, match="largest must be a positive"):
    capacity_buckets(2.5)
  # A float bucket would come back as the capacity, which use_sebp reads as a kept fraction.
  for buckets in ((1.0, 64), (0, 64), ("64",)):
    with pytest.raises(ValueError, match="each of buckets must be a positive"):
      token_capacity(mask, buckets=buckets)
  for buckets in ((), 64, "64"):
    with pytest.raises(ValueError, match="buckets must be a non-empty tuple"):
      token_capacity(mask, buckets=buckets)
  for window in (-1, 1.5, True):
    with pytest.raises(ValueError, match="window must be None or a non-negative int"):
      pack_decoder_inputs(np.ones((2, 5), np.int32), mask, 16, window=window)


def test_fused_attention_needs_an_even_length():
  """cuDNN's backward with a mask needs an even sequence length: an odd capacity runs XLA."""
  odd = jnp.zeros((1, 21, 4, 64), jnp.bfloat16)
  assert fused_attention_implementation(odd) == "xla"
  even = jnp.zeros((1, 22, 4, 64), jnp.bfloat16)
  on_nvidia = jax.default_backend() == "gpu" and "NVIDIA" in jax.devices()[0].device_kind
  assert fused_attention_implementation(even) == ("cudnn" if on_nvidia else "xla")


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention runs on GPUs")
@pytest.mark.parametrize("method, alibi_slopes", [
    ("mask", None), ("mask", (0.5, 0.25, 0.125, 0.0625)), ("rows", (0.5, 0.25, 0.125, 0.0625))])
@pytest.mark.parametrize("capacity", [21, 22, 96])
def test_packed_attention_on_gpu_matches_float32_xla(capacity, method, alibi_slopes):
  """bf16, head size 64, grouped-query, causal, with ALiBi or not: the fused path (or XLA
  for an odd capacity), over the packed sequence or in rows, and its gradients against
  float32 XLA, at the real tokens."""
  rng = np.random.default_rng(capacity)
  mask = np.zeros((3, 12), np.int32)
  for row, length in enumerate((7, 12, 1)):
    mask[row, :length] = 1
  layout = pack_layout(mask, capacity)
  shapes = ((1, capacity, 4, 64), (1, capacity, 2, 64), (1, capacity, 2, 64))
  q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in shapes)
  cotangent = jnp.asarray(rng.standard_normal(shapes[0]), jnp.float32)

  def run(dtype, implementation):
    attend = lambda q, k, v: packed_attention(q, k, v, layout, causal=True,
                                              alibi_slopes=alibi_slopes, method=method,
                                              implementation=implementation)
    args = tuple(a.astype(dtype) for a in (q, k, v))
    out, vjp = jax.vjp(attend, *args)
    return [np.asarray(a, np.float32) for a in (out, *vjp(cotangent.astype(dtype)))]

  real = np.arange(capacity) < mask.sum()
  for got, want in zip(run(jnp.bfloat16, None), run(jnp.float32, "xla")):
    got, want = got[0, real], want[0, real]
    assert np.max(np.abs(got - want)) <= 3e-2 * np.max(np.abs(want))


@settings(max_examples=200, deadline=None)
@given(num_shards=st.integers(1, 6), rows_per_shard=st.integers(1, 6),
       lengths=st.lists(st.integers(0, 3000), min_size=36, max_size=36))
def test_balanced_shard_order_evens_the_shards(num_shards, rows_per_shard, lengths):
  """A permutation, equal rows per block, and the fullest block at most the longest row
  above the least full."""
  lengths = np.asarray(lengths[:num_shards * rows_per_shard])
  order = balanced_shard_order(lengths, num_shards)
  assert sorted(order.tolist()) == list(range(len(lengths)))
  tokens = lengths[order].reshape(num_shards, rows_per_shard).sum(axis=1)
  assert tokens.max() - tokens.min() <= lengths.max()


def test_balanced_shard_order_needs_equal_blocks():
  with pytest.raises(ValueError, match="do not split into num_shards=4"):
    balanced_shard_order([3, 1, 2], 4)
