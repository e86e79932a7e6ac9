"""Tests of examples/: data loaders, pretrained checkpoints, command lines, SEBP in real models."""
