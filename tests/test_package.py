"""`import sebp_jax` stays a library: no example dependencies, no global state."""

import json
import subprocess
import sys


def test_import_pulls_in_no_model_libraries_and_changes_no_environment():
  script = """
import json, os, sys
before = dict(os.environ)
import jax
jax_config = dict(jax.config.values)
import sebp_jax
print(json.dumps({
    "modules": [m for m in ("transformers", "gguf", "tokenizers", "torch", "pallas_kernels")
                if m in sys.modules],
    "environment_changed": dict(os.environ) != before,
    "jax_config_changed": dict(jax.config.values) != jax_config,
}))
"""
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
  assert json.loads(result.stdout.splitlines()[-1]) == {
      "modules": [], "environment_changed": False, "jax_config_changed": False}
