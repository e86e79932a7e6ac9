"""The examples' command lines and shared helpers (the runs themselves are the README's demo)."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples import finetune_bert_sst2, finetune_llama, finetune_llama_nnx
from examples.common import (fit, max_loss_difference, speedups, strict_json,
                             time_forward_backward)
from examples.datasets import DATA_DIR, SST2_FILES, WIKITEXT2_FILES

EXAMPLES = [finetune_bert_sst2, finetune_llama, finetune_llama_nnx]


def test_llama_example_lm_head_flag():
  assert finetune_llama.parse_args([]).lm_head
  assert not finetune_llama.parse_args(["--no-lm-head"]).lm_head


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda example: example.__name__)
def test_packing_is_a_flag(example):
  """The Linen examples pack unless told not to; the NNX one packs when told to (its batches
  are full enough that the packed attention costs more than the padding it saves)."""
  assert example.parse_args([]).packed == (example is not finetune_llama_nnx)
  assert not example.parse_args(["--no-packed"]).packed
  assert example.parse_args(["--packed"]).packed


def test_counts_must_be_positive(capsys):
  with pytest.raises(SystemExit):
    finetune_llama.parse_args(["--steps", "0"])
  assert "--steps must be positive, got 0" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    finetune_llama.parse_args(["--timing-repeats", "-1"])
  assert "--timing-repeats must be 0 or more, got -1" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    finetune_llama.parse_args(["--seed", "-1"])
  assert "--seed must be 0 or more, got -1" in capsys.readouterr().err
  assert finetune_llama.parse_args(["--timing-repeats", "0"]).timing_repeats == 0
  # More positions than the model has: a usage error, not NaN losses and a traceback.
  for example, longest in ((finetune_bert_sst2, 512), (finetune_llama, 2048)):
    with pytest.raises(SystemExit):
      example.parse_args(["--max-length", str(longest + 1)])
    assert (f"--max-length {longest + 1}: the model takes at most {longest} positions"
            in capsys.readouterr().err)
    assert example.parse_args(["--max-length", str(longest)]).max_length == longest


def test_paths_are_checked_before_a_model_loads(tmp_path, capsys):
  """A --data-dir without the run's files and an --out under a file are usage errors at
  once, not a traceback after the model has loaded; an --out yet to be made is fine."""
  from examples import profile_sparsity
  for parse, missing in ((finetune_bert_sst2.parse_args, "sst2/train.tsv"),
                         (finetune_llama.parse_args, "wikitext2/valid.txt"),
                         (finetune_llama_nnx.parse_args, "wikitext2/valid.txt"),
                         (profile_sparsity.parse_args, "sst2/train.tsv")):
    with pytest.raises(SystemExit):
      parse(["--data-dir", str(tmp_path)])
    assert f"--data-dir {tmp_path}: no {missing} there" in capsys.readouterr().err
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  with pytest.raises(SystemExit):
    finetune_llama.parse_args(["--out", str(a_file / "run")])
  assert f"--out {a_file / 'run'}: {a_file} is not a folder to write in" in (
      capsys.readouterr().err)
  assert finetune_llama.parse_args(["--out", str(tmp_path / "new" / "run")]).out == (
      tmp_path / "new" / "run")


def test_more_bert_steps_than_sst2_holds_is_a_usage_error():
  """The carried SST-2 training set makes 60,614 // 32 batches: more --steps stop with a
  message (they trained fewer steps than asked, on a schedule made for the steps asked)."""
  from examples.pretrained import load_minilm_tokenizer
  args = finetune_bert_sst2.parse_args(["--steps", "1895"])
  with pytest.raises(SystemExit, match="SST-2 has only 1894 batches of 32 sentences"):
    finetune_bert_sst2.load_train_batches(load_minilm_tokenizer(), args)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda example: example.__name__)
def test_help_describes_every_option_with_one_default(example, capsys):
  with pytest.raises(SystemExit):
    example.parse_args(["--help"])
  out = capsys.readouterr().out
  assert out.startswith(f"usage: python -m {example.__name__} ")
  entries = re.split(r"\n  (?=-)", out.split("\noptions:\n")[1])[1:]
  assert len(entries) >= 10
  for entry in entries:
    invocation, _, help_text = entry.partition("  ")
    help_text = " ".join(help_text.split())
    assert help_text.count("default") <= 1, entry
    assert re.sub(r"\(default: [^)]*\)$", "", help_text).strip(), f"no help for {invocation}"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda example: example.__name__)
def test_data_dir_defaults_to_the_carried_data(example, tmp_path):
  assert example.parse_args([]).data_dir == DATA_DIR
  for name in SST2_FILES + WIKITEXT2_FILES:  # Another folder holding the files.
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text("")
  assert example.parse_args(["--data-dir", str(tmp_path)]).data_dir == tmp_path


def test_max_loss_difference(capsys):
  assert max_loss_difference({"dense": [1.0, 2.0, 3.0], "sebp": [1.0, 2.5, 2.75]}) == 0.5
  assert "largest per-step loss difference, dense vs SEBP: 5.00e-01" in capsys.readouterr().out
  # A run gone NaN after its first step is not "no difference".
  assert np.isnan(max_loss_difference({"dense": [2.0, 1.9, 1.8], "sebp": [2.0, np.nan, np.nan]}))


def test_float_options_are_checked(capsys):
  for argv, message in [(["--learning-rate=-3e-5"], "--learning-rate must be positive"),
                        (["--learning-rate", "inf"], "--learning-rate must be positive"),
                        (["--weight-decay", "nan"], "--weight-decay must be 0 or more"),
                        (["--weight-decay=-0.1"], "--weight-decay must be 0 or more")]:
    with pytest.raises(SystemExit):
      finetune_llama.parse_args(argv)
    assert message in capsys.readouterr().err
  assert finetune_llama.parse_args(["--weight-decay", "0"]).weight_decay == 0


def test_the_nnx_example_refuses_a_row_log_of_no_layer_when_packed(capsys):
  """Packed, the NNX example runs no layer on SEBP: its row log would be empty."""
  with pytest.raises(SystemExit):
    finetune_llama_nnx.parse_args(["--row-log", "--packed"])
  assert "leave out --packed or --row-log" in capsys.readouterr().err
  assert finetune_llama_nnx.parse_args(["--row-log"]).row_log
  assert finetune_llama.parse_args(["--row-log", "--packed"]).row_log  # Linen: the head logs.


def test_a_one_step_bert_run_has_a_learning_rate_schedule():
  """optax's cosine decay needs steps past the warm-up: a run of one step is the warm-up's."""
  schedule = finetune_bert_sst2.learning_rate_schedule(finetune_bert_sst2.parse_args(
      ["--steps", "1", "--learning-rate", "1e-4"]))
  assert schedule(0) == 0 and schedule(1) == pytest.approx(1e-4)


def test_the_timing_runs_the_whole_batch_at_a_capacity_that_holds_it():
  """Trained on 4 devices, each at its share's capacity, the example times SEBP on the whole
  first batch on one device: at a capacity that holds all its real tokens."""
  from examples.common import run_capacities, timed_capacity
  rng = np.random.default_rng(0)
  masks = [(np.arange(64)[None] < rng.integers(20, 64, (8, 1))).astype(np.int32)
           for _ in range(3)]
  batches = [{"attention_mask": mask} for mask in masks]
  per_device = run_capacities(batches, num_shards=4)
  assert per_device[0] < masks[0].sum()
  assert timed_capacity(per_device, batches[0]) >= masks[0].sum()
  one_device = run_capacities(batches)
  assert timed_capacity(one_device, batches[0]) == one_device[0]


def test_a_summary_is_strict_json_with_non_finite_numbers_as_null():
  summary = {"losses": {"dense": [1.5, 1.25], "sebp": [1.5, float("nan")]},
             "max_loss_difference": np.float32("nan"), "range": (np.inf, 2.0), "steps": 2,
             "name": "bert"}
  text = json.dumps(strict_json(summary), allow_nan=False)
  assert json.loads(text) == {"losses": {"dense": [1.5, 1.25], "sebp": [1.5, None]},
                              "max_loss_difference": None, "range": [None, 2.0], "steps": 2,
                              "name": "bert"}


def test_a_loss_timed_as_nan_raises():
  loss_fns = {"dense": lambda params, batch: jnp.sum(batch["x"] @ params),
              "sebp": lambda params, batch: jnp.sum(batch["x"] @ params) * jnp.nan}
  with pytest.raises(ValueError, match="the sebp loss timed is nan, not finite"):
    time_forward_backward(loss_fns, jnp.ones((4, 2)), {"x": jnp.ones((3, 4))}, repeats=1)


def test_time_forward_backward_reports_milliseconds_of_interleaved_rounds(capsys):
  loss_fns = {"dense": lambda params, batch: jnp.sum((batch["x"] @ params) ** 2),
              "sebp": lambda params, batch: jnp.sum(batch["x"] @ params)}
  timings = time_forward_backward(loss_fns, jnp.ones((4, 2)), {"x": jnp.ones((3, 4))}, repeats=3)
  assert set(timings) == {"dense", "sebp"}
  for timing in timings.values():
    assert set(timing) == {"forward_ms", "forward_backward_ms", "backward_ms", "rounds"}
    for stage, rounds in timing["rounds"].items():
      assert len(rounds) == 3 and min(rounds) > 0
      assert timing[f"{stage}_ms"] == np.median(rounds)
  ratios = speedups(timings, 3, kept_fraction=0.9)
  for stage in ("backward", "forward_backward"):
    per_round = np.divide(timings["dense"]["rounds"][stage], timings["sebp"]["rounds"][stage])
    assert ratios[stage] == np.median(per_round)
    assert ratios[f"{stage}_range"] == [per_round.min(), per_round.max()]
  out = capsys.readouterr().out
  assert "median of 3 interleaved rounds" in out
  assert ("keeps 90% of the rows" in out) == (ratios["backward"] < 1)


def test_the_whole_sst2_training_set_takes_at_most_four_capacities():
  """Every batch of an epoch of SST-2's training sentences (32 a batch, padded to 128) in one of
  four capacities, each holding its real tokens: the example's step compiles at most four
  times."""
  from examples.datasets import batches, encode_fixed_length, load_sst2
  from examples.pretrained import load_minilm_tokenizer
  from examples.common import run_capacities
  sentences = [sentence for sentence, _ in load_sst2("train")]
  arrays = encode_fixed_length(load_minilm_tokenizer(), sentences, 128)
  train_batches = list(batches(arrays, 32))
  assert len(sentences) > 60000 and len(train_batches) == len(sentences) // 32
  capacities = run_capacities(train_batches)
  assert len(set(capacities)) <= 4
  for batch, capacity in zip(train_batches, capacities):
    assert int(batch["attention_mask"].sum()) <= capacity


def _record_fit_options(example, monkeypatch) -> list:
  """The ``compiler_options`` each of ``example``'s training runs passes to ``fit``."""
  seen = []

  def recording_fit(*args, **kwargs):
    seen.append(kwargs["compiler_options"])
    return fit(*args, **kwargs)
  monkeypatch.setattr(example, "fit", recording_fit)
  return seen


