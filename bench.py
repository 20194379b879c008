"""Benchmarks for tinytp: the driver-to-worker IPC, and end-to-end latency.

    python bench.py --ipc                         # shared memory vs Pipe, Queue and gloo
    python bench.py                               # latency of a default model, random weights
    python bench.py --tp 2 --input-len 128 --output-len 256
    python bench.py --compare                     # tinytp tp=1, tp=2, in-process, transformers
    python bench.py --concurrency 8               # 8 callers at once against the same 8 one by one
    python bench.py --serve --concurrency 8 --model DIR  # the same over HTTP: 8 clients of serve.py
    python bench.py --async-scheduling            # the next step sent while the one before it runs
    python bench.py --trace --tp 2                # one decode step across the processes, one clock
    python bench.py --explain --tp 4 --model tiny-llama   # how a checkpoint is cut: nothing runs
    python bench.py --write-gguf bench.gguf       # the same model for llama.cpp (needs gguf)
    python bench.py --arrival-prompt-len 1024 --max-num-batched-tokens 256  # a long prompt arrives
    python bench.py --output-path 6000 --beside-prompts 1500  # text made per new token
    python bench.py --chat-history-len 900 --model smollm2   # turn 2's TTFT, prefix caching on/off
    python bench.py --capacity-len 500 --kv-cache-memory-bytes 1073741824  # requests held at once
    python bench.py --logprobs 5 --model smollm2  # a decode step with logprobs=5 against none
    python bench.py --device cuda --tp 2 --config llama-3.1-8b-instruct.json  # 8B, random weights

The latency mode speaks the language of vLLM's benchmarks/benchmark_latency.py: the same options and
defaults, random token-id prompts, exactly --output-len tokens per sequence, and the same output
lines, so its numbers sit next to those in vLLM pull request #9856 ("[V1] Multiprocessing Tensor
Parallel Support for v1"). It adds what explains them: the prefill and decode step times, the
executor's overhead per step, and how close a decode step comes to the memory-bandwidth limit.

Reads top to bottom: the IPC benchmark (one writer, two reader processes, four transports), then the
latency benchmark (the model, the backends, the roofline, the report), the same model written for
llama.cpp, then `--compare` and the command line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import gc
import itertools
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

import tinytp
from checkpoints import (
    TINY_MODEL_DIR,
    check_tensor_parallel_size,
    checkpoint_shapes,
    config_from_dict,
    read_config,
    resolve_model,
)
from model import (
    ModelConfig,
    TPGroup,
    init_dummy_weights,
    kv_cache_shape,
    vocab_rows_per_rank,
    weight_bytes,
)
from worker import (
    MessageQueue,
    ModelRunnerOutput,
    RPCCall,
    RPCResult,
    SamplingParams,
    SchedulerOutput,
    Worker,
    decode,
    encode,
)

CORES = len(os.sched_getaffinity(0))

# --------------------------------------------------------------------------------------
# The IPC benchmark: one writer (this process), two readers, reader 0 replies
# --------------------------------------------------------------------------------------

READERS = 2  # the workers of a tp=2 run
ITERATIONS = {"small": 2000, "64k": 500, "16m": 30}  # timed round trips per message size
IDLE_SECONDS = 2.0
REPLY = RPCResult(1, ModelRunnerOutput(list(range(8)), 0.0))  # rank 0's answer to a decode step


def ipc_messages() -> dict[str, object]:
    """A decode step of 8 running requests, exactly as the Executor sends it (about 150
    bytes encoded), and two raw payloads."""
    step = SchedulerOutput(
        new_requests=[], scheduled_ids=list(range(8)), num_scheduled_tokens=[1] * 8, finished_ids=[]
    )
    return {
        "small": RPCCall(1, "execute_model", (step,), unique_reply_rank=0),
        "64k": bytes(64 << 10),
        "16m": bytes(16 << 20),
    }


class Transport:
    """One way to talk. The writer calls send(message), which reaches every reader, and
    receive(), which returns reader 0's reply. Reader r's process gets reader_args[r] and
    calls reader_side(r, *reader_args[r]), which returns its (receive, reply) functions.
    Every transport carries the same bytes: messages pickled as the MessageQueue does
    (worker.encode), so what differs is only how the bytes travel."""

    def connect(self) -> None:
        """Called once the readers have started."""

    def close(self) -> None:
        pass


class ShmTransport(Transport):
    """tinytp's MessageQueue: one broadcast queue and a reply queue, as the Executor has."""

    def __init__(self, context):
        self.calls = MessageQueue.create(num_readers=READERS)
        self.replies = MessageQueue.create(num_readers=1, reader=0)
        self.send, self.receive = self.calls.enqueue, self.replies.dequeue
        self.reader_args = [(self.calls.handle, self.replies.handle)] * READERS

    @staticmethod
    def reader_side(reader, calls, replies):
        return MessageQueue.attach(calls, reader=reader).dequeue, MessageQueue.attach(
            replies
        ).enqueue

    def close(self):
        self.calls.close()
        self.replies.close()


class PipeTransport(Transport):
    """multiprocessing.Pipe, one per reader. The message is encoded once and its bytes sent
    down each pipe: Pipe at its best."""

    def __init__(self, context):
        ends = [context.Pipe() for _ in range(READERS)]
        self.pipes = [ours for ours, _ in ends]
        self.reader_args = [(theirs,) for _, theirs in ends]

    @staticmethod
    def reader_side(reader, pipe):
        return lambda: decode(pipe.recv_bytes()), lambda reply: pipe.send_bytes(encode(reply))

    def send(self, message):
        data = encode(message)
        for pipe in self.pipes:
            pipe.send_bytes(data)

    def receive(self):
        return decode(self.pipes[0].recv_bytes())


class QueueTransport(Transport):
    """multiprocessing.Queue, one per reader, and one for the replies."""

    def __init__(self, context):
        self.queues, self.replies = [context.Queue() for _ in range(READERS)], context.Queue()
        self.reader_args = [(queue, self.replies) for queue in self.queues]

    @staticmethod
    def reader_side(reader, queue, replies):
        return lambda: decode(queue.get()), lambda reply: replies.put(encode(reply))

    def send(self, message):
        data = encode(message)
        for queue in self.queues:
            queue.put(data)

    def receive(self):
        return decode(self.replies.get())


def received(collective, src: int):
    """The object that a torch.distributed *_object_list call fills in."""
    box = [None]
    collective(box, src=src)
    return box[0]


class GlooTransport(Transport):
    """torch.distributed over gloo, 3 ranks (we are rank 0): broadcast_object_list out, and
    reader 0 (rank 1) replies with send_object_list, point to point: pickled like every
    other reply, and without making the third rank join in, as a broadcast back would."""

    def __init__(self, context):
        self.store = tinytp.loopback_store()
        self.reader_args = [(self.store.port,)] * READERS

    @staticmethod
    def reader_side(reader, port):
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        dist.init_process_group("gloo", store=store, rank=reader + 1, world_size=READERS + 1)
        return (
            lambda: decode(received(dist.broadcast_object_list, src=0)),
            lambda reply: dist.send_object_list([encode(reply)], dst=0),
        )

    def connect(self):  # joining waits for every rank, so only now that the readers exist
        dist.init_process_group("gloo", store=self.store, rank=0, world_size=READERS + 1)

    def send(self, message):
        dist.broadcast_object_list([encode(message)], src=0)

    def receive(self):
        return decode(received(dist.recv_object_list, src=1))

    def close(self):
        dist.destroy_process_group()


TRANSPORTS = {
    "shm": ShmTransport,
    "pipe": PipeTransport,
    "queue": QueueTransport,
    "gloo": GlooTransport,
}


