"""Benchmarks for tinytp: vLLM's latency benchmark, and the course's instruments.

    python bench.py                            # latency of the default model, random weights
    python bench.py --model smollm2 --batch-size 1 --input-len 32 --output-len 64
    python bench.py --compare                  # the same at tp=2, in-process, in transformers
    python bench.py --compare "--logprobs 5 | --async-scheduling"   # what each costs a step
    python bench.py --ipc                      # the MessageQueue against torch.distributed's gloo
    python bench.py --explain --tp 4 --model tiny-llama   # how a checkpoint is cut: nothing runs
    python bench.py --trace --tp 2             # one decode step across the processes, one clock
    python bench.py --concurrency 8            # 8 callers at once against the same one by one
    python bench.py --concurrency 7 --arrival-prompt-len 1024   # a long prompt among 7 streams
    python bench.py --serve --concurrency 8 --model smollm2 --vllm-python PY  # and vLLM's server
    python bench.py --stream-cpu --model smollm2   # the driver's CPU a token, early and late

The latency mode is vLLM's benchmarks/benchmark_latency.py (its options and defaults, random
token-id prompts, exactly --output-len tokens each, its output lines: its numbers sit beside vLLM
pull request #9856's, "[V1] Multiprocessing Tensor Parallel Support for v1"), and what explains
them: the prefill and decode steps, the executor's overhead, how fast a step reads its weights.
Top to bottom: --ipc, the model, --explain and --trace, the latency benchmark and --compare,
--concurrency and --serve, --stream-cpu, the command line.
"""

import argparse
import collections
import concurrent.futures
import contextlib
import functools
import gc
import itertools
import json
import os
import pickle
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tqdm import tqdm

import tinytp
from checkpoints import (
    check_parallel_sizes,
    checkpoint_shapes,
    config_from_dict,
    read_config,
    resolve_model,
)
from model import (
    ModelConfig,
    TPGroup,
    init_dummy_weights,
    stage_layers,
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
)

CORES = len(os.sched_getaffinity(0))


# The queue (--ipc): one writer (this process), two readers, reader 0 replies ------------------

READERS = 2  # the workers of a tp=2 run
ITERATIONS = {"small": 2000, "64k": 500, "16m": 30}  # timed round trips per message size
# A decode step of 8 running requests, as the Executor sends it, and two raw payloads.
STEP = SchedulerOutput(
    new_requests=[], scheduled_ids=list(range(8)), num_scheduled_tokens=[1] * 8, finished_ids=[]
)
MESSAGES = {"small": RPCCall(1, "execute_model", (STEP,), unique_reply_rank=0)}
MESSAGES |= {"64k": bytes(64 << 10), "16m": bytes(16 << 20)}
REPLY = RPCResult(1, ModelRunnerOutput(list(range(8)), 0.0))  # rank 0's answer to a decode step
# A transport: send(message) reaches every reader, receive() returns reader 0's reply, connect()
# once the readers run; reader r's reader_side(r, *reader_args[r]) gives its (receive, reply). Both
# carry the bytes MessageQueue sends (pickle, protocol 5): only how they travel differs.


class ShmTransport:
    """tinytp's MessageQueue: one broadcast queue and a reply queue, as the Executor has."""

    def __init__(self):
        self.calls = MessageQueue.create(num_readers=READERS)
        self.replies = MessageQueue.create(num_readers=1, reader=0)
        self.send, self.receive = self.calls.enqueue, self.replies.dequeue
        self.reader_args = [(self.calls.handle, self.replies.handle)] * READERS

    @staticmethod
    def reader_side(reader, calls, replies):
        calls, replies = MessageQueue.attach(calls, reader=reader), MessageQueue.attach(replies)
        return calls.dequeue, replies.enqueue

    def connect(self):  # the queues are there already
        pass

    def close(self):
        self.calls.close()
        self.replies.close()


class GlooTransport:
    """torch.distributed over gloo, 3 ranks (we are rank 0): broadcast_object_list out; reader 0
    (rank 1) replies point to point, send_object_list (a broadcast back would need the third)."""

    @staticmethod
    def received(collective, src: int):
        """The message that a torch.distributed *_object_list call fills in, unpickled."""
        box = [None]
        collective(box, src=src)
        return pickle.loads(box[0])

    def __init__(self):
        self.store = tinytp.loopback_store()
        self.reader_args = [(self.store.port,)] * READERS

    @staticmethod
    def reader_side(reader, port):
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        dist.init_process_group("gloo", store=store, rank=reader + 1, world_size=READERS + 1)
        receive = functools.partial(GlooTransport.received, dist.broadcast_object_list, 0)
        return receive, lambda reply: dist.send_object_list(
            [pickle.dumps(reply, protocol=5)], dst=0
        )

    def connect(self):  # joining waits for every rank, so only now that the readers exist
        dist.init_process_group("gloo", store=self.store, rank=0, world_size=READERS + 1)

    def send(self, message):
        dist.broadcast_object_list([pickle.dumps(message, protocol=5)], src=0)

    def receive(self):
        return self.received(dist.recv_object_list, 1)

    def close(self):
        dist.destroy_process_group()


TRANSPORTS = {"shm": ShmTransport, "gloo": GlooTransport}


def ipc_reader(transport: type, reader: int, args: tuple) -> None:
    """A reader process: take messages until None; reader 0 answers each, as rank 0 does."""
    receive, reply = transport.reader_side(reader, *args)
    while receive() is not None:
        if reader == 0:
            reply(REPLY)


