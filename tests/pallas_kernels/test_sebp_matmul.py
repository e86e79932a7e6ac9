"""Tests of the gathered SEBP matmul kernels against a float64 numpy reference.

On CPU the kernels run in the Pallas interpreter. With a GPU present (or
INTERPRET=0) the same tests run compiled: see benchmarks/gpu_check.sh. There,
every production tile is also built for an A100 (sm_80), a card we have no
access to, by compiling for a described target instead of the attached one.
"""

import functools
import os
import string
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from pallas_kernels import BlockSizes
from pallas_kernels import default_block_sizes
from pallas_kernels import gathered_dw_db
from pallas_kernels import gathered_dw_db_reference
from pallas_kernels import gathered_dx
from pallas_kernels import gathered_dx_reference

INTERPRET = os.environ.get(
    "INTERPRET", "1" if jax.default_backend() == "cpu" else "0") != "0"

# Relative Frobenius error bounds: float32 must be full precision (tf32 keeps
# 10 mantissa bits, far above the bound); half types are dominated by rounding
# the output.
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2, jnp.float16: 2e-3}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]

# Small tiles so that the small test shapes span several programs per axis and
# every edge mask is exercised.
SMALL_BLOCKS = BlockSizes(block_rows=16, block_d=16, block_n=16, split_rows=1,
                          num_warps=2, num_stages=2)
SPLIT_BLOCKS = BlockSizes(block_rows=16, block_d=32, block_n=16, split_rows=3,
                          num_warps=2, num_stages=2)

# (T, D, N, K slots, selected rows): odd sizes, padding, no padding, a single
# selected row, and the all-sentinel (empty) set.
CASES = [
    pytest.param(37, 50, 24, 16, 10, id="odd-padded"),
    pytest.param(64, 32, 48, 20, 20, id="unpadded"),
    pytest.param(100, 40, 72, 48, 33, id="multi-block"),
    pytest.param(19, 16, 17, 8, 1, id="single-row"),
    pytest.param(40, 24, 36, 12, 0, id="empty"),
]


def _random(rng, shape, dtype):
  return jnp.asarray(rng.standard_normal(shape), dtype)


def _active_rows(rng, num_rows, num_slots, num_selected):
  """Sorted distinct rows padded at the end with the sentinel ``num_rows``."""
  rows = np.sort(rng.choice(num_rows, num_selected, replace=False))
  padding = np.full(num_slots - num_selected, num_rows)
  return jnp.asarray(np.concatenate([rows, padding]), jnp.int32), rows


def _relative_error(actual, expected):
  scale = max(np.linalg.norm(expected), 1e-30)
  return np.linalg.norm(np.asarray(actual, np.float64) - expected) / scale


def _f64(a):
  return np.asarray(a.astype(jnp.float32), np.float64)


# Every dtype with small tiles; the default tiles once (interpret mode is slow,
# each case costs a compilation).
DX_CONFIGS = [
    *(pytest.param(SMALL_BLOCKS, dtype, id=f"small-{jnp.dtype(dtype).name}")
      for dtype in DTYPES),
    pytest.param(None, jnp.bfloat16, id="default-bfloat16"),
]
DW_CONFIGS = [
    *(pytest.param(SMALL_BLOCKS, dtype, True,
                   id=f"small-{jnp.dtype(dtype).name}-bias")
      for dtype in DTYPES),
    pytest.param(SPLIT_BLOCKS, jnp.bfloat16, True, id="split-bfloat16-bias"),
    pytest.param(None, jnp.float32, False, id="default-float32-no-bias"),
]


