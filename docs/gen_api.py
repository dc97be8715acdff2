"""Write docs/api.md, the API reference, from the signatures and docstrings of the public API.

    python docs/gen_api.py            # rewrite docs/api.md
    python docs/gen_api.py --check    # exit 1 (and say so) when docs/api.md is out of date

The public API is ``tncomp.__all__`` (and ``tncomp.inspect``), ``comera.__all__``, and the
public classes and functions defined in ``comera.experiments.engine``,
``comera.experiments.engine_config``, ``comera.experiments.checks``,
``comera.experiments.task``, ``comera.experiments.results``, ``comera.experiments.rundir``,
``comera.surgery.report`` and the trainer callbacks' ``comera.integrations.hf`` and
``comera.integrations.lightning`` (names without a leading underscore). Each name gets its
signature and docstring, grouped by the module that defines it; a class also gets its public
methods, properties and class attributes, including those of the tncomp / comera classes it
inherits from.
``tests/test_api_reference.py`` checks that the committed file is what this script writes, and
lists the public names that lack a docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "api.md"
PROJECT_PACKAGES = ("tncomp", "comera")
# (namespace, where its public names come from): a package's __all__, a module's definitions,
# or the names listed
NAMESPACES = (
    ("tncomp", "__all__"),
    ("comera", "__all__"),
    ("comera.experiments.engine", "defined"),
    ("comera.experiments.engine_config", "defined"),
    ("comera.experiments.checks", "defined"),
    ("comera.experiments.task", "defined"),
    ("comera.experiments.results", "defined"),
    ("comera.experiments.rundir", "defined"),
    ("comera.surgery.report", "defined"),
    ("comera.integrations.hf", "defined"),  # the trainer callbacks (the hf / lightning extras)
    ("comera.integrations.lightning", "defined"),
    # names that left comera's face (comera.__getattr__ warns): documented in their homes
    ("comera.formats.factorize", ("factorize_pair", "suggest_padded_size")),
    ("comera.ranks.objective", ("rank_regularizer",)),
    ("comera.ranks.truncate", ("TruncationReport",)),
    ("comera.training.controller", ("clear_moments_",)),
)
# public names a package keeps outside its __all__ (``from tncomp import *`` must not shadow the
# standard library's ``inspect``): documented with the package all the same
OUTSIDE_ALL = {"tncomp": ("inspect",)}
HIDDEN_MEMBERS = frozenset({"extra_repr"})  # nn.Module's repr hook: not something users call
SHOWN_DUNDERS = ("__call__",)  # a callable object's call is its main entry point
ONE_LINE = 96  # longer signatures are written one parameter per line
_ROLE = re.compile(r":(?:class|func|meth|mod|attr|exc|data|obj):`(~?)([^`]+)`")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


@dataclass(frozen=True)
class Entry:
    """One public name: how users reach it (``qualname``), the object, where it is defined."""

    qualname: str
    obj: Any
    module: str

    @property
    def anchor(self) -> str:
        return self.qualname


@dataclass(frozen=True)
class Section:
    """One namespace of the reference: its docstring and its entries by defining module."""

    namespace: str
    doc: str
    groups: tuple[tuple[str, tuple[Entry, ...]], ...]


# -- collecting -----------------------------------------------------------------------------------
def _is_project(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module.split(".")[0] in PROJECT_PACKAGES


def _defining_module(obj: Any) -> str:
    return obj.__name__ if inspect.ismodule(obj) else obj.__module__


def _names(module: types.ModuleType, source: str) -> list[str]:
    if source == "__all__":
        return [*module.__all__, *OUTSIDE_ALL.get(module.__name__, ())]
    if isinstance(source, tuple):  # the names listed
        return list(source)
    return [name for name, obj in vars(module).items()
            if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
            and getattr(obj, "__module__", None) == module.__name__]


def sections() -> list[Section]:
    """Every namespace of the public API with its entries, in a stable order."""
    out = []
    for namespace, source in NAMESPACES:
        module = importlib.import_module(namespace)
        by_module: dict[str, list[Entry]] = {}
        for name in _names(module, source):
            obj = getattr(module, name)
            entry = Entry(f"{namespace}.{name}", obj, _defining_module(obj))
            by_module.setdefault(entry.module, []).append(entry)
        order = sorted(by_module, key=lambda m: (m != namespace, m))
        groups = tuple((m, tuple(by_module[m])) for m in order)
        out.append(Section(namespace, inspect.getdoc(module) or "", groups))
    return out


def entries() -> Iterator[Entry]:
    """Every public name, in the order of the reference."""
    for section in sections():
        for _, group in section.groups:
            yield from group


# -- docstrings -----------------------------------------------------------------------------------
def _project_mro(cls: type) -> list[type]:
    return [k for k in cls.__mro__ if _is_project(k)]


def own_doc(obj: Any) -> str:
    """The docstring written for ``obj`` itself ("" if none). A class does not inherit one, and
    the ``Name(field, ...)`` text that dataclasses fill in does not count."""
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__") or ""
        if dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
            return ""
        return inspect.cleandoc(doc)
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, classmethod | staticmethod):
        obj = obj.__func__
    return inspect.cleandoc(getattr(obj, "__doc__", None) or "")


def member_doc(cls: type, name: str) -> str:
    """The docstring of ``cls.name``, from the first tncomp / comera class in the MRO that has
    one (an undocumented override of a documented method is documented)."""
    for klass in _project_mro(cls):
        if name in klass.__dict__:
            doc = own_doc(klass.__dict__[name])
            if doc:
                return doc
    return ""


@dataclass(frozen=True)
class Member:
    """One public member of a class, and the tncomp / comera class that defines it."""

    name: str
    kind: str  # "method", "classmethod", "staticmethod", "property" or "attribute"
    value: Any
    owner: type


def members(cls: type) -> list[Member]:
    """Public methods, properties and class attributes of ``cls`` defined in tncomp / comera
    classes (the class itself first, then its bases); dataclass fields are in the signature."""
    seen: set[str] = set()
    out: list[Member] = []
    fields = ({f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls)
              else set())
    for klass in _project_mro(cls):
        for name, value in klass.__dict__.items():
            if name in seen or name in HIDDEN_MEMBERS or name in fields:
                continue
            if name.startswith("_") and name not in SHOWN_DUNDERS:
                continue
            seen.add(name)
            if isinstance(value, property):
                kind = "property"
            elif isinstance(value, classmethod):
                kind = "classmethod"
            elif isinstance(value, staticmethod):
                kind = "staticmethod"
            elif inspect.isfunction(value):
                kind = "method"
            elif isinstance(value, str | int | float | bool | tuple) or value is None:
                kind = "attribute"
            else:
                continue
            out.append(Member(name, kind, value, klass))
    return out


def missing_docstrings() -> list[str]:
    """Public names (functions, classes, modules) without a docstring of their own."""
    return [e.qualname for e in entries() if not own_doc(e.obj)]


def missing_member_docstrings() -> list[str]:
    """Public methods and properties of public classes that have no docstring, each named once
    where it is defined (``module.Class.name``)."""
    missing: dict[str, None] = {}
    for e in entries():
        if not inspect.isclass(e.obj):
            continue
        for m in members(e.obj):
            if m.kind != "attribute" and not member_doc(e.obj, m.name):
                missing[f"{m.owner.__module__}.{m.owner.__qualname__}.{m.name}"] = None
    return list(missing)


# -- rendering ------------------------------------------------------------------------------------
class _Raw(str):
    """An annotation written in the source (a string): shown as written, without quotes."""

    def __repr__(self) -> str:
        return str(self)


def _annotation(value: Any) -> Any:
    if value is inspect.Parameter.empty:
        return value
    if isinstance(value, str):
        return _Raw(value)
    text = inspect.formatannotation(value)
    return _Raw(re.sub(r"\b(?:tncomp|comera|torch)\.(?:\w+\.)*(\w+)", r"\1", text))


def _parameter_text(p: inspect.Parameter) -> str:
    p = p.replace(annotation=_annotation(p.annotation))
    return _ADDRESS.sub("", str(p))


def signature_text(name: str, obj: Callable, drop_first: bool = False,
                   returns: bool = True) -> str | None:
    """``name(params) -> return`` as in the source, one parameter per line when long."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())[1 if drop_first else 0:]
    parts: list[str] = []
    kinds = [p.kind for p in params]
    for k, p in enumerate(params):
        if (p.kind is inspect.Parameter.KEYWORD_ONLY
                and inspect.Parameter.VAR_POSITIONAL not in kinds
                and (k == 0 or params[k - 1].kind is not inspect.Parameter.KEYWORD_ONLY)):
            parts.append("*")
        parts.append(_parameter_text(p))
        if (p.kind is inspect.Parameter.POSITIONAL_ONLY
                and (k + 1 == len(params)
                     or params[k + 1].kind is not inspect.Parameter.POSITIONAL_ONLY)):
            parts.append("/")
    arrow = ""
    if returns and sig.return_annotation is not inspect.Signature.empty:
        arrow = f" -> {_annotation(sig.return_annotation)}"
    line = f"{name}({', '.join(parts)}){arrow}"
    if len(line) <= ONE_LINE:
        return line
    body = "".join(f"    {part},\n" for part in parts)
    return f"{name}(\n{body}){arrow}"