def measure_transport(transport) -> dict[str, np.ndarray]:
    """Per message size, microseconds from sending until reader 0's reply (a tenth: warm-up)."""
    spawn = mp.get_context("spawn")
    readers = [
        spawn.Process(target=ipc_reader, args=(type(transport), r, args), daemon=True)
        for r, args in enumerate(transport.reader_args)
    ]
    for process in readers:
        process.start()
    try:
        transport.connect()
        times = {}
        for size, message in MESSAGES.items():
            samples = []
            for _ in range(ITERATIONS[size] * 11 // 10):
                start = time.perf_counter()
                transport.send(message)
                transport.receive()
                samples.append(time.perf_counter() - start)
            times[size] = np.array(samples[-ITERATIONS[size] :]) * 1e6
        transport.send(None)
    finally:
        for process in readers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
        transport.close()
    return times


def run_ipc(args) -> dict:
    """Time every transport: a table, gloo's ratio to shm, and the machine's load."""
    table = {}
    for name, transport in TRANSPORTS.items():
        print(f"timing {name} ...", file=sys.stderr, flush=True)
        times = measure_transport(transport())
        table[name] = {f"{size} p50": float(np.median(t)) for size, t in times.items()}
        table[name] |= {f"{size} p99": float(np.percentile(t, 99)) for size, t in times.items()}
        table[name]["16m GB/s"] = (16 << 20) / table[name]["16m p50"] / 1e3
    print_table(table, f"us, writer -> {READERS} readers -> reader 0's reply")
    gloo_over_shm = table["gloo"]["small p50"] / table["shm"]["small p50"]
    # The load reported, not judged: on a busy machine a reader waits for a core, which blurs the
    # transports' differences.
    print(f"\nsmall, median: gloo / shm = {gloo_over_shm:.0f}x; load {os.getloadavg()[0]:.1f}")
    return table


# The model every mode runs, and its prompts ---------------------------------------------------

# With no model named: a Llama of realistic proportions that a CPU runs in seconds (~56M
# parameters, 225 MB in float32: far larger than the caches, so decode is memory-bound).
DEFAULT_CONFIG = json.loads("""{"model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
    "intermediate_size": 1408, "vocab_size": 32000, "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false, "bos_token_id": 1,
    "eos_token_id": 2, "dtype": "float32"}""")
# The engine's flags: vLLM's names, each an argument of LLM's of the same name.
ENGINE_FLAGS = ("cuda_graphs", "enforce_eager", "async_scheduling", "max_num_batched_tokens")
ENGINE_FLAGS += ("block_size", "kv_cache_memory_bytes", "enable_prefix_caching")


def settings_config(args) -> ModelConfig:
    """The config a run of these settings would use: --config, --model's, or the default."""
    if args.config:
        return read_config(args.config)
    if args.model:
        return read_config(os.path.join(resolve_model(args.model, weights=False), "config.json"))
    return config_from_dict(DEFAULT_CONFIG)


class Model:
    """--model's checkpoint, or random weights in --config's or the default shapes (a config.json
    alone: no tokenizer, the prompts are token ids); its device and dtype; the engine's flags."""

    def __init__(self, args):
        self.args, self.load_format = args, "dummy" if args.config or not args.model else "auto"
        self.folder = tempfile.TemporaryDirectory(prefix="tinytp-bench-")  # gone with the Model
        self.path = self.folder.name if self.load_format == "dummy" else resolve_model(args.model)
        if args.config:
            shutil.copy(args.config, os.path.join(self.path, "config.json"))
        elif self.load_format == "dummy":
            with open(os.path.join(self.path, "config.json"), "w") as f:
                json.dump(DEFAULT_CONFIG, f)
        self.config = read_config(os.path.join(self.path, "config.json"))
        sizes = (args.tp, args.device, args.dtype, args.pp)
        self.device, self.dtype = tinytp.choose_device_and_dtype(self.config, *sizes)

    def __str__(self) -> str:
        stages = f" x pp={self.args.pp}" if self.args.pp > 1 else ""
        return f"tp={self.args.tp}{stages}, {self.device}, {self.dtype}, {self.load_format} weights"

    def prompts(self, count: int, length: int, seed: int = 0) -> list[list[int]]:
        """Prompts of random token ids, as vLLM's benchmarks send: no tokenizer needed."""
        rng = np.random.default_rng(seed)
        return rng.integers(self.config.vocab_size, size=(count, length)).tolist()

    def llm(self, max_num_seqs: int, max_model_len: int, **more) -> tinytp.LLM:
        """An LLM of these settings, for max_num_seqs requests at once, `more` of its arguments."""
        engine = {flag: getattr(self.args, flag) for flag in ENGINE_FLAGS}
        engine |= {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len}
        engine |= {"load_format": self.load_format, "pipeline_parallel_size": self.args.pp, **more}
        return tinytp.LLM(self.path, self.args.tp, self.device, self.dtype, **engine)


# The instruments: --explain (how a checkpoint is cut), --trace (one step, every process) ------


def explain(config: ModelConfig, tp: int, dtype: str, pp: int = 1) -> str:
    """The cut, from the workers' own shapes (no memory): per checkpoint tensor its full shape, a
    rank's slice and split dimension, then each rank's layers and bytes, traffic per step."""
    itemsize = getattr(torch, dtype).itemsize
    padded_vocab = vocab_rows_per_rank(config.vocab_size, tp) * tp
    whole, mine = checkpoint_shapes(config), checkpoint_shapes(config, TPGroup(0, tp))
    title = f"checkpoint tensor (layer 0 of {config.num_layers})"
    lines = [f"{title:<48}{'full shape':>14}{'rank 0 slice':>14}  split"]
    for name, full_shape in whole.items():
        if ".layers." in name and ".layers.0." not in name:
            continue  # every layer is cut alike
        split = [dim for dim, (full, part) in enumerate(zip(full_shape, mine[name])) if part < full]
        how = f"dim {split[0]}" if split else "replicated"
        if split and full_shape[split[0]] < mine[name][split[0]] * tp:  # the parts overlap or pad
            padded = full_shape[0] == config.vocab_size
            how += f", vocab padded to {padded_vocab}" if padded else ", KV heads replicated"
        lines.append(f"{name:<48}{str(full_shape):>14}{str(mine[name]):>14}  {how}")
    lines.append("")
    for rank in range(tp * pp):
        stage = rank // tp
        held = weight_bytes(config, TPGroup(rank % tp, tp), dtype, stage, pp)
        line = f"rank {rank} holds {held:,} bytes of weights ({held / 2**20:,.1f} MiB, {dtype})"
        if pp > 1:
            layers = stage_layers(config.num_layers, stage, pp)
            ends = [", the embedding"] * (stage == 0) + [", the norm, the LM head"] * (
                stage == pp - 1
            )
            line += f": stage {stage}, layers {layers[0]}-{layers[-1]}{''.join(ends)}"
        lines.append(line)
    hidden, vocab = config.hidden_size * itemsize, padded_vocab * itemsize
    if pp > 1:  # the residual stream, rank r of a stage to rank r of the next
        lines.append(
            f"\npipeline: {pp - 1} hand-offs a step, each rank to its peer in the next stage: "
            f"{hidden:,} bytes per token (the hidden states, the residual added in)"
        )
    reduces = f"  {2 * config.num_layers + 1} all-reduces of {hidden:,} bytes (2 per layer, after "
    reduces += "o_proj and down_proj, and 1 after the embedding)"
    gather = f"  1 all-gather of the logits: {vocab // tp:,} bytes from each rank, {vocab:,} in all"
    per_step = ["communication per decode step, per sequence in the batch:", reduces, gather]
    return "\n".join([*lines, "", *(per_step if tp > 1 else ["communication: none (tp=1)"])])


def run_explain(args) -> dict:
    config = settings_config(args)
    check_parallel_sizes(config, args.tp, args.pp)
    _, dtype = tinytp.choose_device_and_dtype(config, args.tp, args.device, args.dtype, args.pp)
    text = explain(config, args.tp, dtype, args.pp)
    print(text)
    return {"explain": text.splitlines()}


TRACED_COLLECTIVES = ("all_reduce", "all_gather")  # the TPGroup methods timed


def start_trace(worker: Worker) -> None:  # run in the workers, through collective_rpc
    """Record (start, end, what, bytes) in worker.trace, the step's, collectives' and reply queue's
    methods wrapped (the core stays as it is); perf_counter is one clock in every process."""
    events = worker.trace = []

    def timed(what: str, method):
        def run(*args, **kwargs):
            start = time.perf_counter()
            result = method(*args, **kwargs)
            events.append((start, time.perf_counter(), what, getattr(args[0], "nbytes", 0)))
            return result

        return run

    def replied(queue: MessageQueue, reply: RPCResult, *args, **kwargs) -> int:
        start = time.perf_counter()  # (a worker writes its replies only)
        size = worker.enqueue(queue, reply, *args, **kwargs)
        if isinstance(reply.value, ModelRunnerOutput):  # a step's answer, not a call's
            events.append((start, time.perf_counter(), "replied", size))
        return size

    worker.execute_model = timed("got the step and ran execute_model", worker.execute_model)
    for name in TRACED_COLLECTIVES:  # instance attributes shadow the methods
        setattr(worker.group, name, timed(name, getattr(worker.group, name)))
    worker.enqueue, MessageQueue.enqueue = MessageQueue.enqueue, replied
    # pipeline parallelism's hand-off (Worker.run_stage): a stage's wait for the one before shows
    worker.send, worker.recv = dist.send, dist.recv
    dist.send = timed("sent its hidden states on", dist.send)
    dist.recv = timed("received the hidden states", dist.recv)


def stop_trace(worker: Worker) -> list[tuple]:  # run in the workers, through collective_rpc
    for name in TRACED_COLLECTIVES:
        delattr(worker.group, name)
    del worker.execute_model
    MessageQueue.enqueue, dist.send, dist.recv = worker.enqueue, worker.send, worker.recv
    return worker.trace


def trace_decode_step(llm: tinytp.LLM, prompts: list[list[int]]) -> str:
    """A prefill and a decode step of `prompts`, every process recording what it does and when; the
    decode step's timeline: the driver's broadcast and wait for the answer (around the executor's
    execute_model, which the engine loop calls), each rank's step, collectives, rank 0's reply."""
    driver, execute_model = [], llm.executor.execute_model

    def timed_step(scheduler_output: SchedulerOutput, non_block: bool = False):
        start = time.perf_counter()
        step = execute_model(scheduler_output, True)
        sent = time.perf_counter()

        def result() -> ModelRunnerOutput:
            output = step.result()
            call = RPCCall(0, "execute_model", (scheduler_output,), unique_reply_rank=0)
            driver[:] = [start, sent, time.perf_counter(), len(pickle.dumps(call, protocol=5))]
            return output

        return tinytp.StepFuture(result) if non_block else result()

    llm.executor.execute_model = timed_step  # shadows the method, for this generate
    llm.collective_rpc(start_trace)
    try:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.executor.execute_model
        rank_events = llm.collective_rpc(stop_trace)
    start = driver[0]  # the last step's: the decode
    return trace_timeline(driver, [[e for e in mine if e[0] >= start] for mine in rank_events])


def trace_timeline(driver_call: tuple, rank_events: list[list[tuple]]) -> str:
    """--trace's rows, process by process, each in time order, all timed from the broadcast. Every
    rank runs the same collectives in the same order: numbered (#1, #2, ...), they pair up."""
    start, sent, replied, size = driver_call

    def row(who: str, begin: float, end: float, what: str, nbytes: int) -> str:
        took = f"{(begin - start) * 1e6:9.0f} us  {who:<7} {what:<32} {(end - begin) * 1e6:7.0f} us"
        return took + (f"  {nbytes:,} bytes" if nbytes else "")

    driver = [
        row("driver", start, sent, "broadcast execute_model", size),
        row("driver", sent, replied, "waited for the reply", 0),
    ]
    blocks = [driver]
    for rank, mine in enumerate(rank_events):
        number = itertools.count(1)
        numbered = [
            (begin, end, f"#{next(number)} {what}" if what in TRACED_COLLECTIVES else what, size)
            for begin, end, what, size in sorted(mine)
        ]
        blocks.append([row(f"rank {rank}", *event) for event in numbered])
    header = f"{'start':>12}  {'process':<7} {'event':<32} {'took':>10}  size\n"
    return header + "\n\n".join("\n".join(block) for block in blocks)


def run_trace(args) -> dict:
    model = Model(args)
    with model.llm(args.batch_size, args.input_len + 2) as llm:
        timeline = trace_decode_step(llm, model.prompts(args.batch_size, args.input_len))
    print(f"One decode step of {args.batch_size} sequences, {model}:\n{timeline}")
    return {"trace": timeline.splitlines()}


# The latency benchmark (vLLM's benchmark_latency): the backends, each step timed, the report ---


# A step's time in the driver, around it, and in the worker (tinytp's: None in transformers).
Step = collections.namedtuple("Step", ["prefill", "seconds", "worker_seconds"], defaults=[None])


class InProcessExecutor:
    """tinytp's Worker called in this process (vLLM's "uni" executor), no queues: LLM takes it as
    its distributed_executor_backend. Its difference from tp=1 on the Executor: multiprocessing."""

    def __init__(self, config, model_dir, tp, pp, device, dtype, *engine, num_blocks, block_size):
        max_num_seqs, max_model_len, load_format, cuda_graphs, enforce_eager = engine
        self.store = tinytp.loopback_store()
        self.worker = Worker(0, 1)
        self.collective_rpc("init_device", args=(device, dtype, self.store.port, CORES))
        model = (config, model_dir, max_model_len, load_format, enforce_eager)
        self.collective_rpc("load_model", args=model)
        kv_cache = (num_blocks, block_size, max_num_seqs, cuda_graphs)
        self.collective_rpc("init_kv_cache", args=kv_cache)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        call = method if callable(method) else getattr(Worker, method)
        return [call(self.worker, *args, **(kwargs or {}))]

    def execute_model(self, scheduler_output, non_block=False):
        output = self.worker.execute_model(scheduler_output)  # done: nothing to overlap
        return tinytp.StepFuture(lambda: output) if non_block else output

    def shutdown(self):
        self.worker.close()


def timed(executor_class: type, steps: list[Step]) -> type:
    """`executor_class` with each step timed in the driver, into `steps`: to its answer from its
    sending, or from the answer before if later (async scheduling sends it while that one runs)."""

    class TimedExecutor(executor_class):
        last_answer = 0.0

        def execute_model(self, scheduler_output: SchedulerOutput, non_block: bool = False):
            sent = time.perf_counter()
            step = super().execute_model(scheduler_output, True)

            def result() -> ModelRunnerOutput:
                output = step.result()
                answered = time.perf_counter()
                tokens = scheduler_output.num_scheduled_tokens
                prefill = bool(scheduler_output.new_requests) or max(tokens, default=1) > 1
                seconds = answered - max(sent, self.last_answer)
                steps.append(Step(prefill, seconds, output.execute_seconds))
                self.last_answer = answered
                return output

            return tinytp.StepFuture(result) if non_block else result()

    return TimedExecutor


def steps_compiled(worker: Worker) -> bool:  # run in the workers: Worker.load_model's choice
    return worker.compiled_model is not None


def parameter_bytes(worker: Worker) -> int:  # run in the workers: the weights a rank holds
    return sum(t.numel() * t.element_size() for t in worker.model.parameters())  # tied ones once


class EngineBackend:
    """tinytp's LLM (for --backend inprocess, on an InProcessExecutor), each step timed."""

    def __init__(self, model: Model, prompts: list[list[int]]):
        args, self.prompts, self.steps = model.args, prompts, []
        inprocess = args.backend == "inprocess"
        executor = timed(InProcessExecutor if inprocess else tinytp.Executor, self.steps)
        max_model_len = args.input_len + args.output_len
        self.llm = model.llm(len(prompts), max_model_len, distributed_executor_backend=executor)
        n, k = args.output_len, args.logprobs
        self.params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=n, logprobs=k)
        self.parameter_bytes = self.llm.collective_rpc(parameter_bytes)  # a rank's each
        compiled = all(self.llm.collective_rpc(steps_compiled))
        self.mode = "CUDA graphs" if args.cuda_graphs else "compiled" if compiled else "eager"
        world = args.tp * args.pp
        ranks, threads = (1, CORES) if inprocess else (world, tinytp.threads_per_rank(world))
        self.threads = f"{ranks} process(es) x {threads} torch threads"

    def generate(self) -> list[int]:
        # The same prompts every iteration, as vLLM's benchmark: each computed whole, not found in
        # the prefix cache, so that a prefill step is one.
        self.llm.reset_prefix_cache()
        outputs = self.llm.generate(self.prompts, self.params, use_tqdm=False)
        return [len(o.outputs[0].token_ids) for o in outputs]

    def close(self):
        self.llm.shutdown()


