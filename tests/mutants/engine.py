"""Engine-level injected bugs in nanovllm: model input, attention, sampler, output processing,
API, tensor parallelism and CUDA graphs. Each function returns a context manager that
monkeypatches nanovllm in this process and restores it on exit. The registry, with the checks
expected to catch each one, is in ``tests/mutants/runner.py``.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager as ContextManager

from tests.mutants.core import _edit, _edited, _patched  # noqa: F401  (_patched re-exported for mutants.py)


def _modules(*names: str) -> list:
    import importlib

    return [importlib.import_module(n) for n in names]


# --------------------------------------------------------------- model input
def slot_mapping_off_by_one() -> ContextManager:
    """Each token's K/V goes to the next slot of its block (p % bs + 1): attention reads shifted K/V."""
    mi_mod, engine_mod = _modules("nanovllm.core.model_input", "nanovllm.engine.engine")
    orig = mi_mod.build_model_input

    def build_model_input(out, block_size, finished_seq_ids=None):
        mi, plan = orig(out, block_size, finished_seq_ids)
        mi.slot_mapping = [s - s % block_size + (s % block_size + 1) % block_size for s in mi.slot_mapping]
        return mi, plan

    return _patched(
        (mi_mod, "build_model_input", build_model_input), (engine_mod, "build_model_input", build_model_input)
    )


def min_tokens_ignored() -> ContextManager:
    """Stop tokens are not banned before min_tokens: a stop token can be generated early."""
    mi_mod, engine_mod = _modules("nanovllm.core.model_input", "nanovllm.engine.engine")
    orig = mi_mod.build_model_input

    def build_model_input(out, block_size, finished_seq_ids=None):
        mi, plan = orig(out, block_size, finished_seq_ids)
        mi.banned_token_ids = [[] for _ in mi.banned_token_ids]
        return mi, plan

    return _patched(
        (mi_mod, "build_model_input", build_model_input), (engine_mod, "build_model_input", build_model_input)
    )


# ----------------------------------------------------------------- attention
def decode_drops_last_key() -> ContextManager:
    """Decode attention on the CPU masks the newest key (seq_len - 1): the token never sees itself.
    Both CPU paths: the compiled kernel (float32, taken where it builds) and the PyTorch one."""
    torch_ref, cpu_kernels = _modules("nanovllm.attention.torch_ref", "nanovllm.cpu_kernels")
    orig = torch_ref.paged_decode_batched
    orig_kernel = cpu_kernels.paged_attention

    def paged_decode_batched(q, k_cache, v_cache, meta, scale, *args, **kwargs):
        lens = (meta.seq_lens - 1).clamp(min=1)
        meta = dataclasses.replace(meta, seq_lens=lens, seq_lens_cpu=[max(1, s - 1) for s in meta.seq_lens_cpu])
        return orig(q, k_cache, v_cache, meta, scale, *args, **kwargs)

    def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, rows=None):
        if rows is None:  # decode rows: one per sequence, seeing all its slots
            seq_lens = (seq_lens - 1).clamp(min=1)
        return orig_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, rows)

    return _patched(
        (torch_ref, "paged_decode_batched", paged_decode_batched), (cpu_kernels, "paged_attention", paged_attention)
    )


def fused_decode_attention_unscaled() -> ContextManager:
    """The CPU's fused decode layers (one C call per step) give the attention a scale of 1 instead of
    head_dim ** -0.5: decode steps attend too sharply; the Python layers and prefill are right."""
    (cpu_decode,) = _modules("nanovllm.models.cpu_decode")
    orig = cpu_decode.build

    def build(model):
        fused = orig(model)
        if fused is not None:
            fused.model.scale = 1.0
        return fused

    return _patched((cpu_decode, "build", build))


