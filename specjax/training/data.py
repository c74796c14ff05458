"""Training data for drafting heads: token sequences of fixed length, and optionally their target features.

Sources: a text file (`.txt`: one document per line; `.jsonl`: {"text"} or {"prompt", "response"} per line)
tokenised with the target's tokenizer; a jsonl of conversations rendered with the target's chat template, the loss
masked to the assistant's tokens (`specjax.training.chat`), optionally rewritten by the target first
(`specjax.training.regenerate`); or a self-distilled corpus sampled from the target with specjax's own batched
decoder. Documents are packed (concatenated, each starting with BOS) into `[N, seq_len]` rows of tokens, with
a loss mask beside them (1 where a head is trained to predict that token).

Every file is written to a temporary name beside it then renamed (`specjax.files`), so an interrupted run never
leaves a partial one. The corpus cache (`CACHE.npy`) and the feature store carry their provenance (the target's
identity, a hash of the source text, the settings, for the cache the tokenizer's files, for the store the matmul
precision of its features, and a hash of their own contents), in `CACHE.npy.json` and the store's `manifest.json`:
a cache made from anything else is rebuilt, a feature store is refused.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
from absl import logging

from specjax import cli, files
from specjax.decoding import GenerateSpec, generate
from specjax.errors import DataError, MissingInputError
from specjax.sampling import Sampler
from specjax.training import chat


class Corpus(NamedTuple):
    """Packed training rows: tokens `[N, T]` and the loss mask `[N, T]` (1: a head learns to predict the token)."""

    tokens: np.ndarray
    loss_mask: np.ndarray


def _save_npy(path: Path, array: np.ndarray, replaceable=lambda p: True) -> None:
    with files.atomic_file(path, replaceable) as tmp, open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)


def array_digest(array: np.ndarray) -> str:
    a = np.ascontiguousarray(array)
    h = hashlib.sha256(f"{a.dtype}|{a.shape}|".encode())
    h.update(memoryview(a.reshape(-1).view(np.uint8)))
    return h.hexdigest()


def check_token_range(tokens: np.ndarray, vocab_size: int, where: str) -> None:
    """Token ids must index the target's vocabulary (an id outside it gives a NaN loss, not an error)."""
    if not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"{where} holds {tokens.dtype} values, not token ids; rebuild it")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = tokens.min() if tokens.min() < 0 else tokens.max()
        raise DataError(
            f"{where} holds token id {bad}, outside the target's vocabulary [0, {vocab_size}); its tokenizer "
            "does not belong to the target: rebuild it with the target's tokenizer"
        )


def read_documents(
    path: str | Path, tokenizer, what: str = "training text", flag: str = "data.source"
) -> list[list[int]]:
    """Token ids (BOS first) of each document of a `.txt` or `.jsonl` file; errors call it `what`, set by
    `flag` (the datastore's corpus: what="corpus", flag="--corpus")."""
    path = Path(path)
    if not path.exists():
        raise MissingInputError(f"{what} {path} does not exist; set {flag} to a .txt or .jsonl file")
    if path.is_dir():
        raise DataError(f"{what} {path} is a directory; set {flag} to a .txt or .jsonl file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise DataError(
            f"{what} {path} is not UTF-8 text ({err.reason} at byte {err.start}); set {flag} to a "
            ".txt or .jsonl file"
        ) from err
    docs = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                record = json.loads(line)
                text = record["text"] if "text" in record else record["prompt"] + record["response"]
            except (ValueError, KeyError, TypeError) as err:
                raise DataError(
                    f"{path}:{n}: expected a JSON object with 'text' or 'prompt' and 'response' ({err}); fix "
                    "that line, or give a .txt file with one document per line"
                ) from err
        else:
            text = line
        docs.append(tokenizer.encode(text))
    if not docs:
        raise DataError(f"{what} {path} holds no document (every line is blank); add text to it")
    return docs


