"""Gathered matmuls for the SEBP backward pass of a linear layer, in Pallas.

The forward is ``y = x @ kernel + bias`` with ``x: [T, D]``, ``kernel: [D, N]``.
The SEBP backward keeps only the rows of ``dy: [T, N]`` listed in
``active_rows: int32[K]`` (sorted ascending, padded at the end with the
out-of-range sentinel ``T``) and computes

  dx_kept[k] = dy[active_rows[k]] @ kernel.T   (0 in sentinel slots)
  dW         = sum_r x[r].T @ dy[r]
  db         = sum_r dy[r]

The kernels gather the selected rows straight from ``dy`` / ``x`` in device
memory (integer-array indexers on the leading dimension of whole-array refs),
so no gathered copy of either is ever materialised. dx comes as the ``K`` kept
rows in slot order: the caller spreads them to their ``T`` rows where dx is
consumed, which fuses there instead of costing a pass over zero rows.

They target the Pallas Triton backend (selected through
``plgpu.CompilerParams``); since jax 0.11 that backend is deprecated, which is
why everything backend-specific stays inside this module behind
``gathered_dx`` and ``gathered_dw_db``. Nothing here is Hopper-only: Triton
picks the matrix instructions for the card it compiles for (sm_80 and up).

Layout: kernel bodies, pallas_call wrappers, public functions, references.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile shape and launch parameters of one gathered-matmul kernel.

  Both kernels tile the same three axes: ``block_rows`` selected rows,
  ``block_d`` input features (columns of ``x`` / rows of ``kernel``) and
  ``block_n`` output features (columns of ``dy``).

  * ``gathered_dx``: each program computes a ``[block_rows, block_d]`` tile of
    dx, stepping over N by ``block_n``.
  * ``gathered_dw_db``: each program computes a ``[block_d, block_n]`` tile of
    dW, stepping over the selected rows by ``block_rows``; ``split_rows > 1``
    splits that reduction over several programs (float32 partial sums added
    afterwards), which keeps the GPU busy when D * N has few tiles.

  Every block dimension must be a power of two >= 16 (Triton's dot needs 16).
  """

  block_rows: int = 64
  block_d: int = 128
  block_n: int = 64
  split_rows: int = 1
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    # Triton launches a power-of-two number of warps, at most 32 (1,024 threads).
    for name, smallest, power_of_two in (
        ("block_rows", 16, True), ("block_d", 16, True), ("block_n", 16, True),
        ("split_rows", 1, False), ("num_warps", 1, True), ("num_stages", 1, False)):
      value = getattr(self, name)
      if (not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_))
          or value < smallest
          or (power_of_two and value & (value - 1)) or (name == "num_warps" and value > 32)):
        kind = "a power of two" if power_of_two else "an int"
        largest = ", at most 32" if name == "num_warps" else ""
        raise ValueError(f"{name}={value!r} must be {kind} >= {smallest}{largest}")
      object.__setattr__(self, name, int(value))  # numpy's ints hash and print as ints


# Default tiles per layer-shape class, for 2-byte operands (benchmarks/tune_blocks.py
# searches them).
# dx is keyed by its reduction length N, then its width D: long reductions
# amortise a wide tile, unless D is too narrow to give every SM tiles of it.
# dW is keyed by its tile count D * N: small layers split the row reduction to
# occupy every SM. dW loads each step's row indices inside its loop, and that
# indirect load takes pipeline stages of its own, so dW needs deeper pipelines
# than dx.
_DX_DEFAULTS = (  # (smallest N, smallest D, blocks)
    (2048, 2048, BlockSizes(block_rows=128, block_d=256, block_n=64,
                            num_warps=8, num_stages=3)),
    (2048, 0, BlockSizes(block_rows=64, block_d=128, block_n=64,
                         num_warps=4, num_stages=3)),
    (0, 0, BlockSizes(block_rows=128, block_d=128, block_n=32,
                      num_warps=4, num_stages=5)),
)
_DW_DEFAULTS = (  # (smallest D * N, blocks)
    (2**24, BlockSizes(block_rows=64, block_d=128, block_n=128,
                       num_warps=8, num_stages=5)),
    (2**22, BlockSizes(block_rows=64, block_d=128, block_n=128,
                       num_warps=4, num_stages=5)),
    (0, BlockSizes(block_rows=64, block_d=64, block_n=128, split_rows=4,
                   num_warps=4, num_stages=4)),
)