def prefill_mask_top_left() -> ContextManager:
    """The causal mask of a prefill chunk is aligned top-left: after cached or earlier-chunk tokens a
    query sees only as many keys as its index in the chunk (right only when nothing is cached).
    Both CPU paths: the compiled kernel's rows and the PyTorch per-sequence loop."""
    import torch

    torch_ref, cpu_kernels = _modules("nanovllm.attention.torch_ref", "nanovllm.cpu_kernels")
    orig = torch_ref.attention_one_seq
    orig_kernel = cpu_kernels.paged_attention

    def attention_one_seq(q, k, v, scale):
        n_q, n_k = q.shape[0], k.shape[0]
        if n_q == 1 or n_q == n_k:
            return orig(q, k, v, scale)
        out = torch.empty_like(q)
        for j in range(n_q):  # query j sees keys 0..j only (should be 0..n_k - n_q + j)
            out[j : j + 1] = orig(q[j : j + 1], k[: j + 1], v[: j + 1], scale)
        return out

    def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, rows=None):
        if rows is not None:
            row_seq, row_len = rows
            n_q = torch.bincount(row_seq.long(), minlength=len(seq_lens))
            top_left = []
            for i, seq in enumerate(row_seq.tolist()):
                first = i == 0 or row_seq[i - 1] != seq
                top_left.append(1 if first else top_left[-1] + 1)
            # a one-row chunk (decode) sees its whole sequence, as in the PyTorch mutant
            top_left = [
                row_len[i].item() if n_q[s] == 1 else t for i, (s, t) in enumerate(zip(row_seq.tolist(), top_left))
            ]
            rows = (row_seq, torch.tensor(top_left, dtype=torch.int32))
        return orig_kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, rows)

    return _patched(
        (torch_ref, "attention_one_seq", attention_one_seq), (cpu_kernels, "paged_attention", paged_attention)
    )


# ------------------------------------------------------- CPU linear layers (rows kernel)
def rows_linear_bias_dropped() -> ContextManager:
    """The rows linear kernel leaves out the bias (Qwen2's q/k/v projections have one). The packing check
    (``_kernel_keeps_its_order``, against the scalar reference, which adds the bias) then sends biased
    weights back to oneDNN, so only the kernel's own tests see it."""
    cpu_kernels = _modules("nanovllm.cpu_kernels")[0]
    orig = cpu_kernels.rows_linear

    def rows_linear(x, strips, n, bias, segment):
        return orig(x, strips, n, None, segment)

    return _patched((cpu_kernels, "rows_linear", rows_linear))


def lone_row_summed_otherwise() -> ContextManager:
    """A lone row's products summed in other K pieces than a batch's rows (512-element pieces where K >
    1,024: oneDNN's order for one row, the bug found at 2026-12-05), and the packing check that would
    send such weights back to oneDNN (the scalar reference sums a lone row like any other) trusting
    the kernel: a batch-1 decode step's logprobs leave the same request's in a batch, while its tokens
    mostly stay."""
    cpu_kernels, cpu_linear = _modules("nanovllm.cpu_kernels", "nanovllm.layers.cpu_linear")
    orig = cpu_kernels.rows_linear

    def rows_linear(x, strips, n, bias, segment):
        lone = x.shape[0] == 1 and x.shape[-1] > 1024
        return orig(x, strips, n, bias, 512 if lone else segment)

    def _kernel_keeps_its_order(weight, bias, form="f32"):
        return True

    return _patched(
        (cpu_kernels, "rows_linear", rows_linear), (cpu_linear, "_kernel_keeps_its_order", _kernel_keeps_its_order)
    )


def rows_order_unchecked() -> ContextManager:
    """The rows kernel sums each output as one chain over K, not in the segments measured for oneDNN on
    the development machine: the packing check passes (the scalar reference follows ``segment`` too),
    every float32 weight takes the kernel, still batch-invariant, but its bits leave oneDNN's (the
    fallback's, and the path's before the kernel) for K > 512 where oneDNN sums in that order."""
    cpu_linear = _modules("nanovllm.layers.cpu_linear")[0]

    def segment(k):
        return k

    return _patched((cpu_linear, "segment", segment))


def quant_check_asks_float32() -> ContextManager:
    """The packing check asks the float32 strips' product whatever form the weight is kept in: a block
    format's kernel (rows_quant.c) goes unchecked, and a fault in it would reach the engine."""
    cpu_linear = _modules("nanovllm.layers.cpu_linear")[0]
    check = cpu_linear._kernel_keeps_its_order

    def _kernel_keeps_its_order(weight, bias, form="f32"):
        return check(weight, bias, "f32")

    return _patched((cpu_linear, "_kernel_keeps_its_order", _kernel_keeps_its_order))


def quant_segment_ignored() -> ContextManager:
    """A block-format weight's product sums each output as one chain over K, not restarting every
    ``segment``: the float32 strips' bits are lost for K > 512 (the packing check, which follows the
    segment, then sends such weights to float32 strips: the default model loses its Q4_1 layers)."""
    import torch

    cpu_kernels = _modules("nanovllm.cpu_kernels")[0]
    orig = cpu_kernels.rows_linear

    def rows_linear(x, strips, n, bias, segment):
        return orig(x, strips, n, bias, x.shape[-1] if strips.dtype == torch.uint8 else segment)

    return _patched((cpu_kernels, "rows_linear", rows_linear))