class HFBackend:
    """The same shapes, dtype and prompts in transformers' generate: greedy, KV cache on, fixed
    length, an explicit attention mask. A step: from one forward call's start to the next one's."""

    def __init__(self, model: Model, prompts: list[list[int]]):
        from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

        args, dtype = model.args, getattr(torch, model.dtype)
        if model.load_format == "dummy":  # (never the checkpoint's code)
            with torch.device(model.device):
                config = AutoConfig.from_pretrained(model.path, trust_remote_code=False)
                self.model = AutoModelForCausalLM.from_config(config, dtype=dtype)
            init_dummy_weights(self.model)  # uniform in +-1e-3, as tinytp's dummy weights
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                model.path, dtype=dtype, trust_remote_code=False
            ).to(model.device)
        self.model.eval()
        n, eos = args.output_len, model.config.eos_token_ids or None
        generation = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False)
        generation.eos_token_id, generation.pad_token_id = eos, eos[0] if eos else 0
        input_ids = torch.tensor(prompts, device=model.device)
        self.inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
        self.inputs |= {"generation_config": generation, "use_cache": True}
        self.starts, self.steps = [], []
        self.model.register_forward_pre_hook(lambda *_: self.starts.append(time.perf_counter()))
        self.parameter_bytes = [sum(p.numel() * p.element_size() for p in self.model.parameters())]
        self.threads, self.mode = f"1 process x {CORES} torch threads", "eager"

    def generate(self) -> list[int]:
        self.starts.clear()
        with torch.inference_mode():
            output = self.model.generate(**self.inputs)
        ends = [*self.starts[1:], time.perf_counter()]
        self.steps += [Step(i == 0, b - a) for i, (a, b) in enumerate(zip(self.starts, ends))]
        return [output.shape[1] - self.inputs["input_ids"].shape[1]] * output.shape[0]

    def close(self):
        del self.model