def ipc_reader(transport: type, reader: int, args: tuple) -> None:
    """A reader process: take messages until None; reader 0 answers each, as rank 0 does."""
    receive, reply = transport.reader_side(reader, *args)
    while receive() is not None:
        if reader == 0:
            reply(REPLY)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc (in 10 ms clock ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        utime, stime = f.read().rsplit(")", 1)[1].split()[11:13]
    return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")


def measure_transport(transport: Transport, context) -> tuple[dict[str, np.ndarray], float]:
    """Per message size, the microseconds from sending to both readers until reader 0's
    reply is in (the first tenth of the round trips warms up and is dropped); then the
    fraction of a core the busiest reader burns while nothing comes for IDLE_SECONDS."""
    readers = [
        context.Process(target=ipc_reader, args=(type(transport), r, args), daemon=True)
        for r, args in enumerate(transport.reader_args)
    ]
    for process in readers:
        process.start()
    try:
        transport.connect()
        times = {}
        for size, message in ipc_messages().items():
            samples = []
            for _ in range(ITERATIONS[size] * 11 // 10):
                start = time.perf_counter()
                transport.send(message)
                transport.receive()
                samples.append(time.perf_counter() - start)
            times[size] = np.array(samples[-ITERATIONS[size] :]) * 1e6
        time.sleep(0.5)  # reader 1, who never replies, may still be reading the last message
        before = [cpu_seconds(p.pid) for p in readers]
        time.sleep(IDLE_SECONDS)
        idle = max(cpu_seconds(p.pid) - b for p, b in zip(readers, before)) / IDLE_SECONDS
        transport.send(None)
    finally:
        for process in readers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        transport.close()
    return times, idle


def run_ipc() -> dict:
    """Time every transport; print a table, the ratios to shm and the machine's load; return it
    all."""
    context = mp.get_context("spawn")
    roundtrip, throughput, idle = {}, {}, {}
    for name, transport in TRANSPORTS.items():
        print(f"timing {name} ...", file=sys.stderr, flush=True)
        times, idle[name] = measure_transport(transport(context), context)
        roundtrip[name] = {
            size: {"p50": float(np.median(t)), "p99": float(np.percentile(t, 99))}
            for size, t in times.items()
        }
        throughput[name] = (16 << 20) / (roundtrip[name]["16m"]["p50"] * 1e-6) / 1e9

    print(
        f"\nRound trip: writer -> {READERS} readers -> reply from reader 0, in microseconds; "
        f"16m: GB/s = 16 MiB / median; idle: CPU of a reader waiting {IDLE_SECONDS:g} s"
    )
    print(
        f"{'':6}"
        + "".join(f"{size + ' p50':>11}{size + ' p99':>11}" for size in ITERATIONS)
        + "  16m GB/s   idle"
    )
    for name, by_size in roundtrip.items():
        cells = "".join(f"{s['p50']:11.1f}{s['p99']:11.1f}" for s in by_size.values())
        print(f"{name:6}{cells}{throughput[name]:10.2f}{idle[name]:7.1%}")
    small = {name: by_size["small"]["p50"] for name, by_size in roundtrip.items()}
    # Reported, not judged: on a busy machine a reader waits for a core, which blurs the transports'
    # differences.
    print(
        f"\nsmall message, median: pipe / shm = {small['pipe'] / small['shm']:.1f}x, "
        f"queue / shm = {small['queue'] / small['shm']:.1f}x"
    )
    print(f"16 MiB through shm: {throughput['shm']:.2f} GB/s")
    print(f"idle MessageQueue reader: {idle['shm']:.1%} of a core")
    print(
        f"load while timing: {os.getloadavg()[0]:.1f} processes wanting a core, of "
        f"{os.cpu_count()} cores "
        "(more than the cores: the figures above include waits for one)"
    )
    return {
        "roundtrip_us": roundtrip,
        "idle_reader_cpu": idle["shm"],
        "throughput_16m_gbps": throughput,
    }


# --------------------------------------------------------------------------------------
# The latency benchmark: the model
# --------------------------------------------------------------------------------------

# With no model named: a Llama of realistic proportions that a CPU runs in seconds (~56M
# parameters, 225 MB in float32: far larger than the caches, so decode is memory-bound).
DEFAULT_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1408,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}


def model_source(args, workdir: str) -> tuple[str, str]:
    """The checkpoint directory and load format to run. Dummy weights need no weight
    files, only a config.json, which goes alone into `workdir` (no tokenizer either:
    the prompts are token ids)."""
    load_format = args.load_format or ("auto" if args.model and not args.config else "dummy")
    if load_format == "auto":
        if args.config or not args.model:
            raise ValueError(
                "--load-format auto reads weights: name a checkpoint with --model "
                "(--config gives shapes only, for --load-format dummy)"
            )
        return resolve_model(args.model), load_format
    if args.config:
        shutil.copy(args.config, os.path.join(workdir, "config.json"))
    elif args.model:
        shutil.copy(os.path.join(resolve_model(args.model, weights=False), "config.json"), workdir)
    else:
        with open(os.path.join(workdir, "config.json"), "w") as f:
            json.dump(DEFAULT_CONFIG, f)
    return workdir, load_format


def settings_config(args) -> ModelConfig:
    """The config a run of these settings would use: --config, --model's, or the default."""
    if args.config:
        return read_config(args.config)
    if args.model:
        return read_config(os.path.join(resolve_model(args.model, weights=False), "config.json"))
    return config_from_dict(DEFAULT_CONFIG)


# --------------------------------------------------------------------------------------
# The latency benchmark: backends
# --------------------------------------------------------------------------------------


@dataclass
class Step:
    prefill: bool
    seconds: float  # measured in the driver, around the step
    worker_seconds: float | None = None  # measured inside the worker (tinytp only)


class InProcessExecutor:
    """tinytp's Worker called directly in this process (vLLM's "uni" executor): no worker
    processes and no queues. It has the Executor's constructor and methods, so LLM takes it
    as its distributed_executor_backend and runs its scheduler and loop on top unchanged, and
    the difference from a tp=1 run of the real Executor is the cost of multiprocessing."""

    def __init__(
        self,
        config,
        model_dir,
        tp,
        device,
        dtype,
        max_num_seqs,
        max_model_len,
        load_format="auto",
        cuda_graphs=False,
        *,
        num_blocks,
        block_size,
        enforce_eager=False,
        blocks_fit=False,
    ):
        if tp != 1:
            raise ValueError(f"--backend inprocess runs one rank: use --tp 1, not {tp}")
        self.store = tinytp.loopback_store()
        self.worker = Worker(0, 1)
        self.collective_rpc("init_device", args=(device, dtype, self.store.port, CORES))
        model = (config, model_dir, max_model_len, max_num_seqs, load_format, enforce_eager)
        self.collective_rpc("load_model", args=(*model, blocks_fit))
        self.collective_rpc(
            "init_kv_cache", args=(num_blocks, block_size, max_num_seqs, cuda_graphs)
        )

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        call = method if callable(method) else getattr(Worker, method)
        return [call(self.worker, *args, **(kwargs or {}))]

    def execute_model(self, scheduler_output, non_block=False):
        # done when it returns: nothing to overlap
        output = self.worker.execute_model(scheduler_output)
        return tinytp.StepFuture(lambda: output) if non_block else output

    def shutdown(self):
        self.worker.close()


def lm_head_is_packed(worker: Worker) -> bool:  # run in the workers, through collective_rpc
    return worker.model.lm_head.packed_weight is not None


def steps_compiled(worker: Worker) -> bool:  # run in the workers: Worker.load_model's choice
    return worker.model.compiled is not None


def parameter_bytes(worker: Worker) -> int:  # run in the workers: the bytes of weights a rank holds
    """Tied ones once, packed ones in place of the plain ones."""
    packed = [
        m.packed_weight
        for m in worker.model.modules()
        if getattr(m, "packed_weight", None) is not None
    ]
    return sum(t.numel() * t.element_size() for t in [*worker.model.parameters(), *packed])


def next_step_counts(worker: Worker, reset: bool = False) -> tuple[int, int]:  # run in the workers
    """The steps this rank ran, and at how many of them the next step was already in its queue when
    it finished (counted by worker_main): then; and, with reset, from now on."""
    counts = (worker.steps_run, worker.steps_with_the_next_waiting)
    if reset:
        worker.steps_run = worker.steps_with_the_next_waiting = 0
    return counts


def timed(executor_class: type, steps: list[Step]) -> type:
    """`executor_class` with each step timed in the driver, into `steps`: from its sending, or from
    the answer to the step before if that came later (with async scheduling a step is sent while
    the one before it runs), to its answer."""

    class TimedExecutor(executor_class):
        last_answer = 0.0

        def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False):
            sent = time.perf_counter()
            step = super().execute_model(scheduler_output, True)

            def result() -> ModelRunnerOutput:
                output = step.result()
                answered = time.perf_counter()
                prompts = (
                    bool(scheduler_output.new_requests)
                    or max(scheduler_output.num_scheduled_tokens) > 1
                )
                steps.append(
                    Step(prompts, answered - max(sent, self.last_answer), output.execute_seconds)
                )
                self.last_answer = answered
                return output

            return tinytp.StepFuture(result) if non_block else result()

    return TimedExecutor


class EngineBackend:
    """tinytp's LLM (or, for --backend inprocess, LLM on an InProcessExecutor), with each
    executor.execute_model call timed in the driver."""

    def __init__(self, args, model_dir, load_format, device, dtype, prompts):
        inprocess = args.backend == "inprocess"
        self.steps: list[Step] = []
        executor_class = timed(InProcessExecutor if inprocess else tinytp.Executor, self.steps)
        self.llm = tinytp.LLM(
            model_dir,
            args.tp,
            device,
            dtype,
            max_num_seqs=len(prompts),
            max_model_len=args.input_len + args.output_len,
            load_format=load_format,
            distributed_executor_backend=executor_class,
            cuda_graphs=args.cuda_graphs,
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
            max_num_batched_tokens=args.max_num_batched_tokens,
            **kv_cache_arguments(args),
        )
        self.prompts = prompts
        self.params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
        self.parameter_bytes = max(self.llm.collective_rpc(parameter_bytes))
        # A tied head packed for the CPU has a copy of its own (choose_cpu_kernels): the table then
        # serves only the embedding's few rows.
        tied = self.llm.config.tie_word_embeddings
        self.head_reads_table = tied and not all(self.llm.collective_rpc(lm_head_is_packed))
        if args.cuda_graphs:
            self.mode = "CUDA graphs"
        elif all(self.llm.collective_rpc(steps_compiled)):
            self.mode = "decode steps compiled"
        else:
            self.mode = "eager"
        self.threads = (
            f"1 process (the worker in-process) x {CORES} torch threads"
            if inprocess
            else f"{args.tp} worker process(es) x {tinytp.threads_per_rank(args.tp)} torch threads"
        )

    def generate(self) -> list[int]:
        # The same prompts every iteration, as vLLM's benchmark: each computed whole, not found in
        # the prefix cache, so that a prefill step is one.
        self.llm.reset_prefix_cache()
        return [
            len(o.outputs[0].token_ids)
            for o in self.llm.generate(self.prompts, self.params, use_tqdm=False)
        ]

    def count_next_steps(self, reset: bool = False) -> float | None:
        """The share of steps at which the next step was already waiting (the lowest of the ranks');
        None in-process, where no worker loop counts."""
        if isinstance(self.llm.executor, InProcessExecutor):
            return None
        shares = [
            waiting / run
            for run, waiting in self.llm.collective_rpc(next_step_counts, args=(reset,))
            if run
        ]
        return min(shares, default=None)

    def close(self):
        self.llm.shutdown()


