"""Checkpoints: the atomic on-disk protocol (store), what a checkpoint holds and how it
reshards (state), where DeepSpeed keeps the state it holds (ds_state), the loop hook that
saves and resumes (hook), and HF export."""