PERCENTAGES = [10, 25, 50, 75, 90, 99]


def report(latencies: list[float], steps: list[Step], weight_bytes: int, device: str) -> dict:
    """Print vLLM's lines, then the step figures; return them all for --output-json."""
    percentiles = np.percentile(latencies, PERCENTAGES)
    print(f"Avg latency: {np.mean(latencies)} seconds")
    for percentage, percentile in zip(PERCENTAGES, percentiles):
        print(f"{percentage}% percentile latency: {percentile} seconds")
    decode = [s for s in steps if not s.prefill]
    prefill = float(np.median([s.seconds for s in steps if s.prefill]))
    step, mean = (float(f([s.seconds for s in decode])) for f in (np.median, np.mean))
    print(
        f"Prefill step: {prefill * 1e3:.2f} ms; decode step: {step * 1e3:.2f} ms median, "
        f"{mean * 1e3:.2f} ms mean ({len(decode)} steps)"
    )
    overhead = None
    if decode[0].worker_seconds is not None:
        overhead = float(np.median([s.seconds - s.worker_seconds for s in decode]))
        print(f"Executor overhead per decode step: {overhead * 1e6:.0f} us ({overhead / step:.1%})")
    memory = "memory" if device == "cpu" else "each GPU"  # (against its rate: .ci/gpu's roofline)
    print(
        f"Weights read from {memory} per decode step: {weight_bytes / 1e6:.1f} MB, "
        f"{weight_bytes / step / 1e9:.2f} GB/s"
    )
    return {
        "avg_latency": float(np.mean(latencies)),
        "latencies": list(latencies),
        "percentiles": dict(zip(map(str, PERCENTAGES), percentiles.tolist())),
        "prefill_seconds": prefill,
        "decode_step_seconds": step,
        "decode_step_mean_seconds": mean,
        "executor_overhead_us": None if overhead is None else overhead * 1e6,
        "weight_bytes_per_decode_step": weight_bytes,
    }


