"""Implementations of the linear layer's backward, registered by name.

Every implementation has one signature::

    fn(x, kernel, dy, active_rows, *, with_bias, precision, poison, dkernel_dtype)
        -> (dx, dkernel, dbias)

with ``x: [T, D]``, ``kernel: [D, N]``, ``dy: [T, N]`` and ``active_rows: int32[K]`` (sorted,
padded with the sentinel ``T``, as :func:`sebp_jax.selection.select_active_rows` makes it; None
for an implementation that keeps every row). It returns

* ``dx: [T, D]`` in x's dtype: ``dy[r] @ kernel.T`` for every kept row r, exactly 0 elsewhere;
* ``dkernel: [D, N]`` in ``dkernel_dtype`` (default: the accumulation dtype):
  ``x[rows].T @ dy[rows]``;
* ``dbias: [N]`` in the accumulation dtype, or None without bias: ``sum(dy[rows])``;

summed in :func:`accumulation_dtype` and rounded once: each matmul stores its own output
dtype, since a cast of a float32 result would be a pass of its own. ``poison``, a float32
scalar that is 0 or NaN (or None), must reach dkernel and dbias, and not dx (a NaN or an
active row that the index left out is not the kept rows': linear_backward makes its own row
of dx NaN).

Registered here:

* ``"dense"``: every row (``active_rows`` is ignored); also the baseline of the others;
* ``"xla"``: the dense backward of the kept rows, gathered and spread back in plain jnp;
* ``"pallas_triton"``: the Pallas kernels of ``pallas_kernels/sebp_matmul.py`` (Triton on
  GPU, interpreted elsewhere), which gather the kept rows inside their matmuls. Their work
  follows the index's rows, not its length: a block of sentinel slots exits at once.
* ``"pallas_mosaic"``: the kept rows copied by a Triton kernel, then multiplied by Mosaic GPU
  ``wgmma`` kernels over the count read on the device (``pallas_kernels/sebp_matmul_mgpu.py``;
  compiled on Hopper, interpreted on CPU); ``"pallas_triton"`` where those cannot run (another
  GPU, float32, widths off the tiles). Its work follows the count too.
* ``"pallas"``: ``"pallas_mosaic"`` on Hopper, ``"pallas_triton"`` elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, PartitionSpec as P

Array = jax.Array

Backward = Callable[..., tuple[Array, Array, Array | None]]


@dataclasses.dataclass(frozen=True)
class Implementation:
  """A registered backward, whether it takes the index of the kept rows (an implementation
  that keeps every row takes none), and whether its cost follows the rows the index lists
  rather than the index's length (``follows_count``: sentinel slots cost next to nothing, so
  one index as long as every row serves any count, with no branch between capacities)."""
  backward: Backward
  takes_index: bool
  follows_count: bool = False


_REGISTRY: dict[str, Implementation] = {}


def register_implementation(name: str, backward: Backward, *, takes_index: bool = True,
                            follows_count: bool = False, replace: bool = False) -> None:
  """Makes ``backward`` available as ``backend=name`` to every SEBP op.

  ``takes_index=False`` marks an implementation that keeps every row: it is handed no index
  (None). ``follows_count=True`` one whose cost follows the rows its index lists: where the
  capacity would be chosen at run time (``top_n="auto"``, ``overflow="exact"``), it is handed
  one index as long as every candidate row instead. A name already registered is refused
  unless ``replace``: the cost model relies on ``"dense"`` and ``"xla"`` being what this
  module registers.
  """
  if follows_count and not takes_index:
    raise ValueError("follows_count=True needs an implementation that takes an index")
  if name == "auto":
    raise ValueError("'auto' is the cost model's choice, not an implementation name")
  if name in _REGISTRY and not replace:
    raise ValueError(f"an implementation named {name!r} is registered already; pass "
                     "replace=True to replace it")
  _REGISTRY[name] = Implementation(backward, takes_index, follows_count)


def implementation_names() -> tuple[str, ...]:
  return tuple(_REGISTRY)


def get_implementation(name: str) -> Implementation:
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"backend must be 'auto' or one of {implementation_names()}, "
                     f"got {name!r}") from None


def accumulation_dtype(dtype) -> jnp.dtype:
  """float32 for 16-bit operands (and float32), float64 for float64 operands."""
  return jnp.promote_types(dtype, jnp.float32)


#: About how many rows each partial sum of :func:`sum_rows` adds up.
ROWS_PER_PARTIAL_SUM = 256


def sum_rows(a: Array, dtype) -> Array:
  """``sum(a, axis=0)`` of ``a: [T, F]`` in ``dtype``, as ``k`` interleaved partial sums of at least
  ``ROWS_PER_PARTIAL_SUM`` rows each (``k`` a power of two that divides T; odd T: 1).

  The same float32 sums as ``jnp.sum(a, axis=0, dtype=dtype)`` in another order. On a GPU XLA
  emits the single convert-and-sum of a 16-bit ``[T, F]`` as a slow reduction fusion, and
  autodiff's own 16-bit sum rounds as it adds; the two-level sum is neither.
  """
  num_rows, num_features = a.shape
  most_partials = max(1, num_rows // ROWS_PER_PARTIAL_SUM)
  num_partials = math.gcd(num_rows, 1 << (most_partials.bit_length() - 1))
  partials = jnp.sum(a.reshape(num_rows // num_partials, num_partials * num_features), axis=0,
                     dtype=dtype)
  return jnp.sum(partials.reshape(num_partials, num_features), axis=0)


def gather_rows(a: Array, rows: Array) -> Array:
  """``a[rows]`` for ``a: [T, F]`` and ``rows: int32[K]``, with zero rows for sentinel slots
  (``rows == T``)."""
  return jnp.take(a, rows, axis=0, mode="fill", fill_value=0, indices_are_sorted=True)


def spread_rows(kept: Array, rows: Array, num_rows: int) -> Array:
  """For ``kept: [K, F]``, the ``[T, F]`` array with ``kept[k]`` in row ``rows[k]`` and exact
  zeros elsewhere.

  A gather through the inverse index (each row looks up its slot, or the out-of-range slot K
  and reads zeros) rather than a scatter into zeros: XLA fuses a gather into whatever consumes
  dX (a residual sum, a norm's backward), while a scatter is a kernel of its own after a fill.
  """
  num_slots = rows.shape[0]
  slot_of_row = jnp.full((num_rows,), num_slots, jnp.int32).at[rows].set(
      jnp.arange(num_slots, dtype=jnp.int32), mode="drop", indices_are_sorted=True)
  return jnp.take(kept, slot_of_row, axis=0, mode="fill", fill_value=0)


def dense_backward(x, kernel, dy, active_rows=None, *, with_bias, precision=None, poison=None,
                   dkernel_dtype=None):
  """Every row kept. A NaN/Inf anywhere in dY reaches dW and db by itself, so ``poison`` and
  ``active_rows`` are not needed."""
  del active_rows, poison
  accumulate = accumulation_dtype(dy.dtype)
  dx = lax.dot_general(dy, kernel, (((1,), (1,)), ((), ())), precision=precision,
                       preferred_element_type=x.dtype)
  dkernel = lax.dot_general(x, dy, (((0,), (0,)), ((), ())), precision=precision,
                            preferred_element_type=dkernel_dtype or accumulate)
  dbias = sum_rows(dy, accumulate) if with_bias else None
  return dx, dkernel, dbias


def with_poison(dkernel: Array, dbias: Array | None,
                poison: Array | None) -> tuple[Array, Array | None]:
  """dW and db with ``poison`` added, after the matmuls: a NaN in a row left out reaches the
  sums over rows, never the kept rows' dX."""
  if poison is None:
    return dkernel, dbias
  return (dkernel + poison.astype(dkernel.dtype),
          None if dbias is None else dbias + poison.astype(dbias.dtype))


def xla_backward(x, kernel, dy, active_rows, *, with_bias, precision=None, poison=None,
                 dkernel_dtype=None):
  """The dense backward of the kept rows, dX spread back to all T rows; ``poison`` added to
  dW and db, which the rows left out would have reached, not to the kept rows' dX."""
  dx_kept, dkernel, dbias = dense_backward(gather_rows(x, active_rows), kernel,
                                           gather_rows(dy, active_rows), with_bias=with_bias,
                                           precision=precision, dkernel_dtype=dkernel_dtype)
  return (spread_rows(dx_kept, active_rows, x.shape[0]),
          *with_poison(dkernel, dbias, poison))


def pallas_triton_backward(x, kernel, dy, active_rows, *, with_bias, precision=None,
                           poison=None, dkernel_dtype=None):
  """The gathering Pallas kernels (Triton on GPU): dX as its kept rows, spread by the fusible
  gather of ``"xla"`` (which reads no sentinel slot, so the kernel leaves their blocks
  unwritten); the poison as the start of the dW kernel's sums."""
  import pallas_kernels  # Lazily: the other implementations must not pay for its import.

  interpret = jax.default_backend() != "gpu"
  dx_kept = pallas_kernels.gathered_dx(dy, kernel, active_rows, precision=precision,
                                       interpret=interpret, zero_sentinel_slots=False)
  accumulate = accumulation_dtype(dy.dtype)
  dkernel, dbias = pallas_kernels.gathered_dw_db(
      x, dy, active_rows, with_bias=with_bias, poison=poison, precision=precision,
      interpret=interpret, dw_dtype=dkernel_dtype or accumulate, db_dtype=accumulate)
  return spread_rows(dx_kept.astype(x.dtype), active_rows, x.shape[0]), dkernel, dbias


def varying_axes(array: Array) -> frozenset[str]:
  """The manual mesh axes ``array`` varies over: inside a ``jax.shard_map`` with
  ``check_vma=True``, those its values differ across; empty elsewhere."""
  manual = getattr(jax.typeof(array), "manual_axis_type", None)
  return frozenset() if manual is None else frozenset(manual.varying)


def checks_varying_axes(*arrays: Array) -> bool:
  """Whether this traces inside a ``jax.shard_map`` with ``check_vma=True``, where a
  ``pallas_call`` must say how each output varies over the devices: JAX's own flag, which
  ``pallas_call`` reads (private: on a version without it, whether any of ``arrays``
  varies)."""
  from jax._src import config
  flag = getattr(config, "_check_vma", None)
  if flag is not None:
    return bool(flag.value)
  return any(varying_axes(a) for a in arrays)


def explicit_axes(mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh) -> tuple[str, ...]:
  """The axes of ``mesh`` that are ``Explicit`` (not manual, not ``Auto``)."""
  return tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types)
               if kind == AxisType.Explicit)


