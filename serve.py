"""An OpenAI-compatible HTTP server on tinytp's engine, as `vllm serve` is on vLLM's.

`python serve.py --model M`. A front end, standard library only: a request's prompts are one
LLM.stream_outputs call (the engine hands them to the request's own queue: a slow client never
holds it up), answered in one JSON body or as server-sent events. What it refuses: docs/api.md."""

from __future__ import annotations

import argparse
import contextlib
import hmac
import ipaddress
import itertools
import json
import re
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import fields, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import tinytp
from scheduler import Counter
from tinytp import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams

MAX_BODY_BYTES = 16 << 20  # a larger request body is refused (413) without being read
SOCKET_TIMEOUT = 60.0  # a client that neither sends nor reads for this long is dropped
READ_TIMEOUT = 30.0  # a request's line, headers and body must be in by then, or it is cut (408)
MAX_CONNECTIONS = 256  # one more is answered 503 at once, by the accepting thread
STOP_GRACE = 2.0  # at a stop, the answers in flight get this long; then every connection is cut
POLL_SECONDS = 0.5  # how often slow senders are cut, stopping looked at, the workers' health
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's and vLLM's default (chat's: what the context leaves)
VERSION = "0.0.0+tinytp"  # /version's: no vLLM version, no tool takes it for one with its features
# --allowed-origins' default, Ollama's: this machine's pages (vLLM's "*": any page, any site's)
LOOPBACK = [f"{host}{port}" for host in ("localhost", "127.0.0.1", "[::1]") for port in ("", ":*")]
LOOPBACK_ORIGINS = [f"{scheme}://{host}" for scheme in ("http", "https") for host in LOOPBACK]
ACA = "Access-Control-Allow-"  # the CORS headers' names begin so

# The request fields honoured, as OpenAI and vLLM define them: SamplingParams checks the sampling
# ones, the endpoints prompt, messages, tokens; the rest have their types here (user: unused).
FLAGS = ("stream", "echo", "add_generation_prompt", "add_special_tokens", "return_token_strs")
FIELD_TYPES = {"model": str, "user": str, "stream_options": dict, **dict.fromkeys(FLAGS, bool)}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats"}
TYPE_WORDS = {str: "a string", dict: "an object", bool: "true or false"}
# (SamplingParams' own; the endpoints set max_tokens, logprobs and prompt_logprobs themselves)
SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)} - {"max_tokens", "prompt_logprobs"}
SAMPLING_FIELDS -= {"detokenize", "logits_processors"}  # vLLM's offline API's alone
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "user", *SAMPLING_FIELDS}
COMMON_FIELDS |= {"cache_salt"}  # vLLM's: put in each prompt's dict, which the engine checks
PROMPT_KEYS = {str: "prompt", list: "prompt_token_ids"}  # a prompt's key in a prompt dict
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "add_generation_prompt"}
CHAT_FIELDS |= {"top_logprobs"}
TOKENIZE_FIELDS = {"model", "prompt", "messages", *FLAGS[2:]}  # (FLAGS but stream, echo)
# Fields that would change the output, accepted only at the value that changes nothing. Any other
# field is refused by name too: exact or refuse. (A null is OpenAI's "not given" for every field.)
NEUTRAL_VALUES = {"suffix": "", "tools": [], "response_format": {"type": "text"}}
# path: {method: (the Handler method that answers, the body fields it honours; None: no body)}
ROUTES = {
    "/v1/models": {"GET": ("models", None)},
    "/v1/completions": {"POST": ("completions", COMPLETION_FIELDS)},
    "/v1/chat/completions": {"POST": ("chat", CHAT_FIELDS)},
    "/tokenize": {"POST": ("tokenize", TOKENIZE_FIELDS)},
    "/detokenize": {"POST": ("detokenize", {"model", "tokens"})},
    "/health": {"GET": ("health", None)},
    "/ping": {"GET": ("health", None), "POST": ("health", None)},  # vLLM's (SageMaker's) name
    "/version": {"GET": ("version", None)},
    "/metrics": {"GET": ("metrics", None)},
}
GENERATED = '"%s": %d prompts, %d tokens out (engine: %d steps so far, at most %d requests in one)'


# OpenAI's shapes of the outputs ------------------------------------------------------
def counts(prompt: int, completion: int) -> dict:
    total = prompt + completion
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


def usage(final: list[RequestOutput]) -> dict:
    prompt = sum(len(output.prompt_token_ids) for output in final)  # once, whatever n is
    total = counts(prompt, sum(len(c.token_ids) for output in final for c in output.outputs))
    cached = sum(output.num_cached_tokens or 0 for output in final)  # found in the prefix cache
    return total | {"prompt_tokens_details": {"cached_tokens": cached}}