def run_latency(args) -> dict:
    """vLLM's benchmark_latency: --batch-size prompts generated together, --num-iters times after
    --num-iters-warmup, each generate timed whole and each of its steps on its own."""
    torch.set_num_threads(CORES)  # hf and inprocess compute here
    model = Model(args)
    prompts = model.prompts(args.batch_size, args.input_len)
    backend = (HFBackend if args.backend == "hf" else EngineBackend)(model, prompts)
    try:
        print(f"{args.backend}, {model}, decode steps {backend.mode}; {backend.threads}")
        for _ in tqdm(range(args.num_iters_warmup), desc="Warmup iterations"):
            backend.generate()
        backend.steps.clear()
        latencies = []
        for _ in tqdm(range(args.num_iters), desc="Profiling iterations"):
            start = time.perf_counter()
            lengths = backend.generate()
            latencies.append(time.perf_counter() - start)
            if set(lengths) != {args.output_len}:
                raise RuntimeError(f"generated {set(lengths)} tokens, not {args.output_len}")
    finally:
        backend.close()
    # A decode step reads all the weights the ranks hold but the embedding table, of which it reads
    # one row per sequence (unless the LM head is the table, tied, on the same rank); the ranks on
    # a CPU share one memory (all ranks' bytes), each GPU has its own (the fullest rank's).
    config, itemsize = model.config, getattr(torch, model.dtype).itemsize
    table = vocab_rows_per_rank(config.vocab_size, args.tp) * config.hidden_size * itemsize
    held, cpu = backend.parameter_bytes, model.device == "cpu"
    unread = 0 if config.tie_word_embeddings and args.pp == 1 else table * (args.tp if cpu else 1)
    weight_bytes = (sum(held) if cpu else max(held)) - unread
    result = report(latencies, backend.steps, weight_bytes, model.device)
    settings = {"backend": args.backend, "tp": args.tp, "pp": args.pp, "device": model.device}
    settings |= {"dtype": model.dtype, "mode": backend.mode, "batch_size": args.batch_size}
    return {**settings, "async_scheduling": args.async_scheduling, **result}


# --compare: a run in variants, each in a fresh process, in turn, in rounds --------------------

# The seed's comparison: tp=1 (the settings as given) against tp=2, no executor, transformers.
SEED_VARIANTS = "--tp 2 | --backend inprocess | --backend hf"
FIGURES = {  # a table's columns, where its runs have them: heading -> (JSON key, scale)
    "latency s": ("avg_latency", 1),
    "prefill ms": ("prefill_seconds", 1e3),
    "step ms": ("decode_step_seconds", 1e3),
    "mean ms": ("decode_step_mean_seconds", 1e3),
    "overhead us": ("executor_overhead_us", 1),
    "1 by 1 tok/s": ("sequential.output_throughput", 1),
    "tok/s": ("concurrent.output_throughput", 1),
    "TTFT ms": ("concurrent.median_ttft_ms", 1),
    "ITL ms": ("concurrent.median_itl_ms", 1),
    "ITL p99 ms": ("concurrent.p99_itl_ms", 1),
    "ITL max ms": ("concurrent.max_itl_ms", 1),
}


def figure(result: dict, key: str) -> float | None:
    """A result's figure by its FIGURES key ("concurrent.median_itl_ms": a key inside a key)."""
    for part in key.split("."):
        result = result.get(part) if isinstance(result, dict) else None
    return result


def medians(rounds: dict[str, list[dict]]) -> dict[str, dict]:
    """Per run, each figure's median over its rounds (None where the run has no such figure)."""
    table = {}
    for name, runs in rounds.items():
        table[name] = {}
        for heading, (key, scale) in FIGURES.items():
            values = [figure(r, key) for r in runs]
            table[name][heading] = None if None in values else statistics.median(values) * scale
    return table


def ratios(pairs: dict[str, tuple[list[dict], list[dict]]]) -> dict[str, dict]:
    """Per pair of runs, each figure's ratio: the median of the rounds' own ratios (both runs of a
    round saw that round's machine)."""
    table = {}
    for name, (ours, theirs) in pairs.items():
        table[name] = {}
        for heading, (key, _) in FIGURES.items():
            each = [(figure(a, key), figure(b, key)) for a, b in zip(ours, theirs)]
            each = [a / b if b and a is not None else None for a, b in each]
            table[name][heading] = None if None in each else statistics.median(each)
    return table


def print_table(rows: dict[str, dict[str, float | None]], title: str = "") -> None:
    """Rows of figures, a column each that some row has: four digits, all from 10,000 up."""
    shown = [h for h in next(iter(rows.values())) if any(r[h] is not None for r in rows.values())]
    width = max(map(len, [title, *rows])) + 2
    print(f"\n{title:<{width}}" + "".join(f"{h:>{max(11, len(h) + 2)}}" for h in shown))
    for name, row in rows.items():
        values = [row[h] for h in shown]
        cells = ["-" if v is None else f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}" for v in values]
        cells = [f"{cell:>{max(11, len(h) + 2)}}" for cell, h in zip(cells, shown)]
        print(f"{name:<{width}}" + "".join(cells))


def run_compare(argv: list[str], args) -> dict:
    """The settings as given (argv less --compare's), then with each '|'-separated set of flags
    added, each in a fresh process (no threads, memory, compiled code left by the one before), all
    in turn, --rounds times, so that a machine whose speed drifts slows each round's alike: each
    figure the median of the rounds, each ratio to the first the median of the rounds' own."""
    settings = [a for a in argv if not a.startswith("--compare=")]
    if "--compare" in settings:
        at = settings.index("--compare")
        del settings[at : at + 1 + (settings[at + 1 : at + 2] == [args.compare])]
    variants = {"as given": settings}
    variants |= {flags.strip(): settings + shlex.split(flags) for flags in args.compare.split("|")}
    for variant in map(parse_args, variants.values()):  # each checked now, not after others ran
        check_parallel_sizes(settings_config(variant), variant.tp, variant.pp)
    rounds = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="tinytp-compare-") as tmp:
        path = os.path.join(tmp, "result.json")
        for number, (name, variant) in itertools.product(range(args.rounds), variants.items()):
            print(f"\n=== {name}, round {number + 1} of {args.rounds} ===", flush=True)
            command = [sys.executable, os.path.abspath(__file__), *variant, "--output-json", path]
            subprocess.run(command, check=True)
            with open(path) as f:
                rounds[name].append(json.load(f))
    first = next(iter(rounds))
    pairs = {f"{name} / {first}": (rounds[name], rounds[first]) for name in list(rounds)[1:]}
    table = {"medians": medians(rounds), "ratios": ratios(pairs)}
    print_table(table["medians"], f"medians of {args.rounds} rounds")
    if pairs:
        print_table(table["ratios"], "the rounds' ratios, median")
    return table | {"rounds": rounds}


