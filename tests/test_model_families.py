"""What a model folder says is read into its description, and the postprocess built from it
equals sentence-transformers: pooling formulas against its Pooling module, folders against
SentenceTransformer.encode in-process (decoders through AutoModel, old layouts, lowercasing,
left truncation), refusals with their messages, prompts, Matryoshka truncation."""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
)

from models import ModelLoadError, ModelSpec, UnknownPrompt, load_model, resolve_prompt
from models.answers import top_labels, truncate_dimensions
from models.description import Pooling, describe
from models.postprocess import pool
from models.testing import save_tiny_model
from server.runtime.slot import prepare_call
from server.settings import Settings
from tests.families import (
    TEXTS,
    build_bert_dense,
    build_bert_prompts,
    build_xlm_roberta,
    quiet,
    qwen3_tokenizer,
)

# --- pooling formulas ----------------------------------------------------------------------

MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


def st_pooling(hidden, mask, modes, include_prompt, prompt_length):
    from sentence_transformers.sentence_transformer.modules import Pooling as STPooling

    module = STPooling(hidden.shape[-1], pooling_mode=modes, include_prompt=include_prompt)
    features = {"token_embeddings": hidden, "attention_mask": mask}
    if prompt_length:
        features["prompt_length"] = prompt_length
    return module(features)["sentence_embedding"]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("include_prompt", [True, False])
@pytest.mark.parametrize("modes", [*((m,) for m in MODES), ("cls", "mean", "lasttoken")])
def test_pooling_equals_sentence_transformers_on_either_padding_side(side, include_prompt, modes):
    torch.manual_seed(0)
    lengths = [7, 3, 5, 1]
    hidden = torch.randn(len(lengths), 7, 6)
    mask = torch.zeros(len(lengths), 7, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, 7 - n :] = 1
    prompt_length = 2
    expected = st_pooling(hidden, mask, modes, include_prompt, prompt_length)
    ours = pool(hidden, mask, Pooling(modes, include_prompt), torch.full((4,), prompt_length))
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-6)


def test_a_prompt_length_of_zero_leaves_the_row_whole():
    hidden = torch.arange(12.0).view(1, 4, 3)
    mask = torch.ones(1, 4, dtype=torch.long)
    whole = pool(hidden, mask, Pooling(("mean",), include_prompt=False), torch.zeros(1))
    torch.testing.assert_close(whole, hidden.mean(dim=1))


# --- folders against SentenceTransformer.encode, in process ---------------------------------


def st_encode(folder, **kwargs):
    from sentence_transformers import SentenceTransformer

    with quiet():
        model = SentenceTransformer(str(folder), device="cpu")
        return model.encode(TEXTS, show_progress_bar=False, **kwargs)


def ours(folder, prompt=None, **spec):
    model = load_model(ModelSpec(model=str(folder), **spec))
    return model, np.stack(model.forward(model.prepare(TEXTS, truncate=True, prompt=prompt)))


def assert_same(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    cosines = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
    assert cosines.min() >= 0.9999
    np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.fixture(scope="module")
def xlmr(tmp_path_factory):
    folder = tmp_path_factory.mktemp("xlmr") / "xlm-roberta"
    with quiet():
        build_xlm_roberta(folder)
    return folder


def test_old_layout_max_seq_length_do_lower_case_and_left_truncation(xlmr, tmp_path):
    """sentence-transformers 2.x wrote max_seq_length and do_lower_case in
    sentence_bert_config.json; a tokenizer may truncate on the left."""
    folder = tmp_path / "old"
    shutil.copytree(xlmr, folder)
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 16, "do_lower_case": True})
    )
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["truncation_side"] = "left"
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    model, vectors = ours(folder)
    assert model.info.max_input_tokens == 16
    assert_same(vectors, st_encode(folder))
    # Each change matters: without them the vectors differ.
    _, plain = ours(xlmr)
    assert np.abs(plain - vectors).max() > 1e-3


def test_a_dense_folder_with_pickle_weights_is_refused_with_a_conversion_command(tmp_path):
    folder = tmp_path / "dense"
    with quiet():
        build_bert_dense(folder)
    dense = folder / "2_Dense"
    from safetensors.torch import load_file

    torch.save(load_file(dense / "model.safetensors"), dense / "pytorch_model.bin")
    (dense / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="pickle weights only") as info:
        load_model(ModelSpec(model=str(folder)))
    run_conversion(str(info.value))
    _, vectors = ours(folder)
    assert_same(vectors, st_encode(folder))


