"""A fake executor: the engine's executor interface over a fake paged model, without torch.

``FakeExecutor`` implements ``nanovllm/engine/executor.py`` (``profile_num_blocks``,
``allocate_kv_cache``, ``execute``, ``launch``, ``close``), so the real ``LLMEngine`` step
loop -- scheduler, model input, async scheduling, stop rules, output processing -- runs over
it (``make_engine``). It sees only the ``ModelInput`` of each step, as a real runner does.

The fake model is deterministic and pages its K/V exactly as a real one does:

* the fake K/V of position ``p`` is ``kv_value(kv[p - 1], p, token[p])`` -- a
  64-bit chain value that depends on every token up to ``p`` and on ``p``
  itself, as a deep transformer's K/V does. It is computed by reading the K/V of
  ``p - 1`` *through the block table* and written through ``slot_mapping``;
* the next token is a function of all K/V of the sequence, read through the
  block table (``attend``), so it is ``f(all previous tokens)`` when paging is
  right and something else when a slot holds wrong, stale or missing K/V.

``reference_generate`` computes ``f`` directly from the token list, so the
expected output of any request is known without running an engine: preemption,
chunking, prefix caching, batching and async scheduling must not change it.

Async scheduling: ``launch`` computes the step at once and keeps its sampled tokens; the next
step's placeholder rows (``pending_rows`` / ``pending_src``) read them, as the model runner's
``_fill_pending`` does on the device.

With ``strict=True`` every row of every step is checked against the fake model's own record
of the sequence (``ModelInput.seq_ids`` says which one): its prompt, given by whoever adds the
request (``add_sequence``), and every token the model sampled for it. Input ids, slots,
sequence lengths and sample rows must agree with that record, and every K/V read must return
the sequence's own K/V at that position (else ``KVCacheError`` naming the sequence, position
and slot). With ``strict=False`` wrong K/V only changes the output (what an output comparison
sees).

Pure Python: importing this module imports no torch.
"""

from __future__ import annotations

from types import SimpleNamespace

from nanovllm.config import EngineConfig
from nanovllm.core.model_input import ModelInput
from nanovllm.core.model_output import ModelOutput, ReadyOutput, SamplerOutput
from nanovllm.engine.engine import LLMEngine

MASK64 = (1 << 64) - 1
KV_ROOT = 0x5EED_0F_C0FFEE  # the "K/V" before position 0
INF_BUDGET = 1 << 30  # "unlimited" max_num_batched_tokens


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit bijection."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def kv_value(prev: int, pos: int, token: int) -> int:
    """Fake K/V of position ``pos``: depends on the K/V before it, the position and the token."""
    return _mix(prev ^ _mix((pos << 32) ^ (token & 0xFFFFFFFF)))


def kv_chain(tokens, prev: int = KV_ROOT) -> list[int]:
    out = []
    for pos, tok in enumerate(tokens):
        prev = kv_value(prev, pos, tok)
        out.append(prev)
    return out


def attend(values) -> int:
    """Fold every K/V of a sequence (in position order) into one state."""
    acc = 0xA11
    for v in values:
        acc = _mix(acc ^ v)
    return acc


def next_token(values, vocab_size: int) -> int:
    return (attend(values) >> 7) % vocab_size


def reference_generate(
    prompt: list[int],
    max_tokens: int,
    vocab_size: int,
    *,
    max_model_len: int = 1 << 30,
    stop_token_ids=(),
    min_tokens: int = 0,
) -> list[int]:
    """What the fake model outputs for ``prompt`` when paging is right: f(all previous tokens).

    The stop rules written out independently of the engine's: a stop token ends the request once
    ``min_tokens`` tokens are out (the fake model bans nothing: an earlier one just continues),
    then ``max_tokens`` or ``max_model_len`` does."""
    tokens = list(prompt)
    chain = kv_chain(tokens)
    out: list[int] = []
    while True:
        tok = next_token(chain, vocab_size)
        out.append(tok)
        if len(out) >= min_tokens and tok in stop_token_ids:
            return out
        if len(out) >= max_tokens or len(tokens) + 1 >= max_model_len:
            return out
        chain.append(kv_value(chain[-1] if chain else KV_ROOT, len(tokens), tok))
        tokens.append(tok)


class KVCacheError(AssertionError):
    """The fake model read K/V that does not belong to the sequence at that position."""


class ModelInputError(AssertionError):
    """A step's ModelInput disagrees with the fake model's record of a sequence."""


