"""Whether a draft fits a target, read from their configs (no weights where the formats allow, nothing compiled):

    python -m specjax.pair --target stories260K --draft heads/stories260K_eagle3

The target is anything `run_decode.py --model` takes. The draft is one of:
- a draft model (anything `--model` takes): a supported family, any (it may differ from the target's), with the
  target's vocabulary size and tokenizer (the same special ids and the same text for every token);
- a `train_heads.py` workdir or an export of one: its heads.json records the target it was trained for (the same
  `specjax.drafting.protocol.target_signature`), and the target layers its heads read must exist;
- a head in its authors' layout (`specjax.published`): its config.json's hidden size, vocabulary, number of target
  layers and the target layers it reads (EAGLE-3's `eagle_aux_hidden_state_layer_ids`, DFlash's
  `target_layer_ids`) must fit.
A mismatch is a PairError whose one line names both sides' values and the fix; on success `check_pair` returns a
report whose line summarises the pair. `run_decode.py` and the trainer call `check_pair` before compiling anything.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np

from specjax import heads, published, speculators_format
from specjax.drafting import registry
from specjax.drafting.protocol import target_signature
from specjax.errors import CheckpointError, HeadsError, PairError, SpecjaxError
from specjax.models import loading, store
from specjax.models.config import SUPPORTED_MODEL_TYPES, LlamaConfig

# a published head's config.json key naming the target layers it reads -> (the section that may hold it, the id of
# specjax's tap 0): EAGLE-3's id j is the input of target layer j (specjax's tap j - 1), DFlash's the output of j
DESCRIPTION = (
    "Says whether a draft fits a target: vocabulary and tokenizer, hidden size, the target layers a head reads, "
    "family; one line either way (a mismatch: `error: ...`, exit status 1)."
)
LAYER_IDS = {
    "eagle_aux_hidden_state_layer_ids": ("eagle_config", 1),
    "target_layer_ids": ("dflash_config", 0),
}


class Target(NamedTuple):
    cfg: LlamaConfig
    tokenizer: object | None  # None: not compared
    name: str

    def describe(self) -> str:
        c = self.cfg
        return f"{self.name} ({c.family}, {c.n_layers} layers, hidden {c.dim}, {c.vocab_size}-token vocabulary)"


@dataclasses.dataclass(frozen=True)
class PairReport:
    draft: str
    target: str

    def __str__(self) -> str:
        return f"ok: {self.draft} fits {self.target}"


@dataclasses.dataclass(frozen=True)
class Model:
    """A target-like model's config and tokenizer."""

    path: Path
    cfg: LlamaConfig
    tokenizer: object


def read_model(name: str | Path | None, weights: bool = True) -> Model | None:
    """The config and tokenizer of a model `run_decode.py --model` takes, without its weights where its format
    allows (a specjax checkpoint, a Hugging Face directory); a llama2.c file keeps its config among its weights:
    loaded with `weights`, else None."""
    path = loading.resolve(None if name is None else str(name))
    if (path / store.MARKER).exists():
        cfg, folder = store.read_config(path), path / "tokenizer"
    elif (path / "config.json").is_file():
        cfg, folder = loading.read_hf_config(path / "config.json"), path
    elif weights:
        model = loading.load_model(str(path))
        return Model(path, model.cfg, model.tokenizer)
    else:
        return None
    return Model(path, cfg, loading.load_tokenizer(folder, cfg.vocab_size))


def check_family(cfg: LlamaConfig, what: str) -> None:
    if cfg.family not in SUPPORTED_MODEL_TYPES:
        raise PairError(
            f"{what} is a {cfg.family!r} model, a family specjax does not run ({', '.join(SUPPORTED_MODEL_TYPES)}); "
            "pass a model of one of these families"
        )


def tokenizer_difference(target_tok, draft_tok) -> str | None:
    """How the draft's tokenizer differs from the target's (None: the same size, special ids and text of every
    token; a token either side decodes to '' alone, a special token or a lone byte, is not compared)."""
    for what in ("vocab_size", "bos_id", "eos_id"):
        ours, theirs = getattr(target_tok, what), getattr(draft_tok, what)
        if ours != theirs:
            return f"{what} {theirs} in the draft's, {ours} in the target's"
    for i in range(target_tok.vocab_size):
        ours, theirs = target_tok.decode([i]), draft_tok.decode([i])
        if ours and theirs and ours != theirs:
            return f"token {i} is {theirs!r} in the draft's, {ours!r} in the target's"
    return None


