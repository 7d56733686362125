"""The configuration reference, generated from the comments of ``config/ppo_trainer.yaml`` and ``verl_ignored.yaml``.

An MkDocs hook (``hooks:`` in ``mkdocs.yml``): a page that holds a ``<!-- generated: NAME -->`` marker gets the table
NAME renders, at every build, so the reference cannot fall behind the YAML. The YAML is read line by line, since a
YAML parser drops comments: a key's comment is the block of ``#`` lines right above it.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config"
KEY_LINE = re.compile(r"^(?P<indent> *)(?P<name>[A-Za-z_][\w.-]*):(?:\s+(?P<value>\S.*))?$")
DOCS_PATH = re.compile(r"docs/([\w/-]+\.md)")
# a section with at least this many keys below it gets a heading of its own (depth 2); smaller ones stay in the table
OWN_HEADING = 8


@dataclass
class Key:
    """One key of a YAML file: its dotted path, its default as written, and the comment block above it."""

    path: str
    value: str
    comment: str
    section: bool


def parse(text: str) -> tuple[str, list[Key]]:
    """The file's header comment and its keys in order (sections included), with their comments and defaults."""
    lines = text.splitlines()
    header = []
    while lines and lines[0].startswith("#"):
        header.append(lines.pop(0).lstrip("# ").rstrip())
    keys: list[Key] = []
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in lines:
        stripped = line.strip()
        if not stripped:
            pending = []
        elif stripped.startswith("#"):
            pending.append(stripped.lstrip("#").strip())
        elif stripped.startswith("- "):  # an item of a block list: part of the key above
            if keys and not keys[-1].path.startswith("defaults"):
                keys[-1].value = (keys[-1].value + " " + stripped).strip()
        else:
            match = KEY_LINE.match(line)
            if not match:
                raise ValueError(f"config reference: cannot read this YAML line: {line!r}")
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([name for _, name in stack] + [match["name"]])
            value = match["value"] or ""
            keys.append(Key(path, value, " ".join(pending), section=not value))
            if not value:
                stack.append((indent, match["name"]))
            pending = []
    return " ".join(header), [key for key in keys if not key.path.startswith("defaults")]


def prose(text: str, page_dir: str) -> str:
    """A comment as Markdown table text: code spans kept, Markdown's special characters escaped elsewhere, and
    ``docs/<page>.md`` mentions turned into links relative to the page."""
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(part)
            continue
        part = html.escape(part, quote=False)
        part = re.sub(r"([\\*_\[\]|])", r"\\\1", part)
        out.append(DOCS_PATH.sub(lambda m: f"[{m[1]}]({relative(m[1], page_dir)})", part))
    return "".join(out)


def relative(target: str, page_dir: str) -> str:
    """``target`` (a path under docs/) as a link from a page in ``page_dir`` (also under docs/)."""
    up = "../" * len(Path(page_dir).parts) if page_dir else ""
    return up + target


def code(value: str) -> str:
    """A default as inline code in a table cell (HTML, so that no character of it is read as Markdown)."""
    return "<code>" + html.escape(value).replace("|", "&#124;") + "</code>" if value else ""


def key_cell(path: str) -> str:
    """A dotted key as inline code that may wrap after a dot (never inside a name)."""
    return "<code>" + ".<wbr>".join(html.escape(part) for part in path.split(".")) + "</code>"


def render(keys: list[Key], page_dir: str, skip: set[str] = frozenset()) -> str:
    """Tables of keys: a heading per top-level section, and per large second-level one; the rest as rows."""
    counts = {key.path: sum(other.path.startswith(key.path + ".") for other in keys) for key in keys if key.section}
    out: list[str] = []
    table_open = False
    for key in keys:
        if key.path in skip:
            continue
        depth = key.path.count(".")
        if key.section and (depth == 0 or (depth == 1 and counts[key.path] >= OWN_HEADING)):
            out += ["", f"{'#' * (depth + 2)} `{key.path}`", ""]
            if key.comment:
                out += [prose(key.comment, page_dir), ""]
            table_open = False
            continue
        if not table_open:
            out += ["| key | default | meaning |", "| --- | --- | --- |"]
            table_open = True
        default = "(section)" if key.section else code(key.value)
        out.append(f"| {key_cell(key.path)} | {default} | {prose(key.comment, page_dir)} |")
    return "\n".join(out) + "\n"


def config_reference(page_dir: str) -> str:
    """Every key of ``ppo_trainer.yaml`` with its default and comment (the file's header is the page's to say)."""
    return render(parse((CONFIG / "ppo_trainer.yaml").read_text())[1], page_dir)


def ignored_keys(page_dir: str) -> str:
    """Every key of ``verl_ignored.yaml`` that ``ppo_trainer.yaml`` does not define itself, grouped under the comment
    that says why it is ignored (a comment covers the keys after it in its section, and a section's its keys)."""
    defined = {key.path for key in parse((CONFIG / "ppo_trainer.yaml").read_text())[1] if not key.section}
    keys = parse((CONFIG / "verl_ignored.yaml").read_text())[1]  # its header says what the page says
    groups: dict[tuple[str, str], list[str]] = {}
    why: dict[str, str] = {}  # the comment in force in a section
    for key in keys:
        parent = key.path.rpartition(".")[0]
        why[parent] = key.comment or why.get(parent) or why.get(parent + "/", "")
        if key.section:
            why[key.path + "/"] = why[parent]
        elif key.path not in defined:
            groups.setdefault((key.path.split(".")[0], why[parent]), []).append(key.path)
    out, top = [], None
    for (section, comment), paths in groups.items():
        if section != top:
            out += ["", f"## `{section}`", ""]
            top = section
        out.append(f"- {prose(comment, page_dir) or 'ignored'}: " + ", ".join(f"`{path}`" for path in paths))
    return "\n".join(out) + "\n"


GENERATED = {"config-reference": config_reference, "ignored-keys": ignored_keys}


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs hook: fill each ``<!-- generated: NAME -->`` marker of a page."""
    parent = Path(page.file.src_uri).parent.as_posix()
    page_dir = "" if parent == "." else parent
    for name, generate in GENERATED.items():
        marker = f"<!-- generated: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, generate(page_dir))
    return markdown
