"""Finding and loading a model with its tokenizer, whatever its format: Hugging Face directories (safetensors),
llama2.c files and specjax checkpoints (`specjax.models.store`), onto one device or a mesh.

Resolution of the default demo model (`stories260K`), first match wins:
  1. an explicit path;
  2. `$SPECJAX_MODELS/stories260K`, then the repository's sibling `../shared/models/stories260K`;
  3. a download of the llama2.c files from the Hugging Face hub (`karpathy/tinyllamas`) into its cache.
Any other name that is not a local path is treated as a hub repository id (safetensors format).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

from specjax.errors import MissingInputError
from specjax.models import store
from specjax.models.config import ConfigError, LlamaConfig
from specjax.models.weights import CheckpointError, params_from_hf, read_llama2c, read_safetensors
from specjax.sharding import leaf_placer, llama_shardings, place
from specjax.tokenizer import HFTokenizer, Llama2cTokenizer, SentencePieceTokenizer, Tokenizer, files_in

DEFAULT_MODEL = "stories260K"
HUB_REPO, HUB_FILES = "karpathy/tinyllamas", ("stories260K/stories260K.bin", "stories260K/tok512.model")
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass(frozen=True, eq=False)
class LoadedModel:
    cfg: LlamaConfig
    graphdef: object
    params: object
    tokenizer: Tokenizer
    path: Path


def resolve(name: str | None = None) -> Path:
    """A local path for `name` (a path, 'stories260K', or a hub repo id), downloading if needed."""
    name = name or DEFAULT_MODEL
    if Path(name).expanduser().exists():
        return Path(name).expanduser().absolute()
    if name == DEFAULT_MODEL:
        roots = [
            os.environ.get("SPECJAX_MODELS"),
            REPO_ROOT.parent / "shared" / "models",
            Path("../shared/models"),
        ]
        for root in filter(None, roots):
            if (Path(root) / name).exists():
                return (Path(root) / name).absolute()
        return _download(HUB_REPO, HUB_FILES, name)
    if name.count("/") == 1 and not name.startswith((".", "/")):
        return _download(name, None, name)
    raise MissingInputError(
        f"model {name!r} is neither a local path nor a hub repository id (org/name); pass an existing model "
        f"directory or file, a hub id, or {DEFAULT_MODEL}"
    )


def _download(repo: str, files: tuple[str, ...] | None, name: str) -> Path:
    try:
        import huggingface_hub as hub

        if files is None:
            return Path(
                hub.snapshot_download(repo, allow_patterns=["*.json", "*.safetensors", "tokenizer.model"])
            )
        local = [hub.hf_hub_download(repo, f) for f in files]
        return Path(local[0]).parent
    except Exception as err:  # offline, unknown repo, no permission
        raise MissingInputError(
            f"model {name!r} was not found locally and could not be downloaded from the Hugging Face hub "
            f"repository {repo!r} ({type(err).__name__}). Put the files in a directory and pass its path, or set "
            f"SPECJAX_MODELS to a folder holding {name}/ (for stories260K: {', '.join(HUB_FILES)} from "
            f"{HUB_REPO})."
        ) from err


def load_tokenizer(folder: Path, vocab_size: int) -> Tokenizer:
    """The tokenizer stored in `folder` (HF files, a SentencePiece `.model`, or llama2.c `tok*.bin`)."""
    models, bins = sorted(folder.glob("*.model")), sorted(folder.glob("tok*.bin"))
    if (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists():
        tok = HFTokenizer(folder)
    elif models:
        tok = SentencePieceTokenizer(models[0])
    elif bins:
        tok = Llama2cTokenizer(bins[0], vocab_size)
    else:
        raise CheckpointError(f"no tokenizer (tokenizer.json, *.model or tok*.bin) found in {folder}")
    if tok.vocab_size > vocab_size:
        raise CheckpointError(
            f"tokenizer in {folder} has {tok.vocab_size} tokens but the model's vocabulary is "
            f"{vocab_size}: they do not belong together"
        )
    return tok


SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "max_position_embeddings",
)


def read_hf_config(file: Path, dtype: str = "float32") -> LlamaConfig:
    """The LlamaConfig of a Hugging Face `config.json`; a file that is not a JSON object or lacks a setting
    the decoder needs is a CheckpointError naming the file and the setting."""
    try:
        hf = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(
            f"{file} is not valid JSON ({err}); fix it or download the model's config.json again"
        ) from err
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file} holds a {type(hf).__name__}, not a JSON object; download it again")
    for key in SIZES:
        if hf.get(key) is not None and not (isinstance(hf[key], int) and hf[key] >= 1):
            raise CheckpointError(
                f"{file}: {key}={hf[key]!r} must be a positive integer; fix it or download the config again"
            )
    try:
        return LlamaConfig.from_hf(hf, dtype)
    except KeyError as err:
        raise CheckpointError(
            f"{file} lacks {err}, which a Llama-family config needs; download the model's config.json again"
        ) from None
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise CheckpointError(
            f"{file} has a setting of the wrong type ({err}); fix it or download the model's config.json again"
        ) from err


def load_model(name: str | None = None, dtype: str = "float32", mesh=None) -> LoadedModel:
    """Loads weights and tokenizer from a path or name (see the module docstring); on `mesh`, the weights split
    as `specjax.sharding.llama_shardings` says: a specjax checkpoint is restored straight onto the mesh, Hugging
    Face safetensors are read and placed a parameter at a time, a llama2.c file is read on the host and then
    placed."""
    path = resolve(name)
    tok_folder = path
    if (path / store.MARKER).exists():
        shardings = None if mesh is None else (lambda tree: llama_shardings(mesh, tree))
        cfg, graphdef, params = store.restore_model(path, dtype, shardings)
        tok_folder = path / "tokenizer"
    elif (path / "config.json").exists():
        cfg = read_hf_config(path / "config.json", dtype)
        put = None if mesh is None else leaf_placer(mesh)
        graphdef, params = params_from_hf(cfg, read_safetensors(path), put)
    else:
        bins = (
            [path]
            if path.is_file()
            else sorted(p for p in path.glob("*.bin") if not p.name.startswith("tok"))
        )
        if not bins:
            raise CheckpointError(
                f"{path} holds no config.json, {store.MARKER} or llama2.c *.bin checkpoint; pass a "
                "Hugging Face model directory, a llama2.c file or a checkpoint written by specjax.convert"
            )
        tok_folder = bins[0].parent
        cfg, graphdef, params = read_llama2c(bins[0], dtype)
        if mesh is not None:
            params = place(params, llama_shardings(mesh, params))
    return LoadedModel(cfg, graphdef, params, load_tokenizer(tok_folder, cfg.vocab_size), path)


def tokenizer_files(path: Path) -> list[Path]:
    """The tokenizer files of a model directory or llama2.c checkpoint (for copying into a checkpoint)."""
    return files_in(path if path.is_dir() else path.parent)