def choice(number: int, c: CompletionOutput, text: str, logprobs, chat: bool, stream: bool) -> dict:
    """A choice in a response (its text), or in a stream's chunk (the new text)."""
    content = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
    if chat and stream:  # "" too, for a token that ends in half of a character: vLLM's chunk
        content = {"delta": {"content": text}}
    ends = {"finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
    return {"index": number, **content, "logprobs": logprobs, **ends}


def logprob_value(logprob: Logprob) -> float:
    return max(logprob.logprob, -9999.0)  # JSON has no infinity: a -inf is OpenAI's -9999.0


def chat_logprobs(tokens: list[int], entries: list[dict[int, Logprob]], k: int) -> dict:
    """The chat's: each token's text, log-probability, UTF-8 bytes and the k likeliest's."""

    def item(logprob: Logprob) -> dict:
        text = logprob.decoded_token
        return {"token": text, "logprob": logprob_value(logprob), "bytes": list(text.encode())}

    ranked = [sorted(entry.values(), key=lambda logprob: logprob.rank)[:k] for entry in entries]
    content = [
        {**item(e[t]), "top_logprobs": [*map(item, top)]}
        for t, e, top in zip(tokens, entries, ranked)
    ]
    return {"content": content}


def completion_logprobs(tokens: list[int], entries: list, offset: int, tokenizer) -> dict:
    """The completions': each token's text and where it begins (from offset), its log-probability
    and the likeliest ones' by text (with the sampled one, as vLLM's: k + 1 or k); an entry None
    (the prompt's first token) is null, its text the tokenizer's."""
    texts = [
        tokenizer.decode([t]) if e is None else e[t].decoded_token for t, e in zip(tokens, entries)
    ]
    offsets = list(itertools.accumulate(map(len, texts), initial=offset))[: len(texts)]
    values = [e and logprob_value(e[t]) for t, e in zip(tokens, entries)]
    tops = [e and {lp.decoded_token: logprob_value(lp) for lp in e.values()} for e in entries]
    return {"text_offset": offsets, "token_logprobs": values, "tokens": texts, "top_logprobs": tops}


def salted(prompts: list, body: dict) -> list:
    """The prompts as vLLM's prompt dicts with the body's cache_salt, if any (the engine checks it
    and hashes it into each prompt's first block)."""
    if "cache_salt" not in body:
        return prompts
    named = [p if isinstance(p, dict) else {PROMPT_KEYS[type(p)]: p} for p in prompts]
    return [{**p, "cache_salt": body["cache_salt"]} for p in named]


class APIError(Exception):
    """An answer in OpenAI's error shape: the HTTP status, the message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(str(message).split("\n")[0])  # one line: never a worker's traceback
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        }


def field_fault(name: str, value, honoured: set[str]) -> str | None:
    """What is wrong with a request's field, if anything: exact or refuse."""
    if name in NEUTRAL_VALUES:
        if value != (neutral := NEUTRAL_VALUES[name]):
            only = f"only {json.dumps(neutral)}, which changes nothing"
            return f"{name}={json.dumps(value)}: tinytp does not support {name} ({only})"
    elif name not in honoured:
        return f"tinytp does not support {name}; it honours {', '.join(sorted(honoured))}"
    elif not isinstance(value, FIELD_TYPES.get(name, object)):
        return f"{name} must be {TYPE_WORDS[FIELD_TYPES[name]]}, got {json.dumps(value)}"


def parse_body(data: bytes, kind: str, honoured: set[str], names: list[str]) -> dict:
    """A POST's body (data, of Content-Type kind) as the JSON object it must be, nulls left out
    ("not given"), each field checked; the model one of the served names."""
    # A page of any site may post text/plain, a form or (a Blob) no type without a preflight:
    # JSON's alone is read, as by FastAPI's strict_content_type (vLLM's server). Read first:
    # a connection closed on an unread body resets, and the answer may be lost with it.
    if not re.fullmatch(r"application/(\S*\+)?json", kind.split(";")[0].strip().lower()):
        raise APIError(415, f"Content-Type {kind or '(none)'}: send JSON, application/json")
    try:  # a lone surrogate ("\ud800") is valid JSON, but no text that a tokenizer can take
        body = json.loads(data)
        json.dumps(body, ensure_ascii=False).encode()
    except (ValueError, RecursionError) as e:  # bad JSON, not UTF-8, nested too deep
        raise APIError(400, f"the body is not valid JSON: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
    body = {name: value for name, value in body.items() if value is not None}
    for name, value in body.items():
        if fault := field_fault(name, value, honoured):
            raise APIError(400, fault, name)
    if isinstance(bias := body.get("logit_bias"), dict):  # OpenAI's: token ids as strings
        # (20 digits or more is no token id, and int() would refuse a key past 4,300: a 500)
        if not all(key.isascii() and key.isdigit() and len(key) < 20 for key in bias):
            raise APIError(400, f"logit_bias's keys are token ids: {bias!s:.60}", "logit_bias")
        body["logit_bias"] = {  # each number clamped to [-100, 100], as vLLM's server does
            int(key): min(100, max(-100, v)) if type(v) in (int, float) and v == v else v
            for key, v in bias.items()
        }
    options = {k: v for k, v in body.get("stream_options", {}).items() if v is not None}
    flags = options.keys() <= STREAM_OPTIONS and all(type(v) is bool for v in options.values())
    if options and not (flags and body.get("stream")):
        why = "may hold include_usage and continuous_usage_stats (true or false), with stream"
        raise APIError(400, f"stream_options {why}; {json.dumps(options)}", "stream_options")
    model = body.setdefault("model", names[0])
    if model not in names:
        why = f"the model `{model}` does not exist: this server has {names[0]}"
        raise APIError(404, why, "model", "model_not_found")
    return {**body, "stream_options": options}


def sampling_params(body: dict, server: Server, prompts: list, max_tokens, logprobs) -> tuple:
    """The request's fields over the model's defaults (as vLLM's server), logprobs (k, and echo:
    the prompt's too); and its longest prompt's tokens (text not yet tokenized: 0)."""
    (limit, defaults), (k, echo) = (server.llm.max_model_len, server.defaults), logprobs
    ids = [p.get("prompt_token_ids") if isinstance(p, dict) else p for p in prompts]
    longest = max((len(p) for p in ids if isinstance(p, list)), default=0)  # text: the engine's
    if max_tokens is None:  # chat's default: what the context leaves, at most max_new_tokens
        unset = defaults.max_tokens == SamplingParams().max_tokens
        max_tokens = max(1, min(limit if unset else defaults.max_tokens, limit - longest))
    sampling = {name: body[name] for name in SAMPLING_FIELDS & body.keys()}
    sampling |= {"logprobs": k, "prompt_logprobs": k if echo else None}  # (SamplingParams checks k)
    params = replace(defaults, max_tokens=max_tokens, **sampling)
    if longest < limit < longest + max_tokens:  # as vLLM refuses it (a prompt past it: the engine)
        context = f"this model's context is {limit} tokens and a prompt has {longest}"
        give = f"give at most {limit - longest}"
        raise ValueError(f"max_tokens={max_tokens} is too large: {context}; {give}")
    return params, longest


def engine_fault(llm: LLM) -> str | None:
    """Why the engine cannot serve (None: it can), read without a word to the engine loop, as
    LLM.check_health waits behind the running step. The one place serve.py reads the LLM's insides:
    the executor's failure (set once the workers are gone), whether the loop's thread lives."""
    if (failure := getattr(llm.executor, "failure", None)) is not None:
        return f"tinytp's workers are gone ({failure})"
    return None if llm.engine_client.thread.is_alive() else "tinytp's engine loop has stopped"


class Handler(BaseHTTPRequestHandler):
    """One connection, one request (HTTP/1.0: a response, a stream's too, ends the connection)."""

    timeout = SOCKET_TIMEOUT
    disable_nagle_algorithm = True  # else each small event waits for the client's delayed ACK
    # an answer before the request line is understood (a 414) has a status line too
    default_request_version = request_version = "HTTP/1.0"
    server: Server
    # the request's logprobs (k, or None: not asked) and echo (and max_tokens 0: the prompt alone)
    top_logprobs, echo, echo_only = None, False, False

    def handle_one_request(self) -> None:
        """Every step of a request in one error boundary: a client's mistake is OpenAI's JSON error
        with its status (http.server's own too: send_error), a bug of ours a 500; never HTML."""
        self.streaming, self.allow, self.requestline = False, None, ""
        try:
            self.raw_requestline = self.rfile.readline(65537)
            if len(self.raw_requestline) > 65536:
                raise APIError(414, "the request line is longer than 65536 bytes")
            # none: closed unasked, or idle at a stop; parse_request false: it answered (send_error)
            if self.raw_requestline and self.parse_request():
                self.route()
        except APIError as e:
            self.send_error(e.status, e)
        except (ConnectionError, TimeoutError):
            self.log_message('"%s": the client went away', self.requestline)
        except Exception as e:  # a bug of ours, not the client's doing: a 500 and the traceback
            traceback.print_exc()
            if not self.streaming:
                self.send_body(500, APIError(500, f"{type(e).__name__}: {e}").body())

    def route(self) -> None:
        """The checks every request passes, in order; then its route's method, with its body."""
        path, host = self.path.split("?")[0], self.headers.get("Host", "")
        methods = ROUTES.get(path, {})
        self.allow = ", ".join([*methods, "OPTIONS"])  # sent on every answer
        key = self.headers.get("Authorization", "").removeprefix("Bearer ").encode()
        if len(self.requestline.split()) != 3:
            raise APIError(400, "HTTP/0.9 (a request line without a version): send HTTP/1.x")
        if len(self.headers.get_all("Host", [])) > 1:  # which one names us? (RFC 9112: a 400)
            raise APIError(400, f"send one Host header, not {self.headers.get_all('Host')}")
        if not self.server.host_allowed(host):
            raise APIError(421, f"Host {host!r}: not a loopback name (DNS rebinding?); see --host")
        # in constant time, no guessing the key by timing; a CORS preflight carries none
        api_key, preflight = self.server.args.api_key, self.command == "OPTIONS"
        wrong_key = api_key is not None and not hmac.compare_digest(key, api_key.encode())
        if path.startswith("/v1/") and not preflight and wrong_key:
            why = "a missing or wrong API key: give --api-key's in 'Authorization: Bearer KEY'"
            raise APIError(401, why, code="invalid_api_key")
        if not methods:
            raise APIError(404, f"no route {path}: tinytp serves {', '.join(ROUTES)}")
        if preflight:
            return self.preflight()
        if self.command not in methods:
            raise APIError(405, f"{path} takes {' or '.join(methods)}, not {self.command}")
        answer, fields = methods[self.command]
        body = None if fields is None else self.read_body(fields)
        with self.server.lock:  # all read: no deadline from here on (unless it was cut first)
            state = self.server.connections[self.request]
            state[0], cut = None, state[1]
        if cut:
            raise cut
        getattr(self, answer)(body)

    def send_error(self, code: int, message: str | APIError | None = None, explain=None) -> None:
        """Every error's answer, http.server's own too (431, 505): OpenAI's JSON, or mid-stream an
        event and the end; a request cut while being read gets why (408, or 503 at a stop)."""
        if not isinstance(message, APIError):
            reason = message or HTTPStatus(code).phrase
            message = APIError(code, f"{reason}: {explain}" if explain else reason)
        error = self.server.connections.get(self.request, [None, None])[1] or message
        self.log_message('"%s": %s %s', self.requestline, error.status, error)
        if self.streaming:
            self.send_event(error.body())
            self.send_event("[DONE]")
        else:
            self.send_body(error.status, error.body())

    def send_head(self, status: int, kind: str | None, length: int | None, headers=None) -> None:
        self.send_response(status)  # (length None: to the close)
        fixed = {"Content-Type": kind, "Content-Length": length, "Allow": self.allow}
        for name, value in {**fixed, **(headers or {}), **self.cors_headers()}.items():
            if value is not None:  # (a None: not sent)
                self.send_header(name, str(value))
        self.end_headers()

    def send_body(self, status: int, obj: dict | str, kind: str = "application/json") -> None:
        data = (obj if isinstance(obj, str) else json.dumps(obj)).encode()  # (a str: as it is)
        self.send_head(status, kind, len(data))
        self.wfile.write(data)

    def cors_headers(self) -> dict:
        """An allowed origin's CORS headers, as vLLM's; none for others: their pages see nothing."""
        origin, args = (getattr(self, "headers", None) or {}).get("Origin"), self.server.args
        if origin is None or not any(p.fullmatch(origin) for p in self.server.origins):
            return {}
        if "*" in args.allowed_origins and not args.allow_credentials:
            return {ACA + "Origin": "*"}
        credentials = "true" if args.allow_credentials else None
        return {ACA + "Origin": origin, ACA + "Credentials": credentials, "Vary": "Origin"}

    def preflight(self) -> None:
        """OPTIONS: to a CORS preflight from an allowed origin, what its page may send (the browser
        holds it to that); to any other, the route's methods only."""
        args, asked = self.server.args, self.headers.get("Access-Control-Request-Headers")
        method = self.headers.get("Access-Control-Request-Method")
        methods = method if "*" in args.allowed_methods else ", ".join(args.allowed_methods)
        names = asked if "*" in args.allowed_headers else ", ".join(args.allowed_headers)
        cors = {ACA + "Methods": methods, ACA + "Headers": names, "Access-Control-Max-Age": 600}
        self.send_head(204, None, None, cors if method and self.cors_headers() else {})

    def read_body(self, honoured: set[str]) -> dict:
        """The body, read to its Content-Length, then parsed and checked (parse_body)."""
        lengths = self.headers.get_all("Content-Length", [])
        length = lengths[0].strip() if lengths else ""
        if "Transfer-Encoding" in self.headers or not lengths:
            raise APIError(411, "a POST needs a Content-Length header (not Transfer-Encoding)")
        if len(set(lengths)) > 1 or not (length.isascii() and length.isdigit()):
            raise APIError(400, f"Content-Length must be one number of bytes, got {lengths}")
        if int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}")
        data = self.rfile.read(int(length))
        if len(data) < int(length):
            raise APIError(400, f"the body ended after {len(data)} of its {length} bytes")
        return parse_body(data, self.headers.get("Content-Type", ""), honoured, self.server.names)

    def models(self, _) -> None:
        about = {"object": "model", "created": int(time.time()), "owned_by": "tinytp"}
        about |= {"root": self.server.llm.model_dir, "max_model_len": self.server.llm.max_model_len}
        data = [{"id": name, **about} for name in self.server.names]
        self.send_body(200, {"object": "list", "data": data})

    def health(self, _) -> None:
        """/health, /ping: 200 or 503 naming why, from engine_fault: never queued behind a step."""
        stopping = self.server.stopping.is_set() and "the server is shutting down"
        if fault := engine_fault(self.server.llm) or stopping:
            raise APIError(503, fault)
        self.send_head(200, "text/plain", 0)

    def version(self, _) -> None:
        self.send_body(200, {"version": VERSION})

    def metrics(self, _) -> None:
        """vLLM's GET /metrics: LLM.get_metrics() as Prometheus text (a counter's: name_total)."""
        text, labels = "", f'{{model_name="{self.server.names[0]}"}}'
        for metric in self.server.llm.get_metrics():
            kind, suffix = ("counter", "_total") if isinstance(metric, Counter) else ("gauge", "")
            text += f"# TYPE {metric.name} {kind}\n{metric.name}{suffix}{labels} {metric.value}\n"
        self.send_body(200, text, "text/plain; version=0.0.4")

    def completions(self, body: dict) -> None:
        # a string, a list of token ids, or a list of either (the engine checks each)
        prompt = body.get("prompt")
        many = isinstance(prompt, list) and prompt and all(type(p) in (str, list) for p in prompt)
        prompts = prompt if many else [prompt]
        if not all(isinstance(p, (str, list)) for p in prompts):
            words = "a string, a list of strings, a list of token ids or a list of such lists"
            raise APIError(400, f"prompt must be {words}, got {json.dumps(prompt)}", "prompt")
        # text tokenized as the engine would, its length known now ("", no tokenizer: the engine's);
        # truncate_prompt_tokens by the tokenizer, on the left (BOS kept), as vLLM's server does
        k = body.get("truncate_prompt_tokens")
        cut = {"truncation": True, "max_length": k} if type(k) is int and k > 0 else {}
        for i, p in enumerate(prompts):
            if isinstance(p, str) and p and (tokenizer := self.server.llm.tokenizer):
                prompts[i] = {"prompt": p, "prompt_token_ids": tokenizer(p, **cut).input_ids}
        # echo: the prompt's text (and logprobs) first; max_tokens 0: alone (vLLM samples one token)
        max_tokens, self.echo = body.get("max_tokens", COMPLETIONS_MAX_TOKENS), body.get("echo", 0)
        self.echo_only, self.top_logprobs = self.echo and max_tokens == 0, body.get("logprobs")
        self.generate(body, salted(prompts, body), 1 if self.echo_only else max_tokens, chat=False)

    def chat(self, body: dict) -> None:
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        asked, k = body.get("logprobs", False), body.get("top_logprobs")
        if type(asked) is not bool or k is not None and not asked:
            raise APIError(400, "logprobs must be a boolean (true for top_logprobs)", "logprobs")
        self.top_logprobs = (k or 0) if asked else None
        self.generate(body, salted([self.chat_prompt(body)], body), max_tokens, chat=True)

    def chat_prompt(self, body: dict) -> dict:
        """The messages through the chat template: {"prompt", "prompt_token_ids"}."""
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(type(m) is dict for m in messages)):
            raise APIError(400, "messages must be a non-empty list of message objects", "messages")
        try:  # a template may refuse a conversation (roles out of order): the client's doing
            return self.server.llm.chat_prompt(messages, None, body.get("add_generation_prompt", 1))
        except Exception as e:
            raise APIError(400, f"messages: {type(e).__name__}: {e}", "messages") from None

    def tokenizer(self):
        if self.server.llm.tokenizer is None:
            raise APIError(400, f"{self.server.names[0]} has no tokenizer: it takes token ids")
        return self.server.llm.tokenizer

    def tokenize(self, body: dict) -> None:
        """vLLM's /tokenize: a prompt's token ids (add_special_tokens, default true: BOS), or
        messages' through the chat template (which writes them: add_special_tokens false only)."""
        tokenizer, chat = self.tokenizer(), "messages" in body
        if chat == ("prompt" in body) or not (chat or isinstance(body["prompt"], str)):
            raise APIError(400, "give a prompt (a string) or messages, one of the two", "prompt")
        if body.get("add_special_tokens") if chat else "add_generation_prompt" in body:
            why = "add_special_tokens=true goes with a prompt, add_generation_prompt with messages"
            raise APIError(400, f"{why} (whose chat template writes the special tokens)")
        special = body.get("add_special_tokens", True)
        text = None if chat else tokenizer(body["prompt"], add_special_tokens=special)
        ids = text.input_ids if text else self.chat_prompt(body)["prompt_token_ids"]
        strings = tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
        answer = {"count": len(ids), "max_model_len": self.server.llm.max_model_len}
        self.send_body(200, {**answer, "tokens": ids, "token_strs": strings})

    def detokenize(self, body: dict) -> None:
        """vLLM's /detokenize: token ids to text, special tokens written out (as vLLM's)."""
        tokenizer, tokens, size = self.tokenizer(), body.get("tokens"), len(self.tokenizer())
        if not (isinstance(tokens, list) and all(type(t) is int and 0 <= t < size for t in tokens)):
            raise APIError(400, f"tokens must be a list of ids from 0 to {size - 1}", "tokens")
        self.send_body(200, {"prompt": tokenizer.decode(tokens)})

    def client_left(self) -> bool:
        """Whether the client closed its connection: readable, nothing to read, or reset."""
        try:
            readable = select.select([self.connection], [], [], 0)[0]
            return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    def generate(self, body: dict, prompts: list, max_tokens: int | None, chat: bool) -> None:
        """Run the prompts with the request's fields over the model's defaults (as vLLM's server),
        and answer with their completions, whole or streamed."""
        try:  # every value checked as SamplingParams checks it, and every prompt before any runs
            logprobs = self.top_logprobs, self.echo
            params, longest = sampling_params(body, self.server, prompts, max_tokens, logprobs)
            outputs = self.server.llm.stream_outputs(prompts, params)
        except ValueError as e:  # SamplingParams names the field first
            name = str(e).split()[0].split("=")[0]
            raise APIError(400, str(e), name if name in body else None) from None
        stream, options = body.get("stream", False), body["stream_options"]
        # Usage in a stream: with include_usage (OpenAI's), "usage": null on each chunk and the
        # total at the end; with continuous_usage_stats too (vLLM's), each chunk its choice's.
        each = options.get("continuous_usage_stats")
        self.usage_in_chunks = options.get("include_usage") and ("so far" if each else "null")
        kind = "text_completion" if not chat else f"chat.completion{'.chunk' * stream}"
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "object": kind}
        head |= {"created": int(time.time()), "model": body["model"]}
        # each prompt's latest output; what each choice (index * n + sample) has sent (choices)
        final, sent = [], {}
        # on the way out: a client gone (client_left, a write failed) aborts what still runs
        with contextlib.closing(outputs):
            try:
                if stream:  # server-sent events from here on; a chat's first name the role
                    self.send_head(200, "text/event-stream", None)
                    self.streaming, role = True, {"role": "assistant", "content": ""}
                    for number in range(params.n if chat else 0):
                        piece = {"index": number, "delta": role, "logprobs": None}
                        self.send_chunk(head, {**piece, "finish_reason": None}, longest, 0)
                for final in outputs:
                    if self.client_left():  # within a step of its leaving, streamed or not
                        raise ConnectionResetError
                    for piece in self.choices(final, sent, params.n, chat, True) if stream else []:
                        self.send_chunk(head, *piece)
            except ValueError as e:  # this request's logits became inf or NaN: it alone failed
                raise APIError(400, str(e)) from None
            # the workers died, or the server stops (it shuts the engine down)
            except RuntimeError as e:
                stopping = self.server.stopping.is_set() and "the server is shutting down"
                raise APIError(503, self.server.failure or stopping or str(e)) from None
        # logged before the answer ends: a client that has it finds it in the log
        out, stats = usage(final)["completion_tokens"], self.server.llm.stats()
        numbers = len(prompts), out, stats["steps"], stats["largest_batch"]
        self.log_message(GENERATED, self.requestline, *numbers)
        if stream:
            if self.usage_in_chunks:
                self.send_event({**head, "choices": [], "usage": usage(final)})
            self.send_event("[DONE]")
        else:
            choices = [piece for piece, _, _ in self.choices(final, {}, params.n, chat, False)]
            self.send_body(200, {**head, "choices": choices, "usage": usage(final)})

    def choices(self, outputs: list, sent: dict, n: int, chat: bool, stream: bool) -> Iterator:
        """Each choice that has a token or an end since `sent` (characters, end, tokens sent, by
        number; updated): its new text ("" in half of a character, as vLLM's chunk) and logprobs,
        its prompt's and its own tokens."""
        for index, output in enumerate(outputs):
            for c in output.outputs:
                text, tokens, entries = c.text, c.token_ids, c.logprobs or []
                if self.echo_only:  # (a token was generated: vLLM's way to score a prompt)
                    text, tokens, entries = "", [], []
                if self.echo:  # the prompt's first (given as ids: its text decoded)
                    prompt = output.prompt or self.tokenizer().decode(output.prompt_token_ids)
                    text, tokens = prompt + text, output.prompt_token_ids + tokens
                    entries = [*(output.prompt_logprobs or []), *entries]
                number = index * n + c.index
                characters, ended, num_tokens = sent.get(number, (0, None, 0))
                if (len(text), c.finish_reason, len(tokens)) != (characters, ended, num_tokens):
                    new, logprobs = (tokens[num_tokens:], entries[num_tokens:]), None
                    if self.top_logprobs is not None and chat:
                        logprobs = chat_logprobs(*new, self.top_logprobs)
                    elif self.top_logprobs is not None:
                        logprobs = completion_logprobs(*new, characters, self.tokenizer())
                    piece = choice(number, c, text[characters:], logprobs, chat, stream)
                    sent[number] = len(text), c.finish_reason, len(tokens)
                    yield piece, len(output.prompt_token_ids), len(c.token_ids)

    def send_chunk(self, head: dict, piece: dict, prompt_tokens: int, tokens: int) -> None:
        """A stream's chunk of one choice, with the usage asked for (usage_in_chunks)."""
        so_far = counts(prompt_tokens, tokens) if self.usage_in_chunks == "so far" else None
        usage_field = {"usage": so_far} if self.usage_in_chunks else {}
        self.send_event({**head, "choices": [piece], **usage_field})

    def send_event(self, data: dict | str) -> None:
        text = data if isinstance(data, str) else json.dumps(data)
        self.wfile.write(f"data: {text}\n\n".encode())


