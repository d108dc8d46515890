"""One docstring style for the package: numpydoc sections.

The docstrings of ``transformer_pde`` open with the formula and shapes, then numpydoc sections::

    Parameters
    ----------
    x : torch.Tensor
        tokens (..., n, d) on the sphere.

    Returns
    -------
    torch.Tensor
        (..., n, d).

    Raises
    ------
    ValueError
        bad shapes or weights.

    Examples
    --------
    >>> ...

This script converts the older Google-style sections (``Args:``, ``Returns:``, ``Raises:``,
``Example:``, ...) to that form and checks that every public docstring uses it:

    python scripts/numpydoc_style.py --check            # list offending docstrings, exit 1 if any
    python scripts/numpydoc_style.py --fix [FILES...]   # convert in place (default: the package)

``--check`` skips the modules of :data:`PENDING_CONVERSION` (modules other engineers were editing
when the style was introduced; they are converted with ``--fix`` after those edits land, and the
list is then emptied).  ``--fix`` converts only what it is given (or, with no files, the whole
package except :data:`PENDING_CONVERSION`; ``--fix --all`` includes those too).

The conversion rewrites only the section structure (header lines, entry lines); the text of each
entry is kept as written, escapes included, so that a converted docstring says what it said.
``docs/conf.py`` applies the same :func:`convert` to docstrings still in the old style while they
are rendered, so that the documentation builds before and after the conversion.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "transformer_pde"

# Modules being edited by others when this style was introduced: converted with
# `python scripts/numpydoc_style.py --fix --all` once those edits are merged, then this list is emptied.
PENDING_CONVERSION: tuple[str, ...] = ()

# Google-style header -> numpydoc section
GOOGLE_SECTIONS = {
    "Args": "Parameters", "Arguments": "Parameters", "Parameters": "Parameters", "Params": "Parameters",
    "Keyword Args": "Other Parameters", "Keyword Arguments": "Other Parameters",
    "Other Parameters": "Other Parameters",
    "Returns": "Returns", "Return": "Returns", "Yields": "Yields", "Yield": "Yields",
    "Raises": "Raises", "Warns": "Warns",
    "Example": "Examples", "Examples": "Examples",
    "Note": "Notes", "Notes": "Notes",
    "Attributes": "Attributes",
    "Warning": "Warnings", "Warnings": "Warnings",
    "See Also": "See Also", "References": "References",
}
NUMPY_SECTIONS = ("Parameters", "Other Parameters", "Attributes", "Returns", "Yields", "Receives", "Raises",
                  "Warns", "Warnings", "See Also", "Notes", "References", "Examples", "Methods")
_FIELD_SECTIONS = {"Parameters", "Other Parameters", "Attributes"}
_TYPED_SECTIONS = {"Returns", "Yields"}

_GOOGLE_HEADER = re.compile(r"^(%s):\s*$" % "|".join(re.escape(k) for k in GOOGLE_SECTIONS))
_GOOGLE_INLINE = re.compile(r"^(Args|Arguments|Returns|Raises|Yields|Example|Examples|Note|Attributes):\s+\S")
_PARAM = re.compile(r"^(\*{0,2}[A-Za-z_][\w.]*(?:\s*(?:,|/|\bor\b)\s*\*{0,2}[A-Za-z_][\w.]*)*)\s*(?:\(([^()]*)\))?\s*:(?:\s+(.*))?$")
_EXC_NAME = r"[A-Za-z_][\w.]*(?:Error|Exception|Warning|Interrupt|Exit)"
_RAISES = re.compile(r"^(%s(?:\s*(?:/|,|\bor\b|\band\b)\s*%s)*)\s*(?::\s*|\s+|$)(.*)$" % (_EXC_NAME, _EXC_NAME))
_CLASS_REF = re.compile(r"^:(?:class|exc):`~?([\w.]+)`")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _dedent(lines: list[str]) -> list[str]:
    widths = [_indent(ln) for ln in lines if ln.strip()]
    cut = min(widths) if widths else 0
    return [ln[cut:] if ln.strip() else "" for ln in lines]


def _entries(body: list[str], head: re.Pattern) -> list[tuple[re.Match | None, list[str]]]:
    """Split a section body (dedented) into entries that start at column 0 and match ``head``."""
    out: list[tuple[re.Match | None, list[str]]] = []
    for ln in body:
        m = head.match(ln) if ln and not ln[0].isspace() else None
        if m is not None or not out:
            out.append((m, [] if m is not None else [ln]))
        else:
            out[-1][1].append(ln)
    return out


def _description(first: str | None, rest: list[str]) -> list[str]:
    rest = _dedent(rest)
    lines = ([first] if first else []) + rest
    while lines and not lines[-1].strip():
        lines.pop()
    return ["    " + ln if ln.strip() else "" for ln in lines]


def _convert_section(name: str, body: list[str], returns: str | None, params: dict | None) -> list[str]:
    body = _dedent(body)
    while body and not body[-1].strip():
        body.pop()
    out = [name, "-" * len(name)]
    if name in _FIELD_SECTIONS:
        for m, rest in _entries(body, _PARAM):
            if m is None:
                out += rest
                continue
            names, typ, desc = m.group(1), m.group(2), m.group(3)
            names = ", ".join(n for n in re.split(r"\s*(?:,|/|\bor\b)\s*", names) if n)
            typ = typ or (params or {}).get(names)
            out.append(f"{names} : {typ.strip()}" if typ else names)
            out += _description(desc, rest)
    elif name in ("Raises", "Warns"):
        for m, rest in _entries(body, _RAISES):
            if m is None:  # free text: keep it as the description of a generic entry
                out.append("Exception" if name == "Raises" else "Warning")
                out += _description(None, rest)
                continue
            names = re.split(r"\s*(?:/|,|\bor\b|\band\b)\s*", m.group(1))
            out.append(", ".join(n for n in names if n))
            out += _description(m.group(2) or None, rest)
    elif name in _TYPED_SECTIONS:
        ref = _CLASS_REF.match(body[0]) if body else None
        typ = returns or (ref.group(1).rsplit(".", 1)[-1] if ref else "result")
        out.append(typ)
        out += _description(None, body)
    else:
        out += body
    return out


def convert(text: str, returns: str | None = None, params: dict | None = None) -> str:
    """Convert the Google-style sections of a (dedented) docstring to numpydoc; other text is kept.

    ``returns`` (the return annotation, if any) names the type of a Returns/Yields entry and
    ``params`` (argument name -> annotation) the types of Parameters entries that give none.
    """
    lines = text.split("\n")
    # the first line of a docstring is not indented like the rest: dedent the rest only
    head, rest = lines[:1], _dedent(lines[1:]) if len(lines) > 1 else []
    if head and _GOOGLE_HEADER.match(head[0].strip()):
        head, rest = [""], [head[0].strip()] + rest
    out: list[str] = list(head)
    i = 0
    while i < len(rest):
        m = _GOOGLE_HEADER.match(rest[i])
        if m is None:
            out.append(rest[i])
            i += 1
            continue
        j = i + 1
        while j < len(rest) and (not rest[j].strip() or rest[j][0].isspace()):
            j += 1
        trailing = 0
        while j - trailing - 1 > i and not rest[j - trailing - 1].strip():
            trailing += 1
        if out and out[-1].strip():
            out.append("")
        out += _convert_section(GOOGLE_SECTIONS[m.group(1)], rest[i + 1:j - trailing], returns, params)
        out += [""] * trailing
        i = j
    return "\n".join(out)


def problems(text: str) -> list[str]:
    """What is not numpydoc in a docstring: Google-style headers, badly underlined sections."""
    found = []
    lines = text.split("\n")
    body = [lines[0].strip()] + _dedent(lines[1:])
    for k, ln in enumerate(body):
        if _GOOGLE_HEADER.match(ln) or _GOOGLE_INLINE.match(ln):
            found.append(f"Google-style section {ln.split(':')[0]!r} (numpydoc: a header line underlined with -)")
        stripped = ln.strip()
        if stripped in NUMPY_SECTIONS and k + 1 < len(body):
            under = body[k + 1].strip()
            if set(under) == {"-"} and len(under) != len(stripped):
                found.append(f"section {stripped!r} underlined with {len(under)} dashes, needs {len(stripped)}")
            if set(under) == {"-"} and _indent(ln) != _indent(body[k + 1]):
                found.append(f"section {stripped!r}: header and underline not aligned")
    return found


# ---------------------------------------------------------------------------------------- files

def _docstring_nodes(tree: ast.Module):
    """(qualified name, node owning the docstring) for the module and its public defs/classes."""
    yield "<module>", tree

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                public = not node.name.startswith("_") or node.name == "__init__"
                if not public:
                    continue
                yield prefix + node.name, node
                if isinstance(node, ast.ClassDef):
                    yield from walk(node.body, prefix + node.name + ".")

    yield from walk(tree.body, "")


def _doc_constant(node) -> ast.Constant | None:
    body = getattr(node, "body", None)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        return body[0].value
    return None


def _params(node, source: str) -> dict:
    args = getattr(node, "args", None)
    if args is None:
        return {}
    out = {}
    for a in args.posonlyargs + args.args + args.kwonlyargs:
        seg = ast.get_source_segment(source, a.annotation) if a.annotation is not None else None
        if seg:
            out[a.arg] = seg.strip("\"'")
    return out


def _returns(node, source: str) -> str | None:
    ret = getattr(node, "returns", None)
    if ret is None:
        return None
    seg = ast.get_source_segment(source, ret)
    return seg.strip("\"'") if seg else None


_QUOTED = re.compile(r'^(?P<prefix>[rRuU]?)(?P<q>"""|\'\'\')(?P<body>.*)(?P=q)$', re.S)