class FakeExecutor:
    """The executor interface over the fake paged model (see the module docstring)."""

    def __init__(
        self, block_size: int, vocab_size: int, *, strict: bool = True, profiled_num_blocks: int | None = None
    ):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.strict = strict
        self.profiled_num_blocks = profiled_num_blocks
        self.kv: list[tuple[int, int] | None] = []  # slot -> (position, K/V value)
        self.tokens: dict[int, list[int]] = {}  # seq_id -> prompt + every token sampled for it
        self.names: dict[int, str] = {}  # seq_id -> request id (for messages)
        self._chains: dict[int, list[int]] = {}  # seq_id -> true K/V chain of its tokens
        self.prev_tokens: list[int] | None = None  # the last launched step's sampled tokens
        self.num_steps = 0
        self.closed = False

    # --------------------------------------------------------- test side
    def add_sequence(self, seq_id: int, prompt_token_ids: list[int], name: str = "") -> None:
        """Tell the fake model a request's prompt (its strict checks compare every row with it)."""
        self.tokens[seq_id] = list(prompt_token_ids)
        self.names[seq_id] = name or f"seq {seq_id}"

    # ---------------------------------------------------- executor interface
    def profile_num_blocks(self) -> int:
        if self.profiled_num_blocks is None:
            raise RuntimeError("FakeExecutor has no memory to profile: set num_kvcache_blocks in the config")
        return self.profiled_num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.kv = [None] * (num_blocks * self.block_size)

    def execute(self, mi: ModelInput) -> ModelOutput:
        return self._run(mi)

    def launch(self, mi: ModelInput) -> ReadyOutput:
        """Async scheduling: compute now, keep the sampled tokens for the next step's placeholder rows
        (none when this step sampled nothing: a placeholder row then has nothing to read)."""
        output = self._run(mi)
        self.prev_tokens = list(output.sampled.token_ids) if output.sampled is not None else []
        return ReadyOutput(output)

    def close(self) -> None:
        self.kv = []
        self.closed = True

    # ------------------------------------------------------------ the model
    def _slot(self, table: list[int], pos: int) -> int | None:
        i = pos // self.block_size
        return table[i] * self.block_size + pos % self.block_size if i < len(table) else None

    def _truth(self, seq_id: int) -> list[int]:
        """The correct K/V chain of every token the fake model knows for seq_id."""
        tokens = self.tokens[seq_id]
        chain = self._chains.setdefault(seq_id, [])
        prev = chain[-1] if chain else KV_ROOT
        for pos in range(len(chain), len(tokens)):
            prev = kv_value(prev, pos, tokens[pos])
            chain.append(prev)
        return chain

    def _read(self, seq_id: int, table: list[int], pos: int, truth: list[int] | None) -> int:
        slot = self._slot(table, pos)
        entry = self.kv[slot] if slot is not None and 0 <= slot < len(self.kv) else None
        if truth is not None and entry != (pos, truth[pos]):
            raise KVCacheError(
                f"{self.names[seq_id]} (seq_id {seq_id}): position {pos} reads slot {slot} "
                f"holding {entry}, expected ({pos}, {truth[pos]})"
            )
        if entry is None or entry[0] != pos:
            return 0  # missing or misplaced K/V: contributes garbage
        return entry[1]

    def _fill_pending(self, input_ids: list[int], mi: ModelInput) -> None:
        """Placeholder rows take the tokens the previous launched step sampled (``_fill_pending``)."""
        if self.prev_tokens is None:
            raise RuntimeError("a step has placeholder inputs but no step was launched before it")
        for row, src in zip(mi.pending_rows, mi.pending_src, strict=True):
            if not 0 <= src < len(self.prev_tokens):
                raise ModelInputError(
                    f"placeholder row {row} reads sample row {src} of a step that "
                    f"sampled {len(self.prev_tokens)} tokens"
                )
            input_ids[row] = self.prev_tokens[src]

    def _check_rows(self, j: int, seq_id: int, input_ids: list[int], mi: ModelInput, samples: bool) -> None:
        """Strict: sequence j's rows agree with the fake model's record of seq_id."""
        name = f"{self.names.get(seq_id, seq_id)} (seq_id {seq_id})"
        if seq_id not in self.tokens:
            raise ModelInputError(f"{name}: scheduled but never added (or already finished)")
        tokens = self.tokens[seq_id]
        lo, hi = mi.query_start_loc[j], mi.query_start_loc[j + 1]
        if hi <= lo:
            raise ModelInputError(f"{name}: {hi - lo} rows (nothing to produce logits from)")
        start, n = mi.positions[lo], hi - lo
        if mi.positions[lo:hi] != list(range(start, start + n)):
            raise ModelInputError(f"{name}: positions {mi.positions[lo:hi]} are not consecutive")
        if input_ids[lo:hi] != tokens[start : start + n]:
            raise ModelInputError(
                f"{name}: input ids {input_ids[lo:hi]} at positions [{start}, {start + n}) "
                f"!= its tokens {tokens[start : start + n]}"
            )
        slots = [self._slot(mi.block_tables[j], p) for p in range(start, start + n)]
        if mi.slot_mapping[lo:hi] != slots:
            raise ModelInputError(f"{name}: slot_mapping {mi.slot_mapping[lo:hi]} != {slots} of its block table")
        if mi.seq_lens[j] != start + n:
            raise ModelInputError(f"{name}: seq_len {mi.seq_lens[j]} != {start + n}")
        if samples != (start + n == len(tokens)):
            raise ModelInputError(
                f"{name}: {'samples' if samples else 'does not sample'} at the end of a "
                f"chunk ending at {start + n} of its {len(tokens)} tokens"
            )

    def _run(self, mi: ModelInput) -> ModelOutput:
        if self.closed:
            raise RuntimeError("FakeExecutor is closed")
        self.num_steps += 1
        for seq_id in mi.finished_seq_ids:
            self.tokens.pop(seq_id, None)
            self._chains.pop(seq_id, None)
        input_ids = list(mi.input_ids)
        if mi.pending_rows:
            self._fill_pending(input_ids, mi)
        if len(mi.seq_ids) != len(mi.seq_lens):
            raise ModelInputError(f"{len(mi.seq_ids)} seq_ids for {len(mi.seq_lens)} sequences")
        sample_rows = {row: k for k, row in enumerate(mi.sample_rows)}
        sampled: list[int] = [0] * len(mi.sample_rows)
        for j, seq_id in enumerate(mi.seq_ids):
            lo, hi = mi.query_start_loc[j], mi.query_start_loc[j + 1]
            table = mi.block_tables[j]
            k = sample_rows.get(hi - 1)
            truth = None
            if self.strict:
                self._check_rows(j, seq_id, input_ids, mi, k is not None)
                if k is not None and mi.sample_seq_ids[k] != seq_id:
                    raise ModelInputError(
                        f"sample row {hi - 1} is seq_id {mi.sample_seq_ids[k]}'s, but its rows are seq_id {seq_id}'s"
                    )
                truth = self._truth(seq_id)
                for pos in range(mi.positions[lo]):  # attention reads all earlier K/V through the table
                    self._read(seq_id, table, pos, truth)
            value = None
            for r in range(lo, hi):
                pos, tok, slot = mi.positions[r], input_ids[r], mi.slot_mapping[r]
                if pos == 0:
                    prev = KV_ROOT
                elif r > lo and mi.positions[r - 1] == pos - 1:
                    prev = value  # computed just now, in the same forward pass
                else:
                    prev = self._read(seq_id, table, pos - 1, truth)
                value = kv_value(prev, pos, tok)
                if 0 <= slot < len(self.kv):
                    self.kv[slot] = (pos, value)
            if k is not None:
                values = [self._read(seq_id, table, p, truth) for p in range(mi.seq_lens[j])]
                sampled[k] = next_token(values, self.vocab_size)
                if seq_id in self.tokens:
                    self.tokens[seq_id].append(sampled[k])
        if not mi.sample_rows:
            sampler = None
        else:
            logprobs = [None if k is None else (0.0, 1, []) for k in mi.num_logprobs]
            sampler = SamplerOutput(sampled, [], logprobs)
        prompt_logprobs = [[(0.0, 1, [])] * len(targets) for _, targets, _ in mi.prompt_logprob_jobs]
        return ModelOutput(sampler, prompt_logprobs)