def _escape(text: str) -> str:
    """Markdown-escape prose (not code spans): emphasis marks, HTML-like tags, headings."""
    pieces, last = [], 0
    for match in _CODE_SPAN.finditer(text):
        pieces.append(re.sub(r"([*_<\\])", r"\\\1", text[last:match.start()]))
        pieces.append(match.group(0))
        last = match.end()
    pieces.append(re.sub(r"([*_<\\])", r"\\\1", text[last:]))
    out = "".join(pieces)
    return "\\" + out if out.startswith("#") else out


def markdown_doc(doc: str) -> str:
    """A docstring as markdown: roles become code spans, prose is escaped, indented blocks
    (examples) stay code blocks."""
    doc = _ROLE.sub(lambda m: f"`{m.group(2).split('.')[-1] if m.group(1) else m.group(2)}`",
                    doc)
    lines, in_code, previous_blank = [], False, True
    for line in doc.splitlines():
        indented = line.startswith("    ")
        if indented and (in_code or previous_blank):
            in_code = True
            lines.append(line)
        else:
            if line.strip():
                in_code = False
            lines.append(_escape(line) if not in_code else line)
        previous_blank = not line.strip()
    return "\n".join(lines).strip()


def _bases(cls: type) -> list[str]:
    """Public base classes; a private base is replaced by its own bases."""
    out: list[str] = []
    for base in cls.__bases__:
        if base is object:
            continue
        if base.__name__.startswith("_") and _is_project(base):
            out += [b for b in _bases(base) if b not in out]
        elif base.__name__ not in out:
            out.append(base.__name__)
    return out


