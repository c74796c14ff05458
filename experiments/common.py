"""Model helpers shared by the benchmark scripts: random-weight models on disk, datastores, Medusa's accuracy, peer
generation (prompts, timing in turns and writing: `experiments.harness`; timed passes: `experiments.costs`)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

# What `--drafter=layer_skip --layers=auto` chose on stories260K (greedy tau 2.58 at K=4).
LAYER_SKIP = "0-1,3-4"


def story_datastore(target, n_tokens: int):
    """A retrieval datastore of stories stories260K sampled itself (T=1, 256 tokens each) from openings that are
    not benchmark prompts: the nearest to a story corpus available offline."""
    from specjax.datastore import Datastore
    from specjax.decoding import GenerateSpec, generate
    from specjax.sampling import Sampler

    openings = ["Once", "One day", "There was a", "The little", "In a small town", "A girl", "A boy", "Mom"]
    prompts = [target.tokenizer.encode(t) for t in openings] * max(1, -(-n_tokens // (256 * len(openings))))
    gen = generate(
        target.cfg, target.graphdef, target.params, prompts, GenerateSpec(256, Sampler(1.0)), seed=7
    )
    rows = [np.asarray(t)[:n] for t, n in zip(gen.tokens, gen.lengths)]
    return Datastore.from_tokens(np.concatenate(rows)[:n_tokens])


def medusa_accuracy(target, meta, graphdef, params, sequences):
    """Per Medusa head: top-1 and top-5 accuracy on `sequences` (the Medusa paper's Table 1 layout)."""
    from specjax.drafters.medusa import medusa_loss
    from specjax.training.losses import target_features

    feats = target_features(target.cfg, target.graphdef, target.params, sequences)
    _, metrics = medusa_loss(graphdef, params, feats, sequences, np.ones_like(sequences), 1.0)
    return [
        dict(
            head=i + 1,
            predicts=f"t+{i + 2}",
            top1=float(metrics[f"head{i}_top1"]),
            top5=float(metrics[f"head{i}_top5"]),
        )
        for i in range(meta["shape"]["num_heads"])
    ]


def hf_generate(model, prompts, n: int, temperature: float, repeats: int, **kwargs):
    """(tokens/s, tau, outputs) of transformers' `model.generate(..., **kwargs)` over the prompts, batch 1:
    medians of `repeats` timed runs after one untimed run, which gives the outputs and tau = new tokens / target
    forward passes (counted with a forward hook)."""
    import torch

    passes = [0]
    hook = model.register_forward_hook(lambda *_: passes.__setitem__(0, passes[0] + 1))
    kwargs |= dict(max_new_tokens=n, eos_token_id=None, pad_token_id=0, do_sample=temperature > 0)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    seconds, total_passes, total_new, outputs = 0.0, 0, 0, []
    try:
        with torch.inference_mode():
            for i, p in enumerate(prompts):
                ids = torch.tensor([p])
                times = []
                for r in range(repeats + 1):  # the first run warms up and is counted for tau
                    torch.manual_seed(1000 * i + r)
                    passes[0] = 0
                    start = time.perf_counter()
                    out = model.generate(ids, **kwargs)
                    times.append(time.perf_counter() - start)
                    if r == 0:
                        total_passes += passes[0]
                        total_new += out.shape[1] - len(p)
                        outputs.append(out[0, len(p) :].tolist())
                seconds += float(np.median(times[1:]))
    finally:
        hook.remove()
    return total_new / seconds, total_new / total_passes, outputs


# Random-weight Llama shapes of the benchmarks (llama2.c's 15M and 110M TinyStories shapes).
SHAPES = {
    "llama-15M": dict(dim=288, n_layers=6, n_heads=6, n_kv_heads=6, hidden_dim=768, vocab_size=32000),
    "llama-110M": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, hidden_dim=2048, vocab_size=32000),
}


def quiet_transformers():
    """transformers with its notes and progress bars off: loading a peer is not what a benchmark reports."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def random_hf_model(shape: dict, path: Path, seed: int = 0):
    """A random transformers LlamaForCausalLM of `shape`, saved as safetensors at `path` (tied embeddings)."""
    import torch
    import transformers

    from specjax.models.config import LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(max_seq_len=1024, tie_embeddings=True, **shape)
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    model.save_pretrained(path)
    return model
