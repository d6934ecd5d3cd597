"""Engine flags a user gives to `nanovllm experiment` and to `nanovllm trace` (demo workload)
reach the engine over the experiment's own settings, which fill in only what the user left
out (runner module doc). The model is never loaded: a stand-in LLM records its arguments."""

from __future__ import annotations

import pytest


class _Loaded(Exception):
    pass


@pytest.fixture
def llm_kwargs(monkeypatch):
    import nanovllm.llm

    seen: dict = {}

    def stand_in(model=None, **kwargs):
        seen.update(kwargs)
        raise _Loaded

    monkeypatch.setattr(nanovllm.llm, "LLM", stand_in)
    return seen


def test_experiment_flags_override_the_experiments_settings(tmp_path, llm_kwargs):
    from nanovllm.experiments import e04_scheduler_watch as e04
    from nanovllm.experiments.runner import run_experiment

    own = e04.engine_args(e04.SHAPES["cpu"])
    assert own["num_kvcache_blocks"] != 12 and own["max_num_seqs"] != 3
    with pytest.raises(_Loaded):
        run_experiment(
            "04",
            shape="cpu",
            out_dir=tmp_path,
            engine_args={"num_kvcache_blocks": 12, "max_num_seqs": 3, "device": "cpu"},
            echo=lambda line: None,
        )
    assert llm_kwargs["num_kvcache_blocks"] == 12 and llm_kwargs["max_num_seqs"] == 3
    assert llm_kwargs["block_size"] == own["block_size"]  # the experiment's own, not given by the user
    assert llm_kwargs["max_num_batched_tokens"] == own["max_num_batched_tokens"]


def test_trace_demo_flags_override_experiment_04s_settings(tmp_path, llm_kwargs, capsys):
    from nanovllm.entrypoints.cli import main
    from nanovllm.experiments import e04_scheduler_watch as e04

    own = e04.engine_args(e04.SHAPES["cpu"])
    with pytest.raises(_Loaded):
        main(
            [
                "trace",
                "--json",
                str(tmp_path / "t.json"),
                "--num-kvcache-blocks",
                "12",
                "--max-num-batched-tokens",
                "16",
            ]
        )
    assert llm_kwargs["num_kvcache_blocks"] == 12 and llm_kwargs["max_num_batched_tokens"] == 16
    assert llm_kwargs["block_size"] == own["block_size"] and llm_kwargs["max_num_seqs"] == own["max_num_seqs"]
