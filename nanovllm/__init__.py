"""nanovllm: a compact, readable LLM inference engine in the vLLM lineage."""
from nanovllm.config import EngineConfig
from nanovllm.engine.engine import LLMEngine
from nanovllm.llm import LLM
from nanovllm.outputs import CompletionOutput, Logprob, RequestOutput
from nanovllm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "Logprob"]
__version__ = "0.1.0"
