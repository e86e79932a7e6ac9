"""The examples' command lines (the runs themselves are the README's main job)."""

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "examples"))

import finetune_llama  # noqa: E402


def test_llama_example_lm_head_flag():
  assert finetune_llama.parse_args([]).lm_head
  assert not finetune_llama.parse_args(["--no-lm-head"]).lm_head


def test_counts_must_be_positive(capsys):
  with pytest.raises(SystemExit):
    finetune_llama.parse_args(["--steps", "0"])
  assert "--steps must be positive, got 0" in capsys.readouterr().err