class Server(ThreadingHTTPServer):
    # a thread per connection, up to MAX_CONNECTIONS; daemons: no client keeps the process alive
    daemon_threads, block_on_close = True, False
    request_queue_size = MAX_CONNECTIONS  # the listen backlog: a burst of clients waits its turn

    def __init__(self, args: argparse.Namespace):
        super().__init__((args.host, args.port), Handler, bind_and_activate=False)
        # the port taken now (one in use: said before the model loads); listened on once it is up
        self.server_bind()
        self.args, self.names = args, args.served_model_name or [args.model or "tiny-llama"]
        self.loopback = ipaddress.ip_address(self.server_address[0]).is_loopback  # Host checked
        # --allowed-origins' patterns: each * any characters, nothing else special
        self.origins = [re.compile(re.escape(o).replace(r"\*", ".*")) for o in args.allowed_origins]
        self.stopping, self.failure, self.lock = threading.Event(), None, threading.Lock()
        # each open connection: [when its request must be in (None once it is), why it was cut]
        self.connections: dict[socket.socket, list] = {}

    def host_allowed(self, host: str) -> bool:
        """On loopback, a Host must be localhost or a loopback address (none at all: no page's)."""
        if not (self.loopback and host):
            return True
        name = host if host.endswith("]") else host.rpartition(":")[0] or host
        with contextlib.suppress(ValueError):
            return ipaddress.ip_address(name.strip("[]")).is_loopback
        return name == "localhost"

    def process_request(self, request, client_address) -> None:
        with self.lock:
            if len(self.connections) < MAX_CONNECTIONS:
                self.connections[request] = [time.monotonic() + READ_TIMEOUT, None]
                return super().process_request(request, client_address)  # a thread of its own
        # beyond the cap: a 503 from this thread, what came read first (closing on it would reset)
        data = json.dumps(APIError(503, f"{MAX_CONNECTIONS} connections open: try again").body())
        with contextlib.suppress(OSError):
            if select.select([request], [], [], 0)[0]:
                request.recv(1 << 16)
            head = "HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            request.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n{data}".encode())
        self.shutdown_request(request)

    def shutdown_request(self, request) -> None:  # a connection's end
        with self.lock:
            self.connections.pop(request, None)
        super().shutdown_request(request)

    def cut_readers(self, error: APIError, everyone: bool = False) -> None:
        """Shut the reading side of each connection reading its request past its deadline (or at
        all), to be answered `error`: its read ends at once, the answer goes out; idle ones end."""
        with self.lock:
            for request, state in self.connections.items():
                if state[0] is not None and (everyone or time.monotonic() > state[0]):
                    state[:] = [None, error]
                    with contextlib.suppress(OSError):
                        request.shutdown(socket.SHUT_RD)

    def handle_error(self, request, client_address) -> None:  # a client gone is no error of ours
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def watch_workers(self) -> None:
        """llm.check_health() (which waits behind a running step) on a thread: a death stops us."""
        while not self.stopping.wait(POLL_SECONDS):
            try:
                self.llm.check_health()
            except RuntimeError as e:  # (a stop of ours shuts the workers down too)
                self.failure = self.failure or (None if self.stopping.is_set() else str(e))
                self.stopping.set()

    def serve(self, llm: LLM) -> int:
        """Answer requests until Ctrl-C, SIGTERM (the workers leave one sent to the group to us) or
        the workers' death; then, within seconds whatever the clients do: stop accepting, cut the
        requests being read, end those in flight (503), give answers STOP_GRACE s; exit 0 or 1."""
        self.llm, self.defaults = llm, llm.get_default_sampling_params()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stopping.set())
        # listening from here on: nothing is accepted before the workers are up
        self.server_activate()
        threading.Thread(target=self.serve_forever, args=(POLL_SECONDS,), daemon=True).start()
        threading.Thread(target=self.watch_workers, daemon=True).start()
        host, port = self.server_address[:2]
        print(f"tinytp: serving {self.names[0]} at http://{host}:{port}/v1", flush=True)
        slow = APIError(408, f"the request was not all in within {READ_TIMEOUT:g} s")
        while not self.stopping.wait(POLL_SECONDS):
            self.cut_readers(slow)
        # more signals change nothing, up to the exit: ignored, not left to our handler, which
        # the interpreter's exit resets to the default (a late Ctrl-C would end us by SIGINT)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        self.shutdown()  # no more connections
        self.cut_readers(APIError(503, "the server is shutting down"), everyone=True)
        # the requests in flight end: each gets the engine's RuntimeError, and answers a 503
        llm.shutdown()
        deadline = time.monotonic() + STOP_GRACE
        while self.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.lock:  # a client that does not read its answer has had its time
            for request in self.connections:
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)
        print(f"tinytp: {self.failure or 'stopped'}", file=sys.stderr)
        return 1 if self.failure else 0


