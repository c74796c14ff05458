"""Is a drafter with an acceptance rule lossless? A statistical check with its own negative control.

    python -m specjax.verify_exactness --drafter=draft_model --acceptance=tokenwise,block
    python -m specjax.verify_exactness --drafter=eagle --acceptance=block --temperature=0.7 --top_p=0.9
    python -m specjax.verify_exactness --drafter=medusa --acceptance=tokenwise --model=stories260K --tree=balanced_2x3
    python -m specjax.verify_exactness --drafter=draft_model --model=stories260K --drafter_setting=draft_layers=3

The drafter (any registered name) drafts for a target, the rule verifies, and the first `--tokens` new tokens of
`--samples` decodes of one prompt are compared with the target's own distribution (by default K + 2: the prefill's
token, then the first round's drafts and its bonus token, so a rule wrong only at its last positions is seen):

- `exact` (the default where the target's distribution over those tokens can be enumerated, V^(tokens - 1)
  prefixes, as on the default `--model=tiny`: a random 2-layer target with V = 8 and a scaled-up, peaked head):
  the target's joint probabilities are computed exactly, and a one-sample chi-square goodness-of-fit test (cells
  with an expected count under 5 pooled) asks whether the speculative samples follow them. On the tiny target,
  trained-head drafters get freshly initialised, perturbed heads (exactness must not depend on training) and the
  draft model is the truncated target (`registry.get(name).build` with default settings).
- `ar` (otherwise, e.g. `--model=stories260K`: drafters are built by the registry with their default settings,
  i.e. the committed heads): a two-sample chi-square test of speculative against autoregressive samples.

The negative control runs in the same compiled decode: the rows are split into groups, each rule verifying one
group and a deliberately broken copy of it (`ResampleFromTarget`: its accepted prefix, then the next token drawn
from the target's p instead of the rule's residual) another. The verdict is PASS when the rule's p-value is at
least `--alpha` and the control's is below it, FAIL when the rule's is below it, INCONCLUSIVE when even the
control passes (the test cannot see a broken rule here: raise `--samples` or use a drafter that gets rejections).
With `--greedy` (default) it also checks that greedy speculative decoding reproduces greedy decoding token for
token. The exit status is 0 only if every check passes. Total variation between the sampled and the reference
distribution is printed beside the sampling noise an exact rule would show (a lossy rule's distance reads off
the difference).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from specjax import acceptance, cli
from specjax.decoding import GenerateSpec, generate, speculative_generate
from specjax.drafting import registry
from specjax.drafting.trees import parse_tree
from specjax.errors import UsageError
from specjax.metrics import pooled
from specjax.models.config import LlamaConfig
from specjax.models.llama import causal_mask, forward, init_cache, init_params
from specjax.models.loading import LoadedModel, load_model
from specjax.sampling import Sampler, sample_probs

TINY = LlamaConfig(vocab_size=8, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, hidden_dim=32, max_seq_len=64)
_GEMMA = dict(
    norm_plus_one=True, activation="gelu_tanh", sandwich_norms=True, embed_scale=True, tie_embeddings=True
)
_WINDOW = dict(sliding_window=3, layer_types=("sliding", "full"))  # a window the checked sequences outgrow
_EXPERTS = dict(n_experts=4, experts_per_token=2, expert_dim=24)
# `--model=tiny-<family>`: TINY in each family's architecture (random weights, V = 8)
TINY_FAMILIES = {
    "qwen3": TINY.replace(family="qwen3", qk_norm=True),
    "mistral": TINY.replace(family="mistral", sliding_window=3, layer_types=("sliding", "sliding")),
    "gemma2": TINY.replace(family="gemma2", **_GEMMA, **_WINDOW, attn_scale=0.3, attn_softcap=20.0, final_softcap=30.0),
    "gemma3_text": TINY.replace(
        family="gemma3_text", **_GEMMA, **_WINDOW, qk_norm=True, local_rope_theta=1e4, rope_theta=1e6
    ),
    "mixtral": TINY.replace(family="mixtral", **_EXPERTS),
    "qwen3_moe": TINY.replace(family="qwen3_moe", **_EXPERTS, qk_norm=True, router="softmax_topk"),
    "gpt_oss": TINY.replace(
        family="gpt_oss", **_EXPERTS, **_WINDOW, qkv_bias=True, o_bias=True, attn_sinks=True, router="topk_softmax",
        expert_bias=True, swiglu_clamp=(1.702, 7.0), rope_yarn=(4.0, 32.0, 1.0, 16, False, 1.14),
    ),
}  # fmt: skip
MAX_EXACT_PREFIXES = 4096  # enumerate the target's distribution when V^(tokens - 1) is at most this
# rows decoded at once: memory stays bounded whatever --samples is (40,000 rows at once took 7.6 GB)
ROWS_PER_CALL = 4096


# --- the negative control and the row groups ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ResampleFromTarget:
    """A broken rule: `rule`'s accepted prefix, then the next token drawn from the target's distribution p at
    its end, ignoring the residual the rule would draw from (right only after a full acceptance)."""

    rule: object
    name = "broken"
    lossless = False

    def chain(self, key, sampler, draft_BK, q_BKV, logits_BKV):
        n, _ = self.rule.chain(key, sampler, draft_BK, q_BKV, logits_BKV)
        logits = jnp.take_along_axis(logits_BKV, n[:, None, None], axis=1)[:, 0]
        return n, sample_probs(jax.random.fold_in(key, 1), sampler.probs(logits))

    def tree(self, key, sampler, layout, draft_BN, q_BNV, logits_BNV, without_replacement: bool):
        n, _, path = self.rule.tree(key, sampler, layout, draft_BN, q_BNV, logits_BNV, without_replacement)
        node = jnp.where(n > 0, jnp.take_along_axis(path, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0], 0)
        logits = jnp.take_along_axis(logits_BNV, node[:, None, None], axis=1)[:, 0]
        return n, sample_probs(jax.random.fold_in(key, 1), sampler.probs(logits)), path


@dataclasses.dataclass(frozen=True)
class RowGroups:
    """The batch split into len(rules) equal consecutive groups of rows, group i verified by rules[i] with its
    own key: several rules (and their controls) in one compiled decode. Rules decide each row independently, so
    a group's rows are distributed as under its rule alone."""

    rules: tuple
    name = "row_groups"
    lossless = False

    def _pick(self, outs):
        b = outs[0][0].shape[0]
        group = jnp.arange(b) * len(self.rules) // b
        return tuple(jnp.stack(parts)[group, jnp.arange(b)] for parts in zip(*outs))

    def chain(self, key, sampler, draft_BK, q_BKV, logits_BKV):
        return self._pick(
            [
                r.chain(jax.random.fold_in(key, i), sampler, draft_BK, q_BKV, logits_BKV)
                for i, r in enumerate(self.rules)
            ]
        )

    def tree(self, key, sampler, layout, draft_BN, q_BNV, logits_BNV, without_replacement: bool):
        return self._pick(
            [
                r.tree(
                    jax.random.fold_in(key, i),
                    sampler,
                    layout,
                    draft_BN,
                    q_BNV,
                    logits_BNV,
                    without_replacement,
                )
                for i, r in enumerate(self.rules)
            ]
        )


