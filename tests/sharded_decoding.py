"""Helper of test_sharding.py, run in its own process with 8 simulated CPU devices: decodes the same ragged batch
with each drafter (draft model, Medusa, EAGLE, n-gram) greedily on meshes (data x model) 2x4 (EAGLE also 1x8 and
8x1), sampled on one device and on 2x4 (not n-gram), and with AR greedily on one device and on 2x4; restores a
checkpoint onto 2x4. Prints the tokens of each run, the restored placement, and the collectives and host transfers
of the compiled 2x4 EAGLE program, as JSON."""

import json
import re
from pathlib import Path

import jax
import numpy as np

from specjax import heads, sharding
from specjax.decoding import GenerateSpec, compile_decode
from specjax.drafters.draft_model import DraftModel, truncated_target
from specjax.drafting import registry
from specjax.models.config import LlamaConfig
from specjax.models.llama import init_params
from specjax.sampling import Sampler

# Every axis of every mesh divides the kv heads (8), the MLP's hidden units and the batch (8).
CFG = LlamaConfig(
    vocab_size=97, dim=32, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=4, hidden_dim=64, max_seq_len=256
)
GRAPHDEF, PARAMS = init_params(CFG, seed=3)
# gpt-oss's parts (routed experts with biases, sinks, sliding and full layers, YaRN) in the same shape
MOE = CFG.replace(
    family="gpt_oss", n_experts=4, experts_per_token=2, expert_dim=64, qkv_bias=True, o_bias=True, attn_sinks=True,
    router="topk_softmax", expert_bias=True, swiglu_clamp=(1.702, 7.0), sliding_window=5,
    layer_types=("sliding", "full"), rope_yarn=(4.0, 32.0, 1.0, 64, False, 1.14),
)  # fmt: skip
MOE_GRAPHDEF, MOE_PARAMS = init_params(MOE, seed=5)
PROMPTS = [
    [1, 5, 9],
    [1],
    [1, 40, 41, 42, 43, 44, 45],
    [1, 7, 7, 7, 7],
    [1, 2],
    [1, 9, 9],
    [1, 3, 4, 5],
    [1, 60],
]


def drafter(name: str, sampler, target=(CFG, PARAMS)):
    target_cfg, target_params = target
    if name == "draft_model":
        cfg, graphdef, params = truncated_target(target_cfg, target_params, 1)
        return DraftModel(cfg, graphdef, 3, sampler, None), params
    if name == "ngram":
        entry = registry.get("ngram")
        return entry.build(None, entry.settings(), 3, None, sampler)
    shape = {"num_heads": 3, "num_layers": 1} if name == "medusa" else {}
    meta = heads.describe(name, shape, target_cfg)
    graphdef, params = heads.new_heads(meta, target_cfg, target_params, seed=4)
    return heads.make_drafter(meta, graphdef, target_cfg, 3, sampler), heads.drafter_params(
        meta, params, target_cfg, target_params
    )


def decode(name: str, temperature: float, mesh, target=(CFG, GRAPHDEF, PARAMS)):
    sampler = Sampler(temperature)
    spec = GenerateSpec(24, sampler, eos_id=None)
    cfg, graphdef, params = target
    d, dp = (None, None) if name == "ar" else drafter(name, sampler, (cfg, params))
    run, _ = compile_decode(cfg, graphdef, params, PROMPTS, spec, d, dp, mesh=mesh)
    return np.asarray(run(PROMPTS, seed=7).tokens).tolist()


def program_ops(mesh) -> dict:
    """Counts, in the compiled 2x4 EAGLE program, of collectives (it is really split) and host transfers."""
    sampler = Sampler(0.0)
    d, dp = drafter("eagle", sampler)
    spec = GenerateSpec(24, sampler, eos_id=None)
    from specjax.decoding import prepare_speculative
    from specjax.decoding.speculative import speculative_compiled

    tokens, lengths, spec = prepare_speculative(CFG, d, PROMPTS, spec)
    params = sharding.place_target(mesh, CFG, PARAMS, len(PROMPTS))
    tokens, lengths = jax.device_put((tokens, lengths), sharding.batch_sharding(mesh))
    with jax.set_mesh(mesh):
        text = (
            speculative_compiled.lower(
                CFG,
                GRAPHDEF,
                params,
                d,
                sharding.place_drafter(mesh, dp),
                tokens,
                lengths,
                jax.random.key(0),
                spec,
            )
            .compile()
            .as_text()
        )
    count = lambda pattern: len(re.findall(pattern, text))
    return {
        "collectives": count(
            r"\b(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\("
        ),
        "host_transfers": count(
            r"\b(send|recv|outfeed|infeed)(-done)?\(|custom_call_target=\"[^\"]*(host|callback)"
        ),
        "while_loops": count(r"\bwhile\("),
    }


def restored_on_mesh() -> dict:
    """A checkpoint restored straight onto the 2x4 mesh: each parameter's partition spec, and whether the values
    equal the saved ones."""
    import tempfile

    from specjax import checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint.save_model(Path(tmp) / "ckpt", CFG, PARAMS)
        mesh = sharding.make_mesh(2, 4)
        _, _, params = checkpoint.restore_model(
            path, shardings=lambda tree: sharding.llama_shardings(mesh, tree)
        )
    leaves = jax.tree_util.tree_leaves_with_path(params)
    saved = jax.tree.leaves(PARAMS)
    return {
        "specs": {"/".join(sharding._path(kp)): str(x.sharding.spec) for kp, x in leaves},
        "equal": all(
            np.array_equal(np.asarray(x), np.asarray(y)) for (_, x), y in zip(leaves, saved, strict=True)
        ),
    }


