"""ModelRunner: ModelInput -> tensors -> model -> sampled token ids.

It owns the model, the KV cache and the sampler of one rank. The same runner
drives the CPU (plain PyTorch attention) and the GPU (Triton kernels, CUDA
graphs for decode); only the attention backend and the graph runner differ.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from nanovllm.attention.backends import get_backend
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.config import EngineConfig
from nanovllm.core.model_input import ModelInput
from nanovllm.core.model_output import ModelOutput
from nanovllm.core.utils import cdiv
from nanovllm.layers.attention import Attention
from nanovllm.layers.cpu_linear import pack_linear_weights
from nanovllm.layers.parallel import tp_rank, tp_size
from nanovllm.layers.sampler import Sampler, SamplingMetadata, fused_sampler
from nanovllm.layers.seeds import mix_seed
from nanovllm.loader.model_loader import init_dummy_weights, iter_safetensors, load_weights
from nanovllm.models.registry import get_model_class
from nanovllm.worker import sampling_warmup
from nanovllm.worker.cuda_graph import CudaGraphRunner
from nanovllm.worker.step_inputs import StepInputs

logger = logging.getLogger(__name__)
_SEED_MASK = (1 << 62) - 1


class StepHandle:
    """A launched step; ``result()`` waits for it once and returns its ModelOutput."""

    def __init__(self, finish):
        self._finish = finish
        self._result: ModelOutput | None = None

    def result(self) -> ModelOutput:
        if self._result is None:
            self._result = self._finish()
        return self._result


class ModelRunner:
    def __init__(self, config: EngineConfig, load_format: str = "auto"):
        self.config = config
        self.device = torch.device(config.device if config.device == "cpu" else f"cuda:{torch.cuda.current_device()}")
        self.dtype = config.torch_dtype
        self.kv_dtype = config.kv_cache_torch_dtype
        if self.kv_dtype == torch.float8_e4m3fn and self.device.type == "cuda":
            cap = torch.cuda.get_device_capability(self.device)
            if cap < (8, 9):
                raise ValueError(
                    f"kv_cache_dtype={config.kv_cache_dtype!r} needs a GPU with float8 support (compute "
                    f"capability 8.9 or newer); {torch.cuda.get_device_name(self.device)} has {cap[0]}.{cap[1]}: "
                    f"use kv_cache_dtype='auto'"
                )
        self.block_size = config.block_size
        self.rank = tp_rank()
        hf = config.hf_config
        # what this engine holds on the GPU is counted from here (weights, buffers, graphs)
        self._reserved_at_start = self._check_gpu_memory() if self.device.type == "cuda" else 0
        if self.device.type == "cpu" and config.threads is not None:  # ranks share the threads
            torch.set_num_threads(max(1, config.threads // config.tensor_parallel_size))
        torch.manual_seed(config.seed)
        model_cls = get_model_class(hf)
        built = time.perf_counter()
        default_dtype = torch.get_default_dtype()
        try:
            torch.set_default_dtype(self.dtype)
            with torch.device(self.device):
                self.model = model_cls(hf, max_position=config.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        # RoPE tables stay in float32, as HF computes them
        for module in self.model.modules():
            if hasattr(module, "cos") and hasattr(module, "sin"):
                module.cos, module.sin = module.cos.float(), module.sin.float()
        if load_format == "dummy":
            init_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, iter_safetensors(config.model_dir))
        self.model.eval()
        if self.device.type == "cpu":
            pack_linear_weights(
                self.model
            )  # packed copies (rows kernel / oneDNN): faster decode matmuls (cpu_linear.py)
        logger.info(
            "built the model with %s weights in %.2f s",
            "random (dummy)" if load_format == "dummy" else "its checkpoint's",
            time.perf_counter() - built,
        )
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.backend = get_backend(config.attention_backend)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.generators: dict[int, torch.Generator] = {}
        self.num_sampling_steps = 0
        self.prev_tokens: torch.Tensor | None = None  # the last launched step's sampled tokens
        self.num_blocks = 0
        # GPU: pinned staging buffers (one host->device copy per step) and decode graphs
        self.inputs: StepInputs | None = None
        self.graphs: CudaGraphRunner | None = None
        if self.device.type == "cuda":
            self.inputs = StepInputs(
                max(config.max_num_batched_tokens, config.max_num_seqs),
                config.max_num_seqs,
                cdiv(config.max_model_len, self.block_size),
                self.block_size,
                self.device,
            )

    def _use_graphs(self) -> bool:
        # the torch backend sizes tensors from host lengths: not capturable
        return self.device.type == "cuda" and not self.config.enforce_eager and self.backend.name == "triton"

    # ---------------------------------------------------------------- KV cache
    def kv_bytes_per_block(self) -> int:
        a = self.attn_layers[0]
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * len(self.attn_layers) * self.block_size * a.num_kv_heads * a.head_dim * elem

    def max_useful_blocks(self) -> int:
        per_seq = cdiv(self.config.max_model_len, self.block_size)
        return self.config.max_num_seqs * per_seq

    def _check_gpu_memory(self) -> int:
        """Start-up check of ``gpu_memory_utilization`` (vLLM's per-instance meaning: the fraction
        of the device's total memory *this* engine may use -- weights, activations, graphs and
        KV cache -- whatever other processes hold). Refuses when that much is not free. A KV cache
        sized explicitly (kv_cache_memory_gib, num_kvcache_blocks) is checked when it is allocated.
        Returns the bytes PyTorch has reserved in this process before the engine's own."""
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        # memory this process's caching allocator holds but no tensor uses (an engine closed
        # earlier in this process, e.g. between benchmark repeats) is free for this engine
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if self.config.kv_cache_memory_gib is None and self.config.num_kvcache_blocks is None:
            requested = total * self.config.gpu_memory_utilization
            if requested > free:
                raise ValueError(
                    f"gpu_memory_utilization={self.config.gpu_memory_utilization} asks for "
                    f"{requested / 2**30:.1f} GiB of {self.device}'s {total / 2**30:.1f} GiB, but only "
                    f"{free / 2**30:.1f} GiB are free (other processes or engines hold "
                    f"{(total - free) / 2**30:.1f} GiB): lower gpu_memory_utilization to at most "
                    f"{max(free / total - 0.01, 0.0):.2f}, or size the KV cache with kv_cache_memory_gib"
                )
        return torch.cuda.memory_reserved()

    def profile_num_blocks(self) -> int:
        """How many blocks fit in the memory budget (before any override).

        CPU: ``kv_cache_memory_gib``, else ``NANOVLLM_CPU_KVCACHE_SPACE`` GiB (vLLM's
        ``VLLM_CPU_KVCACHE_SPACE``), else min(4 GiB, 30% of the available RAM). GPU: with
        ``kv_cache_memory_gib`` that much (it must be free, beside the activation reserve);
        otherwise ``total x gpu_memory_utilization`` minus what this engine already holds
        (weights, staging buffers) minus the profiled activation and graph reserve.
        """
        per_block = self.kv_bytes_per_block()
        if self.device.type == "cpu":
            if self.config.kv_cache_memory_gib is not None:
                budget = self.config.kv_cache_memory_gib * (1 << 30)
            elif (space := cpu_kvcache_space_gib()) is not None:
                budget = space * (1 << 30)
            else:
                budget = min(4 << 30, 0.3 * _available_ram())
            return max(1, min(int(budget // per_block), self.max_useful_blocks()))
        reserve = self.profile_peak_activation()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        held = torch.cuda.memory_reserved() - self._reserved_at_start  # weights and buffers
        if self.config.kv_cache_memory_gib is not None:
            budget = self.config.kv_cache_memory_gib * (1 << 30)
            what = f"kv_cache_memory_gib={self.config.kv_cache_memory_gib}"
        else:
            budget = total * self.config.gpu_memory_utilization - held - reserve
            what = (
                f"gpu_memory_utilization={self.config.gpu_memory_utilization} of "
                f"{total / 2**30:.1f} GiB, minus {held / 2**30:.2f} GiB of weights and buffers and "
                f"{reserve / 2**30:.2f} GiB reserved for activations and graphs"
            )
        if budget < per_block:
            raise ValueError(
                f"no GPU memory left for the KV cache ({what}): one block needs "
                f"{per_block / 2**20:.1f} MiB; raise gpu_memory_utilization or kv_cache_memory_gib"
            )
        if budget + reserve > free:
            raise ValueError(
                f"the KV cache ({budget / 2**30:.2f} GiB: {what}) and the activation reserve "
                f"({reserve / 2**30:.2f} GiB) do not fit in the {free / 2**30:.2f} GiB free on "
                f"{self.device}; lower gpu_memory_utilization or kv_cache_memory_gib"
            )
        logger.info("KV cache budget %.2f GiB (%s)", budget / 2**30, what)
        return int(budget // per_block)

    def profile_peak_activation(self) -> int:
        """Bytes to keep free beside weights and KV cache, measured by warm-up steps.

        A prefill of max_num_batched_tokens tokens and, when decode graphs will be
        captured, an eager decode of max_num_seqs rows (a graph pool holds about one
        such forward, plus its share of this reserve's margin); each step includes
        the LM head and a top-p sampler. Both run over a scratch KV cache allocated
        before the measurement and freed after it; they also compile the kernels.
        """
        cfg = self.config
        start = time.perf_counter()
        lens, left = [], cfg.max_num_batched_tokens  # type: ignore[var-annotated]
        while left > 0 and len(lens) < cfg.max_num_seqs:
            lens.append(min(left, cfg.max_model_len))
            left -= lens[-1]
        prefill_blocks = sum(cdiv(n, self.block_size) for n in lens)
        self.allocate_kv_cache(prefill_blocks + cfg.max_num_seqs, capture_graphs=False)
        prefill = _dummy_input(lens, self.block_size, 0)
        n = len(prefill.input_ids)
        prefill.sample_rows = list(range(max(0, n - cfg.max_num_seqs), n))  # worst case: a full batch samples
        try:
            peaks = [self._peak_step_memory(prefill)]
            if self._use_graphs():
                peaks.append(
                    self._peak_step_memory(_dummy_input([1] * cfg.max_num_seqs, self.block_size, prefill_blocks))
                )
        finally:
            self.free_kv_cache()
            torch.cuda.empty_cache()
        logger.info(
            "profiled peak activation memory: %s MiB (%.2f s, kernels compiled or loaded from the cache)",
            [round(p / 2**20) for p in peaks],
            time.perf_counter() - start,
        )
        return int(sum(peaks) * 1.1) + (256 << 20)

    def _peak_step_memory(self, mi: ModelInput) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.inference_mode():
            hidden, rows = self._forward(mi)
            logits = self.model.compute_logits(hidden[rows])
            n = logits.shape[0]
            sampler = Sampler(torch.Generator(device=self.device).manual_seed(0))
            sampler(
                logits,
                SamplingMetadata(
                    [1.0] * n, [50] * n, [0.9] * n, [0.0] * n, [None] * n, [[] for _ in range(n)], [None] * n
                ),
            )
            if fused_sampler.enabled(logits):  # compiled here, not by the first request that samples
                ones = torch.ones(n, dtype=torch.float32, device=self.device)
                zeros = torch.zeros(n, dtype=torch.int64, device=self.device)
                for splits in (1, 2):  # both variants: a whole row per program, and split rows + merge
                    fused_sampler.sample(logits, ones, zeros, splits=splits)
            del hidden, logits
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    def allocate_kv_cache(self, num_blocks: int, capture_graphs: bool = True) -> None:
        """Allocate the cache; on a GPU also reserve kernel workspaces and capture decode graphs."""
        self.num_blocks = num_blocks
        for layer in self.attn_layers:
            dims = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = self.backend.new_kv_cache(*dims, self.kv_dtype, self.device)
            layer.v_cache = self.backend.new_kv_cache(*dims, self.kv_dtype, self.device)
            layer.backend = self.backend
        if hasattr(self.backend, "reserve"):
            a = self.attn_layers[0]
            self.backend.reserve(
                self.config.max_num_seqs,
                a.num_heads,
                a.num_kv_heads,
                a.head_dim,
                self.device,
                self.kv_dtype,
                max_context=cdiv(self.config.max_model_len, self.block_size) * self.block_size,
            )
        if capture_graphs and self._use_graphs():
            self.graphs = CudaGraphRunner(
                self.model,
                self.inputs,
                self.config.max_num_seqs,
                self.config.hf_config.hidden_size,
                self.dtype,
                self.device,
            )
            self.graphs.capture()
        if capture_graphs and self.device.type == "cuda" and sampling_warmup.enabled():
            # every rank (the LM head gathers its vocabulary shards); the sampler on the one that samples
            sampling_warmup.warm_sampling_rows(
                self.model,
                min(self.config.max_num_seqs, self.config.max_num_batched_tokens),
                self.config.hf_config.hidden_size,
                self.dtype,
                self.device,
                sample=self.rank == 0,
            )
            sampling_warmup.warm_pending_scatter(self.scatter_pending, self.device)

    def free_kv_cache(self) -> None:
        self.graphs = None  # graphs hold the cache's addresses
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = torch.tensor([])
        self.num_blocks = 0

    def release(self) -> None:
        """Drop everything this runner holds on its device (after free_kv_cache; the runner is not
        used again): weights, the attention layers and their backend's workspace, the staging
        buffers, the sampler's generators and the last step's tokens.

        The weights' storage is dropped here, tensor by tensor: the modules hold reference cycles (a
        parameter's ``weight_loader`` is a bound method of its layer), so dropping the model alone
        would leave every weight (and, on the CPU, its packed copy) to the next full garbage
        collection, and a collection at every close costs ~0.2 s of a CLI command's exit."""
        if self.model is not None:
            for module in self.model.modules():
                for tensor in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                    tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
                if getattr(module, "packed_weight", None) is not None:
                    module.packed_weight = None
        self.model = None
        self.attn_layers = []
        self.backend = None
        self.inputs = None
        self.sampler = None
        self.generators = {}
        self.prev_tokens = None

    # ------------------------------------------------------------------- step
    def _tensor(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    def _metadata(self, mi: ModelInput) -> AttentionMetadata:
        width = max(len(t) for t in mi.block_tables)
        tables = [t + [0] * (width - len(t)) for t in mi.block_tables]
        qsl = mi.query_start_loc
        return AttentionMetadata(
            slot_mapping=self._tensor(mi.slot_mapping, torch.int64),
            query_start_loc=self._tensor(qsl, torch.int32),
            seq_lens=self._tensor(mi.seq_lens, torch.int32),
            block_tables=self._tensor(tables, torch.int32),
            max_query_len=max(qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)),
            max_seq_len=max(mi.seq_lens),
            block_size=self.block_size,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=mi.seq_lens,
        )

    def _sampling_metadata(self, mi: ModelInput) -> SamplingMetadata:
        if self.device.type == "cuda":
            return self._philox_sampling_metadata(mi)
        for seq_id in mi.finished_seq_ids:
            self.generators.pop(seq_id, None)
        gens = []  # type: ignore[var-annotated]
        for seq_id, seed in zip(mi.sample_seq_ids, mi.seeds):
            if seed is None:
                gens.append(None)
                continue
            gen = self.generators.get(seq_id)
            if gen is None:
                gen = self.generators[seq_id] = torch.Generator(device=self.device).manual_seed(seed)
            gens.append(gen)
        return SamplingMetadata(
            mi.temperatures,
            mi.top_ks,
            mi.top_ps,
            mi.min_ps,
            gens,
            mi.banned_token_ids,
            mi.num_logprobs,
            processing=mi.logits_processing,
        )

    def _philox_sampling_metadata(self, mi: ModelInput) -> SamplingMetadata:
        """GPU: per-row Philox seeds instead of stateful generators. A seeded request's seed for
        its i-th output token is mix(seed, i): its draws depend on nothing else (not its
        batch-mates, not preemption); the others use the engine seed mixed with a step counter,
        plus the row."""
        n = len(mi.sample_rows)
        self.num_sampling_steps += 1
        base = mix_seed(self.config.seed, self.num_sampling_steps)
        # Philox keys are stream ids: base + row gives each unseeded row its own stream
        seeds = [
            (base + r) & _SEED_MASK if s is None else mix_seed(s, i)
            for r, (s, i) in enumerate(zip(mi.seeds, mi.output_indices))
        ]
        return SamplingMetadata(
            mi.temperatures,
            mi.top_ks,
            mi.top_ps,
            mi.min_ps,
            [None] * n,
            mi.banned_token_ids,
            mi.num_logprobs,
            row_seeds=seeds,
            seeded=[s is not None for s in mi.seeds],
            processing=mi.logits_processing,
        )

    def _forward(self, mi: ModelInput):
        """The model on one step -> (hidden states, index of the rows that sample)."""
        fill = (lambda ids: self._fill_pending(ids, mi)) if mi.pending_rows else None
        if self.inputs is None:  # CPU: plain tensors
            input_ids = self._tensor(mi.input_ids, torch.int64)
            positions = self._tensor(mi.positions, torch.int64)
            if fill is not None:
                fill(input_ids)
            return self.model(input_ids, positions, self._metadata(mi)), mi.sample_rows
        batch = self.graphs.padded_size(mi) if self.graphs is not None else None
        if batch is not None:
            return self.graphs.run(mi, batch, fill)
        step = self.inputs.stage(mi)
        if fill is not None:
            fill(step.input_ids)
        return self.model(step.input_ids, step.positions, step.meta), step.sample_rows

    def _fill_pending(self, input_ids: torch.Tensor, mi: ModelInput) -> None:
        """Async scheduling: copy the tokens the previous step sampled (still on the device)
        into the rows that wait for them. Queued on the stream: no synchronisation."""
        prev = self.prev_tokens
        if prev is None:
            raise RuntimeError("a step has placeholder inputs but no step was launched before it")
        k = len(mi.pending_rows)
        if mi.pending_rows == mi.pending_src == list(range(k)):  # steady decode: same rows, same order
            input_ids[:k].copy_(prev[:k])
            return
        self.scatter_pending(input_ids, prev, mi.pending_rows, mi.pending_src)

    @staticmethod
    def scatter_pending(input_ids: torch.Tensor, prev: torch.Tensor, rows: list[int], src: list[int]) -> None:
        """``input_ids[rows[i]] = prev[src[i]]`` on the device: the fill when rows moved or left
        (a pinned index copied without a wait, then ``index_select`` and ``index_copy_``)."""
        index = torch.tensor([rows, src], dtype=torch.int64, pin_memory=input_ids.is_cuda).to(
            input_ids.device, non_blocking=True
        )
        input_ids.index_copy_(0, index[0], prev.index_select(0, index[1]))

    @torch.inference_mode()
    def execute(self, mi: ModelInput) -> ModelOutput:
        hidden, sample_rows = self._forward(mi)
        prompt_lps = self._prompt_logprobs(hidden, mi)
        if not mi.sample_rows:
            return ModelOutput(None, prompt_lps)
        logits = self.model.compute_logits(hidden[sample_rows])
        if self.rank != 0:
            return ModelOutput(None, [])
        return ModelOutput(self.sampler(logits, self._sampling_metadata(mi)), prompt_lps)

    @torch.inference_mode()
    def launch(self, mi: ModelInput) -> StepHandle:
        """Queue a step on the device and return at once (async scheduling): the sampled tokens
        stay on the device for the next step's placeholder rows; the handle's ``result()``
        waits for them. With tensor parallelism rank 0 samples and every rank gets its tokens
        (``_share_sampled``); the other ranks' handles return an empty output."""
        hidden, sample_rows = self._forward(mi)
        prompt_lps = self._prompt_logprobs(hidden, mi)
        if not mi.sample_rows:
            return StepHandle(lambda: ModelOutput(None, prompt_lps))
        logits = self.model.compute_logits(hidden[sample_rows])
        pending = self.sampler.launch(logits, self._sampling_metadata(mi)) if self.rank == 0 else None
        self.prev_tokens = pending.tokens if tp_size() == 1 else self._share_sampled(pending, logits, mi)
        if pending is None:
            return StepHandle(lambda: ModelOutput(None, []))
        return StepHandle(lambda: ModelOutput(pending.result(), prompt_lps))

    def _share_sampled(self, pending, logits: torch.Tensor, mi: ModelInput) -> torch.Tensor:
        """Tensor parallelism: rank 0's sampled tokens on every rank, on the device (a broadcast,
        queued on the stream with NCCL: no host synchronisation). Only rank 0 samples, so the
        ranks cannot disagree on a token whatever their generators hold."""
        n = len(mi.sample_rows)
        if pending is not None:
            tokens = pending.tokens.to(torch.int64)
        else:
            tokens = torch.empty(n, dtype=torch.int64, device=logits.device)
        dist.broadcast(tokens, src=0)
        return tokens

    def _prompt_logprobs(self, hidden: torch.Tensor, mi: ModelInput):
        results = []
        for first_row, targets, k in mi.prompt_logprob_jobs:
            rows = []
            for s in range(0, len(targets), 512):  # bounded memory: 512 rows of vocab logits at a time
                chunk = targets[s : s + 512]
                logits = self.model.compute_logits(hidden[first_row + s : first_row + s + len(chunk)]).float()
                lp = torch.log_softmax(logits, dim=-1)
                tgt = torch.tensor(chunk, device=lp.device).unsqueeze(1)
                tgt_lp = lp.gather(1, tgt)
                ranks = ((lp > tgt_lp).sum(-1) + 1).tolist()
                top_v, top_i = lp.topk(max(k, 1), dim=-1)
                for j, (v, r) in enumerate(zip(tgt_lp.squeeze(1).tolist(), ranks)):
                    top = list(zip(top_i[j, :k].tolist(), top_v[j, :k].tolist())) if k else []
                    rows.append((v, r, top))
            results.append(rows)
        return results if self.rank == 0 else []


def _dummy_input(lens: list[int], block_size: int, first_block: int) -> ModelInput:
    """Fresh prompts of the given lengths (token 0) on consecutive blocks from ``first_block``."""
    mi = ModelInput([], [], [], [0], [], [])
    block = first_block
    for n in lens:
        table = list(range(block, block + cdiv(n, block_size)))
        block += len(table)
        mi.input_ids += [0] * n
        mi.positions += list(range(n))
        mi.slot_mapping += [table[p // block_size] * block_size + p % block_size for p in range(n)]
        mi.query_start_loc.append(mi.query_start_loc[-1] + n)
        mi.seq_lens.append(n)
        mi.block_tables.append(table)
        mi.sample_rows.append(mi.query_start_loc[-1] - 1)
    return mi


def cpu_kvcache_space_gib() -> float | None:
    """``NANOVLLM_CPU_KVCACHE_SPACE``: the CPU KV cache's GiB when ``kv_cache_memory_gib`` is not
    given (vLLM's ``VLLM_CPU_KVCACHE_SPACE``); None when unset. The test suite sets it small: a
    process holding many engines otherwise holds 4 GiB of address space for each, and once the
    kernel merges those mappings into one larger than RAM, every fork of that process (a server, a
    CLI run) fails with ENOMEM."""
    value = os.environ.get("NANOVLLM_CPU_KVCACHE_SPACE")
    if value is None or value == "":
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = float("nan")
    if not gib > 0:
        raise ValueError(f"NANOVLLM_CPU_KVCACHE_SPACE must be a number of GiB > 0, got {value!r}")
    return gib


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