def check_layers(what: str, taps, t: Target, fix: str, source: str = "") -> None:
    """Refuses a head reading target layers (specjax's taps) that the target does not have."""
    n = t.cfg.n_layers
    if any(not 0 <= j < n for j in taps):
        raise PairError(
            f"{what} reads target layers {list(taps)}{source}, the target {t.name} has {n} (0..{n - 1}); {fix}"
        )


@dataclasses.dataclass(frozen=True)
class ModelDraft:
    model: Model

    def check(self, t: Target) -> str:
        cfg, what = self.model.cfg, f"the draft model {self.model.path}"
        fix = f"pass a draft model that shares the tokenizer of {t.name}"
        check_family(cfg, what)
        if cfg.vocab_size != t.cfg.vocab_size:
            raise PairError(
                f"{what} has a {cfg.vocab_size}-token vocabulary, the target {t.name} a {t.cfg.vocab_size}-token "
                f"one; {fix}"
            )
        diff = None if t.tokenizer is None else tokenizer_difference(t.tokenizer, self.model.tokenizer)
        if diff:
            raise PairError(f"{what} has another tokenizer than the target {t.name} ({diff}); {fix}")
        family = "" if cfg.family == t.cfg.family else ", another family with the same tokenizer"
        return (
            f"draft model {self.model.path} ({cfg.family}, {cfg.n_layers} layers, hidden {cfg.dim}{family})"
        )


@dataclasses.dataclass(frozen=True)
class HeadsDraft:
    """A train_heads.py workdir or an export of one (its heads.json, `meta`)."""

    path: Path
    meta: dict

    def check(self, t: Target) -> str:
        method, shape = self.meta["method"], self.meta["shape"]
        what, fix = f"the {method} heads in {self.path}", f"pass heads trained for {t.name}, or train them"
        theirs, ours = self.meta["target"], target_signature(t.cfg)
        differ = [
            f"{k} {theirs.get(k)} in heads.json, {ours.get(k)} in {t.name}"
            for k in sorted({*theirs, *ours})
            if theirs.get(k) != ours.get(k)
        ]
        if differ:
            raise PairError(
                f"{what} were trained for another target than {t.name} ({', '.join(differ)}); {fix}"
            )
        try:
            taps = tuple(registry.trained(method).feature_taps(shape, t.cfg))
        except (KeyError, TypeError, ValueError) as err:
            raise HeadsError(
                f"{self.path / heads.META} describes {method} heads of shape {shape} whose target layers cannot be "
                f"read ({type(err).__name__}: {err}); restore the heads.json the run wrote, or retrain"
            ) from err
        check_layers(what, taps, t, fix)
        return f"{method} heads {self.path}" + (f" (reading target layers {list(taps)})" if taps else "")


@dataclasses.dataclass(frozen=True)
class PublishedDraft:
    """A head in its authors' layout: its method and config.json."""

    path: Path
    method: str
    config: dict

    def check(self, t: Target) -> str:
        what, fix = f"the {self.method} head in {self.path}", f"pass a head trained for {t.name}"
        sizes = {
            "hidden_size": t.cfg.dim,
            "target_hidden_size": t.cfg.dim,
            "vocab_size": t.cfg.vocab_size,
            "num_target_layers": t.cfg.n_layers,
        }
        for key, ours in sizes.items():
            if self.config.get(key) not in (None, ours):
                raise PairError(f"{what} has {key} {self.config[key]}, the target {t.name} {ours}; {fix}")
        taps, source = self.taps()
        check_layers(what, taps, t, fix, source)
        return f"published {self.method} head {self.path}" + (
            f" (reading target layers {taps})" if taps else ""
        )

    def taps(self) -> tuple[list[int], str]:
        """(specjax's taps, where config.json names them) of the target layers the head reads; ([], ''): the
        layout's default layers for the target."""
        for key, (section, first) in LAYER_IDS.items():
            ids = (self.config.get(section) or {}).get(key, self.config.get(key))
            if ids is None:
                continue
            if not isinstance(ids, list) or not all(type(j) is int for j in ids):
                raise CheckpointError(
                    f"{self.path / 'config.json'} has {key}={ids!r}, not a list of layer ids; download it again"
                )
            return [j - first for j in ids], f" ({key} {ids} in its config.json)"
        return [], ""


