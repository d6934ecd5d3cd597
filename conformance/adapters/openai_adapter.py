"""Any OpenAI-compatible server, by base URL and model name, through ``/v1/completions``.

Configuration (environment, so that tox envs and CI can set it):

  CONFORMANCE_OPENAI_BASE_URL    the API root, e.g. http://127.0.0.1:8000/v1 (else $OPENAI_BASE_URL)
  CONFORMANCE_OPENAI_MODEL       the served model name (default: the first one /models lists; a
                                 name /models does not list makes the engine unavailable, naming those it does)
  CONFORMANCE_OPENAI_MODEL_PATH  the local model (HF directory or .gguf) the server was started from;
                                 a check that names another model is skipped (capability any_model)
  CONFORMANCE_OPENAI_SERVER      vllm | nanovllm | llama-cpp | generic, any case (default: probed)
  OPENAI_API_KEY                 sent as a bearer token when set

One server serves one model with its launch-time settings, so the engine knobs (block size,
KV budget, prefix cache, ...) are not capabilities of this adapter: checks that need them are
skipped by name. Requests of one ``generate`` call are sent concurrently (one HTTP request
each), so a server that batches runs them as a batch.

What each kind of server is sent and declares:

- ``vllm`` and ``nanovllm`` (vLLM's API): token-id prompts; temperature, top_p, seed, stop,
  max_tokens, logprobs, and the extras top_k, min_p, min_tokens, ignore_eos, stop_token_ids,
  include_stop_str_in_output, prompt_logprobs, return_tokens_as_token_ids. Whether the server
  honours the last one is probed with one request: where it does, the output's token ids and the
  logprob entries' ids come back as ``token_id:N`` (capabilities token_ids, logprobs); where it
  does not, the output ids are its text (asked with ``skip_special_tokens: false`` unless the
  request has stop strings, so that EOS and other special tokens stay in it) tokenized again, the
  text is those ids decoded without the special tokens, and logprobs are not checked. Ids recovered from text cannot include a token
  whose text a stop string cut off (vLLM keeps that token in the ids).
- ``llama-cpp`` (llama-cpp-python's server): text prompts only (``prompt`` is a string), text
  out; top_k, min_p, min_tokens, seed. The adapter detokenizes prompts with the model's
  tokenizer and refuses (capability token_ids) a prompt whose text does not tokenize back to
  the same ids; output ids are the output text tokenized again.
- ``generic``: the OpenAI parameters only (temperature, top_p, seed, stop, max_tokens), text
  prompts and output as for llama-cpp.

Logprob entries carry ranks by their order among the returned top-k; a sampled token outside
the top-k gets rank None (the OpenAI format does not give it).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

from conformance.adapters.base import C, Capability, EngineAdapter, Logprob, Result, Sampling, Unsupported
from conformance.models import same_model

REQUESTS = {C.GREEDY, C.SAMPLING, C.SEED, C.TOP_P, C.STOP_STRINGS, C.EOS, C.TEXT}
VLLM_API = REQUESTS | {C.TOP_K, C.MIN_P, C.PROMPT_LOGPROBS, C.STOP_TOKEN_IDS, C.MIN_TOKENS, C.IGNORE_EOS}
IDS_OUT = {C.TOKEN_IDS, C.LOGPROBS, C.SAMPLED_LOGPROB}  # with token-id prompts, where ids come back
SERVER_CAPABILITIES: dict[str, frozenset[Capability]] = {
    "vllm": frozenset(VLLM_API),
    "nanovllm": frozenset(VLLM_API),
    "llama-cpp": frozenset(REQUESTS | {C.TOP_K, C.MIN_P, C.MIN_TOKENS}),
    "generic": frozenset(REQUESTS),
}
IDS_IN = {"vllm", "nanovllm"}  # server kinds that take token-id prompts
TOKEN_ID = re.compile(r"^token_id:(\d+)$")


class ServerError(RuntimeError):
    """The server answered with an error status; the message has its body."""


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name) or default


def base_url() -> str:
    return (_env("CONFORMANCE_OPENAI_BASE_URL") or _env("OPENAI_BASE_URL") or "http://127.0.0.1:8000/v1").rstrip("/")


MAX_THREADS = 64  # requests in flight at once from generate()


def _client():
    import httpx

    key = _env("OPENAI_API_KEY")
    # as many pooled connections as generate() has threads, all kept alive: with httpx's default
    # of 20 kept alive, the pool could close a surplus idle connection it had just handed to a
    # waiting thread (httpcore issue #1110), whose request then failed with EBADF (seen against a
    # server with two front-end processes, whose faster answers made the race likely)
    return httpx.Client(
        base_url=base_url(),
        timeout=httpx.Timeout(900.0, connect=5.0),
        limits=httpx.Limits(max_connections=MAX_THREADS, max_keepalive_connections=MAX_THREADS),
        headers={"Authorization": f"Bearer {key}"} if key else {},
    )


def probe_server(client) -> tuple[str, str, str]:
    """(server kind, model name, description) from /models and the server's version endpoint."""
    models = client.get("/models")
    if models.status_code != 200:
        hint = "; does the URL end in /v1? (CONFORMANCE_OPENAI_BASE_URL)" if models.status_code == 404 else ""
        raise ServerError(f"GET {base_url()}/models answered {models.status_code}{hint}")
    data = models.json().get("data") or []
    if not data:
        raise ServerError(f"{base_url()}/models lists no model")
    served = [str(m.get("id")) for m in data]
    name = _env("CONFORMANCE_OPENAI_MODEL") or served[0]
    if name not in served:
        raise ServerError(f"model {name!r} (CONFORMANCE_OPENAI_MODEL) not served; the server has: {', '.join(served)}")
    entry = data[served.index(name)]
    owner = str(entry.get("owned_by", ""))
    kind = (_env("CONFORMANCE_OPENAI_SERVER") or "").lower() or None
    version = ""
    root = base_url().removesuffix("/v1")
    try:
        r = client.get(f"{root}/version")
        if r.status_code == 200:
            version = str(r.json().get("version", ""))
    except Exception:  # noqa: BLE001 - the version is informative only
        pass
    if kind is None:
        kind = (
            "vllm"
            if owner == "vllm"
            else "nanovllm"
            if owner == "nanovllm"
            else "llama-cpp"
            if owner == "me"
            else "generic"
        )
    if kind not in SERVER_CAPABILITIES:
        raise ServerError(
            f"CONFORMANCE_OPENAI_SERVER={kind!r} is not a kind of server this adapter knows: set it to one "
            f"of {', '.join(SERVER_CAPABILITIES)}, or unset it to probe the server"
        )
    desc = f"{kind} server{' ' + version if version else ''} at {base_url()}, model {name!r} (owned_by {owner!r})"
    return kind, name, desc