def run_conversion(message: str) -> None:
    """Run the command the message gives, as a user would paste it."""
    argv = shlex.split(message.split("in one command: ", 1)[1])
    assert argv[0] == "python"
    subprocess.run([sys.executable, *argv[1:]], check=True, timeout=120)


def test_a_pickle_only_model_is_refused_and_the_command_converts_it(tmp_path):
    folder = save_tiny_model(tmp_path / "pickled", task="rerank")
    module = AutoModelForSequenceClassification.from_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save(module.state_dict(), folder / "pytorch_model.bin")  # as older checkpoints ship
    with pytest.raises(ModelLoadError, match="pickle checkpoints are refused") as info:
        load_model(ModelSpec(model=str(folder)))
    run_conversion(str(info.value))
    model = load_model(ModelSpec(model=str(folder)))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    batch = tokenizer(["q"] * 2, ["a cat", "the market"], return_tensors="pt", padding=True)
    with torch.inference_mode():
        expected = torch.sigmoid(module.eval()(**batch).logits[:, 0]).tolist()
    scores = model.forward(model.prepare_pairs("q", ["a cat", "the market"]))
    assert scores == pytest.approx(expected, abs=1e-6)


def decoder_folder(root: Path, model_type: str, *, with_eos: bool) -> Path:
    """A tiny decoder of ``model_type`` with a byte-level tokenizer, in a
    sentence-transformers layout with last-token pooling."""
    from tests.families import _sentence_transformer

    base = root / f"{model_type}-hf"
    base.mkdir(parents=True)
    vocab_size, eos = qwen3_tokenizer(base, padding_side="right")
    if not with_eos:  # a tokenizer without the end-of-text template
        spec = json.loads((base / "tokenizer.json").read_text())
        spec["post_processor"] = None
        (base / "tokenizer.json").write_text(json.dumps(spec))
    torch.manual_seed(5)
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=128, eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
        sliding_window=16, tie_word_embeddings=False,
    )  # fmt: skip
    AutoModel.from_config(config).save_pretrained(base, safe_serialization=True)
    out = root / model_type
    with quiet():
        _sentence_transformer(base, out, {"pooling_mode": "lasttoken"})
    return out


@pytest.mark.parametrize(
    ("model_type", "with_eos"),
    [("qwen2", True), ("llama", False), ("mistral", True), ("gemma3_text", True)],
)
def test_decoders_through_automodel_read_their_last_token(tmp_path, model_type, with_eos):
    folder = decoder_folder(tmp_path, model_type, with_eos=with_eos)
    model, vectors = ours(folder)
    assert (model.info.shape.architecture, model.info.pooling) == ("decoder", "lasttoken")
    # What the memory prior reads: grouped-query attention, the kernel in use, the window.
    shape = model.info.shape
    assert (shape.num_heads, shape.num_kv_heads, shape.head_dim) == (4, 2, 8)
    assert (shape.attention, shape.gated_mlp) == ("sdpa", True)
    # (Qwen2's window is off unless use_sliding_window; Llama has none, whatever this
    # test's config carries.)
    windowed = {"qwen2": None, "mistral": 16, "gemma3_text": 16}
    assert shape.sliding_window == windowed.get(model_type, shape.sliding_window)
    assert_same(vectors, st_encode(folder))
    items = model.prepare(["the cat"], truncate=True)
    eos = AutoTokenizer.from_pretrained(folder).eos_token_id
    assert (items[0].data.ids[-1] == eos) is with_eos  # as the model's tokenizer does


def test_a_decoder_without_modules_json_is_last_token_pooled_and_the_log_says_so(tmp_path, caplog):
    folder = decoder_folder(tmp_path, "qwen2", with_eos=True)
    plain = tmp_path / "plain"
    shutil.copytree(folder, plain)
    for name in ("modules.json", "1_Pooling", "2_Normalize", "config_sentence_transformers.json"):
        path = plain / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    caplog.set_level(logging.INFO)
    model, vectors = ours(plain)
    assert "has no modules.json: assuming lasttoken pooling and L2 normalisation" in caplog.text
    assert model.info.pooling == "lasttoken" and model.info.normalize
    assert_same(vectors, st_encode(folder))


def test_an_encoder_without_modules_json_keeps_mean_pooling_and_normalisation(tmp_path, caplog):
    folder = save_tiny_model(tmp_path / "bare")
    caplog.set_level(logging.INFO)
    _, vectors = ours(folder)
    assert "has no modules.json: assuming mean pooling and L2 normalisation" in caplog.text
    # sentence-transformers reads such a folder as mean pooling without normalisation.
    reference = st_encode(folder)
    assert_same(vectors, reference / np.linalg.norm(reference, axis=1, keepdims=True))