class HFBackend:
    """The same shapes, dtype and prompts in transformers' generate: greedy, KV cache on,
    fixed length, an explicit attention mask. A step lasts from one forward call's start
    to the next one's (or the end of generate)."""

    def __init__(self, args, model_dir, load_format, device, dtype, prompts):
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        if args.tp != 1:
            raise ValueError(f"--backend hf runs on one device: use --tp 1, not {args.tp}")
        torch_dtype = getattr(torch, dtype)
        if load_format == "dummy":
            with torch.device(device):
                # never the checkpoint's code
                config = AutoConfig.from_pretrained(model_dir, trust_remote_code=False)
                self.model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
            init_dummy_weights(self.model)  # uniform in +-1e-3, as tinytp's dummy weights
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=torch_dtype, trust_remote_code=False
            ).to(device)
        self.model.eval()
        eos = read_config(os.path.join(model_dir, "config.json")).eos_token_ids or None
        input_ids = torch.tensor(prompts, device=device)
        self.inputs = {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "generation_config": GenerationConfig(
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                use_cache=True,
                eos_token_id=eos,
                pad_token_id=eos[0] if eos else 0,
            ),
        }
        self.starts: list[float] = []
        self.model.register_forward_pre_hook(
            lambda module, inputs: self.starts.append(time.perf_counter())
        )
        self.steps: list[Step] = []
        self.parameter_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.head_reads_table = self.model.config.tie_word_embeddings
        self.threads, self.mode = f"1 process x {CORES} torch threads", "eager"

    def count_next_steps(self, reset: bool = False) -> None:
        return None  # one process: nothing is sent to anyone

    def generate(self) -> list[int]:
        self.starts.clear()
        with torch.inference_mode():
            output = self.model.generate(**self.inputs)
        ends = self.starts[1:] + [time.perf_counter()]
        self.steps += [
            Step(i == 0, end - start) for i, (start, end) in enumerate(zip(self.starts, ends))
        ]
        return [output.shape[1] - self.inputs["input_ids"].shape[1]] * output.shape[0]

    def close(self):
        del self.model


# --------------------------------------------------------------------------------------
# The latency benchmark: the roofline and the report
# --------------------------------------------------------------------------------------


def memory_bandwidth(device: str, repeats: int = 5) -> tuple[float, str]:
    """The yardstick for a decode step, which reads every weight once (the issue's definition):
    the rate at which a sum reads a tensor far past any cache, bytes per second, best of
    `repeats`, as .ci/gpu measures it, and how it was measured. Not a copy: a copy also writes
    every byte it reads, and on a CPU reads at about half a sum's rate, which made a step look
    near its ceiling while llama.cpp's, reading the same weights, was far shorter
    (docs/performance.md)."""
    size = (1 << 29) if device == "cuda" else (1 << 27)  # 2 GiB on a GPU, 512 MiB on a CPU
    data = torch.ones(size, dtype=torch.float32, device=device)
    synchronize = torch.cuda.synchronize if device == "cuda" else lambda: None
    best = math.inf
    for _ in range(repeats + 1):  # the first warms up
        synchronize()
        start = time.perf_counter()
        data.sum()
        synchronize()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best, "read bandwidth (a sum)"


def decode_weight_bytes(
    parameter_bytes: int, config: ModelConfig, tp: int, dtype: str, head_reads_table: bool
) -> int:
    """Bytes of weights one rank reads in a decode step: all it holds but the embedding
    table, of which a step reads only one row per sequence (unless the LM head reads it)."""
    if head_reads_table:
        return parameter_bytes
    embedding_bytes = (
        vocab_rows_per_rank(config.vocab_size, tp)
        * config.hidden_size
        * getattr(torch, dtype).itemsize
    )
    return parameter_bytes - embedding_bytes


PERCENTAGES = [10, 25, 50, 75, 90, 99]


def report(
    latencies: list[float],
    steps: list[Step],
    weight_bytes: int,
    bandwidth: float,
    measured_by: str,
    memory: str,
) -> dict:
    """Print vLLM's lines, then the step figures; return them all for --output-json."""
    latencies = np.array(latencies)
    percentiles = np.percentile(latencies, PERCENTAGES)
    print(f"Avg latency: {np.mean(latencies)} seconds")
    for percentage, percentile in zip(PERCENTAGES, percentiles):
        print(f"{percentage}% percentile latency: {percentile} seconds")
    decode = [s for s in steps if not s.prefill]
    prefill = float(np.median([s.seconds for s in steps if s.prefill]))
    step = float(np.median([s.seconds for s in decode]))
    overhead = (
        None
        if decode[0].worker_seconds is None
        else float(np.median([s.seconds - s.worker_seconds for s in decode]))
    )
    achieved = weight_bytes / step
    print(f"Prefill step: {prefill * 1e3:.2f} ms; decode step: {step * 1e3:.2f} ms (medians)")
    if overhead is not None:
        print(
            f"Executor overhead per decode step: {overhead * 1e6:.0f} us ({overhead / step:.1%} "
            "of the step)"
        )
    print(
        f"Roofline: {weight_bytes / 1e6:.1f} MB of weights read from {memory} per decode step = "
        f"{achieved / 1e9:.2f} GB/s, of {bandwidth / 1e9:.2f} GB/s {measured_by}: "
        f"{achieved / bandwidth:.0%}"
    )
    return {
        "avg_latency": float(np.mean(latencies)),
        "latencies": latencies.tolist(),
        "percentiles": dict(zip(map(str, PERCENTAGES), percentiles.tolist())),
        "prefill_seconds": prefill,
        "decode_step_seconds": step,
        "executor_overhead_us": None if overhead is None else overhead * 1e6,
        "executor_overhead_fraction": None if overhead is None else overhead / step,
        "weight_bytes_per_decode_step": weight_bytes,
        "bandwidth_gbps": bandwidth / 1e9,
        "bandwidth_measured_by": measured_by,
        "roofline_fraction": achieved / bandwidth,
    }


def bench_inputs(
    args, workdir: str, count: int
) -> tuple[str, str, ModelConfig, str, str, list[list[int]]]:
    """The checkpoint directory and load format, its config, the device and dtype, and `count`
    random token-id prompts of --input-len tokens."""
    model_dir, load_format = model_source(args, workdir)
    config = read_config(os.path.join(model_dir, "config.json"))
    device, dtype = tinytp.choose_device_and_dtype(config, args.tp, args.device, args.dtype)
    prompts = (
        np.random.default_rng(0).integers(config.vocab_size, size=(count, args.input_len)).tolist()
    )
    return model_dir, load_format, config, device, dtype, prompts


def kv_cache_arguments(args) -> dict:
    """The KV cache's LLM arguments, from their flags."""
    return {
        "block_size": args.block_size,
        "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "enable_prefix_caching": args.enable_prefix_caching,
    }


def run_latency(args) -> dict:
    torch.set_num_threads(CORES)  # hf and inprocess compute here; the bandwidth too
    with tempfile.TemporaryDirectory(prefix="tinytp-bench-") as workdir:
        model_dir, load_format, config, device, dtype, prompts = bench_inputs(
            args, workdir, args.batch_size
        )
        backend = (HFBackend if args.backend == "hf" else EngineBackend)(
            args, model_dir, load_format, device, dtype, prompts
        )
        try:
            print(
                f"{args.backend}, tp={args.tp}, {device}, {dtype}, {load_format} weights, "
                f"{backend.mode}; threads: {backend.threads}"
            )
            for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
                backend.generate()
            backend.steps.clear()
            backend.count_next_steps(reset=True)
            latencies = []
            with cpu_hogs(args.hogs):
                for _ in tqdm(range(args.num_iters), desc="Profiling iterations"):
                    start = time.perf_counter()
                    lengths = backend.generate()
                    latencies.append(time.perf_counter() - start)
                    if set(lengths) != {args.output_len}:
                        raise RuntimeError(
                            f"generated {sorted(set(lengths))} tokens, not {args.output_len}"
                        )
            weight_bytes = decode_weight_bytes(
                backend.parameter_bytes, config, args.tp, dtype, backend.head_reads_table
            )
            next_step_ready = backend.count_next_steps()
        finally:
            backend.close()
    # The ranks on a CPU share one memory and its bandwidth; each GPU has its own.
    shared, memory = (args.tp, "memory") if device == "cpu" else (1, "each GPU")
    result = report(
        latencies, backend.steps, weight_bytes * shared, *memory_bandwidth(device), memory
    )
    if next_step_ready is not None:
        print(
            f"Next step already waiting when a worker finished a step: {next_step_ready:.0%} of "
            "the steps "
            f"({'async' if args.async_scheduling else 'sync'} scheduling; the lowest share of the "
            "ranks)"
        )
    return {
        "backend": args.backend,
        "tp": args.tp,
        "device": device,
        "dtype": dtype,
        "cuda_graphs": args.cuda_graphs,
        "async_scheduling": args.async_scheduling,
        "next_step_ready_fraction": next_step_ready,
        **result,
    }


# --------------------------------------------------------------------------------------
# Many callers: one prompt each, all at once, against the same prompts one after another
# --------------------------------------------------------------------------------------


def stream_token_times(
    llm, prompt: list[int], params: SamplingParams, times: list[float] | None = None
) -> list[float]:
    """One caller: its prompt streamed, and when each of its tokens came (its start first), into
    `times` if given: another thread may watch it grow."""
    times = [] if times is None else times
    times.append(time.perf_counter())
    for [output] in llm.stream_outputs([prompt], params):
        arrived = len(output.outputs[0].token_ids) - (len(times) - 1)
        times += [time.perf_counter()] * arrived
    return times


def serving_figures(callers: list[list[float]], wall: float) -> dict:
    """vLLM's benchmark_serving names: output tokens per second, time to first token, inter-token
    latency."""
    ttft = [times[1] - times[0] for times in callers]
    itl = [later - earlier for times in callers for earlier, later in zip(times[1:], times[2:])]
    return {
        "output_throughput": sum(len(times) - 1 for times in callers) / wall,
        "median_ttft_ms": float(np.median(ttft)) * 1e3,
        "p99_ttft_ms": float(np.percentile(ttft, 99)) * 1e3,
        "median_itl_ms": float(np.median(itl)) * 1e3,
        "p99_itl_ms": float(np.percentile(itl, 99)) * 1e3,
        "max_itl_ms": max(itl) * 1e3,
    }


