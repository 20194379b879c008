"""Worker processes: the messages they get, the shared-memory `MessageQueue`, the `Worker`
(one rank's model, KV cache and requests) and `worker_main`, its loop."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import multiprocessing
import multiprocessing.synchronize
import multiprocessing.util
import numbers
import os
import pickle
import signal
import struct
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, fields, replace
from datetime import timedelta
from multiprocessing import resource_tracker, shared_memory
from typing import Any, Callable

import torch
import torch.distributed as dist
from tqdm import tqdm

from model import (
    LlamaForCausalLM,
    ModelConfig,
    ModelInputs,
    TPGroup,
    init_dummy_weights,
    kv_cache_shape,
    load_checkpoint,
)


# Messages between the driver and the workers ------------------------------------------
def is_integer(value) -> bool:
    """An int (numpy's too), but not a bool, which Python counts as one."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_text(value) -> bool:  # (not only spaces: a bad word, stripped, must be some token)
    return isinstance(value, str) and value.strip() != ""


def is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_count(name: str, value) -> None:
    """Refuse a count (n, max_tokens, max_num_seqs) that is not an integer >= 1."""
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def token_id_list(value: int | list[int] | None, key: str) -> list[int]:
    """Config files give token ids such as eos_token_id as one int or a list."""
    ids = [] if value is None else [value] if isinstance(value, int) else value
    if not isinstance(ids, list) or not all(is_integer(i) and i >= 0 for i in ids):
        raise ValueError(f"{key} must be a token id or a list of them, got {value!r}")
    return list(ids)


MIN_TEMPERATURE = 1e-2  # vLLM's _MAX_TEMP: a lower temperature other than 0 is raised to it
# The sampler's float32: a bias or penalty it would hold as inf (or 0) is refused up front
MAX32, TINY32 = torch.finfo(torch.float32).max, torch.finfo(torch.float32).tiny
FAILED = -1  # a sampled token's place in a step's reply when the request's row had no distribution
MAX_LOGPROBS = 20  # vLLM's max_logprobs default: the most log-probabilities a token may ask for
LOGPROBS_WORDS = f"None or an integer from 0 to {MAX_LOGPROBS} (vLLM's max_logprobs)"
IDS, WORDS = "None or a list of token ids", "None or a list of non-empty strings"
TRUNCATE = "None, -1 (max_model_len) or an integer >= 1"


def checked_fields(params: SamplingParams) -> list[tuple[str, bool, str]]:
    """SamplingParams checked for type and range: (each field, whether valid, what it must be)."""

    def within(value, low: float, high: float) -> bool:  # (a NaN is in no range)
        return is_number(value) and low <= value <= high

    def up_to_max_logprobs(k) -> bool:
        return k is None or is_integer(k) and 0 <= k <= MAX_LOGPROBS

    bias, repetition, temperature = params.logit_bias, params.repetition_penalty, params.temperature
    top_k, float32_range = params.top_k, f"from {TINY32:.3g} to {MAX32:.3g}"
    ids, words, k = params.allowed_token_ids, params.bad_words, params.truncate_prompt_tokens
    return [
        # n: at most vLLM's VLLM_MAX_N_SEQUENCES (a huge n would make that many requests at once)
        ("n", is_integer(params.n) and 1 <= params.n <= 16384, "an integer from 1 to 16384"),
        ("temperature", within(temperature, 0, MAX32), f"a number from 0 to {MAX32:.3g}"),
        ("top_p", within(params.top_p, 0, 1) and params.top_p > 0, "a number in (0, 1]"),
        ("top_k", is_integer(top_k) and top_k >= -1, "an integer >= 1, or 0 or -1 for all tokens"),
        ("min_p", within(params.min_p, 0, 1), "a number in [0, 1]"),
        (  # what torch takes
            "seed",
            params.seed is None or is_integer(params.seed) and 0 <= params.seed < 2**64,
            "None or an integer in [0, 2**64)",
        ),
        *[(name, type(getattr(params, name)) is bool, "True or False") for name in BOOL_FIELDS],
        ("min_tokens", is_integer(params.min_tokens) and params.min_tokens >= 0, "an integer >= 0"),
        ("presence_penalty", within(params.presence_penalty, -2, 2), "a number in [-2, 2]"),
        ("frequency_penalty", within(params.frequency_penalty, -2, 2), "a number in [-2, 2]"),
        ("repetition_penalty", within(repetition, TINY32, MAX32), f"a number {float32_range}"),
        ("logprobs", up_to_max_logprobs(params.logprobs), LOGPROBS_WORDS),
        ("prompt_logprobs", up_to_max_logprobs(params.prompt_logprobs), LOGPROBS_WORDS),
        (
            "logit_bias",
            bias is None
            or isinstance(bias, dict)
            and all(is_integer(t) and within(b, -MAX32, MAX32) for t, b in bias.items()),
            f"None or a dict of token ids to numbers from -{MAX32:.3g} to {MAX32:.3g}",
        ),
        ("allowed_token_ids", ids is None or type(ids) is list and all(map(is_integer, ids)), IDS),
        ("bad_words", words is None or type(words) is list and all(map(is_text, words)), WORDS),
        ("truncate_prompt_tokens", k is None or is_integer(k) and (k == -1 or k >= 1), TRUNCATE),
    ]


@dataclass(kw_only=True)  # keywords only: vLLM's positional order differs
class SamplingParams:
    """How to pick each next token, as vLLM's fields of these names: temperature 0 is greedy,
    sampling_probabilities applies the rest; n samples per prompt, repeatable with a seed. A
    sequence ends at an end-of-sequence token (unless ignore_eos), one of stop_token_ids, a stop
    string (the text ends before it) or after max_tokens, never before min_tokens. Before all that,
    adjusted_logits masks (allowed_token_ids, bad_words), adds logit_bias and applies the
    penalties. logprobs, prompt_logprobs: the k likeliest tokens' log-probabilities (and the chosen
    one's) at each generated, prompt token. Numbers are checked against float32, the sampler's:
    one it would hold as inf or 0 would leave a row of logits with no distribution."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: as many as max_model_len leaves, as in vLLM
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id: a number added to its logit
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    best_of: int | None = None  # vLLM V1's: taken, but refused above 1 at generate (Processor)
    logits_processors: list | None = None  # as vLLM V1: refused at generate, if any
    include_stop_str_in_output: bool = False  # the text ends with the stop string, not before it
    detokenize: bool = True  # False: token ids alone, no text (nor Logprob.decoded_token)
    skip_special_tokens: bool = True  # in the text (tokenizer.decode's)
    spaces_between_special_tokens: bool = True  # (a slow tokenizer's: fast ones ignore it)
    bad_words: list[str] | None = None  # never completed: the last token of each is masked
    allowed_token_ids: list[int] | None = None  # the only tokens that may be sampled
    truncate_prompt_tokens: int | None = None  # the prompt's last k tokens (-1: max_model_len)
    bad_words_token_ids = ()  # (not a field) bad_words as token ids: the Processor's tokenizer's

    @property
    def adjusts_logits(self) -> bool:
        """Whether adjusted_row changes anything for it."""
        penalties = self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
        masks = self.bad_words or self.allowed_token_ids
        return bool(self.logit_bias or self.min_tokens or penalties or masks)

    def __new__(cls, *args, **kwargs):
        # vLLM's other fields (beam search, guided decoding, ...) and typos: a ValueError naming
        # the field, not a TypeError, and never accepted, even at vLLM's default.
        for name in kwargs.keys() - {f.name for f in fields(cls)}:
            raise ValueError(
                f"SamplingParams({name}=...): tinytp does not support {name}; it has "
                f"{', '.join(f.name for f in fields(cls))}"
            )
        return super().__new__(cls)

    def __post_init__(self):
        # Checked for type as well as range, here in the driver: a NaN or a float count that
        # reached the workers would fail inside a step and take every request with it.
        for name, valid, allowed in checked_fields(self):
            if not valid:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")
        stop = [self.stop] if isinstance(self.stop, str) else [] if self.stop is None else self.stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(
                f"stop must be a string or a list of non-empty strings, got {self.stop!r}"
            )
        self.stop = list(stop)
        if self.stop and not self.detokenize:  # as vLLM: a stop string is looked for in the text
            raise ValueError(f"stop={self.stop} needs detokenize=True: stop strings are text")
        if self.best_of is not None and not (is_integer(self.best_of) and self.best_of >= self.n):
            raise ValueError(f"best_of must be an integer >= n={self.n}, got {self.best_of!r}")
        self.stop_token_ids = token_id_list(self.stop_token_ids, "stop_token_ids")
        if self.max_tokens is not None:
            check_count("max_tokens", self.max_tokens)
            if self.min_tokens > self.max_tokens:
                raise ValueError(
                    f"min_tokens={self.min_tokens} must be at most max_tokens={self.max_tokens}"
                )
        # 1 / temperature would overflow the logits into NaN
        if 0 < self.temperature < MIN_TEMPERATURE:
            print(
                f"tinytp: temperature {self.temperature:g} is below {MIN_TEMPERATURE:g}, which "
                "gives NaN or inf in "
                f"the sampler: raised to {MIN_TEMPERATURE:g}, as vLLM does (0 is greedy)",
                file=sys.stderr,
            )
            self.temperature = MIN_TEMPERATURE


BOOL_FIELDS = [f.name for f in fields(SamplingParams) if type(f.default) is bool]  # (checked)


@dataclass
class NewRequest:
    """A request new to the workers: sent in full once, then by id. Sent again when it resumes after
    a preemption: the workers keep their copy (its tokens and generator) and take its new blocks."""

    request_id: int
    prompt_token_ids: list[int]
    # its blocks of the KV cache, chosen by the driver so every rank agrees (vLLM's block_ids)
    block_ids: list[int]
    params: SamplingParams
    seed: int  # always set: every rank seeds the same generator, so all sample alike
    # tokens whose keys and values its first blocks already hold (prefix caching)
    num_computed_tokens: int = 0
    # the tokens that min_tokens holds back (end-of-sequence and stop tokens); none without it
    min_tokens_stop_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step, as deltas: never the last sampled token, which each worker appended to its copy."""

    new_requests: list[NewRequest]
    scheduled_ids: list[int]  # requests that run this step, in batch order
    # each one's tokens this step: 1 when it decodes, else a chunk of its prompt
    num_scheduled_tokens: list[int]
    finished_ids: list[int]  # requests the workers can forget
    # blocks appended to running requests' block tables this step (vLLM's new_block_ids)
    new_block_ids: dict[int, list[int]] = field(default_factory=dict)
    # Pipeline parallelism only (vLLM's CachedRequestData.new_token_ids): the sampled tokens among
    # those each request computes this step, as the stages before the last never see them sampled.
    new_token_ids: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """Rank 0's answer to one step."""

    # one per scheduled request, in its order; None: a prompt part-way done
    sampled_token_ids: list[int | None]
    execute_seconds: float  # time inside the worker, to measure the executor's overhead
    # for the requests that asked, by id (logprobs_of's entries): the sampled token's, and each of
    # the prompt's tokens scored this step (in order); empty when none asked
    logprobs: dict[int, tuple] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[tuple]] = field(default_factory=dict)


