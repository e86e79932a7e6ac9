import os
import sys

import jax
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# float32 dots in float32 everywhere: a GPU's default for them is TF32, ~1e-3 relative error,
# which the float32 tolerances here (against float64 references) would not tolerate.
jax.config.update("jax_default_matmul_precision", "highest")
# Tests import the reference helpers (tests/reference.py) as a plain module.
sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def bert():
  """(model, params, tokenizer) of the pretrained all-MiniLM-L6-v2 with a 2-class head."""
  from sebp_jax.pretrained import load_bert_classifier
  return load_bert_classifier(num_labels=2, seed=0)


@pytest.fixture(scope="session")
def smollm2():
  """(model, params, tokenizer) of SmolLM2-135M-Instruct converted from its GGUF file."""
  from sebp_jax.pretrained import load_smollm2
  return load_smollm2()