def run_concurrency(args) -> dict:
    """--concurrency N: N caller threads at once, one prompt each (greedy, exactly --output-len
    tokens), on one LLM (the engine puts them in one running batch), against the same N prompts one
    after another on it."""
    with tempfile.TemporaryDirectory(prefix="tinytp-bench-") as workdir:
        model_dir, load_format, _, device, dtype, prompts = bench_inputs(
            args, workdir, args.concurrency
        )
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
        with tinytp.LLM(
            model_dir,
            args.tp,
            device,
            dtype,
            max_num_seqs=args.concurrency,
            max_model_len=args.input_len + args.output_len,
            load_format=load_format,
            cuda_graphs=args.cuda_graphs,
            enforce_eager=args.enforce_eager,
            async_scheduling=args.async_scheduling,
            **kv_cache_arguments(args),
        ) as llm:
            print(
                f"tinytp, tp={args.tp}, {device}, {dtype}, {load_format} weights, "
                f"{args.concurrency} callers, "
                f"{'async' if args.async_scheduling else 'sync'} scheduling"
            )
            stream_token_times(llm, prompts[0], params)  # warm-up
            llm.reset_prefix_cache()  # each phase computes the prompts whole
            start = time.perf_counter()
            one_by_one = [stream_token_times(llm, prompt, params) for prompt in prompts]
            sequential = serving_figures(one_by_one, time.perf_counter() - start)
            llm.reset_prefix_cache()
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                at_once = list(
                    pool.map(lambda prompt: stream_token_times(llm, prompt, params), prompts)
                )
            concurrent_run = serving_figures(at_once, time.perf_counter() - start)
            largest_batch = llm.stats()["largest_batch"]
    for name, figures in [("sequential", sequential), ("concurrent", concurrent_run)]:
        print(
            f"{name}: output token throughput {figures['output_throughput']:.1f} tok/s; "
            f"TTFT median {figures['median_ttft_ms']:.1f} ms, p99 {figures['p99_ttft_ms']:.1f} ms; "
            f"ITL median {figures['median_itl_ms']:.2f} ms, p99 {figures['p99_itl_ms']:.2f} ms"
        )
    speedup = concurrent_run["output_throughput"] / sequential["output_throughput"]
    print(
        f"concurrency speedup: {speedup:.2f}x the sequential tokens per second (largest batch: "
        f"{largest_batch})"
    )
    return {
        "concurrency": args.concurrency,
        "tp": args.tp,
        "device": device,
        "dtype": dtype,
        "async_scheduling": args.async_scheduling,
        "sequential": sequential,
        "concurrent": concurrent_run,
        "concurrency_speedup": speedup,
        "largest_batch": largest_batch,
    }


# --------------------------------------------------------------------------------------
# --explain: how the checkpoint is cut across the ranks, without running anything
# --------------------------------------------------------------------------------------


def explain(config: ModelConfig, tp: int, dtype: str) -> str:
    """Build every rank's model on the "meta" device (shapes, no memory) with the workers' code, and
    describe the cut: per checkpoint tensor its full shape, a rank's slice and split dimension, then
    bytes per rank, traffic per step."""
    itemsize = getattr(torch, dtype).itemsize
    padded_vocab = vocab_rows_per_rank(config.vocab_size, tp) * tp
    whole, mine = checkpoint_shapes(config), checkpoint_shapes(config, TPGroup(0, tp))
    lines = [
        f"{'checkpoint tensor (layer 0 of ' + str(config.num_layers) + ')':<48}{'full shape':>14}"
        f"{'rank 0 slice':>14}  split"
    ]
    for name, full_shape in whole.items():
        if ".layers." in name and ".layers.0." not in name:
            continue  # every layer is cut alike
        split = [dim for dim, (full, part) in enumerate(zip(full_shape, mine[name])) if part < full]
        how = f"dim {split[0]}" if split else "replicated"
        # the parts overlap or overhang
        if split and full_shape[split[0]] < mine[name][split[0]] * tp:
            how += (
                f", vocab padded to {padded_vocab}"
                if full_shape[0] == config.vocab_size
                else ", KV heads replicated"
            )
        lines.append(f"{name:<48}{str(full_shape):>14}{str(mine[name]):>14}  {how}")
    lines.append("")
    for rank in range(tp):
        held = weight_bytes(config, TPGroup(rank, tp), dtype)
        lines.append(
            f"rank {rank} holds {held:,} bytes of weights ({held / 2**20:,.1f} MiB, {dtype})"
        )
    hidden, vocab = config.hidden_size * itemsize, padded_vocab * itemsize
    lines += (
        ["", "communication: none (tp=1)"]
        if tp == 1
        else [
            "",
            "communication per decode step, per sequence in the batch:",
            f"  {2 * config.num_layers + 1} all-reduces of {hidden:,} bytes (2 per layer, after "
            "o_proj and down_proj, "
            "and 1 after the embedding)",
            f"  1 all-gather of the logits: {vocab // tp:,} bytes from each rank, {vocab:,} in all",
        ]
    )
    return "\n".join(lines)


def run_explain(args) -> dict:
    config = settings_config(args)
    check_tensor_parallel_size(config, args.tp)
    text = explain(
        config, args.tp, tinytp.choose_device_and_dtype(config, args.tp, args.device, args.dtype)[1]
    )
    print(text)
    return {"explain": text.splitlines()}


# --------------------------------------------------------------------------------------
# --trace: one decode step across the processes, on one clock
# --------------------------------------------------------------------------------------

TRACED_COLLECTIVES = ("all_reduce", "all_gather")  # the TPGroup methods timed


def start_trace(worker: Worker) -> None:  # run in the workers, through collective_rpc
    """Record (start, end, what, bytes) events in worker.trace by wrapping the step's, the
    collectives' and the reply queue's methods: the core's code stays as it is. perf_counter() is
    one clock in every process, so the timelines line up (on CUDA: launch times)."""
    events = worker.trace = []

    def timed(what: str, method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = method(*args, **kwargs)
            # a tensor's bytes
            events.append((start, time.perf_counter(), what, getattr(args[0], "nbytes", 0)))
            return result

        return run

    # a worker writes its replies only
    def replied(queue: MessageQueue, reply: RPCResult, *args, **kwargs) -> int:
        start = time.perf_counter()
        size = worker.enqueue(queue, reply, *args, **kwargs)
        if isinstance(reply.value, ModelRunnerOutput):  # a step's answer, not a call's
            events.append((start, time.perf_counter(), "replied", size))
        return size

    worker.execute_model = timed("got the step and ran execute_model", worker.execute_model)
    for name in TRACED_COLLECTIVES:  # instance attributes shadow the methods
        setattr(worker.group, name, timed(name, getattr(worker.group, name)))
    worker.enqueue, MessageQueue.enqueue = MessageQueue.enqueue, replied


def stop_trace(worker: Worker) -> list[tuple]:  # run in the workers, through collective_rpc
    for name in TRACED_COLLECTIVES:
        delattr(worker.group, name)
    del worker.execute_model
    MessageQueue.enqueue = worker.enqueue
    return worker.trace


def trace_decode_step(llm: tinytp.LLM, prompts: list[list[int]]) -> str:
    """A prefill and one decode step of `prompts`, every process recording what it does and when;
    the decode step's timeline by start time: the driver's broadcast and its wait for the answer
    (timed around the executor's execute_model, which the engine loop calls), each rank's step
    and collectives, rank 0's reply."""
    driver, execute_model = [], llm.executor.execute_model

    def timed_step(scheduler_output: SchedulerOutput, non_block: bool = False):
        start = time.perf_counter()
        step = execute_model(scheduler_output, True)
        sent = time.perf_counter()

        def result() -> ModelRunnerOutput:
            output = step.result()
            size = len(
                encode(RPCCall(0, "execute_model", (scheduler_output,), unique_reply_rank=0))
            )
            driver[:] = [start, sent, time.perf_counter(), size]
            return output

        return tinytp.StepFuture(result) if non_block else result()

    llm.executor.execute_model = timed_step  # shadows the method, for this generate
    llm.collective_rpc(start_trace)
    try:
        llm.generate(
            prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False
        )
    finally:
        del llm.executor.execute_model
        rank_events = llm.collective_rpc(stop_trace)
    start, sent, replied, size = driver  # the last step's: the decode
    return trace_timeline(
        driver, [[event for event in mine if event[0] >= start] for mine in rank_events]
    )


def trace_timeline(
    driver_call: tuple[float, float, float, int], rank_events: list[list[tuple]]
) -> str:
    """--trace's rows, process by process (the driver's broadcast and wait; each rank's), each in
    time order, all timed from the broadcast. Every rank runs the same collectives in the same
    order, so numbering them (#1, #2, ...) pairs a collective's rows across ranks."""
    start, sent, replied, size = driver_call

    def row(who: str, begin: float, end: float, what: str, nbytes: int) -> str:
        return (
            f"{(begin - start) * 1e6:9.0f} us  {who:<7} {what:<32} {(end - begin) * 1e6:7.0f} us  "
            + (f"{nbytes:,} bytes" if nbytes else "")
        )

    blocks = [
        [
            row("driver", start, sent, "broadcast execute_model", size),
            row("driver", sent, replied, "waited for the reply", 0),
        ]
    ]
    for rank, mine in enumerate(rank_events):
        collective_number = itertools.count(1)
        blocks.append(
            [
                row(
                    f"rank {rank}",
                    begin,
                    end,
                    f"#{next(collective_number)} {what}" if what in TRACED_COLLECTIVES else what,
                    nbytes,
                )
                for begin, end, what, nbytes in sorted(mine)
            ]
        )
    header = f"{'start':>12}  {'process':<7} {'event':<32} {'took':>10}  size\n"
    return header + "\n\n".join("\n".join(block) for block in blocks)


def batch_llm(args, workdir: str, count: int, max_model_len: int, **engine) -> tuple:
    """An LLM for --batch-size requests at once on bench_inputs' checkpoint (more of its arguments
    in `engine`), and bench_inputs' `count` prompts, config, device, dtype and load format."""
    model_dir, load_format, config, device, dtype, prompts = bench_inputs(args, workdir, count)
    llm = tinytp.LLM(
        model_dir,
        args.tp,
        device,
        dtype,
        max_num_seqs=args.batch_size,
        max_model_len=max_model_len,
        load_format=load_format,
        enforce_eager=args.enforce_eager,
        **engine,
    )
    return llm, prompts, config, device, dtype, load_format


def run_trace(args) -> dict:
    with tempfile.TemporaryDirectory(prefix="tinytp-bench-") as workdir:
        llm, prompts, *_ = batch_llm(args, workdir, args.batch_size, args.input_len + 2)
        with llm:
            report = trace_decode_step(llm, prompts)
    print(
        f"One decode step of {args.batch_size} sequences, tp={args.tp} (times from the driver's "
        f"broadcast):\n{report}"
    )
    return {"trace": report.splitlines()}


def arrival_figures(
    llm: tinytp.LLM, streams: list[list[int]], arrival: list[int], params: SamplingParams
) -> dict:
    """The streams decode; once each has 8 tokens the arriving prompt is sent (for 1 token). The
    streams' figures."""
    llm.reset_prefix_cache()  # the prompts computed whole every round: the budget is measured
    callers = [[] for _ in streams]

    def arrive() -> None:
        while min(map(len, callers)) <= 8:  # its start, then 8 tokens
            time.sleep(1e-3)
        llm.generate([arrival], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(streams) + 1) as pool:
        calls = [
            pool.submit(stream_token_times, llm, prompt, params, times)
            for prompt, times in zip(streams, callers)
        ]
        for call in [*calls, pool.submit(arrive)]:
            call.result()
    return serving_figures(callers, time.perf_counter() - start)


def run_arrival(args) -> dict:
    """The token budget at work: --batch-size - 1 streams of --input-len-token prompts decode
    --output-len tokens each, and a prompt of --arrival-prompt-len tokens arrives among them. Their
    inter-token latency (median, p99, max), with the prompt in chunks at --max-num-batched-tokens
    (default 256), and with its whole prefill in one step (as the engine ran it before the budget,
    then in a step of its own), in --rounds interleaved rounds."""
    torch.set_num_threads(CORES)
    budgets = {
        "chunked": args.max_num_batched_tokens or 256,
        "one step": args.arrival_prompt_len + args.batch_size,
    }
    with tempfile.TemporaryDirectory(prefix="tinytp-bench-") as workdir:
        max_model_len = max(args.input_len + args.output_len, args.arrival_prompt_len + 1)
        budget = max(budgets.values())
        llm, streams, config, device, dtype, load_format = batch_llm(
            args, workdir, args.batch_size - 1, max_model_len, max_num_batched_tokens=budget
        )
        arrival = (
            np.random.default_rng(1)
            .integers(config.vocab_size, size=args.arrival_prompt_len)
            .tolist()
        )
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
        with llm:
            print(
                f"tinytp, tp={args.tp}, {device}, {dtype}, {load_format} weights: {len(streams)} "
                "streams of "
                f"{args.output_len} tokens, a prompt of {args.arrival_prompt_len} arriving"
            )
            arrival_figures(llm, streams, arrival, params)  # warm-up
            rounds = {name: [] for name in budgets}
            for _ in range(args.rounds):
                for name, budget in budgets.items():
                    # (between calls: the engine loop is idle)
                    llm.scheduler.max_num_batched_tokens = budget
                    rounds[name].append(arrival_figures(llm, streams, arrival, params))
    keys = ("median_itl_ms", "p99_itl_ms", "max_itl_ms")
    print(
        f"{'inter-token latency':<28}{'median':>10}{'p99':>11}{'max':>11}   (medians of "
        f"{args.rounds} rounds)"
    )
    medians = {
        name: {key: statistics.median(r[key] for r in rounds[name]) for key in keys}
        for name in budgets
    }
    for name, budget in budgets.items():
        print(
            f"{f'{name}, budget {budget}':<28}"
            + "".join(f"{medians[name][key]:8.1f} ms" for key in keys)
        )
    each = [
        one["max_itl_ms"] / chunked["max_itl_ms"]
        for one, chunked in zip(rounds["one step"], rounds["chunked"])
    ]
    print(
        f"max, one step / chunked: {statistics.median(each):.2f} (rounds: "
        f"{', '.join(f'{r:.2f}' for r in each)})"
    )
    return {"budgets": budgets, "rounds": rounds, "medians": medians}


def long_checkpoint(workdir: str, max_position_embeddings: int) -> str:
    """tiny-llama with room for a long stream: its files, with max_position_embeddings raised
    (RoPE's table is computed for max_model_len: the weights are the same)."""
    path = os.path.join(workdir, "tiny-long")
    shutil.copytree(TINY_MODEL_DIR, path)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "max_position_embeddings": max_position_embeddings}, f)
    return path


