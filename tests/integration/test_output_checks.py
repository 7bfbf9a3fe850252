"""What `export` and `import` may write over is decided by one rule for a folder and a prefix.

An --output is new or empty, or holds only what the command itself writes (an earlier export, an
earlier adapter export, an earlier import of the same source), which it then replaces; anything
else there (a user's file) refuses the command in one line, nothing touched. The same calls run
on a local folder and on a prefix in the local S3 server (tests/s3_server.py): before, a folder
holding an earlier export and a user's file was replaced whole (the file deleted), while the
same prefix was refused, and `--format peft` to a URI checked nothing.
"""

import pytest
from loomtrain import storage
from loomtrain.launcher.checkpoints.export import ExportError, check_export_output
from loomtrain.launcher.checkpoints.hf_import import IMPORTED_FROM, HFImportError, check_output
from loomtrain.launcher.checkpoints.lora_export import ADAPTER_CONFIG, ADAPTER_WEIGHTS


@pytest.fixture
def output(backend_root) -> str:
    return f"{backend_root}/out"


def put(output: str, rel: str, data: bytes = b"{}") -> None:
    storage.location(output).write(rel, data)  # a folder's parents are made as on a disk


def test_an_export_goes_where_nothing_or_only_an_earlier_export_is(output):
    check_export_output(output)  # nothing there yet
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        put(output, name)
    check_export_output(output)  # an earlier export: replaced
    put(output, "notes.txt", b"keep me")
    with pytest.raises(ExportError, match=r"holds notes\.txt and 3 more .*, not an earlier export; choose a new"):
        check_export_output(output)
    assert storage.location(output).read("notes.txt") == b"keep me"


def test_an_adapter_export_goes_over_an_earlier_adapter_export_only(output):
    def adapters(name: str) -> bool:
        return name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG)

    put(output, ADAPTER_CONFIG)
    check_export_output(output, adapters, "an earlier adapter export")
    put(output, "config.json")  # a merged export there: not this command's to replace
    with pytest.raises(ExportError, match=r"holds config\.json and 1 more .*, not an earlier adapter export"):
        check_export_output(output, adapters, "an earlier adapter export")


def test_an_import_replaces_an_import_of_the_same_source_only(output, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    check_output(output, src, "org/model")
    put(output, "config.yaml", IMPORTED_FROM.format("org/model").encode() + b"run: {}\n")
    put(output, "final/manifest.json")
    check_output(output, src, "org/model")  # the same source again: replaced
    with pytest.raises(HFImportError, match=r"holds an import of org/model, not of org/other; choose a new or empty"):
        check_output(output, src, "org/other")
    put(output, "thesis.txt")
    with pytest.raises(HFImportError, match=r"holds thesis\.txt and 2 more, not a previous import of org/model"):
        check_output(output, src, "org/model")
