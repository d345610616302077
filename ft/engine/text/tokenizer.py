"""Tokenizer wrapper: Hugging Face `tokenizer.json` files, chat templates and streaming decode.

`Tokenizer.from_dir(path)` reads a checkpoint directory the way Hugging Face tools lay it out:

* `tokenizer.json` (required): the fast-tokenizer pipeline, loaded with the `tokenizers` library;
  a folder with a tiktoken vocabulary instead (`*.tiktoken` and `special_tokens_and_pattern.json`,
  as the Qwen3.5 family publishes it) is converted once (`ft.tools.tiktoken_vocab`);
* `tokenizer_config.json` (optional): special tokens (`eos_token`, `bos_token`, `pad_token`,
  `unk_token`, `added_tokens_decoder`) and `chat_template` (a string, or a list of
  `{"name", "template"}` entries);
* `chat_template.jinja` and `additional_chat_templates/*.jinja` (optional): templates saved as
  separate files, which take precedence over the ones inside tokenizer_config.json;
* `generation_config.json` (optional; `config.json` when it is absent): `eos_token_id`, an int or a
  list, merged into `Tokenizer.eos_token_ids`.

Chat templates render in a sandboxed, immutable Jinja environment that offers the names Hugging Face
templates expect (`raise_exception`, `tojson`, `strftime_now`, `namespace`, the special tokens,
`tools`, `documents`, `add_generation_prompt`), so a checkpoint's own template renders exactly as
`transformers`' `apply_chat_template(..., tokenize=False)` renders it.

`IncrementalDecoder` turns a stream of generated ids into text pieces that never split a UTF-8
character.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import tokenizers

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - depends on the installed version
    _DecodeStream = None

__all__ = ["Tokenizer", "IncrementalDecoder", "ChatTemplateError", "resolve_chat_template"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
ADDITIONAL_CHAT_TEMPLATES_DIR = "additional_chat_templates"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
RESERVED_TEMPLATE_VARIABLES = {
    "messages": "the conversation is the request's `messages`; it cannot also come as a template variable",
    "self": "`self` is Jinja's name for the template itself and cannot be a template variable",
}
"""Template variables a caller's extras may not set (`apply_chat_template`), and why."""
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A chat template is missing, does not compile, or raised an error while rendering."""


# ------------------------------------------------------------------------------------- helpers
def _read_json(path: Path, *, required: bool) -> Any:
    """Parse a JSON file; `None` when it is absent and not required. Errors name the file."""
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path.name} not found in {path.parent} (expected {path})")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: malformed JSON: {e}") from None


def _token_content(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json: a string, or an AddedToken-style dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


# ----------------------------------------------------------------------------- chat templates
@lru_cache(maxsize=32)
def _compile_chat_template(source: str):
    """Compile a chat template once (cached by its source text)."""
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: HF marks assistant tokens with it; renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
                lineno
            )

        @staticmethod
        def _render_body(caller):
            return caller()

    class _Namespace(jinja2.utils.Namespace):
        """`namespace(...)` that refuses underscore attributes (no reaching into internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - mirrors jinja's trick
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                _Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            _Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates may not set underscore attributes on a namespace ({name!r})"
                )

    def raise_exception(message: Any) -> None:
        raise jinja2.exceptions.TemplateError(str(message))

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters; templates expect plain json.dumps.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["namespace"] = _Namespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template does not compile (line {e.lineno}): {e.message}") from None


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON-like types (the sandbox only ever sees those)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    dump = getattr(value, "model_dump", None)  # pydantic objects
    if callable(dump):
        return _plain(dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Iterable[Any]) -> list[dict[str, Any]]:
    out = []
    for i, message in enumerate(messages):
        message = _plain(message)
        if not isinstance(message, dict):
            raise ValueError(f"chat message {i} is not a dict: {message!r}")
        # APIs send `content: null` / `tool_calls: null`; templates handle a missing key better.
        message = {k: v for k, v in message.items() if v is not None}
        # Reasoning arrives under several names; templates read `reasoning_content` (gpt-oss
        # templates read `thinking`). Fill both, as transformers does.
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def resolve_chat_template(value: str) -> str:
    """`--chat-template`'s value -> the template's text: the contents of the file it names, else
    the value itself when it reads as Jinja (it has "{{" or "{%"). The text is compiled, so a
    template that does not compile fails here. Raises ChatTemplateError, one line, for that and for
    anything else (a missing or unreadable file, a directory)."""
    if os.path.isfile(value):  # never raises, even for template text too long to be a file name
        try:
            text = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e
            raise ChatTemplateError(f"--chat-template: cannot read {value}: {why}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        text = None
    if text is not None:
        try:
            _compile_chat_template(text)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"--chat-template: {e}") from None
        return text
    if os.path.isdir(value):
        raise ChatTemplateError(f"--chat-template: {value} is a directory, not a template file")
    raise ChatTemplateError(f"--chat-template: no file {value} (and the value is not template text: it has no "
                            "{{ or {%)")


