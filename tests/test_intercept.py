"""`use_sebp` on models whose code we do not touch: transformers' Flax BERT and Llama, and
plain linen models.

Tests that compare SEBP with dense ask for backend="xla": on a GPU "auto" runs these tiny
layers dense, and a test must exercise the path it names on every machine."""

import functools
from contextlib import nullcontext

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from transformers import (BertConfig, FlaxBertForMaskedLM, FlaxBertForSequenceClassification,
                          FlaxLlamaForCausalLM, LlamaConfig)

from sebp_jax import RowLog, model_families, use_sebp
from tests.model_testing import (assert_every_gradient_close, branches, causal_lm_loss,
                                 classification_loss)


def _padded_batch(rng, batch, length, vocab):
  ids = rng.integers(3, vocab, size=(batch, length)).astype(np.int32)
  lengths = rng.integers(2, length // 2, size=batch)
  mask = (np.arange(length)[None] < lengths[:, None]).astype(np.int32)
  return ids * mask, mask


@pytest.fixture(scope="module")
def tiny_bert():
  config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64)
  return FlaxBertForSequenceClassification(config, seed=0)


@pytest.fixture(scope="module")
def tiny_llama():
  config = LlamaConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                       max_position_embeddings=64)
  return FlaxLlamaForCausalLM(config, seed=0)


@pytest.mark.parametrize("shared_index", [False, True])
def test_bert_gradients_equal_dense(tiny_bert, shared_index):
  ids, mask = _padded_batch(np.random.default_rng(0), 3, 16, 120)
  labels = np.array([0, 1, 1])
  num_real = int(mask.sum())
  kwargs = dict(top_n=num_real, active_mask=mask if shared_index else None, backend="xla")
  want = jax.jit(jax.grad(classification_loss(tiny_bert, ids, mask, labels)))(tiny_bert.params)
  sebp_loss = classification_loss(tiny_bert, ids, mask, labels, kwargs)
  got = jax.jit(jax.grad(sebp_loss))(tiny_bert.params)
  assert_every_gradient_close(got, want)


@pytest.mark.parametrize("shared_index", [False, True])
@pytest.mark.parametrize("lm_head", [False, True])
def test_llama_gradients_equal_dense(tiny_llama, shared_index, lm_head):
  ids, mask = _padded_batch(np.random.default_rng(1), 2, 16, 120)
  kwargs = dict(top_n=int(mask.sum()), active_mask=mask if shared_index else None,
                lm_head=lm_head, backend="xla")
  want = jax.jit(jax.grad(causal_lm_loss(tiny_llama, ids, mask)))(tiny_llama.params)
  got = jax.jit(jax.grad(causal_lm_loss(tiny_llama, ids, mask, kwargs)))(tiny_llama.params)
  assert_every_gradient_close(got, want)
  with use_sebp(**kwargs) as report:
    jax.eval_shape(lambda: tiny_llama(ids, attention_mask=mask))
  assert ("lm_head" in report.swapped) == lm_head


def test_lm_heads_of_bert_and_tied_heads():
  config = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=64)
  model = FlaxBertForMaskedLM(config, seed=0)
  ids, mask = _padded_batch(np.random.default_rng(4), 2, 8, 120)
  head = "cls/predictions/transform/dense"
  with use_sebp(top_n=4) as report:
    jax.eval_shape(lambda: model(ids, attention_mask=mask))
  assert report.skipped[head] == "matched by exclude"
  # The decoder is tied to the word embedding and applied through .apply: a module of its own,
  # with no path in the model (its name in the report), which no pattern can select.
  assert report.skipped["decoder"] == "no path of its own (applied through .apply)"
  with use_sebp(top_n=4, lm_head=True) as report:
    jax.eval_shape(lambda: model(ids, attention_mask=mask))
  assert head in report.swapped and "decoder" in report.skipped


def test_default_selection_and_report(tiny_bert, tiny_llama):
  ids, mask = _padded_batch(np.random.default_rng(2), 2, 8, 120)
  # The report is filled while the model is traced: nothing needs to run.
  trace = lambda model: jax.eval_shape(lambda: model(ids, attention_mask=mask))
  with use_sebp(top_n=4) as report:
    trace(tiny_bert)
  # 2 layers x (query, key, value, attention output dense, intermediate dense, output dense).
  assert report.num_swapped == 12
  assert set(report.skipped) == {"bert/pooler/dense", "classifier"}
  assert "bert/encoder/layer/1/intermediate/dense" in report.swapped
  assert report.embeddings == [f"bert/embeddings/{name}_embeddings"
                               for name in ("word", "position", "token_type")]
  assert "12 linear layers and 3 embeddings swapped" in report.summary()
  with use_sebp(top_n=4) as report:
    trace(tiny_llama)
  assert report.num_swapped == 2 * 7 and "lm_head" in report.skipped
  assert report.embeddings == ["model/embed_tokens"]
  with use_sebp(top_n=4, lm_head=True, exclude=r"lm_head|embed") as report:
    trace(tiny_llama)
  # lm_head=True wins over exclude (which still leaves the embedding alone).
  assert report.num_swapped == 2 * 7 + 1 and "lm_head" in report.swapped
  assert report.skipped == {"model/embed_tokens": "matched by exclude"}
  with use_sebp(top_n=4, embeddings=False) as report:
    trace(tiny_llama)
  assert report.num_swapped == 2 * 7 and not report.embeddings
  assert report.skipped["model/embed_tokens"] == "embeddings=False"
  with use_sebp(top_n=4, exclude=r"embed_tokens|lm_head") as report:
    trace(tiny_llama)
  assert not report.embeddings and "model/embed_tokens" in report.skipped
  with use_sebp(top_n=4, include=r"mlp/(up|down)_proj$") as report:
    trace(tiny_llama)
  assert report.num_swapped == 4 and all("mlp" in p for p in report.swapped)
  assert report.embeddings == ["model/embed_tokens"]  # include selects Dense layers only
  # A pattern that matches no Dense layer is loud, even though the embedding was swapped.
  with pytest.raises(RuntimeError, match="swapped no Dense layer"):
    with use_sebp(top_n=4, include=r"up_porj$"):
      trace(tiny_llama)


def test_shared_index_covers_layers_of_the_mask_shape(tiny_bert):
  ids, mask = _padded_batch(np.random.default_rng(3), 2, 8, 120)
  with use_sebp(top_n=int(mask.sum()), active_mask=mask, exclude=None) as report:
    jax.eval_shape(lambda: tiny_bert(ids, attention_mask=mask))
  # The pooler and the classifier see [B, H], not the mask's [B, L] tokens: left dense.
  assert report.skipped == {"bert/pooler/dense": "2 rows, not the 16 tokens of active_mask",
                            "classifier": "2 rows, not the 16 tokens of active_mask"}
  assert len(report.shared_index) == 12 + 3  # and the three embedding lookups


