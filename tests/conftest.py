import os
import sys

import jax
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
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


@pytest.fixture(autouse=True)
def float32_dots_in_float32(request):
  """float32 dots in float32 on a GPU too, whose default for them is TF32 (~1e-3 relative
  error, beyond the float32 tolerances against float64 references). Not for the Pallas
  kernel tests: they check that the kernels ask for full float32 precision themselves."""
  if "pallas_kernels" in request.node.nodeid.split("::")[0]:
    yield
    return
  with jax.default_matmul_precision("highest"):
    yield