@pytest.mark.slow
def test_the_bert_example_shows_the_row_log(tmp_path, capsys, monkeypatch):
  """A short unpacked run with ``--row-log``: every encoder layer reports, once per training
  step, the batch's real tokens as its active rows, all kept. A 2-layer BERT of MiniLM's
  vocabulary stands in for the real model (test_real_models loads that)."""
  from transformers import BertConfig, FlaxBertForSequenceClassification

  from examples.pretrained import load_minilm_tokenizer
  tokenizer = load_minilm_tokenizer()
  model = FlaxBertForSequenceClassification(BertConfig(
      vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
      intermediate_size=64, num_labels=2), seed=0)
  monkeypatch.setattr(finetune_bert_sst2, "load_bert_classifier",
                      lambda num_labels, seed: (model, model.params, tokenizer))
  fit_options = _record_fit_options(finetune_bert_sst2, monkeypatch)
  summary = finetune_bert_sst2.main([
      "--steps", "2", "--batch-size", "4", "--max-length", "32", "--dev-examples", "8",
      "--timing-repeats", "1", "--no-packed", "--row-log", "--out", str(tmp_path),
      "--compiler-option", "xla_gpu_reduce_scatter_combine_threshold_bytes=268435456"])
  # The option reaches both runs' training steps (XLA's CPU backend compiles as without it).
  combine = {"xla_gpu_reduce_scatter_combine_threshold_bytes": 256 << 20}
  assert fit_options == [combine, combine] and summary["compiler_options"] == combine
  assert len(summary["timings"]["sebp"]["rounds"]["backward"]) == 1
  assert summary["gradient_speedup"] > 0
  lines = summary["row_log"].splitlines()
  assert "SEBP row log" in capsys.readouterr().out
  layers = [line for line in lines[1:] if line.startswith("bert/encoder/layer/")]
  assert len(layers) == 2 * 6  # 6 Dense layers in each encoder layer
  for line in layers:
    steps, rows = map(int, line.split()[1:3])
    assert (steps, rows) == (2, 4 * 32)
    assert line.split()[-1] == "0"  # nothing dropped