# --- targets and drafters -----------------------------------------------------------------------------


def tiny_target(seed: int = 0, cfg: LlamaConfig = TINY) -> LoadedModel:
    """A random `TINY` target (or `cfg`, one of `TINY_FAMILIES`) whose LM head is scaled up 60x (a tied embedding 10x:
    it also feeds the residual stream): next-token distributions far from uniform, yet not point masses."""
    graphdef, params = init_params(cfg, seed)
    head = params["embed"]["embedding"] if cfg.tie_embeddings else params["lm_head"]["weight"]
    head.set_value(head[...] * (10 if cfg.tie_embeddings else 60))
    return LoadedModel(cfg, graphdef, params, None, Path("tiny-random"))


def tiny_config(model: str) -> LlamaConfig | None:
    """The config `--model` names if it is 'tiny' or 'tiny-<family>' (else None: a real model)."""
    if model == "tiny":
        return TINY
    if model.startswith("tiny-"):
        if model[5:] not in TINY_FAMILIES:
            raise UsageError(f"--model={model} is unknown; tiny families are {', '.join(TINY_FAMILIES)}")
        return TINY_FAMILIES[model[5:]]
    return None


def tiny_drafter(name: str, target: LoadedModel, k: int, tree, sampler: Sampler, seed: int = 0):
    """(drafter, params) for the tiny target: trained-head drafters get fresh heads, perturbed so that
    zero-initialised parts (Medusa's residual blocks) do not make them copy the target; others are built by the
    registry with default settings."""
    entry = registry.get(name)
    if entry.example is not None:
        return entry.example(target, k, tree, sampler)
    if entry.heads is None:
        return entry.build(target, entry.settings(), k, tree, sampler)
    from specjax.training.config import base_config

    shape = entry.heads.shape_of(base_config(name).heads, target.cfg, None)
    graphdef, params = entry.heads.init(shape, target.cfg, target.params, seed)
    params = perturbed(params, jax.random.key(seed))
    drafter = entry.heads.drafter(shape, graphdef, target.cfg, k, sampler, tree)
    return drafter, entry.heads.drafter_params(shape, params, target.cfg, target.params)


