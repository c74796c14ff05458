"""Conversation data: the loss mask covers exactly the assistant's tokens (system, user and assistant turns, both
jsonl layouts); the head losses ignore what the mask leaves out; regeneration rewrites each assistant turn with the
target's own decoding, resumes an interrupted run to the same output, and refuses files it did not write."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY
from helpers import TARGET
from tolerance import approx, assert_far

from specjax import files, heads
from specjax.decoding import GenerateSpec, generate
from specjax.drafting import registry
from specjax.sampling import Sampler
from specjax.training import chat, data, losses, regenerate
from specjax.training.config import base_config, smoke

HEADERS = (  # ChatML-like: every turn opens with a role header the assistant does not write
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
STORIES_TEMPLATE = Path(__file__).parents[1] / "configs" / "chat" / "stories.jinja"
CONVERSATION = [
    {"role": "system", "content": "You tell short stories."},
    {"role": "user", "content": "Tell me about a cat."},
    {"role": "assistant", "content": "Once upon a time, there was a cat named Tom."},
    {"role": "user", "content": "And then?"},
    {"role": "assistant", "content": "Tom found a big red ball and played all day."},
]


def runs(mask):
    """(start, end) of each run of ones."""
    edges = np.diff(np.concatenate([[0], mask, [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def test_loss_mask_covers_exactly_the_assistant_tokens(stories, tmp_path):
    tokenizer = stories.tokenizer
    ids, mask = chat.tokenize(tokenizer, CONVERSATION, HEADERS)
    assert ids[0] == tokenizer.bos_id and len(ids) == len(mask)
    answers = [m["content"] for m in CONVERSATION if m["role"] == "assistant"]
    spans = runs(mask)
    assert len(spans) == len(answers)
    for (a, b), answer in zip(spans, answers):
        assert tokenizer.decode(ids[a:b]).strip() == answer  # the answer, nothing of the headers
        assert ids[b - 1] == tokenizer.eos_id  # its end-of-turn token is trained too
    context = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    assert all(
        h in context for h in ("<|system|>", "You tell short stories.", "And then?", "<|assistant|>")
    )
    assert not any(a in context for a in answers)
    # ShareGPT's layout gives the same tokens and mask
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = [{"from": names[m["role"]], "value": m["content"]} for m in CONVERSATION]
    source = write_jsonl([{"conversations": sharegpt}], tmp_path / "sharegpt.jsonl")
    ids2, mask2 = chat.tokenize(tokenizer, chat.read_conversations(source)[0], HEADERS)
    assert ids2 == ids and np.array_equal(mask2, mask)


def test_a_token_straddling_the_turn_boundary_belongs_to_the_assistant(stories):
    """The stories template writes a space before the answer: SentencePiece's "▁Once" holds it, and is the
    assistant's first token (it is what the target writes after the prompt)."""
    tokenizer = stories.tokenizer
    template = STORIES_TEMPLATE.read_text()
    ids, mask = chat.tokenize(tokenizer, CONVERSATION, template)
    (a, _), _ = runs(mask)
    prompt = chat.prompt_ids(tokenizer, CONVERSATION[:2], template)
    assert ids[:a] == prompt and tokenizer.decode(ids[a : a + 2]).startswith("Once")


def write_jsonl(records, path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"text": "x"}', "expected a JSON object with 'messages' or 'conversations'"),
        ('{"messages": [{"role": "narrator", "content": "x"}]}', "a turn needs a role"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "has no assistant turn to train on"),
        ('{"messages": "hello"}', "not a list of turns"),
    ],
)
def test_bad_conversations_name_the_line(tmp_path, line, message):
    (tmp_path / "c.jsonl").write_text(
        '{"messages": [{"role": "assistant", "content": "ok"}]}\n' + line + "\n"
    )
    with pytest.raises(chat.ChatDataError, match=f"c.jsonl:2: .*{message}"):
        chat.read_conversations(tmp_path / "c.jsonl")


