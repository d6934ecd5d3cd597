"""Each architecture switch of each model family against transformers' own model: the parameters
ours builds (names and shapes, through ``packed_modules_mapping``) must be the ones transformers
builds from the same config, with every switch varied on its own.

Guards against the class "a family option no zoo model sets, or sets only together with another
option": a bias dropped from one projection (o_proj of Qwen3 with ``attention_bias``), or one
switch read for another (``mlp_bias`` read from ``attention_bias``). Such a model ignores part of
its checkpoint with a warning only, or wants tensors the checkpoint lacks, and no golden file
covers it. transformers' model is built on the meta device: names and shapes, no memory.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from conformance.zoo import ZOO, hf_config_dict
from nanovllm.loader.hf_config import hf_config_from_dict
from nanovllm.models.registry import get_model_class

# one small model per family; the switches each family's transformers class reads
FAMILIES = {"llama": "llama-mha-hd64", "qwen2": "qwen2-gqa2-hd64", "qwen3": "qwen3-gqa4-hd128"}
SWITCHES = {"llama": ("attention_bias", "mlp_bias"), "qwen2": (), "qwen3": ("attention_bias",)}


def _cases():
    for family, switches in SWITCHES.items():
        for values in itertools.product((False, True), repeat=len(switches)):
            for tied in (False, True):
                settings = dict(zip(switches, values), tie_word_embeddings=tied)
                label = ",".join(f"{k}={int(v)}" for k, v in settings.items())
                yield pytest.param(family, settings, id=f"{family}[{label}]")


def _config(family: str, settings: dict) -> dict:
    raw = hf_config_dict(ZOO[FAMILIES[family]])
    raw.update(num_hidden_layers=1, vocab_size=64)  # small: the layer structure is what matters
    for key in ("attention_bias", "mlp_bias"):
        raw.pop(key, None)  # each switch is set by the case only, never by the zoo spec
    raw.update(settings)
    return raw


def theirs_parameters(raw: dict) -> dict[str, tuple[int, ...]]:
    """transformers' parameters for ``raw`` (a config.json dict), in checkpoint naming; a tied
    model's checkpoint has no lm_head.weight."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {n: tuple(p.shape) for n, p in model.state_dict().items() if not n.endswith("rotary_emb.inv_freq")}
    if raw.get("tie_word_embeddings"):
        names.pop("lm_head.weight", None)
    return names


def ours_parameters(raw: dict, model_class=None) -> dict[str, tuple[int, ...]]:
    """Our model's parameters for ``raw``, renamed to checkpoint names: a merged parameter
    (qkv_proj, gate_up_proj) stands for each of its checkpoint tensors, with that shard's shape."""
    config = hf_config_from_dict(raw)
    cls = model_class or get_model_class(config)
    with torch.device("meta"):
        model = cls(config)
    mapping = cls.packed_modules_mapping
    head_dim = config.head_dim
    shard_rows = {
        "q": config.num_attention_heads * head_dim,
        "k": config.num_key_value_heads * head_dim,
        "v": config.num_key_value_heads * head_dim,
        0: config.intermediate_size,
        1: config.intermediate_size,
    }
    out = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if name == "lm_head.weight" and getattr(model, "tie_word_embeddings", False):
            continue
        parts = [(ck, sid) for ck, (pp, sid) in mapping.items() if f".{pp}." in name]
        if not parts:
            out[name] = tuple(param.shape)
        for ck, sid in parts:
            out[name.replace(mapping[ck][0], ck)] = (shard_rows[sid], *param.shape[1:])
    return out


def _differences(theirs: dict, ours: dict) -> dict:
    return {
        n: (ours.get(n, "<missing>"), theirs.get(n, "<missing>"))
        for n in sorted(set(theirs) | set(ours))
        if ours.get(n) != theirs.get(n)
    }