def pack(docs: list[list[int]], seq_len: int, masks: list | None = None) -> Corpus:
    """Concatenates the documents (and their loss masks; None: every token) and cuts `[N, seq_len]` rows (the
    incomplete tail is dropped)."""
    flat = np.fromiter((t for d in docs for t in d), np.int32)
    mask = np.ones_like(flat) if masks is None else np.concatenate(masks).astype(np.int32)
    n = len(flat) // seq_len
    if n == 0:
        raise DataError(
            f"the documents hold {len(flat)} tokens, fewer than one sequence of {seq_len}; add documents or "
            "lower data.seq_len"
        )
    return Corpus(flat[: n * seq_len].reshape(n, seq_len), mask[: n * seq_len].reshape(n, seq_len))


def interleave(*corpora: Corpus) -> Corpus:
    """The corpora's rows in turn (one of each while all last, then the longer ones' rest, in order)."""
    n = min(len(c.tokens) for c in corpora)
    rows = [np.stack([c[i][:n] for c in corpora], 1).reshape(-1, corpora[0][i].shape[1]) for i in range(2)]
    rest = [np.concatenate([c[i][n:] for c in corpora]) for i in range(2)]
    return Corpus(*(np.concatenate([r, x]) for r, x in zip(rows, rest)))


def conversation_documents(config, target, tokenizer, target_id: str) -> tuple[list[list[int]], list]:
    """Token ids and loss masks of the conversations in `config.data.source`, rewritten by the target first if
    `config.data.regenerate` names an output file."""
    from specjax.training.regenerate import regenerate

    d = config.data
    try:
        template = chat.chat_template(tokenizer, d.chat_template)
        conversations = chat.read_conversations(d.source)
        if d.regenerate:
            provenance = {
                "target": target_id,
                "source_sha256": files.sha256_file(d.source),
                "template_sha256": chat.template_digest(template),
            }
            conversations = regenerate(
                conversations,
                target,
                tokenizer,
                template,
                d.regenerate,
                provenance,
                d.sample_len,
                d.temperature,
                config.seed,
            )
        pairs = [chat.tokenize(tokenizer, m, template) for m in conversations]
    except chat.ChatDataError as err:
        raise DataError(str(err)) from None
    return [ids for ids, _ in pairs], [mask for _, mask in pairs]


def self_distill(
    cfg,
    graphdef,
    params,
    bos_id: int,
    eos_id: int,
    n_samples: int,
    max_len: int,
    temperature: float,
    seed: int,
    batch: int = 64,
) -> list[list[int]]:
    """`n_samples` documents sampled from the target (BOS, then up to `max_len` tokens, ending at EOS); a
    temperature below `cli.GREEDY_BELOW` samples greedily, as decoding does. Logs how far it is and the time left
    at most every `cli.PROGRESS_S` seconds, and when done."""
    spec = GenerateSpec(max_len, Sampler(cli.temperature(temperature, "data.temperature")), eos_id=eos_id)
    docs = []
    started = shown = time.perf_counter()
    for i, _start in enumerate(range(0, n_samples, batch)):
        out = generate(cfg, graphdef, params, [[bos_id]] * batch, spec, seed=seed + i)
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        docs += [[bos_id] + tokens[r, : lengths[r]].tolist() for r in range(batch)]
        done, now = min(len(docs), n_samples), time.perf_counter()
        if now - shown >= cli.PROGRESS_S or done == n_samples:
            left = cli.time_left(done, n_samples, now - started)
            logging.info("self-distilled corpus: %d/%d samples, %s", done, n_samples, left)
            shown = now
    return docs[:n_samples]