# Stop strings that the tiny model's bytes do not spell: looked for at every token, never found.
NEVER_STOPS = ["\x00never\x00", "no such text"]


def mean_interval_ms(times: list[float], first: int, last: int) -> float:
    """The mean interval between a stream's tokens `first` and `last` (times: its start, then a
    time per token), in ms: a span, since tokens that end in half a character come together."""
    return (times[1 + last] - times[1 + first]) / (last - first) * 1e3


def gaps_ms(times: list[float]) -> np.ndarray:
    """The intervals between a stream's outputs, in ms (tokens that end in half a character come
    with the next: one output)."""
    return np.diff(np.unique(times[1:])) * 1e3


def stream_beside(llm, prompt: str, params, prompts: list[str], their_params) -> list:
    """The stream's token times while, from its 8th token on, a request of many prompts runs
    beside it (sent from another thread: tokenized, made into requests, admitted)."""
    times = []

    def submit() -> None:
        while len(times) <= 8:
            time.sleep(1e-3)
        llm.generate(prompts, their_params, use_tqdm=False)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(stream_token_times, llm, prompt, params, times), pool.submit(submit)]
        for call in calls:
            call.result()
    return times


def long_stream_figures(length: int, rounds: int) -> list[dict]:
    """One stream of `length` tokens on the tiny model (max_position_embeddings raised), with two
    stop strings that never match: the mean interval over tokens 5,500-5,900 against 200-600
    (the same shares of a shorter stream), and the worker's step over the same tokens (its
    attention reads more positions: the model's own cost, beside the output path's)."""
    early, late = (length // 30, length // 10), (length * 11 // 12, length * 59 // 60)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=length, stop=NEVER_STOPS)
    figures, steps = [], []
    with tempfile.TemporaryDirectory(prefix="tinytp-bench-") as workdir:
        path = long_checkpoint(workdir, length + 64)
        with tinytp.LLM(
            path, device="cpu", max_num_seqs=2, max_model_len=length + 16,
            distributed_executor_backend=timed(tinytp.Executor, steps),
        ) as llm:  # fmt: skip
            stream_token_times(llm, [256, 72, 105], replace(params, max_tokens=50))  # warm-up
            for _ in range(rounds):
                steps.clear()
                times = stream_token_times(llm, [256, 72, 105], params)
                # step i gives token i + 1 (step 0, the prefill, token 1)
                worker = [step.worker_seconds * 1e3 for step in steps]
                r = {
                    "tokens": [early, late],
                    "early_ms": mean_interval_ms(times, *early),
                    "late_ms": mean_interval_ms(times, *late),
                    "worker_early_ms": float(np.mean(worker[early[0] : early[1]])),
                    "worker_late_ms": float(np.mean(worker[late[0] : late[1]])),
                }
                r["late_over_early"] = r["late_ms"] / r["early_ms"]
                figures.append(r)
    return figures


def beside_figures(args, rounds: int) -> list[dict]:
    """A 200-token stream alone, then with a request of --beside-prompts text prompts sent beside
    it, on --model (default: tiny-llama): its longest interval beside them against its median
    alone."""
    prompt = "Tensor parallelism splits each weight matrix across devices, so that"
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=200)
    beside = [f"Prompt number {i} of many, a short one." for i in range(args.beside_prompts)]
    their_params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=4)
    figures = []
    with tinytp.LLM(
        resolve_model(args.model), args.tp, args.device, args.dtype, max_num_seqs=16,
        max_model_len=512, max_num_batched_tokens=args.max_num_batched_tokens,
    ) as llm:  # fmt: skip
        stream_token_times(llm, prompt, replace(params, max_tokens=20))  # warm-up
        for _ in range(rounds):
            alone = gaps_ms(stream_token_times(llm, prompt, params))
            crowded = gaps_ms(stream_beside(llm, prompt, params, beside, their_params))
            figures.append(
                {
                    "alone_median_ms": float(np.median(alone)),
                    "alone_max_ms": float(alone.max()),
                    "beside_median_ms": float(np.median(crowded)),
                    "beside_max_ms": float(crowded.max()),
                }
            )
            figures[-1]["ratio"] = figures[-1]["beside_max_ms"] / figures[-1]["alone_median_ms"]
    return figures


def run_output_path(args) -> dict:
    """The output path's cost per token, which grows neither with a request's length nor with the
    requests beside it: long_stream_figures, then beside_figures, --rounds rounds of each."""
    torch.set_num_threads(CORES)
    long = long_stream_figures(args.output_path, args.rounds)
    for r in long:
        (e0, e1), (l0, l1) = r["tokens"]
        print(
            f"a stream of {args.output_path} tokens, two stop strings: tokens {e0}-{e1} "
            f"{r['early_ms']:.2f} ms apart, {l0}-{l1} {r['late_ms']:.2f} ms "
            f"({r['late_over_early']:.2f}x); the worker's step {r['worker_early_ms']:.2f} and "
            f"{r['worker_late_ms']:.2f} ms"
        )
    beside = beside_figures(args, args.rounds)
    for r in beside:
        print(
            f"a 200-token stream: median {r['alone_median_ms']:.1f} ms alone (longest "
            f"{r['alone_max_ms']:.1f}); beside {args.beside_prompts} prompts median "
            f"{r['beside_median_ms']:.1f}, longest {r['beside_max_ms']:.1f} ms ({r['ratio']:.2f}x "
            "the median alone)"
        )
    return {"long_stream": long, "beside": beside, "beside_prompts": args.beside_prompts}


# --------------------------------------------------------------------------------------
# What asking for logprobs costs a decode step
# --------------------------------------------------------------------------------------


