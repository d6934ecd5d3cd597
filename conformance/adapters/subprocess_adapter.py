"""Engines that live in their own Python (their own torch pins): vLLM's offline ``LLM``.

The adapter starts ``engine_worker.py`` with that Python, one process per loaded engine, and
talks JSON lines to it (see engine_worker.py). vLLM's Python is $NANOVLLM_VLLM_PYTHON or
``.venv-vllm/bin/python`` under the current directory (the suite's README says how to install it).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path

from conformance.adapters.base import C, EngineAdapter, Logprob, Result, Sampling, Unsupported

WORKER = Path(__file__).with_name("engine_worker.py")


def _lp(entries):
    if entries is None:
        return None
    return [None if d is None else {int(t): Logprob(v[0], v[1]) for t, v in d.items()} for d in entries]


class EngineError(RuntimeError):
    """An error the engine raised (its type name is kept in the message)."""


class SubprocessAdapter(EngineAdapter):
    kind = ""
    max_live = 2  # engines (processes) alive at once
    python_env = ""
    pythonpath_env = ""
    default_python: str | None = None
    probe = ""  # python -c code: exit 0 when the engine is installed
    version_probe = ""  # python -c code: print the engine's version

    def __init__(self):
        self.proc = None
        self.version = None
        self._log = None

    @classmethod
    def python(cls) -> str | None:
        p = os.environ.get(cls.python_env) or (str(Path.cwd() / cls.default_python) if cls.default_python else None)
        return p if p and Path(p).is_file() else None

    @classmethod
    def unavailable(cls) -> str | None:
        py = cls.python()
        if py is None:
            return (
                f"no Python for it (set ${cls.python_env}"
                + (f" or create {cls.default_python}" if cls.default_python else "")
                + ")"
            )
        probe = subprocess.run(
            [py, "-c", cls.probe],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, PYTHONPATH=os.environ.get(cls.pythonpath_env, "")),
        )
        if probe.returncode != 0:
            why = (probe.stderr.strip().splitlines() or [f"{cls.kind} is not installed there"])[-1]
            return f"{py}: {why}"
        return None

    @classmethod
    def describe(cls) -> str:
        py = cls.python()
        if py is None:
            return f"{cls.kind} (not installed)"
        out = subprocess.run(
            [py, "-c", cls.version_probe],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(os.environ, PYTHONPATH=os.environ.get(cls.pythonpath_env, "")),
        )
        return (out.stdout.strip() or out.stderr.strip()[-200:]) + f" via {py}"

    # ----------------------------------------------------------------- process
    def _start(self) -> None:
        read_fd, write_fd = os.pipe()
        self._log = tempfile.NamedTemporaryFile(prefix=f"{self.kind}-worker-", suffix=".log", delete=False)
        env = dict(
            os.environ,
            PYTHONPATH=os.environ.get(self.pythonpath_env, ""),
            CONFORMANCE_REPLY_FD=str(write_fd),
            VLLM_ENABLE_V1_MULTIPROCESSING="0",
            TOKENIZERS_PARALLELISM="false",
        )
        python = self.python()
        assert python is not None, f"{self.name}: no python (unavailable() says why)"
        self.proc = subprocess.Popen(
            [python, str(WORKER), self.kind],
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=self._log,
            env=env,
            text=True,
            pass_fds=(write_fd,),
        )
        os.close(write_fd)
        self._replies = os.fdopen(read_fd, "r")

    def _call(self, msg: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(msg) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        line = self._replies.readline()
        if not line:
            raise EngineError(f"{self.kind} worker died (exit {self.proc.poll()}); log tail:\n{self._tail()}")
        reply = json.loads(line)
        if not reply.get("ok"):
            if reply.get("unsupported"):
                raise Unsupported(reply["unsupported"], reply.get("error", ""))
            raise EngineError(f"{reply.get('type')}: {reply.get('error')}")
        return reply

    def _tail(self, n: int = 3000) -> str:
        try:
            return Path(self._log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    # ---------------------------------------------------------------- protocol
    def load(self, model_dir: str, **knobs) -> None:
        self.check_knobs(knobs)
        self._start()
        knobs = {k: (None if v == float("inf") else v) for k, v in knobs.items()}
        if knobs.get("max_batched_tokens") is None and "max_batched_tokens" in knobs:
            knobs.pop("max_batched_tokens")
        self.version = self._call({"op": "load", "model": model_dir, "knobs": knobs})["version"]

    def generate(self, prompts: list[list[int]], params: list[Sampling]) -> list[Result]:
        self.check_params(params)
        reply = self._call(
            {"op": "generate", "prompts": [list(p) for p in prompts], "params": [asdict(p) for p in params]}
        )
        return [
            Result(
                token_ids=r["token_ids"],
                finish_reason=r["finish_reason"],
                text=r["text"],
                stop_reason=r["stop_reason"],
                logprobs=_lp(r["logprobs"]),
                prompt_logprobs=_lp(r["prompt_logprobs"]),
                num_cached_tokens=r["num_cached_tokens"],
            )
            for r in reply["results"]
        ]

    def stats(self) -> dict:
        return self._call({"op": "stats"})["stats"]

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            self.proc.kill()
            self.proc.wait()
        finally:
            self._replies.close()
            self._log.close()
            os.unlink(self._log.name)
            self.proc = None


class VLLMAdapter(SubprocessAdapter):
    name = kind = "vllm"
    python_env = "NANOVLLM_VLLM_PYTHON"
    pythonpath_env = "NANOVLLM_VLLM_PYTHONPATH"
    default_python = ".venv-vllm/bin/python"
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    preferred_block_size = 32  # the CPU build's attention needs a multiple of 32
    version_probe = "import vllm, torch; print('vLLM', vllm.__version__, '(torch', torch.__version__ + ')')"
    capabilities = frozenset(
        {
            C.GREEDY,
            C.SAMPLING,
            C.SEED,
            C.TOP_K,
            C.TOP_P,
            C.MIN_P,
            C.LOGPROBS,
            C.SAMPLED_LOGPROB,
            C.PROMPT_LOGPROBS,
            C.STOP_STRINGS,
            C.STOP_TOKEN_IDS,
            C.MIN_TOKENS,
            C.EOS,
            C.IGNORE_EOS,
            C.TEXT,
            C.PREFIX_CACHE_STATS,
            C.PREEMPTION_STATS,
            C.ADMISSION_CONTROL,
            C.ANY_MODEL,
            C.BLOCK_SIZE,
            C.KV_BUDGET,
            C.CHUNK_BUDGET,
            C.PREFIX_CACHE,
            C.MAX_NUM_SEQS,
            C.MAX_MODEL_LEN,
        }
    )