def explicit_axes_in_context() -> tuple[str, ...]:
  """The ``Explicit`` axes of the mesh this traces under (``jax.set_mesh``, less the manual
  axes of a ``jax.shard_map``)."""
  return explicit_axes(jax.sharding.get_abstract_mesh())


def with_explicit_axes_auto(fn: Callable, out_sharding) -> Callable:
  """``fn`` with the context mesh's ``Explicit`` axes made ``Auto`` around it
  (``jax.sharding.auto_axes``: XLA partitions it), its outputs typed by ``out_sharding``, a
  pytree of specs; ``fn`` itself where no axis is ``Explicit``. Arrays go in positionally:
  ``auto_axes`` moves its positional arguments onto the new mesh."""
  explicit = explicit_axes_in_context()
  if not explicit:
    return fn
  return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=out_sharding)


def _with_auto_axes(backward: Backward) -> Backward:
  """``backward`` (Pallas kernels) under :func:`with_explicit_axes_auto`. Inside
  :func:`sebp_jax.sharding.map_row_shards`'s ``shard_map`` the axes the rows are not split
  over stay ``Explicit`` (where the rows are not split at all, :func:`sebp_jax.ops.sebp_linear`
  makes them ``Auto`` around the whole backward); a ``pallas_call`` refuses operands typed as
  split ("requires all mesh axes to be Manual"), and JAX's interpreter fails on a ``pl.when``
  there (its ``cond`` types its outputs on no mesh, which the ``dynamic_update_slice``
  writing the block back refuses). The gradients come back typed as the arrays they are the
  gradients of.
  """
  @functools.wraps(backward)
  def run(x, kernel, dy, active_rows, *, with_bias, precision=None, poison=None,
          dkernel_dtype=None):
    kernel_spec = jax.typeof(kernel).sharding.spec
    bias_spec = P(kernel_spec[1] if len(kernel_spec) > 1 else None)
    specs = (jax.typeof(x).sharding.spec, kernel_spec, bias_spec if with_bias else None)
    return with_explicit_axes_auto(
        lambda x, kernel, dy, active_rows, poison: backward(
            x, kernel, dy, active_rows, with_bias=with_bias, precision=precision,
            poison=poison, dkernel_dtype=dkernel_dtype),
        specs)(x, kernel, dy, active_rows, poison)
  return run