def test_a_function_compiled_before_is_traced_again_or_loud(tiny_bert):
  ids, mask = _padded_batch(np.random.default_rng(4), 2, 8, 120)
  forward = jax.jit(lambda params: tiny_bert(ids, attention_mask=mask, params=params).logits)
  forward(tiny_bert.params)
  # The context is part of jit's cache key: a function compiled outside is traced again in it.
  with use_sebp(top_n=4) as report:
    forward(tiny_bert.params)
  assert report.num_swapped == 12
  # An equal context takes the compiled program, and the report of the trace that made it.
  with use_sebp(top_n=4) as again:
    forward(tiny_bert.params)
  assert again == report
  # A program compiled ahead of time runs what it was compiled with: nothing is traced.
  compiled = jax.jit(lambda params: tiny_bert(ids, attention_mask=mask,
                                              params=params).logits).lower(
                                                  tiny_bert.params).compile()
  with pytest.raises(RuntimeError, match="swapped no Dense layer. No Dense layer was traced "
                     r"in it.*ahead of time"):
    with use_sebp(top_n=5):
      compiled(tiny_bert.params)
  # Where an equal context traced layers before, it cannot tell the program from a cached
  # one: it takes that report (the README says so).
  with use_sebp(top_n=4) as unseen:
    compiled(tiny_bert.params)
  assert unseen == report


def test_a_cached_call_after_two_programs_of_equal_contexts_warns(caplog):
  """Two jitted functions traced in equal contexts (the whole model, its first layer only):
  a later equal context around a cached call cannot tell which program ran; it takes the
  latest trace's report and says so."""
  class TwoLayers(nn.Module):
    @nn.compact
    def __call__(self, x, first_only=False):
      x = nn.Dense(4, name="first")(x)
      return x if first_only else nn.Dense(3, name="second")(x)

  x = jnp.ones((6, 5))
  params = TwoLayers().init(jax.random.key(0), x)
  whole = jax.jit(lambda params: TwoLayers().apply(params, x))
  first = jax.jit(lambda params: TwoLayers().apply(params, x, first_only=True))
  options = dict(top_n=5, threshold=1.25e-7)  # A key of this test's own.
  with use_sebp(**options) as traced_whole:
    whole(params)
  with use_sebp(**options) as traced_first:
    first(params)
  assert traced_whole.swapped == ["first", "second"] and traced_first.swapped == ["first"]
  assert "need not be the program that ran" not in caplog.text
  with use_sebp(**options) as cached:
    whole(params)
  assert cached == traced_first
  assert "equal contexts traced 2 programs with different reports" in caplog.text


def test_decorator_form_and_grad(tiny_bert):
  ids, mask = _padded_batch(np.random.default_rng(5), 2, 12, 120)
  labels = np.array([1, 0])
  dense_loss = classification_loss(tiny_bert, ids, mask, labels)
  sebp_loss = use_sebp(top_n=int(mask.sum()), backend="xla")(dense_loss)
  dense_grads = jax.jit(jax.grad(dense_loss))(tiny_bert.params)
  assert_every_gradient_close(jax.jit(jax.grad(sebp_loss))(tiny_bert.params), dense_grads)
  # Too small a top_n must change the gradient: the interceptor really acts. ("xla": "auto"
  # runs layers this small dense on a GPU, keeping every row.)
  starved = use_sebp(top_n=2, overflow="drop", backend="xla")(dense_loss)
  got = jax.jit(jax.grad(starved))(tiny_bert.params)
  got, want = (g["bert"]["encoder"]["layer"]["0"]["intermediate"] for g in (got, dense_grads))
  assert not np.allclose(got["dense"]["kernel"], want["dense"]["kernel"], rtol=1e-3)


class ScaledEmbed(nn.Embed):
  def __call__(self, inputs):
    return super().__call__(inputs) * 10.0


class PlainDense(nn.Dense):  # no __call__ of its own: runs nn.Dense's
  pass


class MixedModel(nn.Module):
  """Embedding subclass with its own __call__, a Dense subclass without one, and a Dense on a
  transposed batch: as many rows as the mask, in another layout."""

  @nn.compact
  def __call__(self, ids, mask):
    h = ScaledEmbed(20, 6, name="embed")(ids) + nn.Embed(20, 6, name="plain_embed")(ids)
    h = PlainDense(6, name="dense")(h) * mask[..., None]
    flipped = nn.Dense(6, name="up_proj")(jnp.swapaxes(h, 0, 1))
    return jnp.sum(jnp.swapaxes(flipped, 0, 1) * mask[..., None])


