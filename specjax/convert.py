"""Converts a model (HF directory, llama2.c file, hub id or 'stories260K') into a specjax Orbax checkpoint.

python -m specjax.convert SRC DST [--dtype=float32]

DST must not exist yet (or be an empty directory): the checkpoint is written beside it under a temporary name
and renamed into place when complete, so an interrupted conversion leaves nothing that passes for a
checkpoint and a retry starts clean. A user error ends with one line `error: ...`; SPECJAX_DEBUG=1 shows the
traceback.
"""

import os
import sys

from absl import app, flags

from specjax.checkpoint import save_model
from specjax.models.loading import load_model, tokenizer_files

flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16", "float16"], "Parameter dtype of the checkpoint."
)


def main(argv):
    if len(argv) != 3:
        raise app.UsageError("usage: python -m specjax.convert SRC DST")
    try:
        model = load_model(argv[1], flags.FLAGS.dtype)
        out = save_model(argv[2], model.cfg, model.params, tokenizer_files(model.path))
    except (
        ValueError,
        OSError,
    ) as err:  # specjax's typed errors are ValueErrors; OSError: unreadable files
        if os.environ.get("SPECJAX_DEBUG"):
            raise
        sys.exit(f"error: {err}")
    print(f"wrote {model.cfg.num_params:,} parameters ({model.cfg.dtype}) to {out}")


if __name__ == "__main__":
    app.run(main)
