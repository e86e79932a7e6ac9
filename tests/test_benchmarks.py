"""The benchmark modules run end to end at toy sizes (CPU): their records are complete.

No timing is asserted: speed claims live in benchmarks/RESULTS.md, measured on a GPU.
"""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import (attention, balance, collectives, harness, layer, model, profile_model,
                        selection, tune_blocks)
from sebp_jax.packing import token_capacity
from sebp_jax.sharding import shard_row_counts
from tests.model_testing import assert_tables_cross_as_rows


def test_bound_mode_writes_dx_and_skips_weight_gradients():
  """The bound keeps the forward, returns zero dX and no weight gradient for swapped layers."""
  setup = model.setup_for("llama", tiny=True)
  llama = model.build_model("llama", tiny=True, dtype=jnp.float32)
  batch = model.make_batch("llama", llama, setup, seed=0)
  top_n = int(batch["attention_mask"].sum())
  dense = model.make_loss("llama", llama, "dense", top_n, "auto")
  bound = model.make_loss("llama", llama, "bound", top_n, "auto")
  # The bound's loss and gradient in one compile.
  bound_loss, grads = jax.jit(jax.value_and_grad(bound))(llama.params, batch)
  assert np.isclose(jax.jit(dense)(llama.params, batch), bound_loss)
  assert not np.any(grads["model"]["layers"]["0"]["mlp"]["up_proj"]["kernel"])
  # Not a linear layer: its gradient flows through the zero dX of the layers above, but the
  # final norm sits after them and keeps a real gradient.
  assert np.any(grads["model"]["norm"]["weight"])
  assert np.any(grads["lm_head"]["kernel"])
  # With the LM head in the bound, its dX is the zero one: nothing reaches the final norm.
  bound_lm_head = model.make_loss("llama", llama, "bound_lm_head", top_n, "auto")
  grads = jax.jit(jax.grad(bound_lm_head))(llama.params, batch)
  assert not np.any(grads["lm_head"]["kernel"]) and not np.any(grads["model"]["norm"]["weight"])


@pytest.mark.parametrize("kind", ["bert", "albert", "distilbert", "roformer", "llama", "gpt2",
                                  "gpt_neo", "opt", "xglm", "bloom"])
def test_packed_and_fast_attention_modes_give_the_dense_gradient(kind):
  """The baselines, packing and the exact capacities the benchmark times compute the dense
  loss and gradient."""
  setup = model.setup_for(kind, tiny=True)
  net = model.build_model(kind, tiny=True, dtype=jnp.float32)
  batch = model.make_batch(kind, net, setup, seed=1)
  top_n = int(batch["attention_mask"].sum())
  dense = jax.jit(jax.value_and_grad(model.make_loss(kind, net, "dense", top_n, "auto")))
  want_loss, want = dense(net.params, batch)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
  for mode in ("dense_fast_attention", "sebp_packed", "sebp_auto", "sebp_auto_host",
               "sebp_exact", *(("sebp_packed_chunked_head",) if setup.has_lm_head else ())):
    loss_fn = model.make_loss(kind, net, mode, top_n, "auto",
                              capacity=token_capacity(batch["attention_mask"], 16),
                              host_mask=batch["attention_mask"])
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(net.params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
      np.testing.assert_allclose(got, expected, atol=2e-5 * scale)


def test_nnx_modes_give_the_dense_gradient_and_the_bound_drops_the_weight_gradients():
  """The NNX Llama's SEBP modes compute its dense loss and gradient; its bound keeps the
  forward and gives the swapped layers no gradient."""
  setup = model.setup_for("llama_nnx", tiny=True)
  net = model.build_model("llama_nnx", tiny=True, dtype=jnp.float32)
  batch = model.make_batch("llama_nnx", net, setup, seed=2)
  top_n = int(batch["attention_mask"].sum())
  dense = model.make_loss("llama_nnx", net, "dense", top_n, "auto")
  want_loss, want = jax.jit(jax.value_and_grad(dense))(net.params, batch)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
  for mode in ("sebp_shared", "sebp_exact", "sebp_auto_host", "sebp_packed"):
    loss_fn = model.make_loss("llama_nnx", net, mode, top_n, "xla",
                              capacity=token_capacity(batch["attention_mask"], 16),
                              host_mask=batch["attention_mask"])
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(net.params, batch)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-2)  # bfloat16 compute
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
      np.testing.assert_allclose(got, expected, atol=2e-2 * scale)
  bound = model.make_loss("llama_nnx", net, "bound", top_n, "auto")
  bound_loss, grads = jax.jit(jax.value_and_grad(bound))(net.params, batch)
  assert np.isclose(bound_loss, want_loss)
  assert not np.any(grads["layers"][0]["mlp"]["up_proj"]["kernel"][...])
  assert not np.any(grads["layers"][1]["attn"]["q_proj"]["w"][...])
  assert np.any(grads["final_norm"]["w"][...])


