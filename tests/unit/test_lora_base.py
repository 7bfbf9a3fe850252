"""The LoRA base's checksum covers the weights the base is loaded from."""

from types import SimpleNamespace

from loomtrain.launcher.checkpoints.lora_base import compute_reference


def test_the_base_of_a_run_whose_final_has_no_manifest_is_its_final_weights(tmp_path):
    """model.init_from=RUN_DIR whose final/ an older loomtrain wrote (no manifest.json): the base
    loads from final/, so its checksum is over final/'s weights; it was over RUN_DIR's own (none),
    the same for any base, and a resume onto other weights went unnoticed."""
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    (final / "model_config.json").write_text("{}")
    (final / "model.safetensors").write_bytes(b"one")
    base = SimpleNamespace(init_from=str(tmp_path / "run"))
    first = compute_reference(base, seed=0)
    (final / "model.safetensors").write_bytes(b"two")
    assert compute_reference(base, seed=0)["sha256"] != first["sha256"]
    assert compute_reference(SimpleNamespace(init_from=str(final)), seed=0)["sha256"] != first["sha256"]
