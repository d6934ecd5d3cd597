"""Helpers for the fast core tests: torch-free, no engine, no model (each file runs in well under a
second, so mutmut can run this folder once per mutant: ``make mutation``)."""

from __future__ import annotations

from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

# an invariant's message, whole, as the first line of the AssertionError: pytest rewrites the
# asserts of nanovllm's modules where nanovllm is installed (it ships a pytest plugin), and adds
# the compared values on the lines below
FIRST_LINE = r"^{}(\n|$)"

_next_id = iter(range(10**9))


def make_seq(tokens, request_id: str | None = None, eos=(), bad_words=None, **params) -> Sequence:
    """A Sequence over ``tokens`` with SamplingParams(**params) (max_tokens 16 unless given)."""
    seq_id = next(_next_id)
    return Sequence(
        seq_id,
        request_id or f"r{seq_id}",
        list(tokens),
        SamplingParams(**params),
        eos_token_ids=tuple(eos),
        bad_words_token_ids=bad_words,
    )


class CharTokenizer:
    """Token t < 100 decodes to chr(ord('a') + t % 26); t >= 100 is a special token ``<t>``,
    left out with skip_special_tokens. ``encode`` is the inverse over a-z and a leading-space
    token 27 (so " w" starts with a different token than "w")."""

    def decode(self, ids, skip_special_tokens=True):
        parts = []
        for t in ids:
            if t >= 100:
                if not skip_special_tokens:
                    parts.append(f"<{t}>")
            elif t == 27:
                parts.append(" ")
            else:
                parts.append(chr(ord("a") + t % 26))
        return "".join(parts)

    BOS = 200

    def encode(self, text, add_special_tokens=True):
        """Like a Hugging Face tokenizer: adds BOS unless add_special_tokens=False, and takes only
        a bool there (the Rust ``tokenizers`` binding raises TypeError for None)."""
        if not isinstance(add_special_tokens, bool):
            raise TypeError(f"'{add_special_tokens!r}' is not an instance of 'bool'")
        ids = [27 if c == " " else ord(c) - ord("a") for c in text]
        return ([self.BOS] + ids) if add_special_tokens else ids


def bm_check(bm: BlockManager, *seqs: Sequence) -> None:
    bm.check_invariants(list(seqs))
