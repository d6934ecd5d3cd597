"""What generate() and LLMEngine.step() return: vLLM's RequestOutput / CompletionOutput / Logprob,
and RequestMetrics (a request's timestamps)."""

from __future__ import annotations

from dataclasses import dataclass

# One position's log-probabilities: token id -> Logprob.
LogprobsDict = dict[int, "Logprob"]


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[LogprobsDict] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to one request (vLLM's names; seconds since the epoch, ``time.time()``).

    A time is None until it happened. ``first_scheduled_time`` is the first step that computed
    the request (a preempted request keeps it); the token times are when a step's tokens reached
    the host. Derived: ``time_in_queue`` (arrival -> first scheduled) and ``first_token_latency``
    (arrival -> first token, TTFT).
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_in_queue(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def first_token_latency(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def as_dict(self) -> dict:
        """The fields and the derived latencies, as plain JSON-ready data."""
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["time_in_queue"] = self.time_in_queue
        d["first_token_latency"] = self.first_token_latency
        return d


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: list[LogprobsDict | None] | None = None
    metrics: RequestMetrics | None = None

    def add(self, later: RequestOutput, delta: bool) -> RequestOutput:
        """This output followed by ``later`` of the same request, as one output (what a caller
        that fell behind gets: vLLM's merging of a slow consumer's outputs). Completions pair up
        by ``index`` (an n > 1 request streams one child's completion per output): ``delta``
        pieces of the same completion are concatenated, otherwise the later one replaces it; a
        completion only ``later`` has is added. Outputs stay in index order."""
        mine_by_index = {c.index: i for i, c in enumerate(self.outputs)}
        outputs = list(self.outputs)
        for new in later.outputs:
            i = mine_by_index.get(new.index)
            if i is None:
                outputs.append(new)
                continue
            if not delta:
                outputs[i] = new
                continue
            mine = outputs[i]
            mine.text += new.text
            mine.token_ids = mine.token_ids + new.token_ids
            if mine.logprobs is not None and new.logprobs is not None:
                mine.logprobs = mine.logprobs + new.logprobs
            mine.cumulative_logprob = new.cumulative_logprob
            mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
        self.outputs = sorted(outputs, key=lambda c: c.index)
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics
        if later.prompt_logprobs is not None and (self.prompt_logprobs is None or not delta):
            self.prompt_logprobs = later.prompt_logprobs
        return self
