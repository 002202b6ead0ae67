"""A Griffe extension that reads the package's docstrings, written in TRL's (Hugging Face doc-builder) format, as
Google-style docstrings for mkdocstrings. It changes what the documentation shows, never the source files.

What it rewrites, in every docstring of the package:

- Cross-references. ``[`name`]`` and ``[`~package.module.name`]`` become mkdocstrings cross-references
  (``[`name`][full.path]``), with the name resolved in the scope of the documented object as Python would (a member,
  an imported name, a sibling in the module). A name that does not resolve stays plain code.
- Group headings of a ``Parameters:`` block (``> Parameters that control ...``): dropped (Google style has no groups).
- Parameter lines. ``name (`type`, *optional*, defaults to `value`):`` becomes ``name (type): Defaults to `value`. ...``,
  and TRL's shared line for several parameters, ``a (`T`), b (`U`):``, becomes one item per parameter with the same
  description. Types such as ``float` or `None``` read as ``float | None``.
- A ``Returns:`` item ``` `T`: description``` (or ``` `T` or `None`: description```) keeps its type
  (``T: description``, ``T | None: description``).
- Types are shown as the source writes them: each code span of TRL's type text whole (``` `dict[str, Any]` ``` stays
  ``dict[str, Any]``), the spans joined by `` | `` (``` `float` or `None` ``` reads ``float | None``).
- Inherited fields. A class whose base is one of the package's classes with a ``Parameters:`` block (a config
  dataclass inherits its base's fields: `LoptiGRPOConfig` and `LoptiRLOOConfig` those of `LoptiArguments`) lists the
  base's parameters in its own ``Parameters:`` block, first (a block of its own where it adds no field itself), so that
  its page documents every field it adds.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import griffe


CROSS_REFERENCE = re.compile(r"\[`(~?)([A-Za-z_][\w.]*)`\](?![\[(])")
SECTION = re.compile(r"^(\s*)(Args|Arguments|Parameters|Params|Returns|Raises|Yields|Attributes):\s*$")
GROUP_HEADING = re.compile(r"^\s*> ")
ONE_PARAMETER = r"[A-Za-z_*][\w*]*\s*\((?:[^()]|\([^()]*\))*\)"
PARAMETER_LINE = re.compile(rf"^(\s*)({ONE_PARAMETER}(?:\s*,\s*{ONE_PARAMETER})*)\s*:\s*(.*)$")
NAME_AND_TYPE = re.compile(r"([A-Za-z_*][\w*]*)\s*\(((?:[^()]|\([^()]*\))*)\)")
DEFAULT = re.compile(r",?\s*\*optional\*(?:,\s*defaults to\s*(.+))?$")
TYPE_SPAN = r"\[?`~?[^`]+`\]?"  # a type in TRL's text: `T`, or a cross-reference [`T`] / [`~a.b.T`]
RETURNS_LINE = re.compile(rf"^(\s*)({TYPE_SPAN}(?:\s*(?:,\s*or|,|or)\s*{TYPE_SPAN})*)\s*:\s*(.*)$")


def python_type(text: str) -> str:
    """TRL's type text as a Python annotation, each type as the source writes it: `` `float` or `None` `` reads
    ``float | None``, `` `dict[str, Any]` `` stays ``dict[str, Any]``. Text without code spans (a Google-style type) is
    split only on the ``or`` and commas outside brackets (``dict[str, Any] or None``: ``dict[str, Any] | None``)."""
    spans = [span.strip() for span in re.findall(r"`~?([^`]+)`", text)]
    if spans:
        return " | ".join(spans)
    parts, start = [], 0
    for separator in re.finditer(r",\s*or\s+|,|\s+or\s+", text):
        before = text[: separator.start()]
        if before.count("[") + before.count("(") == before.count("]") + before.count(")"):  # outside brackets
            parts.append(text[start : separator.start()])
            start = separator.end()
    parts = [part.strip() for part in [*parts, text[start:]] if part.strip()]
    return " | ".join(parts)


def rewrite_parameters(lines: list[str], defaults: dict[str, str]) -> list[str]:
    """The lines of one ``Args:`` block in TRL's format, in Google style; a documented default that the signature
    shows as well (`defaults`: each parameter's default as written in the source) is left to the signature."""
    output: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        index += 1
        if GROUP_HEADING.match(line) or not line.strip():  # Google style: no groups, no blank line in a section
            continue
        match = PARAMETER_LINE.match(line)
        if not match:
            output.append(line)
            continue
        indent, names, rest = match.groups()
        body = [rest] if rest else []
        while index < len(lines) and len(lines[index]) - len(lines[index].lstrip()) > len(indent):
            body.append(lines[index].strip())
            index += 1
        for name, type_text in NAME_AND_TYPE.findall(names):
            default = DEFAULT.search(type_text)
            prefix = ""
            if default:
                type_text = type_text[: default.start()]
                written = (default.group(1) or "").strip()
                if written and normalised(written.strip("`")) != defaults.get(name):
                    prefix = f"Defaults to {written}. "
            description = (prefix + " ".join(body)).strip()
            output.append(f"{indent}{name} ({python_type(type_text)}): {description}")
    return output


def rewrite_returns(lines: list[str]) -> list[str]:
    """The lines of one ``Returns:`` block in TRL's format (`` `T`: description``, continued at the same indentation) as
    one Google-style item (``T: description``)."""
    match = RETURNS_LINE.match(lines[0]) if lines else None
    if not match:
        return lines
    indent, type_text, first = match.groups()
    description = " ".join([first, *(line.strip() for line in lines[1:])]).strip()
    return [f"{indent}{python_type(type_text)}: {description}"]


def rewrite_sections(text: str, defaults: dict[str, str]) -> str:
    """Every ``Args:``-like and ``Returns:`` block of a docstring in Google style."""
    lines = text.split("\n")
    output: list[str] = []
    index = 0
    while index < len(lines):
        line = lines[index]
        output.append(line)
        index += 1
        section = SECTION.match(line)
        if not section:
            continue
        indent = len(section.group(1))
        block: list[str] = []
        while index < len(lines) and (
            not lines[index].strip() or len(lines[index]) - len(lines[index].lstrip()) > indent
        ):
            block.append(lines[index])
            index += 1
        trailing = []
        while block and not block[-1].strip():
            trailing.append(block.pop())
        if section.group(2) in ("Returns", "Yields"):
            block = rewrite_returns(block)
        elif section.group(2) != "Raises":
            block = rewrite_parameters(block, defaults)
        output.extend(block + trailing)
    return "\n".join(output)


class TrlDocstrings(griffe.Extension):
    """Reads TRL-format docstrings as Google-style docstrings (see the module's docstring)."""

    def __init__(self, packages: list[str] | None = None) -> None:
        self.packages = tuple(packages or ["trl_lopti"])

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name in self.packages:
            self._inherit_parameters(pkg)
            self._rewrite(pkg, seen=set())

    def _inherit_parameters(self, pkg: griffe.Module) -> None:
        """Prepends to each class's ``Parameters:`` block those of the package's classes it extends (raw docstrings)."""
        classes = [obj for obj in iter_objects(pkg) if obj.is_class and obj.docstring is not None]
        blocks = {cls.path: parameter_block(cls.docstring.value) for cls in classes}
        for cls in classes:
            inherited = [line for base in cls.resolved_bases for line in blocks.get(base.path, [])]
            if not inherited:
                continue
            text = cls.docstring.value
            if not re.search(r"^\s*Parameters:\s*$", text, re.MULTILINE):  # a class that adds no field of its own
                text = text.rstrip() + "\n\nParameters:\n"
            header = re.search(r"^\s*Parameters:\s*\n", text, re.MULTILINE)
            cls.docstring.value = text[: header.end()] + "\n".join(inherited) + "\n" + text[header.end() :]

    def _rewrite(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = self._cross_references(
                obj, rewrite_sections(obj.docstring.value, signature_defaults(obj))
            )
        for member in obj.members.values():
            if not member.is_alias:
                self._rewrite(member, seen)

    @staticmethod
    def _cross_references(obj: griffe.Object, text: str) -> str:
        def link(match: re.Match[str]) -> str:
            short, path = match.group(1) == "~", match.group(2)
            shown = path.rsplit(".", 1)[-1] if short else path
            target = find(obj, path)
            return f"[`{shown}`][{target}]" if target else f"`{shown}`"

        return CROSS_REFERENCE.sub(link, text)


def iter_objects(obj: griffe.Object):
    """`obj` and every object it holds, once each (aliases left out)."""
    yield obj
    for member in obj.members.values():
        if not member.is_alias:
            yield from iter_objects(member)


def parameter_block(text: str) -> list[str]:
    """The lines of a docstring's ``Parameters:`` block, as written (empty without one)."""
    lines, block, inside = text.split("\n"), [], False
    for line in lines:
        if re.match(r"^\s*Parameters:\s*$", line):
            inside = True
        elif inside and line.strip() and not line.startswith((" ", "\t")):
            break
        elif inside and (block or line.strip()) and not SECTION.match(line):
            block.append(line)
        elif inside and SECTION.match(line):
            break
    while block and not block[-1].strip():
        block.pop()
    return block


def normalised(expression: str) -> str:
    """A default as Python writes it (`"a"` and `'a'` alike), or the text itself where it is no literal."""
    try:
        return repr(ast.literal_eval(expression))
    except (ValueError, SyntaxError):
        return expression


def signature_defaults(obj: griffe.Object) -> dict[str, str]:
    """Each parameter's default as the signature shows it: a function's, or a class's `__init__`'s (for a dataclass,
    its fields' values)."""
    if obj.is_function:
        parameters = {parameter.name: parameter.default for parameter in obj.parameters}
    elif obj.is_class and "__init__" in obj.members and not obj.members["__init__"].is_alias:
        parameters = {parameter.name: parameter.default for parameter in obj.members["__init__"].parameters}
    elif obj.is_class:  # (its inherited fields too)
        parameters = {name: member.value for name, member in obj.all_members.items() if member.is_attribute}
    else:
        return {}
    return {name: normalised(field_default(str(value))) for name, value in parameters.items() if value is not None}


def field_default(expression: str) -> str:
    """The default of a dataclass field written `field(default=...)`; any other expression as it is."""
    try:
        call = ast.parse(expression, mode="eval").body
    except SyntaxError:
        return expression
    if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("field"):
        return next((ast.unparse(kw.value) for kw in call.keywords if kw.arg == "default"), expression)
    return expression


def find(obj: griffe.Object, path: str) -> str | None:
    """The canonical path of `path` seen from `obj`: a name of its scope (its members, then its parents'), or a dotted
    path from the package; `None` where the name is not one of the package's objects."""
    head, _, tail = path.partition(".")
    scopes = [] if head == obj.package.name else [obj if obj.is_module or obj.is_class else obj.parent]
    while scopes and scopes[-1].parent is not None:
        scopes.append(scopes[-1].parent)
    candidates = [scope.members.get(head) for scope in scopes]
    if head == obj.package.name:
        candidates.append(obj.package)
    for found in filter(None, candidates):
        try:
            found = found.final_target if found.is_alias else found
            for part in filter(None, tail.split(".")):
                member = found.members[part]
                found = member.final_target if member.is_alias else member
        except (KeyError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        public = found.path.startswith(f"{obj.package.name}") and not any(
            part.startswith("_") for part in found.path.split(".")
        )
        return found.path if public else None  # a private module's object has no page: plain code
    return None
