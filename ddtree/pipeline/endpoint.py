"""A small client for another engine's server (OpenAI-compatible, or llama.cpp's native /completion), stdlib only.

`python -m ddtree.check source=endpoint` sends each prompt through it, greedy (or at the check's temperature),
and keeps what comes back: the text, token ids where the server returns them (vLLM `return_token_ids`, SGLang
`return_meta_info` + `return_token_ids`, llama.cpp `return_tokens`: docs/check.md), the client-side latency,
and the server's own speculative-decoding counters where it reports them (SGLang `meta_info.spec_verify_ct`,
llama.cpp `timings.draft_n` / `draft_n_accepted`, vLLM's `/metrics` spec_decode counters).

Greedy means greedy: servers apply sampler settings the request did not name (llama-cpp-python a repetition
penalty of 1.1; vLLM and SGLang the model's generation_config.json, which may carry one; llama.cpp whatever its
command line set), and at T = 0 a penalty changes which token wins. Every request therefore carries the neutral
value of each sampler setting the server has (SAMPLER_NEUTRAL, by the server GET /models names: `server_kind`);
at T > 0 the same, so the engine samples the temperature distribution alone. `endpoint.extra` overrides any of them.

A server that cannot be reached, answers 4xx/5xx, times out or does not serve the model raises EndpointError,
a ConfigError naming the endpoint setting (one line, exit 2).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from ddtree.errors import ConfigError

APIS = ("chat", "completion", "llamacpp")
# The sampler settings each known server applies by default, at their neutral values (off). Only fields the server
# reads: transformers serve answers 422 to a field it does not know, so a server not recognised gets OpenAI's own.
_OPENAI_NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0}  # transformers serve: repetition_penalty = 1 + this
_PENALTY_MINP = {**_OPENAI_NEUTRAL, "min_p": 0.0}
SAMPLER_NEUTRAL: dict[str, dict[str, Any]] = {
    "openai": dict(_OPENAI_NEUTRAL),  # the standard's fields alone: transformers serve, TensorRT-LLM, others
    "vllm": {**_PENALTY_MINP, "repetition_penalty": 1.0, "top_k": -1},  # -1: every token (0 too on recent vLLM)
    "sglang": {**_PENALTY_MINP, "repetition_penalty": 1.0, "top_k": -1},
    # llama-server (native /completion and its OpenAI API): top_k <= 0 is off, top_n_sigma and adaptive_target < 0 off
    "llamacpp": {**_PENALTY_MINP, "top_p": 1.0, "repeat_penalty": 1.0, "top_k": 0, "typical_p": 1.0, "dry_multiplier": 0.0,
                 "xtc_probability": 0.0, "mirostat": 0, "top_n_sigma": -1.0, "dynatemp_range": 0.0,
                 "adaptive_target": -1.0},
    # llama-cpp-python's server (llama_cpp.server): repeat_penalty 1.1, top_k 40, min_p 0.05 by default; its request
    # models take no typical_p or tfs_z (pydantic drops unknown fields)
    "llama-cpp-python": {**_PENALTY_MINP, "repeat_penalty": 1.0, "top_k": 0, "mirostat_mode": 0},
    "none": {},  # endpoint.server=none: temperature and top_p only (what ddtree sent before)
}
SERVERS = ("auto", *SAMPLER_NEUTRAL)
# GET /models' owned_by, as each server writes it
_OWNED_BY = {"vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp"}
# vLLM's Prometheus counters for speculative decoding (V1 engine): summed over label sets
VLLM_SPEC_COUNTERS = {"drafts": "vllm:spec_decode_num_drafts_total",
                      "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                      "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}


class EndpointError(ConfigError):
    """The server failed a request: the setting to look at, what happened, and what to do."""


@dataclass
class Reply:
    """One generation as the server returned it."""

    text: str
    token_ids: list[int] | None  # None: the server gave text only
    finish_reason: str | None  # stop | length | ...
    latency_s: float  # client side: request sent -> whole answer read
    prompt_tokens: int | None = None  # the server's count (usage.prompt_tokens)
    completion_tokens: int | None = None
    prompt_token_ids: list[int] | None = None  # where the server echoes them (vLLM return_token_ids)
    acceptance: dict[str, Any] = field(default_factory=dict)  # the server's spec-decode report, if any


def _first_line(text: str, limit: int = 200) -> str:
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line[:limit]


class EndpointClient:
    """Requests to one server. `url`: the OpenAI base (http://HOST:PORT/v1); api=llamacpp: the server's root."""

    def __init__(self, url: str, *, api: str = "chat", model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0, extra: dict[str, Any] | None = None, server: str = "auto"):
        if api not in APIS:
            raise ConfigError("endpoint.api", f"unknown value '{api}'", f"use one of: {', '.join(APIS)}")
        if server not in SERVERS:
            raise ConfigError("endpoint.server", f"unknown value '{server}'", f"use one of: {', '.join(SERVERS)}")
        # api=llamacpp speaks to llama-server alone; else GET /models tells (served_model)
        self.server = "llamacpp" if server == "auto" and api == "llamacpp" else server
        if not url or not re.match(r"^https?://[^/\s]+", url):
            raise ConfigError("endpoint.url", f"'{url}' is not an http(s) URL",
                              "pass endpoint.url=http://HOST:PORT/v1 (llama.cpp's native API: http://HOST:PORT)")
        self.url, self.api, self.model = url.rstrip("/"), api, model
        self.api_key, self.timeout_s, self.extra = api_key, timeout_s, dict(extra or {})

    @property
    def root(self) -> str:
        """The server's root (where vLLM's /metrics and llama.cpp's /health live)."""
        return re.sub(r"/v\d+$", "", self.url)

    # ------------------------------------------------------------ HTTP

    def _request(self, path: str, body: dict[str, Any] | None = None, *, setting: str = "endpoint.url",
                 base: str | None = None, raw: bool = False) -> Any:
        url = (base or self.url) + path
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(url, data=data, headers=headers, method="POST" if body is not None else "GET")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                payload = resp.read()
        except urllib.error.HTTPError as e:
            detail = _first_line(e.read().decode("utf-8", "replace")) if e.fp is not None else ""
            fix = ("check endpoint.model (GET /models lists what it serves)" if e.code == 404 and "model" in detail.lower()
                   else ("check the server's log; endpoint.extra may hold a field this server refuses, or the sampler "
                         f"fields of endpoint.server={self.server} (endpoint.server=openai sends the standard's alone)")
                   if e.code in (400, 422)
                   else "check endpoint.url and the server's log")
            raise EndpointError(setting, f"{url} answered HTTP {e.code}: {detail or e.reason}", fix) from None
        except TimeoutError:
            raise EndpointError("endpoint.timeout_s", f"{url} did not answer within {self.timeout_s:g} s",
                                "raise endpoint.timeout_s, or lower max_new_tokens") from None
        except (urllib.error.URLError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise EndpointError("endpoint.timeout_s", f"{url} did not answer within {self.timeout_s:g} s",
                                    "raise endpoint.timeout_s, or lower max_new_tokens") from None
            raise EndpointError("endpoint.url", f"cannot reach {url} ({_first_line(reason)})",
                                "start the server, or fix endpoint.url (http://HOST:PORT/v1)") from None
        if raw:
            return payload.decode("utf-8", "replace")
        try:
            return json.loads(payload)
        except ValueError:
            raise EndpointError(setting, f"{url} did not answer JSON ({_first_line(payload.decode('utf-8', 'replace'))!r})",
                                "point endpoint.url at the OpenAI-compatible API (it ends in /v1)") from None

    # ------------------------------------------------------------ before the first prompt

    def served_model(self) -> str | None:
        """The model name to send: endpoint.model checked against what the server lists, or its only model."""
        if self.api == "llamacpp":  # one model per llama.cpp server; /health answers once it is loaded
            self._request("/health", base=self.root)
            return self.model
        listing = self._request("/models")
        if self.server == "auto":
            self.server = server_kind(listing)
        names = [str(m.get("id")) for m in (listing.get("data") or []) if isinstance(m, dict)]
        if self.model is None:
            if len(names) == 1:
                self.model = names[0]
            elif names:
                raise ConfigError("endpoint.model", f"the server serves {len(names)} models: {', '.join(names)}",
                                  "pass endpoint.model=<one of them>")
        elif names and self.model not in names:
            raise ConfigError("endpoint.model", f"'{self.model}' is not served by {self.url} (it serves: "
                              f"{', '.join(names)})", "pass endpoint.model=<one of them>")
        return self.model

    def spec_counters(self) -> dict[str, float] | None:
        """vLLM's speculative-decoding counters from /metrics (None where the server has none)."""
        try:
            text = self._request("/metrics", base=self.root, raw=True)
        except EndpointError:
            return None
        return parse_spec_counters(text)

    # ------------------------------------------------------------ one generation

    def generate(self, *, messages: list[dict[str, str]] | None = None, prompt: str | list[int] | None = None,
                 max_new_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 chat_template_kwargs: dict[str, Any] | None = None) -> Reply:
        """One answer: chat (messages; the server's chat template), completion or llamacpp (prompt text or ids)."""
        if self.api == "llamacpp":
            body: dict[str, Any] = {"prompt": prompt, "n_predict": max_new_tokens, "temperature": temperature,
                                    "cache_prompt": False, "return_tokens": True}
            path, base = "/completion", self.root
        else:
            body = {"max_tokens": max_new_tokens, "temperature": temperature, "top_p": 1.0, "stream": False}
            if self.model is not None:
                body["model"] = self.model
            if self.api == "chat":
                body["messages"] = messages
                if chat_template_kwargs:
                    body["chat_template_kwargs"] = chat_template_kwargs
                path = "/chat/completions"
            else:
                body["prompt"] = prompt
                path = "/completions"
            base = None
        if seed is not None:
            body["seed"] = seed
        body.update(sampler_fields(self.server, self.api, temperature))
        body.update(self.extra)
        t0 = time.perf_counter()
        out = self._request(path, body, base=base)
        latency = time.perf_counter() - t0
        return parse_reply(out, self.api, latency)


def sampler_fields(server: str, api: str, temperature: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a request says about sampling besides temperature and top_p: the server's sampler defaults at their
    neutral values (SAMPLER_NEUTRAL; "auto" not yet resolved: OpenAI's), with endpoint.extra's values over them."""
    fields = dict(SAMPLER_NEUTRAL["openai" if server == "auto" else server])
    if api == "llamacpp" and temperature == 0:
        fields["top_k"] = 1  # greedy by construction on the native API
    return {**fields, **{k: v for k, v in (extra or {}).items() if k in fields}}


def server_kind(listing: Any) -> str:
    """Which server answered GET /models (a key of SAMPLER_NEUTRAL): vLLM, SGLang and llama-server name themselves
    in `owned_by`; llama-cpp-python writes "me" with a `permissions` list; anything else is "openai"."""
    data = listing.get("data") if isinstance(listing, dict) else None
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
    owner = str(first.get("owned_by", ""))
    if owner in _OWNED_BY:
        return _OWNED_BY[owner]
    if owner == "me" and "permissions" in first:
        return "llama-cpp-python"
    return "openai"


def _ids(x: Any) -> list[int] | None:
    if isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        return list(x)
    return None


def parse_reply(out: dict[str, Any], api: str, latency_s: float) -> Reply:
    """The parts of a server's answer the check reads, wherever each engine puts them."""
    if not isinstance(out, dict):
        raise EndpointError("endpoint.url", f"the server's answer is not a JSON object ({type(out).__name__})",
                            "point endpoint.url at an OpenAI-compatible API")
    if api == "llamacpp":  # {"content", "tokens", "stop_type", "timings": {"draft_n", "draft_n_accepted"}, ...}
        timings = out.get("timings") or {}
        acc = {k: timings[k] for k in ("draft_n", "draft_n_accepted") if isinstance(timings.get(k), (int, float))}
        stop = out.get("stop_type")
        finish = {"eos": "stop", "word": "stop", "limit": "length"}.get(stop, stop)
        if finish is None and out.get("stopped_limit"):
            finish = "length"
        elif finish is None and (out.get("stopped_eos") or out.get("stopped_word")):
            finish = "stop"
        return Reply(str(out.get("content", "")), _ids(out.get("tokens")), finish, latency_s,
                     out.get("tokens_evaluated"), out.get("tokens_predicted"), acceptance=acc)
    choices = out.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EndpointError("endpoint.url", f"the server's answer has no choices ({_first_line(json.dumps(out))})",
                            "point endpoint.url at an OpenAI-compatible API")
    ch = choices[0]
    text = ch.get("text") if "text" in ch else (ch.get("message") or {}).get("content")
    meta = ch.get("meta_info") or out.get("meta_info") or {}  # SGLang (return_meta_info)
    ids = (_ids(ch.get("token_ids")) or _ids(ch.get("response_token_ids")) or _ids(meta.get("output_ids"))
           or _logprob_token_ids(ch.get("logprobs")))
    usage = out.get("usage") or {}
    acc = {}
    for key in ("spec_verify_ct", "spec_accept_length", "spec_accept_token_num", "spec_draft_token_num"):
        if isinstance(meta.get(key), (int, float)):
            acc[key] = meta[key]
    return Reply(str(text or ""), ids, ch.get("finish_reason"), latency_s, usage.get("prompt_tokens"),
                 usage.get("completion_tokens"), _ids(ch.get("prompt_token_ids")) or _ids(out.get("prompt_token_ids")),
                 acc)


def _logprob_token_ids(logprobs: Any) -> list[int] | None:
    """vLLM with --return-tokens-as-token-ids (and logprobs): each token spelled 'token_id:<id>'."""
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    tokens = [c.get("token") for c in content] if isinstance(content, list) else (
        logprobs.get("tokens") if isinstance(logprobs, dict) else None)
    if not isinstance(tokens, list) or not tokens:
        return None
    got = [re.fullmatch(r"token_id:(\d+)", str(t)) for t in tokens]
    return [int(m.group(1)) for m in got] if all(got) else None


def parse_spec_counters(text: str) -> dict[str, float] | None:
    """vLLM's spec_decode counters (drafts, draft_tokens, accepted_tokens) in Prometheus text; None if absent."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for key, name in VLLM_SPEC_COUNTERS.items():
            m = re.match(rf"^{re.escape(name)}(?:\{{[^}}]*\}})?\s+([0-9.eE+-]+)\s*$", line)
            if m:
                totals[key] = totals.get(key, 0.0) + float(m.group(1))
    return totals or None


def counter_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """The server's acceptance over the check's requests: counters after minus before (vLLM)."""
    if not before or not after:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in VLLM_SPEC_COUNTERS}
    if not d["draft_tokens"]:
        return None
    d["acceptance_rate"] = d["accepted_tokens"] / d["draft_tokens"]
    d["mean_acceptance_length"] = 1 + d["accepted_tokens"] / d["drafts"] if d["drafts"] else None
    return d