def run_logprobs(args) -> dict:
    """--logprobs K: --batch-size requests of --output-len tokens each, all asking for K logprobs
    per token, against the same requests asking for none, on one LLM, in --rounds interleaved
    rounds: each round's median decode step, timed in the driver (the step, rank 0's log-softmax
    and top-k, its reply) and in the worker, and the ratio of the driver's."""
    steps: list[Step] = []
    executor = timed(tinytp.Executor, steps)
    with tempfile.TemporaryDirectory(prefix="tinytp-bench-") as workdir:
        length = args.input_len + args.output_len
        llm, prompts, _, device, dtype, _ = batch_llm(
            args, workdir, args.batch_size, length, distributed_executor_backend=executor
        )
        greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        kinds = {
            "none": greedy,
            f"logprobs={args.logprobs}": replace(greedy, logprobs=args.logprobs),
        }
        rounds = {name: [] for name in kinds}
        with llm:
            for warm_up in [True] + [False] * args.rounds:
                for name, params in kinds.items():
                    steps.clear()
                    llm.generate(prompts, params, use_tqdm=False)
                    decodes = [step for step in steps if not step.prefill]
                    median = [statistics.median(s.seconds for s in decodes)]
                    median.append(statistics.median(s.worker_seconds for s in decodes))
                    rounds[name] += [] if warm_up else [median]
    (plain, asked), (none, some) = rounds.values(), kinds
    ratios = [a[0] / p[0] for p, a in zip(plain, asked)]
    for name, medians in rounds.items():
        step, worker = (statistics.median(m[i] for m in medians) * 1e3 for i in range(2))
        print(f"{name:>12}: a decode step {step:.2f} ms (in the worker {worker:.2f} ms)")
    print(
        f"tp={args.tp}, {device}, {dtype}, batch {args.batch_size}: {some} / {none}: "
        f"{statistics.median(ratios):.3f}x (the median of {args.rounds} rounds' ratios: "
        f"{', '.join(f'{r:.3f}' for r in ratios)})"
    )
    return {"rounds": rounds, "ratios": ratios}


# --------------------------------------------------------------------------------------
# The KV cache: a chat's second turn with and without prefix caching; requests held at once
# --------------------------------------------------------------------------------------