def test_templates_that_cannot_be_used_are_refused(stories, tmp_path):
    tokenizer = stories.tokenizer
    with pytest.raises(chat.ChatDataError, match="has no chat template; set data.chat_template"):
        chat.chat_template(tokenizer)
    with pytest.raises(chat.ChatDataError, match="needs a Hugging Face tokenizer"):
        chat.chat_template(object())
    counting = "{{ messages | length }}" + HEADERS  # the first line changes as turns are added
    with pytest.raises(chat.ChatDataError, match="renders a conversation's turns differently"):
        chat.tokenize(tokenizer, CONVERSATION, counting)
    (tmp_path / "t.jinja").write_text(HEADERS)
    assert chat.chat_template(tokenizer, str(tmp_path / "t.jinja")) == HEADERS


# --- the loss mask in the head losses ---------------------------------------------------------------------


@pytest.mark.parametrize("method", ["medusa", "eagle", "eagle3", "distill"])
def test_head_losses_ignore_tokens_outside_the_mask(method):
    """With the mask on tokens 0..h, changing the tokens after h (and so the target's features there) leaves the
    loss as it is; changing the tokens inside changes it, as does the same change without the mask (controls)."""
    graphdef, params = TARGET
    entry = registry.trained(method)
    settings = base_config(method).heads  # as the trainer passes config.heads
    if method == "distill":  # a one-layer draft of the target's width, its first layer copied
        settings.n_layers, settings.init = 1, "layers:0"
        settings.dim, settings.hidden_dim = TINY.dim, TINY.hidden_dim
        settings.n_heads, settings.n_kv_heads = TINY.n_heads, TINY.n_kv_heads
    shape = entry.shape_of(settings, TINY, None)
    meta = heads.describe(method, shape, TINY)
    hgraph, hparams = heads.new_heads(meta, TINY, params, seed=0)
    full = heads.drafter_params(meta, hparams, TINY, params)
    taps = tuple(entry.feature_taps(shape, TINY))
    h, t = 9, 16
    mask = jnp.broadcast_to(jnp.arange(t) <= h, (2, t)).astype(jnp.int32)

    def loss(tokens, mask):
        feats = losses.target_features(TINY, graphdef, params, tokens, taps)
        return float(entry.loss(hgraph, TINY, full, feats, tokens, mask, jax.random.key(0), settings)[0])

    tokens = jnp.asarray(np.random.default_rng(0).integers(3, TINY.vocab_size, (2, t)), jnp.int32)
    after = tokens.at[:, h + 1 :].set((tokens[:, h + 1 :] + 7) % TINY.vocab_size)
    inside = tokens.at[:, 1:h].set((tokens[:, 1:h] + 7) % TINY.vocab_size)
    base = loss(tokens, mask)
    depth = 2  # the target is causal: positions up to h see the same values; at most the masked mean rounds anew
    assert loss(after, mask) == approx(base, dtype=jnp.float32, depth=depth)
    assert_far(loss(inside, mask), base, dtype=jnp.float32, depth=depth)
    assert_far(
        loss(after, jnp.ones_like(mask)), loss(tokens, jnp.ones_like(mask)), dtype=jnp.float32, depth=depth
    )


# --- the corpus and regeneration --------------------------------------------------------------------------


def conversations(n):
    subjects = ["cat", "dog", "bird", "fish", "frog", "bear", "duck"]
    return [
        {
            "messages": [
                {"role": "user", "content": f"Tell me a story about a {subjects[i % 7]}."},
                {"role": "assistant", "content": f"The {subjects[i % 7]} was sad."},
                {"role": "user", "content": "Another one."},
                {"role": "assistant", "content": "The end."},
            ]
        }
        for i in range(n)
    ]


def chat_config(source, **data_settings):
    c = smoke(base_config("eagle3"))
    c.data.source, c.data.chat_template, c.data.seq_len = str(source), str(STORIES_TEMPLATE), 16
    c.data.sample_len, c.data.temperature = 12, 0.0
    for k, v in data_settings.items():
        setattr(c.data, k, v)
    return c


