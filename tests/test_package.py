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


def test_imports_from_the_folder_holding_the_clone(tmp_path):
  """A clone in a folder named like the package, run from its parent: the installed package,
  not the clone's folder (a namespace package there), is imported (`make install` puts the
  clone's root on the path)."""
  import pathlib

  (tmp_path / "sebp_jax").symlink_to(pathlib.Path(__file__).resolve().parents[1])
  result = subprocess.run([sys.executable, "-c", "from sebp_jax import use_sebp, nnx"],
                          cwd=tmp_path, capture_output=True, text=True)
  assert result.returncode == 0, result.stderr