@dataclass
class RPCCall:
    """A method call broadcast to every worker, a step too (execute_model, the SchedulerOutput its
    argument). unique_reply_rank (vLLM's name) is the one rank that answers, or None for all: rank 0
    alone answers a step, as every rank sampled the same tokens. Any rank answers with an error."""

    call_id: int
    method: str | bytes  # a Worker method's name, or a pickled function called with the Worker
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    unique_reply_rank: int | None = None


@dataclass
class RPCResult:
    call_id: int
    value: Any = None
    error: str | None = None  # the worker's traceback text


SHUTDOWN = "shutdown"  # the method name that ends the worker loop

# Waiting: poll while yielding the core, then sleep until the doorbell rings -----------
# Poll with sched_yield, not a pure spin: a TP=2 run on 2 cores has 3 processes, and a spinner can
# hold the very core that the process it waits for needs (docs/performance.md: a pure spin's).
YIELD_SECONDS = 1e-3
SLEEP_FRACTION = 0.05  # then, with no doorbell, sleep 5% of the time waited so far
MIN_SLEEP, MAX_SLEEP = 100e-6, 10e-3
# With a doorbell, the ring ends the sleep, and its timeout only spaces the liveness checks: long,
# since each timed wake-up of the driver takes a core from a rank (frequent naps slowed every tp).
DOORBELL_SLEEP = 50e-3


def wait_until(
    ready: Callable[[], bool],
    timeout: float | None,
    what: str | Callable[[], str],
    check: Callable[[], None] | None = None,
    doorbell=None,
) -> None:
    """Return once ready() is true; after `timeout` seconds, raise TimeoutError naming `what` (or
    what(), a message built only then). Past the polling, call check() (it raises if a worker or the
    driver died), then sleep; a `doorbell` (a semaphore the writer releases) ends the sleep."""
    start = time.perf_counter()
    while not ready():
        waited = time.perf_counter() - start
        if timeout is not None and waited > timeout:
            raise TimeoutError(
                f"{what if isinstance(what, str) else what()}: nothing after {timeout:g} s"
            )
        if waited < YIELD_SECONDS:
            os.sched_yield()
            continue
        if check is not None:
            check()
        if doorbell is None:
            time.sleep(min(MAX_SLEEP, max(MIN_SLEEP, waited * SLEEP_FRACTION)))
            continue
        while doorbell.acquire(block=False):
            pass  # rings for chunks that were picked up while polling: stale
        if not ready():  # looked at after the drain, so a ring after this look is never lost
            doorbell.acquire(timeout=DOORBELL_SLEEP)


