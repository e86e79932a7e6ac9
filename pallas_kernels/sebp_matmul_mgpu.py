"""SEBP backward matmuls whose work follows a run-time row count, for Hopper's Mosaic GPU.

The same products as ``sebp_matmul`` (see there for the index convention)::

  dx_kept[k] = dy[active_rows[k]] @ kernel.T
  dW         = sum_r x[r].T @ dy[r]
  db         = sum_r dy[r]

in two steps:

1. ``compact_kept_rows`` (Triton) copies the listed rows of ``dy`` into ``dy_kept: [K, N]`` and
   those of ``x`` into ``x_kept_t: [D, K]`` (transposed: dW's left operand then needs no
   transposed shared-memory view), and sums the rows of dy per block for db. Mosaic GPU cannot
   gather rows into a ``wgmma`` operand on Hopper (the TMA gather is sm_100 only), so the gather
   is a Triton kernel here, as on every other card.
2. Two Mosaic GPU kernels (``wgmma`` fed by a TMA pipeline) multiply the compact rows. Their
   tile loops run over the count read from device memory: dX's grid covers
   ``ceil(count / block_m)`` row tiles, dW's reduction ``ceil(count / block_k)`` steps.

Every slot from the count up to the end of its copy block is written as zero rows, so the
matmuls read only finite rows; the first block is always copied, so that db's sums exist at
count 0. Slots past that are never written nor read.

jax's GPU interpreter (CPU) does not model a transposed ``wgmma`` operand, so interpreted runs
feed ``kernel.T`` from memory where the compiled dX kernel reads ``kernel`` through
``kernel_smem.T`` (a transposed view); everything else runs the same code both ways.

Layout: block sizes, kernel bodies, calls, public function, reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plmgpu
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.sebp_matmul import index_int32


@dataclasses.dataclass(frozen=True)
class MatmulTiles:
  """Tiles of one count-following matmul: a ``[block_m, block_n]`` output tile per loop step,
  reduced in steps of ``block_k`` through a TMA pipeline ``max_concurrent_steps`` deep;
  ``split_k > 1`` (dW only) splits the reduction over that many tile loops, their float32
  partial sums added afterwards, which keeps every SM busy when the output has few tiles."""

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  max_concurrent_steps: int = 4
  split_k: int = 1

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      size = getattr(self, name)
      if size < 64 or size & (size - 1):
        raise ValueError(f"{name}={size} must be a power of two >= 64")
    if self.max_concurrent_steps < 2 or self.split_k < 1:
      raise ValueError(f"max_concurrent_steps={self.max_concurrent_steps} must be >= 2 (a step's "
                       f"buffers are released one step late) and split_k={self.split_k} >= 1")


@dataclasses.dataclass(frozen=True)
class MosaicBlockSizes:
  """Tiles of the count-following backward.

  * ``copy_rows``: slots per program of the row copy, and the granularity to which the slots
    past the count are zero-filled: a multiple of ``dx.block_m`` and ``dw.block_k``.
  * ``dx``: dX's matmul, tiles of kept rows (``block_m``) by D (``block_n``), reduced over N.
  * ``dw``: dW's matmul, tiles of D (``block_m``) by N (``block_n``), reduced over kept rows.
  """

  copy_rows: int = 128
  # Defaults from benchmarks/tune_blocks.py --kernels mosaic (bf16, T=16384, 2% and 20% kept).
  dx: MatmulTiles = MatmulTiles(block_m=128, block_n=128, block_k=64, max_concurrent_steps=6)
  dw: MatmulTiles = MatmulTiles(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4)

  def __post_init__(self):
    if self.copy_rows < 64 or self.copy_rows & (self.copy_rows - 1):
      raise ValueError(f"copy_rows={self.copy_rows} must be a power of two >= 64")
    if self.copy_rows % self.dx.block_m or self.copy_rows % self.dw.block_k:
      raise ValueError(f"copy_rows={self.copy_rows} must be a multiple of dx.block_m="
                       f"{self.dx.block_m} and dw.block_k={self.dw.block_k}")
    if self.dx.split_k != 1:
      raise ValueError(f"dx.split_k={self.dx.split_k}: only dW's reduction splits")


#: The most ways dW's reduction is split by default.
MAX_SPLIT_K = 4


def default_block_sizes(d: int, n: int, num_sms: int) -> MosaicBlockSizes:
  """The default tiles, dW's reduction split where ``[d, n]`` has fewer output tiles than the
  GPU has SMs (up to ``MAX_SPLIT_K`` ways)."""
  blocks = MosaicBlockSizes()
  num_tiles = (d // blocks.dw.block_m) * (n // blocks.dw.block_n)
  split_k = max(1, min(MAX_SPLIT_K, num_sms // max(num_tiles, 1)))
  return dataclasses.replace(blocks, dw=dataclasses.replace(blocks.dw, split_k=split_k))


def supports_shapes(d: int, n: int, dtype, block_sizes: MosaicBlockSizes | None = None) -> bool:
  """Whether these kernels take a layer of ``kernel: [d, n]`` in ``dtype``: 16-bit operands
  (``wgmma`` in float32 would be tf32) and both widths whole, non-zero multiples of the
  tiles."""
  blocks = block_sizes or MosaicBlockSizes()
  return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
          and d > 0 and n > 0 and d % blocks.dx.block_n == 0 and n % blocks.dx.block_k == 0
          and d % blocks.dw.block_m == 0 and n % blocks.dw.block_n == 0)


# ---------------------------------------------------------------------------
# Kernel bodies.
# ---------------------------------------------------------------------------


def _compact_rows_kernel(count_ref, active_rows_ref, src_ref, out_ref, *sums_ref,
                         copy_rows: int, block_cols: int, transpose: bool):
  """Copies rows ``active_rows[s]`` of ``src`` to slot s of ``out`` (its columns if
  ``transpose``); slots past the count get zeros. With ``sums_ref`` also the per-block column
  sums of what it wrote."""
  row_block, col_block = pl.program_id(0), pl.program_id(1)
  num_src_rows = src_ref.shape[0]

  # Block 0 always runs: db reads its sums at count 0 too.
  @pl.when((row_block == 0) | (row_block * copy_rows < count_ref[0]))
  def _copy():
    slots = row_block * copy_rows + jnp.arange(copy_rows, dtype=jnp.int32)
    rows = pltriton.load(active_rows_ref.at[slots])
    live = (slots < count_ref[0]) & (rows < num_src_rows)
    cols = col_block * block_cols + jnp.arange(block_cols, dtype=jnp.int32)
    tile = pltriton.load(src_ref.at[jnp.where(live, rows, 0)[:, None], cols[None, :]],
                         mask=live[:, None], other=0.0)
    if transpose:
      pltriton.store(out_ref.at[cols[:, None], slots[None, :]], tile.T)
    else:
      pltriton.store(out_ref.at[slots[:, None], cols[None, :]], tile)
    if sums_ref:
      pltriton.store(sums_ref[0].at[row_block, cols], jnp.sum(tile.astype(jnp.float32), axis=0))


def _kept_dx_body(count_gmem, dy_gmem, kernel_gmem, dx_gmem, *, blocks: MatmulTiles,
                  kernel_transposed: bool):
  """``dx[s] = dy_kept[s] @ kernel.T`` for the row tiles up to the count."""
  n = dy_gmem.shape[1]
  d = dx_gmem.shape[1]
  block_m, block_n, block_k = blocks.block_m, blocks.block_n, blocks.block_k
  num_d_tiles = d // block_n
  live_row_tiles = lax.div(count_gmem[0] + (block_m - 1), jnp.int32(block_m))

  @plmgpu.nd_loop((live_row_tiles * num_d_tiles,), collective_axes="sm")
  def _tile(loop_info):
    m_i = lax.div(loop_info.index[0], jnp.int32(num_d_tiles))
    d_i = lax.rem(loop_info.index[0], jnp.int32(num_d_tiles))

    def accumulate(acc_ref):
      def step(_, dy_smem, kernel_smem):
        rhs = kernel_smem if kernel_transposed else kernel_smem.T
        plmgpu.wgmma(acc_ref, dy_smem, rhs)

      kernel_spec = (
          plmgpu.BlockSpec((block_k, block_n), lambda k: (k, d_i), delay_release=1)
          if kernel_transposed else
          plmgpu.BlockSpec((block_n, block_k), lambda k: (d_i, k), delay_release=1))
      plmgpu.emit_pipeline(
          step, grid=(n // block_k,),
          in_specs=[plmgpu.BlockSpec((block_m, block_k), lambda k: (m_i, k), delay_release=1),
                    kernel_spec],
          max_concurrent_steps=blocks.max_concurrent_steps,
      )(dy_gmem, kernel_gmem)
      return acc_ref[...]

    acc = pl.run_scoped(accumulate, plmgpu.ACC((block_m, block_n)))
    _store_tile(acc, dx_gmem.at[pl.ds(m_i * block_m, block_m), pl.ds(d_i * block_n, block_n)])


def _kept_dw_body(count_gmem, x_kept_t_gmem, dy_gmem, dw_gmem, *, blocks: MatmulTiles):
  """``dW[split] = x_kept_t[:, rows] @ dy_kept[rows]`` over this split's share of the
  ``ceil(count / block_k)`` row steps (at least one)."""
  d = x_kept_t_gmem.shape[0]
  n = dy_gmem.shape[1]
  block_m, block_n, block_k = blocks.block_m, blocks.block_n, blocks.block_k
  num_n_tiles = n // block_n
  num_tiles = (d // block_m) * num_n_tiles
  num_steps = jnp.maximum(
      lax.div(count_gmem[0] + (block_k - 1), jnp.int32(block_k)), 1)
  steps_per_split = lax.div(num_steps + (blocks.split_k - 1), jnp.int32(blocks.split_k))

  @plmgpu.nd_loop((blocks.split_k * num_tiles,), collective_axes="sm")
  def _tile(loop_info):
    split = lax.div(loop_info.index[0], jnp.int32(num_tiles))
    tile = lax.rem(loop_info.index[0], jnp.int32(num_tiles))
    d_i = lax.div(tile, jnp.int32(num_n_tiles))
    n_i = lax.rem(tile, jnp.int32(num_n_tiles))
    first_step = split * steps_per_split
    split_steps = jnp.clip(num_steps - first_step, 0, steps_per_split)

    def accumulate(acc_ref):
      @pl.when(split_steps > 0)
      def _reduce():
        plmgpu.emit_pipeline(
            lambda _, x_smem, dy_smem: plmgpu.wgmma(acc_ref, x_smem, dy_smem),
            grid=(split_steps,),
            in_specs=[
                plmgpu.BlockSpec((block_m, block_k), lambda k: (d_i, first_step + k),
                                 delay_release=1),
                plmgpu.BlockSpec((block_k, block_n), lambda k: (first_step + k, n_i),
                                 delay_release=1)],
            max_concurrent_steps=blocks.max_concurrent_steps,
        )(x_kept_t_gmem, dy_gmem)
      return acc_ref[...]

    acc = pl.run_scoped(accumulate, plmgpu.ACC((block_m, block_n)))
    _store_tile(acc, dw_gmem.at[split, pl.ds(d_i * block_m, block_m),
                                pl.ds(n_i * block_n, block_n)])


def _store_tile(acc, out_gmem):
  """Registers to ``out_gmem`` through shared memory and the TMA."""
  def store(out_smem):
    out_smem[...] = acc.astype(out_smem.dtype)
    plmgpu.commit_smem()
    plmgpu.copy_smem_to_gmem(out_smem, out_gmem)
    plmgpu.wait_smem_to_gmem(0, wait_read_only=True)

  pl.run_scoped(store, plmgpu.SMEM(acc.shape, out_gmem.dtype))


# ---------------------------------------------------------------------------
# Calls.
# ---------------------------------------------------------------------------


def _num_sms(interpret) -> int:
  # The interpreter simulates each SM as a thread: two are enough to exercise the loops' split.
  return 2 if interpret else jax.devices()[0].core_count


def _interpret_params(interpret: bool):
  if not interpret:
    return None
  from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
  return InterpretGPUParams()


def _mosaic_kernel(body, out_type, interpret: bool):
  return plmgpu.kernel(
      body, out_type=out_type, grid=(_num_sms(interpret),), grid_names=("sm",),
      compiler_params=plmgpu.CompilerParams(
          lowering_semantics=plmgpu.LoweringSemantics.Warpgroup),
      interpret=_interpret_params(interpret))


def _compact(count, active_rows, src, *, transpose: bool, with_sums: bool,
             copy_rows: int, interpret: bool):
  num_slots = active_rows.shape[0]
  num_cols = src.shape[1]
  block_cols = 128 if num_cols % 128 == 0 else 64
  out_shape = [jax.ShapeDtypeStruct(
      (num_cols, num_slots) if transpose else (num_slots, num_cols), src.dtype)]
  if with_sums:
    out_shape.append(jax.ShapeDtypeStruct((num_slots // copy_rows, num_cols), jnp.float32))
  return pl.pallas_call(
      functools.partial(_compact_rows_kernel, copy_rows=copy_rows, block_cols=block_cols,
                        transpose=transpose),
      grid=(num_slots // copy_rows, num_cols // block_cols),
      out_shape=out_shape,
      compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="sebp_compact_rows_t" if transpose else "sebp_compact_rows",
  )(count, active_rows, src)


# ---------------------------------------------------------------------------
# Public function.
# ---------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("with_bias", "dw_dtype", "db_dtype",
                                             "block_sizes", "interpret"))
def kept_rows_backward(
    x: jax.Array, kernel: jax.Array, dy: jax.Array, active_rows: jax.Array, *,
    with_bias: bool, dw_dtype=None, db_dtype=None,
    block_sizes: MosaicBlockSizes | None = None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
  """The SEBP backward of ``y = x @ kernel + b`` at the rows ``active_rows`` lists.

  Args:
    x: ``[T, D]`` layer input, bfloat16 or float16.
    kernel: ``[D, N]`` weight, in x's dtype.
    dy: ``[T, N]`` output cotangent, in x's dtype.
    active_rows: ``int32[K]`` selected rows, sorted ascending, padded at the end with the
      sentinel ``T``; the count of listed rows is read on the device.
    with_bias: also return db.
    dw_dtype, db_dtype: dtypes of dW and db (None: x's and dy's).
    block_sizes: tiles; see ``MosaicBlockSizes`` (default: ``default_block_sizes``).
    interpret: run both backends' interpreters (CPU) instead of compiling.

  Returns:
    ``(dx_kept, dW, db)``: ``dx_kept: [K', D]`` in dy's dtype with ``K' >= K`` (K rounded up to
    whole copy blocks) holds ``dy[active_rows[k]] @ kernel.T`` in slot k for every listed row,
    and is unspecified in the other slots; dW ``[D, N]``; db ``[N]`` or None. Sums in float32.
  """
  num_rows, d = x.shape
  n = dy.shape[1]
  blocks = block_sizes or default_block_sizes(d, n, _num_sms(interpret))
  if kernel.shape != (d, n) or dy.shape[0] != num_rows:
    raise ValueError(f"x {x.shape}, kernel {kernel.shape} and dy {dy.shape} do not form "
                     "a linear layer's backward")
  if not (x.dtype == kernel.dtype == dy.dtype) or not supports_shapes(d, n, x.dtype, blocks):
    raise ValueError(
        f"x, kernel and dy must share one 16-bit dtype, with D={d} and N={n} multiples of the "
        f"tiles {blocks}; got {x.dtype}, {kernel.dtype}, {dy.dtype}")
  num_slots = max(1, pl.cdiv(active_rows.shape[0], blocks.copy_rows)) * blocks.copy_rows
  active_rows = jnp.pad(index_int32(active_rows, num_rows),
                        (0, num_slots - active_rows.shape[0]), constant_values=num_rows)
  count = jnp.sum(active_rows < num_rows, dtype=jnp.int32).reshape(1)
  copy = functools.partial(_compact, count, active_rows, copy_rows=blocks.copy_rows,
                           interpret=interpret)
  x_kept_t, = copy(x, transpose=True, with_sums=False)
  dy_kept, *block_sums = copy(dy, transpose=False, with_sums=with_bias)

  kernel_transposed = interpret
  dx_kept = _mosaic_kernel(
      functools.partial(_kept_dx_body, blocks=blocks.dx, kernel_transposed=kernel_transposed),
      jax.ShapeDtypeStruct((num_slots, d), dy.dtype), interpret,
  )(count, dy_kept, kernel.T if kernel_transposed else kernel)

  dw_out = jnp.dtype(dw_dtype or x.dtype)
  dw_parts = _mosaic_kernel(
      functools.partial(_kept_dw_body, blocks=blocks.dw),
      jax.ShapeDtypeStruct((blocks.dw.split_k, d, n),
                           dw_out if blocks.dw.split_k == 1 else jnp.float32), interpret,
  )(count, x_kept_t, dy_kept)
  dw = dw_parts[0] if blocks.dw.split_k == 1 else dw_parts.sum(axis=0).astype(dw_out)

  db = None
  if with_bias:
    copied = jnp.arange(num_slots // blocks.copy_rows) * blocks.copy_rows < jnp.maximum(count, 1)
    db = jnp.sum(jnp.where(copied[:, None], block_sums[0], 0), axis=0).astype(
        db_dtype or dy.dtype)
  return dx_kept, dw, db


# ---------------------------------------------------------------------------
# Reference.
# ---------------------------------------------------------------------------


def kept_rows_backward_reference(x, kernel, dy, active_rows, *, with_bias: bool):
  """Reference for ``kept_rows_backward`` in float32: ``(dx_kept [K, D], dW, db or None)``,
  sentinel slots of dx_kept zero."""
  dy_rows = dy.at[active_rows].get(mode="fill", fill_value=0).astype(jnp.float32)
  x_rows = x.at[active_rows].get(mode="fill", fill_value=0).astype(jnp.float32)
  listed = (active_rows < x.shape[0])[:, None]
  dx = jnp.where(listed, jnp.dot(dy_rows, kernel.astype(jnp.float32).T,
                                 precision=lax.Precision.HIGHEST), 0)
  dw = jnp.dot(x_rows.T, dy_rows, precision=lax.Precision.HIGHEST)
  db = jnp.sum(jnp.where(listed, dy_rows, 0), axis=0) if with_bias else None
  return dx, dw, db