def _char_col(line: str, byte_col: int) -> int:
    """ast columns are UTF-8 byte offsets; the character offset in ``line``."""
    return len(line.encode("utf-8")[:byte_col].decode("utf-8"))


def fix_source(source: str) -> tuple[str, int]:
    """Convert every Google-style public docstring of a module's source; (new source, count)."""
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))
    edits = []
    for _, node in _docstring_nodes(tree):
        const = _doc_constant(node)
        if const is None or not problems(const.value):
            continue
        a = offsets[const.lineno - 1] + _char_col(lines[const.lineno - 1], const.col_offset)
        b = offsets[const.end_lineno - 1] + _char_col(lines[const.end_lineno - 1], const.end_col_offset)
        m = _QUOTED.match(source[a:b])
        if m is None:
            continue  # a single-quoted or implicitly concatenated docstring: left alone
        ind = " " * _indent(lines[const.lineno - 1])
        body = m.group("body").split("\n")
        closing_alone = len(body) > 1 and not body[-1].strip()
        new_lines = convert("\n".join(body), _returns(node, source), _params(node, source)).split("\n")
        while len(new_lines) > 1 and not new_lines[-1].strip():
            new_lines.pop()
        text = new_lines[0] + "".join("\n" + (ind + ln if ln.strip() else "") for ln in new_lines[1:])
        if closing_alone:
            text += "\n" + ind
        edits.append((a, b, m.group("prefix") + m.group("q") + text + m.group("q")))
    for a, b, text in sorted(edits, reverse=True):
        source = source[:a] + text + source[b:]
    return source, len(edits)


