"""What generation relies on in transformers (pinned in constraints.txt), checked against the
library itself, so that an upgrade that changes one of them fails here first:

- a model's attention layers call ``cache.update(key, value, layer_idx, kwargs=...)`` with
  the kwargs the attention function then receives, and a custom attention implementation
  gets no mask (transformers builds none for it);
- ``logits_to_keep`` given as a tensor of row indices keeps exactly those rows;
- prompts: our tokenizer gives the ids ``AutoTokenizer`` gives, our chat template rendering
  the text ``apply_chat_template`` renders, and a prompt tokenizer pickles.
"""

import pickle
from pathlib import Path

import pytest
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

from models import ChatMessage, ModelSpec, NoChatTemplate, load_model
from models.causal.attention import IMPLEMENTATION
from tests.generators import FAMILIES, load, tiny_generator

GEMMA_TEMPLATE = Path(__file__).resolve().parent.parent / "examples/chat-templates/gemma3.jinja"
# Block tags on lines of their own, as many templates write them: the environment's
# trim_blocks and lstrip_blocks decide the whitespace.
LINES_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'system' %}
[SYS] {{ message['content'] | trim }}
    {% else %}
[{{ message['role'] | upper }}] {{ message['content'] }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
[ASSISTANT] {{ eos_token }}
{% endif %}"""
CONVERSATIONS = [
    [ChatMessage("user", "Hello there!")],
    [
        ChatMessage("system", "You are terse."),
        ChatMessage("user", "What is 2+2?"),
        ChatMessage("assistant", "4."),
        ChatMessage("user", "  And 3+3? ünïcödé 🚀 "),
    ],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_generator(tmp_path_factory.mktemp("contract"), "llama")


class Recorder:
    """A cache that records what the layers hand it."""

    def __init__(self):
        self.calls = []

    def update(self, key, value, layer_idx, kwargs=None, **_):
        self.calls.append((layer_idx, tuple(key.shape), kwargs is not None))
        if kwargs is not None:
            kwargs["contract_marker"] = layer_idx
        return key, value

    def get_seq_length(self, layer_idx=0):
        return 0


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_layers_hand_the_cache_their_kwargs_and_a_custom_attention_gets_no_mask(tmp_path, family):
    module = AutoModelForCausalLM.from_pretrained(tiny_generator(tmp_path, family)).eval()
    seen = []

    def attention(module, query, key, value, attention_mask, **kwargs):
        seen.append((attention_mask, kwargs.get("contract_marker")))
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(query.shape[1] // key.shape[1], dim=1),
            value.repeat_interleave(query.shape[1] // value.shape[1], dim=1), is_causal=True,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("contract_probe", attention)
    module.set_attn_implementation("contract_probe")
    cache = Recorder()
    with torch.inference_mode():
        module(input_ids=torch.tensor([[5, 6, 7]]), position_ids=torch.tensor([[0, 1, 2]]),
               cache=cache, use_cache=True)  # fmt: skip
    layers = module.config.num_hidden_layers
    assert [layer for layer, _, _ in cache.calls] == list(range(layers))
    assert all(handed for _, _, handed in cache.calls)
    assert seen == [(None, layer) for layer in range(layers)]


def test_logits_to_keep_as_indices_keeps_those_rows(folder):
    module = AutoModelForCausalLM.from_pretrained(folder).eval()
    assert module._supports_logits_to_keep()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.inference_mode():
        every = module(input_ids=ids).logits
        kept = module(input_ids=ids, logits_to_keep=torch.tensor([1, 4])).logits
    torch.testing.assert_close(kept, every[:, [1, 4]])


def test_our_attention_is_registered_under_its_name():
    assert IMPLEMENTATION in AttentionInterface._global_mapping


def test_prompts_tokenize_and_chat_templates_render_as_transformers_does(folder):
    prompts = load(folder).preparer()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for text in ["The cat sits.", "  spaced\n\nlines ünïcödé 🚀", "def f(x):\n    return x"]:
        assert prompts.encode(text) == tokenizer(text)["input_ids"]
    for conversation in CONVERSATIONS:
        messages = [{"role": m.role, "content": m.content} for m in conversation]
        expected = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=True)  # fmt: skip
        assert prompts.render_chat(conversation) == expected
        assert prompts.encode_chat(conversation) == tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )


@pytest.mark.parametrize("template_file", ["gemma3", "lines"])
def test_a_template_file_renders_as_transformers_renders_it(tmp_path, template_file):
    folder = tiny_generator(tmp_path, "gemma3_text", chat_template=False)
    path = GEMMA_TEMPLATE
    if template_file == "lines":
        path = tmp_path / "lines.jinja"
        path.write_text(LINES_TEMPLATE)
    template = path.read_text()
    model = load_model(ModelSpec(model=str(folder), task="generate", device="cpu",
                                 chat_template=str(path)))  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(folder)
    for conversation in CONVERSATIONS:
        messages = [{"role": m.role, "content": m.content} for m in conversation]
        expected = tokenizer.apply_chat_template(
            messages, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        assert model.preparer().render_chat(conversation) == expected


def test_a_model_without_a_template_says_so_and_the_tokenizer_pickles(tmp_path):
    prompts = load(tiny_generator(tmp_path, "qwen3", chat_template=False)).preparer()
    with pytest.raises(NoChatTemplate, match="no chat template"):
        prompts.render_chat(CONVERSATIONS[0])
    copy = pickle.loads(pickle.dumps(prompts))
    assert copy.encode("The cat sits.") == prompts.encode("The cat sits.")
    assert copy.defaults == prompts.defaults and copy.info == prompts.info
