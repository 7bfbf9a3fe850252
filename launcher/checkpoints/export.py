"""A run's weights as a Hugging Face transformers checkpoint, written tensor by tensor
(`loomtrain export RUN_DIR --format hf --output DIR`, launcher/cli/export.py).

Source of the weights (full tensors, vocabulary unpadded):
  * RUN_DIR/checkpoints: the newest complete checkpoint (whatever TP x DP x ZeRO layout wrote
    it; its fp32 masters, read one tensor at a time with every tile's sha256 checked), or a
    checkpoint directory given directly;
  * else RUN_DIR/final (checked against its manifest first).

Targets, chosen by the model's variant (every other combination is refused with the
field that does not fit):
  * Llama-style  (pre-norm, rmsnorm, swiglu, rope)        -> hf_families.family_of:
    Qwen3ForCausalLM with model.qk_norm, Qwen2ForCausalLM with model.qkv_bias, MistralForCausalLM
    with model.sliding_window, else LlamaForCausalLM (rope scaling, head_dim, tied or not).
    loomtrain's RoPE already uses the rotate-half layout of HF Llama (dimension i is
    paired with i + head_dim/2), so q/k weights are copied without a permutation.
  * GPT-2-style  (pre-norm, layernorm, gelu|relu, learned) -> GPT2LMHeadModel
    GPT-2's Conv1D stores weights as [in, out]: every linear is transposed, and
    q/k/v are fused into c_attn; biases the model does not have are written as zeros.
The tensor names are the import's maps (hf_families.family_refs, hf_source.gpt2_refs), the ones `import` and
`model.init_from` read by, here read backwards (`hf_recipes`): one map for both directions.

Written: model.safetensors when everything fits in --max-shard-size, else
model-00001-of-0000N.safetensors ... + model.safetensors.index.json (Hugging Face's names and
splitting rule: a new shard when the next tensor would overflow this one); config.json,
generation_config.json, and the tokenizer as HF files (tokenizer.json +
tokenizer_config.json; the byte tokenizer is expressed as an equivalent byte-level
`tokenizers` model, so AutoTokenizer gives the same ids).

Memory: the shard plan comes from the shapes alone, then each tensor is read, converted and
streamed into its shard file, so the peak is a few tensors, not the model. Everything is
written into DIR.tmp-export and renamed into place at the end; an earlier export in DIR is
replaced whole (no stale shard survives), anything else in DIR is refused.
Reading never unpickles: safetensors, JSON and YAML only.

Object storage: RUN_DIR may be a URI: a run's storage (its newest complete checkpoint, read
with ranged GETs of its tiles, each checked against its sha256; else its final/), a checkpoint,
or a final/ (fetched into this host's cache, checked against its manifest: final.fetch_final).
DIR may be a URI: the export is written into a local staging folder and uploaded, config.json
last (an export there is complete once config.json is); an earlier export at DIR is removed
first (config.json first), anything else there is refused, as on disk.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from loomtrain.data_pipeline import load_tokenizer
from loomtrain.data_pipeline.tokenizer import EOS_TOKEN
from loomtrain.durable import replace_dir, write_durable
from loomtrain.launcher.checkpoints.final import (
    TOKENIZER_DIR,
    WEIGHTS,
    WEIGHTS_INDEX,
    FinalWeightsError,
    fetch_final,
    naming_objects,
    objects_named,
    staging_folder,
    verify_final,
    weights_cache,
)
from loomtrain.launcher.checkpoints.hf_families import family_config, family_of, family_refs
from loomtrain.launcher.checkpoints.hf_source import gpt2_refs
from loomtrain.launcher.checkpoints.lora_weights import BaseMismatch, merge_adapters
from loomtrain.launcher.checkpoints.safetensors_source import TensorRef, WeightSourceError, model_tensor_names
from loomtrain.launcher.checkpoints.shards import CorruptCheckpoint, SafetensorsWriter
from loomtrain.launcher.checkpoints.state import open_reader
from loomtrain.launcher.checkpoints.store import (
    MANIFEST,
    read_checkpoint_file,
    read_manifest,
    run_store_at,
    verify,
)
from loomtrain.launcher.checkpoints.weight_source import open_source as open_weights
from loomtrain.model import ModelConfig
from loomtrain.storage import (
    StorageError,
    below,
    download_verified,
    local_folder,
    location,
    output_folder,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

FORMATS = ("hf", "peft")  # peft: a LoRA run's adapters (lora_export.py)
# loomtrain activation -> GPT-2's activation_function computing the same function
HF_ACTIVATION = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_MAX_SHARD = "5GB"


class ExportError(ValueError):
    pass


def parse_size(text: str) -> int:
    """Hugging Face's size strings: '5GB' = 5e9 bytes, '500MB', '2GiB' = 2 * 2**30, or a number."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(text), flags=re.I)
    if not m:
        raise ExportError(f"--max-shard-size {text!r}: expected a size such as 500MB, 5GB or 2GiB")
    unit = (m.group(2) or "B").upper()
    scale = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }.get(unit)
    size = int(float(m.group(1)) * scale) if scale else 0
    if size <= 0:
        raise ExportError(f"--max-shard-size {text!r}: expected a positive size such as 500MB or 5GB")
    return size


