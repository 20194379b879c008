"""An OpenAI-compatible HTTP server on tinytp's engine, as `vllm serve` is on vLLM's: `python
serve.py --model M`.

A front end only, standard library only: a request's prompts are one `LLM.stream_outputs` call
(the engine hands them to the request's own queue, so a slow client never holds it up), answered
as one JSON body or as server-sent events. Endpoints, fields, what is refused and why:
docs/api.md."""

from __future__ import annotations

import argparse
import contextlib
import hmac
import json
import signal
import sys
import threading
import time
import traceback
import uuid
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tinytp import LLM, CompletionOutput, RequestOutput, SamplingParams

MAX_BODY_BYTES = 16 << 20  # a larger request body is refused (413) without being read
SOCKET_TIMEOUT = 60.0  # a client that neither sends nor reads for this long is dropped
# how often the accept loop looks whether to stop, and the main thread whether the workers live
POLL_SECONDS = 0.5
# OpenAI's and vLLM's default for /v1/completions; chat's: what the context leaves
COMPLETIONS_MAX_TOKENS = 16

# The request fields honoured, as OpenAI and vLLM define them. The sampling ones go to
# SamplingParams, which checks them; these have their types checked here (prompt and messages by
# their endpoints). user: an id, unused.
FIELD_TYPES = {
    "model": (str, "a string"),
    "stream": (bool, "true or false"),
    "stream_options": (dict, "an object"),
    "add_generation_prompt": (bool, "true or false"),
    "user": (str, "a string"),
}
SAMPLING_FIELDS = {
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
}
COMMON_FIELDS = {"model", "stream", "stream_options", "max_tokens", "user", *SAMPLING_FIELDS}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "add_generation_prompt"}
# Fields that would change the output, accepted only at the value that changes nothing. Any other
# field is refused by name too: exact or refuse. (A null is OpenAI's "not given" for every field.)
NEUTRAL_VALUES = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "repetition_penalty": 1,
    "logprobs": False,
    "top_logprobs": 0,
    "echo": False,
    "logit_bias": {},
    "suffix": "",
    "tools": [],
    "response_format": {"type": "text"},
    "min_tokens": 0,
}


