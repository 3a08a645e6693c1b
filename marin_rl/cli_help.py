"""The command line's guide to a config class: `--help` lists a run's own keys, an unknown key is one line.

`preflight(RunConfig, args)` runs before draccus sees the arguments. `--help` (or `-h`) prints every key of the
config as a dotted path with its type, value (the `--config` file's, else the default) and description, section by
section; a choice type (the model's `architecture`) shows only the chosen type's fields. `--help SECTION` prints a
section's descriptions whole; `--help-all` is draccus' own listing of every key of every type. A key that the config
class does not have, on the command line or in the `--config` file, ends the program with one line that names it and
the nearest valid key. `placeholder_fields` finds values such as `gs://YOUR_BUCKET/...` left in an example config.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import enum
import functools
import json
import re
import shutil
import sys
import textwrap
import types
import typing
from typing import Any

import draccus
from draccus.choice_types import CHOICE_TYPE_KEY
from draccus.wrappers.docstring import get_attribute_docstring, get_preferred_help_text

HELP_FLAGS = ("--help", "-h")
HELP_ALL = "--help-all"
CONFIG_FLAGS = ("--config", "--config_path")
PLACEHOLDER = re.compile(r"\bYOUR_[A-Z0-9_]+")
"""A value an example config leaves for the user to fill in (`gs://YOUR_BUCKET/...`)."""


# ---- the command line ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CommandLine:
    """The arguments as draccus will read them: the config file, the `--key value` overrides, the help flags."""

    config_path: str | None = None
    overrides: list[tuple[str, str | None]] = dataclasses.field(default_factory=list)
    """(dotted key, value) in order; the value is None when the key is the last argument."""
    help: bool = False
    help_all: bool = False
    help_topic: str | None = None
    """`--help SECTION`: the key prefix whose descriptions to print whole."""


def split_command_line(args: list[str]) -> CommandLine:
    """Read `args` (`--config FILE`, `--key value` or `--key=value`, `--help [SECTION]`, `-h`, `--help-all`)."""
    out = CommandLine()
    i = 0
    while i < len(args):
        a = args[i]
        nxt = args[i + 1] if i + 1 < len(args) else None
        takes_next = nxt is not None and not nxt.startswith("--")
        if a in HELP_FLAGS:
            out.help = True
            if takes_next and not nxt.startswith("-"):
                out.help_topic = nxt.removeprefix("--")
                i += 1
        elif a == HELP_ALL:
            out.help_all = True
        elif a.startswith("--"):
            key, eq, value = a[2:].partition("=")
            if not eq:
                value = nxt if takes_next else None
                i += 1 if takes_next else 0
            if "--" + key in CONFIG_FLAGS:
                out.config_path = value
            else:
                out.overrides.append((key, value))
        i += 1
    return out


def program() -> str:
    """How this program was started, for the usage line: `python -m marin_rl.<program>` (default: run)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return f"python -m {name}" if name.startswith("marin_rl.") else "python -m marin_rl.run"


RUN_EXAMPLE = ("experiments/quickstart.yaml", "--orchestrator.num_steps 50 --output_dir runs/short")
"""`--help`'s example for `marin_rl.run`: a config file and overrides to try with it."""


def preflight(
    config_class: type, args: list[str], prog: str | None = None, example: tuple[str, str] = RUN_EXAMPLE
) -> None:
    """Before draccus parses `args` into `config_class`: print the help and exit (0) for `--help`, `-h` or
    `--help-all`; exit with one line naming an unknown key (on the command line or in the `--config` file) and the
    nearest valid one. Returns when there is nothing to say, and leaves everything else to draccus. `example`: (a
    config file, overrides) shown in the help's examples."""
    prog = prog or program()
    line = split_command_line(args)
    if line.help_all:
        draccus.parse(config_class, args=["--help"], prog=prog)  # prints draccus' listing and exits
    raw_file = _load_file(line.config_path)
    if line.help:
        print(render_help(config_class, line, prog, raw_file, example))
        raise SystemExit(0)
    if raw_file is None:
        return  # draccus names a missing or unreadable file
    merged = _merge(raw_file, line.overrides)
    bad_choice = unknown_choice(config_class, merged)
    if bad_choice:
        raise SystemExit(f"marin_rl: invalid configuration: {bad_choice}")
    for key, _ in line.overrides:
        if not cli_key_known(config_class, key, merged):
            message = unknown_key_message(config_class, key, merged, prefix="--")
            raise SystemExit(f"marin_rl: invalid configuration: {message}")
    bad = _first_unknown_in_file(config_class, raw_file, merged, "")
    if bad:
        message = unknown_key_message(config_class, bad, merged, prefix="", where=line.config_path)
        raise SystemExit(f"marin_rl: invalid configuration: {message}")