@jax.jit
def perturbed(params, key):
    """`params` with Gaussian noise of half each float leaf's spread (of 0.5 where the leaf is constant)."""
    leaves, treedef = jax.tree.flatten(params)
    noisy = [
        x + 0.5 * jnp.where(jnp.std(x) > 0, jnp.std(x), 1.0) * jax.random.normal(kk, x.shape, x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating)
        else x
        for x, kk in zip(leaves, jax.random.split(key, len(leaves)))
    ]
    return jax.tree.unflatten(treedef, noisy)


def build_drafter(name, target, k, tree, sampler, tiny: bool, settings: dict | None = None):
    if tiny:
        if settings:
            raise UsageError("drafter settings apply to real models; drop them with --model=tiny")
        return tiny_drafter(name, target, k, tree, sampler)
    entry = registry.get(name)
    fields = {f.name: f for f in dataclasses.fields(entry.settings)}
    unknown = set(settings or {}) - set(fields)
    if unknown:
        raise UsageError(f"{name} has no settings {sorted(unknown)}; its settings are {sorted(fields)}")

    def convert(key, value):  # command-line values arrive as strings: give them the type of the default
        default = fields[key].default
        if not isinstance(value, str) or default is None:
            return value
        if isinstance(default, bool):
            return value.lower() in ("1", "true", "yes")
        return type(default)(value)

    typed = {key: convert(key, value) for key, value in (settings or {}).items()}
    return entry.build(target, entry.settings(**typed), k, tree, sampler)


# --- reference distributions and tests ----------------------------------------------------------------


def target_distribution(cfg, graphdef, params, prompt: list[int], sampler: Sampler, m: int) -> np.ndarray:
    """The target's exact joint distribution [V^m] (row-major over the m tokens) of its first m new tokens after
    `prompt`, by one forward pass over all V^(m - 1) continuations."""
    v, p_len = cfg.vocab_size, len(prompt)
    prefixes = np.array(list(itertools.product(range(v), repeat=m - 1)), np.int32).reshape(-1, m - 1)
    rows = prefixes.shape[0]
    tokens = np.concatenate(
        [np.broadcast_to(np.asarray(prompt, np.int32), (rows, p_len)), prefixes], axis=1
    )
    t = tokens.shape[1]
    positions = jnp.broadcast_to(jnp.arange(t), (rows, t))
    logits, _, _ = forward(
        graphdef, params, jnp.asarray(tokens), positions, init_cache(cfg, rows, t), causal_mask(t)
    )
    probs = np.asarray(sampler.probs(logits[:, p_len - 1 :]), np.float64)  # [rows, m, V]
    prefix_p = np.prod(np.take_along_axis(probs[:, :-1], prefixes[..., None], axis=-1)[..., 0], axis=1)
    return (prefix_p[:, None] * probs[:, -1]).reshape(-1)


