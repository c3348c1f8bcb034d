"""The configuration's documentation, read from the dataclasses' field metadata: plain text
for `replayrl config explain [NAME]`, Markdown for docs/configuration.md
(`replayrl config docs`)."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import textwrap
from dataclasses import dataclass
from typing import Any

from replayrl.config.ranges import range_of
from replayrl.config.run import SECTIONS, RunConfig
from replayrl.errors import ReplayRLError

DOCS_PATH = "docs/configuration.md"
DOCS_COMMAND = f"replayrl config docs --out {DOCS_PATH}"
TOP_LEVEL = "top-level keys"
WIDTH = 100


@dataclass(frozen=True)
class Knob:
    """One configuration key: dotted name, type, default, help text, and its allowed values
    in words ("> 0", "in [0, 1)"; "" when any value of its type is) as loading checks them."""

    key: str
    type: str
    default: Any
    help: str
    allowed: str = ""

    @property
    def description(self) -> str:
        """The help text, then the allowed values."""
        return f"{self.help} Allowed: {self.allowed}." if self.allowed else self.help


@dataclass(frozen=True)
class Section:
    """A group of knobs: a section of RunConfig, or (name "") its top-level keys."""

    name: str
    doc: str
    knobs: tuple[Knob, ...]

    @property
    def title(self) -> str:
        return self.name or TOP_LEVEL


def _doc(cls: type) -> str:
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split())


def _knobs(cls: type, prefix: str) -> tuple[Knob, ...]:
    out = []
    for f in dataclasses.fields(cls):
        if cls is RunConfig and f.name in SECTIONS:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()  # type: ignore[misc]
        allowed = range_of(f)
        out.append(
            Knob(
                prefix + f.name,
                str(f.type),
                default,
                f.metadata.get("help", ""),
                allowed.describe() if allowed is not None else "",
            )
        )
    return tuple(out)


def sections() -> list[Section]:
    """Every knob: the top-level keys first, then each section in RunConfig's order."""
    out = [Section("", _doc(RunConfig), _knobs(RunConfig, ""))]
    for name, cls in SECTIONS.items():
        out.append(Section(name, _doc(cls), _knobs(cls, name + ".")))
    return out


def select(name: str | None = None) -> list[Section]:
    """The sections `name` asks for: all (None or ""), one section (`buffer`), or one key
    (`iterations`, `buffer.capacity`). An unknown name is a ReplayRLError naming the
    nearest valid one."""
    every = sections()
    if not name:
        return every
    by_name = {s.name: s for s in every if s.name}
    if name in by_name:
        return [by_name[name]]
    for s in every:
        for knob in s.knobs:
            if knob.key == name:
                return [dataclasses.replace(s, knobs=(knob,))]
    head, _, key = name.partition(".")
    if key and head in by_name:
        keys = [k.key for k in by_name[head].knobs]
        raise ReplayRLError(f"Unknown config key '{name}'.{_did_you_mean(name, keys)}")
    valid = [*by_name, *(k.key for k in every[0].knobs)]
    raise ReplayRLError(
        f"Unknown config section '{name}'.{_did_you_mean(name, valid)} Sections: "
        f"{', '.join(by_name)}; top-level keys: {', '.join(k.key for k in every[0].knobs)}."
    )


def _did_you_mean(name: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.4)
    return f" Did you mean '{match[0]}'?" if match else ""


def format_default(value: Any) -> str:
    """A default as YAML would take it: null, true, 0.0001, "tiny", [], {...}."""
    return json.dumps(value, ensure_ascii=False)


def render_text(chosen: list[Section]) -> str:
    """`replayrl config explain`: per section a heading line, then per key its dotted name,
    type and default, and its help indented below."""
    lines: list[str] = []
    for s in chosen:
        lines.extend(textwrap.wrap(f"{s.title}: {s.doc}", width=WIDTH, subsequent_indent="  "))
        for k in s.knobs:
            lines.append(f"  {k.key} ({k.type}, default {format_default(k.default)})")
            lines.extend(
                textwrap.wrap(
                    k.description or "(no help)",
                    width=WIDTH,
                    initial_indent=" " * 6,
                    subsequent_indent=" " * 6,
                    break_on_hyphens=False,
                )
            )
        lines.append("")
    return "\n".join(lines)


def _md_escape(text: str) -> str:
    """Markdown for a table cell: `|` escaped everywhere (inside code spans too, as GFM
    wants), and outside code spans the characters that would start HTML, emphasis or
    strikethrough."""
    parts = text.replace("|", "\\|").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace("*", "\\*").replace("~", "\\~")
    return "`".join(parts)


INTRO = f"""\
# Configuration reference

<!-- Generated from the field metadata in src/replayrl/config/ by `{DOCS_COMMAND}`.
Do not edit by hand: change the help text there and regenerate. -->

A run is configured by one YAML file (see `configs/`) plus `--set section.key=value`
overrides on the command line. Unknown keys are refused with the nearest valid one; every
number is checked against the values its key allows (listed below; NaN and ±inf are never
allowed), and rules that span keys are checked, when the config is loaded, before anything
is written; the error says how to fix it.
`replayrl config explain [SECTION]` prints the same reference in the terminal.

Quantities named as in the paper: R = rollout.prompts_per_iteration x
rollout.samples_per_prompt fresh rollouts per iteration; N = buffer.capacity; S =
train.steps_per_iteration; B = train.batch_size; G = rollout.samples_per_prompt.
"""


def _derived() -> list[str]:
    lines = ["## Derived quantities", ""]
    for name in ("rollouts_per_iteration", "replay_ratio", "staleness_horizon"):
        doc = " ".join(inspect.cleandoc(getattr(RunConfig, name).__doc__ or "").split())
        lines.append(f"- `{name}`: {_md_escape(doc)}")
    return [*lines, ""]


def render_markdown() -> str:
    """docs/configuration.md: the intro, the derived quantities, then per section a heading,
    its description and a table of key, type, default and help."""
    lines = [INTRO, *_derived()]
    for s in sections():
        lines.append(f"## {s.title[0].upper()}{s.title[1:]}" if not s.name else f"## `{s.name}`")
        lines += ["", _md_escape(s.doc), "", "| Key | Type | Default | Description |"]
        lines.append("|---|---|---|---|")
        for k in s.knobs:
            default = _md_escape(f"`{format_default(k.default)}`")
            lines.append(
                f"| `{k.key}` | {_md_escape(f'`{k.type}`')} | {default} | {_md_escape(k.description)} |"
            )
        lines.append("")
    return "\n".join(lines)
