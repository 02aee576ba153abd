"""The output cache in a real replica (bundled model, real uvicorn, real HTTP): hits, partial
hits, one forward pass for concurrent duplicates, a miss for each part of the key, and the
bound. Answers are checked against transformers' own forward pass."""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from models.loading import resolve_model_path
from models.spec import BUNDLED_MODEL
from tests.launch import run_nginx
from tests.servers import run_server

pytestmark = pytest.mark.integration

LEFT = "left"  # the bundled model's weights, truncating on the left and pooling by CLS
CACHE_BYTES = 1 << 20
BATCHES = "batchfit_batch_size_count"
BATCH_ITEMS = "batchfit_batch_size_sum"


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    source = Path(resolve_model_path(BUNDLED_MODEL))
    left = root / "left-truncating"
    shutil.copytree(source, left, ignore=shutil.ignore_patterns("model.safetensors"))
    (left / "model.safetensors").symlink_to(source / "model.safetensors")
    config = json.loads((left / "tokenizer_config.json").read_text())
    (left / "tokenizer_config.json").write_text(json.dumps({**config, "truncation_side": "left"}))
    pooling = json.loads((left / "1_Pooling" / "config.json").read_text())
    pooling.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    (left / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    with run_server(
        root, "--model", BUNDLED_MODEL, "--model", f"{LEFT}={left}",
        "--cache-bytes", str(CACHE_BYTES), "--max-inputs-per-request", "64",
        "--max-queue-items", "256",
    ) as server:  # fmt: skip
        yield server


@pytest.fixture(scope="module")
def reference():
    path = resolve_model_path(BUNDLED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()

    def embed(texts: list[str]) -> np.ndarray:
        encoded = tokenizer(
            texts, padding=True, truncation=True, max_length=256, return_tensors="pt"
        )
        with torch.inference_mode():
            hidden = model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).float()
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=1).numpy()

    return embed


