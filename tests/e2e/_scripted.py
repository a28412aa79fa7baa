"""Test-only generation parts, importable by class path from Ray workers (``tests.e2e._scripted``).

* :class:`HermesTinyLM`: the tiny Qwen2 model over a printable-ASCII character tokenizer with Qwen's special
  tokens (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``, ``</tool_call>``) and a Qwen-2.5-style chat template
  with a tools section: it can write ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the character
  tokenizer cannot), so the Hermes parser runs on real tokens through the server.
* :class:`ScriptedEngine`: the real torch engine, except that a prompt containing one of :data:`SCRIPTS`' keys
  gets that key's reply, teacher-forced through the real model (its real logprobs, the engine's version). A random
  tiny model writes a given tool call with vanishing probability; these tests pin what the *server* does with a
  reply of a given shape (parse, refuse, stream), so the reply's text is fixed and everything else is real.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config

from screl.models import TinyCausalLM
from screl.rollout.engines.protocol import EngineOptions, GenerationRequest, GenerationResult
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.faults import HangsOnceEngine

SPECIALS = ("<pad>", "<|im_end|>", "<bos>", "<|im_start|>", "<tool_call>", "</tool_call>")
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def hermes_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for c in ["\n", *map(chr, range(32, 127))]:
        vocab[c] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    # as in Qwen's tokenizer: <tool_call> is one token but not a special one (decoding keeps it)
    tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in SPECIALS[4:]])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<bos>",
                                  additional_special_tokens=[SPECIALS[3]])
    tok.chat_template = HERMES_TEMPLATE
    return tok


class HermesTinyLM(TinyCausalLM):
    """The tiny model over :func:`hermes_tokenizer`."""

    def build_config(self) -> Qwen2Config:
        return Qwen2Config(vocab_size=len(hermes_tokenizer().get_vocab()), **self.config_kwargs())

    def build_tokenizer(self) -> PreTrainedTokenizerFast:
        return hermes_tokenizer()


SCRIPTS = {
    "@one": '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>',
    "@two": 'Both. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '<tool_call>\n{"name": "mul", "arguments": {"a": 5, "b": 6}}\n</tool_call>',
    "@bad": '<tool_call>\n{"name": "add", "arguments": {"a": 3,, }\n</tool_call>',
    "@named": '{"a": 8, "b": 9}}\n</tool_call>',  # the rest of a call whose opener tool_choice prefilled
    "@plain": "Seven.",
    "=one": "=3+4",  # the compact syntax (the character tokenizer)
    "=two": "=add 1+2 =mul 5+6",
    "=bad": "=div 1+2",  # a tool the request does not offer: call-like text that does not parse
    # the calculator task's 3+4 (tests/e2e/test_agents_sdk.py): call the tool, then answer with its result
    "user 3+4<eos>assistant ": "=",
    "tool 7<eos>assistant ": "7",
}
"""Prompt key -> the reply forced after it (the engine's stop token follows)."""


class ScriptedEngine(TorchGenerationEngine):
    """The torch engine; a prompt holding a :data:`SCRIPTS` key gets its reply, scored by the real model."""

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        free = [r for r in requests if self._script(r) is None]
        done = {r.request_id: r for r in super().generate(free)} if free else {}
        return [done[r.request_id] if r.request_id in done else self._forced(r) for r in requests]

    def _script(self, request: GenerationRequest) -> str | None:
        text = self.tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=False)
        hits = [(text.rfind(k), k) for k in SCRIPTS if k in text]
        return SCRIPTS[max(hits)[1]] if hits else None

    def _forced(self, request: GenerationRequest) -> GenerationResult:
        reply = self._script(request)
        assert reply is not None
        ids = [int(t) for t in self.tokenizer(reply, add_special_tokens=False)["input_ids"]]
        ids.append(int(self.tokenizer.eos_token_id))
        limit = request.sampling.max_new_tokens
        finish = "stop" if len(ids) <= limit else "length"
        ids = ids[:limit]
        prompt = list(request.prompt_token_ids)
        seq = torch.tensor([prompt + ids])
        with torch.no_grad():
            logits = self.model(seq).logits[0, len(prompt) - 1:-1].float() / max(request.sampling.temperature, 1e-6)
        logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()
        return GenerationResult(request.request_id, prompt, ids, logprobs, finish,  # type: ignore[arg-type]
                                [self.version] * len(ids), self.version, self.version)


class MarkedHangEngine(HangsOnceEngine):
    """:class:`~screl.rollout.faults.HangsOnceEngine` that writes the file ``backend_args.marker`` when its first
    ``generate`` starts hanging: a test then knows the request is in the engine (not in the worker's queue)."""

    marker = ""

    @classmethod
    def from_options(cls, policy: TinyCausalLM, options: EngineOptions) -> MarkedHangEngine:
        args = dict(options.args)
        marker = str(args.pop("marker", ""))
        engine = super().from_options(policy, dataclasses.replace(options, args=args))
        assert isinstance(engine, MarkedHangEngine)
        engine.marker = marker
        return engine

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        if not self._hung and self.marker:
            self._hanging = {r.request_id for r in requests}  # abortable from here on
            Path(self.marker).write_text("hanging")
        return super().generate(requests)


def serve(policy: TinyCausalLM, backend: str = "tests.e2e._scripted.ScriptedEngine", workers: int = 1,
          options: EngineOptions | None = None, **server_kwargs: object) -> tuple[object, str, list[object]]:
    """Start generation workers (``backend``) with the policy's initial weights and a policy server in front of them
    (the caller's Ray cluster); returns (server, url, workers)."""
    import ray

    from screl.rollout.server.server import PolicyServer
    from screl.rollout.worker import spawn_workers

    spawned = spawn_workers(workers, policy, namespace_prefix=f"screl-test-{uuid.uuid4().hex[:8]}", max_restarts=0,
                            backend=backend, options=options)
    ray.get([w.update_weights.remote([policy.build_model().state_dict()], 0) for w in spawned], timeout=120)
    server = ray.remote(PolicyServer).options(num_cpus=0, max_concurrency=1000).remote(spawned, policy,
                                                                                       **server_kwargs)
    return server, ray.get(server.start.remote(), timeout=60), list(spawned)


POISONS = {"zzoom": torch.OutOfMemoryError, "zzboom": RuntimeError}
"""Prompt key -> the error the engine raises on a batch holding a prompt with it (the poisoned request)."""


class PoisonedEngine(TorchGenerationEngine):
    """The torch engine, except that a batch holding a prompt with a :data:`POISONS` key fails with its error (as an
    out-of-memory fails the engine's whole batch); ``mixed`` counts the failed batches that held other requests."""

    mixed = 0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        for r in requests:
            text = self.tokenizer.decode(list(r.prompt_token_ids), skip_special_tokens=False)
            for key, error in POISONS.items():
                if key in text:
                    type(self).mixed += len(requests) > 1
                    raise error(f"poisoned request {r.request_id} ({key})")
        return super().generate(requests)
