"""An OpenAI-compatible HTTP server on tinytp's engine, as `vllm serve` is on vLLM's: `python serve.py --model M`.

A front end only: an HTTP request becomes engine requests (`LLM.stream_outputs`, one per prompt), whose outputs
reach the thread answering the client through a queue per request, so a slow client never holds up the engine; they
go back as one JSON body or as server-sent events. Many clients share the engine's running batch; a client that goes
away has its requests aborted. Standard library only. Endpoints, fields, what is refused: docs/api.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import queue
import select
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

from tinytp import LLM, RequestOutput, SamplingParams

MAX_BODY_BYTES = 16 << 20  # a larger request body is refused (413) without being read
SOCKET_TIMEOUT = 60.0  # a client that neither sends nor reads for this long is dropped
POLL_SECONDS = 0.2  # how often a request waiting for the engine looks at its client and the server
HEALTH_SECONDS = 0.5  # how often the main thread asks the engine whether its workers live

# The request fields honoured, as OpenAI and vLLM define them; the sampling ones go to SamplingParams as they are.
SAMPLING_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos"}
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "user", *SAMPLING_FIELDS}  # user: an id, unused
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "add_generation_prompt"}
# Fields that would change the output, accepted only at the value that changes nothing. Any other field is refused
# by name too: exact or refuse. (A null is OpenAI's "not given" for every field.)
NEUTRAL_VALUES = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "logprobs": False,
                  "top_logprobs": 0, "echo": False, "logit_bias": {}, "suffix": "", "tools": [],
                  "response_format": {"type": "text"}, "min_tokens": 0}
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions; chat's: what the context leaves


class APIError(Exception):
    """An answer in OpenAI's error shape: the HTTP status, the message, the field at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def is_neutral(value, neutral) -> bool:
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)  # 0 is not False here


def check_fields(body: dict, honoured: set[str]) -> None:
    for name, value in body.items():
        if name in NEUTRAL_VALUES and not is_neutral(value, NEUTRAL_VALUES[name]):
            raise APIError(400, f"{name}={json.dumps(value)}: tinytp does not support {name} (only "
                                f"{json.dumps(NEUTRAL_VALUES[name])}, which changes nothing)", name)
        if name not in honoured and name not in NEUTRAL_VALUES:
            raise APIError(400, f"tinytp does not support {name}; it honours {', '.join(sorted(honoured))}", name)
    for name, kind, what in [("stream", bool, "true or false"), ("stream_options", dict, "an object"),
                             ("add_generation_prompt", bool, "true or false"), ("user", str, "a string")]:
        if name in body and not isinstance(body[name], kind):
            raise APIError(400, f"{name} must be {what}, got {json.dumps(body[name])}", name)
    options = body.get("stream_options", {})
    if options and not body.get("stream"):
        raise APIError(400, "stream_options is for streamed requests: give stream=true too", "stream_options")
    if options.keys() - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise APIError(400, f"stream_options may hold include_usage (true or false), got {json.dumps(options)}",
                       "stream_options")


def completion_prompts(prompt) -> list:
    """/v1/completions' prompt: a string, a list of strings, a list of token ids, or a list of such lists."""
    one = lambda p: isinstance(p, str) or isinstance(p, list) and p and all(type(t) is int for t in p)  # noqa: E731
    if one(prompt) or isinstance(prompt, list) and prompt and all(map(one, prompt)):
        return [prompt] if one(prompt) else prompt
    raise APIError(400, "prompt must be a string, a list of strings, a list of token ids or a list of such lists",
                   "prompt")


def pump(stream: Iterator[RequestOutput], index: int, arrivals: queue.Queue, done: threading.Event) -> None:
    """Move one prompt's outputs from the engine to its request's queue, then None; closing the stream (when the
    request is done with it, or at its end) aborts it in the engine if it is still running."""
    try:
        for output in stream:
            arrivals.put((index, output))
            if done.is_set():
                break
    except Exception as e:  # the workers died: the request's thread answers with it
        arrivals.put((index, e))
    finally:
        stream.close()
        arrivals.put((index, None))


def client_gone(connection: socket.socket) -> bool:
    """A closed connection reads as readable and empty (a client sends nothing more while it waits)."""
    poller = select.poll()  # not select.select: it fails on descriptors past 1023
    poller.register(connection, select.POLLIN)
    if not poller.poll(0):
        return False
    with contextlib.suppress(OSError):
        return not connection.recv(1, socket.MSG_PEEK)
    return True  # reset


