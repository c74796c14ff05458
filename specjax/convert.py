"""Converts a model (HF directory, llama2.c file, hub id or 'stories260K') into a specjax Orbax checkpoint.

python -m specjax.convert SRC DST [--dtype=float32]

DST must not exist yet (or be an empty directory): the checkpoint is written beside it under a temporary name
and renamed into place when complete, so an interrupted conversion leaves nothing that passes for a
checkpoint and a retry starts clean. The checkpoint records its source
(`specjax.models.conversion.source_record`). A user error ends with one line `error: ...` (exit status 1);
SPECJAX_DEBUG=1 shows the traceback.
"""

from absl import flags

from specjax import cli
from specjax.models.conversion import convert

flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16", "float16"], "Parameter dtype of the checkpoint."
)


def main(argv):
    if len(argv) != 3:
        raise cli.UsageError(
            f"expected a source and a destination, got {len(argv) - 1} argument{'s' * (len(argv) != 2)}; "
            "usage: python -m specjax.convert SRC DST [--dtype=float32]"
        )
    out, model = convert(argv[1], argv[2], flags.FLAGS.dtype)
    print(f"wrote {model.cfg.num_params:,} parameters ({model.cfg.dtype}) to {out}")


if __name__ == "__main__":
    cli.run(main, positional=True)
