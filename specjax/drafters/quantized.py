"""Quantised self-draft: the target itself, its matrices quantised weight-only to int8 or int4
(`specjax.models.quantize`), drafts a chain (or tree) of K tokens with its own KV cache, as `DraftModel` does.
No training, no second model; the draft's weights are about a quarter (int8) or a sixth (int4) of the target's
bytes per token (`quantize.bytes_per_token`), a saving that speeds drafting where XLA fuses dequantisation into
the products (GPU, TPU), not on XLA CPU (see `specjax.models.quantize`). Verification by the float target keeps
the output exact.

    python run_decode.py --drafter=quantized --bits=8 --k=6 --compare_ar
    python run_decode.py --drafter=quantized --bits=4 --group_size=32 --k=4 --temperature=1
"""

from __future__ import annotations

import dataclasses

from flax import nnx

from specjax.drafters.draft_model import DraftModel
from specjax.drafting import registry
from specjax.models.quantize import Quantization, quantize_model
from specjax.models.weights import build_params


@dataclasses.dataclass(frozen=True)
class QuantizedSettings:
    bits: int = 8
    group_size: int = 0
    HELP = {
        "bits": "Quantised self-draft: bits per weight, 8 or 4.",
        "group_size": "Quantised self-draft: input columns per scale; 0 = one scale per output channel "
        "(int4 is usually grouped, e.g. 32).",
    }

    def __post_init__(self):
        self.quantization()  # bad values are errors here, before any weight is touched or compiled

    def quantization(self) -> Quantization:
        return Quantization(self.bits, self.group_size)


def build(target, settings: QuantizedSettings, k: int, tree, sampler):
    """(DraftModel over the quantised target, its params: ints and scales, the float embedding and norms
    shared with the target)."""
    quantization = settings.quantization()
    quantization.check(target.cfg)
    graphdef, params = quantize_model(target.graphdef, target.params, quantization)
    return DraftModel(target.cfg, graphdef, k, sampler, tree), params


PAIRS = (("attn_norm", "wqkv"), ("mlp_norm", "w_gate_up"))  # a norm and the matrix it feeds


def example(target, k: int, tree, sampler, outlier: float = 16.0):
    """For exactness checks on a tiny random target, whose int8 and int4 copies draft its distribution almost
    exactly (no rejections: nothing to check): the target rewritten to compute the same function with an outlier
    input column in the matrices its norms feed (norm weight 0 divided by `outlier`, column 0 multiplied by it),
    then quantised to int4 per output channel, so that rounding moves the draft well away from the target."""
    pure = nnx.to_pure_dict(target.params)
    pairs = [(layer, n, w) for layer in pure["layers"].values() for n, w in PAIRS] + [
        (pure, "norm", "lm_head")
    ]
    for module, norm, linear in pairs:
        if module.get(linear):  # a tied head has no lm_head entry
            module[norm]["weight"] = module[norm]["weight"].at[0].divide(outlier)
            module[linear]["weight"] = module[linear]["weight"].at[:, 0].multiply(outlier)
    graphdef, params = build_params(target.cfg, pure)
    outliers = dataclasses.replace(target, graphdef=graphdef, params=params)
    return build(outliers, QuantizedSettings(bits=4), k, tree, sampler)


registry.register(
    registry.Entry("quantized", QuantizedSettings, build, help=QuantizedSettings.HELP, example=example)
)
