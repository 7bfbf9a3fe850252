"""Shared test set-up: CPU DeepSpeed without its accelerator warning, quiet threads."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