def corpus_provenance(config, target_id: str, tokenizer=None) -> dict:
    """What a packed corpus depends on: the target (its identity, and a hash of `tokenizer`'s files where given),
    the source (the settings of self-distillation, or a hash of the text file's contents, and for conversations
    the chat template file and the regeneration settings) and seq_len."""
    d = config.data
    if d.source == "self_distill":
        source = {
            "self_distill": {
                "num_samples": d.num_samples,
                "sample_len": d.sample_len,
                "temperature": d.temperature,
                "seed": config.seed,
            }
            | ({"mix_temperature": d.mix_temperature} if d.mix_temperature >= 0 else {})
        }
    else:
        path = Path(d.source).absolute()
        if not path.is_file():
            raise DataError(
                f"training text {path} does not exist; set data.source to a .txt or .jsonl file"
            )
        source = {"file": str(path), "sha256": files.sha256_file(path)}
        if chat.is_conversation_file(path):
            template = Path(d.chat_template) if d.chat_template else None
            source["chat_template_sha256"] = files.sha256_file(template) if template else "tokenizer's own"
            if d.regenerate:
                settings = {"sample_len": d.sample_len, "temperature": d.temperature, "seed": config.seed}
                source["regenerate"] = {"file": str(Path(d.regenerate).absolute())} | settings
    made_with = {} if tokenizer is None else {"tokenizer": tokenizer_sha256(tokenizer)}
    return {"format": 2, "target": target_id} | made_with | {"source": source, "seq_len": d.seq_len}


def tokenizer_sha256(tokenizer) -> str:
    """A hash of the names and contents of the files `tokenizer` was read from."""
    paths = getattr(tokenizer, "files", ())
    if not paths:
        raise DataError(
            f"data.cache records what a corpus was tokenised with, but this tokenizer ({type(tokenizer).__name__}) "
            "names no files it was read from: load it with specjax.models.loading.load_tokenizer or set data.cache=''"
        )
    h = hashlib.sha256()
    for path in paths:
        h.update(f"{Path(path).name}:{files.sha256_file(path)}\n".encode())
    return h.hexdigest()


def _sidecar(cache: Path) -> Path:
    return cache.with_name(cache.name + ".json")


def _read_cache(cache: Path, provenance: dict) -> Corpus | None:
    """The cached corpus if `cache` was built from `provenance` and is complete; None if it must be (re)built.
    Refuses a file at `cache` that specjax did not write (no provenance beside it)."""
    if not cache.exists():
        return None
    try:
        record = json.loads(_sidecar(cache).read_text())
    except FileNotFoundError:
        raise files.DestinationError(
            f"corpus cache {cache} exists without its provenance {_sidecar(cache).name} (not written by this "
            "version of specjax); delete it or set data.cache to a new path"
        ) from None
    except (OSError, ValueError):
        record = {}
    if not isinstance(record, dict) or record.get("provenance") != provenance:
        old = record.get("provenance", {}) if isinstance(record, dict) else {}
        changed = sorted(k for k in provenance if not isinstance(old, dict) or old.get(k) != provenance[k])
        logging.warning(
            "rebuilding the corpus cache %s: it was built from another %s", cache, ", ".join(changed)
        )
        return None
    if files.sha256_file(cache) != record.get("sha256"):
        logging.warning("rebuilding the corpus cache %s: it is incomplete or was modified", cache)
        return None
    stacked = np.load(cache, allow_pickle=False)
    if stacked.ndim != 3 or stacked.shape[0] != 2:
        raise DataError(
            f"cached corpus {cache} has shape {stacked.shape}, not [2 (tokens, loss mask), N, "
            f"{provenance['seq_len']}]: delete it or point data.cache elsewhere"
        )
    return Corpus(stacked[0], stacked[1])