def chat_turns(llm: tinytp.LLM, history_len: int) -> tuple[float, float, int]:
    """A two-turn chat from an empty cache: a user message that makes a prompt of about
    history_len tokens, a reply of 32 tokens (greedy), then a question on it. Each turn's time to
    first token, and the tokens of turn 2 found in the prefix cache."""
    llm.reset_prefix_cache()
    sentence = "Tensor parallelism splits each weight matrix across devices. "
    words = len(llm.tokenizer(sentence, add_special_tokens=False).input_ids)
    conversation = [{"role": "user", "content": sentence * (history_len // words)}]
    turn_1 = llm.chat_prompt(conversation)
    params = SamplingParams(temperature=0, max_tokens=32)
    first = stream_token_times(llm, turn_1, params)
    reply = llm.generate([turn_1], params, use_tqdm=False)[0].outputs[0].text
    conversation += [
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Say that in one sentence."},
    ]
    hits_before = metric(llm, "vllm:prefix_cache_hits")
    second = stream_token_times(llm, llm.chat_prompt(conversation), params)
    return (
        first[1] - first[0],
        second[1] - second[0],
        metric(llm, "vllm:prefix_cache_hits") - hits_before,
    )


def metric(llm: tinytp.LLM, name: str) -> float:
    return next(m.value for m in llm.get_metrics() if m.name == name)


def run_chat(args) -> dict:
    """--chat-history-len N: a two-turn chat on --model (its chat template), turn 2's time to
    first token with prefix caching (the history's blocks found cached, only the new message
    computed) and without (all of it computed again), in --rounds interleaved rounds."""
    torch.set_num_threads(CORES)
    rounds = {True: [], False: []}
    with contextlib.ExitStack() as stack:
        llms = {
            caching: stack.enter_context(
                tinytp.LLM(
                    resolve_model(args.model),
                    args.tp,
                    args.device,
                    args.dtype,
                    max_model_len=args.chat_history_len + 256,
                    block_size=args.block_size,
                    enable_prefix_caching=caching,
                )
            )
            for caching in (True, False)
        }
        for llm in llms.values():
            chat_turns(llm, args.chat_history_len)  # warm-up
        for _ in range(args.rounds):
            for caching, llm in llms.items():
                rounds[caching].append(chat_turns(llm, args.chat_history_len))
    print(
        f"{'':22}{'turn 1 TTFT':>13}{'turn 2 TTFT':>13}{'cached':>8}   (medians of {args.rounds})"
    )
    for caching, results in rounds.items():
        turn_1, turn_2, cached = (statistics.median(r[i] for r in results) for i in range(3))
        name = "prefix caching" if caching else "no prefix caching"
        print(f"{name:22}{turn_1 * 1e3:10.1f} ms{turn_2 * 1e3:10.1f} ms{cached:8.0f}")
    each = [off[1] / on[1] for on, off in zip(rounds[True], rounds[False])]
    print(
        f"turn 2 TTFT, without / with: {statistics.median(each):.1f}x (rounds: "
        f"{', '.join(f'{r:.1f}' for r in each)})"
    )
    return {"rounds": {str(k): v for k, v in rounds.items()}, "ratios": each}


def run_capacity(args) -> dict:
    """--capacity-len N with --kv-cache-memory-bytes: how many requests of N tokens (a prompt of
    N - 1, one token generated) the paged KV cache holds at once, measured: the requests its first
    step admits, max_num_seqs and the budget out of the way; against how many contiguous slots of
    max_model_len positions the same bytes are (the cache before paging)."""
    torch.set_num_threads(CORES)
    with tempfile.TemporaryDirectory(prefix="tinytp-bench-") as workdir:
        model_dir, load_format, config, device, dtype, _ = bench_inputs(args, workdir, 0)
        block_bytes = (
            config.num_layers
            * math.prod(kv_cache_shape(config, args.tp, 1, args.block_size))
            * getattr(torch, dtype).itemsize
        )
        blocks = args.kv_cache_memory_bytes // block_bytes - 1  # less the null block
        count = blocks // math.ceil(args.capacity_len / args.block_size) + 1  # one too many
        prompts = (
            np.random.default_rng(0)
            .integers(config.vocab_size, size=(count, args.capacity_len - 1))
            .tolist()
        )
        with tinytp.LLM(
            model_dir,
            args.tp,
            device,
            dtype,
            max_num_seqs=count,
            load_format=load_format,
            max_num_batched_tokens=count * args.capacity_len,
            **kv_cache_arguments(args),
        ) as llm:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            paged, max_model_len = llm.stats()["largest_batch"], llm.max_model_len
    contiguous = args.kv_cache_memory_bytes // (max_model_len * block_bytes // args.block_size)
    print(
        f"{args.kv_cache_memory_bytes / 2**30:.2f} GiB of KV cache, {dtype}: {paged} requests of "
        f"{args.capacity_len} tokens at once, paged in blocks of {args.block_size} (measured); "
        f"{contiguous} in contiguous slots of max_model_len {max_model_len}"
    )
    return {"paged": paged, "contiguous": contiguous, "max_model_len": max_model_len}


# --------------------------------------------------------------------------------------
# The peer: the same shapes for llama.cpp
# --------------------------------------------------------------------------------------


# llama.cpp's names for a Llama checkpoint's tensors (as its convert_hf_to_gguf.py maps them).
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "model.layers.": "blk.",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(args) -> dict:
    """Write the benchmark's model (the default, --config's or --model's shapes) with random
    weights as a GGUF file that llama.cpp runs, and print the llama-batched-bench command for
    these settings: llama.cpp on the very shapes tinytp ran, with no checkpoint to convert.
    No tokenizer (llama.cpp's vocab type "none"; the benchmark feeds token ids) and no RoPE
    scaling tensor (plain RoPE costs the same). Needs `pip install gguf`."""
    try:
        import gguf
    except ImportError:
        raise ValueError("--write-gguf needs the gguf package: pip install gguf") from None
    config = settings_config(args)
    dtype = tinytp.choose_device_and_dtype(config, 1, "cpu", args.dtype)[1]
    matrix_dtype = getattr(torch, dtype)
    ggml_types = {
        torch.float32: gguf.GGMLQuantizationType.F32,
        torch.bfloat16: gguf.GGMLQuantizationType.BF16,
        torch.float16: gguf.GGMLQuantizationType.F16,
    }
    # renamed once complete: never half a model under its name
    partial = args.write_gguf + ".partial"
    writer = gguf.GGUFWriter(partial, "llama")
    hyperparameters = {
        "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size,
        "block_count": config.num_layers,
        "feed_forward_length": config.intermediate_size,
        "head_count": config.num_heads,
        "head_count_kv": config.num_kv_heads,
        "key_length": config.head_dim,
        "value_length": config.head_dim,
        "rope_dimension_count": config.head_dim,
        "rope_freq_base": config.rope_theta,
        "layer_norm_rms_eps": config.rms_norm_eps,
        "vocab_size": config.vocab_size,
    }
    # each under its llama.cpp key, e.g. llama.block_count
    for key, value in hyperparameters.items():
        getattr(writer, f"add_{key}")(value)
    writer.add_tokenizer_model("none")
    writer.add_file_type(
        {
            torch.float32: gguf.LlamaFileType.ALL_F32,
            torch.bfloat16: gguf.LlamaFileType.MOSTLY_BF16,
            torch.float16: gguf.LlamaFileType.MOSTLY_F16,
        }[matrix_dtype]
    )
    # GGUF name: (shape, dtype); norms stay float32, as llama.cpp's converter keeps them
    tensors = {}
    for name, shape in checkpoint_shapes(config).items():
        for theirs, ours in GGUF_NAMES.items():
            name = name.replace(theirs, ours)
        tensors[name] = (shape, matrix_dtype if len(shape) == 2 else torch.float32)
    # its bytes as ints of that width: numpy has no bfloat16
    for name, (shape, tensor_dtype) in tensors.items():
        width = tensor_dtype.itemsize
        writer.add_tensor_info(
            name,
            shape,
            np.dtype(f"int{8 * width}"),
            math.prod(shape) * width,
            ggml_types[tensor_dtype],
        )
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        generator = torch.Generator().manual_seed(0)
        for shape, tensor_dtype in tqdm(tensors.values(), desc="writing", unit="tensor", delay=1):
            # One tensor at a time (an 8B model's would not fit in memory at once); uniform in
            # +-1e-3, as the dummy weights of tinytp and transformers here.
            tensor = torch.empty(shape).uniform_(-1e-3, 1e-3, generator=generator).to(tensor_dtype)
            writer.write_tensor_data(
                tensor.view(getattr(torch, f"int{8 * tensor.itemsize}")).numpy()
            )
        writer.close()
        os.replace(partial, args.write_gguf)
    finally:  # interrupted or failed: no partial file left behind
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
    context = args.batch_size * (args.input_len + args.output_len)  # every sequence's own KV cache
    print(
        f"wrote {args.write_gguf}: {dtype}, random weights; time llama.cpp on it with\n"
        f"  llama-batched-bench -m {args.write_gguf} -c {context} -b 2048 -ub 512 -npp "
        f"{args.input_len} "
        f"-ntg {args.output_len} -npl {args.batch_size} -t {CORES}\n"
        f"(decode step = T_TG s / {args.output_len}; prefill = T_PP s)"
    )
    return {"gguf": args.write_gguf, "dtype": dtype}


# --------------------------------------------------------------------------------------
# --serve: many clients over HTTP against one at a time, on serve.py
# --------------------------------------------------------------------------------------


def stream_over_http(port: int, prompt: list[int], output_len: int) -> tuple[list[float], str]:
    """One client: its prompt streamed from /v1/completions, when each of its tokens came (its start
    first), as stream_token_times has them, and its text. Each chunk is a token's, its text "" where
    the token ends in half of a character (serve.py's and vLLM's), so each is timed, as vLLM's
    benchmark times them: timing only text would count such a token's step twice in the next gap."""
    import http.client

    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    times, text = [time.perf_counter()], ""
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    for line in connection.getresponse():
        event = json.loads(line[6:]) if line.startswith(b"data: {") else {}
        if event.get("choices"):
            times.append(time.perf_counter())
            text += event["choices"][0]["text"]
        if event.get("usage"):  # the last event: every token is in
            times += [times[-1]] * (event["usage"]["completion_tokens"] - (len(times) - 1))
    connection.close()
    return times, text


def serving_round(port: int, prompts: list[list[int]], output_len: int) -> dict:
    """One server's figures: the prompts one after another (1 client), then all at once (one client
    each); and the texts of the first."""
    start = time.perf_counter()
    one_by_one = [stream_over_http(port, prompt, output_len) for prompt in prompts]
    sequential = serving_figures([times for times, _ in one_by_one], time.perf_counter() - start)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        at_once = list(
            pool.map(lambda prompt: stream_over_http(port, prompt, output_len)[0], prompts)
        )
    concurrent_run = serving_figures(at_once, time.perf_counter() - start)
    return {
        "sequential": sequential,
        "concurrent": concurrent_run,
        "texts": [text for _, text in one_by_one],
    }


def free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(server: subprocess.Popen, port: int, command: list[str]) -> None:
    """Until GET /health answers 200 (a server that exits first: an error naming its command)."""
    import http.client

    while server.poll() is None:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(
        f"the server exited ({server.returncode}) before serving: {' '.join(command)}"
    )


def start_servers(args, model_dir: str) -> dict[str, tuple[subprocess.Popen, int, float]]:
    """serve.py, and with --vllm-python vLLM's CPU build's OpenAI server beside it on the same
    checkpoint and settings (its own defaults otherwise: threads bound to the cores, a compiled
    graph): name -> (process, port, seconds from its start to its first 200 on /health)."""
    settings = [  # the same for both: the same model and requests
        *["--model", model_dir, "--dtype", args.dtype, "--max-num-seqs", str(args.concurrency)],
        *["--max-model-len", str(args.input_len + args.output_len)],
        *(["--enforce-eager"] if args.enforce_eager else []),  # vLLM's too: no torch.compile
    ]
    serve_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py")
    commands = {
        "tinytp": (
            [
                *[sys.executable, serve_py, *settings, "--tp", str(args.tp)],
                *(["--device", args.device] if args.device else []),
                *(["--async-scheduling"] if args.async_scheduling else []),
            ],
            {},
        )
    }
    if args.vllm_python:  # VLLM_CPU_KVCACHE_SPACE: 1 GiB of KV cache, not a share of all memory
        commands["vLLM"] = (
            [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", *settings]
            + ["--tensor-parallel-size", str(args.tp)],
            {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"},
        )
    servers = {}
    try:
        for name, (command, env) in commands.items():  # one at a time: start-up is timed alone
            port = free_port()
            flag = ["--port", str(port)]
            start = time.perf_counter()
            server = subprocess.Popen(
                command + flag,
                env={**os.environ, **env},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            servers[name] = (server, port, math.nan)
            wait_for_health(server, port, command + flag)
            servers[name] = (server, port, time.perf_counter() - start)
            print(f"{name} serving on port {port} after {servers[name][2]:.1f} s", flush=True)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict[str, tuple[subprocess.Popen, int, float]]) -> None:
    for server, _, _ in servers.values():
        server.send_signal(signal.SIGTERM)
    for server, _, _ in servers.values():
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()


@contextlib.contextmanager
def cpu_hogs(count: int):
    """`count` processes that spin on a core each (Python's `while 1: pass`): a busy machine."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


SERVING_KEYS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


# vLLM's workers keep polling their queue for a second after their last step (sched_yield between
# looks: shm_broadcast's busy_loop_s), a core's worth on 2 cores: a server timed in that second
# would run beside it, so each round starts once it has passed (docs/performance.md).
SETTLE_SECONDS = 2


def run_serve(args) -> dict:
    """--serve --concurrency N: N streaming HTTP clients at once against the same N requests one
    after another, on one serve.py (greedy, --input-len random token ids, exactly --output-len
    tokens each): run_concurrency's figures, with HTTP, JSON and the server's threads in the way.
    With --vllm-python, vLLM's CPU server too, both alive, the same client on each in turn,
    --rounds times (--hogs busy processes beside them), and each figure's ratio tinytp / vLLM."""
    model_dir = resolve_model(args.model)
    vocab = read_config(os.path.join(model_dir, "config.json")).vocab_size
    prompts = (
        np.random.default_rng(0).integers(vocab, size=(args.concurrency, args.input_len)).tolist()
    )
    servers = start_servers(args, model_dir)
    rounds = {name: [] for name in servers}
    try:
        for _, port, _ in servers.values():
            stream_over_http(port, prompts[0], 4)  # warm-up
        # This client's start-up heap (torch, tinytp) marked static, as the engine marks its own: a
        # collection walking it stops every client thread at once, a gap in the tokens of
        # whichever server it was timing.
        gc.collect()
        gc.freeze()
        with cpu_hogs(args.hogs):
            for _ in range(args.rounds if args.vllm_python else 1):
                for name, (_, port, _) in servers.items():
                    if args.vllm_python:  # vLLM's polling over (tinytp alone: nothing to wait for)
                        time.sleep(SETTLE_SECONDS)
                    rounds[name].append(serving_round(port, prompts, args.output_len))
                    tokens_per_second = rounds[name][-1]["concurrent"]["output_throughput"]
                    print(f"{name}: {tokens_per_second:.1f} tok/s at once", flush=True)
    finally:
        stop_servers(servers)
    print(
        f"serve.py, tp={args.tp}, {args.dtype}, {args.concurrency} HTTP clients, "
        f"{'async' if args.async_scheduling else 'sync'} scheduling, {args.hogs} CPU hogs; "
        f"medians of {len(rounds['tinytp'])} round(s)"
    )
    medians = {
        name: {
            clients: {
                key: statistics.median(r[clients][key] for r in results) for key in SERVING_KEYS
            }
            for clients in ("sequential", "concurrent")
        }
        for name, results in rounds.items()
    }
    for name, figures in medians.items():
        for clients, f in figures.items():
            print(
                f"{name} {clients}: output token throughput {f['output_throughput']:.1f} tok/s; "
                f"TTFT median {f['median_ttft_ms']:.1f} ms, p99 {f['p99_ttft_ms']:.1f} ms; "
                f"ITL median {f['median_itl_ms']:.2f} ms, p99 {f['p99_itl_ms']:.2f} ms"
            )
    tinytp_figures = medians["tinytp"]
    speedup = (
        tinytp_figures["concurrent"]["output_throughput"]
        / tinytp_figures["sequential"]["output_throughput"]
    )
    print(f"concurrency speedup: {speedup:.2f}x the sequential tokens per second")
    result = {
        "serve": True,
        "concurrency": args.concurrency,
        "tp": args.tp,
        "dtype": args.dtype,
        "async_scheduling": args.async_scheduling,
        "hogs": args.hogs,
        **tinytp_figures,
        "concurrency_speedup": speedup,
        "startup_seconds": {name: start for name, (_, _, start) in servers.items()},
        "rounds": rounds,
    }
    if args.vllm_python:
        # each round's own ratios (both servers saw that round's load), then their median
        result["ratios"] = {
            clients: {
                key: statistics.median(
                    t[clients][key] / v[clients][key]
                    for t, v in zip(rounds["tinytp"], rounds["vLLM"])
                )
                for key in SERVING_KEYS
            }
            for clients in ("sequential", "concurrent")
        }
        same = sum(a == b for a, b in zip(rounds["tinytp"][0]["texts"], rounds["vLLM"][0]["texts"]))
        result["same_text"] = f"{same}/{len(prompts)}"
        for clients, ratios in result["ratios"].items():
            print(
                f"tinytp / vLLM, {clients}: "
                + ", ".join(f"{key} {ratio:.2f}" for key, ratio in ratios.items())
            )
        print(f"the same greedy text on {result['same_text']} prompts")
    return result


# --------------------------------------------------------------------------------------
# --compare, and the command line
# --------------------------------------------------------------------------------------

COMPARE_RUNS = {
    "tinytp tp=1": ("tinytp", 1),
    "tinytp tp=2": ("tinytp", 2),
    "inprocess": ("inprocess", 1),
    "hf": ("hf", 1),
}
RATIOS = [
    ("tinytp tp=1", "hf", 0.5),
    ("tinytp tp=1", "inprocess", 1.02),
    ("tinytp tp=2", "tinytp tp=1", 1.1),
]


def compare(argv: list[str]) -> dict:
    """Run each backend on the same settings, each in a fresh process of its own (nothing
    left behind by the one before: threads, memory, process groups), all of them in turn,
    --rounds times (A B C D A B C D ...), so that a machine whose speed drifts slows each
    round's backends alike; then sum them up: each figure is the median over the rounds,
    and each ratio the median of the rounds' own ratios."""
    settings = [a for a in argv if a != "--compare"]
    args = parse_args(settings)
    config = settings_config(args)
    runnable, left_out = {}, {}
    for name, (backend, tp) in COMPARE_RUNS.items():
        try:  # a model that tp=2 cannot split is compared at the sizes it can
            check_tensor_parallel_size(config, tp)
            runnable[name] = (backend, tp)
        except ValueError as e:
            left_out[name] = str(e)
    rounds = {}  # name: that backend's result in each round
    with tempfile.TemporaryDirectory(prefix="tinytp-compare-") as tmp:
        for round_number in range(1, args.rounds + 1):
            for name, (backend, tp) in runnable.items():
                print(f"\n=== {name}, round {round_number} of {args.rounds} ===", flush=True)
                path = os.path.join(tmp, f"{backend}-{tp}.json")
                subprocess.run(
                    [
                        sys.executable,
                        os.path.abspath(__file__),
                        *settings,
                        "--backend",
                        backend,
                        "--tp",
                        str(tp),
                        "--output-json",
                        path,
                    ],
                    check=True,
                )
                with open(path) as f:
                    rounds.setdefault(name, []).append(json.load(f))
    runs = {
        name: {
            key: statistics.median(r[key] for r in results) if results[0][key] is not None else None
            for key in (
                "avg_latency",
                "prefill_seconds",
                "decode_step_seconds",
                "executor_overhead_us",
                "roofline_fraction",
            )
        }
        for name, results in rounds.items()
    }
    print(
        f"\n{'':12}{'avg latency':>13}{'prefill':>11}{'decode step':>13}"
        f"{'overhead':>11}{'roofline':>10}"
        f"   (medians of {args.rounds} rounds)"
    )
    for name, r in runs.items():
        overhead = (
            "-" if r["executor_overhead_us"] is None else f"{r['executor_overhead_us']:.0f} us"
        )
        print(
            f"{name:12}{r['avg_latency']:11.3f} s{r['prefill_seconds'] * 1e3:8.1f} ms"
            f"{r['decode_step_seconds'] * 1e3:10.2f} ms{overhead:>11}{r['roofline_fraction']:10.0%}"
        )
    ratios = {}
    for a, b, target in RATIOS:
        if a in rounds and b in rounds:
            each = [x["avg_latency"] / y["avg_latency"] for x, y in zip(rounds[a], rounds[b])]
            ratios[f"{a} / {b}"] = statistics.median(each)
            print(
                f"{a} / {b}: {ratios[f'{a} / {b}']:.3f} (target <= {target}; rounds: "
                f"{', '.join(f'{ratio:.3f}' for ratio in each)})"
            )
    for name, reason in left_out.items():
        print(f"left out: {name}: {reason}")
    return {"runs": runs, "rounds": rounds, "ratios": ratios, "left_out": left_out}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench.py", description=__doc__.split("\n")[0], allow_abbrev=False
    )
    parser.add_argument(
        "--ipc", action="store_true", help="benchmark the IPC transports, not the model"
    )
    parser.add_argument(
        "--compare", action="store_true", help="tinytp tp=1 and 2, inprocess and hf, in turn"
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="--concurrency streaming clients at once over HTTP (serve.py) against one by one",
    )
    parser.add_argument(
        "--write-gguf",
        metavar="PATH",
        default=None,
        help="write the benchmark's model, random weights, as a GGUF for llama.cpp, and exit",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="with --compare, --arrival-prompt-len or --vllm-python: how many times to run them "
        "all in turn",
    )
    parser.add_argument(
        "--vllm-python",
        default=None,
        help="with --serve: a Python with vLLM's CPU build (vllm-cpu), whose OpenAI server runs "
        "beside serve.py for the same client (docs/performance.md)",
    )
    parser.add_argument(
        "--hogs",
        type=int,
        default=0,
        help="busy processes (a spinning Python each) beside the timed part of --serve or of a "
        "latency run",
    )
    parser.add_argument(
        "--output-path",
        type=int,
        default=None,
        metavar="TOKENS",
        help="the output path: a stream this long, and a stream beside --beside-prompts prompts",
    )
    parser.add_argument("--beside-prompts", type=int, default=1500)
    parser.add_argument(
        "--arrival-prompt-len",
        type=int,
        default=None,
        help="inter-token latency of --batch-size - 1 streams as a prompt this long arrives",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="the tokens one step may run"
    )
    tinytp.add_kv_cache_flags(parser)
    parser.add_argument(
        "--chat-history-len",
        type=int,
        default=None,
        help="turn 2's time to first token after a history this long, with and without caching",
    )
    parser.add_argument(
        "--capacity-len",
        type=int,
        default=None,
        help="with --kv-cache-memory-bytes: how many requests this long the cache holds at once",
    )
    parser.add_argument(
        "--model", default=None, help="checkpoint directory or hub id (default: a ~56M Llama)"
    )
    parser.add_argument("--config", default=None, help="a config.json to run with dummy weights")
    parser.add_argument(
        "--load-format",
        choices=["auto", "dummy"],
        default=None,
        help="default: auto with --model, dummy otherwise",
    )
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="default: cuda where GPUs are visible (fewer than --tp: refused), else cpu",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto: the checkpoint's (on cpu: bfloat16 where the CPU has it, else float32)",
    )
    parser.add_argument(
        "--backend",
        choices=["tinytp", "hf", "inprocess"],
        default="tinytp",
        help="inprocess: tinytp's worker in this process, no executor (tp=1)",
    )
    parser.add_argument(
        "--cuda-graphs", action="store_true", help="tinytp's decode steps as CUDA graphs (opt-in)"
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="tinytp's decode steps eager, not compiled (CPU, tp 1)",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="tinytp sends each step while the one before it runs (two steps in flight)",
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="print how the model is cut across the ranks (--tp), and exit: nothing runs",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="print a timeline of one decode step across the processes, and exit",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help="N callers at once, one prompt each, against the same prompts one after another",
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="a decode step with this many logprobs for every request, against none",
    )
    parser.add_argument("--output-json", default=None, help="write the results to this file")
    args = parser.parse_args(argv)
    for name, least in [
        ("batch_size", 1),
        ("input_len", 1),
        ("output_len", 2),
        ("num_iters", 1),
        ("rounds", 1),
    ]:
        if getattr(args, name) < least:  # output_len 2: at least one decode step to time
            parser.error(f"--{name.replace('_', '-')} must be at least {least}")
    for flag, path in [("--output-json", args.output_json), ("--write-gguf", args.write_gguf)]:
        # checked now, not after the whole benchmark has run
        folder = os.path.dirname(path or "") or "."
        if path is not None and (not path or os.path.isdir(path) or not os.access(folder, os.W_OK)):
            parser.error(
                f"{flag} needs a file it can write, got {path!r}"
                + ("" if os.path.isdir(folder) else f": there is no folder {folder}")
            )
    for flag in ("cuda_graphs", "enforce_eager", "async_scheduling"):
        if getattr(args, flag) and args.backend == "hf":
            parser.error(
                f"--{flag.replace('_', '-')} is tinytp's: --backend hf runs transformers' "
                "generate as it is"
            )
    if args.concurrency is not None and (args.concurrency < 1 or args.backend != "tinytp"):
        parser.error(
            f"--concurrency must be at least 1, on --backend tinytp; got {args.concurrency} on "
            f"{args.backend}"
        )
    if args.vllm_python and not args.serve:
        parser.error("--vllm-python is --serve's: it starts vLLM's server beside serve.py")
    if args.hogs < 0:
        parser.error(f"--hogs must be at least 0, got {args.hogs}")
    if args.serve and not (args.model and args.concurrency):
        parser.error(
            "--serve needs --model (a checkpoint with a tokenizer: the server streams text) "
            "and --concurrency N (the number of clients)"
        )
    if args.arrival_prompt_len is not None and (args.arrival_prompt_len < 1 or args.batch_size < 2):
        parser.error(
            "--arrival-prompt-len needs a length of at least 1 and a --batch-size of at least 2"
        )
    if args.chat_history_len is not None and not (args.model and args.chat_history_len > 0):
        parser.error("--chat-history-len needs a length of at least 1 and --model (a chat model)")
    if args.capacity_len is not None and not (args.capacity_len > 1 and args.kv_cache_memory_bytes):
        parser.error("--capacity-len needs a length of at least 2 and --kv-cache-memory-bytes")
    if args.write_gguf and os.path.exists(args.write_gguf):
        parser.error(
            f"--write-gguf {args.write_gguf} exists already: remove it, or give another name"
        )
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        if args.ipc:
            result = run_ipc()
        elif args.compare:
            result = compare(argv)
        elif args.write_gguf:
            result = write_gguf(args)
        elif args.explain:
            result = run_explain(args)
        elif args.trace:
            result = run_trace(args)
        elif args.serve:
            result = run_serve(args)
        elif args.concurrency:
            result = run_concurrency(args)
        elif args.arrival_prompt_len:
            result = run_arrival(args)
        elif args.output_path:
            result = run_output_path(args)
        elif args.chat_history_len:
            result = run_chat(args)
        elif args.capacity_len:
            result = run_capacity(args)
        elif args.logprobs is not None:
            result = run_logprobs(args)
        else:
            result = run_latency(args)
    except (ValueError, FileNotFoundError, subprocess.CalledProcessError) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