def test_subclasses_and_shared_index_shapes():
  rng = np.random.default_rng(7)
  ids = jnp.asarray(rng.integers(0, 20, size=(3, 4)), jnp.int32)
  mask = jnp.asarray([[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], jnp.float32)
  params = MixedModel().init(jax.random.key(0), ids, mask)
  reports = []

  def dense_loss(params):
    return MixedModel().apply(params, ids, mask)

  def sebp_loss(params):
    with use_sebp(top_n=6, active_mask=mask, backend="xla") as report:
      reports.append(report)
      return dense_loss(params)

  want_value, want = jax.value_and_grad(dense_loss)(params)
  got_value, got = jax.value_and_grad(sebp_loss)(params)
  (report,) = reports
  assert report.skipped["embed"] == "a subclass with its own __call__"
  assert report.embeddings == ["plain_embed"]
  assert report.swapped == ["dense", "up_proj"]
  # up_proj's rows are [L, B]: same count as the mask, not its layout, so no shared index.
  assert report.shared_index == ["plain_embed", "dense"]
  np.testing.assert_allclose(got_value, want_value, rtol=1e-6)  # ScaledEmbed kept its * 10
  assert_every_gradient_close(got, want)


class QuantizedMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Dense(8, name="up_proj")(x)
    return nn.Dense(4, name="down_proj", dot_general=jax.lax.dot_general)(x)


def test_layers_with_a_custom_dot_general_stay_dense():
  x = jnp.ones((2, 3, 5))
  params = QuantizedMLP().init(jax.random.key(0), x)
  with use_sebp(top_n=2) as report:
    QuantizedMLP().apply(params, x)
  assert report.swapped == ["up_proj"]
  assert "custom dot_general" in report.skipped["down_proj"]


class Tagger(nn.Module):
  @nn.compact
  def __call__(self, ids):
    x = jnp.tanh(nn.Dense(32, name="up")(nn.Embed(40, 16)(ids)))
    return nn.Dense(16, name="down")(x)


def test_layers_holding_parameters_they_do_not_read_stay_dense():
  """qwix's LoRA adds its adapters to a layer's own parameters and its term to the layer's
  output by intercepting its ops: the SEBP backward, which knows the kernel and bias alone,
  would drop that term's part of dX. Such layers stay dense, with the reason."""
  qwix = pytest.importorskip("qwix")
  rng = np.random.default_rng(4)
  mask = np.arange(10) < rng.integers(2, 10, (3, 1))
  ids = jnp.asarray(rng.integers(0, 40, (3, 10)) * mask)
  model = qwix.apply_lora_to_model(
      Tagger(), qwix.LoraProvider(module_path=".*(up|down)", rank=2, alpha=2.0))
  params = model.init(jax.random.key(0), ids)
  keys = iter(jax.random.split(jax.random.key(1), 8))
  # Adapters that change the output (qwix starts B at zero).
  params = jax.tree_util.tree_map_with_path(
      lambda path, p: jax.random.normal(next(keys), p.shape) if "lora" in str(path) else p,
      params)
  reports = []

  def loss(params, sebp):
    with use_sebp(active_mask=mask, backend="xla") if sebp else nullcontext() as report:
      reports.append(report)
      out = model.apply(params, ids)
    return jnp.sum(jnp.where(mask[..., None], out, 0) ** 2)

  assert_every_gradient_close(jax.grad(loss)(params, True), jax.grad(loss)(params, False))
  report = reports[0]
  assert report.swapped == [] and report.embeddings == ["Embed_0"]
  for path in ("up", "down"):
    assert report.skipped[path].startswith(
        "parameters its computation does not read (kernel_lora_a, kernel_lora_b)")


@pytest.mark.parametrize("shared_index, backend", [(True, "pallas"), (False, "xla")])
def test_gpt2s_linear_layers_run_sebp(shared_index, backend):
  """GPT-2's linear layers are transformers' FlaxConv1D (a Dense whose kernel is held
  transposed), not nn.Dense: they run SEBP too, with the mask's index or rows of their own,
  exact; its LM head, tied to the token embeddings through .apply, stays dense."""
  from transformers import FlaxGPT2LMHeadModel, GPT2Config

  from sebp_jax.losses import masked_causal_lm_loss
  gpt2 = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=60, n_positions=16, n_embd=16, n_layer=1,
                                        n_head=2), seed=0)
  ids, mask = _padded_batch(np.random.default_rng(36), 3, 8, 60)
  reports = []

  def loss(params, sebp):
    context = use_sebp(active_mask=mask if shared_index else None, backend=backend)
    with context if sebp else nullcontext() as report:
      reports.append(report)
      logits = gpt2(ids, attention_mask=mask, params=params).logits
    return masked_causal_lm_loss(logits, ids, mask)

  assert_every_gradient_close(jax.jit(jax.grad(loss), static_argnums=1)(gpt2.params, True),
                              jax.grad(loss)(gpt2.params, False))
  report = reports[0]
  linear = [f"transformer/h/0/{layer}" for layer in ("attn/c_attn", "attn/c_proj", "mlp/c_fc",
                                                     "mlp/c_proj")]
  assert report.swapped == linear
  assert report.embeddings == ["transformer/wte", "transformer/wpe"]
  assert report.shared_index == (report.embeddings + linear if shared_index else [])
  assert report.skipped == {"lm_head": "no path of its own (applied through .apply)"}


def test_gpt2s_swapped_linear_layers_check_their_parameters_as_their_own_call():
  """A missing bias or a kernel of another shape raises as the layer's own call does, never a
  forward without them."""
  from flax.errors import ScopeParamNotFoundError, ScopeParamShapeError
  from transformers import FlaxGPT2LMHeadModel, GPT2Config
  gpt2 = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=60, n_positions=16, n_embd=16, n_layer=1,
                                        n_head=2), seed=0)
  ids, mask = _padded_batch(np.random.default_rng(41), 3, 8, 60)
  layer = gpt2.params["transformer"]["h"]["0"]["mlp"]["c_fc"]
  without_bias = {"kernel": layer["kernel"]}
  narrow = {**layer, "kernel": layer["kernel"][:48]}
  for params, error in ((without_bias, ScopeParamNotFoundError), (narrow, ScopeParamShapeError)):
    broken = jax.tree.map(lambda a: a, gpt2.params)
    broken["transformer"]["h"]["0"]["mlp"]["c_fc"] = params
    for context in (nullcontext(), use_sebp(active_mask=mask, backend="xla")):
      with pytest.raises(error), context:
        gpt2(ids, attention_mask=mask, params=broken)


def test_bad_arguments():
  with pytest.raises(ValueError, match="top_n"):
    use_sebp(top_n=0)
  with pytest.raises(ValueError, match=r"active_mask must be an array of token flags.*<U1\[2\]"):
    use_sebp(active_mask=np.array(["a", "b"]))
  with pytest.raises(ValueError, match="active_mask must be an array of token flags"):
    use_sebp(active_mask=[[1, 0], [1]])
  assert isinstance(use_sebp(active_mask=[[1, 0], [1, 1]]).active_mask, np.ndarray)
  with pytest.raises(ValueError, match=r"at least 1-D.*\[\]"):
    use_sebp(active_mask=1)
  with pytest.raises(ValueError, match="kept fraction"):
    use_sebp(top_n=1.5)
  with pytest.raises(ValueError, match="kept fraction"):
    use_sebp(top_n=np.float32(1.5))
  use_sebp(top_n=np.float32(0.5))  # a numpy float is a fraction too
  with pytest.raises(ValueError, match="threshold"):
    use_sebp(top_n=4, threshold=-1.0)
  with pytest.raises(ValueError, match="backend"):
    use_sebp(top_n=4, backend="cuda")
  # A string is truthy: "False" would have turned the switch on.
  for switch in ("lm_head", "embeddings", "packed", "require_swaps"):
    with pytest.raises(ValueError, match=f"{switch} must be True or False, got 'False'"):
      use_sebp(**{switch: "False"})
  for pattern in ("include", "exclude"):
    for bad in ("[", 5):
      with pytest.raises(ValueError, match=f"{pattern} must be a regular expression"):
        use_sebp(**{pattern: bad})
  assert use_sebp(exclude="").exclude is None


class ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    return h + jnp.tanh(nn.Dense(8, name="up_proj")(h)), None


class ScannedModel(nn.Module):
  """An embedding, then three remat'd residual blocks under nn.scan; padding is masked."""

  @nn.compact
  def __call__(self, ids, mask):
    h = nn.Embed(30, 8, name="embed")(ids)
    blocks = nn.scan(nn.remat(ScanBlock), variable_axes={"params": 0},
                     split_rngs={"params": True}, length=3)
    h, _ = blocks(name="layers")(h, None)
    return jnp.sum(jnp.tanh(h) * mask[..., None])