def test_the_nnx_example_trains_dense_and_sebp_alike(tmp_path, monkeypatch):
  """A short run of the NNX fine-tune, on a 2-layer Tunix Llama of SmolLM2's vocabulary (the
  real model is loaded and checked in test_real_models): both runs from the same weights, the
  same losses (every dropped row of dY is zero), the row log, the summary and plot written."""
  from examples.pretrained import load_smollm2_tokenizer
  from tests.test_nnx_tunix import _tiny_llama
  tokenizer = load_smollm2_tokenizer()
  model = _tiny_llama(weight_tying=True, remat="NONE", vocab_size=len(tokenizer))
  monkeypatch.setattr(finetune_llama_nnx, "load_smollm2_nnx", lambda: (model, tokenizer))
  summary = finetune_llama_nnx.main([
      "--steps", "2", "--batch-size", "2", "--max-length", "32", "--timing-repeats", "0",
      "--row-log", "--out", str(tmp_path)])
  # --timing-repeats 0: no timing (the row-log BERT run above times its runs).
  assert summary["timings"] is None and summary["gradient_speedup"] is None
  assert summary["max_loss_difference"] < 1e-4 and not summary["packed"]
  assert len(summary["losses"]["sebp"]) == 2
  assert summary["losses"]["dense"][0] == pytest.approx(summary["losses"]["sebp"][0], rel=1e-5)
  # One compile for each capacity the run's batches took, one for dense.
  assert summary["sebp_compiles"] == len(summary["capacities"]) and summary["dense_compiles"] == 1
  layers = [line for line in summary["row_log"].splitlines() if line.startswith("layers/")]
  assert len(layers) == 2 * 7
  assert (tmp_path / "summary.json").is_file() and (tmp_path / "loss_curves.png").is_file()