def names(text: str) -> list[str]:
    """A CORS flag's value: vLLM's JSON list ('["https://app.example"]'), or names and commas."""
    value = json.loads(text) if text.startswith("[") else text.split(",")
    if not all(isinstance(name, str) for name in value):
        raise ValueError(text)  # (argparse says which flag, and the value)
    return value


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve.py", description=__doc__.split("\n")[0])
    add = parser.add_argument
    tinytp.add_engine_flags(parser)  # --model, --tp and the rest, as tinytp.py's
    add("--host", default="127.0.0.1", help="0.0.0.0: every interface (give --api-key)")
    add("--port", type=int, default=8000, help="0: one the OS picks")
    add("--served-model-name", nargs="+", help="the model's name(s) in the API (default: --model)")
    add("--api-key", help="refuse requests without 'Authorization: Bearer API_KEY'")
    cors = {"type": names, "help": "CORS (docs/api.md): a JSON list, or names and commas"}
    add("--allowed-origins", default=LOOPBACK_ORIGINS, **cors)  # patterns, as http://localhost:*
    add("--allowed-methods", default=["*"], **cors)
    add("--allowed-headers", default=["*"], **cors)
    add("--allow-credentials", action="store_true", help="CORS: cookies and auth headers too")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # while loading, SIGTERM stops us as Ctrl-C does
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        warning = f"serving on {args.host} without --api-key: anyone who reaches it can use it"
        print(f"tinytp: warning: {warning}", file=sys.stderr)
    try:
        server = Server(args)
    except (OSError, OverflowError) as e:  # in use, not ours to take; a port past 65535
        reason = getattr(e, "strerror", None) or e
        print(f"tinytp: error: cannot listen at {args.host}:{args.port}: {reason}", file=sys.stderr)
        return 2

    def load_and_serve() -> int:
        with LLM(args.model, **tinytp.engine_arguments(args)) as llm:
            return server.serve(llm)

    try:  # a worker dead while loading, /dev/shm full: 1, not the user's doing (tinytp.exit_code)
        return tinytp.exit_code(load_and_serve)
    finally:
        server.server_close()


if __name__ == "__main__":
    sys.exit(main())