def test_conversation_corpus_masks_the_prompts(stories, tmp_path):
    source = write_jsonl(conversations(6), tmp_path / "chats.jsonl")
    target = (stories.cfg, stories.graphdef, stories.params)
    corpus = data.load_corpus(chat_config(source), target, stories.tokenizer, "A")
    template = STORIES_TEMPLATE.read_text()
    pairs = [chat.tokenize(stories.tokenizer, c["messages"], template) for c in conversations(6)]
    flat = np.concatenate([ids for ids, _ in pairs])
    n = corpus.tokens.size
    np.testing.assert_array_equal(corpus.tokens.ravel(), flat[:n])
    np.testing.assert_array_equal(corpus.loss_mask.ravel(), np.concatenate([m for _, m in pairs])[:n])
    assert 0 < corpus.loss_mask.mean() < 1


def test_regeneration_is_the_targets_decoding_and_resumes_to_the_same_file(stories, tmp_path, monkeypatch):
    source = write_jsonl(conversations(5), tmp_path / "chats.jsonl")
    target = (stories.cfg, stories.graphdef, stories.params)
    template = STORIES_TEMPLATE.read_text()
    args = dict(template=template, provenance={"target": "A"}, max_new_tokens=12, seed=0, batch=2)
    convs = chat.read_conversations(source)
    out = tmp_path / "regen.jsonl"
    greedy = regenerate.regenerate(convs, target, stories.tokenizer, out=out, temperature=0.0, **args)
    # every assistant turn is the target's greedy continuation of the conversation so far (as rewritten)
    spec = GenerateSpec(12, Sampler(0.0), eos_id=stories.tokenizer.eos_id)
    for conv in greedy:
        for i, m in enumerate(conv):
            if m["role"] == "assistant":
                gen = generate(
                    stories.cfg,
                    stories.graphdef,
                    stories.params,
                    [chat.prompt_ids(stories.tokenizer, conv[:i], template)],
                    spec,
                )
                ids = np.asarray(gen.tokens)[0, : int(gen.lengths[0])].tolist()
                assert m["content"] == stories.tokenizer.decode(
                    [t for t in ids if t != stories.tokenizer.eos_id]
                )
    assert [m["content"] for m in greedy[0] if m["role"] == "user"] == [
        "Tell me a story about a cat.",
        "Another one.",
    ]
    assert greedy[0][1]["content"] != "The cat was sad."

    # sampled: interrupted in its second batch (and a torn line left behind), then resumed
    whole = regenerate.regenerate(
        convs, target, stories.tokenizer, out=tmp_path / "whole.jsonl", temperature=1.0, **args
    )
    calls, real = [], regenerate.generate

    def dies_in_batch_two(*a, **k):
        calls.append(1)
        if len(calls) == 3:  # batch 1's first turn: batch 0 (two turns) is written
            raise KeyboardInterrupt
        return real(*a, **k)

    part = tmp_path / "part.jsonl"
    monkeypatch.setattr(regenerate, "generate", dies_in_batch_two)
    with pytest.raises(KeyboardInterrupt):
        regenerate.regenerate(convs, target, stories.tokenizer, out=part, temperature=1.0, **args)
    monkeypatch.undo()
    assert len(part.read_text().splitlines()) == 2
    with open(part, "a") as f:
        f.write('{"messages": [{"role": "us')
    resumed = regenerate.regenerate(convs, target, stories.tokenizer, out=part, temperature=1.0, **args)
    assert resumed == whole and part.read_text() == (tmp_path / "whole.jsonl").read_text()

    # files it did not write, or wrote with other settings, are refused and left alone
    with pytest.raises(
        files.ProvenanceError,
        match="regenerated by another target, from other conversations or with other settings",
    ):
        regenerate.regenerate(convs, target, stories.tokenizer, out=part, temperature=0.5, **args)
    mine = tmp_path / "mine.jsonl"
    mine.write_text("my notes\n")
    with pytest.raises(files.DestinationError, match="exists without its provenance"):
        regenerate.regenerate(convs, target, stories.tokenizer, out=mine, temperature=1.0, **args)
    assert mine.read_text() == "my notes\n"


def test_regeneration_needs_conversations(stories, tmp_path):
    (tmp_path / "docs.txt").write_text("Once upon a time.\n" * 50)
    c = chat_config(tmp_path / "docs.txt", regenerate=str(tmp_path / "r.jsonl"))
    target = (stories.cfg, stories.graphdef, stories.params)
    with pytest.raises(data.DataError, match="rewrites conversations, but data.source=.* holds none"):
        data.load_corpus(c, target, stories.tokenizer, "A")