def test_the_nnx_examples_losses_dense_sebp_and_packed_agree():
  """The NNX example's loss (on a tiny Tunix Llama): SEBP and packed give the dense value and
  gradient."""
  from flax import nnx

  from tests.test_nnx_tunix import _batch, _tiny_llama
  model = _tiny_llama(weight_tying=True, remat="NONE")
  ids, mask = _batch(5)
  batch = {"input_ids": ids, "attention_mask": mask}
  top_n = int(mask.sum())

  def loss_and_grads(*args):
    loss, grads = nnx.jit(nnx.value_and_grad(
        lambda model, batch: finetune_llama_nnx.loss_of(model, batch, *args)))(model, batch)
    return float(loss), nnx.state(grads, nnx.Param)

  want_loss, want = loss_and_grads(None)
  for args in ((top_n, False), (top_n, True)):
    loss, grads = loss_and_grads(*args)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
      np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)


def test_the_llama_example_fills_a_token_budget_with_one_compile(tmp_path, monkeypatch):
  """--token-budget: each batch as many paragraphs as fit the budget (rows left empty), one
  capacity for every batch: the step compiles once, and packed equals dense. A tiny FlaxLlama
  of SmolLM2's vocabulary stands in for the real model (test_real_models loads that)."""
  from transformers import FlaxLlamaForCausalLM, LlamaConfig

  from examples.pretrained import load_smollm2_tokenizer
  tokenizer = load_smollm2_tokenizer()
  model = FlaxLlamaForCausalLM(LlamaConfig(
      vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
      num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64), seed=0)
  monkeypatch.setattr(finetune_llama, "load_smollm2", lambda: (model, model.params, tokenizer))
  summary = finetune_llama.main([
      "--steps", "3", "--batch-size", "4", "--max-length", "64", "--token-budget", "120",
      "--timing-repeats", "0", "--out", str(tmp_path)])
  assert summary["capacities"] == [120] and summary["sebp_compiles"] == 1
  summary = finetune_llama.main([
      "--steps", "1", "--batch-size", "2", "--max-length", "32", "--token-budget", "120",
      "--timing-repeats", "0", "--out", str(tmp_path)])
  assert summary["capacities"] == [64]  # No more slots than the batch's 2 x 32 tokens.
  assert summary["max_loss_difference"] < 1e-5
  args = finetune_llama.parse_args(["--batch-size", "4", "--max-length", "64",
                                    "--token-budget", "120", "--steps", "20"])
  train_batches = finetune_llama.load_train_batches(tokenizer, args)
  assert len(train_batches) == 20
  for batch in train_batches:
    assert batch["input_ids"].shape == (4, 64) and 0 < batch["attention_mask"].sum() <= 120
  # A budget under the longest paragraph is a usage error naming the flag, not a traceback.
  args = finetune_llama.parse_args(["--max-length", "64", "--token-budget", "20"])
  with pytest.raises(SystemExit, match="--token-budget 20 holds fewer tokens than the longest"):
    finetune_llama.load_train_batches(tokenizer, args)