# The shared-memory message queue ------------------------------------------------------
def new_shared_memory(size: int) -> shared_memory.SharedMemory:
    """A new block, zero-filled, named after this process so leftovers are easy to trace."""
    try:
        return shared_memory.SharedMemory(
            name=f"tinytp_{os.getpid()}_{os.urandom(4).hex()}", create=True, size=size
        )
    except OSError as e:  # out of files (inodes), most likely: each block is one, however small
        raise RuntimeError(
            f"cannot create a shared-memory block in /dev/shm ({e.strerror}): if it is out of "
            "files (df -i /dev/shm), remove leftovers of killed programs (ls /dev/shm)"
        ) from e


def check_free_shared_memory(blocks: list[shared_memory.SharedMemory | None]) -> None:
    """New blocks are sparse: tmpfs hands out a page at its first touch, and with /dev/shm full that
    touch is a SIGBUS ("Bus error") that kills the process: a creator checks they fit first."""
    needed = sum(block.size for block in blocks if block is not None)
    stat = os.statvfs("/dev/shm")
    if stat.f_bavail * stat.f_frsize < needed:
        raise RuntimeError(
            f"/dev/shm has {stat.f_bavail * stat.f_frsize / 2**20:.2f} MiB free; tinytp needs "
            f"{needed / 2**20:.1f} MiB: free some, or give a container more "
            "(docker run --shm-size=1g)"
        )


@dataclass(frozen=True)
class QueueHandle:
    """What a process needs to attach to a queue that another process created."""

    name: str
    num_readers: int
    num_chunks: int
    chunk_bytes: int
    doorbells: tuple  # one multiprocessing.Semaphore per reader (pass handles as Process args)


CHUNK_HEADER = struct.Struct("<IQ")  # payload bytes in this chunk, bytes in the whole message


class MessageQueue:
    """One writer, N readers, a ring of fixed-size chunks in one shared-memory block. A pickled
    message longer than a chunk continues in the next ones, so any size goes through a small
    ring; a sleeping reader is woken by its doorbell.

    Why the flag order is safe: the writer clears *written*, resets the read flags, fills the
    chunk and sets *written* last; a reader is done with the chunk before it sets its *read*
    flag, so no chunk is overwritten while read. A reader checks its own *read* flag *before*
    *written*: a reset flag means the writer has already cleared *written* for this round, so
    *written* then truthfully says the chunk is complete (the other order can read a half-written
    chunk). This needs each process's stores, and its loads, kept in program order, as x86 keeps
    them. ARM keeps neither, and Python has no fence: vLLM's memory_fence(), a lock taken and
    released, is an acquire and a release there, not a fence (docs/exercises.md, "Why x86 only")."""

    def __init__(
        self, handle: QueueHandle, shm: shared_memory.SharedMemory, reader: int | None, owner: bool
    ):
        self.handle, self.shm, self.buf = handle, shm, shm.buf
        self.reader = reader  # None for the writer's side
        self.owner = owner  # the creator unlinks the block
        # The block (README, "The shared-memory queue"): all chunks' flags, then the chunks. The
        # *_at offsets are computed once: each Python operation counts in enqueue and dequeue.
        flags_bytes, chunks = 1 + handle.num_readers, range(handle.num_chunks)
        self.written_at = [i * flags_bytes for i in chunks]
        self.read_flags_at = [slice(i * flags_bytes + 1, (i + 1) * flags_bytes) for i in chunks]
        if reader is not None:
            self.my_read_at = [i * flags_bytes + 1 + reader for i in chunks]
        self.chunk_at = [handle.num_chunks * flags_bytes + i * handle.chunk_bytes for i in chunks]
        self.capacity = handle.chunk_bytes - CHUNK_HEADER.size  # payload bytes per chunk
        self.no_reads, self.all_read = bytes(handle.num_readers), bytes([1] * handle.num_readers)
        self.who_waits = (  # built once
            f"queue {handle.name}: the writer waited for readers to free a chunk"
            if reader is None
            else f"queue {handle.name}: reader {reader} waited for a message"
        )
        self.next_chunk = 0  # the writer's or this reader's position in the ring
        # the writer or this reader gave up part-way through a message (see enqueue, dequeue)
        self.cut_off = False

    # Sizes: vLLM's ring is 10 chunks of up to 16-24 MiB (it carries images). A step here is
    # ~150 bytes, a prefill of 8 prompts of 4096 tokens ~130 KB: 8 chunks of 1 MiB hold a few
    # calls whole, larger ones stream through. Replies, rank 0's tokens, get 4 x 256 KiB.
    @classmethod
    def create(
        cls,
        num_readers: int,
        num_chunks: int = 8,
        chunk_bytes: int = 1 << 20,
        reader: int | None = None,
        doorbells: list | None = None,
    ) -> MessageQueue:
        """A new queue; readers may share a doorbell with other queues (the driver's replies do)."""
        doorbells = doorbells or [
            multiprocessing.get_context("spawn").Semaphore(0) for _ in range(num_readers)
        ]
        # zero-filled: no flags set
        shm = new_shared_memory(num_chunks * (1 + num_readers + chunk_bytes))
        handle = QueueHandle(shm.name, num_readers, num_chunks, chunk_bytes, tuple(doorbells))
        return cls(handle, shm, reader, owner=True)

    @classmethod
    def attach(cls, handle: QueueHandle, reader: int | None = None) -> MessageQueue:
        return cls(handle, attach_shared_memory(handle.name), reader, owner=False)

    def _chunk_free(self) -> bool:
        """May the writer fill its next chunk: never written, or read by every reader?"""
        i = self.next_chunk
        return self.buf[self.written_at[i]] == 0 or self.buf[self.read_flags_at[i]] == self.all_read

    def ready(self) -> bool:
        """Is there a message (or its next chunk) for this reader?"""
        i = self.next_chunk
        return self.buf[self.my_read_at[i]] == 0 and self.buf[self.written_at[i]] == 1  # this order

    def enqueue(
        self, obj: Any, timeout: float | None = None, check: Callable[[], None] | None = None
    ) -> int:
        """Send obj to every reader; return its size in bytes, encoded. A timeout or Ctrl-C
        after a message's first chunk leaves `cut_off` set: the readers hold part of it and
        would read the next message as its rest, so the queue is of no more use."""
        data = memoryview(pickle.dumps(obj, protocol=5))
        buf, sent = self.buf, 0
        while True:  # at least one chunk, even for an empty message
            wait_until(self._chunk_free, timeout, self.who_waits, check)
            i = self.next_chunk
            part = data[sent : sent + self.capacity]
            sent += len(part)
            buf[self.written_at[i]] = 0  # not readable while we fill it
            buf[self.read_flags_at[i]] = self.no_reads
            start = self.chunk_at[i] + CHUNK_HEADER.size
            CHUNK_HEADER.pack_into(buf, self.chunk_at[i], len(part), len(data))
            buf[start : start + len(part)] = part
            buf[self.written_at[i]] = 1  # published: set only after the chunk is complete
            self.next_chunk = (i + 1) % self.handle.num_chunks
            self.cut_off = sent < len(data)
            for doorbell in self.handle.doorbells:
                doorbell.release()
            if not self.cut_off:
                return len(data)

    def dequeue(self, timeout: float | None = None, check: Callable[[], None] | None = None) -> Any:
        """The next message. A timeout or Ctrl-C after its first chunk leaves `cut_off` set (as in
        enqueue): its rest, left in the ring, would be read as the start of the next message."""
        data = bytearray()
        while True:
            wait_until(
                self.ready, timeout, self.who_waits, check, self.handle.doorbells[self.reader]
            )
            i = self.next_chunk
            size, total = CHUNK_HEADER.unpack_from(self.buf, self.chunk_at[i])
            start = self.chunk_at[i] + CHUNK_HEADER.size
            data += self.buf[start : start + size]  # copied out: the writer may reuse the chunk
            self.buf[self.my_read_at[i]] = 1  # done with this chunk
            self.next_chunk = (i + 1) % self.handle.num_chunks
            self.cut_off = len(data) < total
            if not self.cut_off:
                return pickle.loads(data)

    def close(self) -> None:
        """Detach; the creator removes the block (multiprocessing the doorbells, once unused)."""
        self.buf = self.handle = None
        self.shm.close()
        if self.owner:
            # a driver that died while shutting down got there first
            with contextlib.suppress(FileNotFoundError):
                self.shm.unlink()


