"""The profiling command on the real pretrained MiniLM: it logs every Dense layer, and what it
reports holds for BERT classification's gradients.

The loss reads the [CLS] row of the last layer only and attention masks padding keys, so no
padding row of any layer reaches the loss, and in the last layer only the [CLS] rows do,
except through its keys and values. SmolLM2, with its 211 layers to compile, is too slow for
the test suite: its run is left to the command line.
"""

import json

import numpy as np
import pytest

from examples import profile_sparsity

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BERT_BLOCK = ("attention/self/query", "attention/self/key", "attention/self/value",
              "attention/output/dense", "intermediate/dense", "output/dense")


def _run(tmp_path, *options):
  summary = profile_sparsity.main([*options, "--out", str(tmp_path)])
  for name in ("cdf.png", "heatmap.png"):
    assert (tmp_path / name).read_bytes()[:8] == PNG_SIGNATURE
  assert json.loads((tmp_path / "layers.json").read_text()) == summary
  return summary, {row["layer"]: row for row in summary["layers"]}


@pytest.mark.slow
def test_minilm_sst2_profile(tmp_path, capsys):
  summary, layers = _run(tmp_path, "--model", "minilm-sst2", "--steps", "2", "--batch-size",
                         "4", "--max-length", "32", "--threshold", "0", "--top-n", "4")
  assert list(layers) == [f"bert/encoder/layer/{i}/{name}" for i in range(6)
                          for name in BERT_BLOCK]
  assert summary["threshold"] == 0.0 and summary["estimated_threshold"] >= 0.0
  assert len(summary["losses"]) == 2 and all(np.isfinite(summary["losses"]))
  real_tokens = summary["real_tokens"]
  assert summary["padding_share"] > 0
  for layer, row in layers.items():
    assert row["steps"] == 2 and row["rows"] == 4 * 32
    assert row["active_max"] <= max(real_tokens) and row["active_mean"] <= np.mean(real_tokens)
    assert row["row_sparsity"] >= summary["padding_share"] > 0
    assert row["active_max"] <= row["capacity_max"]
    # Threshold 0 counts the rows the backward found active; it drops nothing but by top_n.
    assert row["active_at_threshold_mean"] == row["active_mean"]
  cls_only = [f"bert/encoder/layer/5/{name}" for name in BERT_BLOCK if "key" not in name
              and "value" not in name]
  for layer in cls_only:
    assert layers[layer]["active_max"] == layers[layer]["active_mean"] == 4
    assert layers[layer]["dropped_share_max"] == 0.0
  assert all(layers[f"bert/encoder/layer/0/{name}"]["dropped_share_mean"] > 0
             for name in BERT_BLOCK)
  out = capsys.readouterr().out
  assert "bert/encoder/layer/5/output/dense" in out and "row_sparsity" in out


def test_help_and_bad_arguments(capsys):
  with pytest.raises(SystemExit):
    profile_sparsity.parse_args(["--help"])
  out = capsys.readouterr().out
  assert out.startswith("usage: python -m examples.profile_sparsity ")
  for option in ("--model", "--steps", "--top-n", "--threshold", "--out"):
    assert option in out
  for bad in (["--threshold", "-1"], ["--threshold", "knee"], ["--steps", "0"],
              ["--top-n", "0"], ["--model", "gpt2"]):
    with pytest.raises(SystemExit):
      profile_sparsity.parse_args(bad)


def test_defaults_are_per_model():
  minilm = profile_sparsity.parse_args([])
  assert (minilm.model, minilm.steps, minilm.batch_size, minilm.max_length) == (
      "minilm-sst2", 3, 16, 128)
  assert minilm.threshold == "auto" and minilm.top_n is None
  smollm2 = profile_sparsity.parse_args(["--model", "smollm2-wikitext", "--steps", "5"])
  assert (smollm2.steps, smollm2.batch_size, smollm2.max_length) == (5, 4, 256)
  assert profile_sparsity.parse_args(["--threshold", "1e-6"]).threshold == 1e-6
