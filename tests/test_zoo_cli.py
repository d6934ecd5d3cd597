"""python -m conformance.zoo: the zoo's models listed, or built and their folders printed (what a
learner passes to --model)."""

from __future__ import annotations

import pytest

from conformance.zoo import ZOO, main, zoo_model


def test_lists_every_model(capsys):
    assert main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(ZOO)
    assert (
        "qwen3  hidden 192, 2 layers, 4 heads / 2 KV, vocabulary 1031" in lines[list(ZOO).index("qwen3-gqa2-hd64-tied")]
    )


def test_prints_the_folder_of_a_built_model(capsys):
    assert main(["qwen3-gqa2-hd64-tied"]) == 0
    assert capsys.readouterr().out.strip() == zoo_model("qwen3-gqa2-hd64-tied")


def test_an_unknown_name_is_refused_naming_it(capsys):
    with pytest.raises(SystemExit) as e:
        main(["qwen3-gqa2-hd64-tied", "nope"])
    assert e.value.code == 2
    err = capsys.readouterr()
    assert "unknown zoo model(s) 'nope'; known: llama-mha-hd64," in err.err and err.out == ""  # nothing built