@pytest.mark.parametrize("kind", ["llama", "llama_nnx"])
def test_data_parallel_modes_give_the_one_device_gradient(kind):
  """The benchmark's data-parallel SEBP modes, the batch split over 2 devices (each selecting
  its own rows at the fullest shard's real tokens, or packing them), give the dense gradient
  of one device, transformers' Linen Llama and Tunix's NNX one alike."""
  setup = model.setup_for(kind, tiny=True)
  net = model.build_model(kind, tiny=True, dtype=jnp.float32)
  batch = model.make_batch(kind, net, setup, seed=3, shards=2)
  top_n = int(shard_row_counts(batch["attention_mask"], 2).max())
  assert top_n < batch["attention_mask"].sum()
  want_loss, want = jax.jit(jax.value_and_grad(model.make_loss(kind, net, "dense", top_n,
                                                               "xla")))(net.params, batch)
  scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(want))
  mesh = harness.data_parallel_mesh(2)
  split = jax.device_put(batch, NamedSharding(mesh, P("data")))
  # The NNX Llama's slower to compile: its modes apart from Linen's are tested elsewhere.
  modes = (("sebp_shared", "sebp_packed") if setup.nnx
           else ("sebp_shared", "sebp_auto_host", "sebp_layer_auto", "sebp_packed"))
  capacity = token_capacity(batch["attention_mask"], 16, num_shards=2)
  for mode in modes:
    loss_fn = model.make_loss(kind, net, mode, top_n, "xla", capacity=capacity,
                              host_mask=batch["attention_mask"],
                              sharding=dict(batch_axes="data", mesh=mesh))
    loss, grads = jax.jit(jax.value_and_grad(loss_fn))(net.params, split)
    # The NNX Llama computes in bfloat16, packed in another order of sums (its float32
    # exactness per shard: tests/test_packing_sharded.py).
    tolerance = (5e-2 if mode == "sebp_packed" else 2e-2) if setup.nnx else 2e-5
    np.testing.assert_allclose(loss, want_loss, rtol=tolerance)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want)):
      np.testing.assert_allclose(got, expected, atol=tolerance * scale)


def _assert_tables_cross_as_rows(sebp: dict, dense: dict) -> None:
  """The tiny BERT's SEBP step on 2 devices (records of benchmarks.model): the dense step's
  collectives, but for the word and position tables (float32 sums on CPUs), whose gradients
  cross as each device's kept rows."""
  assert_tables_cross_as_rows((sebp["collectives"], sebp["collective_bytes"]),
                              (dense["collectives"], dense["collective_bytes"]),
                              table_bytes=(30522 + 512) * 64 * 4)


@pytest.mark.slow
def test_model_benchmark_records_one_and_two_devices(tmp_path):
  """Every record written and complete, on one device and on two (--devices 2 --fsdp: the
  weight matrices split over both; the step only), the second run measured against the
  first's one-device records in the same --out file. The LM-head modes run only for a model
  with a head (BERT has none); SEBP's step, packed or not, gathers and reduces as the dense
  one does, but for the embedding tables' gradients (:func:`_assert_tables_cross_as_rows`)."""
  out = tmp_path / "model.jsonl"
  modes = ["dense", "sebp_shared", "sebp_packed"]
  common = ["--tiny", "--model", "bert", "--repeats", "1", "--rounds", "2", "--out", str(out)]
  one = model.main(["--modes", ",".join(modes + ["sebp_lm_head"]), "--devices", "1", *common])
  two = model.main(["--modes", ",".join(modes), "--devices", "2", "--fsdp", "--stages", "step",
                    *common])
  assert [(r["devices"], r["mode"]) for r in one + two] == (
      [(1, m) for m in modes] + [(2, m) for m in modes])
  assert len(out.read_text().splitlines()) == len(one + two)
  for row in one + two:
    assert row["step_ms"] > 0
    # Interleaved rounds: the medians of the rounds, the ratios' spread over them.
    assert all(len(ms) == 2 for ms in row["rounds_ms"].values())
    assert row["step_ms"] == pytest.approx(np.median(row["rounds_ms"]["step_ms"]))
    low, high = row["step_speedup_vs_dense_range"]
    assert low <= row["step_speedup_vs_dense"] <= high
    assert 0 < row["real_tokens"] < row["rows"]
    assert row["real_tokens_per_s"] == pytest.approx(row["real_tokens"] / row["step_ms"] * 1e3)
    assert row["num_params"] > 0 and row["real_token_mfu"] is None  # no peak known for CPUs
  for row in one:
    assert math.isfinite(row["grad_speedup_vs_dense"])
    # backward = grad - forward, a difference of timings: on a loaded CPU it can be < 0.
    assert math.isfinite(row["backward_ms"]) and math.isfinite(row["backward_speedup_vs_dense"])
    assert "scaling_efficiency" not in row
  for first, row in zip(one, two):
    assert row["batch_size"] == 4 and "forward_ms" not in row and "grad_ms" not in row
    assert row["scaling_efficiency"] == pytest.approx(first["step_ms"] / row["step_ms"])
    assert row["share_of_one_device_speedup"] == pytest.approx(
        row["step_speedup_vs_dense"] / first["step_speedup_vs_dense"])
  dense, sebp, packed = two
  # FSDP: the weights gathered whole at the step's start, their gradients reduced (XLA's GPU
  # pipeline makes that a reduce-scatter, the CPU's an all-reduce); nothing else crosses.
  assert sebp["fsdp"] and sebp["collectives"]["all-gather"] > 0
  for row in (sebp, packed):
    _assert_tables_cross_as_rows(row, dense)
  assert "all-to-all" not in dense["collectives"]
  assert sebp["top_n"] < sebp["real_tokens"]  # Each shard's own capacity.
  # The packed capacity that ran: the batch's real tokens rounded, each device's on two.
  assert one[2]["capacity"] >= one[2]["real_tokens"] and packed["capacity"] <= 4 * 64 // 2
  assert "capacity" not in sebp
  # A one-device record of another batch (seed) is no baseline.
  (other,) = model.main(["--modes", "dense", "--devices", "2", "--seed", "1", "--stages", "step",
                         *common])
  assert "scaling_efficiency" not in other