# ------------------------------------------------------------------- sampler
def top_p_one_too_few() -> ContextManager:
    """top_p drops the token that crosses the threshold (inclusive cumulative mass)."""
    import torch

    (sampler,) = _modules("nanovllm.layers.sampler")

    def apply_top_k_top_p(logits, top_k, top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        k = torch.where(top_k > 0, top_k, logits.shape[-1]).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        mass = probs.cumsum(dim=-1)  # the bug: should be the mass *before* each token
        drop = (mass >= top_p.unsqueeze(1)) & (ranks > 0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)

    return _patched((sampler, "apply_top_k_top_p", apply_top_k_top_p))


def top_k_one_too_many() -> ContextManager:
    """top_k keeps k + 1 tokens."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    orig = sampler.apply_top_k_top_p

    def apply_top_k_top_p(logits, top_k, top_p):
        return orig(logits, top_k + (top_k > 0).to(top_k.dtype), top_p)

    return _patched((sampler, "apply_top_k_top_p", apply_top_k_top_p))


def min_p_absolute() -> ContextManager:
    """min_p is applied as an absolute probability, not relative to the most likely token."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    import torch

    def apply_min_p(logits, min_p):
        probs = torch.softmax(logits, dim=-1)
        return logits.masked_fill(probs < min_p.unsqueeze(1), float("-inf"))

    return _patched((sampler, "apply_min_p", apply_min_p))


def temperature_ignored() -> ContextManager:
    """Random rows sample at temperature 1 whatever was asked."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    orig = sampler.Sampler._sample

    def _sample(self, logits, meta, rows):
        meta = dataclasses.replace(meta, temperatures=[1.0 if t >= 1e-5 else t for t in meta.temperatures])
        return orig(self, logits, meta, rows)

    return _patched((sampler.Sampler, "_sample", _sample))


def logprobs_after_temperature() -> ContextManager:
    """Returned logprobs are those of the temperature-scaled distribution, not the raw model's."""
    import torch

    (sampler,) = _modules("nanovllm.layers.sampler")
    orig = sampler.Sampler.__call__

    def __call__(self, logits, meta):
        out = orig(self, logits, meta)
        for row, entry in enumerate(out.logprobs):
            t = meta.temperatures[row]
            if entry is None or t < 1e-5:
                continue
            lp = torch.log_softmax(logits[row].float() / t, dim=-1)
            tok = out.token_ids[row]
            k = len(entry[2])
            vals, ids = lp.topk(max(k, 1))
            top = list(zip(ids[:k].tolist(), vals[:k].tolist())) if k else []
            out.logprobs[row] = (float(lp[tok]), int((lp > lp[tok]).sum()) + 1, top)
        return out

    return _patched((sampler.Sampler, "__call__", __call__))


def seed_ignored() -> ContextManager:
    """Seeded requests draw from the engine's shared generator: not reproducible, batch-dependent."""
    (runner,) = _modules("nanovllm.worker.model_runner")
    orig = runner.ModelRunner._sampling_metadata

    def _sampling_metadata(self, mi):
        meta = orig(self, mi)
        meta.generators = [None] * len(meta.generators)
        return meta

    return _patched((runner.ModelRunner, "_sampling_metadata", _sampling_metadata))


def prompt_logprobs_shifted() -> ContextManager:
    """Prompt logprobs are reported one position late (each position gets its successor's)."""
    (runner,) = _modules("nanovllm.worker.model_runner")
    orig = runner.ModelRunner._prompt_logprobs

    def _prompt_logprobs(self, hidden, mi):
        results = orig(self, hidden, mi)
        return [rows[1:] + rows[-1:] for rows in results]

    return _patched((runner.ModelRunner, "_prompt_logprobs", _prompt_logprobs))


# ------------------------------------------------------- logits processing, n > 1
def repetition_penalty_ignores_prompt() -> ContextManager:
    """The repetition penalty applies to the output's tokens only (vLLM: prompt and output)."""
    (lp,) = _modules("nanovllm.layers.logits_processing")
    orig = lp.apply_penalties

    def apply_penalties(x, rows):
        return orig(x, [(i, dataclasses.replace(p, prompt_token_ids=[])) for i, p in rows])

    return _patched((lp, "apply_penalties", apply_penalties))


def presence_penalty_per_occurrence() -> ContextManager:
    """presence_penalty is subtracted once per occurrence (like frequency_penalty), not once."""
    (lp,) = _modules("nanovllm.layers.logits_processing")
    orig = lp.apply_penalties

    def apply_penalties(x, rows):
        return orig(
            x,
            [
                (
                    i,
                    dataclasses.replace(
                        p, frequency_penalty=p.frequency_penalty + p.presence_penalty, presence_penalty=0.0
                    ),
                )
                for i, p in rows
            ],
        )

    return _patched((lp, "apply_penalties", apply_penalties))


def frequency_penalty_counts_prompt() -> ContextManager:
    """The frequency and presence penalties count the prompt's tokens too (output only, in vLLM)."""
    (lp,) = _modules("nanovllm.layers.logits_processing")
    orig = lp.apply_penalties

    def apply_penalties(x, rows):
        return orig(
            x,
            [
                (i, dataclasses.replace(p, output_token_ids=(p.prompt_token_ids or []) + p.output_token_ids))
                for i, p in rows
            ],
        )

    return _patched((lp, "apply_penalties", apply_penalties))


def logit_bias_subtracted() -> ContextManager:
    """logit_bias is subtracted from the logits instead of added."""
    (lp,) = _modules("nanovllm.layers.logits_processing")
    orig = lp.apply_logit_bias

    def apply_logit_bias(x, rows):
        return orig(x, [(i, {t: -v for t, v in bias.items()}) for i, bias in rows])

    return _patched((lp, "apply_logit_bias", apply_logit_bias))


def allowed_token_ids_last_dropped() -> ContextManager:
    """The last id of allowed_token_ids is masked like the disallowed ones."""
    (lp,) = _modules("nanovllm.layers.logits_processing")
    orig = lp.apply_allowed_token_ids

    def apply_allowed_token_ids(x, rows):
        return orig(x, [(i, ids[:-1] or ids) for i, ids in rows])

    return _patched((lp, "apply_allowed_token_ids", apply_allowed_token_ids))


def bad_words_prefix_ignored() -> ContextManager:
    """A bad word's last token is banned whatever precedes it (vLLM: only after its prefix)."""
    bw, mi_mod = _modules("nanovllm.core.bad_words", "nanovllm.core.model_input")

    def banned_by_bad_words(bad_words, output_ids):
        return [w[-1] for w in bad_words if len(w) - 1 <= len(output_ids)]

    return _patched(
        (bw, "banned_by_bad_words", banned_by_bad_words), (mi_mod, "banned_by_bad_words", banned_by_bad_words)
    )


def n_children_share_seed() -> ContextManager:
    """The n children of a seeded request all draw with the request's seed (vLLM: seed + i)."""
    (ps,) = _modules("nanovllm.engine.parallel_sampling")

    def child_params(self, index):
        return dataclasses.replace(self.params, n=1)

    return _patched((ps.ParentRequest, "child_params", child_params))


def fused_sampler_skips_processing() -> ContextManager:
    """The fused sampler keeps rows with logits processing (it applies temperature only)."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    orig = sampler.general_path_rows

    def general_path_rows(meta):
        return orig(dataclasses.replace(meta, processing={}))

    return _patched((sampler, "general_path_rows", general_path_rows))


# ------------------------------------------------------- output processing, API
def stop_string_kept() -> ContextManager:
    """The stop string is left in the output text although include_stop_str_in_output is False."""
    stop_mod, engine_mod = _modules("nanovllm.core.stop", "nanovllm.engine.engine")
    orig = stop_mod.check_stop

    def check_stop(seq, tokenizer, max_model_len):
        saved = seq.params.include_stop_str_in_output
        seq.params.include_stop_str_in_output = True
        try:
            orig(seq, tokenizer, max_model_len)
        finally:
            seq.params.include_stop_str_in_output = saved

    return _patched((stop_mod, "check_stop", check_stop), (engine_mod, "check_stop", check_stop))


def mirror_ignores_stop_text() -> ContextManager:
    """The front end of an engine-core process drops the text the core cut at a stop string: its
    mirror decodes every token, so the stop string shows in the output."""
    mod, wire = _modules("nanovllm.engine.async_llm_process", "nanovllm.engine.core_output")
    orig = mod.apply_update

    def apply_update(seq, update):
        orig(seq, wire.SequenceUpdate(*update)._replace(output_text=None))

    return _patched((mod, "apply_update", apply_update))


def merge_pairs_by_position() -> ContextManager:
    """A slow consumer's outputs are merged completion by position, not by index: an n > 1
    request's child 1 tokens are glued onto child 0 (and CUMULATIVE loses child 0)."""
    (outputs_mod,) = _modules("nanovllm.outputs")

    def add(self, later, delta):
        if not delta:
            return later
        for mine, new in zip(self.outputs, later.outputs):
            mine.text += new.text
            mine.token_ids = mine.token_ids + new.token_ids
            if mine.logprobs is not None and new.logprobs is not None:
                mine.logprobs = mine.logprobs + new.logprobs
            mine.finish_reason, mine.stop_reason = new.finish_reason, new.stop_reason
        self.finished = later.finished
        return self

    return _patched((outputs_mod.RequestOutput, "add", add))


def eos_ignored() -> ContextManager:
    """The model's EOS ids never stop a request (only explicit stop_token_ids do)."""
    (engine_mod,) = _modules("nanovllm.engine.engine")
    orig = engine_mod.LLMEngine.make_sequence

    def make_sequence(self, request_id, prompt, params, *args, **kwargs):
        seq = orig(self, request_id, prompt, params, *args, **kwargs)
        seq.stop_token_ids = frozenset(seq.params.stop_token_ids)
        return seq

    return _patched((engine_mod.LLMEngine, "make_sequence", make_sequence))


def outputs_in_finish_order() -> ContextManager:
    """LLM.generate returns the shortest outputs first (finish order), not input order."""
    (llm_mod,) = _modules("nanovllm.llm")
    orig = llm_mod.LLM.generate

    def generate(self, *args, **kwargs):
        return sorted(orig(self, *args, **kwargs), key=lambda o: len(o.outputs[0].token_ids))

    return _patched((llm_mod.LLM, "generate", generate))


def admission_check_skipped() -> ContextManager:
    """Requests that can never fit are accepted (no admission control)."""
    (sched,) = _modules("nanovllm.core.scheduler")
    return _patched((sched.Scheduler, "check_admissible", lambda self, seq: None))


# ------------------------------------------------------- tensor parallel, GPU
def tp_allreduce_skipped() -> ContextManager:
    """Row-parallel layers and the vocabulary-parallel embedding skip their all-reduce (each rank
    keeps its partial sum). Patched inside the TP worker processes (see _worker_main)."""
    linear, embedding = _modules("nanovllm.layers.linear", "nanovllm.layers.embedding")
    return _patched((linear, "all_reduce", lambda x: x), (embedding, "all_reduce", lambda x: x))


def cuda_graph_padding_writes_kv() -> ContextManager:
    """Decode-graph padding rows get slot 0 instead of -1: replaying a padded batch overwrites the
    K/V of whichever sequence owns slot 0 (GPU only). Patched where every staged step is written
    (StepInputs._write), after the host->device copy, on the same stream."""
    import torch

    (si,) = _modules("nanovllm.worker.step_inputs")
    orig = si.StepInputs._write

    def _write(self, mi, pad_to):
        out = orig(self, mi, pad_to)
        n = len(mi.slot_mapping)
        if pad_to is not None and pad_to > n:
            self._dev(out[0], "slot_mapping", torch.int64)[n:pad_to].fill_(0)
        return out

    return _patched((si.StepInputs, "_write", _write))


def async_input_from_wrong_row() -> ContextManager:
    """Async scheduling: a placeholder row reads the token another row of the previous step sampled."""
    (runner,) = _modules("nanovllm.worker.model_runner")
    orig = runner.ModelRunner._fill_pending

    def _fill_pending(self, input_ids, mi):
        saved = self.prev_tokens
        self.prev_tokens = saved.roll(1)
        try:
            orig(self, input_ids, mi)
        finally:
            self.prev_tokens = saved

    return _patched((runner.ModelRunner, "_fill_pending", _fill_pending))


def tp_ranks_sample_apart() -> ContextManager:
    """Async scheduling with tensor parallelism: rank 0's sampled tokens are not broadcast; every
    other rank samples its own from the (all-gathered) logits, its generators seeded with
    seed + rank, and fills its placeholder rows with them. Patched inside the TP workers."""
    import torch

    (runner,) = _modules("nanovllm.worker.model_runner")

    def _share_sampled(self, pending, logits, mi):
        if pending is not None:
            return pending.tokens
        meta = self._sampling_metadata(mi)
        meta.generators = [
            None if s is None else torch.Generator(device=logits.device).manual_seed(s + self.rank) for s in mi.seeds
        ]
        if meta.row_seeds is not None:  # CUDA: Philox keys instead of generators
            meta.row_seeds = [s + self.rank for s in meta.row_seeds]
        gen = torch.Generator(device=logits.device).manual_seed(self.config.seed + self.rank)
        return runner.Sampler(gen).launch(logits, meta).tokens

    return _patched((runner.ModelRunner, "_share_sampled", _share_sampled))


def tp_result_ignores_ticket() -> ContextManager:
    """Async scheduling with tensor parallelism: a worker answers result() with its oldest queued
    step whatever ticket was asked for, so after a step abandoned by an interrupted engine every
    later result is one step behind. Patched inside the TP workers."""
    (dist_mod,) = _modules("nanovllm.worker.distributed")

    def _take_result(launched, ticket):
        return launched.popleft()[1].result()

    return _patched((dist_mod, "_take_result", _take_result))


# ------------------------------------------------- the CUDA engine's own paths (GPU only)
def fused_sampler_temperature_ignored() -> ContextManager:
    """The fused GPU sampler draws every random row at temperature 1."""
    (fused,) = _modules("nanovllm.layers.fused_sampler")
    orig = fused.sample

    def sample(logits, inv_temp, seeds, *args, **kwargs):
        return orig(logits, (inv_temp > 0).to(inv_temp.dtype), seeds, *args, **kwargs)

    return _patched((fused, "sample", sample))


def philox_seed_ignored() -> ContextManager:
    """On the GPU a seeded request's Philox key comes from the step counter, as if unseeded:
    not reproducible, batch-dependent."""
    (runner,) = _modules("nanovllm.worker.model_runner")
    orig = runner.ModelRunner._philox_sampling_metadata

    def _philox_sampling_metadata(self, mi):
        mi = dataclasses.replace(mi, seeds=[None] * len(mi.seeds))
        return orig(self, mi)

    return _patched((runner.ModelRunner, "_philox_sampling_metadata", _philox_sampling_metadata))


def triton_decode_drops_last_key() -> ContextManager:
    """The Triton decode kernel is given seq_len - 1: the newest key is never attended to."""
    (triton_ops,) = _modules("nanovllm.attention.triton_ops")
    orig = triton_ops.paged_decode

    def paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, *args, **kw):
        return orig(q, k_cache, v_cache, block_tables, (seq_lens - 1).clamp(min=0), scale, *args, **kw)

    return _patched((triton_ops, "paged_decode", paged_decode))