@pytest.mark.parametrize("shared_index", [False, True])
def test_scan_and_remat_inside_use_sebp(shared_index):
  rng = np.random.default_rng(8)
  ids = jnp.asarray(rng.integers(0, 30, size=(2, 6)), jnp.int32)
  mask = jnp.asarray([[1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], jnp.float32)
  params = ScannedModel().init(jax.random.key(0), ids, mask)
  reports = []

  def dense_loss(params):
    return ScannedModel().apply(params, ids, mask)

  def sebp_loss(params):
    with use_sebp(top_n=5, active_mask=mask if shared_index else None,
                  backend="xla") as report:
      reports.append(report)
      return dense_loss(params)

  got = jax.jit(jax.grad(sebp_loss))(params)
  assert_every_gradient_close(got, jax.grad(dense_loss)(params))
  (report,) = reports
  assert report.embeddings == ["embed"] and report.num_swapped == 1
  assert len(report.shared_index) == (2 if shared_index else 0)
  # Too few rows must change the scanned layers' gradient: the interceptor acts under scan.
  with use_sebp(top_n=2, overflow="drop", active_mask=mask if shared_index else None,
                backend="xla"):
    starved = jax.grad(lambda p: ScannedModel().apply(p, ids, mask))(params)
  assert not np.allclose(starved["params"]["layers"]["up_proj"]["kernel"],
                         got["params"]["layers"]["up_proj"]["kernel"])


class PlainMLP(nn.Module):
  """A model of one's own: auto-named layers (Dense_0, Dense_1), padding masked."""

  @nn.compact
  def __call__(self, x, mask):
    h = nn.relu(nn.Dense(16)(x))
    return jnp.sum(nn.Dense(3)(h) * mask[..., None])


def test_a_plain_model_works_with_the_defaults():
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.standard_normal((4, 6, 5)), jnp.float32)
  mask = jnp.asarray(np.arange(6)[None] < np.array([[2], [5], [1], [3]]), jnp.float32)
  params = PlainMLP().init(jax.random.key(0), x, mask)
  reports = []

  def loss(params, sebp):
    if not sebp:
      return PlainMLP().apply(params, x, mask)
    with use_sebp(top_n=int(mask.sum()), backend="xla") as report:
      reports.append(report)
      return PlainMLP().apply(params, x, mask)

  assert_every_gradient_close(jax.grad(loss)(params, True), jax.grad(loss)(params, False))
  assert reports[0].swapped == ["Dense_0", "Dense_1"]
  # Too few rows, dropped, change the gradient: the defaults really swapped them.
  with use_sebp(top_n=2, overflow="drop", backend="xla"):
    starved = jax.grad(lambda p: PlainMLP().apply(p, x, mask))(params)
  assert not np.allclose(starved["params"]["Dense_0"]["kernel"],
                         jax.grad(loss)(params, False)["params"]["Dense_0"]["kernel"])


def test_a_model_with_embeddings_only_is_not_an_error():
  ids = jnp.asarray([[1, 2, 0], [3, 0, 0]], jnp.int32)

  class Wrapper(nn.Module):
    @nn.compact
    def __call__(self, ids):
      return nn.Embed(5, 4, name="tokens")(ids)

  params = Wrapper().init(jax.random.key(0), ids)
  with use_sebp(top_n=3) as report:
    Wrapper().apply(params, ids)
  assert report.embeddings == ["tokens"] and not report.swapped


class PooledClassifier(nn.Module):
  """Auto-named layers: a token layer, then a head on one pooled row per sequence."""

  @nn.compact
  def __call__(self, x, mask):
    h = nn.tanh(nn.Dense(8)(x)) * mask[..., None]
    return nn.Dense(2)(h.sum(axis=1))


def test_a_head_on_other_rows_than_the_mask_stays_dense():
  rng = np.random.default_rng(10)
  x = jnp.asarray(rng.standard_normal((8, 6, 5)), jnp.float32)
  mask = jnp.asarray(np.arange(6)[None] < rng.integers(1, 6, (8, 1)), jnp.float32)
  params = PooledClassifier().init(jax.random.key(0), x, mask)

  def loss(params, sebp):
    with use_sebp(top_n=0.85, active_mask=mask, backend="xla") if sebp else nullcontext():
      return jnp.sum(PooledClassifier().apply(params, x, mask) ** 2)

  assert mask.sum() <= 0.85 * mask.size  # the index covers every real token
  with use_sebp(top_n=0.85, active_mask=mask) as report:
    PooledClassifier().apply(params, x, mask)
  assert report.swapped == ["Dense_0"] and report.shared_index == ["Dense_0"]
  assert report.skipped == {"Dense_1": "8 rows, not the 48 tokens of active_mask"}
  # The same fraction of the head's 8 rows would have dropped a sequence's gradient.
  assert_every_gradient_close(jax.grad(loss)(params, True), jax.grad(loss)(params, False))


class MeanOverEveryPosition(nn.Module):
  """Pools every position, padding included: its padding rows of dY are not zero."""
  @nn.compact
  def __call__(self, ids):
    h = nn.tanh(nn.Dense(8)(nn.Embed(20, 8)(ids)))
    pooled = nn.tanh(nn.Dense(8)(h)).mean(axis=1)
    return nn.Dense(2, name="head")(pooled)


@pytest.mark.parametrize("backend", ["xla", "pallas", "dense"])
def test_a_loss_that_reads_padding_makes_the_gradients_nan(backend):
  """A model that breaks the mask's promise (a pooling over padding) would lose padding's
  gradient rows: each layer on the index finds them in its read of dY and makes its dW, db
  and those rows of dX NaN, so every gradient below turns NaN, the table's too, for a
  concrete and a traced mask and any capacity; the head, on other rows, stays exact."""
  rng = np.random.default_rng(11)
  ids = jnp.asarray(rng.integers(1, 20, (4, 6)), jnp.int32)
  mask = np.arange(6)[None] < np.array([[2], [6], [3], [1]])
  model = MeanOverEveryPosition()
  params = model.init(jax.random.key(0), ids)

  def loss(params, mask, top_n):
    with use_sebp(top_n=top_n, active_mask=mask, backend=backend):
      return jnp.sum(model.apply(params, ids) ** 2)

  dense = jax.grad(lambda params: jnp.sum(model.apply(params, ids) ** 2))(params)
  for top_n, traced in (("auto", False), (16, False), (16, True)):
    grads = (jax.jit(jax.grad(loss), static_argnums=2)(params, jnp.asarray(mask), top_n)
             if traced else jax.grad(loss)(params, mask, top_n))["params"]
    for layer in ("Embed_0", "Dense_0", "Dense_1"):
      assert all(np.isnan(leaf).all() for leaf in jax.tree.leaves(grads[layer])), layer
    assert_every_gradient_close(grads["head"], dense["params"]["head"])


