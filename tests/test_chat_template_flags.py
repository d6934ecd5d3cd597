"""The chat endpoint's prompt flags reach the chat template: ``continue_final_message`` leaves the
last turn open (no end-of-turn token after it), ``add_generation_prompt`` opens the assistant's, and
both at once are refused by name before the template runs. A template that ends each turn with
``<eos>`` shows the difference, which the zoo's own template (no end-of-turn token) cannot."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install -e '.[serve]')")

from conformance.zoo import zoo_model  # noqa: E402
from nanovllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError  # noqa: E402
from nanovllm.entrypoints.openai.serving_chat import answer_role, apply_chat_template, echoed  # noqa: E402
from tests.chat_templates import CONV, TURN_ENDS  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(zoo_model("qwen3-gqa2-hd64-tied"))
    tok.chat_template = TURN_ENDS
    return tok


def request(**flags) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": CONV, **flags})


def test_continue_final_message_leaves_the_last_turn_open(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    closed = apply_chat_template(tokenizer, request(add_generation_prompt=False))["prompt_token_ids"]
    open_ = apply_chat_template(tokenizer, request(add_generation_prompt=False, continue_final_message=True))
    assert closed[-1] == eos  # the control: without the flag the turn is ended
    assert open_["prompt_token_ids"] == closed[:-1] and open_["prompt"].endswith("w30 w40")
    answered = apply_chat_template(tokenizer, request())["prompt_token_ids"]
    assert answered[: len(closed)] == closed and answered[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")


def test_both_prompt_flags_are_refused_by_name(tokenizer):
    with pytest.raises(OpenAIError) as e:
        apply_chat_template(tokenizer, request(continue_final_message=True))
    assert e.value.param == "continue_final_message" and "add_generation_prompt" in str(e.value)


def test_echo_takes_the_last_message_only_in_the_answers_role():
    # vLLM's rule: the roles decide, so an assistant message is echoed before a new assistant turn too
    assert answer_role(request()) == "assistant" and echoed(request(echo=True)) == "w30 w40"
    assert echoed(request(add_generation_prompt=False, continue_final_message=True, echo=True)) == "w30 w40"
    asked = ChatCompletionRequest.model_validate({"messages": CONV[:1], "echo": True})
    assert answer_role(asked) == "assistant" and echoed(asked) == ""
    left_open = ChatCompletionRequest.model_validate(
        {"messages": CONV[:1], "echo": True, "add_generation_prompt": False}
    )
    assert answer_role(left_open) == "user" and echoed(left_open) == "w10 w20"
    assert echoed(request(add_generation_prompt=False)) == ""  # echo not asked


def test_llm_chat_takes_the_same_flag(tokenizer, monkeypatch):
    """``LLM.chat_prompts(continue_final_message=True)`` gives the server's ids for the same
    conversation, and refuses the flag beside a generation prompt (the engine itself is not needed)."""
    from nanovllm import LLM

    llm = LLM.__new__(LLM)
    monkeypatch.setattr(llm, "get_tokenizer", lambda: tokenizer, raising=False)
    served = apply_chat_template(tokenizer, request(add_generation_prompt=False, continue_final_message=True))
    offline = llm.chat_prompts(CONV, add_generation_prompt=False, continue_final_message=True)
    assert offline == [{"prompt_token_ids": served["prompt_token_ids"], "prompt": served["prompt"]}]
    assert offline[0]["prompt_token_ids"] != llm.chat_prompts(CONV, add_generation_prompt=False)[0]["prompt_token_ids"]
    with pytest.raises(ValueError, match="continue_final_message=True and add_generation_prompt=True"):
        llm.chat_prompts(CONV, continue_final_message=True)


def test_chat_template_kwargs_win_over_the_flag(tokenizer):
    """The same key in ``chat_template_kwargs`` and as a flag: the kwargs win (as in vLLM), where
    the two had been passed twice and the template call failed."""
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    ids = apply_chat_template(
        tokenizer,
        request(
            add_generation_prompt=False,
            continue_final_message=True,
            chat_template_kwargs={"continue_final_message": False},
        ),
    )["prompt_token_ids"]
    assert ids[-1] == eos