def wait_for_messages(
    queues: list[MessageQueue], timeout: float | None, what: str, check: Callable, doorbell
) -> None:
    """Wait until any of `queues` (each read by us alone, all ringing one `doorbell`) has a
    message: the driver's wait for the workers' replies."""
    wait_until(lambda: any(queue.ready() for queue in queues), timeout, what, check, doorbell)


# Collectives through shared memory, for ranks on one CPU machine ----------------------
COLLECTIVE_BUFFER_BYTES = 1 << 20  # larger tensors (long prefills) take torch.distributed's way
# ranks do the same work: a minute's wait in a collective means one is stopped or stuck
COLLECTIVE_TIMEOUT = 60.0


def collective_block_bytes(world_size: int) -> int:
    return 8 * world_size + 2 * world_size * COLLECTIVE_BUFFER_BYTES


class SharedMemoryGroup(TPGroup):
    """The group's all-reduce and all-gather through one shared block, for CPU ranks on one machine
    (gloo's TCP costs far more per all-reduce, dozens a step: docs/performance.md). Each rank copies
    its tensor into its buffer, publishes its generation number, waits for all to, and reads all
    buffers; all sum them in one order, so agree. Two buffer sets alternate: once all have published
    g, all have read g-1's set, which g+1 reuses. MessageQueue's store-order caveat holds too."""

    def __init__(self, rank: int, size: int, block_name: str):
        super().__init__(rank, size)
        self.shm = attach_shared_memory(block_name)
        self.published = torch.frombuffer(self.shm.buf, dtype=torch.int64, count=size)
        count = 2 * size * COLLECTIVE_BUFFER_BYTES
        buffers = torch.frombuffer(self.shm.buf, dtype=torch.uint8, offset=8 * size, count=count)
        self.buffers = buffers.view(2, size, -1)
        self.generation = 0

    def exchange(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, stacked: [world_size, *tensor.shape], read in place."""
        data = tensor.contiguous().view(-1).view(torch.uint8)
        self.generation += 1
        generation, buffers = self.generation, self.buffers[self.generation % 2]
        buffers[self.rank, : data.numel()].copy_(data)
        self.published[self.rank] = generation  # after the data: the same store order

        def everyone_published() -> bool:
            return min(self.published.tolist()) >= generation

        def late_ranks() -> str:
            late = [r for r, seen in enumerate(self.published.tolist()) if seen < generation]
            return f"rank {self.rank} waited in a collective for ranks {late}"

        wait_until(everyone_published, COLLECTIVE_TIMEOUT, late_ranks)
        return buffers[:, : data.numel()].view(tensor.dtype).view(self.size, *tensor.shape)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if tensor.nbytes > COLLECTIVE_BUFFER_BYTES:
            return super().all_reduce(tensor)
        torch.sum(self.exchange(tensor), dim=0, out=tensor)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.nbytes > COLLECTIVE_BUFFER_BYTES:
            return super().all_gather(tensor)
        return torch.cat(self.exchange(tensor).unbind(0), dim=-1)

    def close(self, unlink: bool) -> None:
        del self.published, self.buffers  # they view the block: release it before closing
        self.shm.close()
        if unlink:
            self.shm.unlink()


def sampling_probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Weights for drawing one request's next token from its row of logits. vLLM's order:
    temperature, then top-k (0 or -1: all tokens), top-p and min-p, each judging what the one
    before kept, renormalized (min-p is relative to the likeliest, so needs no renormalizing).
    The row's peak is subtracted first (softmax is the same for any shift): a finite row then never
    overflows, as a huge logit_bias divided by a temperature below 1 would."""
    probs = torch.softmax((logits - logits.max()) / float(params.temperature), dim=-1)
    if 0 < params.top_k < probs.numel():
        kth_largest = probs.topk(params.top_k).values[-1]
        probs = probs.masked_fill(probs < kth_largest, 0)  # ties with the k-th are kept, as in vLLM
        probs = probs / probs.sum()
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        # keep a token if the tokens ranked above it hold less than top_p
        outside = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        outside[0] = False  # none is ranked above the likeliest (a top_p float32 holds as 0)
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0))
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0)
    return probs


def adjusted_logits(logits: torch.Tensor, scheduled: list[CachedRequest]) -> torch.Tensor:
    """The rows of the requests with penalties, min_tokens or logit_bias adjusted (adjusted_row),
    in new rows: the raw ones still score logprobs (step_logprobs). The others cost nothing more."""
    if not any(request.params.adjusts_logits for request in scheduled):
        return logits
    return torch.stack(
        [
            adjusted_row(row, r) if r.params.adjusts_logits else row
            for row, r in zip(logits, scheduled)
        ]
    )