@pytest.mark.parametrize("family,settings", list(_cases()))
def test_parameters_match_transformers_for_each_switch(family, settings):
    """For each family and each bias switch set on its own (and tied or not), our model's
    parameters, mapped to checkpoint names, equal the names and shapes of transformers' model
    from the same config: a bias dropped or added, or a switch read for another, shows up as a
    name only one side has."""
    raw = _config(family, settings)
    theirs = theirs_parameters(raw)
    assert any(n.endswith("self_attn.q_proj.weight") for n in theirs), sorted(theirs)[:8]
    diffs = _differences(theirs, ours_parameters(raw))
    assert not diffs, f"{family} {settings}: parameters differ (ours, transformers'): {diffs}"


@pytest.mark.parametrize(
    "family,settings,wrong",
    [
        ("qwen3", {"attention_bias": True}, "o=False"),  # the o_proj bias dropped
        ("llama", {"mlp_bias": True}, "mlp=attention"),  # mlp_bias read from attention_bias
        ("llama", {"attention_bias": True}, "mlp=attention"),
        ("qwen2", {}, "no_qkv"),  # Qwen2's always-on q/k/v bias dropped
    ],
)
def test_a_wrong_bias_switch_is_seen(family, settings, wrong):
    """Negative control: a model class whose biases() gets one switch wrong makes the comparison
    above report the differing parameters."""
    from nanovllm.models.llama import Biases

    raw = _config(family, settings)
    base = get_model_class(hf_config_from_dict(raw))

    def biases(cls, config):
        b = base.biases(config)
        a = bool(getattr(config, "attention_bias", False))
        if wrong == "o=False":
            return Biases(qkv=b.qkv, o=False, mlp=b.mlp)
        if wrong == "mlp=attention":
            return Biases(qkv=b.qkv, o=b.o, mlp=a)
        return Biases(qkv=False, o=b.o, mlp=b.mlp)

    broken = type(f"Broken{base.__name__}", (base,), {"biases": classmethod(biases)})
    diffs = _differences(theirs_parameters(raw), ours_parameters(raw, broken))
    assert diffs and all(n.endswith(".bias") for n in diffs), diffs


def _checkpoint(raw: dict) -> dict[str, torch.Tensor]:
    """A checkpoint with exactly the tensors transformers' model for ``raw`` has (random values)."""
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(shape, generator=gen) for n, shape in theirs_parameters(raw).items()}


@pytest.mark.parametrize("family,settings", list(_cases()))
def test_each_missing_checkpoint_tensor_is_named(family, settings):
    """For each family and switch set, the complete checkpoint (transformers' tensor names) loads,
    and one with any single tensor left out is refused with a ValueError naming that tensor: the
    embedding, an untied lm_head, the norms, each q/k/v and gate/up shard of a merged parameter,
    each bias. Guards against special-cased names (lm_head) or merged shards escaping the
    missing-weight check, so a truncated checkpoint runs with uninitialised memory."""
    from nanovllm.loader.model_loader import load_weights

    raw = _config(family, settings)
    config = hf_config_from_dict(raw)
    cls = get_model_class(config)
    full = _checkpoint(raw)
    load_weights(cls(config), iter(full.items()))  # control: the complete checkpoint loads
    for left_out in full:
        model = cls(config)
        with pytest.raises(ValueError, match=f"missing weight.*{left_out.replace('.', '[.]')}"):
            load_weights(model, ((n, t) for n, t in full.items() if n != left_out))


def test_a_tied_model_needs_no_lm_head():
    """Control for the test above: a tied model's checkpoint without lm_head.weight is complete
    (the head is the embedding), and its logits use the embedding's values."""
    from nanovllm.loader.model_loader import load_weights

    raw = _config("qwen2", {"tie_word_embeddings": True})
    config = hf_config_from_dict(raw)
    full = _checkpoint(raw)
    assert "lm_head.weight" not in full
    model = get_model_class(config)(config)
    load_weights(model, iter(full.items()))
    assert torch.equal(model.lm_head.weight, full["model.embed_tokens.weight"])
