"""Final weights are one protocol on a local folder and in an object store (final.py): the same
calls on both backends (RUN/final on a disk; {run.storage}/final in the local S3 server of
tests/s3_server.py) give the same layout, the same reader's view, and the same refusal of a
write that did not finish. What differs is only what a disk can do and a store cannot: a disk
keeps an earlier final/ until the new one is renamed over it; a store retracts it first (its
manifest goes), so a reader finds none rather than a mix."""

import json

import pytest
import torch
from final_weights import save_final
from loomtrain import storage
from loomtrain.data_pipeline import ByteTokenizer
from loomtrain.launcher.checkpoints.final import FINAL_MANIFEST, FinalWeightsError
from loomtrain.launcher.checkpoints.weight_source import load_final, weights_at
from loomtrain.model import ModelConfig, Transformer

CFG = ModelConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, max_seq_len=32)


@pytest.fixture
def run_location(backend_root) -> str:
    return f"{backend_root}/run"


def files_under(where: str) -> set[str]:
    return set(storage.location(where).sizes())


class BrokenTokenizer(ByteTokenizer):
    def save(self, folder):
        raise OSError(28, "No space left on device")


def test_final_weights_are_the_same_files_a_manifest_names_and_read_back_equal(run_location):
    model = Transformer(CFG, seed=0)
    final = save_final(model, CFG, ByteTokenizer(), storage.below(run_location, "final"))
    assert storage.same_location(final, storage.below(run_location, "final"))
    manifest = json.loads(storage.location(final).read(FINAL_MANIFEST))
    assert files_under(final) == set(manifest["files"]) | {FINAL_MANIFEST}  # nothing else, no stage left
    assert {"model.safetensors", "model_config.json"} <= set(manifest["files"])
    assert set(storage.location(run_location).entries()) == {"final"}  # no final.tmp beside it
    loaded, _ = load_final(run_location)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert weights_at(run_location) and weights_at(final)


def test_a_new_final_replaces_the_earlier_one_whole(run_location):
    where = storage.below(run_location, "final")
    save_final(Transformer(CFG, seed=0), CFG, ByteTokenizer(), where)
    storage.location(where).write("stale.bin", b"from an earlier writer")
    second = Transformer(CFG, seed=1)
    save_final(second, CFG, ByteTokenizer(), where)
    assert "stale.bin" not in files_under(where)
    loaded, _ = load_final(where)
    assert torch.equal(loaded.tok_emb.weight, second.tok_emb.weight)


def test_a_write_that_fails_leaves_no_final_a_reader_takes_for_the_new_one(run_location):
    where = storage.below(run_location, "final")
    first = Transformer(CFG, seed=0)
    save_final(first, CFG, ByteTokenizer(), where)
    with pytest.raises(OSError, match="No space left on device"):
        save_final(Transformer(CFG, seed=1), CFG, BrokenTokenizer(), where)
    if storage.location(run_location).local:  # a disk: the earlier final/ stands until the rename
        loaded, _ = load_final(where)
        assert torch.equal(loaded.tok_emb.weight, first.tok_emb.weight)
    else:  # a store: the earlier final/ was retracted first, the new one never committed
        assert not weights_at(where)
        with pytest.raises(FinalWeightsError, match=f"no {FINAL_MANIFEST}"):
            load_final(where)


def test_a_rank_file_missing_where_rank_0_publishes_is_refused_naming_it(run_location):
    """Ranks on hosts that share no filesystem, writing final/ into run.dir: rank 0 finds another
    rank's file missing and publishes nothing (run.storage is the way)."""
    from loomtrain.launcher.checkpoints.final import _publish, _stage

    store, stage, name = _stage(storage.below(run_location, "final"))
    store.make_folder(stage)
    store.child(stage).write("model-00001-of-00002.safetensors", b"x" * 10)
    parts = [
        {"files": {f"model-0000{r + 1}-of-00002.safetensors": {"size": 10, "sha256": "0" * 64}}, "weight_map": {},
         "owners": 2}
        for r in range(2)
    ]  # fmt: skip
    with pytest.raises(storage.StorageError, match=r"model-00002-of-00002.safetensors: no bytes stored, 10 written"):
        _publish(store, stage, name, parts, CFG, ByteTokenizer())
    assert not weights_at(storage.below(run_location, "final"))