def _fenced(text: str) -> list[str]:
    return ["```text", text, "```", ""]


def _doc_lines(doc: str) -> list[str]:
    return [markdown_doc(doc), ""] if doc else ["*(no docstring)*", ""]


def _has_init(cls: type) -> bool:
    return any("__init__" in k.__dict__ for k in _project_mro(cls))


def render_class(entry: Entry, documented: dict[type, str], level: str = "###") -> list[str]:
    """A class: signature, bases, docstring, class attributes, then its public members; those
    of another documented class are linked there instead of repeated."""
    cls = entry.obj
    lines = [f'<a id="{entry.anchor}"></a>', "", f"{level} class `{entry.qualname}`", ""]
    if _has_init(cls):
        sig = signature_text(cls.__name__, cls, returns=False)
        if sig:
            lines += _fenced(sig)
    bases = _bases(cls)
    if bases:
        lines += ["Bases: " + ", ".join(f"`{b}`" for b in bases) + ".", ""]
    lines += _doc_lines(own_doc(cls))
    attributes = [m for m in members(cls) if m.kind == "attribute"]
    if attributes:
        lines += ["Class attributes: " + ", ".join(f"`{m.name} = {m.value!r}`"
                                                    for m in attributes) + ".", ""]
    inherited: dict[type, list[str]] = {}
    for m in members(cls):
        if m.kind == "attribute":
            continue
        if m.owner is not cls and m.owner in documented:
            inherited.setdefault(m.owner, []).append(m.name)
            continue
        if m.kind == "property":
            lines += [f"#### property `{m.name}`", ""]
        else:
            func = getattr(cls, m.name) if m.kind == "classmethod" else m.value
            if isinstance(func, staticmethod):
                func = func.__func__
            drop = m.kind == "method"
            sig = signature_text(m.name, func, drop_first=drop)
            prefix = "" if m.kind == "method" else f"{m.kind} "
            if getattr(func, "__isabstractmethod__", False):
                prefix = f"abstract {prefix}"
            lines += [f"#### {prefix}`{m.name}`", ""]
            if sig:
                lines += _fenced(sig)
        lines += _doc_lines(member_doc(cls, m.name))
    for owner, names in inherited.items():
        lines += [f"Inherited from [`{owner.__name__}`](#{documented[owner]}): "
                  + ", ".join(f"`{n}`" for n in names) + ".", ""]
    return lines