def load_corpus(config, target, tokenizer, target_id: str | None = None, write: bool = True) -> Corpus:
    """The packed `[N, seq_len]` training tokens and loss mask for `config.data`, built once and cached at
    `config.data.cache` (if `write`) with its provenance; `target_id` is the target's `specjax.models.store.identity`
    (computed from its weights if None). A cache built from another target, source or settings is rebuilt."""
    from specjax.models.store import model_identity, params_digest

    d = config.data
    cfg = target[0]
    cache = Path(d.cache).absolute() if d.cache else None
    if cache is not None and cache.is_dir():
        raise DataError(f"data.cache {cache} is a directory; give the path of a .npy file")
    provenance = None
    conversations = d.source != "self_distill" and chat.is_conversation_file(d.source)
    if cache is not None or conversations:
        target_id = target_id or model_identity(cfg, params_digest(target[2]))
    if cache is not None:
        provenance = corpus_provenance(config, target_id, tokenizer)
        corpus = _read_cache(cache, provenance)
        if corpus is not None:
            check_token_range(corpus.tokens, cfg.vocab_size, f"corpus cache {cache}")
            if corpus.tokens.shape[1] != d.seq_len:
                raise DataError(
                    f"cached corpus {cache} has rows of {corpus.tokens.shape[1]} tokens, not {d.seq_len}: "
                    "delete it or point data.cache elsewhere"
                )
            return corpus
    if d.regenerate and not conversations:
        raise DataError(
            f"data.regenerate={d.regenerate!r} rewrites conversations, but data.source={d.source!r} holds none; "
            "give a jsonl of conversations or set data.regenerate=''"
        )
    if conversations:
        docs, masks = conversation_documents(config, target, tokenizer, target_id)
        corpus = pack(docs, d.seq_len, masks)
    elif d.source == "self_distill":
        temperatures = [d.temperature] + [d.mix_temperature] * (d.mix_temperature >= 0)
        bos, eos = tokenizer.bos_id, tokenizer.eos_id
        distilled = (
            self_distill(*target, bos, eos, d.num_samples, d.sample_len, t, config.seed)
            for t in temperatures
        )
        corpus = interleave(*(pack(docs, d.seq_len) for docs in distilled))
    else:
        corpus = pack(read_documents(d.source, tokenizer), d.seq_len)
    check_token_range(corpus.tokens, cfg.vocab_size, f"the corpus from {d.source}")
    if cache is not None and write:
        # provenance first, with the hash of the tokens' file: a cache whose write was interrupted never matches
        with files.atomic_file(cache, lambda p: True) as tmp, open(tmp, "wb") as f:
            np.save(f, np.stack(corpus), allow_pickle=False)
            f.flush()
            record = {
                "format": "specjax-corpus",
                "provenance": provenance,
                "sha256": files.sha256_file(tmp),
            }
            files.write_text(_sidecar(cache), json.dumps(record, indent=1), lambda p: True)
    return corpus


def batch_indices(position: int, batch: int, n: int, seed: int) -> np.ndarray:
    """Rows for the batch starting at sample `position` of an endless stream of reshuffled epochs: the data
    order is a function of the position alone, so a resumed run sees exactly what it would have seen."""
    sample = np.arange(position, position + batch)
    epochs = sample // n
    out = np.empty(batch, np.int64)
    for epoch in np.unique(epochs):
        order = np.random.default_rng([seed, int(epoch)]).permutation(n)
        out[epochs == epoch] = order[sample[epochs == epoch] % n]
    return out


# --- precomputed features --------------------------------------------------------------------------

MANIFEST = "manifest.json"


def store_provenance(
    target_id: str,
    corpus: Corpus,
    matmul_precision: str,
    dtype: str = "float32",
    taps: tuple[int, ...] = (),
) -> dict:
    """What a feature store depends on: the target that computed the features, the token rows (and their loss
    mask, unless it is all ones), the precision its matrix products ran at (`precision.resolve`), the stored
    dtype, and the target layers tapped beside the final features (EAGLE-3), if any."""
    record = {
        "target": target_id,
        "tokens_sha256": array_digest(corpus.tokens),
        "dtype": dtype,
        "matmul_precision": matmul_precision,  # TF32 features are not float32 features
    }
    if not np.all(corpus.loss_mask == 1):
        record["loss_mask_sha256"] = array_digest(corpus.loss_mask)
    return record | ({"feature_layers": list(taps)} if taps else {})


