"""Decodes text with a Llama-family model. With no flags: a story from stories260K.

    python run_decode.py --prompt="Once upon a time" --max_new_tokens=200 --temperature=0.8
"""

from absl import app, flags, logging

from specjax.decode import GenerateSpec
from specjax.models.loading import load_model
from specjax.runner import decode_texts
from specjax.sampling import Sampler

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "Model path, hub repo id, or None for stories260K (see specjax/models/loading.py).")
flags.DEFINE_multi_string("prompt", None, "Prompt text (repeatable). Default: 'Once upon a time'.")
flags.DEFINE_string("prompts_file", None, "A file with one prompt per line.")
flags.DEFINE_integer("max_new_tokens", 200, "Tokens to generate per prompt.")
flags.DEFINE_float("temperature", 0.0, "Sampling temperature; 0 = greedy.")
flags.DEFINE_integer("top_k", 0, "Keep the k most likely tokens (0 = off).")
flags.DEFINE_float("top_p", 1.0, "Nucleus sampling mass in (0, 1] (1 = off).")
flags.DEFINE_integer("seed", 0, "Random seed.")
flags.DEFINE_integer("batch_size", 8, "Prompts decoded together.")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "Parameter and activation dtype.")


def read_prompts() -> list[str]:
    prompts = list(FLAGS.prompt or [])
    if FLAGS.prompts_file:
        with open(FLAGS.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    return prompts or ["Once upon a time"]


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    sampler = Sampler(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p)
    prompts = read_prompts()
    model = load_model(FLAGS.model, FLAGS.dtype)
    spec = GenerateSpec(FLAGS.max_new_tokens, sampler, eos_id=model.cfg.eos_id)
    report = decode_texts(model, prompts, spec, FLAGS.seed, FLAGS.batch_size)
    for prompt, text in zip(prompts, report.texts):
        print(f"--- {prompt!r}\n{prompt}{text}\n")
    print(f"| model | dtype | prompts | new tokens | compile s | decode s | tokens/s |\n|---|---|---|---|---|---|---|\n"
          f"| {model.path.name} | {model.cfg.dtype} | {len(prompts)} | {report.new_tokens} | {report.compile_s:.2f} "
          f"| {report.run_s:.3f} | {report.tokens_per_s:.1f} |")


if __name__ == "__main__":
    app.run(main)
