"""The xgrammar backend: one request's constraint as an xgrammar grammar, checked or compiled.

Two entry points, one per side of the engine:

* ``check_constraint`` (the front end, before a request is queued): builds the constraint's
  ``xgrammar.Grammar`` without a tokenizer, which is where xgrammar rejects a bad schema, regex or
  EBNF grammar; raises ValueError with xgrammar's reason.
* ``XgrammarBackend`` (the engine core): compiles a constraint against the model's vocabulary into
  a ``CompiledGrammar`` (the per-token mask cache; the slow part) and makes a fresh
  ``RequestGrammar`` matcher for each request from it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

import xgrammar as xgr

from engine.config import StructuredOutputsConfig
from engine.reasoning import ReasoningParser
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output.reasoning_gate import ReasoningGate, ReasoningGatedGrammar
from engine.structured_output.request_grammar import RequestGrammar

# JSON without whitespace between tokens: what ``disable_any_whitespace`` asks for.
COMPACT_SEPARATORS = (",", ":")
# xgrammar prefixes its C++ errors with "[time] /path/file.cc:line: "; the reason is what follows.
_CPP_ERROR_PREFIX = re.compile(r"^\s*\[[0-9:]+\]\s*\S+:\d+:\s*")


def compact_json(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> bool:
    """Whether JSON constraints allow no whitespace: the request's choice, else the engine's."""
    if params.disable_any_whitespace is not None:
        return params.disable_any_whitespace
    return config.disable_any_whitespace


def _json_schema_options(compact: bool) -> dict:
    return {"any_whitespace": False, "separators": COMPACT_SEPARATORS} if compact else {"any_whitespace": True}


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose root matches exactly one of ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def structural_tag_json(spec: str, compact: bool) -> str:
    """A structural tag as xgrammar's JSON (vLLM's legacy form, {"structures": [{"begin", "schema", "end"}],
    "triggers"}, converted); with ``compact``, whitespace runs inside its JSON contents are capped at one
    character (xgrammar's least: structural tags have no separators option)."""
    value = json.loads(spec)
    if isinstance(value, dict) and "structures" in value:
        tags = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in value["structures"]
        ]
        value = xgr.StructuralTag.from_legacy_structural_tag(tags, value.get("triggers", [])).model_dump(mode="json")
    if compact:
        _cap_json_whitespace(value)
    return json.dumps(value)


def _cap_json_whitespace(node) -> None:
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and node.get("max_whitespace_cnt") is None:
            node["max_whitespace_cnt"] = 1
        for child in node.values():
            _cap_json_whitespace(child)
    elif isinstance(node, list):
        for child in node:
            _cap_json_whitespace(child)


# xgrammar (0.2.x) lets a length-bounded JSON string hold raw control characters, which JSON forbids
# (its unbounded strings exclude them): the schema's grammar is compiled with that class tightened.
_LOOSE_STRING_CHARACTER = r"[^\"\\\r\n]"
_JSON_STRING_CHARACTER = r"[^\0-\x1f\"\\]"


def json_schema_grammar(schema: str, compact: bool) -> xgr.Grammar:
    """The grammar of JSON documents valid under ``schema``, strings free of raw control characters."""
    grammar = xgr.Grammar.from_json_schema(schema, **_json_schema_options(compact))
    text = str(grammar)
    if _LOOSE_STRING_CHARACTER not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHARACTER, _JSON_STRING_CHARACTER))


def _reason(error: Exception) -> str:
    return _CPP_ERROR_PREFIX.sub("", str(error)).strip() or type(error).__name__


def check_constraint(params: StructuredOutputsParams, config: StructuredOutputsConfig) -> None:
    """Raises ValueError naming the constraint and xgrammar's reason unless xgrammar can build it."""
    kind, spec = params.kind, params.spec
    try:
        if kind == "json":
            json_schema_grammar(spec, compact_json(params, config))
        elif kind == "regex":
            xgr.Grammar.from_regex(spec)
        elif kind == "choice":
            xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
        elif kind == "grammar":
            xgr.Grammar.from_ebnf(spec)
        elif kind == "structural_tag":
            xgr.Grammar.from_structural_tag(structural_tag_json(spec, compact_json(params, config)))
    except (RuntimeError, ValueError, TypeError, KeyError) as error:
        raise ValueError(f"Invalid structured_outputs.{kind}: {_reason(error)}") from None


class XgrammarBackend:
    """Compiles constraints against one model's vocabulary; thread-safe (xgrammar's compiler is)."""

    def __init__(
        self, tokenizer, vocab_size: int, config: StructuredOutputsConfig, reasoning: ReasoningParser | None = None
    ) -> None:
        """``vocab_size``: the model's logits width (may exceed the tokenizer's; the extra ids are never allowed).
        ``reasoning``: grammars start after the reasoning this parser finds (``reasoning_gate``); None: at once."""
        self.config = config
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=config.num_compile_threads)
        self.reasoning_gate = None
        if reasoning is not None:
            num_words = (vocab_size + 31) // 32
            self.reasoning_gate = ReasoningGate(reasoning, self.tokenizer_info.decoded_vocab, num_words)

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar; ValueError with xgrammar's reason if it cannot be compiled."""
        kind, spec = params.kind, params.spec
        compiler = self.compiler
        try:
            if kind in ("json", "json_object"):
                schema = spec if kind == "json" else '{"type": "object"}'
                return compiler.compile_grammar(json_schema_grammar(schema, compact_json(params, self.config)))
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                return compiler.compile_grammar(choice_ebnf(params.choice))
            if kind == "grammar":
                return compiler.compile_grammar(spec)
            return compiler.compile_structural_tag(structural_tag_json(spec, compact_json(params, self.config)))
        except (RuntimeError, ValueError, TypeError, KeyError) as error:
            raise ValueError(f"Invalid structured_outputs.{kind}: {_reason(error)}") from None

    def make_grammar(
        self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int], prompt_token_ids: Sequence[int] = ()
    ) -> RequestGrammar | ReasoningGatedGrammar:
        """A fresh matcher at the grammar's start; it ends on one of ``stop_token_ids`` once complete. With a
        reasoning gate, it starts where the reasoning of the output after ``prompt_token_ids`` ends."""
        grammar = RequestGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None))
        if self.reasoning_gate is None:
            return grammar
        return self.reasoning_gate.grammar(grammar, prompt_token_ids)