# Reading a run --------------------------------------------------------------------------
class Source:
    """Full tensors by loomtrain name, one at a time: `shape(name)`, `get(name)` (fp32)."""

    def __init__(self, shapes: dict[str, list[int]], read: Callable[[str], torch.Tensor], cfg, tok_dir, what: str):
        self.shapes, self.read, self.cfg, self.tok_dir, self.what = shapes, read, cfg, tok_dir, what

    def __contains__(self, name: str) -> bool:
        return name in self.shapes

    def shape(self, name: str) -> list[int]:
        return list(self.shapes[name])

    def get(self, name: str) -> torch.Tensor:
        return self.read(name).float()


def open_source(src: str | Path) -> Source:
    """The newest complete checkpoint of a run (or a checkpoint itself), else its final/: a folder
    or a URI alike. A checkpoint's tiles are read where they lie (ranged GETs from an object
    store), each checked against its checksum; final/ in an object store is fetched into this
    host's cache, checked against its manifest; so is a checkpoint's tokenizer/."""
    objs = location(src, "export source")
    if objs.local and not objs.root.exists():
        raise ExportError(f"{src}: no such run or checkpoint directory")
    try:
        entries = objs.entries()
        ckpt = None
        if entries.get(MANIFEST) == "file" and entries.get("trainer.json") == "file":
            v = verify(src, checksums=False)  # sizes here; every tile read is checked against its checksum
            if not v.ok:
                raise ExportError(f"{src}: not a usable checkpoint: {v.reason}")
            ckpt = below(src)
        else:
            store = run_store_at(src, log=lambda m: print(m, file=sys.stderr))
            if store is not None:
                ckpt = store.find_resumable(checksums=False)
        return _final_source(src) if ckpt is None else _checkpoint_source(ckpt)
    except (CorruptCheckpoint, StorageError) as exc:
        raise ExportError(str(exc)) from None


def _checkpoint_source(ckpt) -> Source:
    reader = open_reader(ckpt)  # full tensors by name, every tile checked as it is read
    manifest = read_manifest(ckpt)
    run = yaml.safe_load(read_checkpoint_file(ckpt, "config.yaml"))
    tok = {rel: info for rel, info in manifest["files"].items() if rel.startswith(f"{TOKENIZER_DIR}/")}
    tok_dir = None
    if tok:  # the tokenizer's files only
        tok_dir = local_folder(ckpt, lambda uri: download_verified(uri, weights_cache(uri), tok)) / TOKENIZER_DIR
    shapes = {n: reader.shape(n) for n in reader.names()}
    source = Source(shapes, reader.full, ModelConfig(**run["model"]), tok_dir, f"checkpoint {ckpt}")
    return merge_adapters(source, ckpt, run)  # a LoRA checkpoint: its base and adapters, merged


def _final_source(src) -> Source:
    """A run's final/ (or final weights themselves), a folder or a URI (fetched into this host's
    cache, checked against its manifest)."""
    try:
        final = local_folder(src, fetch_final, local=_local_final)
        verify_final(final)
        weights = open_weights(final)  # the reader model.init_from uses
    except (FinalWeightsError, WeightSourceError) as exc:
        raise ExportError(str(exc)) from None
    shapes = {name: list(weights.shape(name)) for name in weights.refs}
    what = objects_named(f"final weights {final}")
    return Source(shapes, weights.read, weights.model_cfg, weights.tokenizer_dir, what)