@pytest.mark.parametrize("num_rows,d,n,num_slots,num_selected", CASES)
@pytest.mark.parametrize("blocks,dtype", DX_CONFIGS)
def test_gathered_dx(num_rows, d, n, num_slots, num_selected, dtype, blocks):
  rng = np.random.default_rng([num_rows, d, n, num_selected])
  dy = _random(rng, (num_rows, n), dtype)
  kernel = _random(rng, (d, n), dtype)
  active_rows, rows = _active_rows(rng, num_rows, num_slots, num_selected)

  dx_kept = gathered_dx(dy, kernel, active_rows, block_sizes=blocks,
                        interpret=INTERPRET)

  assert dx_kept.shape == (num_slots, d) and dx_kept.dtype == dtype
  dx_kept = _f64(dx_kept)
  assert np.all(np.isfinite(dx_kept))
  # Slot k holds row active_rows[k]; the sentinel slots (the last ones) are zero.
  assert np.all(dx_kept[num_selected:] == 0.0), "sentinel slots must be exactly zero"
  if num_selected:
    expected = _f64(dy)[rows] @ _f64(kernel).T
    assert _relative_error(dx_kept[:num_selected], expected) < TOLERANCE[dtype]


def test_gathered_dx_zeros_sentinel_slots_beside_an_inf():
  """Sentinel slots sharing a block with real rows are exactly 0 even where the kernel holds
  an Inf (their zero rows times it would be NaN); the reference agrees."""
  rng = np.random.default_rng(8)
  dy = _random(rng, (40, 24), jnp.float32)
  kernel = _random(rng, (32, 24), jnp.float32).at[3, 5].set(jnp.inf)
  active_rows, _ = _active_rows(rng, 40, 16, 5)
  dx_kept = np.asarray(gathered_dx(dy, kernel, active_rows, block_sizes=SMALL_BLOCKS,
                                   interpret=INTERPRET))
  assert np.all(dx_kept[5:] == 0.0)
  assert not np.all(np.isfinite(dx_kept[:5, 3]))  # the Inf does reach the real rows
  assert np.all(np.asarray(gathered_dx_reference(dy, kernel, active_rows))[5:] == 0.0)


@pytest.mark.parametrize("blocks", [SMALL_BLOCKS, SPLIT_BLOCKS], ids=["one-split", "split"])
@pytest.mark.parametrize("num_selected", [33, 0], ids=["rows", "empty"])
def test_gathered_dw_db_poison(blocks, num_selected):
  """A zero poison changes nothing; a NaN one reaches every element of dW and db, even
  with no row selected (split partial sums included); any other starts the sums once."""
  rng = np.random.default_rng(13)
  x = _random(rng, (100, 40), jnp.bfloat16)
  dy = _random(rng, (100, 72), jnp.bfloat16)
  active_rows, _ = _active_rows(rng, 100, 48, num_selected)
  run = functools.partial(gathered_dw_db, x, dy, active_rows, with_bias=True,
                          dw_dtype=jnp.float32, db_dtype=jnp.float32, block_sizes=blocks,
                          interpret=INTERPRET)

  clean, zero = run(), run(poison=jnp.float32(0))
  for got, want in zip(zero, clean):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  dw, db = run(poison=jnp.float32(jnp.nan))
  assert np.all(np.isnan(np.asarray(dw))) and np.all(np.isnan(np.asarray(db)))
  for got, want in zip(run(poison=jnp.float32(0.5)), clean):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want) + 0.5, rtol=1e-6, atol=1e-6)


def test_references_match_the_kernels():
  """The jnp references exported next to the kernels agree with them, poison included."""
  rng = np.random.default_rng(17)
  x = _random(rng, (100, 40), jnp.float32)
  dy = _random(rng, (100, 72), jnp.float32)
  kernel = _random(rng, (40, 72), jnp.float32)
  active_rows, _ = _active_rows(rng, 100, 48, 33)
  np.testing.assert_allclose(
      gathered_dx(dy, kernel, active_rows, block_sizes=SMALL_BLOCKS, interpret=INTERPRET),
      gathered_dx_reference(dy, kernel, active_rows), rtol=1e-5, atol=1e-5)
  for poison in (None, jnp.float32(jnp.nan)):
    kernel_sums = gathered_dw_db(x, dy, active_rows, with_bias=True, poison=poison,
                                 block_sizes=SMALL_BLOCKS, interpret=INTERPRET)
    reference_sums = gathered_dw_db_reference(x, dy, active_rows, with_bias=True,
                                              poison=poison)
    for got, want in zip(kernel_sums, reference_sums):
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("blocks", [SMALL_BLOCKS, SPLIT_BLOCKS], ids=["one-split", "split"])
def test_gathered_dw_db_float32_out(blocks):
  # How the pallas implementation calls the kernel: bf16 operands, float32 sums stored as they are.
  rng = np.random.default_rng(21)
  x = _random(rng, (100, 40), jnp.bfloat16)
  dy = _random(rng, (100, 72), jnp.bfloat16)
  active_rows, rows = _active_rows(rng, 100, 48, 33)
  dw, db = gathered_dw_db(x, dy, active_rows, with_bias=True, dw_dtype=jnp.float32,
                          db_dtype=jnp.float32, block_sizes=blocks, interpret=INTERPRET)
  assert dw.dtype == db.dtype == jnp.float32
  # Products of bf16 values are exact in float32: only float32 summation error remains.
  assert _relative_error(dw, _f64(x)[rows].T @ _f64(dy)[rows]) < 1e-6
  assert _relative_error(db, _f64(dy)[rows].sum(axis=0)) < 1e-6