def default_block_sizes(kernel: str, d: int, n: int,
                        dtype=jnp.bfloat16) -> BlockSizes:
  """Default tiles for ``kernel`` ("dx" or "dw") at ``D=d, N=n``.

  The table is for 2-byte operands; for 4-byte ones the reduction step is
  halved so the pipelined shared-memory buffers stay within an sm_80's
  163 KiB a block.
  """
  wide = jnp.dtype(dtype).itemsize > 2
  if kernel == "dx":
    blocks = next(b for min_n, min_d, b in _DX_DEFAULTS
                  if n >= min_n and d >= min_d)
    return (dataclasses.replace(blocks, block_n=max(16, blocks.block_n // 2))
            if wide else blocks)
  if kernel == "dw":
    blocks = next(b for min_size, b in _DW_DEFAULTS if d * n >= min_size)
    return (dataclasses.replace(blocks,
                                block_rows=max(16, blocks.block_rows // 2))
            if wide else blocks)
  raise ValueError(f"unknown kernel {kernel!r}")


def _iota(size: int) -> jax.Array:
  """``0 .. size - 1`` as int32, also under ``jax_enable_x64``: the kernels' row and column
  indices stay 32-bit (``test_offsets_beyond_int32`` covers element offsets past 2**31)."""
  return jnp.arange(size, dtype=jnp.int32)


def _check_operand_dtypes(**operands) -> None:
  """The kernels sum in float32: float64 operands would silently lose precision."""
  for name, operand in operands.items():
    if operand.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
      raise ValueError(
          f"{name} must be float32, bfloat16 or float16 (the kernels accumulate in float32), "
          f"got {operand.dtype}; sebp_jax's backend='xla' handles float64")


def index_int32(active_rows: jax.Array, num_rows: int) -> jax.Array:
  """``active_rows`` as the kernels read it, int32[K]: a 1-D integer index (a float would be
  truncated into rows), entries of a wider dtype past ``num_rows`` clipped to it, the
  sentinel, before narrowing (a uint32 past 2**31 would wrap to a negative row). Its order
  cannot be checked on a traced index: one out of order reads unspecified rows (``sebp_jax``
  sorts its indices before they reach a kernel)."""
  dtype = jnp.dtype(active_rows.dtype)
  if active_rows.ndim != 1 or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"active_rows must be a 1-D integer index, got {dtype}"
                     f"{list(active_rows.shape)}")
  if jnp.iinfo(dtype).max > jnp.iinfo(jnp.int32).max:
    active_rows = jnp.clip(active_rows, 0 if jnp.iinfo(dtype).min == 0 else -1, num_rows)
  return active_rows.astype(jnp.int32)


def _fit(block: int, dim: int) -> int:
  """Shrinks a block to the smallest power of two >= 16 covering ``dim``."""
  return min(block, max(16, pl.next_power_of_2(dim)))


def _dot_precision(precision, *dtypes):
  # Triton lowers Precision.DEFAULT on float32 operands to tf32; SEBP promises
  # full float32 unless the caller asks otherwise.
  if precision is None and any(jnp.dtype(d) == jnp.float32 for d in dtypes):
    return lax.Precision.HIGHEST
  return precision


def _dot_f32(a, b, *, contract_a: int, contract_b: int, precision):
  """``a`` · ``b`` over the given axes, accumulated in float32."""
  return lax.dot_general(
      a, b, (((contract_a,), (contract_b,)), ((), ())),
      precision=precision, preferred_element_type=jnp.float32)


# ---------------------------------------------------------------------------
# Kernel bodies.
# ---------------------------------------------------------------------------


def _load_rows(active_rows_ref, first, count: int, sentinel: int):
  """``active_rows[first : first + count]``, the sentinel past slot K - 1."""
  idx = first + _iota(count)
  return plgpu.load(active_rows_ref.at[idx],
                    mask=idx < active_rows_ref.shape[0], other=sentinel)


def _lower_bound(active_rows_ref, values):
  """Per value (scalar or vector), the first slot of the sorted
  ``active_rows`` holding a row >= it (K if none).

  A branch-free binary search (bit_length(K) steps of one gather each), so
  the count of selected rows needs no separate XLA op before the launch.
  """
  num_slots = active_rows_ref.shape[0]
  lo = jnp.zeros_like(values)
  hi = jnp.full_like(values, num_slots)
  for _ in range(num_slots.bit_length()):
    mid = (lo + hi) // 2
    at_mid = plgpu.load(active_rows_ref.at[jnp.minimum(mid, num_slots - 1)])
    searching = lo < hi
    go_right = searching & (at_mid < values)
    lo = jnp.where(go_right, mid + 1, lo)
    hi = jnp.where(searching & ~go_right, mid, hi)
  return lo


def _gathered_dx_kernel(
    active_rows_ref,  # int32[K], K >= 1
    dy_ref,  # [T, N]
    kernel_ref,  # [D, N]
    dx_ref,  # [K, D] (output)
    *, block_sizes: BlockSizes, compute_dtype, precision, zero_sentinel_slots: bool):
  num_rows, n = dy_ref.shape
  d = kernel_ref.shape[0]
  num_slots = active_rows_ref.shape[0]
  block_rows, block_d, block_n = (
      block_sizes.block_rows, block_sizes.block_d, block_sizes.block_n)
  d_block, row_block = pl.program_id(0), pl.program_id(1)
  d_idx = d_block * block_d + _iota(block_d)
  d_in = d_idx < d
  slots = row_block * block_rows + _iota(block_rows)
  out_mask = (slots < num_slots)[:, None] & d_in[None, :]

  # Rows are sorted with sentinels last, so a block is all padding iff its
  # first row is the sentinel: it skips the whole N loop, and stores zeros
  # only if asked (an index as long as T is mostly such blocks).
  first_row = active_rows_ref[jnp.minimum(row_block * block_rows,
                                          num_slots - 1)]

  @pl.when(first_row < num_rows)
  def _compute():
    rows = _load_rows(active_rows_ref, row_block * block_rows, block_rows,
                      sentinel=num_rows)
    row_in = rows < num_rows

    def body(n_step, acc):
      n_idx = n_step * block_n + _iota(block_n)
      n_in = n_idx < n
      dy_tile = plgpu.load(
          dy_ref.at[rows[:, None], n_idx[None, :]],
          mask=row_in[:, None] & n_in[None, :], other=0.0)
      kernel_tile = plgpu.load(
          kernel_ref.at[d_idx[:, None], n_idx[None, :]],
          mask=d_in[:, None] & n_in[None, :], other=0.0)
      return acc + _dot_f32(
          dy_tile.astype(compute_dtype), kernel_tile.astype(compute_dtype),
          contract_a=1, contract_b=1, precision=precision)

    acc = lax.fori_loop(0, pl.cdiv(n, block_n), body,
                        jnp.zeros((block_rows, block_d), jnp.float32))
    # Sentinel slots get exact zeros (their zero rows times an Inf would be NaN).
    plgpu.store(dx_ref.at[slots[:, None], d_idx[None, :]],
                jnp.where(row_in[:, None], acc, 0.0).astype(dx_ref.dtype),
                mask=out_mask)

  if zero_sentinel_slots:
    @pl.when(first_row >= num_rows)
    def _zero_padding_slots():
      plgpu.store(dx_ref.at[slots[:, None], d_idx[None, :]],
                  jnp.zeros((block_rows, block_d), dx_ref.dtype), mask=out_mask)


def _gathered_dw_db_kernel(
    active_rows_ref,  # int32[K], K >= 1
    x_ref,  # [T, D]
    dy_ref,  # [T, N]
    *refs,  # (poison float32[1],) if with_poison; dW [split_rows, D, N] and,
            # if with_bias, db [split_rows, N] (outputs)
    with_poison: bool, d_fastest: bool, split_rows: int,
    block_sizes: BlockSizes, compute_dtype, precision):
  num_rows, d = x_ref.shape
  n = dy_ref.shape[1]
  poison_ref, refs = (refs[0], refs[1:]) if with_poison else (None, refs)
  dw_ref, db_ref = refs[0], (refs[1] if len(refs) > 1 else None)
  block_rows, block_d, block_n = (
      block_sizes.block_rows, block_sizes.block_d, block_sizes.block_n)
  d_block, n_block = pl.program_id(0), pl.program_id(1)
  if not d_fastest:
    d_block, n_block = n_block, d_block
  split = pl.program_id(2)
  # The start of the first split's sums (the splits are added): a NaN reaches all of
  # dW and db, even where no row is selected, at no cost per tile.
  start = jnp.float32(0)
  if with_poison:
    start = jnp.where(split == 0, poison_ref[0], start)
  d_idx = d_block * block_d + _iota(block_d)
  n_idx = n_block * block_n + _iota(block_n)
  d_in = d_idx < d
  n_in = n_idx < n

  # Only steps holding at least one selected row do work: padding at the end
  # of active_rows costs nothing, and the splits share the steps that do. The
  # sentinel's slot is the selected count.
  num_selected = _lower_bound(active_rows_ref, jnp.int32(num_rows))
  # pl.cdiv with int32 divisors: Python int ones would be int64 under x64.
  num_steps = lax.div(num_selected + block_rows - 1, jnp.int32(block_rows))
  steps_per_split = lax.div(num_steps + split_rows - 1, jnp.int32(split_rows))
  first_step = split * steps_per_split
  last_step = jnp.minimum(first_step + steps_per_split, num_steps)

  def body(step, carry, *, with_db: bool):
    dw_acc, db_acc = carry
    rows = _load_rows(active_rows_ref, step * block_rows, block_rows,
                      sentinel=num_rows)
    row_in = rows < num_rows
    x_tile = plgpu.load(
        x_ref.at[rows[:, None], d_idx[None, :]],
        mask=row_in[:, None] & d_in[None, :], other=0.0)
    dy_tile = plgpu.load(
        dy_ref.at[rows[:, None], n_idx[None, :]],
        mask=row_in[:, None] & n_in[None, :], other=0.0)
    dw_acc += _dot_f32(
        x_tile.astype(compute_dtype), dy_tile.astype(compute_dtype),
        contract_a=0, contract_b=0, precision=precision)
    if with_db:
      db_acc += jnp.sum(dy_tile.astype(jnp.float32), axis=0)
    return dw_acc, db_acc

  init = (jnp.full((block_d, block_n), start, jnp.float32),
          jnp.full((block_n,), start, jnp.float32))

  def reduce(with_db: bool):
    return lax.fori_loop(first_step, last_step,
                         functools.partial(body, with_db=with_db), init)

  if db_ref is None:
    dw_acc, _ = reduce(with_db=False)
  else:
    # db needs the column sums of dy only once per N tile: the d_block == 0
    # programs compute them, the others skip the reduction.
    dw_acc, db_acc = lax.cond(d_block == 0, lambda: reduce(with_db=True),
                              lambda: reduce(with_db=False))

    @pl.when(d_block == 0)
    def _store_db():
      plgpu.store(db_ref.at[split, n_idx], db_acc.astype(db_ref.dtype),
                  mask=n_in)

  plgpu.store(dw_ref.at[split, d_idx[:, None], n_idx[None, :]],
              dw_acc.astype(dw_ref.dtype),
              mask=d_in[:, None] & n_in[None, :])


# ---------------------------------------------------------------------------
# pallas_call wrappers.
# ---------------------------------------------------------------------------


def _at_least_one_slot(active_rows: jax.Array, num_rows: int) -> jax.Array:
  """The kernels read slot 0 unconditionally: give an empty index one
  sentinel slot (a static-shape edge case; K >= 1 passes through)."""
  if active_rows.shape[0] == 0:
    return jnp.full((1,), num_rows, jnp.int32)
  return active_rows


def _compiler_params(block_sizes: BlockSizes):
  return plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                              num_stages=block_sizes.num_stages)


def _gathered_dx_call(dy, kernel, active_rows, *, block_sizes: BlockSizes,
                      interpret: bool, precision, zero_sentinel_slots: bool):
  # K >= 1 here: gathered_dx answers an empty index itself.
  num_slots = active_rows.shape[0]
  d = kernel.shape[0]
  # D blocks vary fastest, also where the kernel is the larger operand:
  # programs running together then share one gathered block of dy rows
  # through L2.
  grid = (pl.cdiv(d, block_sizes.block_d),
          pl.cdiv(num_slots, block_sizes.block_rows))
  compute_dtype = jnp.promote_types(dy.dtype, kernel.dtype)
  body = functools.partial(
      _gathered_dx_kernel, block_sizes=block_sizes, compute_dtype=compute_dtype,
      precision=_dot_precision(precision, dy.dtype, kernel.dtype),
      zero_sentinel_slots=zero_sentinel_slots)
  return pl.pallas_call(
      body,
      grid=grid,
      out_shape=jax.ShapeDtypeStruct((num_slots, d), dy.dtype),
      compiler_params=_compiler_params(block_sizes),
      interpret=interpret,
      name="sebp_gathered_dx",
  )(active_rows, dy, kernel)


def _gathered_dw_db_call(x, dy, active_rows, poison, *, with_bias: bool,
                         dw_dtype, db_dtype, block_sizes: BlockSizes,
                         interpret: bool, precision):
  num_rows, d = x.shape
  n = dy.shape[1]
  active_rows = _at_least_one_slot(active_rows, num_rows)
  num_steps = pl.cdiv(active_rows.shape[0], block_sizes.block_rows)
  split_rows = min(block_sizes.split_rows, num_steps)
  # With one split the kernel writes the final dtype directly; partial sums
  # stay float32 until they are added.
  dw_out = x.dtype if dw_dtype is None else dw_dtype
  db_out = dy.dtype if db_dtype is None else db_dtype
  out_shape = [jax.ShapeDtypeStruct(
      (split_rows, d, n), dw_out if split_rows == 1 else jnp.float32)]
  if with_bias:
    out_shape.append(jax.ShapeDtypeStruct(
        (split_rows, n), db_out if split_rows == 1 else jnp.float32))
  num_d_blocks = pl.cdiv(d, block_sizes.block_d)
  num_n_blocks = pl.cdiv(n, block_sizes.block_n)
  # Sweep fastest the axis whose gathered operand is smaller (x's [K, D] rows
  # or dy's [K, N] rows), so that it stays in L2 while the other streams.
  d_fastest = d <= n
  grid = ((num_d_blocks, num_n_blocks, split_rows) if d_fastest
          else (num_n_blocks, num_d_blocks, split_rows))
  compute_dtype = jnp.promote_types(x.dtype, dy.dtype)
  body = functools.partial(
      _gathered_dw_db_kernel, with_poison=poison is not None,
      d_fastest=d_fastest, split_rows=split_rows, block_sizes=block_sizes,
      compute_dtype=compute_dtype,
      precision=_dot_precision(precision, x.dtype, dy.dtype))
  outs = pl.pallas_call(
      body,
      grid=grid,
      out_shape=out_shape,
      compiler_params=_compiler_params(block_sizes),
      interpret=interpret,
      name="sebp_gathered_dw_db",
  )(active_rows, x, dy,
    *(() if poison is None else (jnp.reshape(poison, (1,)).astype(jnp.float32),)))
  if split_rows == 1:
    return outs[0][0], outs[1][0] if with_bias else None
  dw = outs[0].sum(axis=0).astype(dw_out)
  db = outs[1].sum(axis=0).astype(db_out) if with_bias else None
  return dw, db


# ---------------------------------------------------------------------------
# Public functions.
# ---------------------------------------------------------------------------


@functools.partial(
    jax.jit, static_argnames=("block_sizes", "interpret", "precision", "zero_sentinel_slots"))
def gathered_dx(dy: jax.Array, kernel: jax.Array, active_rows: jax.Array, *,
                block_sizes: BlockSizes | None = None, interpret: bool = False,
                precision=None, zero_sentinel_slots: bool = True) -> jax.Array:
  """dx for the selected rows of dy, as the ``K`` kept rows in slot order.

  The caller places them at their rows (a gather through the inverse index
  fuses into dx's consumer, where zero rows written here would be a pass of
  their own).

  Args:
    dy: ``[T, N]`` output cotangent.
    kernel: ``[D, N]`` layer weight.
    active_rows: ``int32[K]`` selected rows, sorted ascending, padded at the
      end with the sentinel ``T``.
    block_sizes: tiles and launch parameters; default from
      ``default_block_sizes``.
    interpret: run the Pallas interpreter (CPU) instead of compiling.
    precision: dot precision; ``None`` means full float32 for float32 operands.
    zero_sentinel_slots: write zeros to the sentinel slots; False leaves the
      blocks of sentinel slots unwritten, for a caller that never reads them
      (a spread through the inverse index), which saves writing ``K x D``
      where the index is much longer than its rows.

  Returns:
    ``[K, D]`` in ``dy.dtype``: slot ``k`` holds ``dy[active_rows[k]] @
    kernel.T`` (float32 accumulation), sentinel slots hold exactly 0 (with
    ``zero_sentinel_slots=False``: those in a block with a listed row; the
    others are unspecified).
  """
  num_rows, n = dy.shape
  d, kernel_n = kernel.shape
  if kernel_n != n:
    raise ValueError(f"dy {dy.shape} and kernel {kernel.shape} disagree on N")
  _check_operand_dtypes(dy=dy, kernel=kernel)
  active_rows = index_int32(active_rows, num_rows)
  if 0 in (active_rows.shape[0], num_rows, d, n):
    # Nothing to tile: an empty result, or zeros (no rows to read, or empty sums).
    return gathered_dx_reference(dy, kernel, active_rows)
  block_sizes = block_sizes or default_block_sizes(
      "dx", d, n, jnp.promote_types(dy.dtype, kernel.dtype))
  block_sizes = dataclasses.replace(
      block_sizes, block_d=_fit(block_sizes.block_d, d),
      block_n=_fit(block_sizes.block_n, n))
  return _gathered_dx_call(dy, kernel, active_rows, block_sizes=block_sizes,
                           interpret=interpret, precision=precision,
                           zero_sentinel_slots=zero_sentinel_slots)


@functools.partial(
    jax.jit,
    static_argnames=("with_bias", "dw_dtype", "db_dtype", "block_sizes", "interpret",
                     "precision"))
def gathered_dw_db(
    x: jax.Array, dy: jax.Array, active_rows: jax.Array, *, with_bias: bool,
    poison: jax.Array | None = None, dw_dtype=None, db_dtype=None,
    block_sizes: BlockSizes | None = None, interpret: bool = False,
    precision=None) -> tuple[jax.Array, jax.Array | None]:
  """Weight and bias gradients accumulated over the selected rows.

  Args:
    x: ``[T, D]`` layer input.
    dy: ``[T, N]`` output cotangent.
    active_rows: ``int32[K]`` selected rows, sorted ascending, padded at the
      end with the sentinel ``T``; sentinel slots contribute nothing.
    with_bias: also return db.
    poison: optional float32 scalar that every sum starts from (added once),
      so that a NaN makes all of dW and db NaN at no extra pass (the result of
      a NaN/Inf check of the rows the kernel does not read).
    dw_dtype, db_dtype: dtypes of dW and db (None: ``x.dtype``, ``dy.dtype``),
      stored straight from the float32 sums: a caller that wants the sums in
      float32, or in a parameter dtype other than the operands', gets them
      rounded once and without a second pass.
    block_sizes: tiles and launch parameters; default from
      ``default_block_sizes``.
    interpret: run the Pallas interpreter (CPU) instead of compiling.
    precision: dot precision; ``None`` means full float32 for float32 operands.

  Returns:
    ``(dW, db)``: ``dW = sum_r x[r].T @ dy[r]`` as ``[D, N]`` and
    ``db = sum_r dy[r]`` as ``[N]`` (``None`` without bias), both accumulated in
    float32, in ``dw_dtype`` and ``db_dtype``.
  """
  num_rows, d = x.shape
  dy_rows, n = dy.shape
  if dy_rows != num_rows:
    raise ValueError(f"x {x.shape} and dy {dy.shape} disagree on T")
  _check_operand_dtypes(x=x, dy=dy)
  active_rows = index_int32(active_rows, num_rows)
  if 0 in (active_rows.shape[0], num_rows, d, n):
    # Nothing to tile: an empty result, or sums of no rows (zero, or the poison).
    return gathered_dw_db_reference(x, dy, active_rows, with_bias=with_bias, poison=poison,
                                    dw_dtype=dw_dtype, db_dtype=db_dtype)
  block_sizes = block_sizes or default_block_sizes(
      "dw", d, n, jnp.promote_types(x.dtype, dy.dtype))
  block_sizes = dataclasses.replace(
      block_sizes, block_d=_fit(block_sizes.block_d, d),
      block_n=_fit(block_sizes.block_n, n))
  return _gathered_dw_db_call(x, dy, active_rows, poison, with_bias=with_bias,
                              dw_dtype=dw_dtype, db_dtype=db_dtype,
                              block_sizes=block_sizes, interpret=interpret,
                              precision=precision)


# ---------------------------------------------------------------------------
# jnp references (these do materialise the gathered rows).
# ---------------------------------------------------------------------------


def _rows_at(array, active_rows):
  """``array``'s rows at ``active_rows``, zero at the sentinel (all of them, with no rows)."""
  if array.shape[0] == 0:
    return jnp.zeros((active_rows.shape[0], *array.shape[1:]), array.dtype)
  return array.at[active_rows].get(mode="fill", fill_value=0)


def gathered_dx_reference(dy, kernel, active_rows):
  """Reference for ``gathered_dx``: the kept rows ``[K, D]`` in ``dy.dtype``."""
  rows = _rows_at(dy, active_rows)
  dx_rows = jnp.dot(rows, kernel.T, precision=lax.Precision.HIGHEST,
                    preferred_element_type=jnp.float32)
  is_row = (active_rows < dy.shape[0])[:, None]
  return jnp.where(is_row, dx_rows, 0).astype(dy.dtype)


def gathered_dw_db_reference(x, dy, active_rows, *, with_bias: bool,
                             poison=None, dw_dtype=None, db_dtype=None):
  """Reference for ``gathered_dw_db``: ``(dW [D, N], db [N] or None)``, each rounded once
  from the float32 sums to ``dw_dtype`` / ``db_dtype`` (None: ``x.dtype``, ``dy.dtype``)."""
  start = jnp.float32(0) if poison is None else poison
  x_rows, dy_rows = _rows_at(x, active_rows), _rows_at(dy, active_rows)
  dw = start + jnp.dot(x_rows.T, dy_rows, precision=lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)
  db = start + dy_rows.astype(jnp.float32).sum(axis=0) if with_bias else None
  return (dw.astype(dw_dtype or x.dtype),
          None if db is None else db.astype(db_dtype or dy.dtype))
