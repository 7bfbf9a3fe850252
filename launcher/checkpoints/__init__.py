"""Checkpoints: the atomic on-disk protocol (store), what a checkpoint holds and how it
reshards (state, reshard), the loop hook that saves and resumes (hook), and HF export."""
