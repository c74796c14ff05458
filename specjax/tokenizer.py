"""Tokenizers behind one small interface: Hugging Face, SentencePiece `.model`, and llama2.c `tok*.bin`."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Protocol

from specjax.errors import CheckpointError
from specjax.hf_import import import_transformers

# a Hugging Face tokenizer folder's files (with any SentencePiece `*.model` beside them): what it is read from
HF_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def files_in(folder: Path) -> list[Path]:
    """The tokenizer files of a model folder: Hugging Face's, SentencePiece `*.model`, llama2.c `tok*.bin`."""
    found = [folder / n for n in HF_FILES if (folder / n).exists()]
    return found + sorted(folder.glob("*.model")) + sorted(folder.glob("tok*.bin"))


class Tokenizer(Protocol):
    vocab_size: int
    bos_id: int
    eos_id: int
    files: tuple[Path, ...]  # what it was read from

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, BOS prepended."""

    def decode(self, ids) -> str:
        """Text of `ids` (special tokens dropped)."""


class HFTokenizer:
    """`transformers.AutoTokenizer` from a local directory."""

    def __init__(self, path: Path):
        self._tok = import_transformers().AutoTokenizer.from_pretrained(str(path))
        self.files = tuple(files_in(path))
        self.vocab_size = len(self._tok)
        self.bos_id = self._tok.bos_token_id
        self.eos_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=True)
        return ids if ids[:1] == [self.bos_id] or self.bos_id is None else [self.bos_id] + ids

    def decode(self, ids) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template (Jinja), if it has one."""
        return self._tok.chat_template

    def render_chat(self, messages: list[dict], template: str, add_generation_prompt: bool = False) -> str:
        """The text of `messages` ([{"role", "content"}]) under the Jinja chat `template`; with
        `add_generation_prompt`, followed by the header that opens the assistant's next turn."""
        return self._tok.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` as written (special tokens in it recognised, none added) and the character span
        of each in `text`."""
        enc = self._tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]


class SentencePieceTokenizer:
    """A SentencePiece `.model` file (Llama 2 / llama2.c `tok*.model`)."""

    def __init__(self, path: Path):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(path))
        self.files = (path,)
        self.vocab_size = self._sp.get_piece_size()
        self.bos_id, self.eos_id = self._sp.bos_id(), self._sp.eos_id()

    def encode(self, text: str) -> list[int]:
        return [self.bos_id] + self._sp.encode(text)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])


class Llama2cTokenizer:
    """llama2.c's `tok*.bin`: scored pieces, greedy highest-score pair merging, byte fallback."""

    bos_id, eos_id = 1, 2

    def __init__(self, path: Path, vocab_size: int):
        raw = path.read_bytes()
        self.vocab_size, self.files = vocab_size, (path,)
        (self.max_len,), offset = struct.unpack_from("i", raw), 4
        self.pieces, self.scores = [], []
        for _ in range(vocab_size):
            score, n = struct.unpack_from("fi", raw, offset)
            offset += 8
            self.pieces.append(raw[offset : offset + n])
            self.scores.append(score)
            offset += n
        if offset != len(raw):
            raise CheckpointError(
                f"tokenizer {path} does not hold exactly {vocab_size} pieces: it does not belong "
                "to this model (vocabulary mismatch) or is corrupt"
            )
        self._ids = {p: i for i, p in enumerate(self.pieces)}

    def encode(self, text: str) -> list[int]:
        if not text:
            return [self.bos_id]
        ids = [self._ids[b" "]] if b" " in self._ids else []  # SentencePiece's dummy prefix
        for ch in text:
            piece = ch.encode()
            ids.extend([self._ids[piece]] if piece in self._ids else [b + 3 for b in piece])
        while True:
            best, best_score = None, float("-inf")
            for i in range(len(ids) - 1):
                j = self._ids.get(self.pieces[ids[i]] + self.pieces[ids[i + 1]])
                if j is not None and self.scores[j] > best_score:
                    best, best_score = (i, j), self.scores[j]
            if best is None:
                return [self.bos_id] + ids
            i, j = best
            ids[i : i + 2] = [j]

    def decode(self, ids) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i in (0, self.bos_id, self.eos_id):
                continue
            piece = self.pieces[i]
            if piece.startswith(b"<0x") and piece.endswith(b">") and len(piece) == 6:
                out.append(int(piece[3:5], 16))
            else:
                out += piece
        return out.decode("utf-8", errors="replace").removeprefix(" ")
