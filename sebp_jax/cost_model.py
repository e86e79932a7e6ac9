"""Which implementation ``backend="auto"`` runs for one linear layer, from static shapes.

* Off GPU: ``"xla"``, the SEBP backward in plain jnp.
* On GPU: ``"xla"`` where :class:`GpuCostModel` predicts it ahead of the dense backward by
  ``margin``, else ``"dense"``: on small layers at high kept fractions the gathers and the
  scoring cost more than the FLOPs they save, and the dense backward is exact.
* Where the capacity is chosen at run time (``top_n="auto"``, or ``overflow="exact"``):
  on GPU, :func:`choose_counted` runs ``"pallas"`` (Mosaic GPU kernels on Hopper, Triton
  elsewhere) once, on an index of every candidate row (its kernels' work follows the
  run-time count), where :class:`GpuCostModel` predicts it
  ahead of a run-time branch between capacities, each run as above. Elsewhere the branch.
* ``"pallas"`` at a static capacity only when asked for: XLA's dots on the kept rows, with dX
  spread by a gather that fuses into its consumer, are ahead of the kernels at the shapes
  measured (see ``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

import dataclasses

import jax

from sebp_jax.implementations import get_implementation

#: The implementation that ``backend="auto"`` runs once where a capacity would be chosen at
#: run time: its cost follows the rows it is handed (``Implementation.follows_count``).
COUNTED_BACKEND = "pallas"


@dataclasses.dataclass(frozen=True)
class GpuCostModel:
  """Predicted seconds of one linear layer's backward on a GPU, dense vs SEBP.

  The rates are fitted to the layer benchmark on H100/H200 at bf16
  (``python -m benchmarks.layer``): matmul rates (XLA's, and the Pallas kernels' that run at
  a run-time count), a copy rate, the fixed cost of the kernels a small layer still launches,
  and that of a run-time branch between capacities. The dense backward overlaps its bytes
  with its FLOPs (a max); the SEBP one, a chain of gathers and matmuls, is modelled
  additively.
  """
  dense_flops_per_s: float = 7.8e14
  sparse_flops_per_s: float = 7.0e14
  counted_flops_per_s: float = 5.0e14
  bytes_per_s: float = 2.9e12
  dense_fixed_s: float = 3e-5
  sparse_fixed_s: float = 3e-5
  selection_fixed_s: float = 4e-5
  branch_fixed_s: float = 1e-4
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

  def counted_seconds(self, num_rows, in_features, out_features, count, itemsize) -> float:
    """The kernels run once over an index of every row, ``count`` of them listed: their
    matmuls, gathers and dX's kept rows follow the count; the spread writes dX whole; the
    scoring pass reads all of dY."""
    flops = 4 * count * in_features * out_features
    moved = itemsize * (2 * count * out_features + 2 * count * in_features
                        + 2 * in_features * out_features + num_rows * in_features
                        + num_rows * out_features)
    return (self.sparse_fixed_s + self.selection_fixed_s + flops / self.counted_flops_per_s
            + moved / self.bytes_per_s)

  def branched_seconds(self, num_rows, in_features, out_features, capacity, itemsize) -> float:
    """The branch of ``capacity`` (dense or XLA's SEBP, as :func:`choose_implementation`
    picks) behind a run-time branch."""
    picked = choose_implementation("auto", num_rows=num_rows, in_features=in_features,
                                   out_features=out_features, top_n=capacity,
                                   itemsize=itemsize, index_given=False, platform="gpu",
                                   cost_model=self)
    if picked == "dense":
      run = self.dense_seconds(num_rows, in_features, out_features, itemsize)
    else:
      run = self.sparse_seconds(num_rows, in_features, out_features, capacity, itemsize,
                                index_given=False)
    return self.branch_fixed_s + run

  def counted_wins(self, num_rows, in_features, out_features, plan, itemsize) -> bool:
    """Whether one counted run beats the branches over ``plan`` (the capacities, smallest
    first), each range of counts between two capacities taken as equally likely and
    represented by its middle."""
    counted = branched = 0.0
    smaller = 0
    for capacity in plan:
      count = (smaller + capacity) // 2
      counted += self.counted_seconds(num_rows, in_features, out_features, count, itemsize)
      branched += self.branched_seconds(num_rows, in_features, out_features, capacity,
                                        itemsize)
      smaller = capacity
    return counted < branched


GPU_COST_MODEL = GpuCostModel()


def choose_implementation(backend: str, *, num_rows: int, in_features: int,
                          out_features: int, top_n: int, itemsize: int, index_given: bool,
                          platform: str | None = None,
                          cost_model: GpuCostModel = GPU_COST_MODEL) -> str:
  """The implementation that runs one layer's backward.

  ``"dense"`` whenever nothing can be skipped (``top_n >= num_rows`` with no index given, or
  no rows at all); otherwise an explicit ``backend`` as given, and ``"auto"`` as the module
  docstring says (on a GPU, by ``cost_model``).
  """
  if num_rows == 0 or (top_n >= num_rows and not index_given):
    return "dense"
  if backend != "auto":
    return backend
  if (platform or jax.default_backend()) == "gpu" and not cost_model.sparse_wins(
      num_rows, in_features, out_features, top_n, itemsize, index_given):
    return "dense"
  return "xla"


def choose_counted(backend: str, *, plan: tuple[int, ...], num_rows: int, in_features: int,
                   out_features: int, itemsize: int, platform: str | None = None,
                   varying: bool = False) -> str | None:
  """The implementation that runs once, on an index of every candidate row, where ``plan``
  (the capacities, smallest first) leaves the choice to run time; None for a run-time branch
  between the capacities.

  An explicit ``backend`` runs once where its cost follows the rows it is handed
  (``follows_count``); ``"auto"`` runs :data:`COUNTED_BACKEND` once on a GPU, for 16-bit
  operands (the kernels' rates were fitted to those), where the cost model predicts it ahead
  of the branches, and not where ``varying`` (in a ``jax.shard_map`` with ``check_vma=True``,
  ``fsdp_loss``'s): a ``pallas_call`` there must say how each output varies over the
  devices, which its kernels do not.
  """
  if len(plan) < 2:
    return None
  if backend != "auto":
    return backend if get_implementation(backend).follows_count else None
  if (not varying and (platform or jax.default_backend()) == "gpu" and itemsize == 2
      and get_implementation(COUNTED_BACKEND).follows_count
      and GPU_COST_MODEL.counted_wins(num_rows, in_features, out_features, plan, itemsize)):
    return COUNTED_BACKEND
  return None