def test_contexts_do_not_nest_and_an_unused_mask_is_loud():
  x = jnp.ones((2, 3, 5))
  params = PlainMLP().init(jax.random.key(0), x, jnp.ones((2, 3)))
  with use_sebp(top_n=4):
    with pytest.raises(RuntimeError, match="already active"):
      with use_sebp(top_n=4):
        pass
    PlainMLP().apply(params, x, jnp.ones((2, 3)))
  with use_sebp(top_n=4):  # the failed inner one left nothing behind
    PlainMLP().apply(params, x, jnp.ones((2, 3)))
  with pytest.raises(RuntimeError, match=r"active_mask of shape \(3, 2\) matched no layer"):
    with use_sebp(top_n=4, active_mask=jnp.ones((3, 2))):
      PlainMLP().apply(params, x, jnp.ones((2, 3)))


# ---------------------------------------------------------------------------------------------
# Exact by construction: capacities, overflow, the row log.
# ---------------------------------------------------------------------------------------------


def _mlp_problem(seed, lengths, length=16):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((len(lengths), length, 5)), jnp.float32)
  mask = jnp.asarray(np.arange(length)[None] < np.array(lengths)[:, None], jnp.float32)
  params = PlainMLP().init(jax.random.key(seed), x, mask)
  return params, x, mask


def _mlp_grads(params, x, mask, **options):
  def loss(params, x, mask):
    with use_sebp(backend="xla", **options):
      return PlainMLP().apply(params, x, mask)
  return jax.jit(jax.grad(loss))(params, x, mask)


def _dense_mlp_grads(params, x, mask):
  return jax.grad(lambda p: PlainMLP().apply(p, x, mask))(params)


@pytest.mark.parametrize("lengths", [[1, 2, 1, 0], [5, 9, 3, 2], [16, 16, 12, 1],
                                     [16, 16, 16, 16]])
@pytest.mark.parametrize("shared_index", [False, True])
def test_the_default_auto_is_exact_for_any_batch(lengths, shared_index):
  params, x, mask = _mlp_problem(11, lengths)
  options = dict(active_mask=mask) if shared_index else {}
  assert_every_gradient_close(_mlp_grads(params, x, mask, **options),
                              _dense_mlp_grads(params, x, mask))


@pytest.mark.parametrize("shared_index", [False, True])
def test_an_int_top_n_is_exact_by_default_when_overflowed(shared_index):
  params, x, mask = _mlp_problem(12, [16, 9, 12, 7])
  options = dict(active_mask=mask) if shared_index else {}
  assert_every_gradient_close(_mlp_grads(params, x, mask, top_n=8, **options),
                              _dense_mlp_grads(params, x, mask))


def _count_conds(fn, *args) -> int:
  return branches(jax.make_jaxpr(fn)(*args).jaxpr).count("cond")


def test_a_concrete_mask_picks_the_capacity_on_the_host_with_no_branch():
  params, x, mask = _mlp_problem(13, [3, 5, 2, 4])
  host_mask = np.asarray(mask)

  def loss(params, x, mask, host):
    with use_sebp(backend="xla", active_mask=host_mask if host else mask):
      return PlainMLP().apply(params, x, mask)

  assert _count_conds(jax.grad(lambda p: loss(p, x, mask, True)), params) == 0
  assert _count_conds(jax.jit(jax.grad(lambda p, m: loss(p, x, m, False))), params, mask) >= 2
  assert_every_gradient_close(jax.jit(jax.grad(lambda p: loss(p, x, mask, True)))(params),
                              _dense_mlp_grads(params, x, mask))


@pytest.mark.parametrize("lengths", [[0, 0, 0, 0], [1, 0, 0, 0], [3, 5, 2, 4], [16, 16, 16, 15],
                                     [16, 16, 16, 16]])
def test_a_traced_mask_with_the_pallas_kernels_is_one_branch_free_program(lengths):
  """top_n="auto" with a traced mask: the Pallas kernels, whose work follows the rows listed,
  take the whole index at once instead of a capacity chosen at run time. No cond, and the
  dense gradient for any count of real tokens."""
  params, x, mask = _mlp_problem(16, lengths)

  def loss(params, mask, backend):
    with use_sebp(active_mask=mask, backend=backend):
      return PlainMLP().apply(params, x, mask)

  def grad(backend):
    return jax.grad(functools.partial(loss, backend=backend))

  assert branches(jax.make_jaxpr(grad("pallas"))(params, mask).jaxpr) == []
  assert "cond" in branches(jax.make_jaxpr(grad("xla"))(params, mask).jaxpr)
  assert_every_gradient_close(jax.jit(grad("pallas"))(params, mask),
                              _dense_mlp_grads(params, x, mask))


def test_overflow_nan_is_visible_and_branch_free():
  params, x, mask = _mlp_problem(14, [16, 9, 12, 7])

  def loss(params, x, mask, top_n):
    with use_sebp(top_n=top_n, overflow="nan", active_mask=mask, backend="xla"):
      return PlainMLP().apply(params, x, mask)

  grad = jax.jit(jax.grad(loss), static_argnums=3)
  assert _count_conds(jax.grad(lambda p, x, m: loss(p, x, m, 8)), params, x, mask) == 0
  assert all(np.all(np.isnan(g)) for g in jax.tree.leaves(grad(params, x, mask, 8)))
  assert_every_gradient_close(grad(params, x, mask, 44), _dense_mlp_grads(params, x, mask))
  with pytest.raises(ValueError, match="44 real tokens, more than top_n=8"):
    loss(params, x, np.asarray(mask), 8)


def test_overflow_drop_keeps_the_first_rows_of_the_mask_index_by_norm():
  params, x, mask = _mlp_problem(15, [16, 9, 12, 7])
  dropped = _mlp_grads(params, x, mask, top_n=8, overflow="drop", active_mask=mask)
  dense = _dense_mlp_grads(params, x, mask)
  assert not np.allclose(dropped["params"]["Dense_0"]["kernel"],
                         dense["params"]["Dense_0"]["kernel"])
  with pytest.raises(ValueError, match="overflow must be one of"):
    use_sebp(overflow="truncate")