Draft = ModelDraft | HeadsDraft | PublishedDraft


def read_json(file: Path) -> dict:
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file} is missing or corrupt ({err}); download it again") from err
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{file} holds a {type(config).__name__}, not a JSON object; download it again"
        )
    return config


def tensor_shapes(file: Path) -> dict:
    """The tensors of a weight file; of a safetensors file, stand-ins of their shapes read from its header."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(file), "np") as f:
                names = f.keys()  # a safe_open handle is not iterable
                return {k: np.broadcast_to(np.float32(0), f.get_slice(k).get_shape()) for k in names}
        except Exception:  # a damaged file: read_tensors says what is wrong
            pass
    return published.read_tensors(file)


def published_method(path: Path) -> str | None:
    """The method of the published head layout in directory `path` (`specjax.published.kind_of`), or None."""
    names = dict.fromkeys(n for layout in published.layouts().values() for n in layout.weights)
    file = next((path / n for n in names if (path / n).is_file()), None)
    return None if file is None else published.kind_of(tensor_shapes(file))


def read_draft(source: str | Path, model: bool = True) -> Draft | None:
    """The draft at `source`: a directory with heads.json is specjax heads, one with config.json a published head
    if its weights are one of `specjax.published`'s layouts, else a draft model; anything else a draft model if
    `model` (read by `read_model`, whose errors say what is missing), else None."""
    path = Path(source)
    if (path / heads.META).is_file():
        return HeadsDraft(path.absolute(), heads.read_meta(path))
    if speculators_format.holds(path):  # vLLM's speculators format: checked as its published layout
        return PublishedDraft(path.absolute(), *speculators_format.published_config(path))
    if (path / "config.json").is_file():
        method = published_method(path)
        if method is not None:
            return PublishedDraft(path.absolute(), method, read_json(path / "config.json"))
    return ModelDraft(read_model(source)) if model or (path / "config.json").is_file() else None


def check_pair(
    target_cfg: LlamaConfig, target_tokenizer, draft: Draft | str | Path, target_name: str = "the target"
) -> PairReport:
    """The report of a draft (a Draft, or a path that `read_draft` reads) that fits the target; PairError, one line
    naming both sides' values and the fix, if it does not. `target_tokenizer` None: tokenizers are not compared."""
    target = Target(target_cfg, target_tokenizer, target_name)
    check_family(target_cfg, f"the target {target_name}")
    if not isinstance(draft, Draft):
        draft = read_draft(draft)
    return PairReport(draft.check(target), target.describe())


def named(flag: str, value: str, read):
    """`read(value)`, a specjax error prefixed with the flag that named the file."""
    try:
        return read(value)
    except SpecjaxError as err:
        raise type(err)(f"--{flag}={value}: {err}") from err


def main(argv=None) -> int:
    """`python -m specjax.pair --target T --draft D`: prints one line if the draft fits the target; else one line
    `error: ...` and exit status 1 (SPECJAX_DEBUG=1: the traceback)."""
    from specjax import cli

    parser = cli.ArgumentParser(prog="python -m specjax.pair", description=DESCRIPTION)
    parser.add_argument(
        "--target", required=True, help="a model run_decode.py --model takes (e.g. stories260K)"
    )
    parser.add_argument(
        "--draft",
        required=True,
        help="a draft model, a train_heads.py workdir (or an export of one), or a head in its authors' layout "
        "(EAGLE, EAGLE-3, Medusa, z-lab DFlash)",
    )
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        target = named("target", args.target, read_model)
        draft = named("draft", args.draft, read_draft)
        report = check_pair(target.cfg, target.tokenizer, draft, args.target)
    except cli.USER_ERRORS as err:
        if cli.debug():
            raise
        cli.fail(cli.describe(err))
    print(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