def chi2_sf(stat: float, dof: int) -> float:
    """P(chi-square with `dof` degrees of freedom > stat)."""
    if dof < 1:
        return 1.0
    try:
        from scipy.stats import chi2
    except ImportError:  # scipy is a test extra; jax has the regularised incomplete gamma function
        return float(jax.scipy.special.gammaincc(dof / 2, stat / 2))
    return float(chi2.sf(stat, dof))


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value of a chi-square test that `counts` were drawn from `probs` (cells expecting fewer than
    `min_expected` pooled); 0 if an impossible outcome was observed."""
    n = counts.sum()
    if counts[probs <= 0].sum() > 0:
        return 0.0
    expected = probs / probs.sum() * n
    big = expected >= min_expected
    if big.any() and 0 < expected[~big].sum() < min_expected:  # the pool joins the smallest large cell
        big[np.flatnonzero(big)[np.argmin(expected[big])]] = False
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    obs, exp = obs[exp > 0], exp[exp > 0]
    return chi2_sf(float(np.sum((obs - exp) ** 2 / exp)), len(exp) - 1)


def two_sample(a: np.ndarray, b: np.ndarray, min_total: float = 20.0) -> float:
    """p-value of a chi-square test that two count vectors come from one distribution (cells with fewer than
    `min_total` counts together pooled)."""
    big = (a + b) >= min_total
    table = np.stack([np.append(a[big], a[~big].sum()), np.append(b[big], b[~big].sum())]).astype(
        np.float64
    )
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return chi2_sf(float(np.sum((table - expected) ** 2 / expected)), table.shape[1] - 1)


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a / a.sum() - b / b.sum()).sum())


# --- the check ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class RuleResult:
    rule: str
    lossless: bool  # what the rule claims
    samples: int
    p_value: float
    tv: float  # from the reference distribution
    control_p_value: float
    control_tv: float

    def verdict(self, alpha: float) -> str:
        if self.p_value < alpha:
            return "FAIL (lossy by design)" if not self.lossless else "FAIL"
        return "PASS" if self.control_p_value < alpha else "INCONCLUSIVE"


@dataclasses.dataclass
class Report:
    drafter: str
    shape: str
    model: str
    sampler: Sampler
    method: str
    tokens: int
    alpha: float
    rules: list[RuleResult]
    noise_tv: float  # the TV an exact rule would show from sampling noise alone
    draft_efficiency: float  # over all groups: the test needs rejections to see anything
    greedy_identical: bool | None  # None: not checked

    @property
    def passed(self) -> bool:
        return (
            all(r.verdict(self.alpha) == "PASS" for r in self.rules) and self.greedy_identical is not False
        )

    def format(self) -> str:
        reference = (
            f"the target's exact distribution over {self.tokens} new tokens (one-sample chi-square)"
            if self.method == "exact"
            else f"autoregressive samples of {self.tokens} new tokens (two-sample chi-square)"
        )
        lines = [
            f"verify_exactness: drafter {self.drafter} ({self.shape}), target {self.model}, {self.sampler}",
            f"reference: {reference}; negative control: each rule's prefix, then the next token from p "
            f"(no residual); alpha {self.alpha:g}; draft efficiency {self.draft_efficiency:.2f}; "
            f"sampling-noise TV {self.noise_tv:.4f}",
            "",
            "| rule | lossless (claimed) | samples | p-value | TV | control p-value | control TV | verdict |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in self.rules:
            lines.append(
                f"| {r.rule} | {r.lossless} | {r.samples} | {r.p_value:.3g} | {r.tv:.4f} | "
                f"{r.control_p_value:.3g} | {r.control_tv:.4f} | {r.verdict(self.alpha)} |"
            )
        if self.greedy_identical is not None:
            lines.append(
                f"\ngreedy: speculative tokens {'identical to' if self.greedy_identical else 'DIFFER from'} "
                "greedy decoding"
            )
        lines.append(f"\nverdict: {'PASS' if self.passed else 'FAIL'}")
        return "\n".join(lines)


def codes(tokens: np.ndarray, vocab: int) -> np.ndarray:
    return np.ravel_multi_index(tuple(tokens.T), (vocab,) * tokens.shape[1])


def verify(
    drafter: str,
    rules=("tokenwise",),
    *,
    model: str = "tiny",
    k: int = 2,
    tree: str = "",
    sampler: Sampler = Sampler(1.0),  # noqa: B008 (frozen)
    samples: int = 0,
    tokens: int = 0,
    method: str = "auto",
    alpha: float = 1e-3,
    greedy: bool = True,
    seed: int = 0,
    settings: dict | None = None,
    draft_temperature: float = 1.0,
) -> Report:
    """Checks `drafter` (a registered name) with each acceptance rule in `rules` (names or rule objects), drafting
    at `sampler`'s temperature times `draft_temperature`; see the module docstring. `samples` per rule and per
    control (0: 10000 for `exact`, 20000 for `ar`); `tokens` new tokens compared (0: K + 2, the prefill's token, the
    first round's drafts and its bonus token: fewer leave the last positions unchecked)."""
    if sampler.greedy:
        raise UsageError(
            "the distribution check needs a sampling temperature > 0; greedy is checked with it"
        )
    if tokens and tokens < 2:
        raise UsageError(f"--tokens must be >= 2 (the first comes from the prefill), got {tokens}")
    rules = [acceptance.get(r) if isinstance(r, str) else r for r in rules]
    tiny_cfg = tiny_config(model)
    tiny = tiny_cfg is not None
    target = tiny_target(seed, tiny_cfg) if tiny else load_model(model)
    cfg = target.cfg
    shape = parse_tree(tree)
    k = k if shape is None else shape.depth
    tokens = tokens or k + 2
    prompt = [1, 3] if tiny else target.tokenizer.encode("Once upon a time")
    if method == "auto":
        method = "exact" if cfg.vocab_size ** (tokens - 1) <= MAX_EXACT_PREFIXES else "ar"
    if method not in ("exact", "ar"):
        raise UsageError(f"--method must be auto, exact or ar, got {method!r}")
    n = samples or (10_000 if method == "exact" else 20_000)
    groups = tuple(x for r in rules for x in (r, ResampleFromTarget(r)))
    draft_sampler = sampler.drafting(draft_temperature)
    draft, dparams = build_drafter(drafter, target, k, shape, draft_sampler, tiny, settings)
    spec = GenerateSpec(tokens, sampler, eos_id=None, acceptance=RowGroups(groups))
    out, gens = in_batches(
        lambda rows, s: speculative_generate(
            cfg, target.graphdef, target.params, draft, dparams, [prompt] * rows, spec, s
        ),
        n,
        len(groups),
        seed,
    )
    if method == "exact":
        v = cfg.vocab_size
        reference = target_distribution(cfg, target.graphdef, target.params, prompt, sampler, tokens)
        counts = [np.bincount(codes(o, v), minlength=v**tokens) for o in out]
        test = lambda c: goodness_of_fit(c, reference)
        rng = np.random.default_rng(seed)
        noise = np.mean(
            [total_variation(rng.multinomial(n, reference / reference.sum()), reference) for _ in range(20)]
        )
    else:
        ar_spec = GenerateSpec(tokens, sampler, eos_id=None)
        ar, _ = in_batches(
            lambda rows, s: generate(cfg, target.graphdef, target.params, [prompt] * rows, ar_spec, s),
            n,
            1,
            seed + 1,
        )
        cells, inverse = np.unique(np.concatenate([*ar, *out]), axis=0, return_inverse=True)
        inverse = inverse.reshape(-1, n)
        reference = np.bincount(inverse[0], minlength=len(cells))
        counts = [np.bincount(i, minlength=len(cells)) for i in inverse[1:]]
        test = lambda c: two_sample(c, reference)
        half = n // 2
        noise = total_variation(
            *(np.bincount(inverse[0][s], minlength=len(cells)) for s in (slice(half), slice(half, None)))
        )
        noise /= np.sqrt(2)  # two samples of n/2 vs two of n
    results = [
        RuleResult(
            r.name,
            bool(r.lossless),
            n,
            test(counts[2 * i]),
            total_variation(counts[2 * i], reference),
            test(counts[2 * i + 1]),
            total_variation(counts[2 * i + 1], reference),
        )
        for i, r in enumerate(rules)
    ]
    identical = None
    if greedy:
        identical = greedy_identical(target, drafter, rules, k, shape, tiny, settings, prompt, seed)
    return Report(
        drafter,
        draft.shape.describe(),
        str(target.path.name),
        sampler,
        method,
        tokens,
        alpha,
        results,
        float(noise),
        float(pooled([g.stats for g in gens])["draft_efficiency"]),
        identical,
    )


def in_batches(decode, n: int, groups: int, seed: int) -> tuple[np.ndarray, list]:
    """`decode(rows, seed)` (a generation of `rows` copies of the prompt, `groups` consecutive equal groups)
    called on at most ROWS_PER_CALL rows at a time, the same shape each time (one compile), each call with its own
    seed, until every group has `n` samples: (tokens [groups, n, T], the generations)."""
    calls = -(-n * groups // ROWS_PER_CALL)
    per_group = -(-n // calls)
    gens = [decode(per_group * groups, s) for s in itertools.islice(derived_seeds(seed), calls)]
    tokens = np.concatenate([np.asarray(g.tokens).reshape(groups, per_group, -1) for g in gens], axis=1)
    return tokens[:, :n], gens


def derived_seeds(seed: int):
    """`seed`, then independent seeds derived from it."""
    yield seed
    for i in itertools.count(1):
        yield int(np.random.SeedSequence([seed, i]).generate_state(1)[0] >> 1)


def greedy_identical(target, drafter, rules, k, shape, tiny, settings, prompt, seed) -> bool:
    """Greedy speculative decoding (every rule, prompts of several lengths) == greedy decoding, token for token."""
    cfg, n_new = target.cfg, 24
    prompts = [prompt, prompt[:1], (prompt * 4)[:7]]
    spec = GenerateSpec(n_new, Sampler(), eos_id=None)
    ar = np.asarray(generate(cfg, target.graphdef, target.params, prompts, spec).tokens)
    draft, dparams = build_drafter(drafter, target, k, shape, Sampler(), tiny, settings)
    spec = dataclasses.replace(spec, acceptance=RowGroups(tuple(rules)))
    batch = [p for _ in rules for p in prompts]  # group i: every prompt under rules[i]
    gen = speculative_generate(cfg, target.graphdef, target.params, draft, dparams, batch, spec, seed)
    return bool((np.asarray(gen.tokens) == np.tile(ar, (len(rules), 1))).all())


# --- command line ---------------------------------------------------------------------------------------


def main(argv=None) -> int:
    from absl import flags

    f = flags.FlagValues()
    flags.DEFINE_string("drafter", None, f"A registered drafter: {registry.names()}.", flag_values=f)
    flags.DEFINE_list(
        "acceptance", [acceptance.DEFAULT], f"Rules to check: {sorted(acceptance.RULES)}.", flag_values=f
    )
    flags.DEFINE_string(
        "model",
        "tiny",
        "'tiny' (random V=8 target, exact reference), 'tiny-<family>' (the same in a family's architecture: "
        + ", ".join(TINY_FAMILIES)
        + ") or a model path/name.",
        flag_values=f,
    )
    flags.DEFINE_integer("k", 2, "Draft tokens per round (a tree sets it to its depth).", flag_values=f)
    flags.DEFINE_string(
        "tree", "", "A tree as in run_decode.py (preset, dynamic:..., or paths).", flag_values=f
    )
    flags.DEFINE_float("temperature", 1.0, "Sampling temperature (> 0).", flag_values=f)
    flags.DEFINE_integer("top_k", 0, "Top-k warper (0 = off).", flag_values=f)
    flags.DEFINE_float("top_p", 1.0, "Top-p warper (1 = off).", flag_values=f)
    flags.DEFINE_float(
        "draft_temperature", 1.0, "The drafter samples at --temperature times this (> 0).", flag_values=f
    )
    flags.DEFINE_integer(
        "samples", 0, "Samples per rule and per control (0: 10000 exact, 20000 ar).", flag_values=f
    )
    flags.DEFINE_integer(
        "tokens",
        0,
        "New tokens compared (the first comes from the prefill; 0: K + 2, through the first round's bonus token).",
        flag_values=f,
    )
    flags.DEFINE_enum(
        "method",
        "auto",
        ["auto", "exact", "ar"],
        "Reference: exact enumeration or AR samples.",
        flag_values=f,
    )
    flags.DEFINE_float("alpha", 1e-3, "Significance level of every test.", flag_values=f)
    flags.DEFINE_bool("greedy", True, "Also check greedy decoding token for token.", flag_values=f)
    flags.DEFINE_integer("seed", 0, "Random seed.", flag_values=f)
    flags.DEFINE_multi_string(
        "drafter_setting", [], "KEY=VALUE of the drafter's settings (real models).", flag_values=f
    )
    argv = sys.argv if argv is None else argv
    if kind := cli.help_asked(argv):
        cli.print_help(f, kind, __doc__)
    argv = f(argv)
    if len(argv) > 1 or f.drafter is None:
        raise UsageError(
            f"no drafter to check; pass --drafter=NAME (one of {registry.names()})"
            + (f"; unexpected arguments {argv[1:]}" if len(argv) > 1 else "")
        )
    for name, ok, rule in (
        ("samples", f.samples >= 0, ">= 0 (0: the default)"),
        ("k", f.k >= 1, ">= 1"),
        ("tokens", f.tokens == 0 or f.tokens >= 2, ">= 2 (the first comes from the prefill; 0: K + 2)"),
        ("alpha", 0 < f.alpha < 1, "in (0, 1), e.g. 1e-3"),
        ("draft_temperature", f.draft_temperature > 0, "> 0 (1: the target's temperature)"),
    ):
        if not ok:
            raise cli.UsageError(f"--{name}={f[name].value} must be {rule}; pass a valid --{name}")
    settings = {}
    for item in f.drafter_setting:
        key, sep, value = item.partition("=")
        if not sep:
            raise cli.UsageError(
                f"--drafter_setting={item!r} is not KEY=VALUE; write e.g. --drafter_setting=draft_layers=2"
            )
        settings[key] = value
    report = verify(
        f.drafter,
        f.acceptance,
        model=f.model,
        k=f.k,
        tree=f.tree,
        sampler=cli.sampler(f.temperature, f.top_k, f.top_p),
        samples=f.samples,
        tokens=f.tokens,
        method=f.method,
        alpha=f.alpha,
        greedy=f.greedy,
        seed=f.seed,
        settings=settings,
        draft_temperature=f.draft_temperature,
    )
    print(report.format())
    return 0 if report.passed else 1


def run() -> None:
    """`main` with user errors as one line `error: ...` and exit status 2 (SPECJAX_DEBUG=1: traceback, see
    `specjax.cli`); a failed check exits with status 1."""
    sys.exit(cli.guarded(main, status=2, positional=True)(sys.argv))


if __name__ == "__main__":
    run()
