"""The benchmark modules run end to end at toy sizes (CPU): their records are complete.

No timing is asserted: speed claims live in benchmarks/RESULTS.md, measured on a GPU.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import layer, model


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
  dense = model.make_loss("llama", llama, "dense", 0, "auto")
  bound = model.make_loss("llama", llama, "bound", 0, "auto")
  assert np.isclose(dense(llama.params, batch), bound(llama.params, batch))
  grads = jax.grad(bound)(llama.params, batch)["model"]
  assert not np.any(grads["layers"]["0"]["mlp"]["up_proj"]["kernel"])
  # Not a linear layer: its gradient flows through the zero dX of the layers above, but the
  # final norm sits after them and keeps a real gradient.
  assert np.any(grads["norm"]["weight"])


def test_layer_benchmark_records(tmp_path):
  out = tmp_path / "layer.jsonl"
  layer.main(["--shapes", "48x64", "--tokens", "128", "--kept", "20", "--repeats", "1",
              "--input-sets", "1", "--compile-threads", "1", "--out", str(out)])
  records = [json.loads(line) for line in out.read_text().splitlines()]
  variants = {(r["backend"], r["index"]) for r in records}
  assert variants == {("dense", None), *((b, i) for b in ("xla", "pallas", "auto")
                                          for i in ("selected", "given"))}
  assert all(r["median_ms"] > 0 and r["roofline_ms"] > 0 for r in records)
