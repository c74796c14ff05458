"""A mixture-of-experts decode step against a dense one with the same active parameters (batch 1, greedy, float32).

    .venv/bin/python -m experiments.bench_moe [--repeats=7] [--new_tokens=64]

Random weights, memory-bound shapes: a Mixtral-style model (E experts, k routed per token, experts of hidden size
F) and a Llama of the same shape whose MLP has hidden size k * F, so a token reads the same bytes in both (the
router's E x dim aside). The two decode in turns (`interleaved_medians`). The floor of each is the bytes a token
must read (active weights and the KV cache) over the read bandwidth measured in the same run; the MoE's "all
experts" floor is what a step that read every expert would cost. Writes results/bench_moe.{md,csv}.
"""

from absl import flags, logging

from experiments import harness
from experiments.costs import read_bandwidth_gbs
from experiments.harness import interleaved_medians, write_table
from specjax import cli
from specjax.decoding import compile_decode
from specjax.models.config import LlamaConfig
from specjax.models.llama import init_params

flags.DEFINE_integer("repeats", 7, "Timed runs per model (median reported).")
flags.DEFINE_integer("new_tokens", 64, "Tokens generated per run.")
flags.DEFINE_list(
    "moe", ["8x2", "32x4"], "MoE shapes EXPERTSxPICKS (routed experts per layer x experts a token runs)."
)
FLAGS = flags.FLAGS
PROMPT = [1, *range(300, 308)]


def configs() -> list[tuple[str, LlamaConfig, str]]:
    """(name, config, its dense twin's name): each MoE after its twin (same attention, same active MLP bytes)."""
    out, f = [], 2048
    for shape in FLAGS.moe:
        e, k = map(int, shape.split("x"))
        dense = LlamaConfig(
            vocab_size=4096, dim=1024, n_layers=4, n_heads=16, n_kv_heads=4, hidden_dim=k * f
        )
        twin = f"dense, hidden {k * f}"
        out.append((twin, dense, twin))
        out.append(
            (
                f"moe {e}x{k}",
                dense.replace(family="mixtral", n_experts=e, experts_per_token=k, expert_dim=f),
                twin,
            )
        )
    return out


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    bandwidth = read_bandwidth_gbs()
    n = FLAGS.new_tokens
    spec = harness.generate_spec(n, eos_id=None)
    runs, compile_s, cases = {}, {}, configs()
    for name, cfg, _ in cases:
        graphdef, params = init_params(cfg, seed=0)
        run, compile_s[name] = compile_decode(cfg, graphdef, params, [PROMPT], spec)
        runs[name] = lambda run=run: run([PROMPT]).tokens.block_until_ready()
    times = interleaved_medians(runs, FLAGS.repeats)
    rows = []
    for name, cfg, twin in cases:
        slots = -(-(len(PROMPT) + n) // 64) * 64
        cache = 2 * cfg.n_layers * slots * cfg.n_kv_heads * cfg.head_dim * 4
        ms = 1e3 * times[name] / n
        floor = 1e3 * (cfg.active_params * 4 + cache) / (bandwidth * 1e9)
        rows.append(
            {
                "model": name,
                "params": f"{cfg.num_params / 1e6:.0f}M",
                "active": f"{cfg.active_params / 1e6:.1f}M",
                "compile s": compile_s[name],
                "ms/token": ms,
                "vs dense twin": times[name] / times[twin],
                "floor ms": floor,
                "of floor": floor / ms,
                "all-experts floor ms": 1e3 * (cfg.num_params * 4 + cache) / (bandwidth * 1e9),
            }
        )
        print(rows[-1], flush=True)
    title = (
        f"MoE vs dense decode step, batch 1, {n} new tokens, greedy, float32, random weights, median of "
        f"{FLAGS.repeats} in turns; read bandwidth {bandwidth:.1f} GB/s"
    )
    print(write_table("bench_moe", rows, title))


if __name__ == "__main__":
    cli.run(main)
