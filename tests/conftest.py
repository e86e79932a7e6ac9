import os

# Four host (CPU) devices, for the tests of steps sharded over several devices
# (tests/test_sharding.py); every other test runs on the first. Set before jax starts.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=4").strip()

import jax
import pytest


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