def test_the_row_log_reports_every_layer_and_step():
  params, x, mask = _mlp_problem(16, [3, 5, 2, 4])
  log = RowLog()

  def loss(params, x, mask):
    with use_sebp(active_mask=mask, backend="xla", row_log=log):
      return PlainMLP().apply(params, x, mask)

  grad = jax.jit(jax.grad(loss))
  for _ in range(2):
    jax.block_until_ready(grad(params, x, mask))
  records = log.records
  assert sorted((r["layer"], r["step"]) for r in records) == [
      ("Dense_0", 0), ("Dense_0", 1), ("Dense_1", 0), ("Dense_1", 1)]
  for record in records:
    assert record["rows"] == 64 and record["active"] == record["kept"] == 14
    assert record["capacity"] == 16 and record["dropped_share"] == 0
  assert "Dense_0" in log.summary()
  with pytest.raises(ValueError, match="row_log must be a sebp_jax.RowLog"):
    use_sebp(row_log=[])


def test_packing_needs_a_capacity_known_on_the_host(tiny_bert):
  ids, mask = _padded_batch(np.random.default_rng(17), 3, 16, 120)
  labels = np.array([1, 0, 1])
  dense_loss = classification_loss(tiny_bert, ids, mask, labels)

  def packed_loss(params, mask):
    with use_sebp(active_mask=mask, packed=True, backend="xla") as report:
      logits = tiny_bert(ids, attention_mask=mask, params=params).logits
    assert report.capacity == min(mask.size, 128)
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(3), labels])

  assert_every_gradient_close(jax.grad(packed_loss)(tiny_bert.params, mask),
                              jax.jit(jax.grad(dense_loss))(tiny_bert.params))
  with pytest.raises(ValueError, match="token_capacity"):
    jax.jit(jax.grad(packed_loss))(tiny_bert.params, mask)
  with pytest.raises(ValueError, match="cannot drop tokens"):
    use_sebp(active_mask=mask, packed=True, overflow="drop")


def test_an_empty_batch_works():
  params, x, mask = _mlp_problem(18, [3, 5])
  empty_x, empty_mask = x[:0], mask[:0]
  for options in (dict(active_mask=empty_mask), {}):
    grads = _mlp_grads(params, empty_x, empty_mask, require_swaps=True, **options)
    assert not any(np.any(g) for g in jax.tree.leaves(grads))


# ---------------------------------------------------------------------------------------------
# The corners: a cut index, square batches, encoder-decoders, contexts around jitted calls.
# ---------------------------------------------------------------------------------------------


class OneDense(nn.Module):
  @nn.compact
  def __call__(self, x):
    return nn.Dense(7)(x)


def test_overflow_nan_counts_the_real_tokens_a_traced_index_cuts():
  """18 real tokens, of which 3 have a zero dY (a label of -100): 15 active rows fit in
  top_n=15, but the index of the first 15 real tokens cuts 3 that carry gradient."""
  rng = np.random.default_rng(30)
  x = jnp.asarray(rng.standard_normal((2, 10, 5)), jnp.float32)
  mask = (np.arange(10)[None] < 9).repeat(2, axis=0).astype(np.float32)
  weights = rng.standard_normal((2, 10, 7)).astype(np.float32) * mask[..., None]
  weights[0, :3] = 0
  params = OneDense().init(jax.random.key(30), x)

  def loss(params, mask, top_n):
    with use_sebp(top_n=top_n, overflow="nan", active_mask=mask, backend="xla"):
      return jnp.sum(OneDense().apply(params, x) * weights)

  grad = jax.jit(jax.grad(loss), static_argnums=2)
  assert all(np.all(np.isnan(g)) for g in jax.tree.leaves(grad(params, mask, 15)))
  dense = jax.grad(lambda p: jnp.sum(OneDense().apply(p, x) * weights))(params)
  assert_every_gradient_close(grad(params, mask, 18), dense)


def test_overflow_nan_on_a_causal_lm_whose_last_positions_weigh_nothing(tiny_llama):
  """Each sequence's last real token predicts nothing: with top_n = real tokens - 3 the
  active rows fit, the real tokens do not, and every gradient is NaN (the loss too, with a
  loss capacity that does not hold them either)."""
  ids, mask = _padded_batch(np.random.default_rng(31), 3, 16, 120)
  num_real = int(mask.sum())

  def loss(params, mask, top_n):
    options = dict(top_n=top_n, overflow="nan", active_mask=mask, lm_head=True, backend="xla")
    return causal_lm_loss(tiny_llama, ids, mask, options)(params)

  grad = jax.jit(jax.grad(loss), static_argnums=2)
  assert all(np.all(np.isnan(g)) for g in jax.tree.leaves(grad(tiny_llama.params, mask,
                                                               num_real - 3)))
  assert_every_gradient_close(grad(tiny_llama.params, mask, num_real),
                              jax.jit(jax.grad(causal_lm_loss(tiny_llama, ids, mask)))(
                                  tiny_llama.params))


class SquareMixed(nn.Module):
  """A token layer, then one fed the batch transposed: [L, B] rows, as many as [B, L]."""

  @nn.compact
  def __call__(self, x, mask):
    h = nn.Dense(6, name="tokens")(x) * mask[..., None]
    flipped = nn.Dense(6, name="time_major")(jnp.swapaxes(h, 0, 1))
    return jnp.sum(jnp.swapaxes(flipped, 0, 1) * mask[..., None])


def test_a_square_batch_cannot_tell_a_transposed_layer_from_its_own(tiny_bert, caplog):
  rng = np.random.default_rng(32)
  x = jnp.asarray(rng.standard_normal((5, 5, 4)), jnp.float32)
  mask = np.arange(5)[None] < rng.integers(1, 5, (5, 1))
  params = SquareMixed().init(jax.random.key(32), x, mask)
  reports = []

  def loss(params, sebp):
    if not sebp:
      return SquareMixed().apply(params, x, mask)
    with use_sebp(active_mask=mask, backend="xla") as report:
      reports.append(report)
      return SquareMixed().apply(params, x, mask)

  grad = jax.jit(jax.grad(loss), static_argnums=1)
  assert_every_gradient_close(grad(params, True), grad(params, False))
  # [B, L] or [L, B]: a model of one's own says nothing, so both layers select their own rows.
  assert set(reports[0].own_rows) == {"tokens", "time_major"} and not reports[0].shared_index
  assert "cannot tell a [B, L] batch from a transposed one" in caplog.text
  # transformers' BERT feeds every layer [B, L] rows: the shared index, exact.
  ids, bert_mask = _padded_batch(rng, 8, 8, 120)
  labels = rng.integers(0, 2, 8)
  kwargs = dict(active_mask=bert_mask, backend="xla")
  assert_every_gradient_close(
      jax.jit(jax.grad(classification_loss(tiny_bert, ids, bert_mask, labels, kwargs)))(
          tiny_bert.params),
      jax.jit(jax.grad(classification_loss(tiny_bert, ids, bert_mask, labels)))(
          tiny_bert.params))
  with use_sebp(**kwargs) as report:
    jax.eval_shape(lambda p: tiny_bert(ids, attention_mask=bert_mask, params=p),
                   tiny_bert.params)
  assert len(report.shared_index) == 12 + 3 and not report.own_rows