# Many callers at once, in-process (--concurrency) and over HTTP (--serve) ---------------------


def stream_token_times(llm, params: SamplingParams, prompt, times: list[float]) -> None:
    """One caller: its prompt streamed, when each of its tokens came (its start first) put in
    `times` as they come: another thread may watch it grow."""
    times.append(time.perf_counter())
    for [output] in llm.stream_outputs([prompt], params):
        arrived = len(output.outputs[0].token_ids) - (len(times) - 1)
        times += [time.perf_counter()] * arrived


def serving_figures(callers: list[list[float]], wall: float) -> dict:
    """vLLM's benchmark_serving names: output tokens/s, time to first token, inter-token latency."""
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


def one_by_one_and_at_once(stream, prompts: list, beside=None) -> dict:
    """`stream(prompt, times)` for each prompt one after another, then for all at once, a thread
    each, and `beside(their times)` in a thread of its own if given: the figures of both."""
    callers, start = [[] for _ in prompts], time.perf_counter()
    for prompt, times in zip(prompts, callers):
        stream(prompt, times)
    sequential = serving_figures(callers, time.perf_counter() - start)
    callers, start = [[] for _ in prompts], time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(prompts) + 1) as pool:
        calls = [pool.submit(stream, prompt, times) for prompt, times in zip(prompts, callers)]
        for call in [*calls, *([pool.submit(beside, callers)] if beside else [])]:
            call.result()
    at_once = serving_figures(callers, time.perf_counter() - start)
    return {"sequential": sequential, "concurrent": at_once}


def run_concurrency(args) -> dict:
    """--concurrency N: N caller threads at once on one LLM (the engine batches them), one prompt
    each, exactly --output-len tokens, against the same prompts one after another. The token
    budget at work: with --arrival-prompt-len L, a prompt of L tokens arrives once each caller at
    once has 8 tokens, in chunks of --max-num-batched-tokens: the longest gap is a chunk's cost."""
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=args.output_len)
    arrival_len = args.arrival_prompt_len or 0
    model = Model(args)
    prompts = model.prompts(args.concurrency, args.input_len)
    [arrival] = model.prompts(1, arrival_len, seed=1)
    max_model_len = max(args.input_len + args.output_len, arrival_len + 1)
    with model.llm(args.concurrency + 1, max_model_len) as llm:

        def arrive(callers: list[list[float]]) -> None:
            while min(map(len, callers)) <= min(8, args.output_len):  # (their starts first)
                time.sleep(1e-3)
            llm.generate([arrival], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)

        stream = functools.partial(stream_token_times, llm, params)
        stream(prompts[0], [])  # warm-up
        llm.reset_prefix_cache()  # each phase computes the prompts whole
        figures = one_by_one_and_at_once(stream, prompts, arrive if arrival else None)
        largest_batch = llm.stats()["largest_batch"]
    arriving = f", a prompt of {arrival_len} arriving" if arrival else ""
    print(f"tinytp, {model}, {args.concurrency} callers{arriving}, largest batch {largest_batch}")
    print_table({"one by one": figures["sequential"], "at once": figures["concurrent"]})
    speedup = (
        figures["concurrent"]["output_throughput"] / figures["sequential"]["output_throughput"]
    )
    print(f"concurrency speedup: {speedup:.2f}x the tokens per second one by one")
    return {"concurrency_speedup": speedup, "largest_batch": largest_batch, **figures}


def stream_over_http(port: int, output_len: int, prompt: list[int], times: list[float]) -> None:
    """stream_token_times over /v1/completions: a chunk a token, its text "" where the token ends
    in half of a character (serve.py and vLLM), each timed, as vLLM's benchmark does."""
    import http.client

    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    times.append(time.perf_counter())
    json_header = {"Content-Type": "application/json"}
    connection.request("POST", "/v1/completions", json.dumps(body), json_header)
    for line in connection.getresponse():
        event = json.loads(line[6:]) if line.startswith(b"data: {") else {}
        if event.get("choices"):
            times.append(time.perf_counter())
        if event.get("usage"):  # the last event: every token is in
            times += [times[-1]] * (event["usage"]["completion_tokens"] - (len(times) - 1))
    connection.close()


def server_commands(args, model_dir: str) -> dict[str, tuple[list[str], dict]]:
    """serve.py, and with --vllm-python vLLM's CPU build's OpenAI server on the same checkpoint and
    settings, once for each --vllm-bind: name -> (command, its environment)."""
    settings = ["--model", model_dir, "--dtype", args.dtype, "--tensor-parallel-size", str(args.tp)]
    settings += ["--pipeline-parallel-size", str(args.pp)]
    settings += ["--max-num-seqs", str(args.concurrency)]
    settings += ["--max-model-len", str(args.input_len + args.output_len)]
    settings += ["--enforce-eager"] * args.enforce_eager  # vLLM's too: no torch.compile
    serve_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "serve.py")
    ours = [sys.executable, serve_py, *settings, *["--async-scheduling"] * args.async_scheduling]
    commands = {"tinytp": (ours + (["--device", args.device] if args.device else []), {})}
    vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", *settings]
    # VLLM_CPU_KVCACHE_SPACE: 1 GiB of KV cache, not a share of all memory. vLLM's default binding
    # keeps a core for its front end (on 2 cores, its worker gets one thread); a user tuning it on a
    # small machine gives its worker every core: VLLM_CPU_OMP_THREADS_BIND, '|' between the ranks.
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"}
    cores = np.array_split(sorted(os.sched_getaffinity(0)), args.tp * args.pp)
    every_core = {"VLLM_CPU_OMP_THREADS_BIND": "|".join(",".join(map(str, c)) for c in cores)}
    for bind in args.vllm_bind if args.vllm_python else []:
        commands[f"vLLM ({bind})"] = (vllm, env | every_core if bind == "all" else env)
    return commands