def fused_qk_norm_k_takes_q_weight() -> ContextManager:
    """Qwen3's fused q/k norm + RoPE kernel normalizes k with q_norm's weight (and eps)."""
    (fused,) = _modules("nanovllm.layers.fused_ops")
    orig = fused.qk_norm_rope

    def qk_norm_rope(positions, qkv, num_q_heads, num_kv_heads, q_norm, k_norm, *args, **kw):
        return orig(positions, qkv, num_q_heads, num_kv_heads, q_norm, q_norm, *args, **kw)

    return _patched((fused, "qk_norm_rope", qk_norm_rope))


# ------------------------------------------------------------------- FP8 KV cache
def fp8_load_ignores_scale() -> ContextManager:
    """The PyTorch path reads an FP8 cache back without its scale (stored x / scale, read x / scale)."""
    (torch_ref,) = _modules("nanovllm.attention.torch_ref")
    orig = torch_ref._load
    return _patched((torch_ref, "_load", lambda t, cache_dtype, scale: orig(t, cache_dtype, 1.0)))


def triton_fp8_v_scale_ignored() -> ContextManager:
    """The Triton decode kernel is not given the layer's V scale on an FP8 cache."""
    (triton_ops,) = _modules("nanovllm.attention.triton_ops")
    orig = triton_ops.paged_decode

    def paged_decode(*args, **kw):
        kw["v_scale"] = 1.0
        return orig(*args, **kw)

    return _patched((triton_ops, "paged_decode", paged_decode))


