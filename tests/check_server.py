"""A small real HTTP server standing in for another engine (tests of `python -m ddtree.check`).

It speaks the OpenAI chat API over a real socket on 127.0.0.1 and generates with Hugging Face `generate` on the
model it is given (greedy, or sampling at the request's temperature from the full distribution). Knobs make
it fail the way servers fail (an HTTP status, a slow answer, dying after N answers) or answer the way
particular engines do (vLLM's `token_ids`, SGLang's `meta_info`, vLLM's /metrics counters, a server's name in
GET /models, a repetition penalty applied unless the request switches it off, 422 for a field it does not take).
The happy path against a real serving engine is tests/test_check.py's `transformers serve` test.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Behaviour:
    model_name: str = "toy"
    status: int | None = None  # answer every generation with this HTTP status
    fail_after: int | None = None  # answer 500 once this many generations were served
    delay_s: float = 0.0  # sleep before answering a generation
    token_ids: bool = False  # vLLM's return_token_ids: choices[0].token_ids
    sglang_meta: bool = False  # SGLang's meta_info with spec_verify_ct
    vllm_metrics: bool = False  # /metrics with spec_decode counters
    text_edit: Any = None  # f(text) -> text: what the server sends instead of the decoded text
    temperature_scale: float = 1.0  # sample at temperature * this (a wrong sampler when != 1)
    # a server's identity in GET /models (owned_by; llama-cpp-python also lists `permissions`)
    owned_by: str | None = None
    permissions: bool = False
    # a repetition penalty the server applies unless the request names `penalty_field` (llama-cpp-python:
    # repeat_penalty, default 1.1): HF's repetition_penalty at this value
    default_penalty: float | None = None
    penalty_field: str = "repeat_penalty"
    # the request fields the server takes; any other answers 422 (transformers serve does so)
    fields: set[str] | None = None
    served: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)


class FakeEngine:
    def __init__(self, model, tokenizer, behaviour: Behaviour | None = None):
        self.model, self.tokenizer = model, tokenizer
        self.b = behaviour or Behaviour()
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _send(self, code: int, obj: Any, raw: str | None = None):
                data = (raw if raw is not None else json.dumps(obj)).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if raw is not None else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                entry: dict[str, Any] = {"id": engine.b.model_name, "object": "model"}
                if engine.b.owned_by is not None:
                    entry["owned_by"] = engine.b.owned_by
                if engine.b.permissions:
                    entry["permissions"] = []
                if self.path == "/v1/models":
                    return self._send(200, {"object": "list", "data": [entry]})
                if self.path == "/metrics" and engine.b.vllm_metrics:
                    n = engine.b.served
                    return self._send(200, None, raw=(
                        "# HELP vllm:spec_decode_num_drafts_total drafts\n"
                        f'vllm:spec_decode_num_drafts_total{{engine="0"}} {10 * n}\n'
                        f'vllm:spec_decode_num_draft_tokens_total{{engine="0"}} {40 * n}\n'
                        f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {25 * n}\n'))
                return self._send(404, {"error": {"message": f"no route {self.path}"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                engine.b.requests.append(body)
                if self.path != "/v1/chat/completions":
                    return self._send(404, {"error": {"message": f"no route {self.path}"}})
                if engine.b.status is not None:
                    return self._send(engine.b.status, {"error": {"message": "the test server refuses"}})
                unexpected = set(body) - engine.b.fields if engine.b.fields is not None else set()
                if unexpected:
                    return self._send(422, {"detail": f"Unexpected fields in the request: {sorted(unexpected)}"})
                if body.get("model") != engine.b.model_name:
                    return self._send(404, {"error": {"message": f"model {body.get('model')} not found"}})
                if engine.b.fail_after is not None and engine.b.served >= engine.b.fail_after:
                    return self._send(500, {"error": {"message": "engine died"}})
                time.sleep(engine.b.delay_s)
                try:
                    self._send(200, engine.answer(body))
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout)
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        import torch

        tok = self.tokenizer
        text = tok.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        t = float(body.get("temperature") or 0.0)
        kw: dict[str, Any] = {"do_sample": False}
        if t > 0:
            kw = {"do_sample": True, "temperature": t * self.b.temperature_scale, "top_k": 0, "top_p": 1.0}
            torch.manual_seed(int(body.get("seed", 0)))
        if self.b.default_penalty is not None:
            kw["repetition_penalty"] = float(body.get(self.b.penalty_field, self.b.default_penalty))
        with self.lock, torch.no_grad():
            out = self.model.generate(torch.tensor([ids]), max_new_tokens=int(body["max_tokens"]),
                                      pad_token_id=tok.pad_token_id, **kw)[0, len(ids):].tolist()
        self.b.served += 1
        stop = bool(out) and out[-1] == tok.eos_token_id
        answer = tok.decode(out, skip_special_tokens=True)
        if self.b.text_edit is not None:
            answer = self.b.text_edit(answer)
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": answer},
                                  "finish_reason": "stop" if stop else "length"}
        if self.b.token_ids:
            choice["token_ids"] = out
        if self.b.sglang_meta:
            choice["meta_info"] = {"spec_verify_ct": max(1, len(out) // 2), "completion_tokens": len(out)}
        return {"id": "x", "object": "chat.completion", "model": self.b.model_name, "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out), "total_tokens": len(ids) + len(out)}}

    def __enter__(self) -> FakeEngine:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