def _local_final(src) -> Path:
    """The final weights in a local run directory, or the folder itself when it holds them."""
    src = Path(src).expanduser()
    final = src if ((src / WEIGHTS).is_file() or (src / WEIGHTS_INDEX).is_file()) else src / "final"
    if not ((final / WEIGHTS).is_file() or (final / WEIGHTS_INDEX).is_file()):
        raise ExportError(f"{src}: no complete checkpoint in {src}/checkpoints and no {src}/final/{WEIGHTS}")
    return final


# Variant checks ---------------------------------------------------------------------------
def hf_architecture(cfg) -> str:
    """The Hugging Face architecture a model exports as (LlamaForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM, MistralForCausalLM: hf_families.family_of; GPT2LMHeadModel), or an
    ExportError naming the model field that has no HF counterpart."""

    def need(field: str, allowed: tuple, arch: str) -> None:
        value = getattr(cfg, field)
        if value not in allowed:
            raise ExportError(
                f"model.{field}={value!r}: a {arch}-style export needs model.{field} in {list(allowed)}; "
                f"Hugging Face has no architecture for this variant"
            )

    if cfg.positions == "rope":
        arch = "Llama"
        need("norm_placement", ("pre",), arch)
        need("norm", ("rmsnorm",), arch)
        need("activation", ("swiglu",), arch)
        try:
            return family_of(cfg)
        except ValueError as exc:
            raise ExportError(str(exc)) from None
    if cfg.positions == "learned":
        arch = "GPT-2"
        need("norm_placement", ("pre",), arch)
        need("norm", ("layernorm",), arch)
        need("activation", ("gelu", "gelu_tanh", "relu"), arch)
        for field in ("qkv_bias", "qk_norm"):
            need(field, (False,), arch)
        need("sliding_window", (None,), arch)
        if cfg.kv_heads != cfg.n_heads:
            raise ExportError(
                f"model.n_kv_heads={cfg.n_kv_heads}: GPT-2 has no grouped-query attention "
                f"(needs n_kv_heads == n_heads = {cfg.n_heads})"
            )
        if cfg.head_width * cfg.n_heads != cfg.d_model:
            raise ExportError(f"model.head_dim={cfg.head_dim}: GPT-2's heads are d_model / n_heads wide")
        return "GPT2LMHeadModel"
    raise ExportError(
        f"model.positions={cfg.positions!r}: Hugging Face export supports 'rope' (Llama-style: "
        f"rmsnorm + swiglu) and 'learned' (GPT-2-style: layernorm + gelu)"
    )


# Recipes: HF tensor name -> (shape, how to make it from the source), so the shards can be planned
# from shapes before any tensor is read -------------------------------------------------------
@dataclass
class Recipe:
    shape: list[int]
    make: Callable[[], torch.Tensor]


def _ref(src: Source, name: str) -> Recipe:
    return Recipe(src.shape(name), lambda: src.get(name))


def _transposed(r: Recipe) -> Recipe:
    return Recipe(list(reversed(r.shape)), lambda: r.make().t().contiguous())


def _cat(parts: list[Recipe]) -> Recipe:
    shape = [sum(p.shape[0] for p in parts), *parts[0].shape[1:]]
    return Recipe(shape, lambda: torch.cat([p.make() for p in parts]))


def hf_recipes(src: Source, refs: dict[str, TensorRef], cfg) -> dict[str, Recipe]:
    """Each Hugging Face tensor, in the refs' order, made from the loomtrain tensors whose refs
    point into it (hf_source's name maps read backwards): q, k and v joined into GPT-2's c_attn,
    Conv1D's [in, out] transposed; a bias the model lacks (GPT-2 has them all) is zeros."""
    with_bias = model_tensor_names(dataclasses.replace(cfg, bias=True))
    parts: dict[str, list[tuple[str, TensorRef]]] = {}
    for ours, ref in refs.items():
        parts.setdefault(ref.key, []).append((ours, ref))
    out = {}
    for key, pieces in parts.items():
        made = [
            _ref(src, ours)
            if ours in src or not ours.endswith(".bias")
            else Recipe(list(with_bias[ours]), lambda n=with_bias[ours]: torch.zeros(n))
            for ours, _ in sorted(pieces, key=lambda p: p[1].offset)
        ]
        joined = made[0] if len(made) == 1 else _cat(made)
        out[key] = _transposed(joined) if pieces[0][1].transpose else joined
    return out