# ------------------------------------------------ per-request fields under preemption (class 3)
def prompt_logprobs_reappended_on_recompute() -> ContextManager:
    """The bug of issue 10: a recompute after a preemption scores every prompt row of its chunks
    again and the engine appends them to the prompt logprobs already recorded (tokens unaffected)."""
    mi_mod, engine_mod = _modules("nanovllm.core.model_input", "nanovllm.engine.engine")
    orig = mi_mod.build_model_input

    def build_model_input(out, block_size, finished_seq_ids=None):
        mi, plan = orig(out, block_size, finished_seq_ids)
        mi.prompt_logprob_jobs, plan.prompt_logprob_jobs = [], []
        for j, (seq, start, num_new) in enumerate(zip(out.seqs, plan.starts, out.num_new_tokens)):
            last = min(start + num_new, seq.num_prompt_tokens - 1)
            if seq.params.prompt_logprobs is not None and start < last:  # the old rule: from start
                mi.prompt_logprob_jobs.append(
                    (mi.query_start_loc[j], seq.token_ids[start + 1 : last + 1], seq.params.prompt_logprobs)
                )
                plan.prompt_logprob_jobs.append((seq, seq.num_prompt_logprobs_recorded))  # appended as new
        return mi, plan

    return _patched(
        (mi_mod, "build_model_input", build_model_input), (engine_mod, "build_model_input", build_model_input)
    )


