"""The retrieval datastore (REST, He et al. 2024): a text corpus tokenised with the target's tokenizer and its
suffix array, built once, saved as arrays with its provenance, and searched on device by
`specjax.drafters.retrieval`.

    python -m specjax.datastore --corpus=stories.txt --model=stories260K --out=stories.datastore

A datastore is a folder holding `tokens.npy` (the documents of a `.txt` or `.jsonl` file, each starting with
BOS, concatenated: int32 [R]), `suffix.npy` (the suffix array: positions sorted by the text from there to the
end, a suffix that is a prefix of another first: int32 [R]) and `manifest.json` (the provenance: the corpus
file and its sha256, the tokenizer's identity; digests of both arrays). 8 bytes per corpus token. It is written
in a temporary folder renamed into place (`specjax.files`); a datastore built from another corpus or tokenizer
is rebuilt (when the corpus is given) or refused, never used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from absl import logging

from specjax import files
from specjax.errors import DatastoreError
from specjax.training.data import array_digest, check_token_range, read_documents

FORMAT = "specjax-datastore"
MANIFEST = "manifest.json"
ARRAYS = ("tokens", "suffix")
PROBE = 'Once upon a time, 12 cats said: "Hello!" ünïcode 東京 <tab>\t</s> end.'


def suffix_array(tokens_R: np.ndarray) -> np.ndarray:
    """Start positions of the suffixes of `tokens_R` in lexicographic order (a proper prefix sorts first), by
    prefix doubling: O(R log^2 R) with numpy sorts."""
    n = len(tokens_R)
    rank = np.unique(tokens_R, return_inverse=True)[1].astype(np.int64).reshape(-1)
    order, width = np.arange(n), 1
    while n:
        second = np.zeros(n, np.int64)  # 0: the suffix ended (smallest); else rank + 1 of the next half
        second[: max(n - width, 0)] = rank[width:] + 1
        key = rank * (n + 1) + second
        order = np.argsort(key, kind="stable")
        ordered = key[order]
        rank[order] = np.concatenate([[0], np.cumsum(ordered[1:] != ordered[:-1])])
        if rank[order[-1]] == n - 1:  # all distinct
            break
        width *= 2
    return order.astype(np.int32)


def tokenizer_identity(tokenizer) -> str:
    """A digest of what the tokenizer does: its kind, special ids, every piece and the ids of a probe text."""
    h = hashlib.sha256(
        f"{type(tokenizer).__name__}|{tokenizer.vocab_size}|{tokenizer.bos_id}|{tokenizer.eos_id}|".encode()
    )
    h.update(json.dumps(tokenizer.encode(PROBE)).encode())
    for i in range(tokenizer.vocab_size):
        h.update(tokenizer.decode([i]).encode(errors="replace") + b"\0")
    return h.hexdigest()


def provenance(corpus: str | Path, tokenizer_id: str) -> dict:
    """What a datastore depends on: the corpus file's contents and the tokenizer."""
    path = Path(corpus).absolute()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise DatastoreError(f"corpus {path} {what}; pass --corpus=FILE (.txt or .jsonl)")
    return {"corpus": {"file": str(path), "sha256": files.sha256_file(path)}, "tokenizer": tokenizer_id}


@dataclasses.dataclass(frozen=True, eq=False)
class Datastore:
    """Corpus tokens `tokens_R` and their suffix array `suffix_R`; `manifest` as saved (empty if in memory)."""

    tokens_R: np.ndarray
    suffix_R: np.ndarray
    manifest: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def from_tokens(cls, tokens_R) -> Datastore:
        tokens = np.asarray(tokens_R, np.int32).reshape(-1)
        if tokens.size == 0:
            raise DatastoreError("the corpus holds no tokens; give a corpus with text in it")
        return cls(tokens, suffix_array(tokens))

    @property
    def nbytes(self) -> int:
        return self.tokens_R.nbytes + self.suffix_R.nbytes