def make_engine(
    *,
    num_blocks: int,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    enable_chunked_prefill: bool = True,
    async_scheduling: bool = False,
    vocab_size: int = 11,
    strict: bool = True,
    trace=False,
) -> tuple[LLMEngine, FakeExecutor]:
    """The real LLMEngine over a FakeExecutor, from a resolved EngineConfig without a model: a
    minimal HF config (vocab_size, max_position_embeddings) and ``device="cpu"`` (no torch)."""
    config = EngineConfig(
        device="cpu",
        block_size=block_size,
        num_kvcache_blocks=num_blocks,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
        async_scheduling=async_scheduling,
        skip_tokenizer_init=True,
    )
    config.resolve(SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=max_model_len), "fake-model")
    executor = FakeExecutor(block_size, vocab_size, strict=strict)
    return LLMEngine(config, executor, trace=trace), executor


def add_request(engine: LLMEngine, executor: FakeExecutor, request_id: str, prompt: list[int], params) -> None:
    """``engine.add_request`` and the fake model's record of each sequence it made (every child
    of an n > 1 request under its own id), so that a strict executor knows their prompts."""
    before = set(engine.requests)
    engine.add_request(request_id, prompt, params)
    for rid in engine.requests.keys() - before:
        executor.add_sequence(engine.requests[rid].seq_id, prompt, rid)
