"""Fine-tuning examples of sebp_jax, run as modules from the repository root."""
