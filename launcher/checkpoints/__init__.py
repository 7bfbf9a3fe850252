"""Checkpoints and weights on disk: the atomic on-disk protocol (store), what a checkpoint holds
and how it reshards (state, parts), where DeepSpeed keeps the state it holds (ds_state), the
loop hook that saves and resumes (hook), a run's final weights (final), the readers of initial
weights (weight_source, hf_source, safetensors_source), and HF export and import."""