def is_datastore(folder: Path) -> bool:
    try:
        return json.loads((Path(folder) / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def build(corpus: str | Path, tokenizer, out: str | Path) -> Datastore:
    """Tokenises `corpus` (one document per line of a `.txt`, or {"text"} / {"prompt", "response"} per line of a
    `.jsonl`), builds the suffix array and saves the datastore at `out` (replacing only a datastore)."""
    start = time.perf_counter()
    record = provenance(corpus, tokenizer_identity(tokenizer))
    docs = read_documents(corpus, tokenizer, "corpus", "--corpus")
    store = Datastore.from_tokens(np.fromiter((t for d in docs for t in d), np.int32))
    check_token_range(store.tokens_R, tokenizer.vocab_size, f"the corpus {corpus}")
    manifest = {
        "format": FORMAT,
        "provenance": record,
        "n_tokens": int(store.tokens_R.size),
        "n_documents": len(docs),
        "digests": {name: array_digest(getattr(store, f"{name}_R")) for name in ARRAYS},
        "bytes_per_token": store.nbytes / store.tokens_R.size,
        "build_s": round(time.perf_counter() - start, 3),
    }
    with files.atomic_dir(out, replaceable=is_datastore, what="datastore") as tmp:
        for name in ARRAYS:
            np.save(tmp / f"{name}.npy", getattr(store, f"{name}_R"), allow_pickle=False)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return dataclasses.replace(store, manifest=manifest)


def load(folder: str | Path) -> Datastore:
    """The datastore saved at `folder`; an error if it is missing, unfinished or was modified."""
    folder = Path(folder).absolute()
    rebuild = (
        "build it with `python -m specjax.datastore --corpus=FILE --model=MODEL --out=DIR` or pass --corpus"
    )
    if not is_datastore(folder):
        what = "does not exist" if not folder.exists() else "is not a specjax datastore (no manifest.json)"
        raise DatastoreError(f"datastore {folder} {what}; {rebuild}")
    manifest = json.loads((folder / MANIFEST).read_text())
    try:
        arrays = {name: np.load(folder / f"{name}.npy", allow_pickle=False) for name in ARRAYS}
    except (OSError, ValueError) as err:
        raise DatastoreError(f"datastore {folder} is unreadable ({err}); {rebuild}") from err
    if any(array_digest(arrays[name]) != manifest.get("digests", {}).get(name) for name in ARRAYS):
        raise DatastoreError(f"datastore {folder} was modified since it was built; {rebuild}")
    return Datastore(arrays["tokens"], arrays["suffix"], manifest)


def open_datastore(datastore: str, corpus: str, tokenizer) -> Datastore:
    """The datastore for the retrieval drafter's settings: with `corpus`, the one at `datastore` (default:
    `CORPUS.datastore`) if it was built from this corpus and tokenizer, else (re)built there; without, the one at
    `datastore`, refused if built with another tokenizer or if its corpus file has changed since."""
    if not datastore and not corpus:
        raise DatastoreError(
            "the retrieval drafter needs a datastore; pass --datastore=DIR (built by `python -m "
            "specjax.datastore`) or --corpus=FILE (.txt or .jsonl) to build one"
        )
    if tokenizer is None:
        raise DatastoreError(
            "the retrieval datastore holds the target's tokens, but this target has no tokenizer; "
            "load a model that has one"
        )
    tokenizer_id = tokenizer_identity(tokenizer)
    if corpus:
        wanted = provenance(corpus, tokenizer_id)
        out = Path(datastore or f"{corpus}.datastore").absolute()
        if is_datastore(out):
            try:
                store = load(out)
                if store.manifest.get("provenance") == wanted:
                    return store
                logging.warning(
                    "rebuilding the datastore %s: it was built from another corpus or tokenizer", out
                )
            except DatastoreError as err:
                logging.warning("rebuilding the datastore %s: %s", out, err)
        return build(corpus, tokenizer, out)
    store = load(datastore)
    recorded = store.manifest.get("provenance", {})
    if recorded.get("tokenizer") != tokenizer_id:
        raise files.ProvenanceError(
            f"datastore {datastore} was built with another tokenizer than the target's; rebuild it with the "
            "target's model (`python -m specjax.datastore --model=...`) or pass --corpus to build one"
        )
    source = recorded.get("corpus", {})
    if Path(source.get("file", "")).is_file() and files.sha256_file(source["file"]) != source.get("sha256"):
        raise files.ProvenanceError(
            f"datastore {datastore} was built from {source['file']}, which has changed since; rebuild it: "
            f"pass --corpus={source['file']}"
        )
    return store


def main(argv=None) -> int:
    """`python -m specjax.datastore --corpus=FILE --model=MODEL --out=DIR`: builds a datastore. A user error
    ends with one line `error: ...` and exit status 1 (SPECJAX_DEBUG=1: traceback)."""
    from specjax import cli
    from specjax.models.loading import load_model

    parser = cli.ArgumentParser(prog="python -m specjax.datastore", description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", required=True, help="a .txt (one document per line) or .jsonl file")
    parser.add_argument(
        "--model", default="stories260K", help="the target whose tokenizer tokenises the corpus"
    )
    parser.add_argument("--out", default="", help="the datastore folder (default: CORPUS.datastore)")
    args = parser.parse_args(argv)
    try:
        store = build(args.corpus, load_model(args.model).tokenizer, args.out or f"{args.corpus}.datastore")
    except cli.USER_ERRORS as err:
        if cli.debug():
            raise
        print(f"error: {cli.describe(err)}", file=sys.stderr)
        return 1
    m = store.manifest
    print(
        f"wrote {m['n_tokens']:,} tokens of {m['n_documents']:,} documents to {args.out or args.corpus + '.datastore'} "
        f"in {m['build_s']:.2f} s ({m['bytes_per_token']:.0f} bytes per token)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