# --- refusals ------------------------------------------------------------------------------


@pytest.fixture()
def prompts_folder(tmp_path):
    folder = tmp_path / "e5"
    with quiet():
        build_bert_prompts(folder)
    return folder


def edit_json(path: Path, **changes):
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.update(changes)
    path.write_text(json.dumps(data))


def set_module(folder: Path, index: int, **changes):
    modules = json.loads((folder / "modules.json").read_text())
    modules[index].update(changes)
    (folder / "modules.json").write_text(json.dumps(modules))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda f: set_module(f, 1, type="sentence_transformers.models.WordWeights"),
         "a module of type 'sentence_transformers.models.WordWeights', which Batchfit cannot run"),
        (lambda f: set_module(f, 2, type="my_package.Rescale"),
         "a module of type 'my_package.Rescale'"),
        (lambda f: set_module(f, 1, type="sentence_transformers.models.Router"),
         "'sentence_transformers.models.Router'"),
        (lambda f: edit_json(f / "2_Normalize" / "config.json",
                             module_input_name="token_embeddings"),
         "Normalize module's module_input_name is 'token_embeddings'"),
        (lambda f: edit_json(f / "1_Pooling" / "config.json", pooling_mode="first"),
         "unknown pooling mode"),
        (lambda f: edit_json(f / "sentence_bert_config.json", transformer_task="text-generation"),
         "transformer_task is 'text-generation'"),
        (lambda f: edit_json(f / "sentence_bert_config.json", modality_config={
            "text": {"method": "forward", "method_output_name": "last_hidden_state"},
            "message": {"method": "forward", "method_output_name": "last_hidden_state"}}),
         "chat template"),
        (lambda f: (f / "modules.json").write_text(json.dumps(
            json.loads((f / "modules.json").read_text())[:1])),
         "no Pooling module"),
        (lambda f: edit_json(f / "config_sentence_transformers.json",
                             default_prompt_name="title"),
         "no prompt named 'title' to use by default; its prompts: 'document', 'passage'"),
    ],
)  # fmt: skip
def test_what_cannot_be_run_is_refused_at_load_with_its_reason(prompts_folder, edit, message):
    edit(prompts_folder)
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelSpec(model=str(prompts_folder)))
    assert message in str(info.value)


def test_legacy_pooling_keys_are_read_in_sentence_transformers_order(prompts_folder):
    (prompts_folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True,
             "pooling_mode_cls_token": True, "pooling_mode_max_tokens": False}
        )
    )  # fmt: skip
    model, vectors = ours(prompts_folder, prompt="query: ")
    assert model.info.pooling == "cls+mean" and model.info.output_dim == 64
    assert_same(vectors, st_encode(prompts_folder))


# --- prompts and the default prompt ---------------------------------------------------------


def test_the_operator_chooses_the_default_prompt_or_none(prompts_folder):
    default = load_model(ModelSpec(model=str(prompts_folder)))
    chosen = load_model(ModelSpec(model=str(prompts_folder), default_prompt_name="passage"))
    cleared = load_model(ModelSpec(model=str(prompts_folder), default_prompt_name=""))
    assert [m.info.default_prompt_name for m in (default, chosen, cleared)] == [
        "query", "passage", None,
    ]  # fmt: skip
    assert resolve_prompt(chosen.info, None, None) == "passage: "
    assert resolve_prompt(cleared.info, None, None) is None
    with pytest.raises(ModelLoadError, match="no prompt named 'title'"):
        load_model(ModelSpec(model=str(prompts_folder), default_prompt_name="title"))


def test_prompt_resolution_follows_sentence_transformers(prompts_folder):
    info = load_model(ModelSpec(model=str(prompts_folder))).info
    assert resolve_prompt(info, None, None) == "query: "  # the default
    assert resolve_prompt(info, "passage", None) == "passage: "
    assert resolve_prompt(info, None, "title: ") == "title: "
    assert resolve_prompt(info, None, "") is None  # an empty prompt overrides the default
    with pytest.raises(UnknownPrompt, match="its prompts: 'document', 'passage', 'query'"):
        resolve_prompt(info, "title", None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ((), [None, None]),
        (("passage",), ["passage", "passage"]),
        (("",), ["", ""]),
        (("passage", "b="), ["passage", ""]),
        (("a=query",), ["query", None]),
    ],
)
def test_default_prompt_name_flag_is_per_model(value, expected):
    settings = Settings(model=("a=/m/a", "b=/m/b"), default_prompt_name=value)
    assert [spec.default_prompt_name for _, spec in settings.model_specs()] == expected