# GPT-2 (the Llama-shaped families' config: hf_families.family_config) ------------------------
def gpt2_config(cfg) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layers,
        "n_head": cfg.n_heads,
        "n_inner": cfg.ffn_dim,
        "n_positions": cfg.max_seq_len,
        "n_ctx": cfg.max_seq_len,
        # "gelu" is the exact erf GELU, as in loomtrain; gelu_pytorch_tanh is F.gelu(approximate="tanh")
        "activation_function": HF_ACTIVATION[cfg.activation],
        "layer_norm_epsilon": cfg.norm_eps,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
    }


# Tokenizer -------------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, over tokenizers' ByteLevel alphabet (the
    same map): a printable byte is its own character, the others take, in order, the alphabet's
    characters past 255."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    beyond = iter(sorted(c for c in alphabet if ord(c) > 255))
    return {b: chr(b) if chr(b) in alphabet else next(beyond) for b in range(256)}


def byte_tokenizer_json() -> str:
    """loomtrain's byte tokenizer (ids 0..255 = bytes, 256 = EOS) as a `tokenizers` model."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS_TOKEN])
    assert tok.token_to_id(EOS_TOKEN) == 256
    return tok.to_str(pretty=True)


def export_tokenizer(tok, out: Path, max_len: int) -> None:
    """The run's tokenizer (`tok`: load_tokenizer's) as tokenizer.json, its own file or the byte
    tokenizer's equivalent, and tokenizer_config.json."""
    if tok is None:
        print("export: the run has no tokenizer files; exporting weights only", file=sys.stderr)
        return
    if tok.name == "byte":
        eos = EOS_TOKEN
        write_durable(out / "tokenizer.json", byte_tokenizer_json())
    else:
        eos = tok.eos_token
        write_durable(out / "tokenizer.json", Path(tok.source).read_bytes())  # the tokenizer.json it was read from
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "bos_token": eos,
    }
    chat = getattr(tok, "chat", None)
    if chat:  # a chat model's prompt format goes back where transformers reads it
        cfg.update({k: v for k, v in chat.items() if v})
    write_durable(out / "tokenizer_config.json", json.dumps(cfg, indent=2) + "\n")


