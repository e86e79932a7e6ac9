"""Pallas kernels for the SEBP backward pass: gather-matmuls in Triton (``sebp_matmul``, any
GPU) and a row copy plus Mosaic GPU matmuls over a run-time count (``sebp_matmul_mgpu``,
Hopper)."""

from pallas_kernels.sebp_matmul import BlockSizes
from pallas_kernels.sebp_matmul import default_block_sizes
from pallas_kernels.sebp_matmul import gathered_dw_db
from pallas_kernels.sebp_matmul import gathered_dw_db_reference
from pallas_kernels.sebp_matmul import gathered_dx
from pallas_kernels.sebp_matmul import gathered_dx_reference
from pallas_kernels.sebp_matmul_mgpu import MatmulTiles
from pallas_kernels.sebp_matmul_mgpu import MosaicBlockSizes
from pallas_kernels.sebp_matmul_mgpu import kept_rows_backward
from pallas_kernels.sebp_matmul_mgpu import kept_rows_backward_reference

__all__ = [
    "BlockSizes",
    "MatmulTiles",
    "MosaicBlockSizes",
    "default_block_sizes",
    "gathered_dw_db",
    "gathered_dw_db_reference",
    "gathered_dx",
    "gathered_dx_reference",
    "kept_rows_backward",
    "kept_rows_backward_reference",
]