def output_logprobs_cleared_on_preemption() -> ContextManager:
    """Preemption clears the logprobs recorded so far (as if the recompute recorded them again)."""
    (sched,) = _modules("nanovllm.core.scheduler")
    return _edit(
        sched.Scheduler,
        "_preempt",
        (
            "seq.num_computed_tokens = 0",
            "seq.num_computed_tokens = 0\n    if seq.output_logprobs is not None:\n        seq.output_logprobs.clear()",
        ),
    )


def cumulative_logprob_reset_on_preemption() -> ContextManager:
    """Preemption resets the request's cumulative logprob (a reset in the wrong place)."""
    (sched,) = _modules("nanovllm.core.scheduler")
    return _edit(
        sched.Scheduler,
        "_preempt",
        ("seq.num_computed_tokens = 0", "seq.num_computed_tokens = 0\n    seq.cumulative_logprob = 0.0"),
    )


def seeded_generator_dropped_on_preemption() -> ContextManager:
    """A preempted request's sampler state is dropped like a finished one's: a seeded request
    re-admitted after a preemption draws its noise from the start of its stream again (CPU)."""
    (engine_mod,) = _modules("nanovllm.engine.engine")
    return _edit(
        engine_mod.LLMEngine,
        "_launch_next",
        ("self._finished_seq_ids = []", "self._finished_seq_ids = [s.seq_id for s in sched.preempted]"),
    )