def test_the_llama_example_trains_on_several_devices_as_on_one(tmp_path, monkeypatch):
  """--devices 4 (the test machine's host devices): FSDP, each device packing its own rows
  (or, --no-packed, selecting them for SEBP) at its own capacity; the losses are one
  device's, dense and SEBP alike. A tiny FlaxLlama of SmolLM2's vocabulary stands in for the
  real model."""
  from transformers import FlaxLlamaForCausalLM, LlamaConfig

  from examples.pretrained import load_smollm2_tokenizer
  tokenizer = load_smollm2_tokenizer()
  model = FlaxLlamaForCausalLM(LlamaConfig(
      vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
      num_key_value_heads=1, intermediate_size=32, max_position_embeddings=64), seed=3)
  monkeypatch.setattr(finetune_llama, "load_smollm2", lambda: (model, model.params, tokenizer))
  fit_options = _record_fit_options(finetune_llama, monkeypatch)
  run = lambda *flags: finetune_llama.main([
      "--steps", "3", "--batch-size", "4", "--max-length", "64", *flags,
      "--timing-repeats", "0", "--out", str(tmp_path / "-".join(flags))])
  # The README's option for 2 GPUs: XLA's CPU backend compiles with it as without.
  combine = {"xla_gpu_reduce_scatter_combine_threshold_bytes": 256 << 20}
  options = [f"--compiler-option={name}={value}" for name, value in combine.items()]
  # One device packed; both ways on four (one device's SEBP losses are the dense ones either
  # way, so one run of one device serves both; the two runs on four compile one dense step).
  one = run("--packed", "--devices", "1")
  fours = [run(packing, *options, "--devices", "4") for packing in ("--packed", "--no-packed")]
  assert [run["devices"] for run in (one, *fours)] == [1, 4, 4]
  assert [run["compiler_options"] for run in (one, *fours)] == [{}, combine, combine]
  assert fit_options == [{}, {}] + [combine] * 4  # Each run's dense and SEBP steps.
  for four in fours:
    for mode in ("dense", "sebp"):
      np.testing.assert_allclose(four["losses"][mode], one["losses"][mode], rtol=2e-5)
    assert four["max_loss_difference"] < 1e-5
    # Once per capacity: the optimizer's state starts as the step returns it.
    assert four["dense_compiles"] == 1
    assert four["sebp_compiles"] == len(set(four["capacities"]))
    # A device's capacity holds its fullest shard of 1 row, not the batch's 4.
    assert max(four["capacities"]) < max(one["capacities"])