# ----------------------------------------------------------------------------------- tokenizer
class Tokenizer:
    """A checkpoint's tokenizer: encode/decode, special tokens, EOS ids and its chat template."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        config: Mapping[str, Any] | None = None,
        chat_templates: Mapping[str, str] | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        source: str | None = None,
    ) -> None:
        self._tok = tokenizer
        self._config = dict(config or {})
        self._source = source or "<in-memory tokenizer>"
        self._chat_templates: dict[str, str] = dict(chat_templates or {})

        # Tokens that tokenizer_config.json declares but tokenizer.json lacks are added, as HF does.
        decoder = self._config.get("added_tokens_decoder") or {}
        if isinstance(decoder, Mapping):
            missing = []
            for _, entry in sorted(decoder.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
                content = _token_content(entry)
                if content is not None and self._tok.token_to_id(content) is None:
                    special = bool(entry.get("special", True)) if isinstance(entry, Mapping) else True
                    missing.append(tokenizers.AddedToken(content, special=special, normalized=False))
            for token in missing:
                if token.special:
                    self._tok.add_special_tokens([token])
                else:
                    self._tok.add_tokens([token])

        self._special_tokens: dict[str, str | None] = {
            key: _token_content(self._config.get(key)) for key in _SPECIAL_TOKEN_KEYS
        }
        eos_ids = set(int(i) for i in extra_eos_token_ids)
        eos_tok = self._special_tokens["eos_token"]
        if eos_tok is not None:
            eos_id = self._tok.token_to_id(eos_tok)
            if eos_id is not None:
                eos_ids.add(eos_id)
        self._eos_token_ids = frozenset(eos_ids)

    # ------------------------------------------------------------------------------- loading
    @classmethod
    def from_dir(
        cls,
        path: str | os.PathLike[str],
        *,
        chat_template: str | None = None,
        model_dir: str | os.PathLike[str] | None = None,
    ) -> "Tokenizer":
        """Load the tokenizer files of a checkpoint directory (see the module docstring).

        `chat_template` (`--chat-template`): a template file's path or the template text
        (`resolve_chat_template`); it replaces every template the directory has, and is compiled
        here, so a bad one fails at load. `model_dir` (when the tokenizer comes from another
        directory than the checkpoint, `--tokenizer`): where generation_config.json / config.json,
        and so the EOS ids, are read; default `path`.
        """
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"tokenizer directory {root} does not exist")
        tok_path = root / TOKENIZER_FILE
        if not tok_path.is_file():
            from ft.tools.tiktoken_vocab import ensure_tokenizer_json, find_tiktoken_files

            if find_tiktoken_files(root) is not None:  # a tiktoken vocabulary: converted once, cached
                return cls.from_dir(ensure_tokenizer_json(root), chat_template=chat_template, model_dir=model_dir)
        if not tok_path.is_file():
            raise FileNotFoundError(
                f"{TOKENIZER_FILE} not found in {root}: FreeToken needs a Hugging Face fast-tokenizer "
                f"file ({tok_path})"
            )
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust side raises a plain Exception on bad input
            raise ValueError(f"{tok_path}: malformed tokenizer file: {e}") from None

        config = _read_json(root / TOKENIZER_CONFIG_FILE, required=False) or {}
        if not isinstance(config, dict):
            raise ValueError(f"{root / TOKENIZER_CONFIG_FILE}: expected a JSON object")

        templates = cls._templates_from_config(config, root / TOKENIZER_CONFIG_FILE)
        jinja_file = root / CHAT_TEMPLATE_FILE
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        extra_dir = root / ADDITIONAL_CHAT_TEMPLATES_DIR
        if extra_dir.is_dir():
            for f in sorted(extra_dir.glob("*.jinja")):
                templates[f.stem] = f.read_text(encoding="utf-8")

        if chat_template is not None:
            templates = {"default": resolve_chat_template(chat_template)}

        # generation_config.json is what generation stops on; HF derives it from config.json
        # when the file is absent, so fall back to config.json's eos_token_id then. Both describe
        # the model, so they are read from the checkpoint even when the tokenizer is elsewhere.
        eos_ids: list[int] = []
        gen_root = Path(model_dir) if model_dir is not None else root
        gen = _read_json(gen_root / GENERATION_CONFIG_FILE, required=False)
        if isinstance(gen, dict) and "eos_token_id" in gen:
            eos_ids = _as_id_list(gen.get("eos_token_id"))
        elif gen is None:
            try:
                model_cfg = _read_json(gen_root / MODEL_CONFIG_FILE, required=False)
            except ValueError:
                model_cfg = None  # config.json errors are the model loader's to report
            if isinstance(model_cfg, dict):
                eos_ids = _as_id_list(model_cfg.get("eos_token_id"))

        return cls(tok, config=config, chat_templates=templates, extra_eos_token_ids=eos_ids,
                   source=str(root))

    @staticmethod
    def _templates_from_config(config: Mapping[str, Any], where: Path) -> dict[str, str]:
        raw = config.get("chat_template")
        if raw is None:
            return {}
        if isinstance(raw, str):
            return {"default": raw}
        if isinstance(raw, list):
            out = {}
            for entry in raw:
                if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                        and isinstance(entry.get("template"), str)):
                    raise ValueError(
                        f"{where}: chat_template list entries must be {{'name': str, 'template': str}}"
                    )
                out[entry["name"]] = entry["template"]
            return out
        raise ValueError(f"{where}: chat_template must be a string or a list of named templates")

    # ------------------------------------------------------------------------------ encoding
    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) map to their ids.
        A long text goes through `encode_batch_fast`, which releases the GIL while it works (`encode`
        holds it: a server thread tokenizing a megabyte prompt would stall the event loop) and keeps
        no offsets (a 7 MB prompt: 3.2 s instead of 4.6 s, and less memory at the peak)."""
        if len(text) > 16384:
            return self._fast_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._fast_batch(list(texts), add_special_tokens=add_special_tokens)]

    @property
    def _fast_batch(self):
        """`encode_batch_fast` (tokenizers >= 0.20: no offsets kept), else `encode_batch`: the same ids."""
        return getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # -------------------------------------------------------------------------- special tokens
    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end generation: tokenizer_config's eos_token plus generation_config's eos ids."""
        return self._eos_token_ids

    @property
    def eos_token(self) -> str | None:
        return self._special_tokens["eos_token"]

    @property
    def bos_token(self) -> str | None:
        return self._special_tokens["bos_token"]

    @property
    def pad_token(self) -> str | None:
        return self._special_tokens["pad_token"]

    @property
    def unk_token(self) -> str | None:
        return self._special_tokens["unk_token"]

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self._id_of(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self._id_of(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self._id_of(self.pad_token)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of every added token marked special (decode(skip_special_tokens=True) drops them)."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    # ------------------------------------------------------------------------- chat templates
    @property
    def chat_template(self) -> str | None:
        """The default chat template's source, or None when the checkpoint has none."""
        return self._chat_templates.get("default") or (
            next(iter(self._chat_templates.values())) if len(self._chat_templates) == 1 else None
        )

    @property
    def chat_templates(self) -> dict[str, str]:
        """All named chat templates (`default`, `tool_use`, ...)."""
        return dict(self._chat_templates)

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        if chat_template is not None:
            if chat_template in self._chat_templates:
                return self._chat_templates[chat_template]
            if "{" in chat_template:  # a template source passed directly
                return chat_template
            raise ChatTemplateError(
                f"no chat template named {chat_template!r} for {self._source} "
                f"(have: {', '.join(sorted(self._chat_templates)) or 'none'})"
            )
        if not self._chat_templates:
            raise ChatTemplateError(
                f"the tokenizer at {self._source} has no chat template: neither "
                f"{TOKENIZER_CONFIG_FILE} ('chat_template') nor {CHAT_TEMPLATE_FILE} provides one; "
                "send a plain prompt instead of chat messages, or give the server one (--chat-template)"
            )
        if tools and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        if len(self._chat_templates) == 1:
            return next(iter(self._chat_templates.values()))
        raise ChatTemplateError(
            f"{self._source} has several chat templates and none is named 'default' "
            f"({', '.join(sorted(self._chat_templates))}); pass chat_template=<name>"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Render `messages` (OpenAI-style dicts) into the prompt text the model was trained on.

        Extra keyword arguments reach the template as variables (`tools`, `documents`,
        `enable_thinking`, ...); `chat_template=` picks a named template or passes a template source.
        ChatTemplateError for an extra named like a variable the rendering sets itself (`messages`)
        or that Jinja reserves (`self`): it would be dropped or break the render, not reach the template.
        """
        import jinja2

        for name in RESERVED_TEMPLATE_VARIABLES:
            if name in extra:
                raise ChatTemplateError(f"chat_template_kwargs.{name}: {RESERVED_TEMPLATE_VARIABLES[name]}")

        chat_template = extra.pop("chat_template", None)
        tools = extra.pop("tools", None)
        documents = extra.pop("documents", None)
        source = self._select_template(chat_template, tools)
        template = _compile_chat_template(source)

        # Like transformers: only the special tokens that are set are defined in the template.
        context: dict[str, Any] = {k: v for k, v in self._special_tokens.items() if v is not None}
        context.update(_plain(extra))
        context.update(
            messages=_normalize_messages(messages),
            tools=_plain(tools) if tools is not None else None,
            documents=_plain(documents) if documents is not None else None,
            add_generation_prompt=bool(add_generation_prompt),
        )
        try:
            return template.render(**context)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e}") from None
        except Exception as e:  # noqa: BLE001 - a template's own runtime error (1/0, range(10**9)): the template's fault
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> list[int]:
        """`encode(apply_chat_template(...))`: the prompt ids of a conversation."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **extra))

    def incremental_decoder(
        self, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True
    ) -> "IncrementalDecoder":
        return IncrementalDecoder(self, prompt_ids=prompt_ids, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer({self._source!r}, vocab_size={self.vocab_size})"


from ft.engine.text.detokenizer import IncrementalDecoder  # noqa: E402  (re-exported; it needs Tokenizer)