def render_function(entry: Entry, documented: dict[type, str], level: str = "###") -> list[str]:
    """A function: signature and docstring."""
    lines = [f'<a id="{entry.anchor}"></a>', "", f"{level} `{entry.qualname}`", ""]
    sig = signature_text(entry.obj.__name__, entry.obj)
    if sig:
        lines += _fenced(sig)
    return lines + _doc_lines(own_doc(entry.obj))


def render_module(entry: Entry, documented: dict[type, str]) -> list[str]:
    """A module exported as a name (``tncomp.errors``): its docstring and public contents."""
    module = entry.obj
    lines = [f'<a id="{entry.anchor}"></a>', "", f"### module `{entry.qualname}`", ""]
    lines += _doc_lines(own_doc(module))
    for name in _names(module, "defined"):
        sub = Entry(f"{entry.qualname}.{name}", getattr(module, name), module.__name__)
        render = render_class if inspect.isclass(sub.obj) else render_function
        lines += render(sub, documented, level="####")
    return lines


def render_entry(entry: Entry, documented: dict[type, str]) -> list[str]:
    if inspect.ismodule(entry.obj):
        return render_module(entry, documented)
    if inspect.isclass(entry.obj):
        return render_class(entry, documented)
    return render_function(entry, documented)


def render() -> str:
    """The whole reference as markdown (what docs/api.md holds)."""
    all_sections = sections()
    documented = {e.obj: e.anchor for s in all_sections for _, group in s.groups for e in group
                  if inspect.isclass(e.obj)}
    lines = ["<!-- Generated by docs/gen_api.py from the docstrings; do not edit by hand. -->", "",
             "# API reference", "",
             "The public API of tncomp and comera: every name in `tncomp.__all__` and "
             "`comera.__all__`, and the public classes and functions of the training engine "
             "(`comera.experiments.engine`, `.task`, `.results`) and of `comera.surgery.report`, "
             "with "
             "signatures and docstrings, grouped by the module that defines them. The "
             "[tutorial](tutorial.md) shows them at work. Regenerate this file with "
             "`python docs/gen_api.py`.", ""]
    for section in all_sections:
        names = ", ".join(f"[`{e.qualname.rsplit('.', 1)[1]}`](#{e.anchor})"
                          for _, group in section.groups for e in group)
        lines.append(f"- **`{section.namespace}`**: {names}")
    lines.append("")
    for section in all_sections:
        lines += [f"## `{section.namespace}`", ""]
        if section.doc:
            lines += [markdown_doc(section.doc), ""]
        for module, group in section.groups:
            if module != section.namespace or len(section.groups) > 1:
                lines += [f"*Defined in `{module}`.*", ""]
            for entry in group:
                lines += render_entry(entry, documented)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/api.md from the docstrings.")
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if docs/api.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.is_file() else ""
        if current != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run python docs/gen_api.py",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}: {sum(1 for _ in entries())} public names")
    missing = missing_docstrings() + missing_member_docstrings()
    if missing:
        print(f"{len(missing)} without a docstring: {', '.join(missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # run from anywhere without installing the project
    sys.exit(main())
