"""A file written the way dataset tools write it (every line with the same json_schema
response_format, some sampled at temperature 0.7, one with n = 2, one asking for
logprobs, one with a penalty) runs through spec-run, through spec-submit + spec-worker
--batch 8, and through spec-serve driven by the official openai SDK: the three give the
same lines, every finished output validates against the schema, and every greedy line
is exactly what target-only decoding under the schema gives (the demo pair)."""

from __future__ import annotations

import json
import time

import jsonschema
import mlx.core as mx
import numpy as np
import openai
from conftest import PAIR_ARGS
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlx_lm.generate import generate_step
from test_queue import _collect, comparable, read_jsonl, write_jobs
from test_serve_inprocess import KEY, _wait, api  # noqa: F401 - a fixture

import engine
from engine.text import grammars

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "category": {"enum": ["kitchen", "garden", "office"]},
        "price": {"type": "integer", "minimum": 0, "maximum": 99},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["new", "sale"]}, "maxItems": 2},
    },
    "required": ["name", "category", "price", "in_stock", "tags"],
    "additionalProperties": False,
}
FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "product", "schema": SCHEMA, "strict": True},
}
ITEMS = ["a teapot", "a hose", "a stapler", "a kettle", "a rake", "a lamp", "a mug", "a pen"]


def lines() -> list[dict]:
    out = []
    for i, item in enumerate(ITEMS):
        body = {
            "model": "demo",
            "messages": [
                {"role": "system", "content": "You write catalogue records as JSON."},
                {"role": "user", "content": f"The record of {item}."},
            ],
            "max_tokens": 80,
            "response_format": FORMAT,
            "temperature": 0.7 if i % 2 else 0.0,
            "seed": 11 + i,
        }
        if i == 1:
            body["n"] = 2
        if i == 2:
            body.update(logprobs=True, top_logprobs=2)
        if i == 4:
            body["frequency_penalty"] = 0.5
        out.append(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return out


def target_only(pair, body: dict) -> str:
    """Greedy target-only text under the schema (mlx-lm generate_step + llguidance's mask)
    and the line's frequency penalty."""
    ids = list(pair.tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True))
    matcher = grammars(pair).matcher(
        {"type": "json_schema", "schema": SCHEMA, "whitespace_flexible": False}
    )
    fed = {"n": len(ids)}

    penalty = body.get("frequency_penalty", 0.0)

    def mask(tokens, logits):
        for t in tokens.tolist()[fed["n"] :]:
            assert matcher.consume_token(t)
        fed["n"] = len(tokens)
        out = tokens.tolist()[len(ids) :]
        if penalty and out:  # OpenAI's frequency penalty over the output so far
            counts = np.bincount(out, minlength=pair.target_vocab).astype(np.float32)
            logits = logits - penalty * mx.array(counts)[None]
        bits = allocate_token_bitmask(1, pair.target_vocab)
        fill_next_token_bitmask(matcher, bits)
        ok = np.unpackbits(bits.view(np.uint8), bitorder="little")[: pair.target_vocab]
        return mx.where(mx.array(ok.astype(bool))[None], logits, -mx.inf)

    out = []
    for token, _ in generate_step(
        mx.array(ids), pair.target, max_tokens=body["max_tokens"], logits_processors=[mask]
    ):
        if int(token) in pair.tokenizer.eos_token_ids:
            break
        out.append(int(token))
    return pair.tokenizer.decode(out)


def same(line: dict) -> tuple[dict, list[float]]:
    """What must not differ between doors: the line less ids, times and cached tokens,
    and apart, its logprob values (a batch of other rows changes a logit's last bits)."""
    line = comparable(line)
    body = line["response"]["body"]
    body["usage"].pop("prompt_tokens_details", None)
    values = []
    for choice in body["choices"]:
        for entry in (choice.get("logprobs") or {}).get("content") or []:
            values.append(entry.pop("logprob"))
            values += [top.pop("logprob") for top in entry["top_logprobs"]]
    return line, values


def test_a_dataset_tools_structured_file_runs_exactly_through_every_door(
    redis_env,
    start_worker,
    api,  # noqa: F811
    tmp_path,
):
    requests = lines()
    jobs = write_jobs(tmp_path / "jobs.jsonl", requests)
    local = redis_env.run(
        "spec-run", jobs, "-o", str(tmp_path / "local.jsonl"), *PAIR_ARGS, timeout=400
    )
    assert local.returncode == 0, local.stderr
    expected = {r["custom_id"]: r for r in read_jsonl(tmp_path / "local.jsonl")}

    submitted = redis_env.batch_id("structured")
    assert redis_env.run("spec-submit", jobs, "--batch-id", submitted).returncode == 0
    with api() as http:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key=KEY, http_client=http, max_retries=0
        )
        uploaded = client.files.create(file=open(jobs, "rb"), purpose="batch")
        deadline = time.monotonic() + 60
        while client.files.retrieve(uploaded.id).status != "processed":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _wait(http, batch.id, lambda b: b["status"] != "validating")
        worker = start_worker("--burst", "--batch", "8", *PAIR_ARGS)
        assert worker.wait(timeout=600) == 0, worker.log
        batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed", batch
        served = [json.loads(x) for x in client.files.content(batch.output_file_id).iter_lines()]
    queued = read_jsonl(_collect(redis_env, submitted, tmp_path / "queued.jsonl"))

    pair = engine.load_pair()
    for got in (queued, served):
        assert sorted(r["custom_id"] for r in got) == sorted(expected)
        for line in got:  # (prompt tokens the prefix cache gave depend on the process)
            (mine, values), (theirs, want) = same(line), same(expected[line["custom_id"]])
            assert mine == theirs
            assert np.allclose(values, want, atol=1e-4)
    finished = 0
    for i, request in enumerate(requests):
        body = expected[request["custom_id"]]["response"]["body"]
        assert len(body["choices"]) == request["body"].get("n", 1)
        for choice in body["choices"]:
            text = choice["message"]["content"]
            if choice["finish_reason"] == "stop":
                jsonschema.validate(json.loads(text), SCHEMA)
                finished += 1
            if request["body"]["temperature"] == 0.0:
                assert text == target_only(pair, request["body"]), request["custom_id"]
        if i == 2:
            content = body["choices"][0]["logprobs"]["content"]
            assert len(content) == body["usage"]["completion_tokens"]
            assert all(len(e["top_logprobs"]) == 2 for e in content)
    assert finished >= 3, "the demo model should close a few records within 80 tokens"
