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
