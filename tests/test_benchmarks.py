"""The benchmark modules run end to end at toy sizes (CPU): their records are complete.

No timing is asserted: speed claims live in benchmarks/RESULTS.md, measured on a GPU.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sebp_jax
import sebp_jax.backends
import sebp_jax.layers
import sebp_jax.ops
from benchmarks import ablations, layer, model, tune_blocks


def test_model_benchmark_records(tmp_path):
  out = tmp_path / "model.jsonl"
  rows = model.main(["--tiny", "--model", "bert", "--modes", "dense,sebp_shared,bound",
                     "--repeats", "1", "--out", str(out)])
  assert [r["mode"] for r in rows] == ["dense", "sebp_shared", "bound"]
  assert len(out.read_text().splitlines()) == 3
  for row in rows:
    assert row["backward_ms"] > 0 and row["step_ms"] > 0
    assert math.isfinite(row["backward_speedup_vs_dense"])
    assert 0 < row["real_tokens"] < row["rows"]


def test_bound_mode_writes_dx_and_skips_weight_gradients():
  """The bound keeps the forward, returns zero dX and no weight gradient for swapped layers."""
  setup = model.setup_for("llama", tiny=True)
  llama = model.build_model("llama", tiny=True, dtype=jnp.float32)
  batch = model.make_batch("llama", llama, setup, seed=0)
  top_n = int(batch["attention_mask"].sum())
  dense = model.make_loss("llama", llama, "dense", top_n, "auto")
  bound = model.make_loss("llama", llama, "bound", top_n, "auto")
  assert np.isclose(dense(llama.params, batch), bound(llama.params, batch))
  grads = jax.grad(bound)(llama.params, batch)
  assert not np.any(grads["model"]["layers"]["0"]["mlp"]["up_proj"]["kernel"])
  # Not a linear layer: its gradient flows through the zero dX of the layers above, but the
  # final norm sits after them and keeps a real gradient.
  assert np.any(grads["model"]["norm"]["weight"])
  assert np.any(grads["lm_head"]["kernel"])
  # With the LM head in the bound, its dX is the zero one: nothing reaches the final norm.
  bound_lm_head = model.make_loss("llama", llama, "bound_lm_head", top_n, "auto")
  grads = jax.grad(bound_lm_head)(llama.params, batch)
  assert not np.any(grads["lm_head"]["kernel"]) and not np.any(grads["model"]["norm"]["weight"])


def test_lm_head_modes_only_for_models_with_one():
  rows = model.main(["--tiny", "--model", "bert", "--model", "llama", "--modes",
                     "dense,sebp_lm_head", "--repeats", "1"])
  assert [(r["model"], r["mode"]) for r in rows] == [
      ("bert", "dense"), ("llama", "dense"), ("llama", "sebp_lm_head")]


def test_layer_benchmark_records(tmp_path, capsys):
  out = tmp_path / "layer.jsonl"
  layer.main(["--shapes", "48x64", "--tokens", "128", "--kept", "20", "--repeats", "1",
              "--input-sets", "1", "--compile-threads", "1", "--out", str(out)])
  records = [json.loads(line) for line in out.read_text().splitlines()]
  variants = {(r["backend"], r["index"]) for r in records}
  assert variants == {("dense", None), ("kept_matmuls", "pregathered"),
                      *((b, i) for b in ("xla", "pallas", "auto") for i in ("selected", "given"))}
  assert all(r["median_ms"] > 0 and r["roofline_ms"] > 0 for r in records)
  # The table shows both backends' time over the roofline, as recorded.
  header, _, row = capsys.readouterr().out.splitlines()[-3:]
  assert "xla/roof" in header and "pal/roof" in header
  roof = {r["backend"]: r["time_over_roofline"] for r in records if r["index"] == "selected"}
  assert f"{roof['xla']:7.2f}x {roof['pallas']:7.2f}x |" in row


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
  assert "--kernels must name dx and/or dw, each once" in capsys.readouterr().err


def test_ablation_studies_run_and_agree(tmp_path):
  out = tmp_path / "ablations.jsonl"
  dx = ablations.main(["dx", "--tiny", "--repeats", "1", "--out", str(out)])
  # dX by scatter, by gather and by the Pallas kernels all matched dense inside the study.
  assert {r["variant"] for r in dx} == {"dense", "xla, dX by gather", "xla, dX by scatter",
                                        "pallas"}
  check = ablations.main(["check", "--tiny", "--model", "bert", "--repeats", "1",
                          "--out", str(out)])
  assert [r["variant"] for r in check] == ["dense", *ablations.CHECKS]
  assert all(r["backward_ms"] > 0 and r["mode"] in ("dense", "sebp_shared") for r in check)
  records = len(dx) + len(check)
  for study, variants in (("poison", ["kept rows of dY", "dW and db"]),
                          ("cast", ["inside the op", "before the op"])):
    got = ablations.main([study, "--tiny", "--model", "llama", "--repeats", "1",
                          "--out", str(out)])
    assert [r["variant"] for r in got] == ["dense", *variants]
    assert all(len(r["backward_ms_rounds"]) == 2 for r in got)
    records += len(got)
  # Both stores agreed inside the study (it asserts that); one record per output and variant.
  store = ablations.main(["store", "--tiny", "--repeats", "1", "--out", str(out)])
  assert sorted((r["output"], r["variant"]) for r in store) == [
      (output, variant) for output in ("dW", "dX")
      for variant in ("float32, then cast", "stored by the matmul")]
  records += len(store)
  bias_sum = ablations.main(["bias-sum", "--tiny", "--repeats", "1", "--out", str(out)])
  assert [r["variant"] for r in bias_sum] == ["jax.vjp", "partial sums", "one sum"]
  # Both float32 sums give the float64 sum rounded once, in every entry.
  assert [r["dbias_entries_off"] for r in bias_sum[1:]] == [0, 0]
  records += len(bias_sum)
  assert len(out.read_text().splitlines()) == records


def test_ablation_poison_and_cast_variants_take_effect():
  """Swapped in as the studies do, each alternative acts on the real backward."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((8, 3)), jnp.bfloat16)
  g = rng.standard_normal((8, 4)).astype(np.float32)
  g[5:] = 0
  g[6, 2] = np.nan
  rows = jnp.arange(5, dtype=jnp.int32)
  kernel = jnp.asarray(rng.standard_normal((3, 4)), jnp.bfloat16)
  for swaps in ([], [(sebp_jax.backends, "xla_sparse_backward",
                      ablations._poison_after_matmuls)]):
    with ablations._patched(swaps):
      dx, dkernel = jax.grad(lambda x, k: jnp.sum(sebp_jax.sebp_linear(  # "auto": dense on GPU
          x, k, top_n=5, active_rows=rows, backend="xla").astype(jnp.float32) * g),
                             (0, 1))(x, kernel)
    assert np.isnan(np.asarray(dkernel, np.float32)).all()
    # Poisoned rows of dY reach dX's kept rows too; poisoned sums leave dX alone.
    assert np.isnan(np.asarray(dx, np.float32)[:5]).all() == (not swaps)
  params = {"params": {"kernel": jnp.asarray(rng.standard_normal((3, 4)), jnp.float32),
                       "bias": jnp.zeros(4)}}
  layer = sebp_jax.SEBPDense(4, dtype=jnp.bfloat16, top_n=8, backend="xla")
  dy = jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16)
  kernels = []
  for swaps in ([], [(sebp_jax.layers, "promotion_for_sebp",
                      ablations._promote_before_the_op)]):
    with ablations._patched(swaps):
      _, vjp = jax.vjp(lambda p: layer.apply(p, x), params)
      kernels.append(np.asarray(vjp(dy)[0]["params"]["kernel"]))
  # Cast before the op, dW is rounded to bf16 first: representable in bf16, unlike inside.
  as_bf16 = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32)
  assert not np.array_equal(kernels[0], as_bf16(kernels[0]))
  np.testing.assert_array_equal(kernels[1], as_bf16(kernels[1]))


def test_ablation_check_variants_take_effect():
  """Each check variant, swapped in as the study does, acts on the real backward: a NaN in a
  row the given index skips poisons all of dW (row max, all(isfinite)), only its column
  (column sum) or nothing (none)."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 3)).astype(np.float32)
  kernel = rng.standard_normal((3, 4)).astype(np.float32)
  g = rng.standard_normal((8, 4)).astype(np.float32)
  g[5:] = 0
  g[6, 2] = np.nan
  rows = jnp.arange(5, dtype=jnp.int32)
  want_nan_columns = {"row_max": 4, "all_isfinite": 4, "column_sum": 1, "none": 0}
  for name, check in ablations.CHECKS.items():
    with ablations._patched([(sebp_jax.ops, "nan_if_not_finite", check)]):
      dkernel = jax.grad(lambda k: jnp.sum(sebp_jax.sebp_linear(  # "auto": dense on a GPU
          x, k, top_n=5, active_rows=rows, backend="xla") * g))(kernel)
    nan_columns = np.isnan(np.asarray(dkernel)).all(axis=0)
    assert nan_columns.sum() == want_nan_columns[name], name
    assert not np.isnan(np.asarray(dkernel)[:, ~nan_columns]).any(), name