def hf_streamed() -> dict:
    """A Hugging Face model of 16 layers in 6 safetensors shards, read onto the 2x4 mesh a parameter at a time
    (`load_model(mesh=...)`'s path): whether it equals the single-device load and each parameter's partition
    spec, and the host's peak of traced allocations while loading beyond what the loaded arrays keep (XLA's CPU
    devices alias aligned host buffers: their memory is device memory here), against the model's bytes and
    against reading every tensor at once (the control)."""
    import tempfile
    import tracemalloc

    from safetensors.numpy import save_file

    from specjax.models.loading import read_hf_config
    from specjax.models.weights import params_from_hf, read_safetensors

    d, f, v, n = 128, 512, 97, 16
    hf = dict(
        model_type="llama",
        vocab_size=v,
        hidden_size=d,
        intermediate_size=f,
        num_hidden_layers=n,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    rng = np.random.default_rng(5)
    weight = lambda *shape: (0.02 * rng.standard_normal(shape)).astype(np.float32)
    shards = [{"model.embed_tokens.weight": weight(v, d)}]
    for i in range(n):
        p = f"model.layers.{i}."
        layer = {p + "input_layernorm.weight": weight(d), p + "post_attention_layernorm.weight": weight(d)}
        layer |= {p + f"self_attn.{x}_proj.weight": weight(d, d) for x in "qkvo"}
        layer |= {p + "mlp.gate_proj.weight": weight(f, d), p + "mlp.up_proj.weight": weight(f, d)}
        layer[p + "mlp.down_proj.weight"] = weight(d, f)
        shards[-1] |= layer
        if i % 3 == 2:
            shards.append({})
    shards[-1] |= {"model.norm.weight": weight(d), "lm_head.weight": weight(v, d)}
    total = sum(x.nbytes for shard in shards for x in shard.values())
    mesh = sharding.make_mesh(2, 4)

    def transient() -> int:  # the peak since the last call, less what is still held
        held, peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        return peak - held

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        (folder / "config.json").write_text(json.dumps(hf))
        where = {}
        for i, shard in enumerate(shards):
            save_file(shard, str(folder / f"model-{i}.safetensors"))
            where |= dict.fromkeys(shard, f"model-{i}.safetensors")
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": where}))
        del shards
        cfg = read_hf_config(folder / "config.json")
        tracemalloc.start()
        _, one = params_from_hf(cfg, read_safetensors(folder))
        one_device = transient()
        _, on_mesh = params_from_hf(cfg, read_safetensors(folder), sharding.leaf_placer(mesh))
        mesh_load = transient()
        files, before = read_safetensors(folder), tracemalloc.get_traced_memory()[0]
        everything = {name: files[name] for name in files}
        all_at_once = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        del everything
    leaves = jax.tree_util.tree_leaves_with_path(on_mesh)
    return {
        "model_bytes": total,
        "peak_one_device": one_device,
        "peak_mesh": mesh_load,
        "peak_all_at_once": all_at_once,
        "largest_layer_bytes": (4 * d * d + 3 * f * d + 2 * d) * 4,
        "specs": {"/".join(sharding._path(kp)): str(x.sharding.spec) for kp, x in leaves},
        "equal": all(
            np.array_equal(np.asarray(x), np.asarray(y))
            for (_, x), y in zip(leaves, jax.tree.leaves(one), strict=True)
        ),
    }


out = {"devices": len(jax.devices()), "restored": restored_on_mesh(), "hf": hf_streamed(), "runs": {}}
# Greedy: each drafter on 2x4, and EAGLE (whose own matrices are split like the target's) also on the one-axis
# meshes, against AR on one device (greedy speculation equals AR: other tests prove it on one device); sampled:
# each drafter that samples its drafts (not n-gram's point masses) on 2x4 against itself on one device.
runs = [("ar", 0.0, "1"), ("ar", 0.0, "2x4")]
for name in ("draft_model", "medusa", "eagle", "ngram"):
    meshes = ("1x8", "2x4", "8x1") if name == "eagle" else ("2x4",)
    runs += [(name, 0.0, m) for m in meshes] + [(name, 1.0, m) for m in ("1", "2x4") if name != "ngram"]
for name, temperature, label in runs:
    mesh = None if label == "1" else sharding.make_mesh(*map(int, label.split("x")))
    out["runs"][f"{name} T={temperature:g} {label}"] = decode(name, temperature, mesh)
# the mixture of experts: AR and EAGLE greedy on 2x4 against AR on one device
moe = (MOE, MOE_GRAPHDEF, MOE_PARAMS)
for name, temperature, label in [("ar", 0.0, "1"), ("ar", 0.0, "2x4"), ("eagle", 0.0, "2x4")]:
    mesh = None if label == "1" else sharding.make_mesh(*map(int, label.split("x")))
    out["runs"][f"moe {name} T={temperature:g} {label}"] = decode(name, temperature, mesh, moe)
out["program"] = program_ops(sharding.make_mesh(2, 4))
print(json.dumps(out))
