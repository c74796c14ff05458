"""The exceptions specjax raises for a user's mistake, in one place, so that a notebook can catch them all:

    from specjax import errors
    try:
        ...
    except errors.SpecjaxError as err:   # any mistake specjax explains; str(err) says what is wrong and the fix
        print(err)

Each class also derives from the builtin the library raised before it had this module (ValueError,
FileNotFoundError, RuntimeError), so `except ValueError` keeps working. The modules that raise them re-export
them (`specjax.models.config.ConfigError is specjax.errors.ConfigError`). This module imports nothing of specjax.
"""

from __future__ import annotations


class SpecjaxError(Exception):
    """Base of every error specjax raises for a user's mistake; the message is one line, `<what>; <fix>`."""


# --- command lines, settings ---------------------------------------------------------------------------


class UsageError(SpecjaxError, ValueError):
    """A command line that cannot work: stray arguments, flags that do not go together, a bad value."""


class ConfigError(SpecjaxError, ValueError):
    """A model configuration specjax cannot run (or expand), with the reason and the fix."""


class TrainingConfigError(SpecjaxError, ValueError):
    """A training setting that cannot work; the message names the key, the value and the fix."""


class SamplingError(SpecjaxError, ValueError):
    """Sampling or acceptance settings that cannot work (temperature, top-k, top-p, an unknown rule)."""


class PrecisionError(SpecjaxError, ValueError):
    """An unknown matrix-product precision (`specjax.precision.CHOICES`)."""


class DecodingError(SpecjaxError, ValueError):
    """A decoding job that cannot run: no or empty prompts, prompt + new tokens beyond the context or the cache,
    token ids outside the vocabulary, a batch size below 1."""


class DrafterError(SpecjaxError, ValueError):
    """A drafter that cannot serve this target or these settings (unknown name, draft length, tree, adaptive K)."""


class PairError(DrafterError):
    """A draft that does not fit the target (`specjax.pair`): vocabulary, tokenizer, hidden size, the target layers
    a head reads, or a family specjax does not run; the message names both sides' values."""


class TreeError(DrafterError):
    """An invalid tree specification; the message names the offending path."""


class LookaheadError(DrafterError):
    """Invalid lookahead settings; the message says what is wrong and how to fix it."""


class NGramError(DrafterError):
    """Invalid n-gram drafter settings; the message says what is wrong and how to fix it."""


class LayerSkipError(DrafterError):
    """Invalid layer-skip settings; the message says what is wrong and how to fix it."""


class RetrievalError(DrafterError):
    """Invalid retrieval drafter settings; the message says what is wrong and how to fix it."""


class SuffixError(DrafterError):
    """Invalid suffix drafter settings or store; the message says what is wrong and how to fix it."""


class QuantizationError(SpecjaxError, ValueError):
    """Invalid quantisation settings (a scheme, a group size that does not divide the model's matrices)."""


class MeshError(SpecjaxError, ValueError):
    """A mesh that cannot hold the job (too many devices, an axis that does not divide a dimension)."""


# --- files read ----------------------------------------------------------------------------------------


class MissingInputError(SpecjaxError, FileNotFoundError):
    """A model, text or store that does not exist where it was asked for; the message says where to get it."""


class CheckpointError(SpecjaxError, ValueError):
    """A missing, corrupt or mismatched weight file or tokenizer; the message names the file and the fix."""


class HeadsError(CheckpointError):
    """A heads folder (or published head) that is malformed, or heads that were trained for another target or
    method than the one asked for."""


class DataError(SpecjaxError, ValueError):
    """Training data that cannot be used as it is; the message names the file or setting and the fix."""


class ChatDataError(SpecjaxError, ValueError):
    """Conversation data or a chat template that cannot be used; the message names the line or setting and the fix."""


class DatastoreError(SpecjaxError, ValueError):
    """A missing, unfinished or unusable retrieval datastore; the message names it and the fix."""


class ResultsError(SpecjaxError, ValueError):
    """A results file without its stamp, or a table without the columns it must have."""


# --- files written -------------------------------------------------------------------------------------


class FileSafetyError(SpecjaxError, ValueError):
    """specjax refuses to write or read a path (it would lose or mix data); the message names the path and the fix."""


class DestinationError(FileSafetyError):
    """A destination that exists and was not written by specjax, overlaps its source, or cannot be written."""


class ProvenanceError(FileSafetyError):
    """Files on disk that were made from another source, target or settings than the ones asked for."""


class LockedError(FileSafetyError):
    """A work directory, destination or store that another running process holds; the message names the lock."""


# --- runs ----------------------------------------------------------------------------------------------


class NonFiniteLossError(SpecjaxError, RuntimeError):
    """The loss or the gradient became NaN or infinite; the run stopped and kept its last good checkpoint."""