class OpenAIAdapter(EngineAdapter):
    name = "openai"
    # an instance is an HTTP client of the one server: several stay open at once, so a check that
    # asks for other knobs (refused at load) does not close the client an earlier fixture holds
    max_live = 8
    capabilities = frozenset(VLLM_API | IDS_OUT)  # the upper bound; an instance has its server's

    def __init__(self):
        self.client = _client()
        self.kind, self.model, self.description = probe_server(self.client)
        self.ids_in = self.kind in IDS_IN
        self.ids_out = self.ids_in and self._probe_ids_out()
        self.capabilities = SERVER_CAPABILITIES[self.kind] | (IDS_OUT if self.ids_out else set())
        self.tokenizer = None

    def _probe_ids_out(self) -> bool:
        """Does the server return token ids as token_id:N when asked (return_tokens_as_token_ids)?"""
        try:
            reply = self._post(
                {
                    "model": self.model,
                    "prompt": [1, 2, 3],
                    "max_tokens": 1,
                    "temperature": 0.0,
                    "logprobs": 0,
                    "return_tokens_as_token_ids": True,
                }
            )
            tokens = (reply["choices"][0].get("logprobs") or {}).get("tokens") or []
        except (ServerError, KeyError, IndexError):
            return False
        return bool(tokens) and all(TOKEN_ID.match(t) for t in tokens)

    @classmethod
    def unavailable(cls) -> str | None:
        try:
            with _client() as client:
                probe_server(client)
        except ServerError as e:  # a server answered: the message says what to change
            return str(e)
        except Exception as e:  # noqa: BLE001 - any other failure means: no server to check
            first_line = (str(e).strip().splitlines() or [""])[0]  # httpx's messages run over lines
            return (
                f"no OpenAI-compatible server at {base_url()} ({type(e).__name__}: {first_line}); "
                f"set CONFORMANCE_OPENAI_BASE_URL"
            )
        return None

    @classmethod
    def describe(cls) -> str:
        try:
            with _client() as client:
                return probe_server(client)[2]
        except Exception as e:  # noqa: BLE001
            return f"openai ({base_url()}: {e})"

    def load(self, model_dir: str, **knobs) -> None:
        self.check_knobs(knobs)
        served = _env("CONFORMANCE_OPENAI_MODEL_PATH")
        if served is None:
            raise Unsupported(
                C.ANY_MODEL,
                "set CONFORMANCE_OPENAI_MODEL_PATH to the model the server runs, "
                "so that checks of other models are skipped, not misjudged",
            )
        if not same_model(model_dir, served):
            raise Unsupported(C.ANY_MODEL, f"the server runs {served}, the check needs {model_dir}")
        if not self.ids_out:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    # ---------------------------------------------------------------- requests
    def body(self, prompt: list[int], p: Sampling) -> dict:
        body = {
            "model": self.model,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "n": 1,
            "stream": False,
        }
        if p.seed is not None:
            body["seed"] = p.seed
        if p.stop:
            body["stop"] = list(p.stop)
        if self.ids_in:
            body["prompt"] = list(prompt)
            if self.ids_out:
                # every request asks for logprobs: the output's token ids come back through them
                body["logprobs"] = p.logprobs or 0
                body["return_tokens_as_token_ids"] = True
            elif not p.stop:
                # the ids come from the text: keep the special tokens (EOS, ...) in it (not with stop
                # strings: the server's own text is then what is checked)
                body["skip_special_tokens"] = False
            body.update(
                min_p=p.min_p,
                min_tokens=p.min_tokens,
                ignore_eos=p.ignore_eos,
                stop_token_ids=list(p.stop_token_ids),
                include_stop_str_in_output=p.include_stop_str_in_output,
            )
            if p.top_k > 0:
                body["top_k"] = p.top_k
            if p.prompt_logprobs is not None:
                body["prompt_logprobs"] = p.prompt_logprobs
            return body
        body["prompt"] = self._prompt_text(prompt)
        if p.logprobs is not None:
            body["logprobs"] = p.logprobs
        if self.kind == "llama-cpp":
            body.update(top_k=p.top_k, min_p=p.min_p, min_tokens=p.min_tokens, repeat_penalty=1.0)
        return body

    def _prompt_text(self, prompt: list[int]) -> str:
        text = self.tokenizer.decode(prompt)
        again = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if list(again) != list(prompt):
            raise Unsupported(
                C.TOKEN_IDS,
                f"the server takes text prompts and this prompt's text tokenizes to "
                f"other ids ({len(again)} vs {len(prompt)} tokens)",
            )
        return text

    def _post(self, body: dict) -> dict:
        r = self.client.post("/completions", json=body)
        if r.status_code != 200:
            raise ServerError(f"POST /completions {r.status_code}: {r.text[:500]}")
        return r.json()

    def generate(self, prompts: list[list[int]], params: list[Sampling]) -> list[Result]:
        self.check_params(params)
        bodies = [self.body(prompt, p) for prompt, p in zip(prompts, params)]
        with ThreadPoolExecutor(max_workers=max(1, min(len(bodies), MAX_THREADS))) as pool:
            replies = list(pool.map(self._post, bodies))
        return [self.result(reply, p) for reply, p in zip(replies, params)]

    # ---------------------------------------------------------------- replies
    def result(self, reply: dict, p: Sampling) -> Result:
        choice = reply["choices"][0]
        lp = choice.get("logprobs") or {}
        if self.ids_out:
            ids = choice.get("token_ids")
            if ids is None:
                ids = [_token_id(t) for t in lp.get("tokens") or []]
            logprobs = _logprob_entries(lp, ids, p.logprobs) if p.logprobs is not None else None
        else:
            ids = self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"]
            logprobs = None
            if self.ids_in and not p.stop:  # the text kept its special tokens: vLLM's text drops them
                choice = dict(choice, text=self.tokenizer.decode(ids, skip_special_tokens=True))
        usage = reply.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        return Result(
            token_ids=list(ids),
            finish_reason=choice.get("finish_reason"),
            text=choice.get("text"),
            stop_reason=choice.get("stop_reason"),
            logprobs=logprobs,
            prompt_logprobs=_prompt_logprobs(choice.get("prompt_logprobs")),
            num_cached_tokens=cached,
            extra={"server": self.kind},
        )

    def stats(self) -> dict:
        """Counters from the server's Prometheus /metrics, where it has them (vLLM's names)."""
        root = base_url().removesuffix("/v1")
        try:
            text = self.client.get(f"{root}/metrics").text
        except Exception:  # noqa: BLE001 - metrics are optional
            return {}
        out = {}
        for key, metric in (
            ("preemptions", "vllm:num_preemptions_total"),
            ("cached_tokens", "vllm:prefix_cache_hits_total"),
        ):
            values = re.findall(rf"^{re.escape(metric)}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.M)
            if values:
                out[key] = int(sum(float(v) for v in values))
        return out

    def close(self) -> None:
        self.client.close()


def _token_id(token: str) -> int:
    m = TOKEN_ID.match(token)
    if not m:
        raise ServerError(
            f"logprob token {token!r} is not of the form token_id:N (the server ignored return_tokens_as_token_ids)"
        )
    return int(m.group(1))


def _logprob_entries(lp: dict, ids: list[int], k: int) -> list[dict[int, Logprob]]:
    """Per step {token: Logprob}: the top-k ranked by value; the sampled token, where it is outside
    the top-k, with rank None (the format does not say how far outside)."""
    out = []
    for t, (tok, top) in enumerate(zip(ids, lp.get("top_logprobs") or [None] * len(ids))):
        entry: dict[int, Logprob] = {}
        ranked = sorted(((_token_id(key), v) for key, v in (top or {}).items()), key=lambda kv: -kv[1])
        for rank, (tid, value) in enumerate(ranked, start=1):
            entry[tid] = Logprob(float(value), rank if rank <= k else None)
        if tok not in entry:
            entry[tok] = Logprob(float(lp["token_logprobs"][t]), None)
        out.append(entry)
    return out


def _prompt_logprobs(entries) -> list | None:
    if entries is None:
        return None
    out: list = []
    for d in entries:
        if d is None:
            out.append(None)
            continue
        out.append({int(t): Logprob(float(v["logprob"]), v.get("rank")) for t, v in d.items()})
    return out
