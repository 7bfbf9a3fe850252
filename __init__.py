"""loomtrain: distributed training for decoder-only transformer language models."""

__version__ = "0.1.0"
