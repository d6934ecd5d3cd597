"""transformers' logits processors as references, made independent of its version's input checks.

- ``NoBadWordsLogitsProcessor`` looks at the whole ``input_ids``; vLLM's rule looks at the output
  tokens only. Passing the output alone hits a boundary some transformers versions treat
  differently (an output exactly as long as a word's prefix: banned by 5.x, not by the GPU image's
  version). A leading token that is in no word makes that boundary an ordinary case everywhere:
  the word's prefix can only match inside the output, which is vLLM's rule.
- ``SequenceBiasLogitsProcessor`` refuses token id 0 in some versions ("positive integers"); a
  bias on a single token is an addition to that token's logit, so id 0 is added directly.
"""

from __future__ import annotations

import torch
from transformers import NoBadWordsLogitsProcessor, SequenceBiasLogitsProcessor


def bad_words_reference(words: list[list[int]], output: list[int], scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (1 x vocab) with transformers' bad-words bans over ``output`` (vLLM's meaning)."""
    in_words = {t for w in words for t in w}
    lead = next(t for t in range(len(in_words) + 1) if t not in in_words)
    return NoBadWordsLogitsProcessor(words, eos_token_id=None)(torch.tensor([[lead] + list(output)]), scores)


def logit_bias_reference(bias: dict[int, float], input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` with a per-token bias, through SequenceBiasLogitsProcessor where it accepts the id."""
    rest = {t: v for t, v in bias.items() if t != 0}
    if rest:
        scores = SequenceBiasLogitsProcessor([[[t], v] for t, v in rest.items()])(input_ids, scores)
    if 0 in bias:
        scores = scores.clone()
        scores[:, 0] += bias[0]
    return scores
