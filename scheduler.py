"""The scheduler, vLLM V1's, in the driver and without processes: each `Request`'s state, the
paged KV cache's blocks (`KVCacheManager`: block tables, prefix caching, the free queue) and the
`Scheduler`, which picks each step's tokens within the token budget and the free blocks
(`schedule`) and takes in each step's sampled tokens (`update_from_output`). The engine loop
(tinytp.py's `EngineCore`) calls the two, one step after another."""

from __future__ import annotations

import hashlib
import pickle
import queue
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from worker import FAILED, ModelRunnerOutput, NewRequest, SamplingParams, SchedulerOutput


@dataclass
class Metric:  # vLLM's vllm.v1.metrics.reader: what LLM.get_metrics() returns
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Request:
    """The driver's view of one sample of a prompt; the workers keep their own (`CachedRequest`)."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0  # its tokens the steps sent so far compute (their keys and values)
    num_in_flight: int = 0  # tokens of unanswered steps (vLLM's placeholders: async scheduling)
    # its caller's queue (EngineClient.add): (request, tokens, finished) reports
    output_queue: queue.SimpleQueue | None = None
    stream: bool = False  # each new token (a stream) or the end (generate): vLLM's output_kind
    num_cached_tokens: int = -1  # prompt tokens cached at its first admission; -1 before (vLLM's)
    # the hash of each of its full blocks, chained (KVCacheManager): kept while it is preempted
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None  # vLLM's: in its first block's hash, so shared only with its salt
    logprobs: list[tuple] = field(default_factory=list)  # logprobs_of entries, one per output token
    prompt_logprobs: list[tuple] = field(default_factory=list)  # one per prompt token but the first

    @property
    def num_tokens(self) -> int:  # vLLM's: its prompt and the tokens sampled so far
        return len(self.prompt_token_ids) + len(self.output_token_ids)


# The KV cache's blocks, and the scheduler ------------------------------------------------
@dataclass(eq=False)
class KVCacheBlock:
    """One block of the KV cache (vLLM's name): block_size positions of every layer, on every
    rank. ref_cnt: the requests whose block tables hold it; block_hash: set once it is full and
    cached (found by the next request that begins with the same tokens)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


def hash_block_tokens(
    parent_block_hash: bytes | None, token_ids: list[int], extra_keys=None
) -> bytes:
    """vLLM's hash_block_tokens: a full block's hash covers its parent's, so equal hashes mean equal
    tokens from position 0 (the same tokens after another prefix have other keys and values).
    extra_keys: the first block's cache salt, whose hash every later block's then covers."""
    key = (parent_block_hash, tuple(token_ids), extra_keys)
    return hashlib.sha256(pickle.dumps(key, protocol=5)).digest()


class KVCacheManager:
    """vLLM V1's KVCacheManager, with its BlockPool inside: num_blocks blocks of block_size
    positions; a request holds ceil(tokens / block_size) of them, its block table. Block 0 is vLLM's
    null block, never handed out: it pads block tables, and the fixed-shape decode step's pad rows
    write there. Prefix caching (enable_caching): a full block is cached under its hash
    (hash_block_tokens); a new request starts from its longest run of cached blocks; a freed block
    stays cached in free_block_queue (least recently freed first) until another request takes it."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_caching = enable_caching
        # vLLM's free_block_queue, a doubly linked list there: a hit takes a block out of its middle
        self.free_block_queue = OrderedDict((i, KVCacheBlock(i)) for i in range(1, num_blocks))
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.req_to_blocks: dict[int, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[int, int] = {}  # its first blocks that cache_full_blocks saw

    def usage(self) -> float:
        """The share of blocks held by requests (vLLM's kv_cache_usage_perc, a fraction)."""
        return 1 - len(self.free_block_queue) / (self.num_blocks - 1)

    def reads_cache(self, request: Request) -> bool:
        """A request asking for prompt logprobs computes its whole prompt (vLLM's choice): a cached
        block has keys and values, not logits. Its blocks are cached all the same."""
        return self.enable_caching and request.params.prompt_logprobs is None

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """Cached blocks its tokens begin with, short of its last (always computed, for logits)."""
        if not self.reads_cache(request):
            return []
        self.hash_full_blocks(request)
        hits = []
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            if block_hash not in self.cached_block_hash_to_block:
                break
            hits.append(self.cached_block_hash_to_block[block_hash])
        return hits

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: list[KVCacheBlock] = ()
    ) -> list[int] | None:
        """Blocks for its next num_new_tokens, after its computed ones (the cached blocks it starts
        with, at admission), appended to its block table: their ids; None if too few are free."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_tokens = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        needed = max(0, -(-num_tokens // self.block_size) - len(blocks) - len(computed))
        # cached blocks that no request holds are in the free queue: taking them leaves fewer
        if needed > len(self.free_block_queue) - sum(b.ref_cnt == 0 for b in computed):
            return None
        for block in computed:
            if block.ref_cnt == 0:
                del self.free_block_queue[block.block_id]
            block.ref_cnt += 1
        new_blocks = [*computed, *(self.take_free_block() for _ in range(needed))]
        blocks += new_blocks
        if self.enable_caching:  # its full blocks whose tokens are known (async: some in flight)
            self.cache_full_blocks(request, blocks, min(num_tokens, request.num_tokens))
        return [block.block_id for block in new_blocks]

    def take_free_block(self) -> KVCacheBlock:
        """The least recently freed block, its cached contents evicted."""
        _, block = self.free_block_queue.popitem(last=False)
        if block.block_hash is not None:
            del self.cached_block_hash_to_block[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def hash_full_blocks(self, request: Request) -> None:
        """Extend request.block_hashes to its tokens' full blocks, each chained to its parent."""
        hashes, size = request.block_hashes, self.block_size
        if len(hashes) < request.num_tokens // size:
            token_ids = request.prompt_token_ids + request.output_token_ids
            for start in range(len(hashes) * size, request.num_tokens // size * size, size):
                parent, salt = (hashes[-1], None) if hashes else (None, request.cache_salt)
                hashes.append(hash_block_tokens(parent, token_ids[start : start + size], salt))

    def cache_full_blocks(
        self, request: Request, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        """Cache the blocks its first num_tokens fill, when scheduled as in vLLM: the step computing
        one runs before any later step reads it, and in a step each layer writes, then attends."""
        start, end = self.num_cached_block.get(request.request_id, 0), num_tokens // self.block_size
        self.hash_full_blocks(request)
        for block, block_hash in zip(blocks[start:end], request.block_hashes[start:end]):
            # hit, or another request computed the same tokens first: that block stays the one
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block
        self.num_cached_block[request.request_id] = end

    def free(self, request: Request) -> None:
        """Its blocks freed, last first (vLLM's order): shared prefix blocks get evicted last."""
        self.num_cached_block.pop(request.request_id, None)
        for block in reversed(self.req_to_blocks.pop(request.request_id, [])):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); False while any block is held."""
        if len(self.free_block_queue) < self.num_blocks - 1:
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        return True


class Scheduler:
    """vLLM V1's scheduler: no prefill or decode steps. A request has the tokens it has computed
    (num_computed_tokens) and the tokens it has; each step gives every running request what it still
    needs (one token when it decodes, the rest of its prompt), then admits waiting ones while the KV
    cache has free blocks, all within a budget of max_num_batched_tokens: a prompt that does not fit
    is cut and continued later (chunked prefill). A running request short of blocks preempts the
    newest one (V1's recompute: preempt). With async scheduling a request counts its tokens in
    flight, so no step is sent that could only yield a token past max_tokens or max_model_len.
    Under pipeline parallelism (pipeline_parallel_size stages) a request with a token in flight
    waits for it: the first stage computes a token only once the driver has told it the token."""

    def __init__(
        self,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        eos_token_ids: set[int],
        kv_cache_manager: KVCacheManager,
        pipeline_parallel_size: int = 1,
    ):
        self.max_num_seqs, self.max_model_len = max_num_seqs, max_model_len
        self.pipeline_parallel_size = pipeline_parallel_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.eos_token_ids, self.kv_cache_manager = eos_token_ids, kv_cache_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # every unfinished request by id (vLLM's): running, waiting, preempted with tokens in flight
        self.requests: dict[int, Request] = {}
        self.finished_ids: list[int] = []  # told to the workers with the next step
        # vLLM's counters (LLM.get_metrics): prompt tokens looked up and found in the prefix cache
        self.prefix_cache_queries = self.prefix_cache_hits = self.num_preemptions = 0
        self.num_dropped_tokens = 0  # sampled for a request that had ended: README, exercise 14

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput | None:
        """The next step: the running requests in arrival order, then the waiting ones that free
        blocks and the budget admit; None if nothing can run (each waits for its tokens in flight).
        Only the last one admitted can be cut in its prompt (the budget ran out), so every decoding
        request (before it) gets a token every step: the budget is at least max_num_seqs."""
        budget, scheduled = self.max_num_batched_tokens, []  # (a request, its tokens, new blocks)
        preempted = []
        for request in list(self.running):
            needed = 0 if request in preempted else min(self.num_tokens_needed(request), budget)
            if not needed:
                continue
            # no free block for it: the newest running request makes room, maybe itself
            while (new_block_ids := self.kv_cache_manager.allocate_slots(request, needed)) is None:
                preempted.append(self.preempt(self.running.pop()))
                if preempted[-1] is request:
                    break
            else:
                scheduled.append((request, needed, new_block_ids))
                budget -= needed
        new = [] if preempted else self.admit(budget, scheduled)  # none admitted as it preempts
        if not scheduled:
            return None
        first_new = len(scheduled) - len(new)  # the admitted ones come last
        new_requests = [
            NewRequest(
                r.request_id,
                r.prompt_token_ids,
                blocks,
                r.params,
                r.seed,
                r.num_computed_tokens,
                # vLLM's: the end-of-sequence tokens too, whatever ignore_eos says
                sorted(self.eos_token_ids | {*r.params.stop_token_ids})
                if r.params.min_tokens
                else [],
            )
            for r, _, blocks in scheduled[first_new:]
        ]
        new_token_ids = self.sampled_tokens_to_tell(scheduled)
        for request, num_tokens, _ in scheduled:
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens >= request.num_tokens:  # decode, or prompt done: a token
                request.num_in_flight += 1
        finished_ids, self.finished_ids = self.finished_ids, []
        return SchedulerOutput(
            new_requests,
            [r.request_id for r, _, _ in scheduled],
            [n for _, n, _ in scheduled],
            finished_ids,
            {r.request_id: blocks for r, _, blocks in scheduled[:first_new] if blocks},
            new_token_ids,
        )

    def admit(self, budget: int, scheduled: list) -> list[Request]:
        """Waiting requests, first come first served, while there are free blocks for their first
        chunk: each starts after its cached prefix (prefix caching), and joins `scheduled`."""
        new = []
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            computed = self.kv_cache_manager.get_computed_blocks(request)
            num_computed = len(computed) * self.kv_cache_manager.block_size
            num_tokens = min(request.num_tokens - num_computed, budget)
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_tokens, computed)
            if new_block_ids is None:
                break  # it waits for blocks, and those behind it with it
            self.waiting.popleft()
            if request.num_cached_tokens < 0:  # first admission (vLLM counts resumes' hits apart)
                request.num_cached_tokens = num_computed
                if self.kv_cache_manager.reads_cache(request):
                    self.prefix_cache_queries += request.num_tokens
                    self.prefix_cache_hits += num_computed
            request.num_computed_tokens = num_computed
            self.running.append(request)
            new.append(request)
            scheduled.append((request, num_tokens, new_block_ids))
            budget -= num_tokens
        return new

    def sampled_tokens_to_tell(self, scheduled: list) -> dict[int, list[int]]:
        """Pipeline parallelism: each request's sampled tokens among those it computes this step
        (its last sampled one when it decodes; after a preemption, those its chunk recomputes), for
        the stages before the last, which never sampled them. (At pp = 1 every rank samples, and
        a step carries deltas only: never the last token.) The cost: an id a decoding request."""
        if self.pipeline_parallel_size == 1:
            return {}
        told = {}
        for request, num_tokens, _ in scheduled:
            first = max(request.num_computed_tokens - len(request.prompt_token_ids), 0)
            last = request.num_computed_tokens + num_tokens - len(request.prompt_token_ids)
            if last > first:
                told[request.request_id] = request.output_token_ids[first:last]
        return told

    def make_metrics(self) -> list[Metric]:
        """vLLM's metrics of the scheduler and its KV cache, by their Prometheus names."""
        return [
            Counter("vllm:prefix_cache_queries", {}, self.prefix_cache_queries),
            Counter("vllm:prefix_cache_hits", {}, self.prefix_cache_hits),
            Counter("vllm:num_preemptions", {}, self.num_preemptions),
            Gauge("vllm:kv_cache_usage_perc", {}, self.kv_cache_manager.usage()),
            Gauge("vllm:num_requests_running", {}, len(self.running)),
            Gauge("vllm:num_requests_waiting", {}, len(self.waiting)),
        ]

    def preempt(self, request: Request) -> Request:
        """V1's recompute: its blocks freed, its computed tokens forgotten, to the front of the
        waiting queue. Its tokens in flight still come (Scheduler.requests); the workers keep their
        copy of it, generator included, so a seeded request samples as if never preempted."""
        self.kv_cache_manager.free(request)
        request.num_computed_tokens = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1
        return request

    def num_tokens_needed(self, request: Request) -> int:
        """The rest of its prompt (after a preemption: of all its tokens); else 1 (its last token,
        sampled or in flight) if it may need another token."""
        if self.pipeline_parallel_size > 1 and request.num_in_flight:  # see the class's docstring
            return 0
        left = request.num_tokens + request.num_in_flight - request.num_computed_tokens
        return left if left > 1 else int(self.may_need_another_token(request))

    def may_need_another_token(self, request: Request) -> bool:
        """Below max_tokens and max_model_len, counting tokens in flight (which may yet stop it)."""
        tokens = len(request.output_token_ids) + request.num_in_flight
        return (
            tokens < request.params.max_tokens
            and len(request.prompt_token_ids) + tokens < self.max_model_len
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[Request]:
        """Append each sampled token to its request; return the requests that got one (those it
        ended have finish_reason set). The token of a request finished or aborted since this step
        was sent, computed on the workers all the same, is dropped: never shown, never counted."""
        updated = []
        sampled = zip(scheduler_output.scheduled_ids, runner_output.sampled_token_ids)
        for request_id, token in sampled:
            request = self.requests.get(request_id)
            if request is None:  # finished or aborted since it was sent (async): dropped
                self.num_dropped_tokens += token is not None
                continue
            request.prompt_logprobs += runner_output.prompt_logprobs.get(request_id, [])
            if token is None:  # part-way in its prompt
                continue
            request.num_in_flight -= 1
            request.output_token_ids.append(token)
            if request.params.logprobs is not None:
                request.logprobs.append(runner_output.logprobs[request_id])
            updated.append(request)
            # An end-of-sequence or stop token ends it here; a stop string, a matter of text, is
            # found by the front end (OutputProcessor), which then aborts the request.
            if token == FAILED:  # no distribution in its row (Worker.sample): it alone ends
                request.finish_reason = "error"
            elif token in self.eos_token_ids and not request.params.ignore_eos:
                request.finish_reason = "stop"
            elif token in request.params.stop_token_ids:
                request.finish_reason, request.stop_reason = "stop", token
            elif (
                len(request.output_token_ids) >= request.params.max_tokens
                or request.num_tokens >= self.max_model_len
            ):
                request.finish_reason = "length"
        self.release([request for request in updated if request.finish_reason is not None])
        return updated

    def release(self, requests: list[Request]) -> None:
        """Free the requests' blocks at once (running ones, or preempted: waiting, known to the
        workers); the workers forget them with the next step."""
        for request in requests:
            del self.requests[request.request_id]
            (self.running if request in self.running else self.waiting).remove(request)
            self.kv_cache_manager.free(request)
            self.finished_ids.append(request.request_id)

    def abort_requests(self, request_ids: set[int]) -> None:
        """Forget these requests: those never admitted (unknown to the workers) are dropped, the
        others free their blocks (their tokens in flight are dropped when they come)."""
        unknown = {r.request_id for r in self.waiting if r.num_cached_tokens < 0} & request_ids
        self.waiting = deque(r for r in self.waiting if r.request_id not in unknown)
        for request_id in unknown:
            del self.requests[request_id]
        self.release([r for r in (*self.running, *self.waiting) if r.request_id in request_ids])