class APIError(Exception):
    """An answer in OpenAI's error shape: the HTTP status, the message, the field at fault."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {
            "error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}
        }


def usage(final: list[RequestOutput]) -> dict:
    prompt = sum(len(output.prompt_token_ids) for output in final)  # once per prompt, whatever n is
    completion = sum(len(c.token_ids) for output in final for c in output.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def choice(index: int, completion: CompletionOutput, chat: bool, piece: str | None = None) -> dict:
    """A choice in a response (piece None: the whole text) or in a stream's chunk (the text's new
    piece)."""
    if piece is None:
        text = (
            {"message": {"role": "assistant", "content": completion.text}}
            if chat
            else {"text": completion.text}
        )
    else:
        text = {"delta": {"content": piece} if piece else {}} if chat else {"text": piece}
    return {
        "index": index,
        **text,
        "logprobs": None,
        "finish_reason": completion.finish_reason,
        "stop_reason": completion.stop_reason,
    }


class Handler(BaseHTTPRequestHandler):
    """One connection, one request (HTTP/1.0: the response, a stream's too, ends with the
    connection)."""

    timeout = SOCKET_TIMEOUT
    # else each small event waits for the client's delayed acknowledgement
    disable_nagle_algorithm = True
    server: Server

    def do_GET(self) -> None:  # and do_POST: one router for both
        routes = {
            "/v1/models": ("GET", self.models),
            "/health": ("GET", self.health),
            "/v1/completions": ("POST", self.completions),
            "/v1/chat/completions": ("POST", self.chat),
        }
        path, self.streaming = self.path.split("?")[0], False
        try:
            key = self.headers.get("Authorization", "").removeprefix("Bearer ").encode()
            if (
                path.startswith("/v1/")
                and self.server.api_key is not None
                and not hmac.compare_digest(
                    # in constant time: no guessing the key by timing
                    key,
                    self.server.api_key.encode(),
                )
            ):
                raise APIError(
                    401,
                    "a missing or wrong API key: give --api-key's in 'Authorization: Bearer KEY'",
                    code="invalid_api_key",
                )
            if path not in routes:
                raise APIError(404, f"no route {path}: tinytp serves {', '.join(routes)}")
            if routes[path][0] != self.command:
                raise APIError(405, f"{path} takes {routes[path][0]}, not {self.command}")
            routes[path][1]()
        # mid-stream (the workers died, the server stopping): an event, then the end
        except APIError as e:
            self.log_message('"%s": %s %s', self.requestline, e.status, e)
            if self.streaming:
                self.send_event(e.body())
                self.send_event("[DONE]")
            else:
                self.send_json(e.status, e.body())
        except (ConnectionError, TimeoutError):
            self.log_message('"%s": the client went away', self.requestline)
        except Exception as e:  # a bug of ours, not the client's doing: a 500 and the traceback
            traceback.print_exc()
            if not self.streaming:
                self.send_json(500, APIError(500, f"{type(e).__name__}: {e}").body())

    do_POST = do_GET

    # length None: to the close
    def send_head(self, status: int, content_type: str, length: int | None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.end_headers()

    def send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj).encode()
        self.send_head(status, "application/json", len(data))
        self.wfile.write(data)

    def read_body(self, honoured: set[str]) -> dict:
        """The request's JSON object, its nulls left out ("not given"), its fields and its model
        checked."""
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
        for name, value in body.items():
            if name in NEUTRAL_VALUES:
                neutral = NEUTRAL_VALUES[name]
                # 0 is not False here
                if value != neutral or isinstance(value, bool) != isinstance(neutral, bool):
                    raise APIError(
                        400,
                        f"{name}={json.dumps(value)}: tinytp does not support {name} (only "
                        f"{json.dumps(neutral)}, which changes nothing)",
                        name,
                    )
            elif name not in honoured:
                raise APIError(
                    400,
                    f"tinytp does not support {name}; it honours {', '.join(sorted(honoured))}",
                    name,
                )
            elif name in FIELD_TYPES and not isinstance(value, FIELD_TYPES[name][0]):
                raise APIError(
                    400, f"{name} must be {FIELD_TYPES[name][1]}, got {json.dumps(value)}", name
                )
        options = body.get("stream_options", {})
        if (
            options.keys() - {"include_usage"}
            or not isinstance(options.get("include_usage", False), bool)
            or (options and not body.get("stream"))
        ):
            raise APIError(
                400,
                f"stream_options may hold include_usage (true or false), with stream=true; got "
                f"{json.dumps(options)}",
                "stream_options",
            )
        body.setdefault("model", self.server.names[0])
        if body["model"] not in self.server.names:
            raise APIError(
                404,
                f"the model `{body['model']}` does not exist: this server has "
                f"{self.server.names[0]}",
                "model",
                "model_not_found",
            )
        return body

    def models(self) -> None:
        self.send_json(
            200,
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": int(time.time()),
                        "owned_by": "tinytp",
                        "root": self.server.llm.model_dir,
                        "max_model_len": self.server.llm.max_model_len,
                    }
                    for name in self.server.names
                ],
            },
        )

    def health(self) -> None:
        try:
            self.server.llm.check_health()
        except RuntimeError as e:
            raise APIError(503, str(e)) from None
        self.send_head(200, "text/plain", 0)

    def completions(self) -> None:
        body = self.read_body(COMPLETION_FIELDS)
        # a string, a list of token ids, or a list of either (the engine checks each)
        prompt = body.get("prompt")
        many = (
            isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
        )
        prompts = prompt if many else [prompt]
        if not all(isinstance(p, (str, list)) for p in prompts):
            raise APIError(
                400,
                "prompt must be a string, a list of strings, a list of token ids or a list of such "
                f"lists, got {json.dumps(prompt)}",
                "prompt",
            )
        tokenizer = self.server.llm.tokenizer
        # Text is tokenized here, as the engine would, so that its length is known now ("" and text
        # without a tokenizer are left for the engine to refuse).
        prompts = [
            {"prompt": p, "prompt_token_ids": tokenizer(p).input_ids}
            if isinstance(p, str) and p and tokenizer
            else p
            for p in prompts
        ]
        self.generate(body, prompts, body.get("max_tokens", COMPLETIONS_MAX_TOKENS), chat=False)

    def chat(self) -> None:
        body = self.read_body(CHAT_FIELDS)
        messages = body.get("messages")
        if not (
            isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages)
        ):
            raise APIError(
                400,
                'messages must be a non-empty list of objects ({"role", "content"})',
                "messages",
            )
        # a template may refuse a conversation (roles out of order, a missing content): the client's
        # doing
        try:
            prompt = self.server.llm.chat_prompt(
                messages, None, body.get("add_generation_prompt", True)
            )
        except Exception as e:
            raise APIError(400, f"messages: {type(e).__name__}: {e}", "messages") from None
        self.generate(
            body, [prompt], body.get("max_completion_tokens", body.get("max_tokens")), chat=True
        )

    def generate(self, body: dict, prompts: list, max_tokens: int | None, chat: bool) -> None:
        """Run the prompts with the request's fields over the model's defaults
        (generation_config.json), as vLLM's server does, and answer with their completions, whole or
        streamed."""
        limit, defaults = self.server.llm.max_model_len, self.server.defaults
        longest = max(
            len(p["prompt_token_ids"])
            if isinstance(p, dict)
            else len(p)
            if isinstance(p, list)
            else 0
            for p in prompts
        )
        # chat's default: what the context leaves, at most the config's max_new_tokens
        if max_tokens is None:
            # (none given)
            cap = (
                limit if defaults.max_tokens == SamplingParams().max_tokens else defaults.max_tokens
            )
            max_tokens = max(1, min(cap, limit - longest))
        try:  # every value checked as SamplingParams checks it, and every prompt before any runs
            fields = {name: body[name] for name in SAMPLING_FIELDS & body.keys()}
            params = replace(defaults, max_tokens=max_tokens, **fields)
            # refused as vLLM does (a prompt past it: by the engine)
            if longest < limit < longest + max_tokens:
                raise APIError(
                    400,
                    f"max_tokens={max_tokens} is too large: this model's context is {limit} tokens "
                    f"and a prompt has {longest}; give at most {limit - longest}",
                    "max_tokens",
                )
            outputs = self.server.llm.stream_outputs(prompts, params)
        except ValueError as e:  # SamplingParams names the field first
            raise APIError(
                400, str(e), str(e).split()[0] if str(e).split()[0] in body else None
            ) from None
        stream = body.get("stream", False)
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": ("chat.completion.chunk" if stream else "chat.completion")
            if chat
            else "text_completion",
            "created": int(time.time()),
            "model": body["model"],
        }
        usage_field = {"usage": None} if body.get("stream_options", {}).get("include_usage") else {}
        final: list[RequestOutput] = []  # each prompt's latest output
        # a stream's choices (index * n + sample): characters, end sent
        sent: dict[int, tuple[int, str | None]] = {}
        # on the way out: a client gone (a write failed) aborts what still runs
        with contextlib.closing(outputs):
            try:
                if stream:
                    self.start_stream(head, params.n if chat else 0, usage_field)
                for final in outputs:
                    if stream:
                        self.send_new_text(head, final, sent, params.n, chat, usage_field)
            # the workers died, or the server stops (it shuts the engine down)
            except RuntimeError as e:
                stopping = self.server.stopping.is_set() and "the server is shutting down"
                raise APIError(503, self.server.failure or stopping or str(e)) from None
        # logged before the answer ends: a client that has it finds it in the log
        stats = self.server.llm.stats()
        self.log_message(
            '"%s": %d prompt(s), %d tokens out (engine: %d steps so far, at most %d requests in '
            "one)",
            self.requestline,
            len(prompts),
            usage(final)["completion_tokens"],
            stats["steps"],
            stats["largest_batch"],
        )
        if stream:
            if usage_field:
                self.send_event({**head, "choices": [], "usage": usage(final)})
            self.send_event("[DONE]")
        else:
            choices = [
                choice(index * params.n + c.index, c, chat)
                for index, output in enumerate(final)
                for c in output.outputs
            ]
            self.send_json(200, {**head, "choices": choices, "usage": usage(final)})

    def start_stream(self, head: dict, roles: int, usage_field: dict) -> None:
        """Server-sent events from here on; a chat's stream first names the role, in a chunk per
        choice."""
        self.send_head(200, "text/event-stream", None)
        self.streaming = True
        for number in range(roles):
            self.send_event(
                {
                    **head,
                    "choices": [
                        {
                            "index": number,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ],
                    **usage_field,
                }
            )

    def send_new_text(
        self,
        head: dict,
        outputs: list[RequestOutput],
        sent: dict,
        n: int,
        chat: bool,
        usage_field: dict,
    ) -> None:
        """A chunk per choice whose text grew or that ended since the last (with "usage": null when
        the stream's usage is asked for, as OpenAI's)."""
        for index, output in enumerate(outputs):
            for c in output.outputs:
                number = index * n + c.index
                shown, ended = sent.get(number, (0, None))
                if (len(c.text), c.finish_reason) != (shown, ended):
                    self.send_event(
                        {
                            **head,
                            "choices": [choice(number, c, chat, c.text[shown:])],
                            **usage_field,
                        }
                    )
                    sent[number] = len(c.text), c.finish_reason

    def send_event(self, data: dict | str) -> None:
        self.wfile.write(
            f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()
        )


class Server(ThreadingHTTPServer):
    daemon_threads = False  # server_close() waits for the requests in flight

    def __init__(self, address: tuple[str, int], names: list[str], api_key: str | None):
        super().__init__(address, Handler, bind_and_activate=False)
        # the port taken now (one in use: said before the model loads); listened on once it is up
        self.server_bind()
        self.names, self.api_key = names, api_key
        self.stopping, self.failure = threading.Event(), None

    # a client that vanished is no error of ours
    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)

    def serve(self, llm: LLM) -> int:
        """Answer requests until Ctrl-C, SIGTERM (the workers ignore one sent to the process group:
        ours to handle) or the workers' death; then stop accepting, end the requests in flight (a
        503, an error event); exit 0 or 1."""
        self.llm, self.defaults = llm, llm.get_default_sampling_params()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: self.stopping.set())
        # listening from here on: nothing is accepted before the workers are up
        self.server_activate()
        threading.Thread(target=self.serve_forever, args=(POLL_SECONDS,), daemon=True).start()
        host, port = self.server_address[:2]
        print(f"tinytp: serving {self.names[0]} at http://{host}:{port}/v1", flush=True)
        while not self.stopping.wait(POLL_SECONDS):
            try:
                llm.check_health()
            except RuntimeError as e:
                self.failure = str(e)
                self.stopping.set()
        self.shutdown()  # no more requests
        # the requests in flight end: each gets the engine's RuntimeError, and answers a 503
        llm.shutdown()
        self.server_close()  # waits for them
        print(f"tinytp: {self.failure or 'stopped'}", file=sys.stderr)
        return 1 if self.failure else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve.py", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", help="checkpoint directory or hub id (default: a tiny random Llama)"
    )
    parser.add_argument(
        "--tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="number of ranks"
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="0.0.0.0: every interface (give --api-key)"
    )
    parser.add_argument("--port", type=int, default=8000, help="0: one the OS picks")
    parser.add_argument(
        "--served-model-name", nargs="+", help="the model's name(s) in the API (default: --model)"
    )
    parser.add_argument("--api-key", help="refuse requests without 'Authorization: Bearer API_KEY'")
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto"
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], help="default: cuda where GPUs are visible, else cpu"
    )
    parser.add_argument(
        "--async-scheduling", action="store_true", help="schedule a step while the last one runs"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # while loading, SIGTERM stops us as Ctrl-C does
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(
            f"tinytp: warning: serving on {args.host} without --api-key: anyone who reaches it "
            "can use it",
            file=sys.stderr,
        )
    try:
        server = Server(
            (args.host, args.port),
            args.served_model_name or [args.model or "tiny-llama"],
            args.api_key,
        )
    except (OSError, OverflowError) as e:  # in use, not ours to take; a port past 65535
        reason = getattr(e, "strerror", None) or e
        print(f"tinytp: error: cannot listen at {args.host}:{args.port}: {reason}", file=sys.stderr)
        return 2
    try:
        with LLM(
            args.model,
            tensor_parallel_size=args.tp,
            device=args.device,
            dtype=args.dtype,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            async_scheduling=args.async_scheduling,
        ) as llm:
            return server.serve(llm)
    except (ValueError, FileNotFoundError) as e:
        print(f"tinytp: error: {e}", file=sys.stderr)
        return 2
    # a worker died while loading, /dev/shm is full: not the user's doing
    except (RuntimeError, OSError) as e:
        print(f"tinytp: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tinytp: interrupted", file=sys.stderr)
        return 130
    finally:
        server.server_close()


if __name__ == "__main__":
    sys.exit(main())