def test_a_mode_out_of_memory_is_recorded_and_the_others_run(tmp_path, monkeypatch, capsys):
  mode_loss = model.mode_loss

  def failing(kind, net, mode, *args, **kwargs):
    batch, loss = mode_loss(kind, net, mode, *args, **kwargs)
    if mode != "sebp_shared":
      return batch, loss

    def out_of_memory(params, batch):
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                       "allocate 343.45GiB")
    return batch, out_of_memory

  monkeypatch.setattr(model, "mode_loss", failing)
  out = tmp_path / "model.jsonl"
  rows = model.main(["--tiny", "--model", "bert", "--modes", "dense,sebp_shared,sebp_packed",
                     "--stages", "step", "--repeats", "1", "--rounds", "1", "--out", str(out)])
  assert [r["mode"] for r in rows] == ["sebp_shared", "dense", "sebp_packed"]
  assert rows[0]["error"].startswith("out of memory: RESOURCE_EXHAUSTED")
  assert rows[2]["step_speedup_vs_dense"] > 0
  assert len(out.read_text().splitlines()) == 3
  assert "out of memory" in capsys.readouterr().out


def test_batch_sizes_give_each_modes_best_batch(capsys):
  """--batch-sizes runs each batch size; each mode's best batch is the one of the most real
  tokens a second, its throughput against the fast-attention baseline's own best. With
  --donate the steps run on their own results; every record has the step's host time."""
  rows = model.main(["--tiny", "--model", "bert", "--modes",
                     "longest_dense_fast_attention,sebp_packed", "--batch-sizes", "2,4",
                     "--stages", "step", "--repeats", "1", "--rounds", "2", "--donate"])
  assert sorted((r["batch_size"], r["mode"]) for r in rows) == [
      (2, "longest_dense_fast_attention"), (2, "sebp_packed"),
      (4, "longest_dense_fast_attention"), (4, "sebp_packed")]
  for row in rows:
    assert row["donated"] is True
    # Each repeat's host time is a part of its whole time, so their medians keep the order.
    assert 0 < row["step_dispatch_ms"] <= row["step_ms"]
  best = {b["mode"]: b for b in model.best_batches(rows)}
  for mode, b in best.items():
    mine = [r for r in rows if r["mode"] == mode]
    assert b["real_tokens_per_s"] == max(r["real_tokens_per_s"] for r in mine)
    assert b["batch_sizes"] == [2, 4]
  assert best["longest_dense_fast_attention"]["throughput_vs_longest_fast_attention"] == 1.0
  assert best["sebp_packed"]["throughput_vs_longest_fast_attention"] == pytest.approx(
      best["sebp_packed"]["real_tokens_per_s"]
      / best["longest_dense_fast_attention"]["real_tokens_per_s"])
  out = capsys.readouterr().out
  assert "best batch" in out
  # The table says each row's batch size (a column after the devices).
  lines = out.splitlines()
  batch_column = lines[lines.index(next(l for l in lines if l.startswith("model "))) :]
  assert batch_column[0].split()[3] == "batch"
  assert sorted(int(line.split()[3]) for line in batch_column[2:6]) == [2, 2, 4, 4]


@pytest.mark.slow
def test_nnx_rows_beside_the_linen_ones():
  rows = model.main(["--tiny", "--model", "llama", "--model", "llama_nnx", "--modes",
                     "dense,sebp_lm_head,sebp_packed", "--stages", "step", "--repeats", "1",
                     "--rounds", "1"])
  # The NNX Llama ties its head to the embedding: no head for SEBP to swap.
  assert [(r["model"], r["mode"]) for r in rows] == [
      ("llama", "dense"), ("llama", "sebp_lm_head"), ("llama", "sebp_packed"),
      ("llama_nnx", "dense"), ("llama_nnx", "sebp_packed")]
  assert {r["param_dtype"] for r in rows} == {"float32"}


def test_attention_benchmark_records_the_three_ways(tmp_path, capsys):
  """Packed attention over a mask and in rows, and the padded batch with lengths: a record per
  batch with each way's rounds, medians and ratios to the padded batch."""
  out = tmp_path / "attention.jsonl"
  (row,) = attention.main(["--tiny", "--batches", "3x96", "--rounds", "2", "--out", str(out)])
  assert json.loads(out.read_text()) == row
  for way in ("mask", "rows", "padded"):
    assert len(row[f"{way}_rounds_ms"]) == 2 and row[f"{way}_ms"] > 0
  low, high = row["rows_vs_padded_range"]
  assert low <= row["rows_vs_padded"] <= high
  # The padded way's columns: the longest row rounded up to 64, at most the batch's 96.
  assert row["real_tokens"] <= row["capacity"] and row["longest"] in (64, 96)
  assert "rows/padded" in capsys.readouterr().out


@pytest.mark.parametrize("kind", collectives.KINDS)
def test_collectives_compute_what_they_are_named(kind):
  """Each timed collective over the 4 host devices, on fresh random values: the gathered
  array, each device's rows of the devices' sum, the sum (a whole array's copy sits on every
  device for the last two, so the sum is 4 times it)."""
  mesh = jax.make_mesh((4,), ("devices",))
  fn, in_spec = collectives.collective(kind, mesh)
  whole = np.random.default_rng(7).normal(size=(8, 16)).astype(np.float32)
  got = np.asarray(fn(jax.device_put(whole, NamedSharding(mesh, in_spec))))
  np.testing.assert_allclose(got, whole if kind == "all-gather" else 4 * whole, rtol=1e-6)
  assert collectives.bus_bytes(kind, 1000, 4) == (1500 if kind == "all-reduce" else 750)