def _load_file(path: str | None) -> dict | None:
    """The `--config` file as a dict ({} without one); None when it cannot be read (draccus then says why)."""
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            raw = draccus.cfgparsing.load_config(f, file=path)
    except Exception:  # missing, unreadable or not YAML: draccus reports it in its own words
        return None
    return raw if isinstance(raw, dict) else None


def _merge(raw: dict, overrides: list[tuple[str, str | None]]) -> dict:
    """The file's dict with the overrides' values set at their dotted paths (what decides a choice type)."""
    out = copy.deepcopy(raw)
    for key, value in overrides:
        parts = key.split(".")
        node = out
        for p in parts[:-1]:
            if not isinstance(node.get(p), dict):
                node[p] = {}
            node = node[p]
        node[parts[-1]] = value
    return out


# ---- the schema: what keys a config class has ----------------------------------------------------------------------


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation (the annotation's text where it does not resolve)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a forward reference that does not resolve here: draccus would fail on it too
        hints = {}
    return {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls)}


def _strip_optional(t: Any) -> Any:
    if typing.get_origin(t) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return t


def _is_choice(t: Any) -> bool:
    return draccus.utils.is_choice_type(t)


def _is_dataclass_type(t: Any) -> bool:
    return isinstance(t, type) and dataclasses.is_dataclass(t)


def _list_item_dataclass(t: Any) -> type | None:
    if typing.get_origin(t) in (list, tuple, typing.List, typing.Tuple):  # noqa: UP006
        args = [a for a in typing.get_args(t) if a is not Ellipsis]
        if len(args) == 1 and _is_dataclass_type(_strip_optional(args[0])):
            return _strip_optional(args[0])
    return None


def _default(f: dataclasses.Field) -> Any:
    try:
        value = draccus.utils.default_value(f)
    except Exception:  # a default factory that needs more than nothing
        return dataclasses.MISSING
    return value


def _chosen_class(choice: type, raw: Any, default: Any) -> type | None:
    """The class a choice field decodes to: `type:` in the config, else the default value's class, else the
    registry's default choice."""
    name = raw.get(CHOICE_TYPE_KEY) if isinstance(raw, dict) else None
    if name is not None:
        return choice.get_known_choices().get(str(name))
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
        return type(default)
    name = choice.default_choice_name()
    return choice.get_known_choices().get(name) if name else None