# -------------------------------------------------------- exact contract boundaries (class 4)
def min_tokens_ban_off_by_one() -> ContextManager:
    """Stop tokens stay banned one token too long: the token at output index min_tokens cannot stop."""
    mi_mod, engine_mod = _modules("nanovllm.core.model_input", "nanovllm.engine.engine")
    new = _edited(
        mi_mod,
        "build_model_input",
        ("seq.num_output_tokens < params.min_tokens", "seq.num_output_tokens <= params.min_tokens"),
    )
    return _patched((mi_mod, "build_model_input", new), (engine_mod, "build_model_input", new))


def stop_string_window_too_narrow() -> ContextManager:
    """Stop strings are searched only in the characters the newest token added: a stop string
    that spans a token boundary is never found."""
    (stop_mod,) = _modules("nanovllm.core.stop")
    return _edit(
        stop_mod,
        "find_stop_string",
        ("max(len(text) - num_new_chars - len(stop) + 1, 0)", "max(len(text) - num_new_chars, 0)"),
    )


def stop_string_counts_at_min_tokens() -> ContextManager:
    """A stop string completed by the min_tokens-th token already stops (vLLM: only past min_tokens)."""
    stop_mod, engine_mod = _modules("nanovllm.core.stop", "nanovllm.engine.engine")
    new = _edited(
        stop_mod, "check_stop", ("if n_out > params.min_tokens else None", "if n_out >= params.min_tokens else None")
    )
    return _patched((stop_mod, "check_stop", new), (engine_mod, "check_stop", new))


def prompt_logprobs_chunk_offset_lost() -> ContextManager:
    """The runner's 512-row chunks of prompt logprobs all read the hidden states of the first chunk."""
    (runner,) = _modules("nanovllm.worker.model_runner")
    return _edit(
        runner.ModelRunner,
        "_prompt_logprobs",
        ("hidden[first_row + s : first_row + s + len(chunk)]", "hidden[first_row : first_row + len(chunk)]"),
    )


def logprobs_zero_treated_as_none() -> ContextManager:
    """logprobs=0 (only the sampled token's logprob) is taken for "no logprobs"."""
    (seq_mod,) = _modules("nanovllm.core.sequence")
    return _edit(
        seq_mod.Sequence, "__init__", ("[] if params.logprobs is not None else None", "[] if params.logprobs else None")
    )


# ----------------------------------------------------- sampling parameter interplay (class 5)
def filters_before_temperature() -> ContextManager:
    """min_p, top_k and top_p are applied to the raw logits, the temperature after them."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    scale = (
        "    if len(set(temps)) == 1:  # one temperature for all: a scalar, no host->device copy\n"
        "        logits = logits / temps[0]\n"
        "    else:\n"
        "        logits = logits / torch.tensor(temps, device=device, dtype=torch.float32).unsqueeze(1)\n"
    )
    return _edit(
        sampler.Sampler,
        "_sample",
        (scale, ""),
        ("    probs = torch.softmax(logits, dim=-1)\n", scale + "    probs = torch.softmax(logits, dim=-1)\n"),
    )


def top_p_mass_before_top_k() -> ContextManager:
    """top_p measures the mass of the distribution before top_k, not of the top_k survivors."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    return _edit(
        sampler,
        "apply_top_k_top_p",
        (
            '    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))\n'
            "    probs = torch.softmax(sorted_logits, dim=-1)\n",
            "    probs = torch.softmax(sorted_logits, dim=-1)\n"
            '    sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))\n',
        ),
    )


