"""specjax AR decoding vs transformers' PyTorch `generate` on identical weights (batch 1, greedy, float32).

    .venv/bin/python -m experiments.bench_ar [--repeats=5] [--new_tokens=128] \
        [--models=stories260K,llama-15M,llama-110M]

The two systems take turns (`interleaved_medians`), so the machine's drift hits both alike.
Writes results/bench_ar.{md,csv}. The bandwidth floor is (weight bytes + KV-cache bytes read) per token
over the read bandwidth measured in the same run.
"""

import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from absl import flags, logging

from experiments import harness
from experiments.common import SHAPES, quiet_transformers, random_hf_model
from experiments.costs import read_bandwidth_gbs
from experiments.harness import interleaved_medians, write_table
from specjax import cli
from specjax.decoding import compile_decode
from specjax.models.loading import load_model

flags.DEFINE_integer("repeats", 5, "Timed runs per system (median reported).")
flags.DEFINE_integer("new_tokens", 128, "Tokens generated per run.")
flags.DEFINE_list("models", ["stories260K", "llama-15M", "llama-110M"], "Models to run.")
harness.define_precision_flag()
FLAGS = flags.FLAGS
PROMPT = "Once upon a time, there was a little"


def bench(name: str, model_dir: Path, bandwidth: float) -> dict:
    transformers = quiet_transformers()
    model = load_model(str(model_dir))
    prompt = model.tokenizer.encode(PROMPT) if name == "stories260K" else [1] + list(range(300, 308))
    n = FLAGS.new_tokens
    spec = harness.generate_spec(n, eos_id=None)
    run, compile_s = compile_decode(model.cfg, model.graphdef, model.params, [prompt], spec)
    ours = np.asarray(run([prompt]).tokens[0])

    peer = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    gen = lambda: peer.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        theirs = gen()[0, len(prompt) :].numpy()
        t = interleaved_medians(
            {"jax": lambda: run([prompt]).tokens.block_until_ready(), "torch": gen}, FLAGS.repeats
        )
    jax_s, torch_s = t["jax"], t["torch"]

    cfg = model.cfg
    cache_slots = spec.cache_size or (-(-(8 * -(-len(prompt) // 8) + n) // 64) * 64)
    cache_bytes = (
        2 * cfg.n_layers * cache_slots * cfg.n_kv_heads * cfg.head_dim * 4
    )  # the whole static cache is read
    floor_s = (cfg.num_params * 4 + cache_bytes) / (bandwidth * 1e9)
    ms = 1e3 * jax_s / n
    return {
        "model": name,
        "params": f"{cfg.num_params / 1e6:.2f}M",
        "same tokens": bool((ours == theirs).all()),
        "compile s": compile_s,
        "specjax ms/tok": ms,
        "torch ms/tok": 1e3 * torch_s / n,
        "speedup": torch_s / jax_s,
        "floor ms/tok": 1e3 * floor_s,
        "of floor": floor_s / (jax_s / n),
    }


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    torch.manual_seed(0)
    bandwidth = read_bandwidth_gbs()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in FLAGS.models:
            if name == "stories260K":
                path = load_model().path
            else:
                path = Path(tmp) / name
                random_hf_model(SHAPES[name], path)
                for f in (
                    "tokenizer.json",
                    "tokenizer_config.json",
                ):  # any tokenizer: ids are given directly
                    shutil.copy(load_model().path / f, path)
            rows.append(bench(name, path, bandwidth))
            print(rows[-1], flush=True)
    title = (
        f"AR decoding, batch 1, {FLAGS.new_tokens} new tokens, greedy, float32, median of {FLAGS.repeats}; "
        f"torch threads {torch.get_num_threads()}; read bandwidth {bandwidth:.1f} GB/s"
    )
    print(write_table("bench_ar", rows, title))


if __name__ == "__main__":
    cli.run(main)