def module_files(include_pending: bool = False) -> list[Path]:
    files = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
    if not include_pending:
        files = [p for p in files if p.relative_to(ROOT).as_posix() not in PENDING_CONVERSION]
    return files


def check_file(path: Path) -> list[str]:
    source = path.read_text()
    tree = ast.parse(source)
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    out = []
    for qual, node in _docstring_nodes(tree):
        const = _doc_constant(node)
        if const is None:
            continue
        for p in problems(const.value):
            out.append(f"{rel}:{const.lineno}: {qual}: {p}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="list public docstrings not in numpydoc style")
    mode.add_argument("--fix", action="store_true", help="convert Google-style sections in place")
    ap.add_argument("--all", action="store_true", help="include the modules of PENDING_CONVERSION")
    ap.add_argument("files", nargs="*", type=Path)
    args = ap.parse_args(argv)
    files = [p.resolve() for p in args.files] or module_files(include_pending=args.all)
    if args.check:
        found = [msg for f in files for msg in check_file(f)]
        print("\n".join(found) if found else f"numpydoc style: {len(files)} files, no problems")
        return 1 if found else 0
    total = 0
    for f in files:
        new, n = fix_source(f.read_text())
        if n:
            ast.parse(new)  # never write a file that no longer parses
            f.write_text(new)
            print(f"{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}: {n} docstrings converted")
            total += n
    print(f"{total} docstrings converted")
    return 0


if __name__ == "__main__":
    sys.exit(main())
