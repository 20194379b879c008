"""tinytp: multiprocessing tensor-parallel Llama inference, in the style of vLLM V1.

    python tinytp.py --tp 2                                     # a tiny random model, CPU
    python tinytp.py --tp 2 --model meta-llama/Llama-3.1-8B-Instruct --prompt "Hi"

The driver, in the order a step flows: the `Executor` (one worker process per rank, rank 0
included), the engine loop around the `Scheduler` (scheduler.py), then the front end: requests
made and checked, text made from tokens, the `LLM` and the command line.
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import functools
import inspect
import itertools
import math
import os
import pickle
import queue
import random
import signal
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoints import (
    check_checkpoint,
    check_parallel_sizes,
    has_tokenizer,
    load_tokenizer,
    read_json_object,
    read_model_config,
    resolve_model,
)
from model import (
    ModelConfig,
    TPGroup,
    cpu_has_native_bfloat16,
    kv_cache_shape,
    stage_layers,
    weight_bytes,
)
from scheduler import KVCacheManager, Metric, Request, Scheduler
from worker import (
    SHUTDOWN,
    MessageQueue,
    ModelRunnerOutput,
    RPCCall,
    RPCResult,
    SamplingParams,
    SchedulerOutput,
    check_count,
    check_free_shared_memory,
    collective_block_bytes,
    forget_child_processes,
    importing_main_for_spawn,
    is_integer,
    is_number,
    new_shared_memory,
    token_id_list,
    unlink_semaphores,
    wait_for_messages,
    worker_main,
)

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

# transformers (seconds to import) is imported in functions: spawned workers re-import this module.


# Requests and outputs, in vLLM's shape -----------------------------------------------
@dataclass
class Logprob:  # vLLM's: one token's log-probability at a position
    logprob: float
    rank: int | None = None  # 1: the likeliest token there
    decoded_token: str | None = None  # its text alone (tokenizer.decode([id]), as vLLM's)


@dataclass
class CompletionOutput:  # one sample of a prompt's completion
    index: int  # which of the prompt's n samples
    text: str  # the text of token_ids, special tokens left out, ending before a stop string
    token_ids: list[int]  # the generated tokens (the one that ended the sequence included)
    finish_reason: str  # "stop" (an end-of-sequence token, a stop token or string) or "length"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    cumulative_logprob: float | None = None  # logprobs asked: the sum of its tokens' logprobs
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the sampled one, the k likeliest
    lora_request: None = None  # vLLM's, as vLLM leaves it when none was asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # the n samples, in index order
    finished: bool = True
    # SamplingParams.prompt_logprobs asked: None for the first token, then for each {token id:
    # Logprob}, the prompt's token first, then the k likeliest
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    metrics: None = None  # vLLM's other fields, as left unasked: tinytp has only num_cached_tokens
    lora_request: None = None
    encoder_prompt: str | None = None
    encoder_prompt_token_ids: list[int] | None = None
    num_cached_tokens: int | None = None  # its prompt tokens the prefix cache held (first sample)
    multi_modal_placeholders: dict | None = None
    kv_transfer_params: dict | None = None


# The executor: N worker processes and the queues between them and us ------------------
def choose_device_and_dtype(
    config: ModelConfig, tp: int, device: str | None, dtype: str, pp: int = 1
) -> tuple[str, str]:
    """The device (default: cuda if there are GPUs, else cpu) and the dtype ("auto": the
    checkpoint's; on cpu bfloat16 only where oneDNN runs it natively (AVX-512 and newer: faster than
    float32 and half the memory, docs/performance.md), else float32, float16 too: slow on CPUs)."""
    gpus, ranks = torch.cuda.device_count(), tp * pp
    device = device or ("cuda" if gpus else "cpu")
    if device == "cuda" and gpus < ranks:  # too few GPUs: refused, not a silent fall back to CPU
        sizes = f"tp={tp}" + (f" x pp={pp}" if pp > 1 else "")
        raise ValueError(
            f"{sizes} needs {ranks} GPUs and {gpus} are visible; --device cpu runs it on the CPU"
        )
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    dtype = {"half": "float16", "float": "float32"}.get(str(dtype), dtype)  # vLLM's names too
    if dtype == "auto":
        native_bfloat16 = config.dtype == "bfloat16" and cpu_has_native_bfloat16()
        dtype = config.dtype if device == "cuda" or native_bfloat16 else "float32"
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(
            f"dtype must be auto, float32, bfloat16, float16, half or float: {dtype!r}"
        )
    return device, dtype


def loopback_store() -> dist.TCPStore:
    """A TCP store where the workers meet, on a port the OS picks (no torchrun, no MASTER_PORT, no
    race for a "free" port), on loopback only: c10d's own listener takes every interface."""
    listener = socket.create_server(("127.0.0.1", 0))
    (host, port), fd = listener.getsockname(), listener.detach()
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, master_listen_fd=fd)


