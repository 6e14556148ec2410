"""Models in Ollama's store, found by name as `ollama run` finds them: `ollama:NAME[:TAG]`.

The store ($OLLAMA_MODELS, else ~/.ollama/models) keeps one manifest per model and tag,
`manifests/HOST/NAMESPACE/MODEL/TAG` (a bare `llama3.2` is registry.ollama.ai/library/llama3.2,
tag latest), whose layers name content-addressed blobs, `blobs/sha256-HEX`: the weights
(`application/vnd.ollama.image.model`, a GGUF file), the chat template (Go's text/template
syntax), default parameters (JSON: stop strings, temperature, ...) and a system prompt.

pagechat runs the blob as any GGUF. The file's own chat template (Jinja, as the model's makers
wrote it) is used where it has one; Ollama's is translated where it does not and it is of the
single-turn kind ({{ .System }}, {{ .Prompt }}, {{ .Response }}). Stop strings that are one
token end a reply as the end-of-sequence token does; the system prompt is `run`'s default.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from pagechat.core.errors import PagechatError

HOST, NAMESPACE, TAG = "registry.ollama.ai", "library", "latest"
MEDIA = "application/vnd.ollama.image."
_PART = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


def store_root() -> Path:
    """Where Ollama keeps its models."""
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


@dataclass(frozen=True, slots=True)
class OllamaModel:
    """One model and tag of the store: its GGUF blob and what the manifest says beside it."""

    name: str  # as `ollama list` shows it: llama3.2:1b, or user/model:tag
    manifest: Path
    model: Path
    template: str | None = None
    system: str | None = None
    params: dict = field(default_factory=dict)

    @property
    def stops(self) -> tuple[str, ...]:
        """The stop strings of the model's parameters."""
        stop = self.params.get("stop", ())
        stop = [stop] if isinstance(stop, str) else stop
        return tuple(s for s in stop if isinstance(s, str) and s)


def parse_name(ref: str) -> tuple[str, str, str, str]:
    """NAME[:TAG] -> (host, namespace, model, tag), with Ollama's defaults for what is left out;
    PagechatError for a name that is not one (no path may climb out of the store)."""
    name, _, tag = ref.partition(":")
    parts = name.split("/")
    if len(parts) > 3 or not all(_PART.match(p) for p in [*parts, tag or TAG]):
        raise PagechatError(f"ollama:{ref} is not an Ollama model name (NAME[:TAG])")
    host, namespace, model = [HOST, NAMESPACE][: 3 - len(parts)] + parts
    return host, namespace, model, tag or TAG


def _display(host: str, namespace: str, model: str, tag: str) -> str:
    """The name as `ollama list` shows it: the registry and namespace only where not the default."""
    if host != HOST:
        return f"{host}/{namespace}/{model}:{tag}"
    return f"{model}:{tag}" if namespace == NAMESPACE else f"{namespace}/{model}:{tag}"


def _blob(root: Path, digest: object, where: Path) -> Path:
    if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise PagechatError(f"{where}: a layer digest {digest!r} is not sha256:HEX")
    return root / "blobs" / digest.replace(":", "-")


def read_manifest(path: Path, name: str, root: Path) -> OllamaModel:
    """The model a manifest describes; PagechatError naming the manifest when it is broken or its
    weights are missing."""
    try:
        layers = json.loads(path.read_text())["layers"]
        by_type = {layer["mediaType"].split(";")[0]: layer for layer in layers}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise PagechatError(f"{path} is not an Ollama manifest (JSON with layers)") from None
    if MEDIA + "model" not in by_type:
        raise PagechatError(f"{path}: the manifest has no model layer (not a GGUF model)")
    model = _blob(root, by_type[MEDIA + "model"].get("digest"), path)
    if not model.is_file():
        raise PagechatError(f"ollama:{name}: its weights {model} are missing from the store")

    def text(kind: str) -> str | None:
        layer = by_type.get(MEDIA + kind)
        if layer is None:
            return None
        try:
            return _blob(root, layer.get("digest"), path).read_text()
        except (OSError, UnicodeDecodeError):
            raise PagechatError(f"{path}: its {kind} blob cannot be read") from None

    params = text("params")
    try:
        params = json.loads(params) if params else {}
    except json.JSONDecodeError:
        raise PagechatError(f"{path}: its params blob is not JSON") from None
    params = params if isinstance(params, dict) else {}
    return OllamaModel(name, path, model, text("template"), text("system"), params)


