"""sebp_jax: the Sparsity-Exploiting Backward Pass for linear layers in JAX/Flax.

The forward of every linear layer stays dense and exact; its backward keeps only the top-N rows
of the output gradient (padding rows are zero), cutting the backward FLOPs to N/T.
"""

from sebp_jax.backends import sparse_backward
from sebp_jax.embedding import SEBPEmbed, sebp_embed_lookup
from sebp_jax.intercept import SEBPReport, use_sebp
from sebp_jax.layers import SEBPDense, resolve_top_n
from sebp_jax.ops import SEBP_CHECKPOINT_NAME, sebp_linear
from sebp_jax.selection import active_rows_from_mask, row_scores, select_active_rows

__all__ = [
    "SEBPDense",
    "SEBPEmbed",
    "SEBP_CHECKPOINT_NAME",
    "active_rows_from_mask",
    "resolve_top_n",
    "row_scores",
    "select_active_rows",
    "sebp_embed_lookup",
    "sebp_linear",
    "sparse_backward",
    "SEBPReport",
    "use_sebp",
]
