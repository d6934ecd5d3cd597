"""LLM: the offline batch API (vLLM's names): generate(), chat(), stats()."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import sys
import time
from collections.abc import Generator
from collections.abc import Sequence as SequenceOf

from tqdm.auto import tqdm

from nanovllm.engine.engine import LLMEngine
from nanovllm.engine.interrupts import DeferredInterrupts
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# where the bar's stream is not a terminal (a log file, a CI pipe), tqdm still redraws it with a
# carriage return at every refresh: at most one redraw this often there, not ten a second
NON_TTY_BAR_INTERVAL_S = 10.0


def progress_bar(total: int, enabled: bool, file=None) -> tqdm:
    """The "Generating" bar on ``file`` (stderr): a terminal's redraws every 0.1 s (tqdm's
    default), a pipe's or file's every NON_TTY_BAR_INTERVAL_S (its first and last states always)."""
    file = sys.stderr if file is None else file
    try:
        tty = file.isatty() or "ipykernel" in sys.modules  # a notebook: tqdm.auto's widget, redrawn live
    except (AttributeError, ValueError):  # no isatty, a closed stream
        tty = False
    return tqdm(
        total=total,
        desc="Generating",
        unit="req",
        dynamic_ncols=True,
        disable=not enabled,
        file=file,
        mininterval=0.1 if tty else NON_TTY_BAR_INTERVAL_S,
    )


class LLM:
    """Offline inference. ``LLM(model=None, **engine_args)``; model None = the default model.

    Engine arguments are the fields of EngineConfig (device, dtype, block_size,
    num_kvcache_blocks, max_num_seqs, max_num_batched_tokens, max_model_len,
    enable_prefix_caching, enable_chunked_prefill, enforce_eager,
    tensor_parallel_size, gpu_memory_utilization, seed, ...). ``trace=True``
    records a StepEvent per step in ``llm.llm_engine.tracer.events``.
    """

    def __init__(self, model: str | None = None, *, trace=False, load_format: str = "auto", **engine_args):
        self.llm_engine = LLMEngine.from_engine_args(model, load_format=load_format, trace=trace, **engine_args)
        self._request_counter = itertools.count()

    # ---------------------------------------------------------------- helpers
    @staticmethod
    def _as_prompt_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
                return [list(prompts)]  # one prompt given as token ids
            return list(prompts)
        raise TypeError(
            f"prompts must be a str, a list of token ids, a dict or a list of those, got {type(prompts).__name__}"
        )

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def stats(self) -> dict:
        return self.llm_engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing changed) while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    # --------------------------------------------------------------- generate
    def generate(
        self, prompts, sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None, use_tqdm: bool = True
    ) -> list[RequestOutput]:
        """Generate for every prompt; the outputs come back in input order.

        Only final outputs are wanted here, so every request runs with ``output_kind``
        FINAL_ONLY (as in vLLM): no per-step detokenization. The caller's SamplingParams are
        not changed."""
        prompts = self._as_prompt_list(prompts)
        results: list[RequestOutput | None] = [None] * len(prompts)
        for i, out in self.generate_iter(prompts, sampling_params, use_tqdm):
            results[i] = out
        return results  # type: ignore[return-value]

    def generate_iter(
        self, prompts, sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None, use_tqdm: bool = True
    ) -> Generator[tuple[int, RequestOutput], None, None]:
        """Like generate(), but yields ``(input index, RequestOutput)`` as each request finishes.

        Every request is validated and queued before this returns (a bad one raises here and
        queues nothing). When the iteration ends early -- the caller stops (``close()``) or an
        exception such as KeyboardInterrupt interrupts a step -- the unfinished requests are
        aborted and the engine is left clean for the next call.
        """
        prompts = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (SamplingParams, dict)):  # a dict is refused by name below
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"sampling_params has {len(params_list)} entries but there are {len(prompts)} prompts")
        final_only: dict[int, SamplingParams] = {}
        for i, params in enumerate(params_list):
            if isinstance(params, SamplingParams) and params.output_kind is not RequestOutputKind.FINAL_ONLY:
                if id(params) not in final_only:
                    final_only[id(params)] = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                params_list[i] = final_only[id(params)]
        engine = self.llm_engine
        # validate everything first, so a bad request leaves the engine untouched
        order: dict[str, int] = {}
        groups = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            request_id = str(next(self._request_counter))
            try:
                groups.append(engine.make_sequences(request_id, prompt, params))
            except (ValueError, TypeError) as e:
                raise type(e)(f"prompt {i}: {e}") from None
            order[request_id] = i
        for group in groups:
            for seq in group:
                engine.add_sequence(seq)
        return self._run(order, use_tqdm)

    def _run(self, order: dict[str, int], use_tqdm: bool) -> Generator[tuple[int, RequestOutput], None, None]:
        engine = self.llm_engine
        left = set(order)
        bar = progress_bar(len(order), use_tqdm)
        start = time.perf_counter()
        interrupts = DeferredInterrupts()  # Ctrl-C lands between steps, never inside one
        try:
            with interrupts:  # held while steps run; released while the caller has an output
                while left and engine.has_unfinished_requests():
                    outputs = engine.step()
                    interrupts.raise_pending()
                    done = [out for out in outputs if out.finished and out.request_id in left]
                    if done:
                        with interrupts.released():
                            for out in done:
                                left.discard(out.request_id)
                                bar.update(1)
                                yield order[out.request_id], out
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(
                        f"out {engine.num_generation_tokens / max(elapsed, 1e-9):.1f} tok/s", refresh=False
                    )
                engine.drain()  # async scheduling: no step left in flight between calls
                interrupts.raise_pending()
        except BaseException:  # an error, Ctrl-C, or the caller closing the iterator
            for request_id in left:  # leave the engine clean for the next call
                engine.abort_request(request_id)
            try:
                with interrupts:  # a second Ctrl-C does not cut the clean-up's step (unless it hangs)
                    engine.drain()
            except Exception:  # noqa: BLE001 - the original error is the one to raise
                logger.exception("the step in flight failed while cleaning up after an error")
            raise
        finally:
            bar.close()

    def chat_prompts(
        self,
        messages,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[dict]:
        """The prompts chat() generates from: the tokenizer's chat template applied to one
        conversation (a list of {"role", "content"} dicts) or to each of a list of them.
        ``continue_final_message``: the last message's turn is left open (the model goes on with it).
        ``chat_template``: a template's text used instead of the model's own."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat() needs a tokenizer; this model has none")
        if chat_template is None and getattr(tok, "chat_template", None) is None:
            raise ValueError("chat() needs a chat template; this model has none (pass chat_template=TEXT)")
        if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
            raise ValueError(f"chat_template must be a template's text (a non-empty str), got {chat_template!r}")
        if continue_final_message and add_generation_prompt:
            raise ValueError(
                "continue_final_message=True and add_generation_prompt=True: the last message is either "
                "continued or answered (pass add_generation_prompt=False)"
            )
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts or a list of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = []
        for conv in conversations:
            for m in conv:
                if not isinstance(m, dict) or "role" not in m or "content" not in m:
                    raise ValueError(f"each message must be a dict with 'role' and 'content', got {m!r}")
            ids = tok.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
                **{
                    **({"continue_final_message": True} if continue_final_message else {}),
                    **({"chat_template": chat_template} if chat_template is not None else {}),
                    **(chat_template_kwargs or {}),
                },
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids), "prompt": tok.decode(ids, skip_special_tokens=False)})
        return prompts

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | SequenceOf[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        continue_final_message: bool = False,
        chat_template: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (a list of
        {"role", "content"} dicts) or a list of conversations, then generate.
        ``continue_final_message``: the model goes on with the last message (with
        ``add_generation_prompt=False``), e.g. an assistant message's start.
        ``chat_template``: a template's text used instead of the model's own (vLLM's argument)."""
        prompts = self.chat_prompts(
            messages, add_generation_prompt, chat_template_kwargs, continue_final_message, chat_template
        )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # -------------------------------------------------------------- lifetime
    def close(self) -> None:
        self.llm_engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
