"""Function spec files (``function.toml``): read, check, and turn into a :class:`FunctionSpec`.

The file's format is the README's ("Your own functions") and is mirrored by :class:`SpecFile`
(msgspec decodes the TOML into it, refusing unknown keys, so a typo'd key is an error naming
it); :func:`load_spec` then applies the cross-field rules and the defaults that depend on other
fields (by kind, by emulation model) and returns a :class:`LoadedSpec`: the spec with ``code``
empty, plus the resolved code folder that ``dilu deploy`` uploads.

Every problem is a :class:`SpecError`: one line naming the file and the field, e.g.
``function.toml: slo_ms: Expected number, got str``. Names are refused, never sanitised.
"""
from __future__ import annotations

import keyword
import math
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from dilu.contracts.events import FunctionKind, FunctionSpec, PriorityClass, Profile
from dilu.services.common import files, functions, models
from dilu.services.common.invoke import MAX_TIMEOUT_S

NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,63}")
NAME_RULE = "1..63 characters of A-Z a-z 0-9 _ -"  # NAME_RE in words, for every message about a name
NAME_SHOWN = 40  # characters of a bad name a message repeats: enough to recognise it, never a wall of text

MAX_BATCH_LIMIT = 1024
MAX_MEMORY_BYTES = 2**50  # the events' Bytes bound (1 PiB)
DEFAULT_MAX_BATCH = 8
DEFAULT_MAX_INSTANCES = 8
MAX_INSTANCES_LIMIT = 1024  # instances of one function: more is a typo, not a plan
MAX_DURATION_MS = MAX_TIMEOUT_S * 1000.0  # slo_ms, ttft_ms, tpot_ms, cold_start_ms: no caller waits longer
MAX_KEEP_ALIVE_S = 7 * 86_400.0  # a week: longer is what min_instances is for


def name_problem(name: str) -> str | None:
    """Why ``name`` is not a function name (``NAME_RE``), in one line that shows at most its first
    ``NAME_SHOWN`` characters; None when it is one."""
    if NAME_RE.fullmatch(name):
        return None
    shown = name if len(name) <= NAME_SHOWN else name[:NAME_SHOWN] + "..."
    return f"{shown!r} is not a function name ({NAME_RULE})"


class SpecError(ValueError):
    """A spec file that cannot be used; the message is one line: ``<file>: <field>: <why>``
    (a line break taken from the file, e.g. in a quoted key, is written as its escape)."""

    def __init__(self, message: str) -> None:
        super().__init__(_LINE_BREAK.sub(lambda m: m.group().encode("unicode_escape").decode(), message))


# every character str.splitlines() breaks on
_LINE_BREAK = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


