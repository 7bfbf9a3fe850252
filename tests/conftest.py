"""Shared test set-up: CPU DeepSpeed without its accelerator warning, quiet threads."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
from ray_fixtures import ray_head  # noqa: E402,F401  (session-scoped private Ray head, issue 8)