def _child(cls: type, name: str, raw: Any, default: Any) -> tuple[str, Any, Any, Any]:
    """(kind, class, raw value, default value) of field `name` of `cls`: kind is 'dataclass', 'choice', 'list' (of
    dataclasses: class is the item's), or 'leaf'. The default is the parent default's value when the config does not
    give the parent, else the field's own default (as draccus decodes)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    t = _strip_optional(_field_types(cls)[name])
    child_raw = raw.get(name) if isinstance(raw, dict) else None
    if isinstance(raw, dict) or default is None or default is dataclasses.MISSING:
        child_default = _default(f)
    else:
        child_default = getattr(default, name, dataclasses.MISSING)
    if _is_choice(t):
        return "choice", _chosen_class(t, child_raw, child_default), child_raw, child_default
    if _is_dataclass_type(t):
        return "dataclass", t, child_raw, child_default
    item = _list_item_dataclass(t)
    if item is not None:
        return "list", item, child_raw, child_default
    return "leaf", t, child_raw, child_default


def valid_keys(cls: type, raw: Any, default: Any = None, prefix: str = "", lists: bool = True) -> list[str]:
    """Every dotted key of `cls` (sections too) given the config `raw` (which decides choice types); list items as
    `name[i].key` for the items `raw` has, or `name[*].key`, unless `lists` is False (the command line cannot
    address them)."""
    out = []
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        out.append(key)
        kind, sub, child_raw, child_default = _child(cls, f.name, raw, default)
        if kind == "choice":
            out.append(f"{key}.{CHOICE_TYPE_KEY}")
        if kind in ("choice", "dataclass") and sub is not None:
            out += valid_keys(sub, child_raw, child_default, key + ".", lists)
        elif kind == "list" and lists:
            items = child_raw if isinstance(child_raw, list) and child_raw else [None]
            for i, item in enumerate(items):
                index = "*" if item is None else str(i)
                out += valid_keys(sub, item if isinstance(item, dict) else {}, None, f"{key}[{index}].", lists)
    return out


def _first_unknown_in_file(cls: type, raw: Any, merged: Any, prefix: str) -> str | None:
    """The first key of the config file `raw` that `cls` lacks (a dotted path, list items as `name[i]`); choice
    types are those of `merged` (the file with the command line's overrides)."""
    if not isinstance(raw, dict):
        return None
    names = {f.name for f in dataclasses.fields(cls)}
    for key, value in raw.items():
        if key not in names:
            return prefix + str(key)
        kind, sub, _, _ = _child(cls, key, merged, None)
        child_merged = merged.get(key) if isinstance(merged, dict) else None
        if kind in ("choice", "dataclass") and sub is not None and isinstance(value, dict):
            inner = {k: v for k, v in value.items() if not (kind == "choice" and k == CHOICE_TYPE_KEY)}
            bad = _first_unknown_in_file(sub, inner, child_merged, f"{prefix}{key}.")
            if bad:
                return bad
        elif kind == "list" and isinstance(value, list):
            for i, item in enumerate(value):
                bad = _first_unknown_in_file(sub, item, item, f"{prefix}{key}[{i}].")
                if bad:
                    return bad
    return None


def unknown_choice(cls: type, raw: Any, prefix: str = "") -> str | None:
    """'KEY.type: unknown type 'lama'; did you mean llama? (one of: ...)' for the first choice field (the model's
    `architecture`) whose `type` in the merged config `raw` names no registered type; None when all are known."""
    if not isinstance(raw, dict):
        return None
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        t = _strip_optional(_field_types(cls)[f.name])
        value = raw[f.name]
        if _is_choice(t) and isinstance(value, dict) and value.get(CHOICE_TYPE_KEY) is not None:
            name, known = str(value[CHOICE_TYPE_KEY]), sorted(t.get_known_choices())
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                hint = f"; did you mean {close[0]}?" if close else ""
                return f"{prefix}{f.name}.{CHOICE_TYPE_KEY}: unknown type {name!r}{hint} (one of: {', '.join(known)})"
        kind, sub, child_raw, _ = _child(cls, f.name, raw, None)
        if kind in ("choice", "dataclass") and sub is not None:
            found = unknown_choice(sub, child_raw, f"{prefix}{f.name}.")
            if found:
                return found
    return None


def cli_key_known(config_class: type, key: str, merged: dict) -> bool:
    """Whether `--key` (dotted) is a field of `config_class` or of a section in it (a choice field's `type`, and
    the fields of the type `merged` chooses); items of a list are not addressable from the command line."""
    cls, raw, default, choice = config_class, merged, None, False
    parts = key.split(".")
    for n, part in enumerate(parts):
        last = n == len(parts) - 1
        if cls is None:
            return False
        if choice and part == CHOICE_TYPE_KEY and last:
            return True
        if part not in {f.name for f in dataclasses.fields(cls)}:
            return False
        kind, sub, raw, default = _child(cls, part, raw, default)
        if last:
            return True
        choice = kind == "choice"
        cls = sub if kind in ("choice", "dataclass") else None
    return True


def unknown_key_message(
    config_class: type, key: str, merged: dict, prefix: str = "--", where: str | None = None
) -> str:
    """'unknown key KEY[ in FILE]; did you mean KEY2?' for a key `config_class` lacks (`prefix` '--' for the command
    line, '' for a file's key); says which types have it when it is a field of another choice."""
    shown = prefix + key + (f" in {where}" if where else "")
    other = _other_choices_with(config_class, merged, key)
    if other:
        return f"unknown key {shown}: {other}"
    keys = valid_keys(config_class, merged, lists=not prefix)
    parts = key.split(".")
    ancestors = {".".join(parts[:n]) for n in range(1, len(parts))}
    listed = next((a for a in sorted(ancestors, key=len) if _is_list(config_class, a)), None)
    if prefix and listed:
        return f"unknown key {shown}: {listed} is a list, whose items are set in the config file"
    suggestion = _nearest(key, [k for k in keys if k not in ancestors])
    if suggestion:
        return f"unknown key {shown}; did you mean {prefix}{suggestion}?"
    section = max((a for a in ancestors if a in keys), key=len, default=None)
    return f"unknown key {shown} ({'--help ' + section if section else '--help'} lists the keys)"


def _is_list(config_class: type, key: str) -> bool:
    """Whether dotted `key` is a list-of-dataclasses field."""
    cls: Any = config_class
    parts = key.split(".")
    for n, part in enumerate(parts):
        if not _is_dataclass_type(cls) or part not in {f.name for f in dataclasses.fields(cls)}:
            return False
        kind, cls, _, _ = _child(cls, part, {}, None)
        if n == len(parts) - 1:
            return kind == "list"
    return False


def _nearest(key: str, keys: list[str]) -> str | None:
    """The valid key `key` most likely meant: a sibling with a similar name, else the same name or a similar one in
    another section (the closest whole key among those)."""
    parent, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == parent]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.75)
    if close:
        return f"{parent}.{close[0]}" if parent else close[0]
    leaves = {k.rpartition(".")[2] for k in keys}
    similar = set(difflib.get_close_matches(leaf, leaves, n=3, cutoff=0.75))
    same = [k for k in keys if k.rpartition(".")[2] == leaf] or [k for k in keys if k.rpartition(".")[2] in similar]
    if not same:
        return None
    return max(same, key=lambda k: difflib.SequenceMatcher(None, key, k).ratio())


