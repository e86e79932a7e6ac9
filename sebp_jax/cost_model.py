"""Which implementation ``backend="auto"`` runs for one linear layer, from static shapes.

* Off GPU: ``"xla"``, the SEBP backward in plain jnp.
* On GPU: ``"xla"`` where :class:`GpuCostModel` predicts it ahead of the dense backward by
  ``margin``, else ``"dense"``: on small layers at high kept fractions the gathers and the
  scoring cost more than the FLOPs they save, and the dense backward is exact.
* ``"pallas"`` only when asked for: XLA's dots on the kept rows, with dX spread by a gather
  that fuses into its consumer, are ahead of the kernels at the shapes measured (see
  ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class GpuCostModel:
  """Predicted seconds of one linear layer's backward on a GPU, dense vs SEBP.

  The rates are fitted to the layer benchmark on H100/H200 at bf16
  (``python -m benchmarks.layer``): matmul rates, a copy rate, and the fixed cost of the
  kernels a small layer still launches. The dense backward overlaps its bytes with its FLOPs
  (a max); the SEBP one, a chain of gathers and matmuls, is modelled additively.
  """
  dense_flops_per_s: float = 7.8e14
  sparse_flops_per_s: float = 7.0e14
  bytes_per_s: float = 2.9e12
  dense_fixed_s: float = 3e-5
  sparse_fixed_s: float = 3e-5
  selection_fixed_s: float = 4e-5
  #: SEBP must be predicted this much faster: near a tie the dense backward is exact and
  #: simpler.
  margin: float = 1.1

  def dense_seconds(self, num_rows, in_features, out_features, itemsize) -> float:
    flops = 4 * num_rows * in_features * out_features
    # Reads dY twice, X and W once; writes dX and dW.
    moved = itemsize * (2 * num_rows * out_features + 2 * num_rows * in_features
                        + 2 * in_features * out_features)
    return self.dense_fixed_s + max(flops / self.dense_flops_per_s, moved / self.bytes_per_s)

  def sparse_seconds(self, num_rows, in_features, out_features, top_n, itemsize,
                     index_given) -> float:
    flops = 4 * top_n * in_features * out_features
    # Kept rows of dY (twice) and X, W, dW, and the whole of dX (its zero rows are written).
    moved = itemsize * (2 * top_n * out_features + top_n * in_features
                        + 2 * in_features * out_features + num_rows * in_features)
    seconds = self.sparse_fixed_s + flops / self.sparse_flops_per_s + moved / self.bytes_per_s
    if not index_given:  # Scoring reads all of dY once more.
      seconds += self.selection_fixed_s + itemsize * num_rows * out_features / self.bytes_per_s
    return seconds

  def sparse_wins(self, num_rows, in_features, out_features, top_n, itemsize,
                  index_given) -> bool:
    sparse = self.sparse_seconds(num_rows, in_features, out_features, top_n, itemsize,
                                 index_given)
    return sparse * self.margin < self.dense_seconds(num_rows, in_features, out_features,
                                                     itemsize)


GPU_COST_MODEL = GpuCostModel()


def choose_implementation(backend: str, *, num_rows: int, in_features: int,
                          out_features: int, top_n: int, itemsize: int, index_given: bool,
                          platform: str | None = None) -> str:
  """The implementation that runs one layer's backward.

  ``"dense"`` whenever nothing can be skipped (``top_n >= num_rows`` with no index given, or
  no rows at all); otherwise an explicit ``backend`` as given, and ``"auto"`` as the module
  docstring says.
  """
  if num_rows == 0 or (top_n >= num_rows and not index_given):
    return "dense"
  if backend != "auto":
    return backend
  if (platform or jax.default_backend()) == "gpu" and not GPU_COST_MODEL.sparse_wins(
      num_rows, in_features, out_features, top_n, itemsize, index_given):
    return "dense"
  return "xla"