@contextlib.contextmanager
def servers_running(args, model_dir: str):
    """Each of server_commands, started one at a time (start-up timed alone), stopped at the end:
    yields name -> (port, seconds from its start to its first 200 on /health)."""
    import http.client

    started, servers = [], {}
    try:
        for name, (command, env) in server_commands(args, model_dir).items():
            with contextlib.closing(socket.socket()) as s:  # a port free now
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            command, start = [*command, "--port", str(port)], time.perf_counter()
            quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
            started.append(subprocess.Popen(command, env=os.environ | env, **quiet))
            while name not in servers:
                if started[-1].poll() is not None:
                    exited = f"the server exited ({started[-1].returncode}) first"
                    raise RuntimeError(f"{exited}: {shlex.join(command)}")
                with contextlib.suppress(OSError):
                    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                    connection.request("GET", "/health")
                    if connection.getresponse().status == 200:
                        servers[name] = (port, time.perf_counter() - start)
                        continue
                time.sleep(1)
            bound = [f"{key}={value}" for key, value in env.items()]
            print(f"{name} serving after {servers[name][1]:.1f} s", *bound, flush=True)
        yield servers
    finally:
        for server in started:
            server.terminate()
        for server in started:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.wait(timeout=60)
            server.kill()  # (none, where it has exited)


# vLLM's workers keep polling their queue for a second after their last step (sched_yield between
# looks: shm_broadcast's busy_loop_s), a core's worth on 2 cores: a server timed in that second
# would run beside it, so each round starts once it has passed.
SETTLE_SECONDS = 2


def run_serve(args) -> dict:
    """--concurrency's figures over HTTP, JSON and the server's threads in the way, on serve.py;
    with --vllm-python, vLLM's CPU server too (at each --vllm-bind), all alive, the same client on
    each in turn, --rounds times, and each figure's ratio tinytp / vLLM."""
    model_dir = resolve_model(args.model)
    vocab = read_config(os.path.join(model_dir, "config.json")).vocab_size
    rng = np.random.default_rng(0)
    prompts = rng.integers(vocab, size=(args.concurrency, args.input_len)).tolist()
    with servers_running(args, model_dir) as servers:
        rounds, alone = {name: [] for name in servers}, len(servers) == 1
        for port, _ in servers.values():
            stream_over_http(port, 4, prompts[0], [])  # warm-up
        # This client's start-up heap (torch, tinytp) marked static: a collection walking it
        # stops every client thread at once, a gap in the tokens it times.
        gc.collect()
        gc.freeze()
        turns = itertools.product(range(1 if alone else args.rounds), servers.items())
        for _, (name, (port, _)) in turns:
            time.sleep(0 if alone else SETTLE_SECONDS)
            stream = functools.partial(stream_over_http, port, args.output_len)
            rounds[name].append(one_by_one_and_at_once(stream, prompts))
            at_once = rounds[name][-1]["concurrent"]["output_throughput"]
            print(f"{name}: {at_once:.1f} tok/s at once", flush=True)
    load = f"load {os.getloadavg()[0]:.1f} (of {os.cpu_count()} cores)"
    sizes = f"tp={args.tp}" + (f" x pp={args.pp}" if args.pp > 1 else "")
    print(f"\nserve.py, {sizes}, {args.dtype}, {args.concurrency} HTTP clients; {load}")
    pairs = {f"tinytp / {name}": (rounds["tinytp"], rounds[name]) for name in list(rounds)[1:]}
    table = {"medians": medians(rounds), "ratios": ratios(pairs)}
    print_table(table["medians"], f"medians of {len(rounds['tinytp'])} round(s)")
    if pairs:
        print_table(table["ratios"], "the rounds' ratios, median")
    startup = {name: seconds for name, (_, seconds) in servers.items()}
    return table | {"startup_seconds": startup, "rounds": rounds}


# --stream-cpu: the driver's CPU a token, early and late in one long stream --------------------

STREAM_TOKENS, WINDOWS = 2000, ((200, 600), (1500, 1900))  # tokens early, tokens late
NEVER_FOUND = ["\x00 never said", "Observation: nothing"]  # stop strings looked for at each token


def run_stream_cpu(args) -> dict:
    """One stream of 2,000 tokens with stop strings (looked for at every token, never found): the
    driver's CPU a token over tokens 200-600 and 1,500-1,900, which should be the same (a cost that
    grows with the output is one the front end should not have): the whole process's, the engine
    loop thread's (scheduling, and waiting for the workers: it polls for up to a millisecond a
    step), the caller's (OutputProcessor: the text, the stop strings). And the text streamed, a
    piece a token, checked against generate's and against the whole output decoded at once."""
    model = Model(args)
    [prompt] = model.prompts(1, args.input_len)
    params = SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=STREAM_TOKENS, stop=NEVER_FOUND
    )
    with model.llm(1, args.input_len + STREAM_TOKENS) as llm:
        loop = time.pthread_getcpuclockid(llm.engine_client.thread.ident)
        clocks = {"driver": time.process_time, "engine loop": lambda: time.clock_gettime(loop)}
        clocks |= {"caller": time.thread_time}
        llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
        rounds = []  # each round's clocks at each window's first and last token
        for _ in range(args.rounds):
            pieces, at = [], {}
            for piece in llm.stream(prompt, params):
                pieces.append(piece)  # (a piece a token: "" for one in half of a character)
                if len(pieces) in itertools.chain(*WINDOWS):
                    at[len(pieces)] = {name: clock() for name, clock in clocks.items()}
            rounds.append(at)
        [whole] = llm.generate([prompt], params, use_tqdm=False)
        decoded = llm.tokenizer.decode(whole.outputs[0].token_ids, skip_special_tokens=True)
    if not len(pieces) == len(whole.outputs[0].token_ids) == STREAM_TOKENS:
        raise RuntimeError(f"{len(pieces)} pieces, not {STREAM_TOKENS}: a stop string was found")
    unchanged = "".join(pieces) == whole.outputs[0].text == decoded
    table, (a, b), (c, d) = {}, *WINDOWS
    for name in clocks:  # each figure the median of the rounds'
        early = statistics.median((at[b][name] - at[a][name]) / (b - a) * 1e6 for at in rounds)
        late = statistics.median((at[d][name] - at[c][name]) / (d - c) * 1e6 for at in rounds)
        table[name] = {f"{a}-{b} us": early, f"{c}-{d} us": late, "late / early": late / early}
    streams = f"{args.rounds} streams of {STREAM_TOKENS} tokens, {len(NEVER_FOUND)} stop strings"
    print(f"tinytp, {model}: {streams}; load {os.getloadavg()[0]:.1f} (of {os.cpu_count()} cores)")
    print_table(table, "CPU a token, median")
    print(f"the text streamed {'equals' if unchanged else 'DIFFERS FROM'} generate's and decode's")
    if not unchanged:
        raise RuntimeError("the streamed text is not the output's")
    return {"cpu_us_per_token": table, "text_unchanged": unchanged}


