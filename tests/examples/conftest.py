"""The pretrained models the example tests share, loaded once per session."""

import pytest


@pytest.fixture(scope="session")
def bert():
  """(model, params, tokenizer) of the pretrained all-MiniLM-L6-v2 with a 2-class head."""
  from examples.pretrained import load_bert_classifier
  return load_bert_classifier(num_labels=2, seed=0)


@pytest.fixture(scope="session")
def smollm2():
  """(model, params, tokenizer) of SmolLM2-135M-Instruct converted from its GGUF file."""
  from examples.pretrained import load_smollm2
  return load_smollm2()


@pytest.fixture(scope="session")
def smollm2_nnx():
  """(model, tokenizer) of SmolLM2-135M-Instruct in Tunix's NNX Llama 3, same weights."""
  from examples.pretrained import load_smollm2_nnx
  return load_smollm2_nnx()
