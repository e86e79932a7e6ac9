"""sebp_jax: the Sparsity-Exploiting Backward Pass for linear layers in JAX/Flax.

The forward of every linear layer stays dense and exact; its backward keeps only the top-N rows
of the output gradient (padding rows are zero), cutting the backward FLOPs to N/T.

Layout: :mod:`~sebp_jax.selection` (which rows) -> :mod:`~sebp_jax.implementations` (dense,
xla, pallas, by name) and :mod:`~sebp_jax.cost_model` (which one) -> :mod:`~sebp_jax.backward`
(the one entry point) -> :mod:`~sebp_jax.ops` (the custom-VJP ops) -> :mod:`~sebp_jax.layers`
and :mod:`~sebp_jax.intercept` (Linen), :mod:`~sebp_jax.nnx` (NNX, imported as ``from sebp_jax
import nnx``), both on :mod:`~sebp_jax.context`; :mod:`~sebp_jax.sharding` for a batch split
over devices (each shard selects its own rows). Packing (``use_sebp(packed=True)``): the layout and
per-sequence attention in :mod:`~sebp_jax.packing`, the transformers model families it knows
in :mod:`~sebp_jax.model_families`; :mod:`~sebp_jax.losses` for losses on real rows.
"""

from sebp_jax.implementations import register_implementation
from sebp_jax.intercept import SEBPReport, use_sebp
from sebp_jax.layers import SEBPDense, SEBPEmbed, resolve_top_n
from sebp_jax.ops import SEBP_CHECKPOINT_NAME, sebp_embed_lookup, sebp_linear
from sebp_jax.packing import (balanced_shard_order, capacity_buckets, pack_decoder_inputs,
                              token_budget_batches, token_capacity)
from sebp_jax.report import RowLog
from sebp_jax.selection import (active_rows_from_mask, capacity_ladder, row_scores,
                                select_active_rows)

__all__ = [
    "SEBPDense",
    "SEBPEmbed",
    "SEBPReport",
    "RowLog",
    "SEBP_CHECKPOINT_NAME",
    "active_rows_from_mask",
    "balanced_shard_order",
    "capacity_buckets",
    "pack_decoder_inputs",
    "capacity_ladder",
    "register_implementation",
    "resolve_top_n",
    "row_scores",
    "select_active_rows",
    "sebp_embed_lookup",
    "sebp_linear",
    "token_budget_batches",
    "token_capacity",
    "use_sebp",
]