def test_collectives_benchmark_records_each_kind_and_size(tmp_path, capsys):
  out = tmp_path / "collectives.jsonl"
  records = collectives.main(["--sizes-mb", "1,2", "--repeats", "2", "--calls-per-repeat", "2",
                              "--out", str(out)])
  assert harness.read_json_lines(out) == records
  assert [(r["kind"], r["whole_bytes"]) for r in records] == [
      (kind, mb * 2**20) for mb in (1, 2) for kind in collectives.KINDS]
  assert all(r["devices"] == 4 and r["ms"] > 0 and r["bus_gb_per_s"] > 0 for r in records)
  assert capsys.readouterr().out.count("all-gather") == 2


def test_layer_benchmark_records(tmp_path, capsys):
  out = tmp_path / "layer.jsonl"
  layer.main(["--shapes", "48x64", "--tokens", "128", "--kept", "20", "--repeats", "1",
              "--input-sets", "1", "--compile-threads", "1", "--out", str(out)])
  records = [json.loads(line) for line in out.read_text().splitlines()]
  variants = {(r["backend"], r["index"]) for r in records}
  assert variants == {("dense", None), ("kept_matmuls", "pregathered"), ("auto", "auto_capacity"),
                      ("pallas_triton", "auto_capacity"),
                      ("pallas_mosaic", "auto_capacity"),
                      *((b, i) for b in ("xla", "pallas", "auto") for i in ("selected", "given"))}
  assert all(r["median_ms"] > 0 and r["roofline_ms"] > 0 for r in records)
  # The table shows both backends' time over the roofline, as recorded.
  header, _, row = capsys.readouterr().out.splitlines()[-3:]
  assert "xla/roof" in header and "pal/roof" in header
  roof = {r["backend"]: r["time_over_roofline"] for r in records if r["index"] == "selected"}
  assert f"{roof['xla']:7.2f}x {roof['pallas']:7.2f}x |" in row


@pytest.mark.slow
def test_tune_blocks_records_every_candidate(tmp_path, capsys):
  out = tmp_path / "tune.jsonl"
  tune_blocks.main(["--shapes", "48x64", "--tokens", "128", "--kept", "20", "--repeats", "1",
                    "--input-sets", "1", "--compile-threads", "1", "--out", str(out)])
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["kernel"] for r in records] == (["dx"] * len(tune_blocks.DX_CANDIDATES)
                                            + ["dw"] * len(tune_blocks.DW_CANDIDATES))
  # Interpreted, every tile fits: each candidate was timed, and a winner is printed per kernel.
  assert all(r["error"] is None and r["median_ms"] > 0 for r in records)
  table = capsys.readouterr().out
  assert "48x64     dx" in table and "48x64     dw" in table


def test_tune_blocks_sweeps_only_the_kernels_asked_for(tmp_path, capsys, monkeypatch):
  # Two dW candidates suffice (every candidate is interpreted in the test above).
  monkeypatch.setattr(tune_blocks, "DW_CANDIDATES", tune_blocks.DW_CANDIDATES[:2])
  out = tmp_path / "tune.jsonl"
  tune_blocks.main(["--kernels", "dw", "--shapes", "48x64", "--tokens", "128", "--repeats", "1",
                    "--input-sets", "1", "--compile-threads", "1", "--out", str(out)])
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert [r["kernel"] for r in records] == ["dw"] * len(tune_blocks.DW_CANDIDATES)
  assert "48x64     dx" not in capsys.readouterr().out


@pytest.mark.parametrize("kernels", ["dz", "dx,dW", "", "dw,dw"])
def test_tune_blocks_rejects_unknown_kernels(kernels, capsys):
  with pytest.raises(SystemExit):
    tune_blocks.main(["--kernels", kernels, "--shapes", "48x64"])
  assert "argument --kernels: expected distinct names out of dx,dw" in capsys.readouterr().err


def test_layer_variants_run_the_op_and_agree_with_dense():
  """Every timed variant is the library's backward: on dY whose unkept rows are zero they all
  give dense's gradients, and a given index still checks the rows it skips."""
  case = layer.Case(24, 40, 64, 25, "float32")
  x, kernel, bias, dy, active_rows = layer.make_inputs(case, seed=3)
  want = layer.dense_backward(x, kernel, bias, dy)
  for backend, mode, fn, _ in layer.variants(case):
    if mode == "pregathered":
      continue
    got = jax.jit(fn)(x, kernel, bias, dy, *([active_rows] if mode == "given" else []))
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{backend} {mode}")
  skipped = int(np.setdiff1d(np.arange(64), np.asarray(active_rows))[0])
  poisoned = dy.at[skipped, 0].set(jnp.nan)
  _, dkernel, dbias = layer.sebp_backward("xla", case.num_kept)(x, kernel, bias, poisoned,
                                                                 active_rows)
  assert np.all(np.isnan(dkernel)) and np.all(np.isnan(dbias))


def test_selection_benchmark_records(tmp_path):
  out = tmp_path / "selection.jsonl"
  selection.main(["--tokens", "64", "--widths", "16", "--repeats", "1", "--out", str(out)])
  records = [json.loads(line) for line in out.read_text().splitlines()]
  assert {(r["regime"], r["variant"]) for r in records} == {
      (regime, variant) for regime in ("padding", "dense") for variant in selection.VARIANTS}
  assert all(r["median_ms"] > 0 and r["device"] and r["jax_version"] for r in records)


