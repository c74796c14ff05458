"""The public checkpoint API in one import: specjax's Orbax layout (`specjax.models.store`: save, restore,
identity) and conversion into it (`specjax.models.conversion`). Nothing inside specjax imports this module; the
library imports the owners."""

from specjax.models.conversion import convert, converted, recorded_source, source_record
from specjax.models.store import (
    MARKER,
    identity,
    model_identity,
    params_digest,
    read_config,
    restore_model,
    restore_step,
    save_model,
)

__all__ = [
    "MARKER",
    "convert",
    "converted",
    "identity",
    "model_identity",
    "params_digest",
    "read_config",
    "recorded_source",
    "restore_model",
    "restore_step",
    "save_model",
    "source_record",
]
