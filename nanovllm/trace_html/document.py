"""The trace document: a run's StepEvents, the engine's settings and each request's summary,
as one JSON-ready dict. The HTML viewer embeds it; tests compare the page against it.

Times are seconds from the first step's start. ``block_size`` lets a reader turn a prefix-cache
hit (``num_cached_tokens``) into hit blocks: the first ``num_cached_tokens // block_size``
entries of that step's block table.
"""

from __future__ import annotations

import dataclasses
import datetime

from nanovllm.engine.trace import StepEvent, summarize_requests

FORMAT = "nanovllm-trace/1"
_CONFIG_FIELDS = (
    "device",
    "dtype",
    "block_size",
    "num_kvcache_blocks",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_model_len",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "async_scheduling",
)


def trace_document(
    events: list[StepEvent], engine=None, outputs=None, title: str = "nanovllm trace", command: str | None = None
) -> dict:
    """``engine``: the LLMEngine that ran (its settings and block size); ``outputs``: the run's
    RequestOutputs (prompt and output lengths, text)."""
    if not events:
        raise ValueError("trace_document needs at least one StepEvent (was the engine built with trace=True?)")
    t0 = events[0].t_start
    steps = []
    for ev in events:
        d = ev.to_dict()
        d["t_start"] = d["t_start"] - t0
        d["t_end"] = None if ev.t_end is None else ev.t_end - t0
        steps.append(d)
    config = {}
    if engine is not None:
        config = {f: getattr(engine.config, f) for f in _CONFIG_FIELDS}
        config["num_kvcache_blocks"] = engine.block_manager.num_blocks
        config["model"] = engine.config.model or "default (SmolLM2-135M-Instruct)"
    by_id = {o.request_id: o for o in (outputs or [])}
    requests = []
    for rid, s in summarize_requests(events).items():
        r = {k: (v - t0 if k.startswith("t_") and v is not None else v) for k, v in dataclasses.asdict(s).items()}
        out = by_id.get(rid)
        if out is not None:
            r.update(
                num_prompt_tokens=len(out.prompt_token_ids),
                num_output_tokens=len(out.outputs[0].token_ids),
                text=out.outputs[0].text,
            )
        else:
            first = next(x for ev in events for x in ev.seqs if x.request_id == rid)
            r.update(num_prompt_tokens=None, num_output_tokens=None, text=None, num_tokens_first_seen=first.num_tokens)
        requests.append(r)
    return {
        "format": FORMAT,
        "title": title,
        "command": command,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "block_size": config.get("block_size"),
        "config": config,
        "steps": steps,
        "requests": requests,
    }