def first_row_temperature_for_all() -> ContextManager:
    """The one-temperature fast path is taken for every batch: all random rows get the first
    row's temperature."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    return _edit(sampler.Sampler, "_sample", ("if len(set(temps)) == 1:", "if True:"))


def top_p_by_position() -> ContextManager:
    """The random rows read the top_p of the batch's first rows (greedy ones included), not their own."""
    (sampler,) = _modules("nanovllm.layers.sampler")
    return _edit(
        sampler.Sampler, "_sample", ("top_ps = [meta.top_ps[r] for r in rows]", "top_ps = meta.top_ps[:len(rows)]")
    )


def seeded_generator_not_kept() -> ContextManager:
    """A seeded request's generator is made afresh from its seed at every step (not kept): every
    token of the request reuses the noise of its first one (CPU)."""
    (runner,) = _modules("nanovllm.worker.model_runner")
    return _edit(
        runner.ModelRunner,
        "_sampling_metadata",
        ("gen = self.generators[seq_id] = torch.Generator", "gen = torch.Generator"),
    )


def seed_zero_unseeded() -> ContextManager:
    """seed=0 is taken for "no seed" (a truthiness test): the request is not reproducible (CPU)."""
    (runner,) = _modules("nanovllm.worker.model_runner")
    return _edit(runner.ModelRunner, "_sampling_metadata", ("if seed is None:", "if not seed:"))


# ----------------------------------------------- request options at non-defaults (class 7)
def chat_always_adds_generation_prompt() -> ContextManager:
    """LLM.chat applies the template with add_generation_prompt=True whatever the caller asked."""
    (llm_mod,) = _modules("nanovllm.llm")
    return _edit(
        llm_mod.LLM,
        "chat_prompts",
        ("add_generation_prompt=add_generation_prompt,", "add_generation_prompt=True,"),
    )


def skip_special_tokens_ignored() -> ContextManager:
    """Output text always skips special tokens, whatever skip_special_tokens says."""
    (op,) = _modules("nanovllm.engine.output_processor")
    return _edit(
        op,
        "final_text",
        (
            "decode(tokenizer, seq.output_token_ids, seq.params.skip_special_tokens)",
            "decode(tokenizer, seq.output_token_ids, True)",
        ),
    )


def stop_text_skips_specials() -> ContextManager:
    """The text that stop strings are searched in (and cut from) always skips special tokens."""
    stop_mod, engine_mod = _modules("nanovllm.core.stop", "nanovllm.engine.engine")
    new = _edited(
        stop_mod,
        "check_stop",
        (
            "decode(tokenizer, seq.output_token_ids, params.skip_special_tokens)",
            "decode(tokenizer, seq.output_token_ids, True)",
        ),
    )
    return _patched((stop_mod, "check_stop", new), (engine_mod, "check_stop", new))


def decoded_token_of_sampled() -> ContextManager:
    """Every top-k logprob entry carries the decoded text of the sampled token, not its own."""
    (op,) = _modules("nanovllm.engine.output_processor")
    return _edit(
        op,
        "_logprob_dict",
        ("lp.decoded_token = tokenizer.decode([tok])", "lp.decoded_token = tokenizer.decode([sampled])"),
    )


# ------------------------------------------------------------------ accounting (class 9)
def prompt_tokens_skip_recompute_tail() -> ContextManager:
    """The counting bug fixed with issue 10: a recompute's last chunk that starts past the prompt
    is not counted in prompt_tokens_computed."""
    (engine_mod,) = _modules("nanovllm.engine.engine")
    return _edit(
        engine_mod.LLMEngine,
        "_postprocess",
        (
            "if not (num_new == 1 and id(seq) in sampling and start >= seq.num_prompt_tokens):",
            "if id(seq) not in sampling or start < seq.num_prompt_tokens:",
        ),
    )


def first_scheduled_time_every_admission() -> ContextManager:
    """metrics.first_scheduled_time is set at every admission: a preempted request reports its
    re-admission (after its first tokens) as its first scheduling."""
    (engine_mod,) = _modules("nanovllm.engine.engine")
    return _edit(engine_mod.LLMEngine, "_launch_next", ("if seq.metrics.first_scheduled_time is None:", "if True:"))