def threads_per_rank(tp: int) -> int:
    """Torch threads for each worker, so that ranks x threads = the cores we may use."""
    return max(1, len(os.sched_getaffinity(0)) // tp)


# A stopped worker (SIGSTOP, state T; t under a debugger) never answers; at tp=1 no peer notices
STOPPED_GRACE = 5.0  # till the driver gives up (not at once: a debugger's attach, Ctrl-Z, fg)


def is_stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")  # the state: after "(name)"
    except OSError:  # no /proc (macOS), or the process is gone: not stopped, as far as we can tell
        return False


class WorkerError(RuntimeError):
    """A worker method raised: names the rank and carries its traceback text."""


@dataclass
class StepFuture:
    """A step on its way (vLLM's execute_model(non_block=True) returns a Future); result() waits."""

    result: Callable[[], ModelRunnerOutput]


def start_processes(workers: list[mp.Process]) -> None:
    """Start the workers. Ctrl-C and SIGTERM are blocked while they start: they inherit the mask, so
    a signal sent to the process group reaches the driver (when we unblock it) and never N workers
    mid-import; worker_main then ignores both."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        for process in workers:
            process.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    forget_child_processes(workers)


class Executor:
    """Spawns one worker process per rank, rank 0 included (design discussion: "N worker processes
    rather than N-1"), and runs methods on all: calls go out on one shared-memory broadcast queue,
    and each worker answers on its own (a step: rank 0 alone, as all sampled alike). Under pipeline
    parallelism, tp x pp ranks, and the last stage's first rank answers each step."""

    def __init__(
        self,
        config: ModelConfig,
        model_dir: str,
        tp: int,
        pp: int,
        device: str,
        dtype: str,
        max_num_seqs: int,
        max_model_len: int,
        load_format: str = "auto",
        cuda_graphs: bool = False,
        enforce_eager: bool = False,
        *,
        num_blocks: int,
        block_size: int,
    ):
        self.tp, self.pp, self.world_size = tp, pp, tp * pp
        self.reply_rank = self.world_size - tp  # the last stage's first: it has the logits
        self.call_ids = itertools.count(1)
        self.failure: str | None = None
        self.creator = os.getpid()  # a forked child inherits our exit hook, and must not stop ours
        self.workers, self.responses, self.collective_blocks = [], [], []  # made in the try below
        self.stopped_since: dict[int, float] = {}  # rank: when _check_workers first saw it stopped
        self.awaited: dict[int, tuple[str, dict, int]] = {}  # call id: (name, answers, count due)
        # One thread drives the executor: its maker's, then an LLM's engine loop's (EngineClient's
        # doing). Another may still shut it down, so sending is a critical section.
        self.driver: int | None = threading.get_ident()  # None: any (the loop gone)
        self.sending = threading.RLock()
        self.closing = threading.Event()  # set: the driver gives up its wait at its next check
        self.broadcast = MessageQueue.create(num_readers=self.world_size)
        atexit.register(self.shutdown)
        try:
            self._start_workers(device)
            # Initialization goes through collective_rpc too, as in the design discussion.
            blocks = [block.name for block in self.collective_blocks]
            threads = threads_per_rank(self.world_size)
            device_args = (device, dtype, self.store.port, threads, blocks)
            self.collective_rpc("init_device", args=device_args)
            model = (config, model_dir, max_model_len, load_format, enforce_eager)
            self.collective_rpc("load_model", args=model)
            kv_cache = (num_blocks, block_size, max_num_seqs, cuda_graphs)
            self.collective_rpc("init_kv_cache", args=kv_cache)
        except BaseException:
            self.shutdown()
            raise

    def _start_workers(self, device: str) -> None:
        """The reply queues, a collective block a stage (CPU, tp > 1), the store, the processes."""
        context = mp.get_context("spawn")
        self.doorbell = context.Semaphore(0)  # one for all reply queues: we wait on all at once
        reply_queue = {"num_readers": 1, "num_chunks": 4, "chunk_bytes": 1 << 18, "reader": 0}
        for _ in range(self.world_size):
            self.responses.append(MessageQueue.create(**reply_queue, doorbells=[self.doorbell]))
        if device == "cpu" and self.tp > 1:
            for _ in range(self.pp):
                self.collective_blocks.append(new_shared_memory(collective_block_bytes(self.tp)))
        check_free_shared_memory(
            [*self.collective_blocks, *(q.shm for q in [self.broadcast, *self.responses])]
        )
        self.store = loopback_store()
        self.workers = [
            context.Process(
                target=worker_main,
                name=f"tinytp-rank{rank}",
                daemon=True,
                args=(rank, self.tp, self.pp, self.broadcast.handle, replies.handle, self.creator),
            )
            for rank, replies in enumerate(self.responses)
        ]
        start_processes(self.workers)

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        """Run `method` on every worker; return the results in rank order. A callable (picklable:
        module-level) gets the Worker first, pickled alone: a worker that cannot import it says so.
        It runs after the steps in flight (_wait_for keeps their answers). args, kwargs: a tuple, a
        dict (vLLM's form, not the design discussion's `*args, **kwargs`): no name can collide."""
        name, payload = (
            (method, method) if isinstance(method, str) else (method.__name__, pickle.dumps(method))
        )
        call_id = self._send(RPCCall(0, payload, tuple(args), kwargs or {}), timeout, name)
        return self._wait_for(call_id, timeout)

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> ModelRunnerOutput | StepFuture:
        """One step; one rank answers (reply_rank). non_block (vLLM's; async scheduling): return a
        StepFuture at once, so that the next step can be scheduled and sent while this one runs."""
        call = RPCCall(0, "execute_model", (scheduler_output,), unique_reply_rank=self.reply_rank)
        call_id = self._send(call, None, "execute_model")
        step = StepFuture(functools.partial(self._wait_for_step, call_id))
        return step if non_block else step.result()

    def _wait_for_step(self, call_id: int) -> ModelRunnerOutput:
        """A step's answer; a failure shuts the workers down (the ranks may disagree now)."""
        try:
            return self._wait_for(call_id, None)[0]
        except WorkerError as e:
            self._fail(str(e).splitlines()[0])
            raise

    def _send(self, call: RPCCall, timeout: float | None, name: str) -> int:
        """Number the call, broadcast it, and expect its answers; return its number."""
        if self.driver not in (None, threading.get_ident()):  # README, exercise 11
            why = "one thread drives tinytp's executor, the engine loop's: call LLM.collective_rpc"
            raise RuntimeError(f"{name}: {why}")  # (two would take each other's replies)
        with self.sending:
            if self.failure is None and any(q.cut_off for q in [self.broadcast, *self.responses]):
                cut_off = "a message between us was cut off part-way, and its reader would misread"
                self._fail(f"{cut_off} what follows")
            self._raise_if_failed()
            call.call_id = next(self.call_ids)
            everyone = range(self.world_size)
            ranks = everyone if call.unique_reply_rank is None else [call.unique_reply_rank]
            self.awaited[call.call_id] = (name, {}, len(ranks))
            try:
                self.broadcast.enqueue(call, timeout, check=self._check_workers)
            except BaseException:
                del self.awaited[call.call_id]
                raise
            return call.call_id

    def _wait_for(self, call_id: int, timeout: float | None) -> list:
        """Wait for a call's answers (rank order), keeping other awaited calls' answers that come
        meanwhile. After a timeout or Ctrl-C it is no longer awaited: late answers are dropped."""
        name, answers, count = self.awaited[call_id]
        what = f"{name} on the workers"
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while len(answers) < count:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                wait_for_messages(self.responses, left, what, self._check_workers, self.doorbell)
                self._take_replies()
        except TimeoutError:  # said with the caller's timeout, not the part of it left
            raise TimeoutError(f"{what}: nothing after {timeout:g} s") from None
        finally:
            del self.awaited[call_id]
        return [answers[rank] for rank in sorted(answers)]

    def _take_replies(self) -> None:
        """Every reply come (a failed rank sends its error unasked), put with its call's answers."""
        for rank, replies in enumerate(self.responses):
            while replies.ready():
                reply: RPCResult = replies.dequeue(check=self._check_workers)  # may span chunks
                if reply.call_id not in self.awaited:
                    continue  # a late answer to a call that timed out or was interrupted
                name, answers, _ = self.awaited[reply.call_id]
                if reply.error is not None:
                    self._check_workers()  # a dead peer is the root cause of a collective's error
                    raise WorkerError(
                        f"worker {self.rank_name(rank)} failed in {name}:\n{reply.error}"
                    )
                answers[rank] = reply.value

    def rank_name(self, rank: int) -> str:
        return f"rank {rank}" + (f" (pipeline stage {rank // self.tp})" if self.pp > 1 else "")

    def check_health(self) -> None:
        """Raise if the workers are gone (shut down, failed, dead or stopped)."""
        self._raise_if_failed()
        self._check_workers()

    def _raise_if_failed(self) -> None:
        if self.failure is not None:
            raise RuntimeError(f"tinytp's workers are gone ({self.failure}); create a new LLM")

    def _check_workers(self) -> None:
        """Called while we wait: a worker dead, or stopped past STOPPED_GRACE, will never answer."""
        if self.closing.is_set():
            raise RuntimeError("tinytp was shut down while it waited for its workers")
        for rank, process in enumerate(self.workers):
            if process.exitcode is not None:  # peers wait for it in a collective: they won't answer
                self._fail(
                    f"worker {self.rank_name(rank)} exited with code {process.exitcode}", grace=0
                )
                raise RuntimeError(
                    f"tinytp worker {self.rank_name(rank)} died (exit code {process.exitcode}); "
                    "the other workers were stopped"
                )
            since = self.stopped_since.setdefault(rank, time.monotonic())
            if not is_stopped(process.pid):
                del self.stopped_since[rank]
            elif time.monotonic() - since > STOPPED_GRACE:
                self._fail(f"worker {self.rank_name(rank)} was stopped")
                raise RuntimeError(
                    f"tinytp worker {self.rank_name(rank)} (pid {process.pid}) is stopped "
                    f"(SIGSTOP?), for {STOPPED_GRACE:g} s now; the workers were shut down"
                )

    def _fail(self, reason: str, grace: float = 2.0) -> None:
        self.failure = reason
        self.shutdown(grace)

    def shutdown(self, grace: float = 2.0) -> None:
        """Stop the workers (politely, for `grace` s, then by force) and free every shared-memory
        block and semaphore, in the process that made them only: not in a forked child at exit."""
        with self.sending:  # (the engine loop may be sending)
            if self.broadcast.buf is None or os.getpid() != self.creator:  # done, or not ours
                return
            workers = [p for p in self.workers if p.pid is not None]  # the started ones
            self.workers = []
            atexit.unregister(self.shutdown)
            self.failure = self.failure or "shut down"
            with contextlib.suppress(TimeoutError):  # ring full: a worker is stuck, killed below
                self.broadcast.enqueue(RPCCall(0, SHUTDOWN), timeout=min(grace, 1))
            deadline = time.monotonic() + grace  # an idle worker exits within milliseconds
            for process in workers:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
            for process in workers:  # one still alive is stuck in a step, a collective, loading
                process.kill()  # (a no-op for one that exited)
                process.join()
            ours = [getattr(self, "doorbell", None)]  # None if the start failed before it
            unlink_semaphores([*self.broadcast.handle.doorbells, *filter(None, ours)])
            for message_queue in [self.broadcast, *self.responses]:
                message_queue.close()
            for block in self.collective_blocks:
                block.close()
                block.unlink()
            self.store = self.doorbell = None


# The engine: the scheduler and the executor, driven by one thread ---------------------
STOP_ENGINE = "stop"


class EngineCore:
    """vLLM's EngineCore: owns the Scheduler and Executor, with vLLM's verbs for them (step,
    has_unfinished_requests; adds and aborts go to the scheduler), which one thread calls:
    run_busy_loop's (an LLM starts it). Callers in other threads reach it through queues, one in
    and one out per caller."""

    def __init__(self, scheduler: Scheduler, executor: Executor, async_scheduling: bool):
        self.scheduler, self.executor = scheduler, executor
        # Design discussion (njhill): "make the scheduling async, so that they always have the
        # schedule for the next step waiting when they finish the current one": two steps in flight.
        # Pipeline parallelism: one a stage at least (vLLM's batch queue), each at its own stage.
        pp = scheduler.pipeline_parallel_size
        self.max_steps_in_flight = max(pp, 2 if async_scheduling else 1)
        self.batch_queue: deque[tuple[SchedulerOutput, StepFuture]] = deque()  # sent, oldest first
        self.stats = {"steps": 0, "largest_batch": 0}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.batch_queue)

    def step(self) -> list[Request]:
        """Send the next step while fewer than max_steps_in_flight are out; then, when that many are
        or none is left to send, wait for the oldest and return the requests it gave a token (vLLM's
        step_with_batch_queue). Async, the step sent here runs while we wait for the one before: the
        workers append their own sampled tokens, so a step needs no earlier step's answer."""
        if len(self.batch_queue) < self.max_steps_in_flight:
            scheduler_output = self.scheduler.schedule()
            if scheduler_output is not None:
                self.stats["steps"] += 1
                self.stats["largest_batch"] = max(
                    self.stats["largest_batch"], len(scheduler_output.scheduled_ids)
                )
                self.batch_queue.append(
                    (scheduler_output, self.executor.execute_model(scheduler_output, True))
                )
                if len(self.batch_queue) < self.max_steps_in_flight:
                    return []  # this step is on its way: send the next one before waiting for it
        if not self.batch_queue:
            return []
        scheduler_output, step = self.batch_queue.popleft()
        return self.scheduler.update_from_output(scheduler_output, step.result())

    def run_busy_loop(self, commands: queue.SimpleQueue) -> None:
        """vLLM's EngineCoreProc.run_busy_loop, as a thread: take the commands waiting (add, abort,
        call), sleeping on the queue when idle (an idle LLM costs no CPU), step, and hand each
        updated request to its caller. A failure (a worker died) goes to every caller at once."""
        while True:
            try:
                while not commands.empty() or not self.has_unfinished_requests():
                    verb, argument = commands.get()
                    if verb == STOP_ENGINE:
                        self.fail_every_request(RuntimeError("this LLM was shut down"))
                        return
                    self.run_command(verb, argument)
                for request in self.step():
                    finished = request.finish_reason is not None
                    report = (request, len(request.output_token_ids), finished)
                    if request.finish_reason == "error":  # its caller's alone: the engine goes on
                        why = "its logits became inf or NaN (its logit_bias and penalties together)"
                        report = ValueError(f"request {request.request_id}: {why}; it was stopped")
                    if request.stream or finished:
                        request.output_queue.put(report)
            except Exception as error:  # a worker failed or died: shut down, later steps raise too
                self.executor.shutdown()  # already, but for driver faults: ranks may disagree now
                self.fail_every_request(error)

    def run_command(self, verb: str, argument) -> None:
        if verb == "add":
            for request in argument:
                self.scheduler.add_request(request)
        elif verb == "abort":
            self.scheduler.abort_requests(set(argument))
        else:  # "call": a function run here between steps, by the one thread driving the executor
            function, result = argument
            try:
                result.set_result(function())
            except Exception as error:
                result.set_exception(error)

    def fail_every_request(self, error: Exception) -> None:
        requests = [*self.scheduler.waiting, *self.scheduler.running]
        for request in requests:
            request.output_queue.put(error)
        self.scheduler.abort_requests({request.request_id for request in requests})
        self.batch_queue.clear()


# The front end: the callers' side, in vLLM's pieces ---------------------------------
# Input processing (vLLM's Processor) makes a prompt and its SamplingParams into requests; the
# engine client hands them to the engine loop and takes its reports; output processing (vLLM's
# OutputProcessor) makes RequestOutputs. LLM, what vLLM scripts call, is a thin layer on the three.
def default_sampling_params(model_dir: str) -> SamplingParams:
    """vLLM's get_default_sampling_params(): temperature, top_p, top_k, min_p, repetition_penalty,
    max_new_tokens from generation_config.json (not do_sample, as in vLLM), else vLLM's defaults."""
    path = os.path.join(model_dir, "generation_config.json")
    config = read_json_object(path) if os.path.exists(path) else {}
    try:
        config["max_tokens"] = config.get("max_new_tokens")  # transformers' name for it
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens")
        return SamplingParams(**{key: config[key] for key in keys if config.get(key) is not None})
    except ValueError as e:  # a value SamplingParams refuses
        raise ValueError(f"{path}: {e}") from None


def message_text(parts: list) -> str:
    """A chat message's content given as OpenAI's content parts: the text parts joined by newlines,
    as in vLLM's chat; any other part (an image, audio) refused: a text model cannot take it."""
    for part in parts:
        if not (
            isinstance(part, dict)
            and part.get("type") == "text"
            and isinstance(part.get("text"), str)
        ):
            raise ValueError(
                'a content part must be {"type": "text", "text": ...}: tinytp runs text models; '
                f"got {part!r:.80}"
            )
    return "\n".join(part["text"] for part in parts)


class Processor:
    """vLLM's Processor: a caller's prompt and SamplingParams checked, tokenized and made into the
    engine's requests, one per sample, before any of them runs."""

    def __init__(
        self,
        config: ModelConfig,
        model_dir: str,
        tokenizer,
        max_model_len: int,
        generation_config: str | None,
        seed: int | None,
    ):
        self.config, self.model_dir, self.tokenizer = config, model_dir, tokenizer
        self.max_model_len = max_model_len
        # where sampling defaults (None: SamplingParams()'s) and extra end-of-sequence ids come from
        self.generation_config = generation_config
        self.get_default_sampling_params()  # a bad generation_config.json refused now
        self.seeds = random.Random(seed)  # seed None: from the OS
        self.request_ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        if self.generation_config is None:
            return SamplingParams()
        return default_sampling_params(self.generation_config)

    def end_of_sequence_ids(self) -> set[int]:
        """EOS ids: config.json's, generation_config.json's (3 in Llama 3.1), the tokenizer's."""
        ids = set(self.config.eos_token_ids)
        path = os.path.join(self.generation_config or self.model_dir, "generation_config.json")
        if os.path.exists(path):
            eos = read_json_object(path).get("eos_token_id")
            ids.update(token_id_list(eos, f"{path}: eos_token_id"))
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def make_groups(self, prompts: str | dict | list, sampling_params) -> list[list[Request]]:
        """Each prompt's requests (its n samples), every prompt checked before any runs."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        one_for_all = not isinstance(sampling_params, list)
        params = [sampling_params] * len(prompts) if one_for_all else sampling_params
        if len(params) != len(prompts):
            raise ValueError(
                f"{len(params)} SamplingParams for {len(prompts)} prompts: "
                "give one, or one per prompt"
            )
        return [self.make_requests(prompt, p) for prompt, p in zip(prompts, params)]

    def make_requests(
        self, prompt: str | dict | list[int], params: SamplingParams | None
    ) -> list[Request]:
        """A prompt's requests, one per sample (params.n), checked."""
        params = self.get_default_sampling_params() if params is None else params  # as vLLM's
        if not isinstance(params, SamplingParams):
            raise ValueError(
                f"sampling_params must be SamplingParams or a list of them, got {params!r}"
            )
        # truncate_prompt_tokens, vLLM's: -1 is max_model_len, more is refused
        if (k := params.truncate_prompt_tokens) and k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens={k} is more than max_model_len")
        text, token_ids = self.tokenize(prompt, self.max_model_len if k == -1 else k)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None  # (None: no salt)
        if salt is not None and not (isinstance(salt, str) and salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; max_model_len={self.max_model_len} "
                "allows at most max_model_len - 1"
            )
        self.check_vocabulary(params.stop_token_ids, "stop_token_ids")
        self.check_vocabulary(list(params.logit_bias or {}), "logit_bias")
        self.check_vocabulary(params.allowed_token_ids or [], "allowed_token_ids")
        if params.best_of not in (None, 1) or params.logits_processors:  # refused by vLLM V1 too
            name = "logits_processors" if params.logits_processors else f"best_of={params.best_of}"
            raise ValueError(f"{name}: vLLM V1 does not support it, nor does tinytp")
        if params.allowed_token_ids == []:  # as vLLM
            raise ValueError("allowed_token_ids=[] allows no token: give one at least, or None")
        if (params.stop or params.bad_words) and self.tokenizer is None:
            raise ValueError(
                f"{self.model_dir} has no tokenizer, so no stop strings, no bad_words: give ids"
            )
        if params.max_tokens is None:  # vLLM's: as many as max_model_len leaves
            params = replace(params, max_tokens=self.max_model_len - len(token_ids))
        if params.bad_words:  # a copy of params, with them as token ids for the workers
            params = replace(params)
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        seed = params.seed if params.seed is not None else self.seeds.getrandbits(63)
        # Sample 0 takes the seed itself (n=1 samples as before), sample i one drawn from (seed, i):
        # a seeded call repeats exactly, and sample 1 of seed s is not sample 0 of seed s + 1.
        seeds = [seed] + [
            random.Random(f"{seed}:{index}").getrandbits(64) for index in range(1, params.n)
        ]
        return [
            Request(next(self.request_ids), text, token_ids, params, sample_seed, cache_salt=salt)
            for sample_seed in seeds
        ]

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's: each word's tokens (leading spaces stripped), and a space and the word's too
        where that begins with another token and has as many (a word within a text, not at its
        start)."""
        token_ids = []
        for word in words:
            alone = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            token_ids += [alone] + [spaced] * (spaced[0] != alone[0] and len(spaced) == len(alone))
        self.check_vocabulary(sum(token_ids, []), "bad_words' token ids")
        return token_ids

    def tokenize(self, prompt: str | dict | list[int], last=None) -> tuple[str | None, list[int]]:
        """A prompt's text (None if given as ids) and its token ids, checked; `last` given, only its
        last tokens (a text's: the tokenizer's, which cuts on the left and keeps BOS, as vLLM's)."""
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict):  # vLLM's {"prompt": ...}, {"prompt_token_ids": ...}, or both
            text = prompt.get("prompt")  # (and a cache_salt: make_requests')
            if (
                not prompt
                or prompt.keys() - {"prompt", "prompt_token_ids", "cache_salt"}
                or not isinstance(text, (str, type(None)))
            ):
                raise ValueError(
                    'a dict prompt is {"prompt": text} or {"prompt_token_ids": ids}, '
                    f"got {prompt!r}"
                )
            prompt = prompt.get("prompt_token_ids", text)
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("empty prompt: give at least one character")
            if self.tokenizer is None:
                raise ValueError(f"{self.model_dir} has no tokenizer: give prompts as token ids")
            token_ids = self.tokenizer(prompt, truncation=bool(last), max_length=last).input_ids
            self.check_vocabulary(token_ids, f"the tokenizer's ids for {prompt[:40]!r}:")
        elif isinstance(prompt, (list, tuple)):
            if not prompt:
                raise ValueError("empty prompt: give at least one token id")
            if wrong_type := [t for t in prompt if not is_integer(t)]:
                raise ValueError(
                    f"token ids must be integers, got {wrong_type[0]!r} "
                    f"({type(wrong_type[0]).__name__})"
                )
            token_ids = [int(t) for t in prompt][-(last or len(prompt)) :]  # plain ints
            self.check_vocabulary(token_ids, "token ids")
        else:
            raise ValueError(
                f"a prompt is a string or a list of token ids, got {prompt!r} "
                f"({type(prompt).__name__})"
            )
        return text, token_ids

    def check_vocabulary(self, token_ids: list[int], what: str) -> None:
        if outside := [t for t in token_ids if not 0 <= t < self.config.vocab_size]:
            raise ValueError(
                f"{what} {outside[:5]} are outside the vocabulary (0..{self.config.vocab_size - 1})"
            )

    def chat_prompt(
        self,
        conversation: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> dict:
        """A conversation as a prompt: its text, and its token ids (the template writes the special
        tokens); message_text joins a content given as OpenAI's parts. continue_final_message: the
        text ends in the last message, for the model to go on with it. chat_template_kwargs: more
        variables for the template (enable_thinking=False, say)."""
        if not (self.tokenizer and (chat_template or self.tokenizer.chat_template)):
            raise ValueError(
                f"{self.model_dir} has no tokenizer with a chat template: give chat_template=..."
            )
        # as vLLM: a new message, or more of the last one
        if add_generation_prompt and continue_final_message:
            raise ValueError(
                "continue_final_message=True goes on with the last message: "
                "give add_generation_prompt=False"
            )
        template_kwargs = dict(chat_template_kwargs or {})
        chat_arguments = {"conversation", "chat_template", "tokenize", "add_generation_prompt"}
        if taken := template_kwargs.keys() & {*chat_arguments, "continue_final_message"}:
            raise ValueError(
                f"chat_template_kwargs cannot set {sorted(taken)[0]}: chat() has an argument for it"
            )
        conversation = [
            dict(message, content=message_text(message["content"]))
            if isinstance(message, dict) and isinstance(message.get("content"), list)
            else message
            for message in conversation
        ]
        text = self.tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
        token_ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return {"prompt": text, "prompt_token_ids": token_ids}


class EngineClient:
    """The callers' side of the engine loop (vLLM's EngineCoreClient): starts the thread that runs
    EngineCore.run_busy_loop, puts commands on its queue (add, abort, call), and hands each caller
    the queue its requests are reported on. Any number of threads may call it at once. Once the loop
    has stopped, every command is refused at once: none waits for a loop that will never read it."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        # `stopped` and the queue change together: a command is drained and failed, or refused here.
        self.lock = threading.Lock()
        self.stopped = False
        self.thread = threading.Thread(target=self._run_engine, name="tinytp-engine", daemon=True)
        self.thread.start()

    def _run_engine(self) -> None:
        self.engine.executor.driver = threading.get_ident()  # this thread drives it from now on
        try:
            self.engine.run_busy_loop(self.commands)
        finally:
            with self.lock:
                self.stopped = True
            self.engine.executor.driver = None  # stopped: EngineClient.call runs in its caller
            stopped = RuntimeError("this LLM was shut down")
            while not self.commands.empty():  # what came while the loop was stopping
                verb, argument = self.commands.get()
                if verb == "add":
                    for request in argument:
                        request.output_queue.put(stopped)
                elif verb == "call":
                    argument[1].set_exception(stopped)

    def _put(self, command: tuple) -> None:
        with self.lock:
            if self.stopped:
                raise RuntimeError("this LLM was shut down")
            self.commands.put(command)

    def add(self, requests: list[Request], stream: bool) -> queue.SimpleQueue:
        """Hand the requests to the engine loop; return the queue it reports them on: (a request,
        its tokens then, whether it finished) for each new token, or (stream False) only at the
        end. A request with stop strings is reported at every token all the same: the front end
        looks for them in its text. A failure comes on the queue as an exception."""
        outputs = queue.SimpleQueue()
        for request in requests:
            request.output_queue, request.stream = outputs, stream or bool(request.params.stop)
        self._put(("add", requests))
        return outputs

    def abort(self, request_ids: list[int]) -> None:
        """Forget these requests (a caller gone, a stop string found): a stopped loop forgot all."""
        with contextlib.suppress(RuntimeError):
            self._put(("abort", request_ids))

    def call(self, function: Callable):
        """Run `function` in the engine loop's thread, between two steps, and return what it
        returns: that thread alone drives the executor (once the loop has stopped, here)."""
        result = concurrent.futures.Future()
        try:
            self._put(("call", (function, result)))
        except RuntimeError:  # stopped: nothing else drives the executor now
            return function()
        return result.result()

    def shutdown(self) -> None:
        """Stop the engine loop; a step it waits for is given up at its next check."""
        if self.thread.is_alive():
            if isinstance(self.engine.executor, Executor):  # others (bench's) wait on no processes
                self.engine.executor.closing.set()
            with contextlib.suppress(RuntimeError):
                self._put((STOP_ENGINE, None))
            self.thread.join()


class IncrementalText:
    """One sample's text as its tokens come (vLLM's IncrementalDetokenizer), and its stop strings
    looked for as it grows, so that a token costs the same at position 10 and 10,000. A token's
    text is decoded from a window of the few tokens before it (a tokenizer may spell a token by its
    neighbours), never from the whole output; a stop string is looked for in the new text and the
    characters before it that a stop string could begin in (the longest one's length, less one);
    and the text shown holds back as many, while a stop string could still begin there."""

    def __init__(self, detokenize: Callable, stop: list[str], min_tokens=0, include_stop=False):
        self.detokenize, self.stop, self.min_tokens = detokenize, stop, min_tokens
        self.hold = max(map(len, stop), default=1) - 1
        # the text ends with a stop string found, not before it (vLLM's include_stop_str_in_output)
        self.include_stop = include_stop
        self.start = self.shown = 0  # the window, and where its decoded part ends
        self.decoded = ""  # the text of the tokens before `shown`
        self.pending = False  # the tokens after `shown` end in half of a multi-byte character
        self.found: tuple[int, str] | None = None  # where a stop string begins, and which
        self.num_tokens_at_stop = 0  # the tokens up to the one that completed it

    def add(self, token_ids: list[int], end: int, final: bool) -> None:
        """Decode the tokens up to `end`, looking for the stop strings in the text they add (with
        stop strings, one token at a time: the one that completes a stop string ends the
        sample). `final`: the last call, whose half of a character stays as it is."""
        window = self.detokenize(token_ids[self.start : end])
        before = (
            self.detokenize(token_ids[self.start : self.shown]) if self.shown > self.start else ""
        )
        new = window[len(before) :]
        if self.stop and end > self.min_tokens:  # vLLM's: no stop string within min_tokens
            begin = max(0, len(self.decoded) - self.hold)
            tail = self.decoded[begin:] + new  # (not a copy of the whole text: it grows)
            found = [(begin + i, stop) for stop in self.stop if (i := tail.find(stop)) >= 0]
            if found:  # the one that begins first, as a search of the whole text finds it
                self.found, self.num_tokens_at_stop = min(found), end
                self.decoded += new
                return
        self.pending = window.endswith("\ufffd") and not final
        if not self.pending:
            self.decoded += new
            self.start, self.shown = self.shown, end

    def text(self, finished: bool) -> str:
        """The text to show: before a stop string found; all at the end; else all but those held."""
        if self.found is not None:
            return self.decoded[: self.found[0] + self.include_stop * len(self.found[1])]
        held = 0 if self.include_stop else self.hold  # (no text after a stop string is ever shown)
        return self.decoded if finished else self.decoded[: max(0, len(self.decoded) - held)]


class RequestState:
    """One sample as the front end follows it (vLLM's RequestState): its text as tokens come, its
    logprobs where asked, its CompletionOutput so far. A stop string in its text ends it here."""

    def __init__(self, request: Request, index: int, detokenize: Callable, decode_token: Callable):
        """detokenize: a text's tokens to text; decode_token: one token's text (Logprob's)."""
        params = request.params
        if not params.detokenize:  # vLLM's: token ids alone, no text, no Logprob.decoded_token
            detokenize, decode_token = (lambda token_ids, **special: ""), (lambda token_id: None)
        special = {"skip_special_tokens": params.skip_special_tokens}
        special["spaces_between_special_tokens"] = params.spaces_between_special_tokens
        detokenize = functools.partial(detokenize, **special)
        self.request, self.index, self.decode_token = request, index, decode_token
        include = params.include_stop_str_in_output
        self.text = IncrementalText(detokenize, params.stop, params.min_tokens, include)
        self.num_tokens = 0  # the tokens taken in so far
        self.completion = CompletionOutput(index, "", [], None)
        self.finished = False
        # Its outputs' lists, appended to, never copied whole (a copy a token grew with the output);
        # each output hands out these same lists, which grow: vLLM's cumulative outputs' too.
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] = []  # one per token, where asked
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list | None = None  # made at the first report, where asked: all in

    def logprob_dict(self, entry: tuple) -> dict[int, Logprob]:
        """A position's {token id: Logprob} from the workers' entry (logprobs_of): the given token
        first, then the k likeliest, ranked 1 to k (one entry fewer if the given is among them)."""
        token_ids, logprobs, rank = entry
        ranks = [rank, *range(1, len(token_ids))]
        return {
            token_id: Logprob(logprob, rank, self.decode_token(token_id))
            for token_id, logprob, rank in zip(token_ids, logprobs, ranks)
        }

    def update(self, num_tokens: int, finished: bool) -> None:
        """Take in the engine's report: the request had `num_tokens` tokens then (maybe more since)
        and maybe finished. A token ending mid-character is an output, with no text yet (vLLM's)."""
        request, text = self.request, self.text
        if request.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None, *map(self.logprob_dict, request.prompt_logprobs)]
        # An engine "stop" is an EOS or stop token: in token_ids, left out of the text, as in vLLM
        # (include_stop_str_in_output: in it)
        end = num_tokens - (finished and request.finish_reason == "stop" and not text.include_stop)
        if request.params.stop:  # every token, in order: the one that completes a stop string
            ends = list(range(self.num_tokens + 1, end + 1))
        else:
            ends = [end] if end > self.num_tokens else []
        if finished and text.pending and not ends:  # the half of a character the output ends in
            ends = [end]
        for upto in ends:
            text.add(request.output_token_ids, upto, final=finished and upto == end)
            if text.found is not None:
                break
        self.num_tokens = max(self.num_tokens, end)
        if text.found is not None:
            self.finished, num_tokens = True, text.num_tokens_at_stop
            reason, stop_reason = "stop", text.found[1]
        elif finished:
            self.finished, reason, stop_reason = True, request.finish_reason, request.stop_reason
        else:
            reason = stop_reason = None
        new = slice(len(self.token_ids), num_tokens)  # (at a stop string: to the one ending it)
        self.token_ids += request.output_token_ids[new]
        self.completion = CompletionOutput(
            self.index, text.text(self.finished), self.token_ids, reason, stop_reason
        )
        if request.params.logprobs is not None:
            self.logprobs += map(self.logprob_dict, request.logprobs[new])
            for entry in request.logprobs[new]:  # in order, as one sum over all adds them
                self.cumulative_logprob += entry[1][0]
            self.completion.logprobs = self.logprobs
            self.completion.cumulative_logprob = self.cumulative_logprob


class OutputProcessor:
    """vLLM's OutputProcessor: the engine's reports as RequestOutputs, in the callers' threads. The
    engine core sees only token ids and finish reasons; text is made here, incrementally
    (IncrementalText), and a stop string found here aborts its request in the engine, as in vLLM."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def detokenize(self, token_ids: list[int], **special) -> str:
        """special: skip_special_tokens, spaces_between_special_tokens (a request's)."""
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, **special)

    def decode_token(self, token_id: int) -> str | None:
        """A token's text alone, special tokens written out: vLLM's Logprob.decoded_token."""
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def follow(
        self, groups: list[list[Request]], client: EngineClient, stream: bool
    ) -> Iterator[tuple[int, RequestState]]:
        """Hand the groups' requests to the engine; yield (a group's number, its sample's state) at
        each token or end. Leaving early (an exception, Ctrl-C, a closed stream) aborts the rest."""
        states = {
            r.request_id: (number, RequestState(r, index, self.detokenize, self.decode_token))
            for number, group in enumerate(groups)
            for index, r in enumerate(group)
        }
        outputs = client.add([r for group in groups for r in group], stream)
        unfinished = set(states)
        try:
            while unfinished:
                report = outputs.get()
                if isinstance(report, Exception):  # the same failure for every caller: a copy
                    raise type(report)(*report.args) from None
                request, num_tokens, finished = report
                number, state = states[request.request_id]
                if state.finished:
                    continue  # a stop string ended it here: the engine's later tokens are dropped
                state.update(num_tokens, finished)
                if state.finished:
                    unfinished.discard(request.request_id)
                    if not finished:
                        client.abort([request.request_id])
                yield number, state
        finally:
            if unfinished:
                client.abort(list(unfinished))


class GroupOutputs:
    """Every prompt's RequestOutput so far, each rebuilt when one of its samples changes."""

    def __init__(self, groups: list[list[Request]]):
        self.groups = groups
        self.completions = [
            [CompletionOutput(index, "", [], None) for index in range(len(group))]
            for group in groups
        ]
        self.num_finished = [0] * len(groups)
        self.prompt_logprobs = [None] * len(groups)  # its first sample's (all have the same)
        self.outputs = [self.request_output(number) for number in range(len(groups))]

    def update(self, number: int, state: RequestState) -> None:
        self.completions[number][state.index] = state.completion
        self.num_finished[number] += state.finished
        if state.index == 0:
            self.prompt_logprobs[number] = state.prompt_logprobs
        self.outputs[number] = self.request_output(number)

    def current(self) -> list[RequestOutput]:
        return list(self.outputs)

    def request_output(self, number: int) -> RequestOutput:
        """A prompt's output: named by its first sample's request, with its n completions."""
        first, completions = self.groups[number][0], self.completions[number]
        finished = self.num_finished[number] == len(completions)
        return RequestOutput(
            str(first.request_id),
            first.prompt,
            first.prompt_token_ids,
            list(completions),
            finished,
            self.prompt_logprobs[number],
            num_cached_tokens=first.num_cached_tokens,
        )


# The LLM: its arguments checked, the pieces made and put together -----------------------
def in_units(size: float) -> str:
    return f"{size / 2**30:,.1f} GiB" if size >= 2**30 else f"{size / 2**20:,.1f} MiB"


def check_process_can_start_workers() -> None:
    """Spawned workers re-import the main script, from its file, as children of this process."""
    if importing_main_for_spawn():
        sys.exit(
            "tinytp: a worker process, importing your script as spawn does, ran its LLM(...) "
            'too: put the code that creates the LLM under if __name__ == "__main__":'
        )
    main_file = getattr(sys.modules["__main__"], "__file__", None)
    if main_file is not None and not os.path.exists(main_file):
        raise RuntimeError(
            f"tinytp cannot start workers from a script read from {main_file}: save it to a file"
        )
    if mp.current_process().daemon:  # whose children multiprocessing forbids (an assert -O skips)
        raise RuntimeError(
            "tinytp cannot start workers from a daemonic process (a multiprocessing.Pool worker)"
        )


@dataclass
class CacheConfig:
    """vLLM's CacheConfig: the KV cache's arguments (check_vllm_arguments checks them)."""

    block_size: int
    gpu_memory_utilization: float
    kv_cache_memory_bytes: int | None
    enable_prefix_caching: bool


def check_vllm_arguments(
    others, seed, enforce_eager, cuda_graphs, trust_remote_code, generation_config, cache
) -> None:
    """vLLM's arguments that tinytp takes, each with the values it honours (one table: the rule
    and its words); any other (quantization, speculative_config, ..., and typos) refused."""
    for name in others:
        raise ValueError(
            f"LLM({name}=...): tinytp does not support {name}; it takes "
            f"{', '.join(list(inspect.signature(LLM).parameters)[:-1])}"
        )
    is_directory = isinstance(generation_config, str) and os.path.isdir(generation_config)
    part, size, memory = cache.gpu_memory_utilization, cache.block_size, cache.kv_cache_memory_bytes
    prefix = cache.enable_prefix_caching
    for name, value, valid, allowed in [
        ("seed", seed, seed is None or is_integer(seed) and 0 <= seed, "None or an integer >= 0"),
        (
            "enforce_eager",
            enforce_eager,
            enforce_eager is False or enforce_eager is True and not cuda_graphs,
            "False or True, and True only without cuda_graphs",
        ),
        (
            "trust_remote_code",
            trust_remote_code,
            trust_remote_code is False,
            "False: tinytp never runs a checkpoint's own code",
        ),
        ("gpu_memory_utilization", part, is_number(part) and 0 < part <= 1, "a number in (0, 1]"),
        ("block_size", size, is_integer(size) and size > 0, "an integer >= 1 (vLLM's default: 16)"),
        (
            "kv_cache_memory_bytes",
            memory,
            memory is None or is_integer(memory) and memory >= 1,
            "None or an integer >= 1",
        ),
        ("enable_prefix_caching", prefix, type(prefix) is bool, "True or False"),
        (
            "generation_config",
            generation_config,
            generation_config in ("auto", "vllm") or is_directory,
            "'auto' (the model's generation_config.json), 'vllm' (SamplingParams()'s defaults) "
            "or a directory holding a generation_config.json",
        ),
    ]:
        if not valid:
            raise ValueError(f"{name}={value!r} is not supported: it must be {allowed}")


def executor_class_for(backend: str | type) -> type:
    """distributed_executor_backend: vLLM's "mp" is ours; a class of one's own needs the three
    methods the engine calls. Either starts worker processes: first, can this process start them?"""
    check_process_can_start_workers()
    if backend == "mp":
        return Executor
    needed = ("collective_rpc", "execute_model", "shutdown")
    if not (isinstance(backend, type) and all(hasattr(backend, m) for m in needed)):
        raise ValueError(
            f"distributed_executor_backend must be 'mp' or an Executor class, got {backend!r}"
        )
    return backend


def check_max_model_len(config: ModelConfig, max_model_len: int | None) -> int:
    limit = config.max_position_embeddings
    max_model_len = max_model_len or min(limit, 4096)
    if not is_integer(max_model_len) or not 1 < max_model_len <= limit:
        raise ValueError(
            f"max_model_len must be an integer in 2..{limit} (the model's "
            f"max_position_embeddings), got {max_model_len}"
        )
    return max_model_len


def check_max_num_batched_tokens(value: int | None, max_num_seqs: int, tp: int, device: str) -> int:
    """vLLM V1's offline defaults: 4096 tokens a rank on CPU, 8192 on a GPU (vLLM's own is 16384
    on one of 70 GiB or more but an A100; tinytp keeps 8192); a default is never below
    max_num_seqs, the bound a given value must meet."""
    check_count("max_num_seqs", max_num_seqs)
    if value is None:
        value = max(max_num_seqs, 4096 * tp if device == "cpu" else 8192)
    if not is_integer(value) or value < max_num_seqs:  # vLLM's bound too
        raise ValueError(
            f"max_num_batched_tokens must be an integer >= max_num_seqs ({max_num_seqs}), so "
            f"that every running request's token fits a step; got {value!r}"
        )
    return value


def check_kv_cache(
    config: ModelConfig,
    tp: int,
    pp: int,
    device: str,
    dtype: str,
    cache: CacheConfig,
    max_num_seqs: int,
    max_model_len: int,
) -> int:
    """The blocks of the KV cache, on every rank: as many as kv_cache_memory_bytes holds (vLLM's:
    a rank's, GPU's, bytes), or by default max_num_seqs requests of max_model_len tokens' worth;
    and block 0, the null block. Refused if one request of max_model_len tokens would not fit, as
    vLLM refuses it, or if the memory has no room for them (check_memory). Pipeline parallelism:
    a rank caches its stage's layers only, and the stage with the most sets num_blocks."""
    size, memory_bytes = cache.block_size, cache.kv_cache_memory_bytes
    blocks_per_request = -(-max_model_len // size)
    layer_block = math.prod(kv_cache_shape(config, tp, 1, size))
    layers = max(len(stage_layers(config.num_layers, stage, pp)) for stage in range(pp))
    block_bytes = layers * layer_block * getattr(torch, dtype).itemsize
    if memory_bytes is None:
        num_blocks = max_num_seqs * blocks_per_request + 1
        sized_by = f"max_num_seqs={max_num_seqs}, max_model_len={max_model_len}"
    else:
        num_blocks, sized_by = memory_bytes // block_bytes, f"kv_cache_memory_bytes={memory_bytes}"
    if num_blocks - 1 < blocks_per_request:
        raise ValueError(
            f"kv_cache_memory_bytes={memory_bytes} holds {num_blocks} blocks of "
            f"{size} tokens ({block_bytes} bytes each, in {dtype}; block 0 is reserved), too "
            f"few for one request of max_model_len={max_model_len}: give at least "
            f"{(blocks_per_request + 1) * block_bytes}, or a smaller max_model_len"
        )
    kv_cache, part = (num_blocks, size, sized_by), cache.gpu_memory_utilization
    check_memory(config, tp, pp, device, dtype, kv_cache, part)
    return num_blocks


MEMINFO = "/proc/meminfo"  # the kernel's account of memory, MemAvailable among it


def check_memory(
    config: ModelConfig,
    tp: int,
    pp: int,
    device: str,
    dtype: str,
    kv_cache: tuple[int, int, str],
    gpu_memory_utilization: float,
) -> None:
    """The workers' weights and KV cache (one GPU's share: the fullest stage's rank's; or on cpu
    every rank's) against the memory they go in: one line now, not a worker the kernel kills as it
    loads (exit code -9). kv_cache: its blocks, their size, what chose them."""
    num_blocks, block_size, chosen_by = kv_cache
    memory = gpu_memory_utilization * (
        torch.cuda.get_device_properties(0).total_memory
        if device == "cuda"
        else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    )

    def size_of(dtype: str) -> int:
        return getattr(torch, dtype).itemsize

    def needed(dtype: str) -> tuple[int, int]:  # bytes of weights, of KV cache
        layer_cache = math.prod(kv_cache_shape(config, tp, num_blocks, block_size))
        stages = [  # a rank of each stage's
            (
                weight_bytes(config, TPGroup(0, tp), dtype, stage, pp),
                len(stage_layers(config.num_layers, stage, pp)) * layer_cache * size_of(dtype),
            )
            for stage in range(pp)
        ]
        if device == "cuda":
            return max(stages, key=sum)
        return tp * sum(weights for weights, _ in stages), tp * sum(kv for _, kv in stages)

    where = f"{in_units(memory)} of {'a GPU' if device == 'cuda' else 'this machine'}"
    # and no more than it can give now (MemAvailable): past that the kernel kills a worker
    with contextlib.suppress(OSError, StopIteration), open(MEMINFO) as meminfo:
        available = next(int(x.split()[1]) * 1024 for x in meminfo if x.startswith("MemAvailable:"))
        if device == "cpu" and available < memory:
            memory, where = available, f"{in_units(available)} this machine can give now"
    weights, kv_cache = needed(dtype)
    if weights + kv_cache <= memory:
        return
    if dtype == "float32" and sum(needed("bfloat16")) <= memory:  # a CPU without native bfloat16
        fix = f"dtype='bfloat16' (--dtype bfloat16) needs {in_units(sum(needed('bfloat16')))}"
    elif weights < memory:
        fix = "lower " + " or ".join(setting.split("=")[0] for setting in chosen_by.split(", "))
    elif device == "cuda":
        fix = "more GPUs (a larger tensor_parallel_size)"
    else:
        fix = "a machine with more memory"
    raise ValueError(
        f"{in_units(weights)} of weights and {in_units(kv_cache)} of KV cache ({chosen_by}) in "
        f"{dtype} need more than the {where}: {fix}"
    )


def check_engine_choices(device: str, cuda_graphs, load_format: str, async_scheduling, pp) -> None:
    if type(cuda_graphs) is not bool or cuda_graphs and device != "cuda":  # graphs of CUDA kernels
        raise ValueError(
            f"cuda_graphs must be False, or True on device 'cuda'; got {cuda_graphs!r} on {device}"
        )
    if cuda_graphs and pp > 1:  # a graph replays a whole model's step, not a stage's and its recv
        raise ValueError(
            f"cuda_graphs runs one pipeline stage only; got pipeline_parallel_size={pp}"
        )
    if load_format not in ("auto", "dummy"):
        raise ValueError(
            f"load_format must be 'auto' (safetensors) or 'dummy', got {load_format!r}"
        )
    if type(async_scheduling) is not bool:
        raise ValueError(f"async_scheduling must be True or False, got {async_scheduling!r}")


class LLM:
    """Generate text with a Llama checkpoint split over `tensor_parallel_size` processes.

    The arguments are vLLM's LLM's, for those it has (and cuda_graphs, its own). tokenizer: a
    directory or hub id (default: the model's). seed: where requests without one draw theirs from.
    generation_config: "auto" (the model's generation_config.json), "vllm" (SamplingParams()'s
    defaults) or a directory holding one. enforce_eager: no compiled steps (Worker.load_model), no
    cuda_graphs. trust_remote_code: False only (a checkpoint's code never runs).
    gpu_memory_utilization: the share of the memory (a GPU's; on cpu the machine's, no more than it
    can give now) that weights and KV cache may take. max_num_batched_tokens: the tokens one step
    may run (Scheduler). block_size: the KV cache's block, in tokens. kv_cache_memory_bytes: a
    rank's KV cache (default: max_num_seqs x max_model_len tokens' worth). enable_prefix_caching:
    V1's automatic prefix caching (KVCacheManager). Any other argument is refused by name."""

    def __init__(
        self,
        model: str | None = None,
        tensor_parallel_size: int = 1,
        device: str | None = None,
        dtype: str = "auto",
        max_num_seqs: int = 8,
        max_model_len: int | None = None,
        load_format: str = "auto",
        distributed_executor_backend: str | type = "mp",
        cuda_graphs: bool = False,
        async_scheduling: bool = False,
        *,
        tokenizer: str | None = None,
        seed: int | None = None,
        generation_config: str = "auto",
        enforce_eager: bool = False,
        trust_remote_code: bool = False,
        gpu_memory_utilization: float = 0.9,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        enable_prefix_caching: bool = True,
        pipeline_parallel_size: int = 1,
        **others,
    ):
        """Everything checked before any worker starts; then the pieces, put together."""
        executor_class = executor_class_for(distributed_executor_backend)
        cache = CacheConfig(
            block_size, gpu_memory_utilization, kv_cache_memory_bytes, enable_prefix_caching
        )
        vllm_arguments = (seed, enforce_eager, cuda_graphs, trust_remote_code)
        check_vllm_arguments(others, *vllm_arguments, generation_config, cache)
        self.model_dir = resolve_model(model)
        self.config = config = read_model_config(self.model_dir)
        tp, pp = check_parallel_sizes(config, tensor_parallel_size, pipeline_parallel_size)
        device, dtype = choose_device_and_dtype(config, tp, device, dtype, pp)
        self.max_model_len = max_len = check_max_model_len(config, max_model_len)
        budget = check_max_num_batched_tokens(max_num_batched_tokens, max_num_seqs, tp, device)
        check_engine_choices(device, cuda_graphs, load_format, async_scheduling, pp)
        num_blocks = check_kv_cache(config, tp, pp, device, dtype, cache, max_num_seqs, max_len)
        if load_format == "auto":
            check_checkpoint(config, self.model_dir)
        self._make_front_end(tokenizer, generation_config, seed)
        self.scheduler = self._make_scheduler(max_num_seqs, budget, num_blocks, cache, pp)
        workers = (tp, pp, device, dtype, max_num_seqs, max_len, load_format, cuda_graphs)
        kv_cache = {"num_blocks": num_blocks, "block_size": block_size}  # each worker's
        self.executor = executor_class(config, self.model_dir, *workers, enforce_eager, **kv_cache)
        # The engine loop: one thread drives the scheduler and executor; callers use its queues
        self.engine = EngineCore(self.scheduler, self.executor, async_scheduling)
        self.engine_client = EngineClient(self.engine)
        atexit.register(self.shutdown)  # registered after the executor's, so run before it

    def _make_scheduler(
        self, max_num_seqs: int, budget: int, num_blocks: int, cache: CacheConfig, pp: int
    ) -> Scheduler:
        """V1's scheduler over the paged KV cache's blocks, told the model's end-of-sequence ids."""
        eos_token_ids = self.processor.end_of_sequence_ids()
        blocks = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching)
        return Scheduler(max_num_seqs, self.max_model_len, budget, eos_token_ids, blocks, pp)

    def _make_front_end(self, tokenizer: str | None, generation_config: str, seed) -> None:
        """The callers' side: the tokenizer, the Processor (requests checked and made, with the
        model's sampling defaults) and the OutputProcessor (text from tokens)."""
        self.tokenizer = load_tokenizer(tokenizer, self.model_dir)
        defaults = {"auto": self.model_dir, "vllm": None}.get(generation_config, generation_config)
        self.processor = Processor(
            self.config, self.model_dir, self.tokenizer, self.max_model_len, defaults, seed
        )
        self.output_processor = OutputProcessor(self.tokenizer)

    def generate(
        self,
        prompts: str | dict | list[str | dict | list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for each prompt, in prompt order. A prompt is a string, a list of
        token ids, or vLLM's {"prompt": text} or {"prompt_token_ids": ids}; a bare string or dict
        is one prompt. sampling_params: one for all prompts, or one per prompt. Every prompt is
        checked before any runs: one bad prompt rejects the call."""
        from tqdm import tqdm

        groups = self.processor.make_groups(prompts, sampling_params)
        outputs, total = GroupOutputs(groups), sum(map(len, groups))
        disable = not use_tqdm or total < 2
        with tqdm(total=total, desc="generating", unit="sequence", disable=disable) as bar:
            for number, state in self.output_processor.follow(groups, self.engine_client, False):
                if state.finished:  # (only a request with stop strings is reported before)
                    outputs.update(number, state)
                    bar.update(1)
        return outputs.current()

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """The next message of a conversation ({"role", "content"} dicts), or of each in a list."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        args = (chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs)
        prompts = [self.chat_prompt(conversation, *args) for conversation in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def chat_prompt(self, conversation: list[dict], *args, **kwargs) -> dict:
        """A conversation as a prompt: Processor.chat_prompt (its arguments are chat's)."""
        return self.processor.chat_prompt(conversation, *args, **kwargs)

    def get_tokenizer(self):
        """The tokenizer (vLLM's LLM.get_tokenizer): None for a checkpoint without one."""
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use without SamplingParams (vLLM's; see generation_config)."""
        return self.processor.get_default_sampling_params()

    def stream(
        self, prompt: str | dict | list[int], sampling_params: SamplingParams | None = None
    ) -> Iterator[str]:
        """Yield one prompt's completion text as it is generated, a piece a token ("" for one in
        half of a character), the prompt checked now, not at the first piece. Closing it early
        (break, .close(), garbage collection) aborts the request: its slot is free within a step."""
        requests = self.processor.make_requests(prompt, sampling_params)
        if len(requests) > 1:
            raise ValueError(f"stream yields one completion: n must be 1, got {len(requests)}")
        return self._stream(requests)

    def _stream(self, requests: list[Request]) -> Iterator[str]:
        shown = ""
        for outputs in self._stream_outputs([requests]):
            text = outputs[0].outputs[0].text
            yield text[len(shown) :]
            shown = text

    def stream_outputs(
        self, prompts: str | dict | list, sampling_params: SamplingParams | list | None = None
    ) -> Iterator[list[RequestOutput]]:
        """generate's outputs as they grow (vLLM's AsyncLLM.generate streams one prompt, with
        asyncio): after each step that gave a sample a token (its text may wait for the rest of a
        character), every prompt's RequestOutput so far, in prompt order; a completion's
        finish_reason None until it ends, an output `finished` once all its samples are. Checked
        now, not at the first output; closing it early aborts the requests, as stream's does."""
        return self._stream_outputs(self.processor.make_groups(prompts, sampling_params))

    def _stream_outputs(self, groups: list[list[Request]]) -> Iterator[list[RequestOutput]]:
        outputs = GroupOutputs(groups)
        for number, state in self.output_processor.follow(groups, self.engine_client, True):
            outputs.update(number, state)
            yield outputs.current()

    def collective_rpc(
        self,
        method: str | Callable,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict | None = None,
    ) -> list:
        """Run `method` on every worker (Executor.collective_rpc), from the engine loop's thread."""
        return self.engine_client.call(
            lambda: self.executor.collective_rpc(method, timeout, args, kwargs)
        )

    def check_health(self) -> None:
        """Raise RuntimeError if the workers are gone (vLLM's check_health)."""
        self.engine_client.call(self.executor.check_health)

    def stats(self) -> dict:
        """The engine's counts so far: steps run, the most requests one step has run, and the
        tokens sampled for requests that had ended before their step's answer (async scheduling)."""
        return {**self.engine.stats, "dropped_tokens": self.scheduler.num_dropped_tokens}

    def get_metrics(self) -> list[Metric]:
        """vLLM's get_metrics() (Scheduler.make_metrics): counters since start, gauges now. Read in
        the caller's thread, not queued behind the running step (a long prefill: seconds), as
        vLLM's are read from its front end: each value is one number or length, read whole."""
        return self.scheduler.make_metrics()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's): False, and nothing forgotten, while requests run."""
        return self.engine_client.call(self.scheduler.kv_cache_manager.reset_prefix_cache)

    def shutdown(self) -> None:
        """Stop the engine loop (EngineClient.shutdown), then the workers; free shared memory."""
        atexit.unregister(self.shutdown)
        self.engine_client.shutdown()
        self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


# Command line -------------------------------------------------------------------------
DEFAULT_PROMPTS = ["Hello, my name is", "The capital of France is", "Tensor parallelism splits"]


def add_kv_cache_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's KV-cache flags (bench.py's too)."""
    add = parser.add_argument_group("KV cache").add_argument
    add("--block-size", type=int, default=16, help="tokens per KV-cache block")
    memory = "a rank's KV cache (default: max_num_seqs x max_model_len tokens' worth)"
    add("--kv-cache-memory-bytes", type=int, default=None, help=memory)
    reuse = "reuse the KV cache of a prompt's longest cached prefix (default: on, as vLLM V1)"
    add("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True, help=reuse)


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's flags, vLLM's names: the command line's and serve.py's (engine_arguments)."""
    add = parser.add_argument
    add("--model", help="checkpoint directory or hub id (default: a tiny random Llama)")
    add("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=1, help="ranks")
    stages = "pipeline stages, each of tp ranks, a share of the layers each"
    add("--pp", "-pp", "--pipeline-parallel-size", dest="pp", type=int, default=1, help=stages)
    add("--device", choices=["cpu", "cuda"], help="default: cuda where GPUs are visible, else cpu")
    auto = "auto: the checkpoint's (on cpu: bfloat16 where the CPU has it, else float32)"
    dtypes = ["auto", "float32", "bfloat16", "float16", "half", "float"]  # vLLM's names
    add("--dtype", choices=dtypes, default="auto", help=auto)
    add("--max-num-seqs", type=int, default=8)
    add("--max-model-len", type=int, default=None)
    budget = "the tokens one step may run (default: 4096 a rank on cpu, 8192 on cuda)"
    add("--max-num-batched-tokens", type=int, default=None, help=budget)
    add_kv_cache_flags(parser)
    add("--cuda-graphs", action="store_true", help="replay decode steps as CUDA graphs (opt-in)")
    add("--enforce-eager", action="store_true", help="no compiled decode steps (one CPU rank)")
    ahead = "send each step while the one before it runs (two steps in flight)"
    add("--async-scheduling", action="store_true", help=ahead)


ENGINE_FLAGS = ("device", "dtype", "max_num_seqs", "max_model_len", "max_num_batched_tokens")
ENGINE_FLAGS += ("block_size", "kv_cache_memory_bytes", "enable_prefix_caching")
ENGINE_FLAGS += ("cuda_graphs", "enforce_eager", "async_scheduling")


def engine_arguments(args: argparse.Namespace) -> dict:
    """LLM's keyword arguments from add_engine_flags' flags (but --model)."""
    sizes = {"tensor_parallel_size": args.tp, "pipeline_parallel_size": args.pp}
    return sizes | {name: vars(args)[name] for name in ENGINE_FLAGS}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tinytp.py", description=__doc__.split("\n")[0])
    add_engine_flags(parser)
    add = parser.add_argument
    add("--prompt", action="append", help="a prompt; repeat for a batch")
    add("--max-tokens", type=int, default=128)
    sampling = "sampling (with none of these: from the model's generation_config.json)"
    add_sampling = parser.add_argument_group(sampling).add_argument
    add_sampling("--temperature", type=float, help="0 is greedy")
    add_sampling("--top-p", type=float)
    add_sampling("--top-k", type=int, help="0 or -1: all tokens")
    add_sampling("--min-p", type=float)
    add("--seed", type=int, default=None)
    add("--stop", action="append", help="end the text before this string; repeat for more")
    add("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens")
    add("--no-chat-template", action="store_true", help="send the prompt text as it is")
    parser.set_defaults(max_num_seqs=None)  # run(): a row per prompt (at most 8), no graph for more
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    """The command line's run: every argument checked before anything loads."""
    sampling = ("temperature", "top_p", "top_k", "min_p")
    chosen = {name: vars(args)[name] for name in sampling if vars(args)[name] is not None}
    others = {name: vars(args)[name] for name in ("max_tokens", "seed", "stop", "ignore_eos")}
    params = SamplingParams(**chosen, **others)  # checked now, before anything loads
    prompts = args.prompt or DEFAULT_PROMPTS
    args.max_num_seqs = min(8, len(prompts)) if args.max_num_seqs is None else args.max_num_seqs
    if not all(prompts):
        raise ValueError("empty --prompt: give at least one character")
    model_dir = resolve_model(args.model)
    if not has_tokenizer(model_dir):  # said now, not after minutes of loading
        raise ValueError(f"{model_dir} has no tokenizer files, so it cannot take text prompts")
    if not chosen:
        params = replace(default_sampling_params(model_dir), **others)
    with LLM(model_dir, **engine_arguments(args)) as llm:
        if args.model is None:
            gibberish = "a tiny Llama with RANDOM weights, so its text is gibberish"
            print(f"tinytp: no --model given: running {gibberish}", file=sys.stderr)
        template = llm.tokenizer.chat_template and not args.no_chat_template
        inputs = [
            llm.chat_prompt([{"role": "user", "content": p}]) if template else p for p in prompts
        ]
        if len(prompts) == 1:  # stream a single completion as it is generated
            pieces = llm.stream(inputs[0], params)  # checks the prompt before anything is printed
            print(f"Prompt: {prompts[0]!r}\nOutput: ", end="", flush=True)
            for piece in pieces:
                print(piece, end="", flush=True)
            print()
        else:
            for prompt, output in zip(prompts, llm.generate(inputs, params)):
                print(f"Prompt: {prompt!r}\nOutput: {output.outputs[0].text!r}\n")


def main(argv: list[str] | None = None) -> int:
    return exit_code(lambda: run(parse_args(argv)))


def exit_code(command: Callable[[], int | None]) -> int:
    """Run a command line (tinytp.py's, serve.py's): its exit code, 0, or 2 (the user's mistake)."""
    try:
        return command() or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"tinytp: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as `yes | head` does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else exit's flush fails
        return 141  # 128 + SIGPIPE, as a shell reports it
    except (RuntimeError, OSError) as e:  # a worker failed or died, /dev/shm full: not user error
        print(f"tinytp: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("tinytp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