def test_an_encoder_decoder_model_refuses_one_mask_and_is_exact_without():
  from transformers import BartConfig, FlaxBartForConditionalGeneration
  config = BartConfig(vocab_size=60, d_model=16, encoder_layers=1, decoder_layers=1,
                      encoder_attention_heads=2, decoder_attention_heads=2,
                      encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32)
  bart = FlaxBartForConditionalGeneration(config, seed=0)
  rng = np.random.default_rng(33)
  # Encoder and decoder padded to the same length, as seq2seq fine-tuning pads them.
  ids, mask = _padded_batch(rng, 3, 8, 60)
  decoder_ids, decoder_mask = _padded_batch(rng, 3, 8, 60)

  def loss(params, options=None):
    with use_sebp(**dict(options)) if options is not None else nullcontext():
      logits = bart(ids, attention_mask=mask, decoder_input_ids=decoder_ids,
                    decoder_attention_mask=decoder_mask, params=params).logits
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, decoder_ids)
    return jnp.sum(losses * decoder_mask) / decoder_mask.sum()

  with pytest.raises(ValueError, match="encoder-decoder model.*Leave active_mask out"):
    jax.eval_shape(jax.grad(lambda p: loss(p, dict(active_mask=mask, backend="xla"))),
                   bart.params)
  # Without it every layer selects its own rows from dY, the LM head too.
  grad = jax.jit(jax.grad(loss), static_argnums=1)
  assert_every_gradient_close(grad(bart.params, (("lm_head", True), ("backend", "xla"))),
                              grad(bart.params, None))


@pytest.mark.parametrize("name", ["GPT-2", "BERT", "XGLM"])
def test_a_model_with_cross_attention_refuses_one_mask(name):
  """transformers' Flax GPT-2 and BERT build cross-attention from add_cross_attention alone,
  is_decoder or not: its key and value projections run on the encoder's rows, of the
  decoder's shape here, so one mask would give them the decoder's index. Called without
  encoder states, the cross-attention does not run, and the mask serves the rest exactly."""
  from transformers import (FlaxBertModel, FlaxGPT2LMHeadModel, FlaxXGLMForCausalLM,
                            GPT2Config, XGLMConfig)
  if name == "GPT-2":
    model = FlaxGPT2LMHeadModel(GPT2Config(vocab_size=60, n_positions=16, n_embd=16,
                                           n_layer=1, n_head=2, add_cross_attention=True))
  elif name == "XGLM":
    # Its cross-attention (encoder_attn, MBart's) reads these two sizes too.
    model = FlaxXGLMForCausalLM(XGLMConfig(
        vocab_size=60, max_position_embeddings=32, d_model=16, num_layers=1,
        attention_heads=2, ffn_dim=32, add_cross_attention=True, decoder_attention_heads=2,
        n_embd=16))
  else:
    model = FlaxBertModel(BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32,
                                     add_cross_attention=True))
  assert not model.config.is_decoder
  rng = np.random.default_rng(40)
  ids, mask = _padded_batch(rng, 3, 8, 60)
  encoded = jnp.asarray(rng.standard_normal((3, 8, 16)), jnp.float32)

  def loss(params, sebp=True, cross=True):
    with use_sebp(active_mask=mask, backend="xla") if sebp else nullcontext():
      out = model(ids, attention_mask=mask, params=params, **(
          dict(encoder_hidden_states=encoded,
               encoder_attention_mask=np.ones((3, 8), np.int32)) if cross else {}))
    return jnp.sum(jnp.where(mask[..., None] != 0, out[0], 0) ** 2)

  with pytest.raises(ValueError, match="one with cross-attention.*Leave active_mask out"):
    jax.eval_shape(jax.grad(loss), model.params)
  grad = jax.jit(jax.grad(loss), static_argnums=(1, 2))
  assert_every_gradient_close(grad(model.params, True, False), grad(model.params, False, False))