def find_model(ref: str) -> OllamaModel:
    """The model `ollama:REF` names; PagechatError saying what is missing where."""
    root = store_root()
    host, namespace, model, tag = parse_name(ref)
    path = root / "manifests" / host / namespace / model / tag
    if not path.is_file():
        if not (root / "manifests").is_dir():
            raise PagechatError(
                f"ollama:{ref}: no Ollama store at {root} (set OLLAMA_MODELS to where it is)"
            )
        raise PagechatError(
            f"ollama:{ref}: not in the Ollama store at {root} (`pagechat models` lists what is)"
        )
    return read_manifest(path, _display(host, namespace, model, tag), root)


def list_models(root: Path | None = None) -> list[OllamaModel]:
    """Every model of the store whose manifest reads (broken ones are left out)."""
    root = root or store_root()
    found = []
    for path in sorted((root / "manifests").glob("*/*/*/*")):
        if not path.is_file():
            continue
        host, namespace, model, tag = path.relative_to(root / "manifests").parts
        try:
            found.append(read_manifest(path, _display(host, namespace, model, tag), root))
        except PagechatError:
            continue
    return found


_ACTION = re.compile(r"{{(-?)\s*(.*?)\s*(-?)}}", re.S)
_FIELDS = {".System": "system", ".Prompt": "prompt", ".Response": "response"}


def jinja_template(go: str) -> str | None:
    """A Jinja chat template from an Ollama template of the single-turn kind (the fields .System,
    .Prompt and .Response, `if` / `else` / `end` on them), rendered once per turn as Ollama renders
    it: the system prompt in the first turn, the last turn cut after .Response; None for any other
    kind (.Messages, tools), which is left to the GGUF's own template."""
    actions = list(_ACTION.finditer(go))
    bounds = zip([0] + [m.end() for m in actions], [m.start() for m in actions] + [len(go)])
    texts = [go[a:b] for a, b in bounds]
    for i, m in enumerate(actions):  # {{- and -}} take the whitespace beside them away
        texts[i] = texts[i].rstrip() if m[1] else texts[i]
        texts[i + 1] = texts[i + 1].lstrip() if m[3] else texts[i + 1]
    out = [_uncut(json.dumps(texts[0]))]
    for m, text in zip(actions, texts[1:]):
        action = m[2]
        if action in _FIELDS:
            out.append(_uncut(_FIELDS[action]))
            if action == ".Response":
                out.append("{% if last %}{% set ns.cut = true %}{% endif %}")
        elif re.fullmatch(r"if (\.System|\.Prompt|\.Response)", action):
            out.append("{% if " + _FIELDS[action[3:]] + " %}")
        elif action in ("else", "end"):
            out.append("{% else %}" if action == "else" else "{% endif %}")
        else:
            return None
        out.append(_uncut(json.dumps(text)))
    return _TURNS.replace("BODY", "".join(out))


def _uncut(expr: str) -> str:
    """A Jinja expression printed unless the last turn was cut after its .Response."""
    return "{% if not ns.cut %}{{ " + expr + " }}{% endif %}"


# turns: (system of the first turn, a user message, the assistant's reply or "" for the last)
_TURNS = """{%- set ns = namespace(system="", cut=false, turns=[]) -%}
{%- for m in messages -%}
{%- if m.role == "system" -%}{%- set ns.system = m.content -%}
{%- elif m.role == "user" -%}{%- set ns.turns = ns.turns + [[m.content, ""]] -%}
{%- elif ns.turns -%}{%- set ns.turns = ns.turns[:-1] + [[ns.turns[-1][0], m.content]] -%}
{%- endif -%}
{%- endfor -%}
{%- for t in ns.turns -%}
{%- set system = ns.system if loop.first else "" -%}
{%- set prompt, response, last = t[0], t[1], loop.last and add_generation_prompt -%}
BODY
{%- endfor -%}"""
