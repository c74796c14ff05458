"""Converts a model (HF directory, llama2.c file, hub id or 'stories260K') into a specjax Orbax checkpoint.

python -m specjax.convert SRC DST [--dtype=float32]
"""

from absl import app, flags

from specjax.checkpoint import save_model
from specjax.models.loading import load_model, tokenizer_files

flags.DEFINE_enum(
    "dtype", "float32", ["float32", "bfloat16", "float16"], "Parameter dtype of the checkpoint."
)


def main(argv):
    if len(argv) != 3:
        raise app.UsageError("usage: python -m specjax.convert SRC DST")
    model = load_model(argv[1], flags.FLAGS.dtype)
    out = save_model(argv[2], model.cfg, model.params, tokenizer_files(model.path))
    print(f"wrote {model.cfg.num_params:,} parameters ({model.cfg.dtype}) to {out}")


if __name__ == "__main__":
    app.run(main)
