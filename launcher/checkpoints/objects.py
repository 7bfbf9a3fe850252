"""Checkpoint bytes in an object store (run.storage=s3://bucket/prefix): the prefix class and the
streaming multipart upload the checkpoint store, its shard writer and readers use. They live in
loomtrain.storage with the other object-store primitives; imported from here as before."""

from loomtrain.storage import PART_BYTES, UPLOADS_IN_FLIGHT, Objects, Upload

__all__ = ["PART_BYTES", "UPLOADS_IN_FLIGHT", "Objects", "Upload"]
