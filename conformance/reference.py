"""The reference: HuggingFace transformers in float32 on the CPU.

greedy() generates with ``model.generate`` and keeps every step's raw
log-probabilities; score() teacher-forces a token sequence and returns the
log-probabilities at each position (for prompt-logprob checks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class RefGreedy:
    tokens: list[int]
    logprobs: torch.Tensor  # [steps, vocab] log-softmax of the raw logits at each step


def load_hf_model(model: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    path = Path(model)
    if path.suffix == ".gguf":
        m = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        m = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return m.eval()


class HFReference:
    def __init__(self, model: str, dtype: torch.dtype = torch.float32):
        import transformers

        self.model = load_hf_model(model, dtype)
        self.name = f"transformers {transformers.__version__}"
        self.vocab_size = self.model.config.vocab_size

    @torch.inference_mode()
    def greedy(self, prompt: list[int], max_new_tokens: int) -> RefGreedy:
        """Exactly max_new_tokens greedy tokens (EOS ignored)."""
        ids = torch.tensor([prompt])
        out = self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = torch.log_softmax(torch.stack([step[0] for step in out.logits]).float(), dim=-1)
        return RefGreedy(tokens, logprobs)

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """[len, vocab]: row p is the log-distribution of token p + 1 given tokens 0..p."""
        logits = self.model(torch.tensor([token_ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)
