"""transformers, imported without its notice that PyTorch is missing: specjax reads configs and tokenizers with it,
which need no PyTorch. That one notice is dropped; every other message of the library passes."""

import logging


def _not_the_torch_notice(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("PyTorch was not found.")


def import_transformers():
    """The `transformers` module, its missing-PyTorch notice silenced (before its first import prints it)."""
    library = logging.getLogger("transformers")
    if _not_the_torch_notice not in library.filters:
        library.addFilter(_not_the_torch_notice)
    import transformers

    return transformers