@pytest.mark.parametrize("num_rows,d,n,num_slots,num_selected", CASES)
@pytest.mark.parametrize("blocks,dtype,with_bias", DW_CONFIGS)
def test_gathered_dw_db(num_rows, d, n, num_slots, num_selected, dtype, blocks,
                        with_bias):
  rng = np.random.default_rng([num_rows, d, n, num_selected, 1])
  x = _random(rng, (num_rows, d), dtype)
  dy = _random(rng, (num_rows, n), dtype)
  active_rows, rows = _active_rows(rng, num_rows, num_slots, num_selected)

  dw, db = gathered_dw_db(x, dy, active_rows, with_bias=with_bias,
                          block_sizes=blocks, interpret=INTERPRET)

  assert dw.shape == (d, n) and dw.dtype == dtype
  expected_dw = _f64(x)[rows].T @ _f64(dy)[rows]
  expected_db = _f64(dy)[rows].sum(axis=0)
  assert np.all(np.isfinite(_f64(dw)))
  if with_bias:
    assert db.shape == (n,) and db.dtype == dtype
    assert np.all(np.isfinite(_f64(db)))
  else:
    assert db is None
  if num_selected == 0:
    assert np.all(_f64(dw) == 0.0)
    if with_bias:
      assert np.all(_f64(db) == 0.0)
    return
  assert _relative_error(dw, expected_dw) < TOLERANCE[dtype]
  if with_bias:
    assert _relative_error(db, expected_db) < TOLERANCE[dtype]


