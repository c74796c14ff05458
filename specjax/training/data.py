"""Training data for drafting heads: token sequences of fixed length, and optionally their target features.

Sources: a text file (`.txt`: one document per line; `.jsonl`: {"text"} or {"prompt", "response"} per line)
tokenised with the target's tokenizer, or a self-distilled corpus sampled from the target with specjax's
own batched decoder. Documents are packed (concatenated, each starting with BOS) into `[N, seq_len]`.
Every file is written to a temporary name then renamed, so an interrupted run never leaves a partial one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from specjax.decode import GenerateSpec, generate
from specjax.sampling import Sampler


def _save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, array)
    os.replace(tmp, path)


def read_documents(path: str | Path, tokenizer) -> list[list[int]]:
    """Token ids (BOS first) of each document of a `.txt` or `.jsonl` file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"training text {path} does not exist")
    docs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            try:
                record = json.loads(line)
                text = record["text"] if "text" in record else record["prompt"] + record["response"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(
                    f"{path}:{n}: expected a JSON object with 'text' or 'prompt' and 'response' ({err})"
                ) from err
        else:
            text = line
        docs.append(tokenizer.encode(text))
    return docs


def pack(docs: list[list[int]], seq_len: int) -> np.ndarray:
    """Concatenates the documents and cuts `[N, seq_len]` rows (the incomplete tail is dropped)."""
    flat = np.fromiter((t for d in docs for t in d), np.int32)
    n = len(flat) // seq_len
    if n == 0:
        raise ValueError(f"the documents hold {len(flat)} tokens, fewer than one sequence of {seq_len}")
    return flat[: n * seq_len].reshape(n, seq_len)


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
    """`n_samples` documents sampled from the target (BOS, then up to `max_len` tokens, ending at EOS)."""
    spec = GenerateSpec(max_len, Sampler(temperature), eos_id=eos_id)
    docs = []
    for i, _start in enumerate(range(0, n_samples, batch)):
        out = generate(cfg, graphdef, params, [[bos_id]] * batch, spec, seed=seed + i)
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        docs += [[bos_id] + tokens[r, : lengths[r]].tolist() for r in range(batch)]
    return docs[:n_samples]


def load_corpus(config, target, tokenizer) -> np.ndarray:
    """The packed `[N, seq_len]` training tokens for `config.data`, built once and cached at `config.data.cache`."""
    d = config.data
    cache = Path(d.cache).absolute() if d.cache else None
    if cache is not None and cache.exists():
        tokens = np.load(cache)
        if tokens.ndim != 2 or tokens.shape[1] != d.seq_len:
            raise ValueError(
                f"cached corpus {cache} has shape {tokens.shape}, not [N, {d.seq_len}]: delete it or "
                "point data.cache elsewhere"
            )
        return tokens
    if d.source == "self_distill":
        cfg, graphdef, params = target
        docs = self_distill(
            cfg,
            graphdef,
            params,
            tokenizer.bos_id,
            tokenizer.eos_id,
            d.num_samples,
            d.sample_len,
            d.temperature,
            config.seed,
        )
    else:
        docs = read_documents(d.source, tokenizer)
    tokens = pack(docs, d.seq_len)
    if tokens.max() >= target[0].vocab_size:
        raise ValueError(
            f"the corpus holds token id {tokens.max()} >= the target's vocabulary "
            f"{target[0].vocab_size}: the tokenizer does not belong to the target"
        )
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        _save_npy(cache, tokens)
    return tokens


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


def build_feature_store(
    folder: str | Path, tokens_NT: np.ndarray, features_fn, shard_size: int = 256, dtype: str = "float32"
) -> dict:
    """Writes the target's features of every sequence into shards `features_XXXXX.npy` ([n, T, H]) next to
    `tokens.npy`, then `manifest.json` last (a store without a manifest is incomplete). `features_fn(tokens)`
    returns `[n, T, H]`. Returns the manifest, including the bytes of storage per training token."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _save_npy(folder / "tokens.npy", tokens_NT)
    shards = []
    for i, start in enumerate(range(0, len(tokens_NT), shard_size)):
        feats = np.asarray(features_fn(tokens_NT[start : start + shard_size])).astype(dtype)
        name = f"features_{i:05d}.npy"
        _save_npy(folder / name, feats)
        shards.append({"file": name, "rows": int(feats.shape[0])})
    dim = int(feats.shape[-1])
    manifest = {
        "rows": int(len(tokens_NT)),
        "seq_len": int(tokens_NT.shape[1]),
        "dim": dim,
        "dtype": dtype,
        "shards": shards,
        "bytes_per_token": dim * np.dtype(dtype).itemsize + 4,
    }
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)
    return manifest


class FeatureStore:
    """Read side of `build_feature_store`: memory-mapped shards, rows gathered by global index."""

    def __init__(self, folder: str | Path):
        folder = Path(folder)
        if not (folder / MANIFEST).exists():
            raise FileNotFoundError(
                f"{folder} has no {MANIFEST}: the feature store is missing or was not finished; rebuild it"
            )
        self.manifest = json.loads((folder / MANIFEST).read_text())
        self.tokens = np.load(folder / "tokens.npy")
        self.shards = [np.load(folder / s["file"], mmap_mode="r") for s in self.manifest["shards"]]
        self.starts = np.cumsum([0] + [s["rows"] for s in self.manifest["shards"]])

    def features(self, rows: np.ndarray) -> np.ndarray:
        shard = np.searchsorted(self.starts, rows, side="right") - 1
        return np.stack([self.shards[s][r - self.starts[s]] for s, r in zip(shard, rows)]).astype(
            np.float32
        )