def _is_store(folder: Path) -> bool:
    try:
        return json.loads((folder / MANIFEST).read_text()).get("format") == "specjax-feature-store"
    except (OSError, ValueError, AttributeError):
        return False


def build_feature_store(
    folder: str | Path,
    corpus: Corpus,
    features_fn,
    shard_size: int = 256,
    dtype: str = "float32",
    provenance: dict | None = None,
) -> dict:
    """Writes the target's features of every sequence into shards `features_XXXXX.npy` ([n, T, H]) next to
    `tokens.npy`, `loss_mask.npy` and `manifest.json` (with `provenance`), in a temporary folder beside `folder`
    renamed into place when complete: `folder` must not exist yet (or be empty). `features_fn(tokens)` returns
    `[n, T, H]`. Returns the manifest, including the bytes of storage per training token."""
    tokens_NT = corpus.tokens
    with files.atomic_dir(folder, what="feature store") as tmp:
        _save_npy(tmp / "tokens.npy", tokens_NT)
        _save_npy(tmp / "loss_mask.npy", corpus.loss_mask.astype(np.int8))
        shards = []
        for i, start in enumerate(range(0, len(tokens_NT), shard_size)):
            feats = np.asarray(features_fn(tokens_NT[start : start + shard_size])).astype(dtype)
            name = f"features_{i:05d}.npy"
            _save_npy(tmp / name, feats)
            shards.append({"file": name, "rows": int(feats.shape[0])})
        dim = int(feats.shape[-1])
        manifest = {
            "format": "specjax-feature-store",
            "provenance": provenance,
            "rows": int(len(tokens_NT)),
            "seq_len": int(tokens_NT.shape[1]),
            "dim": dim,
            "dtype": dtype,
            "shards": shards,
            "bytes_per_token": dim * np.dtype(dtype).itemsize + 4 + 1,  # features, token id, loss mask
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


class FeatureStore:
    """Read side of `build_feature_store`: memory-mapped shards, rows gathered by global index. With
    `provenance`, a store built from another target, other tokens or another dtype is refused."""

    def __init__(self, folder: str | Path, provenance: dict | None = None):
        folder = Path(folder).absolute()
        if not (folder / MANIFEST).exists():
            raise MissingInputError(
                f"{folder} has no {MANIFEST}: the feature store is missing or was not finished; rebuild it"
            )
        self.manifest = json.loads((folder / MANIFEST).read_text())
        if provenance is not None and self.manifest.get("provenance") != provenance:
            recorded = self.manifest.get("provenance") or {}
            names = {
                "target": "target",
                "tokens_sha256": "corpus",
                "loss_mask_sha256": "loss mask",
                "dtype": "dtype",
                "matmul_precision": "matmul precision",
                "feature_layers": "set of feature layers",
            }
            changed = [
                names.get(k, k) for k in {**recorded, **provenance} if recorded.get(k) != provenance.get(k)
            ]
            raise files.ProvenanceError(
                f"feature store {folder} was built from another "
                f"{', '.join(changed) if recorded else 'target or corpus (it records no provenance)'} "
                "than this run's; set data.store to a new folder (or delete this one to rebuild it)"
            )
        self.tokens = np.load(folder / "tokens.npy", allow_pickle=False)
        mask = folder / "loss_mask.npy"  # absent from stores written before loss masks: every token
        self.loss_mask = np.load(mask, allow_pickle=False) if mask.exists() else np.ones_like(self.tokens)
        self.shards = [np.load(folder / s["file"], mmap_mode="r") for s in self.manifest["shards"]]
        self.starts = np.cumsum([0] + [s["rows"] for s in self.manifest["shards"]])

    def features(self, rows: np.ndarray) -> np.ndarray:
        shard = np.searchsorted(self.starts, rows, side="right") - 1
        return np.stack([self.shards[s][r - self.starts[s]] for s, r in zip(shard, rows)]).astype(
            np.float32
        )