@pytest.mark.parametrize("num_selected", [5, 40])
def test_an_index_of_every_row_does_the_work_of_its_rows(num_selected):
  """An index as long as T (every row a slot, sentinels after the selected ones), as the
  backward hands the kernels where the count is known only at run time: the splits of the
  row reduction share the steps that hold rows, and both kernels give those rows' sums."""
  rng = np.random.default_rng(num_selected)
  num_rows, d, n = 96, 40, 24
  x = _random(rng, (num_rows, d), jnp.float32)
  dy = _random(rng, (num_rows, n), jnp.float32)
  active_rows, rows = _active_rows(rng, num_rows, num_rows, num_selected)
  dw, db = gathered_dw_db(x, dy, active_rows, with_bias=True, block_sizes=SPLIT_BLOCKS,
                          interpret=INTERPRET)
  assert _relative_error(dw, _f64(x)[rows].T @ _f64(dy)[rows]) < TOLERANCE[jnp.float32]
  assert _relative_error(db, _f64(dy)[rows].sum(axis=0)) < TOLERANCE[jnp.float32]
  kernel = _random(rng, (d, n), jnp.float32)
  dx_kept = _f64(gathered_dx(dy, kernel, active_rows, block_sizes=SMALL_BLOCKS,
                             interpret=INTERPRET))
  assert np.all(dx_kept[num_selected:] == 0.0)
  assert _relative_error(dx_kept[:num_selected],
                         _f64(dy)[rows] @ _f64(kernel).T) < TOLERANCE[jnp.float32]
  # Blocks of sentinel slots left unwritten: the listed slots, and the sentinel slots of the
  # blocks that hold rows, are as before.
  unzeroed = _f64(gathered_dx(dy, kernel, active_rows, block_sizes=SMALL_BLOCKS,
                              interpret=INTERPRET, zero_sentinel_slots=False))
  written = -(-num_selected // SMALL_BLOCKS.block_rows) * SMALL_BLOCKS.block_rows
  np.testing.assert_array_equal(unzeroed[:written], dx_kept[:written])


# One (D, N) in each class of the default tile tables, for dx (N >= 2048 and D >= 2048; N >=
# 2048; the rest) and dW (D * N >= 2**24; >= 2**22; the rest).
DEFAULT_TILE_CLASSES = [(4096, 4096), (1024, 4096), (256, 256)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layer_shape", DEFAULT_TILE_CLASSES, ids=lambda s: "x".join(map(str, s)))
def test_every_default_tile(layer_shape, dtype):
  """Each production tile (in each dtype's variant) on a small problem it overhangs, so that
  every edge is masked; the tiles at their own shapes are built for an A100 below."""
  rng = np.random.default_rng([*layer_shape, jnp.dtype(dtype).itemsize])
  num_rows, d, n = 70, 72, 100
  x = _random(rng, (num_rows, d), dtype)
  dy = _random(rng, (num_rows, n), dtype)
  kernel = _random(rng, (d, n), dtype)
  active_rows, rows = _active_rows(rng, num_rows, 48, 30)

  dx = gathered_dx(dy, kernel, active_rows, interpret=INTERPRET,
                   block_sizes=default_block_sizes("dx", *layer_shape, dtype))
  dw, db = gathered_dw_db(x, dy, active_rows, with_bias=True, interpret=INTERPRET,
                          block_sizes=default_block_sizes("dw", *layer_shape, dtype))

  assert np.all(_f64(dx)[30:] == 0.0)
  assert _relative_error(dx[:30], _f64(dy)[rows] @ _f64(kernel).T) < TOLERANCE[dtype]
  assert _relative_error(dw, _f64(x)[rows].T @ _f64(dy)[rows]) < TOLERANCE[dtype]
  assert _relative_error(db, _f64(dy)[rows].sum(axis=0)) < TOLERANCE[dtype]


#: An A100-SXM4-40GB as XLA's GPU compiler sees a target (a GpuTargetConfigProto): sm_80,
#: 108 SMs, 164 KiB of shared memory per SM and at most 163 KiB per block (the optin field,
#: left to fill in so that a control can vary that limit alone).
A100_SHARED_MEMORY_PER_BLOCK = 166912
A100_TARGET = string.Template("""
gpu_device_info {
  cuda_compute_capability { major: 8 minor: 0 }
  core_count: 108
  fpus_per_core: 64
  threads_per_block_limit: 1024
  threads_per_warp: 32
  threads_per_core_limit: 2048
  thread_dim_limit_x: 1024
  thread_dim_limit_y: 1024
  thread_dim_limit_z: 64
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  shared_memory_per_block: 49152
  shared_memory_per_block_optin: $shared_memory_per_block
  shared_memory_per_core: $shared_memory_per_core
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  memory_bandwidth: 1555200000000
  l2_cache_size: 41943040
  clock_rate_ghz: 1.41
  device_memory_size: 42331013120
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
device_description_str: "A100 (compile-only target)"
""")


def a100_sharding(shared_memory_per_block: int = A100_SHARED_MEMORY_PER_BLOCK) -> NamedSharding:
  """A sharding onto the described A100: what is compiled for it is built for sm_80, whatever
  GPU is attached (a deviceless compile; nothing runs). ``shared_memory_per_block`` other than
  the A100's describes an otherwise identical card with that limit."""
  target = A100_TARGET.substitute(shared_memory_per_block=shared_memory_per_block,
                              shared_memory_per_core=shared_memory_per_block + 1024)
  topology = topologies.get_topology_desc(topology_name="a100", platform="cuda",
                                          target_config=target, topology="1x1x1")
  assert [d.device_kind for d in topology.devices] == ["A100 (compile-only target)"]
  return NamedSharding(topologies.make_mesh(topology, (1,), ("rows",)), PartitionSpec())


@pytest.fixture(scope="module")
def on_an_a100():
  return a100_sharding()


@pytest.mark.skipif(INTERPRET, reason="compiles through the CUDA plugin, for a GPU target")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("layer_shape", DEFAULT_TILE_CLASSES, ids=lambda s: "x".join(map(str, s)))
def test_every_default_tile_builds_for_an_a100(on_an_a100, layer_shape, dtype):
  """Each production tile of both kernels, at its layer shape, is compiled by XLA and Triton
  for sm_80 with no A100 attached, which fails where a kernel needs an instruction sm_80 lacks
  or more shared memory per block than an A100 grants (the two controls below)."""
  d, n = layer_shape
  def spec(*shape, dtype=dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=on_an_a100)
  active_rows = spec(819, dtype=jnp.int32)
  dx = jax.jit(lambda dy, kernel, rows: gathered_dx(
      dy, kernel, rows, block_sizes=default_block_sizes("dx", d, n, dtype))).lower(
          spec(4096, n), spec(d, n), active_rows).compile()
  dw_db = jax.jit(lambda x, dy, rows: gathered_dw_db(
      x, dy, rows, with_bias=True, block_sizes=default_block_sizes("dw", d, n, dtype))).lower(
          spec(4096, d), spec(4096, n), active_rows).compile()
  assert all('custom_call_target="__gpu$xla.gpu.triton"' in c.as_text() for c in (dx, dw_db))


#: Builds a cast to float8_e4m3fn (sm_89 and newer) for the attached card, then for the A100
#: (``a100_sharding`` of this module, whose directory is argv[1]); Triton's failure there ends
#: the process (an LLVM fatal error), hence a process of its own.
_FLOAT8_KERNEL_FOR_AN_A100 = """
import os, sys
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], os.pardir, os.pardir)]
from test_sebp_matmul import a100_sharding

def to_float8(x_ref, out_ref):
  out_ref[...] = x_ref[...].astype(jnp.float8_e4m3fn)

cast = jax.jit(pl.pallas_call(to_float8, out_shape=jax.ShapeDtypeStruct((16, 16), jnp.float8_e4m3fn),
                              compiler_params=plgpu.CompilerParams(num_warps=4)))
cast.lower(jax.ShapeDtypeStruct((16, 16), jnp.float32)).compile()
print("built for the attached card", flush=True)
cast.lower(jax.ShapeDtypeStruct((16, 16), jnp.float32, sharding=a100_sharding())).compile()
print("built for the A100", flush=True)
"""


@pytest.mark.skipif(INTERPRET, reason="compiles through the CUDA plugin, for a GPU target")
def test_a_kernel_beyond_an_a100_does_not_build_for_it():
  """The check above can fail: a kernel that needs sm_89 builds for the attached card but not
  for the described A100."""
  result = subprocess.run([sys.executable, "-c", _FLOAT8_KERNEL_FOR_AN_A100,
                           os.path.dirname(os.path.abspath(__file__))],
                          capture_output=True, text=True, timeout=600)
  assert "built for the attached card" in result.stdout, result.stderr[-2000:]
  assert "built for the A100" not in result.stdout and result.returncode != 0
  assert "compute capability >= 89" in result.stderr, result.stderr[-2000:]


@pytest.mark.skipif(INTERPRET, reason="compiles through the CUDA plugin, for a GPU target")
def test_a_tile_beyond_an_a100s_shared_memory_does_not_build_for_it(on_an_a100):
  """The check above can fail on shared memory too. A float32 dx tile of 128x256 with five
  pipeline stages needs 192 KiB on sm_80 (four buffers of 48 KiB): it builds for the
  described A100 given an H100's 227 KiB per block, and XLA refuses it at the A100's own
  163 KiB."""
  blocks = BlockSizes(block_rows=128, block_d=256, block_n=32, num_warps=8, num_stages=5)
  dx = jax.jit(lambda dy, kernel, rows: gathered_dx(dy, kernel, rows, block_sizes=blocks))
  def specs(sharding):
    return [jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in
            (((4096, 4096), jnp.float32), ((4096, 4096), jnp.float32), ((819,), jnp.int32))]
  dx.lower(*specs(a100_sharding(shared_memory_per_block=232448))).compile()
  with pytest.raises(jax.errors.JaxRuntimeError, match="Shared memory size limit exceeded"):
    dx.lower(*specs(on_an_a100)).compile()


def test_row_zero_counted_once():
  """Row 0 selected plus sentinel padding: padding must not add row 0 again
  (as padding ``jnp.nonzero`` with its default fill index 0 would)."""
  rng = np.random.default_rng(7)
  num_rows, d, n = 24, 16, 16
  x = _random(rng, (num_rows, d), jnp.float32)
  dy = _random(rng, (num_rows, n), jnp.float32)
  active_rows = jnp.asarray([0, 5, num_rows, num_rows], jnp.int32)

  dw, db = gathered_dw_db(x, dy, active_rows, with_bias=True,
                          block_sizes=SMALL_BLOCKS, interpret=INTERPRET)

  rows = [0, 5]
  expected_dw = _f64(x)[rows].T @ _f64(dy)[rows]
  assert _relative_error(dw, expected_dw) < TOLERANCE[jnp.float32]
  assert _relative_error(db, _f64(dy)[rows].sum(0)) < TOLERANCE[jnp.float32]


def test_tf32_on_request():
  """Full float32 by default; an explicit lower precision is passed through
  (on GPU it gives tf32-level error, in the interpreter the same result)."""
  rng = np.random.default_rng(3)
  num_rows, d, n = 32, 64, 64
  dy = _random(rng, (num_rows, n), jnp.float32)
  kernel = _random(rng, (d, n), jnp.float32)
  active_rows, rows = _active_rows(rng, num_rows, 16, 16)
  expected = _f64(dy)[rows] @ _f64(kernel).T

  dx_kept = gathered_dx(dy, kernel, active_rows, block_sizes=SMALL_BLOCKS,
                        interpret=INTERPRET, precision=jax.lax.Precision.DEFAULT)

  assert _relative_error(dx_kept, expected) < 2e-3


def test_under_enable_x64():
  """jax_enable_x64 changes no index dtype inside the kernels; float64 operands, which they
  would sum in float32, are refused by name."""
  rng = np.random.default_rng(12)
  with jax.enable_x64(True):
    x = _random(rng, (40, 16), jnp.float32)
    dy = _random(rng, (40, 24), jnp.float32)
    kernel = _random(rng, (16, 24), jnp.float32)
    active_rows, rows = _active_rows(rng, 40, 8, 5)
    dx = gathered_dx(dy, kernel, active_rows, block_sizes=SMALL_BLOCKS, interpret=INTERPRET)
    dw, db = gathered_dw_db(x, dy, active_rows, with_bias=True, block_sizes=SPLIT_BLOCKS,
                            interpret=INTERPRET)
    assert _relative_error(dx[:5], _f64(dy)[rows] @ _f64(kernel).T) < 1e-5
    assert _relative_error(dw, _f64(x)[rows].T @ _f64(dy)[rows]) < 1e-5
    assert _relative_error(db, _f64(dy)[rows].sum(0)) < 1e-5
    with pytest.raises(ValueError, match="dy must be float32, bfloat16 or float16.*float64"):
      gathered_dx(dy.astype(jnp.float64), kernel, active_rows, interpret=INTERPRET)
    with pytest.raises(ValueError, match="x must be float32, bfloat16 or float16.*float64"):
      gathered_dw_db(x.astype(jnp.float64), dy, active_rows, with_bias=False,
                     interpret=INTERPRET)


def test_an_index_of_any_integer_dtype_reads_its_rows_and_others_are_refused():
  """uint8, int64 and uint32 indices read the rows an int32 one does, a wide entry past T as
  the sentinel (a uint32 past 2**31 is not wrapped to a negative row); a float or 2-D index
  is refused by name."""
  rng = np.random.default_rng(13)
  x, dy = _random(rng, (40, 16), jnp.float32), _random(rng, (40, 24), jnp.float32)
  kernel = _random(rng, (16, 24), jnp.float32)
  active_rows, rows = _active_rows(rng, 40, 8, 5)
  want_dx = _f64(dy)[rows] @ _f64(kernel).T
  with jax.enable_x64(True):
    for index in (np.asarray(active_rows, np.uint8), np.asarray(active_rows, np.int64),
                  np.asarray(active_rows, np.uint32).copy()):
      if index.dtype != np.uint8:
        index[-1] = np.iinfo(index.dtype).max
      dx = gathered_dx(dy, kernel, jnp.asarray(index), block_sizes=SMALL_BLOCKS,
                       interpret=INTERPRET)
      dw, db = gathered_dw_db(x, dy, jnp.asarray(index), with_bias=True,
                              block_sizes=SPLIT_BLOCKS, interpret=INTERPRET)
      assert _relative_error(dx[:5], want_dx) < 1e-5 and np.all(_f64(dx)[5:] == 0)
      assert _relative_error(dw, _f64(x)[rows].T @ _f64(dy)[rows]) < 1e-5
      assert _relative_error(db, _f64(dy)[rows].sum(0)) < 1e-5
  for index in (active_rows.astype(jnp.float32), active_rows.reshape(2, 4)):
    with pytest.raises(ValueError, match="active_rows must be a 1-D integer index"):
      gathered_dx(dy, kernel, index, interpret=INTERPRET)
    with pytest.raises(ValueError, match="active_rows must be a 1-D integer index"):
      gathered_dw_db(x, dy, index, with_bias=False, interpret=INTERPRET)


@pytest.mark.skipif(INTERPRET, reason="needs a GPU with > 10 GB of memory")
def test_offsets_beyond_int32():
  """Rows whose element offset exceeds 2**31 (arrays over 4 GiB)."""
  num_rows, d, n = 2**21 + 96, 1024, 64
  key_x, key_dy, key_w = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(key_x, (num_rows, d), jnp.bfloat16)
  dy = jax.random.normal(key_dy, (num_rows, n), jnp.bfloat16)
  kernel = jax.random.normal(key_w, (d, n), jnp.bfloat16)
  rows = np.asarray([3, 2**20, 2**21 + 1, num_rows - 1])
  active_rows = jnp.asarray(np.concatenate([rows, [num_rows] * 12]), jnp.int32)

  dx_kept = gathered_dx(dy, kernel, active_rows)
  dw, db = gathered_dw_db(x, dy, active_rows, with_bias=True)

  assert np.all(_f64(dx_kept)[len(rows):] == 0.0)
  dy_rows, x_rows = _f64(dy[rows]), _f64(x[rows])
  expected_dx = dy_rows @ _f64(kernel).T
  assert _relative_error(_f64(dx_kept)[:len(rows)], expected_dx) < 1e-2
  assert _relative_error(dw, x_rows.T @ dy_rows) < 1e-2
  assert _relative_error(db, dy_rows.sum(0)) < 1e-2


def test_zero_slots():
  """An index of static size 0: dx has no rows, dW and db are zero."""
  rng = np.random.default_rng(11)
  num_rows, d, n = 20, 16, 24
  x = _random(rng, (num_rows, d), jnp.bfloat16)
  dy = _random(rng, (num_rows, n), jnp.bfloat16)
  kernel = _random(rng, (d, n), jnp.bfloat16)
  active_rows = jnp.zeros((0,), jnp.int32)

  dx = gathered_dx(dy, kernel, active_rows, block_sizes=SMALL_BLOCKS,
                   interpret=INTERPRET)
  dw, db = gathered_dw_db(x, dy, active_rows, with_bias=True,
                          block_sizes=SMALL_BLOCKS, interpret=INTERPRET)

  assert dx.shape == (0, d) and dx.dtype == jnp.bfloat16
  assert np.all(_f64(dw) == 0.0) and np.all(_f64(db) == 0.0)


@pytest.mark.parametrize("num_rows,d,n", [(20, 0, 24), (20, 16, 0), (0, 16, 24)],
                         ids=["no-features-in", "no-features-out", "no-rows"])
def test_empty_dimensions(num_rows, d, n):
  """A layer with no input or output features, or no rows: dx, dW and db of their shapes
  and dtypes, equal to the float64 sums (db of the kept rows where there are any), and NaN
  throughout from a NaN poison."""
  rng = np.random.default_rng(12)
  x = _random(rng, (num_rows, d), jnp.bfloat16)
  dy = _random(rng, (num_rows, n), jnp.bfloat16)
  kernel = _random(rng, (d, n), jnp.bfloat16)
  active_rows = jnp.asarray([0, 3, num_rows, num_rows][:4 if num_rows else 2], jnp.int32)
  active_rows = jnp.minimum(active_rows, num_rows)

  dx = gathered_dx(dy, kernel, active_rows, block_sizes=SMALL_BLOCKS, interpret=INTERPRET)
  dw, db = gathered_dw_db(x, dy, active_rows, with_bias=True, dw_dtype=jnp.float32,
                          db_dtype=jnp.float32, block_sizes=SMALL_BLOCKS, interpret=INTERPRET)
  assert dx.shape == (active_rows.shape[0], d) and dx.dtype == jnp.bfloat16
  assert (dw.shape, dw.dtype, db.shape, db.dtype) == ((d, n), jnp.float32, (n,), jnp.float32)
  kept = [row for row in np.asarray(active_rows) if row < num_rows]
  dy_rows = _f64(dy)[kept]
  np.testing.assert_array_equal(_f64(dx)[:len(kept)], dy_rows @ _f64(kernel).T)
  assert not np.any(_f64(dx)[len(kept):])
  np.testing.assert_array_equal(_f64(dw), _f64(x)[kept].T @ dy_rows)
  np.testing.assert_allclose(_f64(db), dy_rows.sum(0), rtol=1e-6)  # float32, rounded once
  dw, db = gathered_dw_db(x, dy, active_rows, with_bias=True, poison=jnp.float32(np.nan),
                          block_sizes=SMALL_BLOCKS, interpret=INTERPRET)
  assert np.isnan(_f64(dw)).all() and np.isnan(_f64(db)).all()


@pytest.mark.skipif(INTERPRET, reason="compiles the large default tiles")
@pytest.mark.parametrize("dtype", DTYPES)
def test_default_tiles_of_large_layers(dtype):
  """The default tiles of the largest shape classes compile and are right for
  every dtype (float32 must fit shared memory with its halved step)."""
  rng = np.random.default_rng(5)
  num_rows, d, n = 192, 2048, 8192
  x = _random(rng, (num_rows, d), dtype)
  dy = _random(rng, (num_rows, n), dtype)
  kernel = _random(rng, (d, n), dtype)
  active_rows, rows = _active_rows(rng, num_rows, 96, 80)

  dx_kept = gathered_dx(dy, kernel, active_rows)
  dw, db = gathered_dw_db(x, dy, active_rows, with_bias=True)

  assert np.all(_f64(dx_kept)[80:] == 0.0)
  expected_dx = _f64(dy)[rows] @ _f64(kernel).T
  assert _relative_error(_f64(dx_kept)[:80], expected_dx) < TOLERANCE[dtype]
  expected_dw = _f64(x)[rows].T @ _f64(dy)[rows]
  assert _relative_error(dw, expected_dw) < TOLERANCE[dtype]
  assert _relative_error(db, _f64(dy)[rows].sum(0)) < TOLERANCE[dtype]


@pytest.mark.parametrize("field,value,expected", [
    ("block_rows", 48, "a power of two >= 16"), ("block_n", 8, "a power of two >= 16"),
    ("block_d", 64.0, "a power of two >= 16"), ("split_rows", 0, "an int >= 1"),
    ("num_warps", 6, "a power of two >= 1, at most 32"),
    ("num_warps", 64, "a power of two >= 1, at most 32"),
    ("num_stages", 0, "an int >= 1"), ("num_stages", True, "an int >= 1")])
def test_block_sizes_refuse_what_triton_cannot_launch(field, value, expected):
  with pytest.raises(ValueError, match=f"{field}={value!r} must be {expected}"):
    BlockSizes(**{field: value})
  assert BlockSizes(**{field: np.int64(32 if field != "num_stages" else 2)}) == BlockSizes(
      **{field: 32 if field != "num_stages" else 2})
