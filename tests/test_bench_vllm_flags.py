"""A vLLM user's flag names work in nanovllm's benchmarks: vLLM's --dataset-name,
--random-input-len / --random-output-len and --output-json mean what nanovllm's own names mean."""

from __future__ import annotations

import pytest

from nanovllm.entrypoints import cli


def _parse(argv: list[str]):
    return cli.build_parser().parse_args(argv)


@pytest.mark.parametrize(
    "ours, vllms",
    [
        (
            ["bench", "--dataset", "random", "--input-len", "64", "--output-len", "8", "--json-out", "r.json"],
            [
                "bench",
                "--dataset-name",
                "random",
                "--random-input-len",
                "64",
                "--random-output-len",
                "8",
                "--output-json",
                "r.json",
            ],
        ),
        (
            ["bench", "latency", "--input-len", "16", "--json-out", "l.json"],
            ["bench", "latency", "--random-input-len", "16", "--output-json", "l.json"],
        ),
        (
            ["bench", "serve", "--dataset", "random", "--input-len", "32", "--output-len", "4"],
            ["bench", "serve", "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "4"],
        ),
    ],
    ids=["throughput", "latency", "serve"],
)
def test_vllm_names_mean_the_same(ours, vllms):
    a, b = vars(_parse(ours)), vars(_parse(vllms))
    assert a == b
    assert a != vars(_parse(ours[:-2])), "the control: the last flag changes what is parsed"


def test_bench_throughput_is_plain_bench():
    """`nanovllm bench throughput` (vllm bench's name) parses and runs as plain `nanovllm bench`."""
    flags = ["--dataset", "random", "--num-prompts", "5", "--input-len", "8", "--max-model-len", "64"]
    plain, named = vars(_parse(["bench", *flags])), vars(_parse(["bench", "throughput", *flags]))
    assert named.pop("bench_command") == "throughput" and plain.pop("bench_command") is None
    assert plain == named
    assert vars(_parse(["bench", "throughput", *flags[:-2]])) != {**named, "bench_command": "throughput"}