class Handler(BaseHTTPRequestHandler):
    """One connection, one request (HTTP/1.0: the response, a stream's too, ends with the connection)."""
    timeout = SOCKET_TIMEOUT
    disable_nagle_algorithm = True  # else each small event waits for the client's delayed acknowledgement
    server: Server

    def do_GET(self) -> None:  # and do_POST: one router for both
        routes = {"/v1/models": ("GET", self.models), "/health": ("GET", self.health),
                  "/v1/completions": ("POST", self.completions), "/v1/chat/completions": ("POST", self.chat)}
        path, start = self.path.split("?")[0], time.monotonic()
        self.status, self.note, self.streaming = "-", "", False
        try:
            if path.startswith("/v1/"):
                self.check_api_key()
            if path not in routes:
                raise APIError(404, f"no route {path}: tinytp serves {', '.join(routes)}")
            if routes[path][0] != self.command:
                raise APIError(405, f"{path} takes {routes[path][0]}, not {self.command}")
            routes[path][1]()
        except APIError as e:
            self.send_json(e.status, e.body())
        except (ConnectionError, TimeoutError):
            self.note = "the client went away"
        except Exception as e:  # a bug of ours, not the client's doing: a 500 and the traceback
            traceback.print_exc()
            if not self.streaming:
                self.send_json(500, APIError(500, f"{type(e).__name__}: {e}").body())
        self.log_message('"%s" %s %.2f s %s', self.requestline, self.status, time.monotonic() - start, self.note)

    do_POST = do_GET

    def log_request(self, code="-", size="-") -> None:  # send_response's log line: dispatch writes one at the end
        self.status = code

    def check_api_key(self) -> None:
        if self.server.api_key is None:
            return
        given = self.headers.get("Authorization", "").removeprefix("Bearer ").encode()
        if not hmac.compare_digest(given, self.server.api_key.encode()):  # in constant time: no guessing by timing
            raise APIError(401, "a missing or wrong API key: give --api-key's in 'Authorization: Bearer KEY'",
                           code="invalid_api_key")

    def send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def read_body(self) -> dict:
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            raise APIError(411, "a POST needs a Content-Length header and a JSON body")
        if int(length) > MAX_BODY_BYTES:
            raise APIError(413, f"the body has {length} bytes; the limit is {MAX_BODY_BYTES}")
        try:
            body = json.loads(self.rfile.read(int(length)))
        except ValueError as e:  # bad JSON, or not UTF-8
            raise APIError(400, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, f"the body must be a JSON object, got {type(body).__name__}")
        body = {name: value for name, value in body.items() if value is not None}
        model = body.get("model", self.server.names[0])
        if not isinstance(model, str):
            raise APIError(400, f"model must be a string, got {json.dumps(model)}", "model")
        if model not in self.server.names:
            raise APIError(404, f"the model `{model}` does not exist: this server has {self.server.names[0]}",
                           "model", "model_not_found")
        return body

    def models(self) -> None:
        self.send_json(200, {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.server.started, "owned_by": "tinytp",
             "root": self.server.llm.model_dir, "max_model_len": self.server.llm.max_model_len}
            for name in self.server.names]})

    def health(self) -> None:
        try:
            self.server.llm.check_health()
        except RuntimeError as e:
            raise APIError(503, str(e)) from None
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def completions(self) -> None:
        body = self.read_body()
        check_fields(body, COMPLETION_FIELDS)
        if "prompt" not in body:
            raise APIError(400, "prompt is required", "prompt")
        llm = self.server.llm
        # Text prompts are tokenized here, as the engine would, so that their lengths are known now.
        prompts = [{"prompt": p, "prompt_token_ids": llm.tokenizer(p).input_ids} if isinstance(p, str) and p
                   and llm.tokenizer else p for p in completion_prompts(body["prompt"])]
        self.generate(body, prompts, body.get("max_tokens", COMPLETIONS_MAX_TOKENS), chat=False)

    def chat(self) -> None:
        body = self.read_body()
        check_fields(body, CHAT_FIELDS)
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)):
            raise APIError(400, "messages must be a non-empty list of objects ({\"role\", \"content\"})", "messages")
        try:  # a template may refuse a conversation (roles out of order, a missing content): the client's doing
            prompt = self.server.llm.chat_prompt(messages, add_generation_prompt=body.get("add_generation_prompt",
                                                                                         True))
        except Exception as e:
            raise APIError(400, f"messages: {type(e).__name__}: {e}", "messages") from None
        self.generate(body, [prompt], body.get("max_completion_tokens", body.get("max_tokens")), chat=True)

    def sampling_params(self, body: dict, max_tokens: int | None, prompt_lengths: list[int]) -> SamplingParams:
        """The model's defaults (generation_config.json), as in vLLM's server, with the request's fields over them.
        max_tokens: the request's, refused past the context (as vLLM does); not given, what the context leaves."""
        defaults, limit = self.server.defaults, self.server.llm.max_model_len
        try:
            params = replace(defaults, **{name: body[name] for name in SAMPLING_FIELDS & body.keys()})
            if max_tokens is None:  # chat only; capped by generation_config.json's max_new_tokens where it gives one
                # (SamplingParams' own default, 16, reads as none given).
                cap = defaults.max_tokens if defaults.max_tokens != SamplingParams().max_tokens else limit
                return replace(params, max_tokens=max(1, min(cap, limit - max(prompt_lengths))))
            params = replace(params, max_tokens=max_tokens)
        except ValueError as e:  # SamplingParams names the field first
            raise APIError(400, str(e), str(e).split()[0] if str(e).split()[0] in body else None) from None
        too_long = [n for n in prompt_lengths if n < limit < n + max_tokens]  # a prompt past limit: the engine says
        if too_long:
            raise APIError(400, f"max_tokens={max_tokens} is too large: this model's context is {limit} tokens and "
                                f"the prompt has {too_long[0]}; give at most {limit - too_long[0]}", "max_tokens")
        return params

    @contextlib.contextmanager
    def engine_outputs(self, prompts: list, params: SamplingParams) -> Iterator[Iterator[tuple[int, RequestOutput]]]:
        """Run the prompts in the engine; yield an iterator of (prompt index, output) as they come. Every prompt is
        checked before any runs (a 400); leaving the block, early or not, stops those still running."""
        streams = []
        try:
            for prompt in prompts:
                streams.append(self.server.llm.stream_outputs(prompt, params))
        except ValueError as e:  # a prompt or a value the engine refuses
            for stream in streams:
                stream.close()
            raise APIError(400, str(e)) from None
        arrivals, done = queue.Queue(), threading.Event()
        for index, stream in enumerate(streams):
            threading.Thread(target=pump, args=(stream, index, arrivals, done), daemon=True).start()
        try:
            yield self.merged(arrivals, len(streams))
        finally:
            done.set()

    def merged(self, arrivals: queue.Queue, unfinished: int) -> Iterator[tuple[int, RequestOutput]]:
        while unfinished:
            with contextlib.suppress(queue.Empty):
                index, output = arrivals.get(timeout=POLL_SECONDS)
                if isinstance(output, Exception):
                    raise APIError(503, str(output))
                if output is None:
                    unfinished -= 1
                else:
                    yield index, output
            if self.server.stopping.is_set():
                raise APIError(503, self.server.failure or "the server is shutting down")
            if client_gone(self.connection):  # its requests are aborted, and nobody is answered
                raise ConnectionAbortedError

    def generate(self, body: dict, prompts: list, max_tokens: int | None, chat: bool) -> None:
        lengths = [len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p) if isinstance(p, list) else 0
                   for p in prompts]  # a text prompt not tokenized here ("", no tokenizer) is refused by the engine
        params = self.sampling_params(body, max_tokens, lengths)
        stream = body.get("stream", False)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": ("chat.completion.chunk" if stream else "chat.completion") if chat else "text_completion",
                "created": int(time.time()), "model": body.get("model", self.server.names[0])}
        final: dict[int, RequestOutput] = {}  # each prompt's latest output
        with self.engine_outputs(prompts, params) as outputs:
            if stream:
                self.stream_events(head, outputs, final, params.n, chat, body.get("stream_options", {}))
            else:
                for index, output in outputs:
                    final[index] = output
                choices = [choice(index * params.n + c.index, c, chat) for index in sorted(final)
                           for c in final[index].outputs]
                self.send_json(200, {**head, "choices": choices, "usage": usage(final)})
        stats = self.server.llm.stats()
        self.note += (f"{len(prompts)} prompt(s), {usage(final)['completion_tokens']} tokens out (engine: "
                      f"{stats['steps']} steps so far, at most {stats['largest_batch']} requests in one)")

    def stream_events(self, head: dict, outputs: Iterator[tuple[int, RequestOutput]], final: dict[int, RequestOutput],
                      n: int, chat: bool, options: dict) -> None:
        """Server-sent events: a chunk per choice whose text grew or that ended, then usage if asked, then [DONE]."""
        usage_field = {"usage": None} if options.get("include_usage") else {}  # null but in the last, as OpenAI's
        self.start_events()
        for number in range(n if chat else 0):  # the role first, as OpenAI's chat stream does
            self.send_event({**head, "choices": [{"index": number, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}], **usage_field})
        sent: dict[int, int] = {}  # characters sent of each choice (index * n + sample)
        ended: set[int] = set()
        try:
            for index, output in outputs:
                final[index] = output
                for c in output.outputs:
                    number = index * n + c.index
                    piece = c.text[sent.get(number, 0):]
                    if number not in ended and (piece or c.finish_reason):
                        self.send_event({**head, "choices": [choice(number, c, chat, piece)], **usage_field})
                        sent[number] = len(c.text)
                        if c.finish_reason:
                            ended.add(number)
            if usage_field:
                self.send_event({**head, "choices": [], "usage": usage(final)})
        except APIError as e:  # the workers died, or the server is stopping: the client hears why
            self.send_event(e.body())
            self.note = f"{e}; "
        self.send_event("[DONE]")

    def start_events(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.streaming = True

    def send_event(self, data: dict | str) -> None:
        self.wfile.write(f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode())


def usage(final: dict[int, RequestOutput]) -> dict:
    prompt = sum(len(output.prompt_token_ids) for output in final.values())  # once per prompt, whatever n is
    completion = sum(len(c.token_ids) for output in final.values() for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def choice(index: int, completion, chat: bool, piece: str | None = None) -> dict:
    """A choice in a response (piece None: the whole text) or in a stream's chunk (the text's new piece)."""
    if piece is None:
        text = {"message": {"role": "assistant", "content": completion.text}} if chat else {"text": completion.text}
    else:
        text = {"delta": {"content": piece} if piece else {}} if chat else {"text": piece}
    return {"index": index, **text, "logprobs": None, "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason}


class Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() waits for the requests in flight

    def __init__(self, address: tuple[str, int], names: list[str], api_key: str | None):
        super().__init__(address, Handler, bind_and_activate=False)
        try:  # the port is taken now (one in use is said before the model loads), but listened on once it is up
            self.server_bind()
        except OSError:
            self.server_close()
            raise
        self.names, self.api_key, self.started = names, api_key, int(time.time())
        self.stopping, self.failure = threading.Event(), None

    def handle_error(self, request, client_address) -> None:  # a client that vanished is no error of ours
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def serve(self, llm: LLM) -> int:
        """Answer requests until Ctrl-C, SIGTERM or the workers' death; then stop accepting, end the requests in
        flight (a 503, or an error event in a stream) and return the exit status."""
        self.llm, self.defaults = llm, llm.get_default_sampling_params()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stopping.set())
        self.server_activate()  # listening from here on: nothing is accepted before the workers are up
        threading.Thread(target=self.serve_forever, args=(POLL_SECONDS,), daemon=True).start()
        host, port = self.server_address[:2]
        print(f"tinytp: serving {self.names[0]} at http://{host}:{port}/v1", flush=True)
        while not self.stopping.wait(HEALTH_SECONDS):
            try:
                llm.check_health()
            except RuntimeError as e:
                self.failure = str(e)
                self.stopping.set()
        self.shutdown()
        self.server_close()  # waits for the requests in flight: each sees `stopping` within POLL_SECONDS
        print(f"tinytp: {self.failure or 'stopped'}", file=sys.stderr)
        return 1 if self.failure else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve.py", description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint directory or hub id (default: a tiny random Llama)")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="number of ranks")
    parser.add_argument("--host", default="127.0.0.1", help="0.0.0.0: every interface (give --api-key)")
    parser.add_argument("--port", type=int, default=8000, help="0: one the OS picks")
    parser.add_argument("--served-model-name", nargs="+", help="the model's name(s) in the API (default: --model)")
    parser.add_argument("--api-key", help="refuse requests without 'Authorization: Bearer API_KEY'")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda where GPUs are visible, else cpu")
    parser.add_argument("--async-scheduling", action="store_true", help="schedule a step while the last one runs")
    args = parser.parse_args(argv)
    if not 0 <= args.port < 65536:
        parser.error(f"--port must be in 0..65535, got {args.port}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # while loading, SIGTERM stops us as Ctrl-C does
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"tinytp: warning: serving on {args.host} without --api-key: anyone who reaches it can use it",
              file=sys.stderr)
    try:
        server = Server((args.host, args.port), args.served_model_name or [args.model or "tiny-llama"], args.api_key)
    except OSError as e:
        print(f"tinytp: error: cannot listen at {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:
        with LLM(args.model, tensor_parallel_size=args.tp, device=args.device, dtype=args.dtype,
                 max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                 async_scheduling=args.async_scheduling) as llm:
            return server.serve(llm)
    except (ValueError, FileNotFoundError) as e:
        print(f"tinytp: error: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as e:  # a worker died while loading, /dev/shm is full: not the user's doing
        print(f"tinytp: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tinytp: interrupted", file=sys.stderr)
        return 130
    finally:
        server.server_close()


if __name__ == "__main__":
    sys.exit(main())