# The command line -----------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench.py", description=__doc__.split("\n")[0])
    parser.allow_abbrev = False
    modes = parser.add_argument_group("what to run (none: the latency benchmark)")
    add = modes.add_mutually_exclusive_group().add_argument
    add("--ipc", action="store_true", help="time the IPC transports, not the model")
    add("--explain", action="store_true", help="how the model is cut across --tp ranks")
    add("--trace", action="store_true", help="a timeline of one decode step, every process")
    add("--serve", action="store_true", help="--concurrency over HTTP: serve.py (and vLLM's)")
    stream_cpu = f"the driver's CPU a token early and late in a {STREAM_TOKENS}-token stream"
    add("--stream-cpu", action="store_true", help=stream_cpu)
    compare = "this run, then with each set of flags added: in turn, --rounds times, each run in "
    compare += f"a process of its own (default: {SEED_VARIANTS}; one flag: --compare=FLAG)"
    add("--compare", nargs="?", const=SEED_VARIANTS, metavar="'FLAGS | ...'", help=compare)
    add = modes.add_argument
    add("--concurrency", type=int, metavar="N", help="N callers at once, against one by one")
    add = parser.add_argument_group("the model").add_argument
    add("--model", help="checkpoint directory or hub id (default: a ~56M Llama, random weights)")
    add("--config", help="a config.json to run with random weights (--model's: its shapes)")
    add("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    add("--pp", "-pp", "--pipeline-parallel-size", dest="pp", type=int, default=1)
    add("--device", choices=["cpu", "cuda"], help="default: cuda where GPUs are visible, else cpu")
    dtypes = ["auto", "float32", "bfloat16", "float16"]
    add("--dtype", choices=dtypes, default="auto", help="auto: the checkpoint's, as the CPU can")
    add = parser.add_argument_group("vLLM's benchmark_latency").add_argument
    add("--batch-size", type=int, default=8)
    add("--input-len", type=int, default=32)
    add("--output-len", type=int, default=128)
    add("--num-iters-warmup", type=int, default=10)
    add("--num-iters", type=int, default=30)
    add("--output-json", help="write the results to this file")
    add = parser.add_argument_group("the engine").add_argument
    backends = ["tinytp", "inprocess", "hf"]
    add("--backend", choices=backends, default="tinytp", help="hf: transformers; inprocess: no IPC")
    add("--enforce-eager", action="store_true", help="decode steps eager, not compiled")
    add("--cuda-graphs", action="store_true", help="decode steps as CUDA graphs")
    add("--async-scheduling", action="store_true", help="send a step while the one before runs")
    add("--max-num-batched-tokens", type=int, help="the tokens one step may run")
    add("--logprobs", type=int, help="every request asks for this many logprobs a token")
    add("--arrival-prompt-len", type=int, metavar="N", help="--concurrency: a prompt of N arrives")
    tinytp.add_kv_cache_flags(parser)
    add = parser.add_argument_group("yardsticks").add_argument
    add("--rounds", type=int, default=3, help="of --compare, --stream-cpu, --serve beside vLLM")
    add("--vllm-python", help="--serve: a Python with vLLM's CPU build, its server beside ours")
    binds, bind = ["default", "all"], "vLLM's worker at its default binding, on all cores, or both"
    add("--vllm-bind", nargs="+", choices=binds, default=binds, help=bind)
    args = parser.parse_args(argv)
    check_args(parser.error, args)
    return args


def check_args(error, args: argparse.Namespace) -> None:
    """What parse_args cannot check alone: now, not after the whole benchmark has run."""
    given = [
        mode for mode in ("ipc", "explain", "trace", "serve", "stream_cpu") if vars(args)[mode]
    ]
    if given and args.concurrency is not None and given != ["serve"]:
        error(f"--{given[0]} runs no callers: --concurrency is its own mode")
    for name in ("batch_size", "input_len", "output_len", "num_iters", "rounds", "concurrency"):
        least = 2 if name == "output_len" else 1  # output_len 2: a decode step to time
        if vars(args)[name] is not None and vars(args)[name] < least:
            error(f"--{name.replace('_', '-')} must be at least {least}")
    folder = os.path.dirname(args.output_json or "") or "."
    unwritable = os.path.isdir(args.output_json or folder) or not os.access(folder, os.W_OK)
    if args.output_json is not None and unwritable:
        there = "" if os.path.isdir(folder) else f": there is no folder {folder}"
        error(f"--output-json needs a file it can write, got {args.output_json!r}{there}")
    for flag in ("cuda_graphs", "async_scheduling", "logprobs"):  # (transformers' steps: eager)
        if vars(args)[flag] not in (None, False) and args.backend == "hf":
            error(f"--{flag.replace('_', '-')} is tinytp's: --backend hf runs transformers'")
    if args.backend != "tinytp" and (given or args.concurrency or args.tp != 1 or args.pp != 1):
        error(f"--backend {args.backend} runs the latency benchmark, at --tp 1 --pp 1")
    if args.serve and not (args.model and args.concurrency):
        error("--serve needs --model (one with a tokenizer) and --concurrency N (the clients)")
    if args.stream_cpu and not args.model:
        error("--stream-cpu needs --model, one with a tokenizer (its stop strings are text)")
    if args.vllm_python and not args.serve:
        error("--vllm-python is --serve's: it starts vLLM's server beside serve.py")
    if args.arrival_prompt_len is not None and not (args.concurrency and args.arrival_prompt_len):
        error("--arrival-prompt-len is --concurrency's, a prompt of at least 1 token")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # The first flag given runs (--serve before --concurrency, which it takes too).
    modes = {
        "compare": functools.partial(run_compare, argv),
        "ipc": run_ipc,
        "explain": run_explain,
    }
    modes |= {"trace": run_trace, "serve": run_serve, "concurrency": run_concurrency}
    modes |= {"stream_cpu": run_stream_cpu}
    given = [run for mode, run in modes.items() if vars(args)[mode] not in (None, False)]
    try:
        result = (given + [run_latency])[0](args)
    except (ValueError, FileNotFoundError, subprocess.CalledProcessError) as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=4)
    return 0


if __name__ == "__main__":
    sys.exit(main())
