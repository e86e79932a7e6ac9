"""Pallas kernels for the SEBP backward pass (Triton backend on GPU)."""

from pallas_kernels.sebp_matmul import BlockSizes
from pallas_kernels.sebp_matmul import default_block_sizes
from pallas_kernels.sebp_matmul import gathered_dw_db
from pallas_kernels.sebp_matmul import gathered_dw_db_reference
from pallas_kernels.sebp_matmul import gathered_dx
from pallas_kernels.sebp_matmul import gathered_dx_reference

__all__ = [
    "BlockSizes",
    "default_block_sizes",
    "gathered_dw_db",
    "gathered_dw_db_reference",
    "gathered_dx",
    "gathered_dx_reference",
]