def _other_choices_with(config_class: type, merged: dict, key: str) -> str | None:
    """For a key under a choice field that another choice has: 'not a field of SECTION type T (A, B have it)'."""
    parts = key.split(".")
    cls, raw, default = config_class, merged, None
    for n, part in enumerate(parts[:-1]):
        if cls is None or part not in {f.name for f in dataclasses.fields(cls)}:
            return None
        t = _strip_optional(_field_types(cls)[part])
        kind, sub, raw, default = _child(cls, part, raw, default)
        if kind == "choice" and n == len(parts) - 2 and sub is not None:
            having = sorted(
                name
                for name, c in t.get_known_choices().items()
                if dataclasses.is_dataclass(c) and parts[-1] in {f.name for f in dataclasses.fields(c)}
            )
            if having:
                section = ".".join(parts[:-1])
                return (
                    f"not a field of {section}.{CHOICE_TYPE_KEY} {t.get_choice_name(sub)} "
                    f"(a field of {', '.join(having)})"
                )
            return None
        cls = sub if kind in ("choice", "dataclass") else None
    return None


# ---- --help ---------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class HelpRow:
    """One key of the listing."""

    key: str
    """Dotted path; items of a list as `name[*]`."""
    type: str
    value: str
    """The value in this config (the file's or the default), as YAML writes it."""
    doc: str
    """The field's description (draccus' docstring extraction), on one line."""
    cli: bool
    """Settable as `--key VALUE` (not under a list)."""

    @property
    def flag(self) -> str:
        return ("--" if self.cli else "") + self.key


def field_doc(cls: type, name: str) -> str:
    """Field `name`'s description as draccus' `--help` finds it (its docstring, or its comment), on one line."""
    try:
        doc = get_preferred_help_text(get_attribute_docstring(cls, name)) or ""
    except Exception:  # no source to read (a class built at run time)
        doc = ""
    return " ".join(doc.split())


def type_name(t: Any) -> str:
    """A type annotation as the listing shows it: `int`, `str | None`, `list[str]`."""
    if isinstance(t, str):
        return t
    if t is type(None) or t is None:
        return "None"
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(t))
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(t))
    if origin is not None:
        args = typing.get_args(t)
        base = getattr(origin, "__name__", str(origin))
        return f"{base}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]" if args else base
    return getattr(t, "__name__", str(t).replace("typing.", ""))