def scrape(url: str) -> dict[tuple[str, str], float]:
    """(metric, model label) -> value, summed over any other labels."""
    found: dict[tuple[str, str], float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        match = re.match(r"^(\w+)(?:\{(.*)\})? (\S+)$", line)
        if not match:
            continue
        model = re.search(r'model="([^"]*)"', match.group(2) or "")
        key = (match.group(1), model.group(1) if model else "")
        found[key] = found.get(key, 0.0) + float(match.group(3))
    return found


def delta(before, after, name, model=BUNDLED_MODEL) -> float:
    return after.get((name, model), 0.0) - before.get((name, model), 0.0)


def post(url: str, **body) -> list:
    response = httpx.post(f"{url}/v1/infer", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["outputs"]


def test_a_repeated_request_is_answered_from_the_cache_without_a_forward_pass(replica, reference):
    texts = [f"Sentence number {i} about caching repeated embedding traffic." for i in range(64)]
    first = post(replica.url, inputs=texts)
    before = scrape(replica.url)
    second = post(replica.url, inputs=texts)
    after = scrape(replica.url)
    assert second == first  # identical, to the last digit
    assert delta(before, after, "batchfit_cache_hits_total") == 64
    assert delta(before, after, "batchfit_cache_misses_total") == 0
    assert delta(before, after, BATCHES) == 0  # no forward pass ran
    expected = reference(texts)
    for got, want in zip(second, expected, strict=True):
        assert float(np.dot(got, want)) > 0.9999
    assert after[("batchfit_cache_bytes", BUNDLED_MODEL)] > 64 * 384 * 4


def test_partial_hits_keep_the_order_and_compute_only_the_misses(replica, reference):
    cached = [f"An input seen before, number {i}." for i in range(4)]
    post(replica.url, inputs=cached)
    fresh = [f"A new input, number {i}." for i in range(3)]
    mixed = [fresh[0], cached[2], cached[0], fresh[1], cached[3], fresh[2]]
    before = scrape(replica.url)
    outputs = post(replica.url, inputs=mixed)
    after = scrape(replica.url)
    assert delta(before, after, "batchfit_cache_hits_total") == 3
    assert delta(before, after, "batchfit_cache_misses_total") == 3
    assert delta(before, after, BATCH_ITEMS) == 3  # only the misses ran
    for got, want in zip(outputs, reference(mixed), strict=True):
        assert float(np.dot(got, want)) > 0.9999


def test_concurrent_duplicates_cost_one_forward_pass_over_that_input(replica, reference):
    text = "Thirty-two clients ask for this very sentence at the same moment."
    before = scrape(replica.url)
    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(lambda _: post(replica.url, inputs=[text]), range(32)))
    after = scrape(replica.url)
    assert all(answer == answers[0] for answer in answers)
    assert float(np.dot(answers[0][0], reference([text])[0])) > 0.9999
    assert delta(before, after, BATCH_ITEMS) == 1  # one input computed, once
    waited = delta(before, after, "batchfit_deduplicated_inputs_total")
    assert waited + delta(before, after, "batchfit_cache_hits_total") == 31


def test_each_part_of_the_key_changes_the_answer_and_misses(replica):
    long = " ".join(f"word{i % 50}" for i in range(400))  # past the 256-token maximum
    other_tail = long + " and an ending that truncation on the right never reads"
    short = "A short sentence that both models tokenize alike."
    cases = {
        "model": (short, {"model": LEFT}),  # the same token ids, another model
        "prompt": (long, {"prompt": "query: "}),
        "dimensions": (long, {"dimensions": 128}),
    }
    base = {text: post(replica.url, inputs=[text]) for text in (long, short)}
    for part, (text, options) in cases.items():
        before = scrape(replica.url)
        model = options.get("model", BUNDLED_MODEL)
        outputs = post(replica.url, inputs=[text], **options)
        after = scrape(replica.url)
        assert delta(before, after, "batchfit_cache_misses_total", model) == 1, part
        assert delta(before, after, "batchfit_cache_hits_total", model) == 0, part
        assert outputs != base[text], part
    base = base[long]
    # Truncation: the model reads the ids after truncation. On the right, a different tail
    # is cut away, so the model reads the same ids (a hit, with the same answer); on the
    # left it keeps the tail, so the ids differ (a miss).
    before = scrape(replica.url)
    assert post(replica.url, inputs=[other_tail]) == base
    left_tail = post(replica.url, inputs=[other_tail], model=LEFT)
    after = scrape(replica.url)
    assert delta(before, after, "batchfit_cache_hits_total") == 1
    assert delta(before, after, "batchfit_cache_misses_total", LEFT) == 1
    assert left_tail != post(replica.url, inputs=[long], model=LEFT)
    # And dimensions=128 once more is a hit, renormalised as before.
    before = scrape(replica.url)
    cut = post(replica.url, inputs=[long], dimensions=128)
    assert delta(before, scrape(replica.url), "batchfit_cache_hits_total") == 1
    assert len(cut[0]) == 128 and abs(float(np.linalg.norm(cut[0])) - 1) < 1e-5


def test_filling_past_the_bound_evicts_and_never_holds_more(replica):
    before = scrape(replica.url)
    for start in range(0, 640, 64):
        post(replica.url, inputs=[f"filler text {i}" for i in range(start, start + 64)])
        held = sum(
            v for (name, _), v in scrape(replica.url).items() if name == "batchfit_cache_bytes"
        )
        assert 0 < held <= CACHE_BYTES
    after = scrape(replica.url)
    assert delta(before, after, "batchfit_cache_evictions_total") > 0


def test_nginx_answers_a_repeated_body_from_its_cache(replica, tmp_path):
    """The template's answer cache, enabled, through real Nginx in front of the replica: a
    repeated body is a HIT that never reaches the replica; another body or another API key
    is a MISS; a body too large to key in memory always goes to the replica."""
    address = replica.url.removeprefix("http://")
    with run_nginx(tmp_path, [address], cache_bytes=1 << 20, cache_body_bytes=4096) as nginx:

        def send(body, key="k1", path="/v1/infer"):
            response = httpx.post(
                f"{nginx.url}{path}", json=body, timeout=60,
                headers={"authorization": f"Bearer {key}"},
            )  # fmt: skip
            assert response.status_code == 200, response.text
            return response.headers["x-cache-status"], response.json()

        body = {"inputs": ["Nginx keeps this whole answer."]}
        assert send(body)[0] == "MISS"
        requests = scrape(replica.url)[("batchfit_requests_total", "")]
        status, answer = send(body)
        assert status == "HIT"
        assert scrape(replica.url)[("batchfit_requests_total", "")] == requests + 1  # the scrape
        assert answer["outputs"] == send(body)[1]["outputs"]
        assert send({"inputs": ["Another body."]})[0] == "MISS"
        assert send(body, key="k2")[0] == "MISS"  # another API key: another entry
        assert send(body, key="k2")[0] == "HIT"
        embeddings = {"input": "An OpenAI client's request.", "model": BUNDLED_MODEL}
        assert send(embeddings, path="/v1/embeddings")[0] == "MISS"
        assert send(embeddings, path="/v1/embeddings")[0] == "HIT"
        large = {"inputs": ["a longer input " * 400]}  # beyond the 4 KiB body buffer
        assert [send(large)[0] for _ in range(2)] == ["BYPASS", "BYPASS"]
        assert httpx.get(f"{nginx.url}/v1/models", timeout=10).headers.get("x-cache-status") is None