def test_default_prompt_name_for_an_unknown_model_is_refused():
    with pytest.raises(ValueError, match=r"default_prompt_name for \['c'\], which no --model"):
        Settings(model=("a=/m/a",), default_prompt_name=("c=query",))


def test_a_model_whose_prepare_takes_no_prompt_gets_it_in_front_of_the_text():
    seen = []

    class Plain:
        def prepare(self, inputs, *, truncate):
            seen.append(list(inputs))
            return []

    prepare_call(Plain(), ["a", "b"], name="p", truncate=True, query=None, prompt="query: ")()
    assert seen == [["query: a", "query: b"]]


# --- per-request shaping -------------------------------------------------------------------


def test_truncate_dimensions_renormalises_only_normalised_models():
    vector = np.array([3.0, 4.0, 12.0], dtype=np.float32)
    np.testing.assert_allclose(truncate_dimensions(vector, 2, True), [0.6, 0.8], atol=1e-7)
    np.testing.assert_allclose(truncate_dimensions(vector, 2, False), [3.0, 4.0])
    assert truncate_dimensions(np.zeros(3), 2, True).tolist() == [0.0, 0.0]


def test_top_labels_best_first():
    ranked = [{"label": "b", "score": 0.7}, {"label": "a", "score": 0.2}]
    assert top_labels(ranked, None) == ranked[0]
    assert top_labels(ranked, 1) == ranked[:1]
    assert top_labels(ranked, 5) == ranked
    assert top_labels(ranked[0], 2) == ranked[:1]  # a custom model's single answer


# --- heads ---------------------------------------------------------------------------------


def head_config(**fields) -> PretrainedConfig:
    return PretrainedConfig(num_labels=fields.pop("num_labels", 1), **fields)


@pytest.mark.parametrize(
    ("task", "config", "settings", "expected"),
    [
        ("rerank", {}, {}, "torch.nn.modules.activation.Sigmoid"),
        ("rerank", {"sbert_ce_default_activation_function": "torch.nn.modules.linear.Identity"},
         {}, "torch.nn.modules.linear.Identity"),
        ("rerank", {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}},
         {}, "torch.nn.modules.activation.Tanh"),
        ("rerank", {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Tanh"}},
         {"activation_fn": "torch.nn.modules.linear.Identity"}, "torch.nn.modules.linear.Identity"),
        ("classify", {"num_labels": 3}, {}, "softmax"),
        ("classify", {"num_labels": 3, "problem_type": "multi_label_classification"}, {},
         "sigmoid"),
        ("classify", {"num_labels": 3, "problem_type": "single_label_classification"}, {},
         "softmax"),
        ("classify", {"num_labels": 2, "problem_type": "regression"}, {}, "identity"),
        ("classify", {"num_labels": 1}, {}, "sigmoid"),
    ],
)  # fmt: skip
def test_head_activation_as_cross_encoder_and_pipeline_resolve_it(
    tmp_path, task, config, settings, expected
):
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(settings))
    hf = head_config(hidden_size=8, **config)
    description = describe(tmp_path, hf, task, name="m", default_prompt_name=None)
    assert description.head_activation == expected


def test_a_saved_truncate_dim_cuts_outputs_as_sentence_transformers_does(tmp_path):
    folder = tmp_path / "dense"
    with quiet():
        build_bert_dense(folder)
    edit_json(folder / "config_sentence_transformers.json", truncate_dim=8)
    model, vectors = ours(folder)
    assert (model.info.output_dim, model.info.normalize) == (8, False)
    assert_same(vectors, st_encode(folder))


def test_a_hub_model_is_read_from_its_downloaded_files_like_a_folder(tmp_path, monkeypatch):
    folder = tmp_path / "snapshot"
    with quiet():
        build_bert_dense(folder)
    (folder / "pytorch_model.bin").write_bytes(b"never fetched")  # a pickle beside the weights
    asked = []

    def snapshot_download(repo_id, *, allow_patterns):
        asked.append((repo_id, allow_patterns))
        return str(folder)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    model, vectors = ours("org/dense-model")
    assert model.info.name == "org/dense-model"
    assert (model.info.pooling, model.info.output_dim) == ("max", 16)
    assert_same(vectors, st_encode(folder))
    [(repo_id, patterns)] = asked
    assert repo_id == "org/dense-model" and "*/*.safetensors" in patterns
    assert not any(p.endswith((".bin", ".pt", ".onnx")) for p in patterns)
