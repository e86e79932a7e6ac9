import os
import shutil
import subprocess
import sys
import tempfile

# Four host (CPU) devices, for the tests of steps sharded over several devices
# (tests/test_sharding.py); every other test runs on the first. Set before jax starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=4").strip()
# Compiling dominates the tests' time, running the tiny models little: LLVM's optimisations
# of the compiled code cost more than they save here.
if "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"


def _xla_accepts(flag: str) -> bool:
  """Whether this jaxlib's XLA takes ``flag``: an unknown one in XLA_FLAGS aborts the process,
  so a child process tries it first."""
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices('cpu')"],
                         env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"},
                         capture_output=True)
  return probe.returncode == 0


# XLA's CPU fusion emitters (through MLIR) take longer to compile a fusion than its classic
# ones, which the tests' programs, mostly small fusions, pay for in nearly every compile.
# The XLA of jaxlib 0.11 (on the GPU machines) does not know the flag: there it is left out.
_CLASSIC_EMITTERS = "--xla_cpu_use_fusion_emitters=false"
if "xla_cpu_use_fusion_emitters" not in os.environ["XLA_FLAGS"] and _xla_accepts(
    _CLASSIC_EMITTERS):
  os.environ["XLA_FLAGS"] += " " + _CLASSIC_EMITTERS
# One compilation cache for the run, shared by the xdist workers (started after this runs in
# the controller, they inherit it) and the processes tests start: a program that several
# tests compile alike (a dense reference gradient of the same model and batch, say) compiles
# once. Removed at the end by the process that made it.
OWN_COMPILATION_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  OWN_COMPILATION_CACHE = tempfile.mkdtemp(prefix="sebp_jax_test_compiles_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = OWN_COMPILATION_CACHE
# Every program into the cache, not only those compiling for over a second: the tests'
# eager references compile one small program per op, alike in every worker and process.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import jax
import pytest

# jax reads its environment when first imported, which a plugin may have done before this file.
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))


def pytest_unconfigure(config):
  if OWN_COMPILATION_CACHE is not None:
    shutil.rmtree(OWN_COMPILATION_CACHE, ignore_errors=True)


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
