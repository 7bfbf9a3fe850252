"""Start-up and the loop: building the model, data and topology of a rank (startup), the
DeepSpeed engine (engine), the one training loop (loop), stopping on signals (stopping),
non-finite steps (nonfinite), LOOMTRAIN_PLUGIN's hooks (plugins) and activation
checkpointing. It imports the launcher root, observe/ and checkpoints/, never planning/,
cluster/ or cli/: the same loop runs alone, under torchrun and in a Ray worker."""