def adjusted_row(logits: torch.Tensor, request: CachedRequest) -> torch.Tensor:
    """One request's row of logits as vLLM's sampler adjusts it, greedy or not, in its order:
    allowed_token_ids and bad_words masks (vLLM's: a bad word's last token, where the output so far
    ends in its other tokens; the prompt not counted); logit_bias added; the end-of-sequence and
    stop tokens ruled out below min_tokens; then the penalties: repetition over the prompt's and
    output's tokens (a positive logit divided by it, a negative one multiplied, as transformers'
    RepetitionPenaltyLogitsProcessor), frequency (times each token's count) and presence (once per
    token) over the output's, as OpenAI's."""
    params, ids = request.params, functools.partial(torch.tensor, device=logits.device)
    output = request.token_ids[request.num_prompt_tokens :]
    if allowed := params.allowed_token_ids:  # every other token masked: x + -inf, x + 0 (exact)
        logits = logits + torch.full_like(logits, -math.inf).index_fill(0, ids(allowed), 0)
    for *before, last in params.bad_words_token_ids:  # where the output ends in the rest of one
        if output[len(output) - len(before) :] == before:
            logits = logits.index_fill(0, ids([last]), -math.inf)
    if params.logit_bias:
        biases = ids([*params.logit_bias.values()], dtype=logits.dtype)
        logits = logits.index_add(0, ids([*params.logit_bias]), biases)
    if len(output) < params.min_tokens:
        logits = logits.index_fill(0, ids(request.min_tokens_stop_ids), -math.inf)
    if (penalty := float(params.repetition_penalty)) != 1:  # (an int may pass torch's int64)
        seen = ids(request.token_ids).unique()
        scores = logits[seen]
        logits = logits.index_copy(
            0, seen, torch.where(scores > 0, scores / penalty, scores * penalty)
        )
    if params.frequency_penalty or params.presence_penalty:
        counts = torch.bincount(ids(output, dtype=torch.long), minlength=logits.numel())
        logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return logits


def logprobs_of(logits: torch.Tensor, token_ids: list[int], num_logprobs: list[int]) -> list[tuple]:
    """Each row's log-softmax (raw: before penalties, temperature and top-k/p, as vLLM's default
    raw_logprobs) as (the given token, then the k likeliest: their ids, log-probabilities, the given
    token's rank). A rank counts the tokens at least as likely, as vLLM's (1: the likeliest)."""
    logprobs = logits.float().log_softmax(dim=-1)
    tokens = torch.tensor(token_ids, device=logits.device)[:, None]
    chosen = logprobs.gather(1, tokens)
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    top = logprobs.topk(max(num_logprobs), dim=-1)
    ids = torch.cat([tokens, top.indices], dim=1).tolist()
    values = torch.cat([chosen, top.values], dim=1).tolist()
    return [(i[: k + 1], v[: k + 1], r) for i, v, r, k in zip(ids, values, ranks, num_logprobs)]


# The worker: one rank's model, KV cache and copy of every running request -------------
@dataclass
class CachedRequest:
    """A worker's own copy of a running request."""

    token_ids: list[int]  # prompt, then every sampled token
    num_computed: int  # tokens whose keys and values are in the KV cache
    block_ids: list[int]  # its block table: position p is at offset p % block_size of block p // it
    params: SamplingParams
    generator: torch.Generator
    num_prompt_tokens: int = 0
    min_tokens_stop_ids: list[int] = field(default_factory=list)
    # the first prompt position whose logits have not scored its next token yet (prompt_logprobs:
    # a preempted request computes its prompt again, and each position is sent once)
    prompt_logprobs_from: int = 0

    @classmethod
    def new(cls, new: NewRequest, device: torch.device) -> CachedRequest:
        """A new request's copy, its generator seeded alike on every rank."""
        generator = torch.Generator(device).manual_seed(new.seed)
        token_ids, stop_ids = list(new.prompt_token_ids), new.min_tokens_stop_ids
        return cls(token_ids, 0, [], new.params, generator, len(token_ids), stop_ids)

    def prompt_logprob_positions(self, num_tokens: int) -> range:
        """The positions among this step's num_tokens whose logits score the next prompt token."""
        if self.params.prompt_logprobs is None:
            return range(0)
        end = min(self.num_computed + num_tokens, self.num_prompt_tokens - 1)
        return range(max(self.num_computed, self.prompt_logprobs_from), end)


# Token 0 at position 1 of the null block, which no request reads unmasked: a CUDA graph's pad
# rows, and (moved to position 2 too) the compiled decode step's warm-up (compile_decode_step)
NULL_ROW = CachedRequest([0, 0], 1, [0, 0], SamplingParams(), None)


def logits_rows(batch: list[tuple[CachedRequest, int]], ends: list[int]) -> list[int]:
    """The rows of a step (each request's end where its rows end) whose logits are computed:
    those sampled (a decode's, a chunk's last where it ends its prompt), then those that score a
    prompt's next token, for the requests that asked (prompt_logprobs)."""
    pairs = list(zip(batch, ends))
    sampled = [end - 1 for (r, n), end in pairs if r.num_computed + n == len(r.token_ids)]
    scoring = [
        end - n - r.num_computed + p for (r, n), end in pairs for p in r.prompt_logprob_positions(n)
    ]
    return sampled + scoring


def step_logprobs(
    logits: torch.Tensor, ids: list[int], batch: list[tuple], tokens: dict[int, int]
) -> tuple[dict, dict]:
    """A step's log-probabilities for the requests that asked (ModelRunnerOutput's), rank 0's:
    of the sampled tokens (the first rows of logits, one per token) and of the prompts' tokens
    (the rows after them, as logits_rows orders them), in one call of logprobs_of."""
    requests = {i: r for i, (r, _) in zip(ids, batch)}
    asked = [(row, i) for row, i in enumerate(tokens) if requests[i].params.logprobs is not None]
    prompts = [(i, r, r.prompt_logprob_positions(n)) for i, (r, n) in zip(ids, batch)]
    prompts = [(i, r, positions) for i, r, positions in prompts if positions]
    targets = [tokens[i] for _, i in asked]
    targets += [r.token_ids[p + 1] for _, r, positions in prompts for p in positions]
    if not targets:
        return {}, {}
    num_logprobs = [requests[i].params.logprobs for _, i in asked]
    num_logprobs += [r.params.prompt_logprobs for _, r, positions in prompts for _ in positions]
    rows = [row for row, _ in asked] + list(range(len(tokens), len(logits)))
    entries = iter(logprobs_of(logits[rows], targets, num_logprobs))
    sampled = {i: next(entries) for _, i in asked}
    return sampled, {i: [next(entries) for _ in positions] for i, _, positions in prompts}


def choose_cuda_attention_backends() -> None:
    """cuDNN's attention, PyTorch's first choice on Hopper, plans anew for each set of sizes, key
    length included: each decode step at a new length would pay. Off: flash takes the unmasked
    half-precision calls, memory-efficient the masked and float32 ones (both graph-capturable)."""
    torch.backends.cuda.enable_cudnn_sdp(False)