def test_harness_timer_and_parsers():
  calls = []
  ms = harness.median_ms(lambda a: calls.append(a) or jnp.ones(()), 7, repeats=3,
                         calls_per_repeat=2, warmup=1)
  assert ms > 0 and calls == [7] * 7
  assert harness.parse_shapes("bert-base") == harness.SHAPES["bert-base"]
  assert harness.parse_shapes("48x64,2048X512") == [(48, 64), (2048, 512)]
  assert harness.parse_positive_ints("4096,16") == [4096, 16]
  assert harness.parse_subset("dw,dx", ("dx", "dw")) == ["dw", "dx"]
  for parse, text in ((harness.parse_shapes, "48"), (harness.parse_shapes, "48x0"),
                      (harness.parse_positive_ints, "4,-1"), (harness.parse_positive_ints, "a"),
                      (lambda t: harness.parse_subset(t, ("dx", "dw")), "dx,dx")):
    with pytest.raises(harness.argparse.ArgumentTypeError, match="expected"):
      parse(text)


def test_profile_model_attributes_time_to_jax_ops(tmp_path):
  """The trace's XLA ops are summed under the JAX ops they came from, one row per layer kind:
  the SEBP backward's scatter of dX rows appears under a swapped layer."""
  out = tmp_path / "prof.json"
  report = profile_model.main(["--tiny", "--model", "bert", "--modes", "dense,sebp_shared",
                               "--iterations", "1", "--out", str(out)])["bert"]
  for mode in ("dense", "sebp_shared"):
    assert sum(report[mode].values()) > 0
    assert not any(re.search(r"/\d+/", row) for row in report[mode])  # Layers folded.
  def backward_ops(mode):  # The JAX ops of one swapped layer kind's backward.
    return {row.rsplit("/", 1)[1] for row in report[mode]
            if row.startswith("transpose(") and "/layer/*/intermediate/dense/" in row}
  assert "dot_general" in backward_ops("dense") & backward_ops("sebp_shared")
  assert "scatter" in backward_ops("sebp_shared") - backward_ops("dense")
  assert json.loads(out.read_text())["models"]["bert"].keys() == {"dense", "sebp_shared"}


@pytest.mark.parametrize("fsdp", [None, "shard_map"])
def test_profile_model_times_a_data_parallel_step_per_device(tmp_path, fsdp):
  """--devices 2 --call step (and --fsdp shard_map): the packed step's ops per device, and a
  timeline whose busy time holds its computations' and whose collectives (the gradient's
  sum, or the gathers and reduce-scatters) show."""
  out = tmp_path / "prof.json"
  profile_model.main(["--tiny", "--model", "bert", "--modes", "sebp_packed", "--devices", "2",
                      "--call", "step", "--iterations", "1", "--out", str(out),
                      *(["--fsdp", fsdp] if fsdp else [])])
  written = json.loads(out.read_text())
  assert written["devices"] == 2 and written["call"] == "step" and written["fsdp"] == fsdp
  if fsdp:
    assert any("all_gather" in row for row in written["models"]["bert"]["sebp_packed"])
  assert sum(written["models"]["bert"]["sebp_packed"].values()) > 0
  (timeline, *_) = written["timelines"]["bert"]["sebp_packed"].values()
  assert timeline["wall_ms"] > 0 and timeline["collective_ms"] > 0
  assert timeline["busy_ms"] >= timeline["compute_ms"] > 0
  assert timeline["exposed_collective_ms"] == pytest.approx(
      timeline["busy_ms"] - timeline["compute_ms"])


def test_profile_model_reads_op_names_from_the_hlo():
  hlo = """%fused_computation.7 (param_0: bf16[4,8]) -> bf16[4,8] {
  %param_0 = bf16[4,8]{1,0} parameter(0)
  %neg.1 = bf16[4,8]{1,0} negate(%param_0), metadata={op_name="jit(f)/first"}
  ROOT %mul.2 = bf16[4,8]{1,0} multiply(%neg.1, %neg.1), metadata={op_name="jit(f)/root"}
}

ENTRY %main.9 (p: bf16[4,8]) -> bf16[4,8] {
  %fusion.3 = bf16[4,8]{1,0} fusion(%p), kind=kLoop, calls=%fused_computation.7
  %fusion.4 = bf16[4,8]{1,0} fusion(%fusion.3), kind=kLoop, calls=%fused_computation.7, metadata={op_name="jit(loss_fn)/transpose(jvp(M))/layers/12/mlp/dot_general" source_file="x.py"}
  ROOT %custom-call.1 = f32[2]{0} custom-call(%fusion.4), metadata={op_name="jit(f)/q_proj/dot_general"}
  %no_metadata = f32[] add(%a, %b)
}
"""
  names = profile_model.hlo_op_names(hlo)
  assert names == {"neg.1": "jit(f)/first", "mul.2": "jit(f)/root", "fusion.3": "jit(f)/root",
                   "fusion.4": "jit(loss_fn)/transpose(jvp(M))/layers/12/mlp/dot_general",
                   "custom-call.1": "jit(f)/q_proj/dot_general"}
  assert profile_model.op_row(names["fusion.4"]) == "transpose(jvp(M))/layers/*/mlp/dot_general"
  assert profile_model.op_row("jit(f)/a/layers_12/0/1/b/dot") == "a/layers_*/*/*/b/dot"