@pytest.mark.parametrize("argv,message", [
    (["--devices", "8"], "--devices 8: this machine has 4"),
    (["--devices", "3"], "--batch-size 4 does not split over --devices 3"),
    (["--devices", "2", "--row-log"], "--row-log runs on one device"),
    (["--compiler-option", "xla_gpu_reduce_scatter_combine_threshold_bytes"],
     "expected NAME=VALUE"),
    (["--compiler-option", "xla_no_such_option=1"], "No such compile option: 'xla_no_such_option'"),
    (["--compiler-option", "xla_gpu_reduce_scatter_combine_threshold_bytes=many"],
     "'many' is not a valid int64 value"),
    (["--compiler-option", "xla_a=1", "--compiler-option", "xla_a=2"],
     "--compiler-option xla_a given twice"),
], ids=["too_many", "uneven", "row_log", "no_value", "misspelt_option", "bad_value", "twice"])
def test_devices_errors_name_the_flags(argv, message, capsys):
  with pytest.raises(SystemExit):
    finetune_llama.parse_args(["--batch-size", "4", *argv])
  assert message in capsys.readouterr().err


def test_the_training_step_compiles_with_the_options_given():
  """fit's step takes the XLA options (a misspelt one fails its compile) and trains with
  valid ones as without: a least-squares fit, one step of SGD against the hand-derived
  update."""
  rng = np.random.default_rng(4)
  x, y, w = rng.normal(size=(8, 3)), rng.normal(size=8), rng.normal(size=3)
  batches = [{"x": jnp.asarray(x, jnp.float32), "y": jnp.asarray(y, jnp.float32)}]
  loss_fn = lambda params, batch, capacity: jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)
  run = lambda options: fit(loss_fn, {"w": jnp.asarray(w, jnp.float32)}, batches,
                            optax.sgd(0.1), "sgd", [None], compiler_options=options)
  with pytest.raises(jax.errors.JaxRuntimeError, match="xla_no_such_option"):
    run({"xla_no_such_option": 1})
  params, losses, compiles = run({"xla_gpu_reduce_scatter_combine_threshold_bytes": 256 << 20})
  expected = w - 0.1 * 2 * x.T @ (x @ w - y) / len(y)
  np.testing.assert_allclose(params["w"], expected, rtol=1e-5)
  np.testing.assert_allclose(losses, [np.mean((x @ w - y) ** 2)], rtol=1e-5)
  assert compiles == 1