def on_hopper() -> bool:
  """Whether the default device is a Hopper GPU (sm_90), where Mosaic GPU's kernels run."""
  device = jax.devices()[0]
  return device.platform == "gpu" and getattr(device, "compute_capability", None) == "9.0"


def mosaic_takes(x, kernel, dy) -> bool:
  """Whether the Mosaic GPU kernels take these operands: one 16-bit dtype and widths their
  tiles divide, with 64-bit types off (Mosaic's pipeline mixes 64- and 32-bit step counts
  under ``jax_enable_x64``)."""
  from pallas_kernels import sebp_matmul_mgpu  # Lazily, as in pallas_triton_backward.

  return (x.dtype == kernel.dtype == dy.dtype and not jax.config.jax_enable_x64
          and sebp_matmul_mgpu.supports_shapes(*kernel.shape, kernel.dtype))


def pallas_mosaic_backward(x, kernel, dy, active_rows, *, with_bias, precision=None,
                           poison=None, dkernel_dtype=None):
  """The kept rows copied by a Triton kernel, then Mosaic GPU matmuls over the run-time count
  (compiled on Hopper, interpreted on CPU); ``"pallas_triton"`` for operands they do not take
  and on other GPUs. dX comes as the kept rows in slot order, spread as there."""
  hopper_or_cpu = on_hopper() or jax.default_backend() == "cpu"
  if not (hopper_or_cpu and mosaic_takes(x, kernel, dy)):
    return pallas_triton_backward(x, kernel, dy, active_rows, with_bias=with_bias,
                                  precision=precision, poison=poison,
                                  dkernel_dtype=dkernel_dtype)
  from pallas_kernels import sebp_matmul_mgpu

  num_rows = x.shape[0]
  accumulate = accumulation_dtype(dy.dtype)
  dx_kept, dkernel, dbias = sebp_matmul_mgpu.kept_rows_backward(
      x, kernel, dy, active_rows, with_bias=with_bias,
      dw_dtype=dkernel_dtype or accumulate, db_dtype=accumulate,
      interpret=jax.default_backend() != "gpu")
  dkernel, dbias = with_poison(dkernel, dbias, poison)
  rows = jnp.pad(active_rows.astype(jnp.int32), (0, dx_kept.shape[0] - active_rows.shape[0]),
                 constant_values=num_rows)
  return spread_rows(dx_kept.astype(x.dtype), rows, num_rows), dkernel, dbias


def pallas_backward(x, kernel, dy, active_rows, *, with_bias, precision=None, poison=None,
                    dkernel_dtype=None):
  """The Pallas kernels chosen by device: ``"pallas_mosaic"`` on Hopper, where it is the
  faster, else ``"pallas_triton"`` (interpreted on CPU)."""
  backward = pallas_mosaic_backward if on_hopper() else pallas_triton_backward
  return backward(x, kernel, dy, active_rows, with_bias=with_bias, precision=precision,
                  poison=poison, dkernel_dtype=dkernel_dtype)


register_implementation("dense", dense_backward, takes_index=False)
register_implementation("xla", xla_backward)
register_implementation("pallas", _with_auto_axes(pallas_backward), follows_count=True)
register_implementation("pallas_triton", _with_auto_axes(pallas_triton_backward),
                        follows_count=True)
register_implementation("pallas_mosaic", _with_auto_axes(pallas_mosaic_backward),
                        follows_count=True)