def show_value(v: Any, limit: int = 40) -> str:
    """`v` as YAML would write it (null, true, 3e-4, [a, b]), cut to `limit` characters."""
    if v is dataclasses.MISSING:
        return "(required)"
    if isinstance(v, enum.Enum):
        v = v.value
    if isinstance(v, str):
        text = v if v and v.strip() == v and not v.startswith(("{", "[")) else json.dumps(v)
    else:
        try:
            text = json.dumps(draccus.encode(v), default=str)
        except Exception:  # a value draccus cannot encode: its own repr
            text = repr(v)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def help_rows(
    cls: type,
    objs: list[Any],
    prefix: str = "",
    cli: bool = True,
    listed: dict[type, str] | None = None,
    record: dict[type, list[str]] | None = None,
) -> list[HelpRow]:
    """The listing's rows for dataclass `cls`, valued from `objs` (its instances: one, or a list's items; none:
    the defaults); a choice field lists only the fields of the type its value has. A section whose class `listed`
    maps to another prefix (where it is listed in full) is one row naming its values other than the defaults;
    `record` collects where each class's sections are."""
    if record is not None:
        record.setdefault(cls, []).append(prefix)
    if listed is not None and listed.get(cls, prefix) != prefix:
        return [_repeated_row(cls, objs, prefix, cli, listed[cls])]
    rows = []
    hints = _field_types(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        t = _strip_optional(hints[f.name])
        values = [getattr(o, f.name) for o in objs] if objs else [_default(f)]
        doc = field_doc(cls, f.name)
        sample = next((v for v in values if dataclasses.is_dataclass(v) and not isinstance(v, type)), None)
        item = _list_item_dataclass(t)
        if _is_choice(t) and sample is not None:
            chosen = type(sample)
            names = ", ".join(sorted(t.get_known_choices()))
            rows.append(
                HelpRow(
                    f"{key}.{CHOICE_TYPE_KEY}",
                    "str",
                    t.get_choice_name(chosen),
                    f"One of: {names} (--help-all lists every type's keys). {doc}".strip(),
                    cli,
                )
            )
            rows += help_rows(chosen, [v for v in values if isinstance(v, chosen)], key + ".", cli, listed, record)
        elif sample is not None:
            same = [v for v in values if isinstance(v, type(sample))]
            rows += help_rows(type(sample), same, key + ".", cli, listed, record)
        elif item is not None:
            items = [x for v in values if isinstance(v, list | tuple) for x in v]
            rows += help_rows(item, items, key + "[*].", False, listed, record)
        else:
            shown = [show_value(v) for v in values]
            value = shown[0] if len(set(shown)) == 1 else "[" + ", ".join(shown) + "]"
            rows.append(HelpRow(key, type_name(t), value, doc, cli))
    return rows


def _repeated_row(cls: type, objs: list[Any], prefix: str, cli: bool, first: str) -> HelpRow:
    """One row for a section whose class was listed at `first`: its values that differ from the defaults."""
    try:
        base = cls()
    except Exception:  # required fields: compare with nothing
        base = None
    changed = []
    for f in dataclasses.fields(cls):
        values = {show_value(getattr(o, f.name)) for o in objs}
        if base is None or values != {show_value(getattr(base, f.name))}:
            changed.append(f"{f.name}: {' / '.join(sorted(values))}")
    doc = f"as {'--' if cli else ''}{first}*; " + ("here " + ", ".join(changed) if changed else "all defaults here")
    return HelpRow(prefix + "*", cls.__name__, "", doc, cli)


def _decode_for_help(config_class: type, line: CommandLine) -> tuple[Any, str | None]:
    """The config the command line describes, or the defaults and why not."""
    args = [f"--{k}={v}" if v is not None else f"--{k}" for k, v in line.overrides]
    try:
        return draccus.parse(config_class, config_path=line.config_path, args=args, exit_on_error=False), None
    except (Exception, SystemExit) as e:  # an invalid config still gets the listing, with the defaults
        reason = " ".join(str(e.__cause__ or e).split())[:200]
        return config_class(), reason


def render_help(
    config_class: type,
    line: CommandLine,
    prog: str,
    raw_file: dict | None = None,
    example: tuple[str, str] = RUN_EXAMPLE,
) -> str:
    """The `--help` text: usage and examples, then every key of the config by section (or, with a topic, that
    section's keys with their whole descriptions)."""
    config, problem = _decode_for_help(config_class, line)
    if line.help_topic:
        rows = help_rows(config_class, [config])
        return _render_topic(config_class, rows, line.help_topic, raw_file or {})
    record: dict[type, list[str]] = {}
    help_rows(config_class, [config], record=record)
    listed = {c: min(ps, key=lambda p: p.count(".")) for c, ps in record.items() if len(ps) > 1}
    rows = help_rows(config_class, [config], listed=listed)
    width = max(80, shutil.get_terminal_size((120, 24)).columns)
    source = line.config_path or "the defaults"
    out = [
        f"usage: {prog} --config FILE [--KEY VALUE ...]",
        "",
        "Runs the experiment that FILE (YAML) describes. Each key below is a path in that file, and `--KEY VALUE`",
        "on the command line overrides it (VALUE is YAML: 50, true, null, gs://..., '[a, b]'). Keys under a list",
        "(name[*]) are set in the file.",
        "",
        "examples:",
        f"  {prog} --config {example[0]}",
        f"  {prog} --config {example[0]} {example[1]}",
        f"  {prog} --config FILE --help          this listing, with FILE's values",
        f"  {prog} --help orchestrator           a section's descriptions in full",
        f"  {prog} --help-all                    every key of every model type (draccus)",
        "",
        f"values: {source}" + (f" (not valid: {problem}; showing the defaults)" if problem else ""),
    ]
    top_docs = {f.name: field_doc(config_class, f.name) for f in dataclasses.fields(config_class)}
    sections: dict[str, list[HelpRow]] = {}
    for row in rows:
        head = re.split(r"\.|\[", row.key, maxsplit=1)[0]
        nested = row.key != head and not row.key.startswith(head + "." + CHOICE_TYPE_KEY) or "[" in row.key
        sections.setdefault(head if nested or "." in row.key else "", []).append(row)
    for head, section in sections.items():
        out.append("")
        if head:
            doc = top_docs.get(head, "")
            listed = "[*]" if any(r.key.startswith(head + "[") for r in section) else ""
            out.append(_cut(f"{head}{listed}: {doc}", width))
        kw = min(46, max(len(r.flag) for r in section))
        tw = min(30, max(len(_typed(r)) for r in section))
        for r in section:
            left = f"  {r.flag:<{kw}}  {_typed(r):<{tw}}"
            out.append(_cut(f"{left}  {r.doc}".rstrip(), width))
    out += ["", f"Descriptions are cut to one line: `{prog} --help SECTION` prints a section's whole."]
    return "\n".join(out)


def _typed(row: HelpRow) -> str:
    return f"{row.type} = {row.value}" if row.value else row.type


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _render_topic(config_class: type, rows: list[HelpRow], topic: str, raw: dict) -> str:
    topic = topic.removeprefix("--")
    chosen = [r for r in rows if r.key == topic or r.key.startswith((topic + ".", topic + "["))]
    if not chosen:
        raise SystemExit(f"marin_rl: {unknown_key_message(config_class, topic, raw, prefix='')}")
    width = max(80, shutil.get_terminal_size((120, 24)).columns)
    out = []
    for r in chosen:
        out.append(f"{r.flag}  {r.type} = {r.value}")
        out += textwrap.wrap(r.doc, width - 6, initial_indent="      ", subsequent_indent="      ") if r.doc else []
    return "\n".join(out)


# ---- placeholders ---------------------------------------------------------------------------------------------------


def placeholder_fields(obj: Any, prefix: str = "", cli: bool = True) -> list[tuple[str, str, bool]]:
    """(dotted field, value, settable as --field) of every string in the config `obj` (dataclasses, lists, dicts)
    that holds a placeholder such as `YOUR_BUCKET`."""
    found = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            found += placeholder_fields(getattr(obj, f.name), f"{prefix}.{f.name}" if prefix else f.name, cli)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found += placeholder_fields(v, f"{prefix}.{k}", False)
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            found += placeholder_fields(v, f"{prefix}[{i}]", False)
    elif isinstance(obj, str) and PLACEHOLDER.search(obj):
        found.append((prefix, obj, cli))
    return found