# Writing -------------------------------------------------------------------------------------------
def plan_shards(recipes: dict[str, Recipe], dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    """Hugging Face's rule: tensors in order, a new shard when the next one would overflow this
    one (a tensor larger than the limit gets a shard of its own)."""
    item = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, r in recipes.items():
        n = item * math.prod(r.shape)
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_weights(recipes: dict[str, Recipe], out: Path, dtype: torch.dtype, max_bytes: int) -> list[str]:
    """model.safetensors, or shards + index; each tensor made, converted and streamed in turn."""
    shards = plan_shards(recipes, dtype, max_bytes)
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map, total = {}, 0
    for fname, members in zip(names, shards):
        w = SafetensorsWriter(out / fname, [(k, dtype, recipes[k].shape) for k in members], metadata={"format": "pt"})
        for k in members:
            t = recipes[k].make().to(dtype).contiguous()
            if list(t.shape) != list(recipes[k].shape):
                raise ExportError(f"{k}: made a tensor of shape {list(t.shape)}, planned {recipes[k].shape}")
            w.write(k, t)
            total += t.numel() * t.element_size()
            weight_map[k] = fname
            del t
        w.close()
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        write_durable(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    return names


def _export_names(name: str) -> bool:
    """A file an export writes (what an earlier export may hold, a cut-short one too)."""
    small = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", WEIGHTS_INDEX)
    return name in small or (name.startswith("model") and name.endswith(".safetensors"))


def check_export_output(output, ours: Callable[[str], bool] = _export_names, what: str = "an earlier export") -> None:
    """--output (a folder or a prefix) is new or empty, or holds only files an export writes
    (`ours`: an earlier export, replaced); never a file, nor a place holding anything else.
    Refused in one line, with nothing there touched."""
    objs = location(output, "--output")
    kind = "directory" if objs.local else "prefix"
    if objs.local and objs.root.exists() and not objs.root.is_dir():  # the folder output_folder writes
        raise ExportError(f"--output {output}: is a file; expected a directory to create (or {what} to replace)")
    entries = objs.entries()
    others = sorted(name for name, type_ in entries.items() if type_ != "file" or not ours(name))
    if others:
        more = f" and {len(entries) - 1} more {objs.noun}s" if len(entries) > 1 else ""
        raise ExportError(
            f"--output {output}: holds {others[0]}{more}, not {what}; choose a new or empty {kind} "
            "(nothing in it was touched)"
        )


@contextlib.contextmanager
def replacing(out: Path):
    """A new folder beside `out` to write an export into, renamed over `out` once the block
    completes (replace_dir); removed, and `out` left as it was, when the block fails."""
    tmp = out.with_name(out.name + ".tmp-export")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, out)


def write_export(
    src: str | Path,
    output: str | Path,
    dtype: str,
    write: Callable[[Source, Path], None],
    last: str = "config.json",
    ours: Callable[[str], bool] = _export_names,
    what: str = "an earlier export",
) -> Path | str:
    """An export of either format: `output` checked (check_export_output: `ours` and `what` say
    what it may replace), then `write(source, out)` given the run's weights (a LoRA checkpoint's
    base and adapters merged) and the local folder to fill, uploaded when `output` is a URI
    (`last`: the file a reader takes it by, uploaded last)."""
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r}: expected one of {list(DTYPES)}")
    try:
        with naming_objects():
            check_export_output(output, ours, what)
            with output_folder(output, (last,), staging_folder()) as out:
                write(open_source(src), out)
            return below(output)
    except (StorageError, BaseMismatch) as exc:
        raise ExportError(str(exc)) from None


def export_hf(
    src: str | Path, output: str | Path, dtype: str = "fp32", max_shard_size: str | int = DEFAULT_MAX_SHARD
) -> Path | str:
    if dtype not in DTYPES:  # refused before --max-shard-size is read
        raise ExportError(f"--dtype {dtype!r}: expected one of {list(DTYPES)}")
    max_bytes = max_shard_size if isinstance(max_shard_size, int) else parse_size(max_shard_size)
    return write_export(src, output, dtype, lambda source, out: _export(source, out, dtype, max_bytes, str(output)))


def _export(source: Source, out: Path, dtype: str, max_bytes: int, shown: str) -> None:
    """The export of `source` into the local folder `out` (`shown`: what the user named it)."""
    torch_dtype = DTYPES[dtype]
    cfg = source.cfg
    arch = hf_architecture(cfg)
    tok = None if source.tok_dir is None else load_tokenizer(str(source.tok_dir))
    eos_id = None if tok is None else tok.eos_id
    if arch == "GPT2LMHeadModel":
        recipes, config = hf_recipes(source, gpt2_refs(cfg, "transformer."), cfg), gpt2_config(cfg)
    else:  # tied: no lm_head.weight (config.json says so and transformers re-ties on load)
        recipes, config = hf_recipes(source, family_refs(cfg), cfg), family_config(cfg, arch)
    dtype_name = str(torch_dtype).removeprefix("torch.")  # float32, bfloat16, float16
    config.update(
        tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        torch_dtype=dtype_name,
        dtype=dtype_name,
        use_cache=True,
    )
    # An earlier export (checked above) is replaced whole, so no stale shard survives.
    with replacing(out) as tmp:
        names = write_weights(recipes, tmp, torch_dtype, max_bytes)
        write_durable(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        # No max_length: transformers warns whenever a caller's max_new_tokens meets one set here;
        # the context length is config.json's and the tokenizer's model_max_length.
        gen = {"bos_token_id": eos_id, "eos_token_id": eos_id}
        write_durable(tmp / "generation_config.json", json.dumps(gen, indent=2) + "\n")
        export_tokenizer(tok, tmp, cfg.max_seq_len)
    n_params = sum(math.prod(r.shape) for r in recipes.values())
    print(
        f"export: {source.what} -> {shown} ({config['architectures'][0]}, {n_params:,} parameters, {dtype}, "
        f"{len(names)} file{'s' if len(names) > 1 else ''})"
    )