def test_the_carried_lengths_are_those_of_the_data(tmp_path):
  """benchmarks/lengths/ holds what token_lengths writes from data/: SST-2 dev sentences,
  WikiText-2 paragraphs and sections."""
  from benchmarks import token_lengths
  token_lengths.main(["--out", str(tmp_path / "lengths")])
  carried = sorted(path.name for path in token_lengths.LENGTHS_DIR.glob("*.json"))
  assert sorted(path.name for path in (tmp_path / "lengths").iterdir()) == carried
  for name in carried:
    assert json.loads((tmp_path / "lengths" / name).read_text()) == json.loads(
        (token_lengths.LENGTHS_DIR / name).read_text()), name
  written = (tmp_path / "lengths" / "wikitext2_valid_sections_smollm2_bpe.json").read_text()
  lengths = np.asarray(json.loads(written)["lengths"])
  assert 400 < lengths.mean() < 600 and lengths.max() > 2000


def test_balance_benchmark_evens_the_fullest_shard():
  rows = balance.main(["--model", "llama", "--devices", "1,4", "--batches", "20"])
  one, four = rows
  assert one["fullest_over_mean_drawn"] == one["fullest_over_mean_balanced"] == 1.0
  assert four["fullest_over_mean_balanced"] < four["fullest_over_mean_drawn"]
  assert four["worst_balanced"] <= four["worst_drawn"]


@pytest.mark.slow
def test_model_benchmark_runs_as_several_processes(tmp_path, monkeypatch):
  """--processes 2: two processes of one device each (jax.distributed, Gloo on CPU), the
  packed step over both; the first process writes the record, with the collectives of the
  dense step (one all-reduce of every parameter's float32 gradient) but for the tables.
  --pgle-runs: the step traced and compiled again, the first process's profile sent to the
  other (on CPU the trace has no op times)."""
  monkeypatch.delenv("XLA_FLAGS", raising=False)  # One host device per process.
  out = tmp_path / "model.jsonl"
  rows = model.main(["--tiny", "--model", "bert", "--modes", "sebp_packed",
                     "--processes", "2", "--devices", "2", "--stages", "step", "--repeats",
                     "1", "--rounds", "1", "--pgle-runs", "2", "--out", str(out)])
  assert [(r["mode"], r["devices"], r["processes"], r["pgle_runs"]) for r in rows] == [
      ("sebp_packed", 2, 2, 2)]
  assert len(out.read_text().splitlines()) == 1
  (packed,) = rows
  dense = {"collectives": {"all-reduce": 1},
           "collective_bytes": {"all-reduce": 4 * packed["num_params"]}}
  assert packed["step_ms"] > 0
  _assert_tables_cross_as_rows(packed, dense)


def test_shards_hold_the_one_device_lengths_or_their_own():
  """--shard-lengths: "same" gives every shard the first shard's lengths (the one-device
  batch's) with tokens of its own; "drawn" draws each shard's lengths anew. The first shard is
  the one-device batch either way."""
  setup = model.setup_for("llama", tiny=True)
  net = model.build_model("llama", tiny=True, dtype=jnp.float32)
  one = model.make_batch("llama", net, setup, seed=5)
  rows = setup.batch_size
  same = model.make_batch("llama", net, setup, seed=5, shards=3, shard_lengths="same")
  drawn = model.make_batch("llama", net, setup, seed=5, shards=3, shard_lengths="drawn")
  for batch in (same, drawn):
    for key in one:
      np.testing.assert_array_equal(batch[key][:rows], one[key])
  for shard in (1, 2):
    part = slice(shard * rows, (shard + 1) * rows)
    np.testing.assert_array_equal(same["attention_mask"][part], one["attention_mask"])
    assert not np.array_equal(same["input_ids"][part], one["input_ids"])
    assert np.all((same["input_ids"][part] != 0) == (one["attention_mask"] != 0))
  assert not np.array_equal(drawn["attention_mask"][rows:2 * rows], one["attention_mask"])
  with pytest.raises(ValueError, match="shard_lengths"):
    model.make_batch("llama", net, setup, seed=5, shards=2, shard_lengths="even")
  with pytest.raises(SystemExit):
    model.main(["--tiny", "--model", "llama", "--devices", "2", "--balance"])


def test_more_devices_than_the_machine_has_is_a_usage_error(capsys):
  with pytest.raises(SystemExit):
    model.main(["--tiny", "--model", "bert", "--devices", f"1,{jax.device_count() + 1}"])
  assert f"this machine has {jax.device_count()}" in capsys.readouterr().err


def test_compiler_options_parse_as_xla_values():
  assert harness.parse_compiler_option("xla_a=true") == ("xla_a", True)
  assert harness.parse_compiler_option("xla_b=False") == ("xla_b", False)
  assert harness.parse_compiler_option("xla_c=8388608") == ("xla_c", 8388608)
  assert harness.parse_compiler_option("xla_d=FUSION,CUBLAS") == ("xla_d", "FUSION,CUBLAS")
  for text in ("xla_e", "=1"):
    with pytest.raises(harness.argparse.ArgumentTypeError, match="NAME=VALUE"):
      harness.parse_compiler_option(text)