def test_every_layer_of_an_encoder_decoder_is_known_as_one():
  """T5 hands its stacks configs that say nothing of the encoder-decoder around them: the
  model's own config does, so every layer is refused one mask, not the shared embedding
  alone (with it left out, the decoder's layers took the encoder's index). T5's Flax model
  does not run on jax 0.10 (transformers calls ``jnp.clip(a_max=)``); its module binds."""
  from transformers import BertConfig, T5Config
  from transformers.models.bert.modeling_flax_bert import FlaxBertForCausalLMModule
  from transformers.models.t5.modeling_flax_t5 import (FlaxT5EncoderModule,
                                                       FlaxT5ForConditionalGenerationModule)
  config = T5Config(vocab_size=50, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
  t5 = FlaxT5ForConditionalGenerationModule(config).bind({"params": {}})
  attention = lambda stack: stack.block.blocks[0].layer.layer[0].SelfAttention
  for stack in (t5.encoder, t5.decoder):
    assert not attention(stack).config.is_encoder_decoder
    assert model_families.input_layout(attention(stack)) == model_families.ENCODER_DECODER
  # The encoder-only model keeps the encoder-decoder's config, but has no decoder.
  encoder_only = FlaxT5EncoderModule(config).bind({"params": {}})
  assert (model_families.input_layout(attention(encoder_only.encoder))
          == model_families.BATCH_MAJOR)
  bert = FlaxBertForCausalLMModule(BertConfig(is_decoder=True)).bind({"params": {}})
  assert (model_families.input_layout(bert.bert.encoder.layer.layers[0].attention.self)
          == model_families.BATCH_MAJOR)


def test_a_context_around_a_jitted_call_never_runs_another_contexts_program():
  """A function jitted outside the context and traced inside it (the index of a numpy mask
  baked in) is traced again for another mask, or outside any context; an equal context
  reuses its program and report."""
  traces = []

  def dense_loss(params, x, mask):
    traces.append(1)
    return PlainMLP().apply(params, x, mask)

  grad = jax.jit(jax.grad(dense_loss))
  params, x, mask = _mlp_problem(34, [3, 5, 2, 4])
  _, x2, mask2 = _mlp_problem(35, [16, 1, 9, 6])
  with use_sebp(active_mask=np.asarray(mask), backend="xla") as first:
    grad(params, x, mask)
  assert first.shared_index == ["Dense_0", "Dense_1"] and len(traces) == 1
  # Outside any context, on another batch: traced again, dense.
  assert_every_gradient_close(grad(params, x2, mask2), _dense_mlp_grads(params, x2, mask2))
  assert len(traces) == 2
  with use_sebp(active_mask=np.asarray(mask2), backend="xla") as second:
    got = grad(params, x2, mask2)
  assert second.shared_index == ["Dense_0", "Dense_1"] and len(traces) == 3
  assert_every_gradient_close(got, _dense_mlp_grads(params, x2, mask2))
  # The first context again: its program, no trace, and its trace's report.
  with use_sebp(active_mask=np.asarray(mask), backend="xla") as again:
    got = grad(params, x, mask)
  assert len(traces) == 3 and again == first
  assert_every_gradient_close(got, _dense_mlp_grads(params, x, mask))


def test_contexts_of_equal_looking_options_run_their_own_programs():
  """A jitted gradient traced under top_n=1 (one row) is not the program of top_n=1.0 (every
  row), though 1 == 1.0; nor is an exclude pattern's program that of the pattern with a flag
  (re.IGNORECASE) matching other layers."""
  import re
  params, x, mask = _mlp_problem(41, [3, 5, 2, 4])
  grad = jax.jit(jax.grad(lambda p: PlainMLP().apply(p, x, mask)))
  want = _dense_mlp_grads(params, x, mask)
  with use_sebp(top_n=1, overflow="drop", backend="xla"):
    one_row = grad(params)
  assert not np.allclose(one_row["params"]["Dense_0"]["kernel"],
                         want["params"]["Dense_0"]["kernel"])
  with use_sebp(top_n=1.0, overflow="drop", backend="xla") as every_row:
    assert_every_gradient_close(grad(params), want)
  assert every_row.swapped == ["Dense_0", "Dense_1"]
  with use_sebp(top_n=1.0, backend="xla", exclude=re.compile("DENSE_1", re.I)) as flagged:
    grad(params)
  with use_sebp(top_n=1.0, backend="xla", exclude="DENSE_1") as plain:
    grad(params)
  assert flagged.swapped == ["Dense_0"] and plain.swapped == ["Dense_0", "Dense_1"]


def test_a_context_entered_again_starts_afresh():
  class OneLayer(nn.Module):
    @nn.compact
    def __call__(self, x):
      return jnp.sum(nn.Dense(2, name="only")(x))

  params, x, mask = _mlp_problem(42, [3, 5, 2, 4])
  one_params = OneLayer().init(jax.random.key(1), x)
  context = use_sebp(top_n=1.0, backend="xla")
  with context as first:
    jax.grad(lambda p: PlainMLP().apply(p, x, mask))(params)
  with context as second:
    jax.grad(lambda p: OneLayer().apply(p, x))(one_params)
  assert first.swapped == ["Dense_0", "Dense_1"] and second.swapped == ["only"]
  assert second is not first


def test_lm_head_false_keeps_the_head_dense_beside_an_exclude_of_ones_own():
  class LM(nn.Module):
    @nn.compact
    def __call__(self, ids):
      return nn.Dense(50, name="lm_head")(nn.Dense(8, name="mlp")(nn.Embed(50, 8)(ids)))

  ids = jnp.asarray(np.random.default_rng(43).integers(0, 50, (2, 6)), jnp.int32)
  params = LM().init(jax.random.key(0), ids)
  with use_sebp(lm_head=False, exclude="classifier") as report:
    LM().apply(params, ids)
  assert report.swapped == ["mlp"]
  assert report.skipped["lm_head"] == "a language-model head (lm_head=False)"
  with use_sebp(lm_head=True, exclude="classifier") as report:
    LM().apply(params, ids)
  assert report.swapped == ["mlp", "lm_head"]


def test_a_packed_head_reads_weights_boxed_with_their_partitioning(tiny_llama):
  """An LM head whose kernel carries nn.with_partitioning's metadata runs on the packed rows
  as a plain one does."""
  from transformers.models.llama.modeling_flax_llama import FlaxLlamaModule
  from sebp_jax.losses import masked_causal_lm_loss

  config = tiny_llama.config

  class LM(nn.Module):
    @nn.compact
    def __call__(self, ids, mask):
      positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
      hidden = FlaxLlamaModule(config, name="model")(ids, mask, positions)[0]
      return nn.Dense(config.vocab_size, use_bias=False, name="lm_head",
                      kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                       (None, "vocab")))(hidden)

  ids, mask = _padded_batch(np.random.default_rng(44), 2, 12, config.vocab_size)
  params = LM().init(jax.random.key(0), ids, mask)
  assert isinstance(params["params"]["lm_head"]["kernel"], nn.Partitioned)

  def loss(params, packed):
    options = dict(top_n=int(mask.sum()), active_mask=mask, packed=True) if packed else None
    with use_sebp(**options) if packed else nullcontext():
      logits = LM().apply(params, ids, mask)
    return masked_causal_lm_loss(logits, ids, mask,
                                 capacity=int(mask.sum()) if packed else None)

  assert_every_gradient_close(jax.grad(loss)(params, True), jax.grad(loss)(params, False))


def test_a_dense_after_a_packed_region_that_the_users_exclude_names_runs_as_it_is():
  """A per-token Dense after the packed encoder, on features of its own (not the encoder's
  outputs), read at every position: packed, its forward would change at padding; named in
  exclude, it runs as it is and the gradients are the dense ones."""
  from transformers.models.bert.modeling_flax_bert import FlaxBertModule

  config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=16)

  class Tagger(nn.Module):
    @nn.compact
    def __call__(self, ids, mask, features):
      positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
      hidden = FlaxBertModule(config, add_pooling_layer=False, name="bert")(
          ids, mask, jnp.zeros_like(ids), positions, None)[0]
      return jnp.sum(hidden[:, 0]) + jnp.sum(jnp.tanh(nn.Dense(4, name="side_proj")(features)))

  rng = np.random.default_rng(45)
  ids, mask = _padded_batch(rng, 2, 8, 50)
  features = jnp.asarray(rng.standard_normal((2, 8, 3)), jnp.float32)
  params = Tagger().init(jax.random.key(0), ids, mask, features)

  reports = []

  def loss(params):
    with use_sebp(top_n=int(mask.sum()), active_mask=mask, packed=True,
                  exclude="side_proj") as report:
      reports.append(report)
      return Tagger().apply(params, ids, mask, features)

  got, got_grads = jax.value_and_grad(loss)(params)
  want, want_grads = jax.value_and_grad(lambda p: Tagger().apply(p, ids, mask, features))(params)
  assert reports[0].packed == ["bert/encoder"]
  np.testing.assert_allclose(got, want, rtol=1e-5)
  assert_every_gradient_close(got_grads, want_grads)