class EmulationTable(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[emulation]``: ``model`` is a catalogue model (:data:`dilu.services.common.models.MODELS`)."""

    model: str = ""


class ProfileTable(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[profile]``: the operator's profile; quotas are fractions 0..1 of one GPU."""

    request_quota: float
    limit_quota: float
    batch_size: int


class SpecFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The spec file as written (keys as in the file). UNSET: not given, a default applies that
    may depend on other keys (see :func:`load_spec`)."""

    name: str
    entry: str = ""
    code: str | UnsetType = UNSET  # with an entry: "." (the spec's own folder)
    kind: FunctionKind = "inference"
    priority: PriorityClass | UnsetType = UNSET
    slo_ms: float | UnsetType = UNSET
    ttft_ms: float | UnsetType = UNSET
    tpot_ms: float | UnsetType = UNSET
    max_batch: int = DEFAULT_MAX_BATCH
    memory_bytes: int | UnsetType = UNSET
    min_instances: int | UnsetType = UNSET
    max_instances: int = DEFAULT_MAX_INSTANCES
    initial_scale: int = -1
    keep_alive_s: float = 0.0
    cold_start_ms: float | UnsetType = UNSET
    emulation: EmulationTable | UnsetType = UNSET
    profile: ProfileTable | UnsetType = UNSET
    config: dict[str, Any] = {}  # values checked by hand, so an error can name the key


@dataclass(frozen=True)
class LoadedSpec:
    """A checked spec and the folder to ship with it.

    ``spec.code`` is empty until ``deploy`` uploads ``code_dir`` (an absolute path) and sets it
    to the bundle key; ``code_dir`` is None when nothing is shipped (an emulated-only function,
    or ``code = ""``: the entry is importable on every node as it is).
    """

    spec: FunctionSpec
    code_dir: Path | None


# msgspec's type names in its messages -> the words a TOML author knows
_TYPE_WORDS = (("`float`", "number"), ("`int`", "integer"), ("`str`", "string"), ("`object`", "table"),
               ("`array`", "array"), ("`bool`", "boolean"))
_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)  # keys may hold line breaks


def _known(struct: type[msgspec.Struct]) -> str:
    return ", ".join(f.encode_name for f in msgspec.structs.fields(struct))


def _tables() -> dict[str, type[msgspec.Struct]]:
    return {"": SpecFile, "emulation": EmulationTable, "profile": ProfileTable}


def _field_type(path: str) -> object:
    """The annotated type of the spec file's key at ``path`` (``kind``, ``emulation.model``),
    None where there is none."""
    *table, key = path.split(".") if path else [""]
    struct = _tables().get(".".join(table))
    if struct is None:
        return None
    hints = typing.get_type_hints(struct, include_extras=False)
    by_name = {f.encode_name: f.name for f in msgspec.structs.fields(struct)}
    return hints.get(by_name.get(key, key))


def _validation_message(source: str, exc: msgspec.ValidationError) -> str:
    """msgspec's ``Expected `float`, got `str` - at `$.slo_ms``` -> ``<file>: slo_ms: Expected number, got str``."""
    m = _AT.match(str(exc))
    msg, path = m.group("msg"), (m.group("path") or "").lstrip(".")
    unknown = re.match(r"Object contains unknown field `(.+)`", msg, re.DOTALL)
    if unknown:
        table = _tables().get(path, SpecFile)
        field = f"{path}.{unknown.group(1)}" if path else unknown.group(1)
        hint = ""
        if path and unknown.group(1) in {f.encode_name for f in msgspec.structs.fields(SpecFile)}:
            hint = f"; a key written below [{path}] belongs to that table: move it above the first [table]"
        return (f"{source}: {field}: unknown key (known keys{' of [' + path + ']' if path else ''}: "
                f"{_known(table)}){hint}")
    missing = re.match(r"Object missing required field `(.+)`", msg, re.DOTALL)
    if missing:
        field = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return f"{source}: {field}: required"
    enum = re.match(r"Invalid enum value (.+)", msg, re.DOTALL)
    if enum:
        field_type = _field_type(path)
        options = (field_type,) if typing.get_origin(field_type) is typing.Literal else typing.get_args(field_type)
        allowed = [v for t in options if typing.get_origin(t) is typing.Literal for v in typing.get_args(t)]
        if allowed:
            return f"{source}: {path}: {enum.group(1)} is not one of {', '.join(map(str, allowed))}"
    msg = msg.replace(" | null", "")
    for typ, word in _TYPE_WORDS:
        msg = msg.replace(typ, word)
    msg = msg.replace("`", "")
    return f"{source}: {path or '(file)'}: {msg}"


class _Checker:
    """Collects the first broken rule as a SpecError naming the file and the field."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, why: str) -> None:
        raise SpecError(f"{self.source}: {field}: {why}")

    def number(self, field: str, value: float, *, gt: float | None = None, ge: float | None = None,
               le: float | None = None) -> float:
        """A finite number within the bounds; returns it as float."""
        if not math.isfinite(value):
            self.fail(field, f"{value} is not a finite number")
        if gt is not None and not value > gt:
            self.fail(field, f"must be > {gt:.15g}, got {value:g}")
        if ge is not None and not value >= ge:
            self.fail(field, f"must be >= {ge:.15g}, got {value:g}")
        if le is not None and not value <= le:
            self.fail(field, f"must be <= {le:.15g}, got {value:g}")
        return float(value)

    def integer(self, field: str, value: int, lo: int, hi: int | None = None) -> int:
        if value < lo or (hi is not None and value > hi):
            bounds = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            self.fail(field, f"must be {bounds}, got {value}")
        return value


def check_entry(entry: str) -> str | None:
    """None when ``entry`` is ``module:Name`` (a dotted module path of identifiers, a class
    identifier); otherwise why not."""
    module, sep, name = entry.partition(":")
    if not sep or not module or not name:
        return f"{entry!r} is not of the form module:Class (e.g. classifier:ImageClassifier)"
    for part in module.split(".") + [name]:
        if not part.isidentifier() or keyword.iskeyword(part):
            return f"{part!r} in {entry!r} is not a Python identifier"
    return None


def _given(value: Any) -> bool:
    return value is not UNSET


SPEC_FILE_NAME = "function.toml"  # the spec file a function's folder holds (examples/*/function.toml)
SPEC_MAX_BYTES = files.MiB  # a spec is a few hundred bytes; more is not a spec file


def parse_spec(text: str | bytes, *, source: str = SPEC_FILE_NAME, base_dir: str | os.PathLike | None = None) -> LoadedSpec:
    """Check the TOML ``text`` of a spec file and build its :class:`LoadedSpec`.

    ``source`` names the file in errors; ``base_dir``: the folder ``code`` is relative to (the
    spec file's folder; default the current one). Raises :class:`SpecError` (one line).
    """
    # a UTF-8 byte-order mark (editors on Windows write one) says nothing; the TOML parser
    # would call it an "invalid statement"
    text = text.removeprefix(b"\xef\xbb\xbf") if isinstance(text, bytes) else text.removeprefix("\ufeff")
    if isinstance(text, bytes):
        try:
            text.decode()
        except UnicodeDecodeError:  # the parser would quote the codec's words about one byte
            raise SpecError(f"{source}: not valid TOML: not a text file (not UTF-8)") from None
    try:
        raw = msgspec.toml.decode(text, type=SpecFile)
    except msgspec.ValidationError as exc:
        raise SpecError(_validation_message(source, exc)) from None
    except msgspec.DecodeError as exc:
        raise SpecError(f"{source}: not valid TOML: {exc}") from None
    except RecursionError:  # arrays or tables nested past the parser's recursion limit
        raise SpecError(f"{source}: not valid TOML: nested too deeply") from None
    c = _Checker(source)
    why = name_problem(raw.name)
    if why:
        c.fail("name", why)
    model = _model(c, raw)
    if raw.entry:
        why = check_entry(raw.entry)
        if why:
            c.fail("entry", why)
    elif not model:
        c.fail("entry", "required (module:Class) unless the function is emulated-only ([emulation] model)")
    slo_ms, ttft_ms, tpot_ms = _objectives(c, raw)
    max_batch = c.integer("max_batch", raw.max_batch, 1, MAX_BATCH_LIMIT)
    memory = _memory(c, raw, model)
    min_instances, max_instances, initial_scale = _scale(c, raw)
    spec = FunctionSpec(
        name=raw.name,
        model=model,
        kind=raw.kind,
        slo_ms=slo_ms,
        ttft_ms=ttft_ms,
        tpot_ms=tpot_ms,
        memory_bytes=memory,
        entry=raw.entry,
        priority=raw.priority if _given(raw.priority) else functions.default_priority(raw.kind),
        max_batch=max_batch,
        min_instances=min_instances,
        max_instances=max_instances,
        initial_scale=initial_scale,
        keep_alive_s=c.number("keep_alive_s", raw.keep_alive_s, ge=0, le=MAX_KEEP_ALIVE_S),
        cold_start_ms=_cold_start(c, raw, model),
        profile=_profile(c, raw, max_batch),
        config=_config(c, raw),
    )
    if raw.entry:
        spec.handler = ""  # the entry wins; the handler default is the emulated one
    return LoadedSpec(spec=spec, code_dir=_code_dir(c, raw, base_dir))


def load_spec(path: str | os.PathLike) -> LoadedSpec:
    """Read and check the spec file at ``path``, or the ``function.toml`` of the folder ``path``
    (see :func:`parse_spec`); ``code`` resolves relative to the file's folder. Raises
    :class:`SpecError` (also for a missing or unreadable file)."""
    p = Path(path) / SPEC_FILE_NAME if Path(path).is_dir() else Path(path)
    try:
        text = files.read_bounded(p, SPEC_MAX_BYTES)
    except OSError as exc:
        raise SpecError(f"{p}: cannot read the spec file: {exc.strerror or exc}") from None
    return parse_spec(text, source=str(p), base_dir=p.resolve().parent)


def _model(c: _Checker, raw: SpecFile) -> str:
    model = raw.emulation.model if _given(raw.emulation) else ""
    if model and model not in models.MODELS:
        c.fail("emulation.model", f"unknown model {model!r} (known: {', '.join(sorted(models.MODELS))})")
    return model


def _objectives(c: _Checker, raw: SpecFile) -> tuple[float, float, float]:
    """(slo_ms, ttft_ms, tpot_ms) by kind: inference needs slo_ms; llm needs ttft_ms and
    tpot_ms (slo_ms derived unless given); training takes none."""
    for field in ("ttft_ms", "tpot_ms"):
        if raw.kind != "llm" and _given(getattr(raw, field)):
            c.fail(field, f"only llm functions have a {field} objective (kind is {raw.kind!r})")
    if raw.kind == "training":
        if _given(raw.slo_ms):
            c.fail("slo_ms", "training functions take no requests, so have no slo_ms")
        return 0.0, 0.0, 0.0
    if raw.kind == "inference":
        if not _given(raw.slo_ms):
            c.fail("slo_ms", "required for inference functions (latency objective of one request, ms)")
        return c.number("slo_ms", raw.slo_ms, gt=0, le=MAX_DURATION_MS), 0.0, 0.0
    values = {}
    for field in ("ttft_ms", "tpot_ms"):
        if not _given(getattr(raw, field)):
            c.fail(field, "required for llm functions (time to first token / per output token, ms)")
        values[field] = c.number(field, getattr(raw, field), gt=0, le=MAX_DURATION_MS)
    slo = c.number("slo_ms", raw.slo_ms, gt=0, le=MAX_DURATION_MS) if _given(raw.slo_ms) else 0.0
    slo = functions.request_slo_ms("llm", slo_ms=slo, **values)
    return slo, values["ttft_ms"], values["tpot_ms"]


def _memory(c: _Checker, raw: SpecFile, model: str) -> int:
    if _given(raw.memory_bytes):
        return c.integer("memory_bytes", raw.memory_bytes, 1, MAX_MEMORY_BYTES)
    if model:
        return models.memory_bytes(model)
    c.fail("memory_bytes", "required (device memory of one instance, bytes) unless [emulation] model is set")
    return 0  # not reached


def _scale(c: _Checker, raw: SpecFile) -> tuple[int, int, int]:
    default_min = 1 if raw.kind == "training" else 0
    lo = (c.integer("min_instances", raw.min_instances, 0, MAX_INSTANCES_LIMIT) if _given(raw.min_instances)
          else default_min)
    if 1 <= raw.max_instances < lo:  # in range on its own: the pair is what is wrong
        default = " (the default)" if raw.max_instances == DEFAULT_MAX_INSTANCES else ""
        c.fail("max_instances", f"must be >= min_instances ({lo}), got {raw.max_instances}{default}")
    hi = c.integer("max_instances", raw.max_instances, max(1, lo), MAX_INSTANCES_LIMIT)
    initial = c.integer("initial_scale", raw.initial_scale, -1, hi)
    return lo, hi, initial


def _cold_start(c: _Checker, raw: SpecFile, model: str) -> float:
    if _given(raw.cold_start_ms):
        return c.number("cold_start_ms", raw.cold_start_ms, ge=0, le=MAX_DURATION_MS)
    return models.cold_start_ms(model) if model else 0.0


def _profile(c: _Checker, raw: SpecFile, max_batch: int) -> Profile | None:
    if not _given(raw.profile):
        return None
    p = raw.profile
    request = c.number("profile.request_quota", p.request_quota, gt=0, le=1)
    limit = c.number("profile.limit_quota", p.limit_quota, ge=request, le=1)
    batch = c.integer("profile.batch_size", p.batch_size, 1, max_batch)
    return Profile(function=raw.name, request_quota=request, limit_quota=limit, batch_size=batch, backend="operator")


def _config(c: _Checker, raw: SpecFile) -> dict[str, str]:
    for key, value in raw.config.items():
        if not isinstance(value, str):
            c.fail(f"config.{key}", f"values are strings, got {type(value).__name__} (quote it: {key} = \"{value}\")")
    return dict(raw.config)


def _code_dir(c: _Checker, raw: SpecFile, base_dir: str | os.PathLike | None) -> Path | None:
    if not raw.entry:
        if _given(raw.code) and raw.code:  # a folder that would silently not be shipped
            c.fail("code", "a code folder is shipped only with an entry (module:Class) to run from it; "
                           "this function is emulated-only")
        return None  # emulated-only: no user code runs
    code = raw.code if _given(raw.code) else "."
    if not code:
        return None  # the entry is importable on every node as it is
    try:
        folder = (Path(base_dir or ".") / code).resolve()
        is_dir = folder.is_dir()
    except (OSError, ValueError) as exc:  # e.g. a NUL in the path, a name too long
        c.fail("code", f"{code!r} is not a usable folder path: {exc}")
    if not is_dir:
        c.fail("code", f"folder {str(folder)!r} does not exist or is not a folder")
    return folder


__all__ = ["LoadedSpec", "SpecError", "SpecFile", "load_spec", "parse_spec", "check_entry"]