def test_gathered_rows_benchmark_records_both_combines(tmp_path):
  """Each combine of each row set, recorded; the rows summed per id give the same table in
  every run (on CPUs a scatter-add does too: there the check has nothing to catch) and the
  float64 sum's table."""
  from benchmarks import gathered_rows
  out = tmp_path / "rows.jsonl"
  records = gathered_rows.main(["--tables", "5000x16", "--runs", "3", "--out", str(out)])
  assert [(r["combine"], r["rows"]) for r in records] == [
      (name, rows) for rows, _ in gathered_rows.ROW_SETS
      for name in ("summed_per_id", "scatter_add")]
  assert len(out.read_text().splitlines()) == len(records)
  for r in records:
    assert len(r["differing_elements"]) == 2 and r["max_abs_error_vs_float64"] < 1e-5
    assert r["call_ms"] > 0 and r["distinct_ids"] > 1
    if r["combine"] == "summed_per_id":
      assert r["differing_elements"] == [0, 0]
  with pytest.raises(SystemExit):
    gathered_rows.main(["--runs", "1"])


def test_records_carry_the_xla_flags_they_ran_under(monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")
  assert harness.record(step_ms=1.0)["xla_flags"] == "--xla_gpu_enable_command_buffer="
  monkeypatch.delenv("XLA_FLAGS")
  assert "xla_flags" not in harness.record(step_ms=1.0)


def test_options_for_several_devices_refuse_a_one_device_run(capsys):
  """--compiler-option and --pgle-runs leave one device's runs as they are (the baseline):
  with no run on several devices they would do nothing, and say so."""
  for extra in (["--compiler-option", "xla_gpu_graph_min_graph_size=1"], ["--pgle-runs", "2"]):
    with pytest.raises(SystemExit):
      model.main(["--tiny", "--model", "bert", "--devices", "1", *extra])
    assert "apply to the runs on several devices" in capsys.readouterr().err


def test_a_donated_step_runs_on_its_own_results_and_keeps_the_params_it_started_from():
  compiled = jax.jit(lambda params, state, batch: (params + batch, state + 1),
                     donate_argnums=(0, 1)).lower(
                         jnp.zeros(3), jnp.zeros((), jnp.int32), jnp.zeros(3)).compile()
  params = jnp.asarray(np.random.default_rng(0).normal(size=3), jnp.float32)
  batch = jnp.asarray(np.random.default_rng(1).normal(size=3), jnp.float32)
  step = model.DonatedStep.start(compiled, params, jnp.int32(5))
  step(batch)
  new_params, state = step(batch)
  np.testing.assert_allclose(new_params, params + 2 * batch, rtol=1e-6)
  assert int(state) == 7
  assert not params.is_deleted()


@pytest.mark.parametrize("module,argv,message", [
    (model, ["--repeats", "0"], "--repeats: expected a positive int, got '0'"),
    (model, ["--seed", "-1"], "--seed: expected an int of 0 or more, got '-1'"),
    (model, ["--packed-capacity", "-5"], "--packed-capacity: expected a positive int"),
    (layer, ["--input-sets", "0"], "--input-sets: expected a positive int"),
    (layer, ["--kept", "150"], "--kept is a percentage of the rows, at most 100, got 150"),
    (layer, ["--dtype", "floot"], "--dtype: invalid choice: 'floot'"),
    (selection, ["--tokens", "8", "--kept", "0.1"], "--kept 0.1 of 8 tokens keeps no row"),
    (selection, ["--repeats", "0"], "--repeats: expected a positive int"),
    (balance, ["--batches", "0"], "--batches: expected a positive int"),
    (attention, ["--rounds", "0"], "--rounds: expected a positive int")])
def test_counts_out_of_range_are_usage_errors(module, argv, message, capsys):
  with pytest.raises(SystemExit):
    module.main(argv)
  assert message in capsys.readouterr().err


def test_donating_refuses_profile_guided_compiles(capsys):
  with pytest.raises(SystemExit):
    model.main(["--tiny", "--model", "bert", "--devices", "2", "--donate", "--pgle-runs", "2"])
  assert "--donate and --pgle-runs" in capsys.readouterr().err


def test_modes_take_a_backend_of_their_own():
  assert model.parse_modes("dense,sebp_auto@pallas,sebp_auto") == [
      "dense", "sebp_auto@pallas", "sebp_auto"]
  assert model.split_mode("sebp_auto@pallas", "auto") == ("sebp_auto", "pallas")
  assert model.split_mode("sebp_auto", "xla") == ("sebp_auto", "xla")
  for text in ("sebp_auto@triton", "sebp@pallas", "dense,dense", ""):
    with pytest.raises(harness.argparse.ArgumentTypeError):
      model.parse_modes(text)


def test_a_mode_with_its_own_backend_runs_and_records_it(monkeypatch):
  """``MODE@BACKEND`` builds MODE's loss with that backend; the record names it."""
  built = []
  real_make_loss = model.make_loss
  monkeypatch.setattr(model, "make_loss", lambda kind, net, mode, top_n, backend, *a, **k: (
      built.append((mode, backend)) or real_make_loss(kind, net, mode, top_n, backend, *a, **k)))
  rows = model.main(["--tiny", "--model", "bert", "--modes", "sebp_auto@xla,sebp_auto",
                     "--backend", "dense", "--stages", "step", "--repeats", "1",
                     "--rounds", "1"])
  assert built == [("sebp_auto", "xla"), ("sebp_auto", "dense")]
  assert [(r["mode"], r["backend"]) for r in rows] == [("sebp_auto@xla", "xla"),
                                                       ("sebp_auto", "dense")]


def test_timeline_unions_overlapping_intervals():
  """Busy time counts overlapping kernels once; exposed collective time is what no
  computation covers."""
  assert profile_model._union_ns([]) == 0
  assert profile_model._union_ns([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
  assert profile_model._union_ns([(30, 40), (0, 50)]) == 50


def test_balanced_batch_evens_the_shards_real_tokens():
  setup = model.setup_for("llama", tiny=True)
  net = model.build_model("llama", tiny=True, dtype=jnp.float32)
  batch = model.make_batch("llama", net, setup, seed=4, shards=4)
  balanced = model.balanced_batch(batch, 4)
  counts = lambda b: shard_row_counts(b["attention_mask"], 4)
  assert counts(balanced).max() - counts(balanced).min() <= setup.length
  assert sorted(map(tuple, balanced["input_ids"])) == sorted(map(tuple, batch["input_ids"]))


@pytest.mark.slow
def test_fsdp_layer_by_layer_with_packing_has_the_dense_collectives():
  """--fsdp layer: the weight matrices split, gathered where XLA's partitioner places the
  gathers (for the dense BERT step it also moves activations between shardings, all-to-alls);
  the packed step has no collective of any kind more often. (Not in bytes on CPU: SEBP's
  per-shard partial gradients are summed whole and then split, an all-reduce that XLA's GPU
  pipeline makes a reduce-scatter; the CPU's keeps it whole.)"""
  rows = model.main(["--tiny", "--model", "bert", "--modes", "dense,sebp_packed", "--devices",
                     "2", "--fsdp", "layer", "--repeats", "1", "--rounds", "1",
                     "--stages", "step", "--calls-per-repeat", "2", "--compiler-option",
                     "xla_gpu_enable_latency_hiding_scheduler=true"])
  dense, packed = rows
  assert dense["fsdp"] == packed["fsdp"] == "layer"
  assert packed["compiler_options"] == {"xla_gpu_enable_latency_hiding_scheduler": True}
  assert packed["calls_per_repeat"] == 2 and packed["step_ms"] > 0
  assert "grad_ms" not in packed and "forward_ms" not in packed  # --stages step
  assert dense["collectives"].get("all-gather", 0) > 0
  for kind, count in packed["collectives"].items():
    assert count <= dense["collectives"][kind]


def test_fsdp_in_a_shard_map_packs_each_device_with_the_dense_collectives():
  """--fsdp shard_map: each device runs the one-device packed loss on its rows
  (`fsdp_loss`), at the fullest device's capacity, with the dense step's collectives (their
  bytes no more: the lookup and the head move the packed rows); the embedding table is
  looked up in place and the LM head split by its vocabulary, so that both move fewer bytes
  than with the head gathered (`shard_map_gathered_head`, run side by side: a comma list)."""
  rows = model.main(["--tiny", "--model", "llama", "--modes", "dense,sebp_packed", "--devices",
                     "2", "--fsdp", "shard_map,shard_map_gathered_head", "--repeats", "1",
                     "--rounds", "2", "--stages", "step"])
  assert [(r["fsdp"], r["mode"]) for r in rows] == [
      (kind, mode) for kind in ("shard_map", "shard_map_gathered_head")
      for mode in ("dense", "sebp_packed")]
  for dense, packed in (rows[:2], rows[2:]):
    assert packed["step_ms"] > 0 and len(packed["rounds_ms"]["step_ms"]) == 2
    assert packed["step_speedup_vs_dense"] == pytest.approx(np.median(
        np.asarray(dense["rounds_ms"]["step_ms"]) / packed["rounds_ms"]["step_ms"]))
    assert packed["collectives"] == dense["collectives"]
    for kind, moved in dense["collective_bytes"].items():  # The packed rows: no more.
      assert packed["collective_bytes"][kind] <= moved
  split_head, gathered_head = rows[0], rows[2]
  for kind in ("all-gather", "reduce-scatter"):
    assert 0 < split_head["collective_bytes"][kind] < gathered_head["collective_bytes"][kind]


def test_packed_capacity_replaces_the_batch_own_where_it_holds_it(monkeypatch):
  """``--packed-capacity``: the packed modes run at that capacity (at least the batch's own,
  at most its rows), and the loss is still the dense one."""
  seen = []
  make_loss = model.make_loss
  monkeypatch.setattr(model, "make_loss", lambda *a, **k: seen.append(a[5]) or make_loss(*a, **k))
  setup = model.setup_for("bert", tiny=True)
  net = model.build_model("bert", tiny=True, dtype=jnp.float32)
  batch = model.make_batch("bert", net, setup, seed=3)
  own, rows = token_capacity(batch["attention_mask"]), batch["attention_mask"].size
  for packed_capacity in (None, 1, rows, 10 * rows):
    model.mode_loss("bert", net, "sebp_packed", batch, 8, "xla", packed_capacity=packed_capacity)
  assert seen == [own, own, rows, rows] and own < rows
  _, dense = model.mode_loss("bert", net, "dense", batch, 8, "xla")
  _, packed = model.mode_loss("bert", net, "sebp_packed", batch, 8, "xla", packed_capacity=rows)
  np.testing.assert_allclose(jax.jit(packed)(net.params, batch),
                             jax.jit(dense)(net.params, batch), rtol=2e-5)


def test_profile_guided_compile_computes_the_function():
  """profile_guided: traced, then compiled again with the trace's profile (empty on CPU); the
  executable it returns computes the function's values (float64 numpy's)."""
  x = jax.random.normal(jax.random.key(3), (32, 48))
  w = jax.random.normal(jax.random.key(4), (48, 16))
  fn = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=0))
  lowered = fn.lower(x, w)
  compiled = harness.profile_guided(lowered, (x, w), runs=2)
  expected = np.tanh(np.asarray(x, np.float64) @ np.asarray(w, np.float64)).sum(axis=0)
  np.testing.assert_allclose(compiled(x, w), expected, rtol=1e-5, atol=1e-5)
