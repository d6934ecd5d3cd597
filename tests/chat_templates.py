"""A chat template the tests share: it ends each turn with ``<eos>`` (the zoo's own ends none), so
an open last turn (``continue_final_message``) and a closed one tokenize differently."""

TURN_ENDS = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|> ' + m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|> ' }}{% endif %}"
)
CONV = [{"role": "user", "content": "w10 w20"}, {"role": "assistant", "content": "w30 w40"}]