class Worker:
    """Everything one rank does: execute_model runs each step; the rest comes via collective_rpc.
    Ranks are laid out as vLLM lays them, TP innermost: the tp ranks of pipeline stage s are
    s x tp .. s x tp + tp - 1 (pp = 1: one stage, every rank)."""

    def __init__(self, rank: int, tp: int, pp: int = 1):
        self.rank, self.stage, self.pp = rank, rank // tp, pp
        self.group = TPGroup(rank % tp, tp)  # this rank's place in its stage
        self.requests: dict[int, CachedRequest] = {}

    def init_device(
        self,
        device: str,
        dtype: str,
        store_port: int,
        num_threads: int,
        collective_blocks: list[str] | None = None,
    ) -> None:
        """Pick the device and join the process group through the driver's TCP store. "cuda" puts
        rank r on GPU r, over nccl; "cuda:N" puts every rank on GPU N (tp > 1 on one GPU, for
        tests) over gloo, which carries CUDA tensors through the host: nccl refuses two ranks on
        one GPU. Collective blocks (CPU, tp > 1): a stage's collectives on shared memory."""
        torch.set_num_threads(num_threads)
        self.device = torch.device(device, self.rank) if device == "cuda" else torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before the process group, which binds to it
            choose_cuda_attention_backends()
        self.dtype = getattr(torch, dtype)
        # For a driver that died meanwhile (NCCL's first get waits as long: ranks come together).
        store = dist.TCPStore(
            "127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60)
        )
        backend = "nccl" if device == "cuda" else "gloo"
        # gloo and nccl listen on the address the hostname resolves to, a network one on many hosts
        # (Docker, cloud VMs): loopback instead, as the store's (Linux's lo; the group is one node).
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = "lo"
        dist.init_process_group(
            backend,
            store=store,
            rank=self.rank,
            world_size=self.group.size * self.pp,
            device_id=self.device if backend == "nccl" else None,  # nccl: connect now, not lazily
        )
        if collective_blocks:  # the layers get this group, with its collectives
            block = collective_blocks[self.stage]
            self.group = SharedMemoryGroup(self.group.rank, self.group.size, block)
        # each stage's ranks, a group of their own for torch.distributed's collectives
        self.group.process_group, _ = dist.new_subgroups(self.group.size)

    def load_model(
        self,
        config: ModelConfig,
        model_dir: str,
        max_model_len: int,
        load_format: str = "auto",
        enforce_eager: bool = False,
    ) -> None:
        """Build this rank's part of the model and fill it from the checkpoint (load_format "dummy":
        random numbers); the config parsed and checked by the driver. On one CPU rank the decode
        steps also run through torch.compile, as gpt-fast and vLLM compile theirs: inductor fuses
        the small operations between the matmuls, each of them eagerly a pass over memory and a
        wait for every thread. enforce_eager (vLLM's --enforce-eager): never. Ranks' collectives,
        Python on shared memory, would break each graph in three: tp > 1 stays eager, and so does
        pp > 1 (a stage's hand-off, likewise)."""
        from checkpoints import open_checkpoint  # (checkpoints.py reads with this module's checks)

        self.config, self.max_model_len = config, max_model_len
        torch.set_default_dtype(self.dtype)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(config, self.group, max_model_len, self.stage, self.pp)
        torch.set_default_dtype(torch.float32)
        if load_format == "dummy":
            init_dummy_weights(self.model)
        else:
            files = open_checkpoint(model_dir)
            load_checkpoint(self.model, files, show_progress=self.rank == 0)
        one_rank = self.group.size == self.pp == 1
        compiles = self.device.type == "cpu" and one_rank and not enforce_eager
        self.compiled_model = torch.compile(self.model) if compiles else None

    def init_kv_cache(
        self, num_blocks: int, block_size: int, max_num_seqs: int, cuda_graphs: bool = False
    ) -> None:
        """Preallocate the KV cache: num_blocks blocks of block_size positions, which KVCacheManager
        hands out. Zeros: a masked NaN, never written, would still poison the weighted sum."""
        shape = kv_cache_shape(self.config, self.group.size, num_blocks, block_size)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.model.layers
        ]
        self.block_size, self.max_num_seqs = block_size, max_num_seqs
        # LLM(cuda_graphs=True): every decode-only step at one shape (cuda_graph_step), replayed
        # from a graph where one can be captured (not through gloo's collectives); else, and with
        # capture_graphs set False (.ci/gpu compares the two), the same step runs eagerly.
        self.cuda_graphs = cuda_graphs
        self.capture_graphs = self.device.type == "cuda" and dist.get_backend() == "nccl"
        self.graphs: dict[int, tuple] = {}  # context length: (graph, its inputs, its logits)
        if self.compiled_model is not None:  # at start, as vLLM does: not in a request's first step
            self.compile_decode_step()

    def compile_decode_step(self) -> None:
        """Compile the decode step on steps in the null block, which none reads. torch.compile
        compiles for the shapes it is first given, and again for a size that changes, then left
        free (dynamic); a size of 1 keeps a graph of its own: so one row at two context lengths,
        then two rows."""
        print(
            "tinytp: compiling the decode step with torch.compile (about a minute on a first "
            "start, seconds from inductor's cache; --enforce-eager skips it)",
            file=sys.stderr,
        )
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                for rows, position in [(1, 1), (1, 2), (2, 2)][: 2 + (self.max_num_seqs > 1)]:
                    row = replace(NULL_ROW, token_ids=[0] * (position + 1), num_computed=position)
                    self.compiled_model(self.prepare_inputs([(row, 1)] * rows), self.kv_caches)
        except Exception as error:  # no C++ compiler for inductor, say: torch's first line
            why = str(error).strip().split("\n", 1)[0]
            raise RuntimeError(f"torch.compile failed ({why}): run with --enforce-eager") from None
        print(f"tinytp: compiled in {time.perf_counter() - start:.1f} s", file=sys.stderr)

    def context_slots(self, requests: list[CachedRequest], num_positions: int) -> torch.Tensor:
        """The slots (block x block_size + offset) of each request's first num_positions, a row
        each: its block table, padded to one width with the null block 0 (masked), spelled out."""
        size, width = self.block_size, -(-num_positions // self.block_size)
        table = torch.tensor(
            [(r.block_ids + [0] * width)[:width] for r in requests], device=self.device
        ).view(len(requests), width, 1)  # (a view: no decodes is no rows)
        slots = table * size + torch.arange(size, device=self.device)
        return slots.view(len(requests), width * size)[:, :num_positions].contiguous()

    def prepare_inputs(
        self, batch: list[tuple[CachedRequest, int]], context_len: int | None = None
    ) -> ModelInputs:
        """The step's tokens packed in `batch`'s order ((a request, its tokens this step), one-token
        ones first): the one-token rows attend in one call (decode_attention), each longer chunk of
        a prompt in a call of its own (chunk_attention). Only attention asks where a row belongs."""
        as_index = {"dtype": torch.long, "device": self.device}  # (no tokens: still indices)
        tokens = [(r, p) for r, n in batch for p in range(r.num_computed, r.num_computed + n)]
        positions = torch.tensor([p for _, p in tokens], **as_index)
        ends = list(itertools.accumulate(n for _, n in batch))  # where each request's rows end
        decodes = [r for r, n in batch if n == 1]
        return ModelInputs(
            input_ids=torch.tensor(
                [t for r, n in batch for t in r.token_ids[r.num_computed : r.num_computed + n]],
                **as_index,
            ),
            positions=positions,
            slot_mapping=(
                torch.tensor([r.block_ids[p // self.block_size] for r, p in tokens], **as_index),
                positions % self.block_size,
            ),
            **self.decode_attention(decodes, positions[: len(decodes)], context_len),
            chunks=self.chunk_attention(batch, positions, ends),
            logits_indices=torch.tensor(logits_rows(batch, ends), **as_index),
        )

    def decode_attention(
        self, decodes: list[CachedRequest], positions: torch.Tensor, context_len: int | None
    ) -> dict:
        """The one-token rows' context: a decoding request's token at position p sees 0..p of its
        blocks (as does a prompt's one-token chunk), up to the longest context (or a given
        context_len: cuda_graph_step's fixed shape), masked where the rows' lengths differ. A fixed
        shape is always masked, and so is a compiled step: one graph serves every step."""
        contexts = [r.num_computed + 1 for r in decodes]
        fixed_shape, context_len = context_len is not None, context_len or max(contexts, default=0)
        masked = fixed_shape or self.compiled_model is not None or len(set(contexts)) > 1
        mask = (  # (where not masked it would be all True)
            torch.arange(context_len, device=self.device) <= positions[:, None, None, None]
            if masked
            else None
        )
        return {"context_slots": self.context_slots(decodes, context_len), "attn_mask": mask}

    def chunk_attention(
        self, batch: list[tuple[CachedRequest, int]], positions: torch.Tensor, ends: list[int]
    ) -> list[tuple]:
        """Each longer chunk's slots up to its last position, its first position, its length and
        its mask: none from position 0 (plain causal attention), else the cached positions too."""
        return [
            (
                self.context_slots([r], r.num_computed + n)[0],
                r.num_computed,
                n,
                None
                if r.num_computed == 0
                else torch.arange(r.num_computed + n, device=self.device)
                <= positions[end - n : end, None],
            )
            for (r, n), end in zip(batch, ends)
            if n > 1
        ]

    def cuda_graph_step(self, scheduled: list[CachedRequest]) -> torch.Tensor:
        """The scheduled rows' logits of a decode step at the one shape a CUDA graph replays:
        max_num_seqs rows (NULL_ROW pads), attention over 2**k positions (block tables as wide)."""
        rows = scheduled + [NULL_ROW] * (self.max_num_seqs - len(scheduled))
        # + 1, this step's token: at most the power of two above
        longest = max(r.num_computed for r in scheduled)
        context_len = min(self.max_model_len, max(16, 1 << longest.bit_length()))
        inputs = self.prepare_inputs([(row, 1) for row in rows], context_len)
        if not self.capture_graphs:  # see init_kv_cache: run it as it is
            return self.model(inputs, self.kv_caches)[: len(scheduled)]
        if context_len not in self.graphs:  # at a length's first step: every rank at the same step
            # warm-up (this very step): lazy initialization stays out of the graph
            self.model(inputs, self.kv_caches)
            # "thread_local": nccl's watchdog thread may query its events meanwhile
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.graphs[context_len] = graph, inputs, self.model(inputs, self.kv_caches)
        graph, captured, logits = self.graphs[context_len]
        # the rest is the same every step
        for name in ("input_ids", "positions", "context_slots", "attn_mask"):
            getattr(captured, name).copy_(getattr(inputs, name))
        for captured_index, index in zip(captured.slot_mapping, inputs.slot_mapping):
            captured_index.copy_(index)
        graph.replay()
        return logits[: len(scheduled)]

    def sample(self, logits: torch.Tensor, scheduled: list[CachedRequest]) -> list[int]:
        """Every rank has the same logits (all-gathered) and seeded generators: all pick the same
        tokens, unspoken, having adjusted them alike (penalties, min_tokens, logit_bias)."""
        logits = adjusted_logits(logits.float(), scheduled)
        tokens = logits.argmax(dim=-1).tolist()  # greedy, for temperature 0
        for i, request in enumerate(scheduled):
            # A row whose peak is inf or NaN (extreme biases and penalties, combined: an adjusted
            # row) has no distribution: its request alone fails (FAILED), not the step's others.
            if request.params.adjusts_logits and not math.isfinite(logits[i].max()):
                tokens[i] = FAILED
            elif request.params.temperature > 0:
                probs = sampling_probabilities(logits[i], request.params)
                tokens[i] = torch.multinomial(probs, 1, generator=request.generator).item()
        return tokens

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step: update our requests from the deltas, run the model, sample, append tokens."""
        start = time.perf_counter()
        for request_id in scheduler_output.finished_ids:
            self.requests.pop(request_id, None)  # after an interrupted generate, maybe never sent
        for new in scheduler_output.new_requests:
            request = self.requests.get(new.request_id)  # known: resumed after a preemption
            if request is None:
                request = self.requests[new.request_id] = CachedRequest.new(new, self.device)
            request.num_computed, request.block_ids = new.num_computed_tokens, list(new.block_ids)
        for request_id, block_ids in scheduler_output.new_block_ids.items():
            self.requests[request_id].block_ids += block_ids
        for request_id, token_ids in scheduler_output.new_token_ids.items():  # pp > 1
            request = self.requests[request_id]
            # (on the last stage, which sampled them: the same tokens again)
            first = max(request.num_computed, request.num_prompt_tokens)
            request.token_ids[first : first + len(token_ids)] = token_ids
        counts = dict(zip(scheduler_output.scheduled_ids, scheduler_output.num_scheduled_tokens))
        # one-token rows first, the rest in order
        ids = sorted(counts, key=lambda request_id: counts[request_id] > 1)
        batch = [(self.requests[request_id], counts[request_id]) for request_id in ids]
        # Those ending their prompt this step, or decoding, sample; a prompt part-way draws nothing.
        sampling = {i: r for i, (r, n) in zip(ids, batch) if r.num_computed + n == len(r.token_ids)}
        # every request samples its one token
        decode_only = len(sampling) == len(batch) == sum(counts.values())
        with torch.inference_mode():
            logits = self.run_model(batch, list(sampling.values()), decode_only)
        # .tolist() waits for the GPU. Stages before the last have no logits: they sample nothing.
        tokens, scheduled = {}, list(sampling.values())
        if logits is not None:
            tokens = dict(zip(sampling, self.sample(logits[: len(scheduled)], scheduled)))
        # A FAILED request's copy takes token 0 (it ends, and is forgotten, at the driver's word)
        kept = {request_id: max(token, 0) for request_id, token in tokens.items()}
        # the last stage's rank 0 alone answers, so it alone computes what was asked
        answers = logits is not None and self.group.rank == 0
        logprobs = step_logprobs(logits, ids, batch, kept) if answers else ({}, {})
        for request, count in batch:
            request.num_computed += count
            request.prompt_logprobs_from = max(request.prompt_logprobs_from, request.num_computed)
        for request_id, token in kept.items():
            self.requests[request_id].token_ids.append(token)
        sampled_token_ids = [tokens.get(i) for i in scheduler_output.scheduled_ids]
        return ModelRunnerOutput(sampled_token_ids, time.perf_counter() - start, *logprobs)

    def run_model(
        self, batch: list[tuple[CachedRequest, int]], sampled: list[CachedRequest], decode: bool
    ) -> torch.Tensor | None:
        """The step's logits (None before the last pipeline stage). A decode-only step runs at a
        CUDA graph's shape (cuda_graphs), or through the compiled model, but for a one-token
        prompt's (a context of one would be a graph of its own); every other step eagerly."""
        if decode and self.cuda_graphs:
            return self.cuda_graph_step(sampled)
        inputs = self.prepare_inputs(batch)
        if decode and self.compiled_model is not None and all(r.num_computed for r in sampled):
            return self.compiled_model(inputs, self.kv_caches)
        return self.run_stage(inputs)

    def run_stage(self, inputs: ModelInputs) -> torch.Tensor | None:
        """This pipeline stage's part of the step: the hidden states [N, hidden] from the same TP
        rank of the stage before (none on the first stage: it embeds the tokens), its layers, and
        on to the same rank of the stage after; the last stage's logits. Each TP rank holds the
        whole residual stream after its stage's last all-reduce, so rank r of one stage hands
        rank r of the next its copy: no gather, and every rank of a stage takes the same input.
        (vLLM's IntermediateTensors carry hidden_states and residual apart, as its layers add the
        residual in the next layer's fused norm; ours add it at the layer's end, as transformers
        does: x is their sum already.) send and recv: gloo over TCP on CPU, nccl on GPUs."""
        hidden = None
        if self.stage > 0:
            shape = (len(inputs.input_ids), self.config.hidden_size)
            hidden = torch.empty(shape, dtype=self.dtype, device=self.device)
            dist.recv(hidden, src=self.rank - self.group.size)
        out = self.model(inputs, self.kv_caches, hidden)
        if self.stage == self.pp - 1:
            return out
        dist.send(out, dst=self.rank + self.group.size)
        return None

    def close(self, unlink_collective_block: bool = False) -> None:
        if isinstance(self.group, SharedMemoryGroup):
            self.group.close(unlink_collective_block)
        if dist.is_initialized():
            dist.destroy_process_group()


# The worker process -------------------------------------------------------------------
class DriverGone(Exception):
    """The driver process exited without shutting us down."""


def worker_main(
    rank: int,
    tp: int,
    pp: int,
    broadcast_handle: QueueHandle,
    response_handle: QueueHandle,
    driver_pid: int,
) -> None:
    """The loop of one worker process: take the next step or call from the broadcast queue, run it,
    reply. Nothing else happens here (design discussion: workers "sit in a very tight model
    execution loop" of model execution and termination). driver_pid is passed in: a driver that died
    while we imported torch has re-parented us already."""
    # Ctrl-C, and a SIGTERM sent to the whole process group (timeout, systemd), are the driver's to
    # handle: it stops us in order. (The driver's force is SIGKILL.)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # tqdm's default lock is a named semaphore, which the resource tracker reports "leaked" when a
    # killed worker leaves it behind. One thread here draws progress bars: a thread lock does.
    tqdm.set_lock(threading.RLock())
    # the Executor's broadcast and our response queue
    broadcast = MessageQueue.attach(broadcast_handle, reader=rank)
    response = MessageQueue.attach(response_handle)
    worker = Worker(rank, tp, pp)

    def driver_alive() -> None:
        if os.getppid() != driver_pid:  # we were re-parented: the driver is gone
            raise DriverGone

    try:
        driver_alive()  # its first message may be waiting: dequeue checks only while it waits
        while True:
            call: RPCCall = broadcast.dequeue(check=driver_alive)
            if call.method == SHUTDOWN:
                break
            try:
                method = (
                    getattr(worker, call.method)
                    if isinstance(call.method, str)
                    else functools.partial(pickle.loads(call.method), worker)
                )
                reply = RPCResult(call.call_id, method(*call.args, **call.kwargs))
            except Exception:
                reply = RPCResult(call.call_id, error=traceback.format_exc())
            if call.unique_reply_rank in (None, rank) or reply.error is not None:
                response.enqueue(reply, check=driver_alive)
    except DriverGone:
        # Nobody else will unlink the blocks and doorbells now (which also keeps the dead driver's
        # resource tracker quiet): rank 0 the shared ones, each rank its reply block, each stage's
        # first rank its collective block.
        broadcast.owner, response.owner = rank == 0, True
        if rank == 0:  # what the driver's exit would do
            unlink_semaphores([*broadcast.handle.doorbells, *response.handle.doorbells])
    finally:
        worker.close(unlink_collective_block=response.owner and worker.group.rank == 0)
        broadcast.close()
        response.close()
    # All is released: the interpreter's own exit would collect torch's and the model's objects one
    # by one, for seconds on a busy machine, past shutdown's grace (a dead driver's workers linger).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Not Python's public API, in one place --------------------------------------------------
# multiprocessing internals that no public call replaces in Python 3.11, each used once.
def forget_child_processes(processes: list) -> None:
    """Take processes off multiprocessing's list of children, whose exit hook (in a forked
    child too) would terminate them: our workers are stopped by the Executor alone."""
    multiprocessing.process._children.difference_update(processes)


def importing_main_for_spawn() -> bool:
    """Is this a spawned process importing its parent's main script? (multiprocessing's own test)"""
    return getattr(multiprocessing.current_process(), "_inheriting", False)


def unlink_semaphores(semaphores: list) -> None:
    """Remove named semaphores (the doorbells) from /dev/shm now, as multiprocessing does when
    the last reference goes (a traceback a caller keeps may hold one): by the finalizer it
    registered where they were made, which then removes itself, else by its cleanup."""
    names = {semaphore._semlock.name for semaphore in semaphores}
    for finalizer in list(multiprocessing.util._finalizer_registry.values()):
        if (
            finalizer._callback is multiprocessing.synchronize.SemLock._cleanup
            and finalizer._args[0] in names
        ):
            names.discard(finalizer._args[0])
            finalizer()
    for name in names:  # made by another process (a worker cleaning up for a dead driver)
        multiprocessing.synchronize.SemLock._cleanup(name)


def attach_shared_memory(name: str) -> shared_memory.SharedMemory:
    """Attach to another process's block without registering it with Python 3.11's resource
    tracker, which would unlink it under the creator's feet (and warn of a "leak") at exit.
    Public alternative: SharedMemory(name, track=False), from Python 3.13."""
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register
