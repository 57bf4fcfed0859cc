#!/usr/bin/python3
"""Builds one man page from its scdoc source (tools/man/NAME.SECTION.scd).

  build-man.py SOURCE README VERSION OUTPUT    writes OUTPUT (roff) and OUTPUT.gz (gzip -9n)
  build-man.py --scd SOURCE README VERSION     prints the scdoc text after substitution

Two substitutions before scdoc(1) sees the source:
  @VERSION@       the project's version (CMakeLists.txt)
  @CONFIG_TABLE@  (a line of its own) the configuration table of README.md's "Configuration"
                  section, one entry per key: the README table is the one source of the keys,
                  their defaults and meanings, for README.md and bucketd(8) alike.
tests/e2e/test_man_pages.py checks the pages against each program's --help and this table.
"""

import gzip
import os
import re
import subprocess
import sys

TABLE_HEADER = re.compile(r"^\|\s*key\s*\|")


def config_table(readme_text):
    """The README's configuration table: a list of rows, each a list of cells (header first)."""
    rows = []
    for line in readme_text.splitlines():
        if not rows:
            if TABLE_HEADER.match(line):
                rows.append(split_row(line))
            continue
        if not line.startswith("|"):
            break
        cells = split_row(line)
        if all(re.fullmatch(r":?-+:?", c) for c in cells):
            continue  # the | --- | line
        rows.append(cells)
    if len(rows) < 2:
        raise SystemExit("build-man: README.md has no configuration table (| key | ...)")
    return rows


def split_row(line):
    # Cells are separated by '|' outside code spans (none of the table's cells holds one now,
    # but a `a|b` code span must not split).
    cells, cur, in_code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
    cells.append(cur.strip())
    return cells


def scd_escape(text):
    return text.replace("\\", "\\\\").replace("*", "\\*").replace("_", "\\_")


def markdown_to_scd(text):
    """Inline Markdown of a table cell to scdoc: `code` in bold, [text](#anchor) as
    "text" in README.md; everything else escaped."""
    out, pos = [], 0
    pattern = re.compile(r"`([^`]*)`|\[([^\]]*)\]\(([^)]*)\)")
    for m in pattern.finditer(text):
        out.append(scd_escape(text[pos:m.start()]))
        if m.group(1) is not None:
            out.append("*" + scd_escape(m.group(1)) + "*" if m.group(1) else "")
        else:
            where = "README.md" if m.group(3).startswith("#") else m.group(3)
            out.append('"%s" in %s' % (scd_escape(m.group(2)), scd_escape(where)))
        pos = m.end()
    out.append(scd_escape(text[pos:]))
    return "".join(out)


def config_section(readme_text):
    """One entry per row: the key in bold with the other columns but the meaning in brackets
    ("(default: 8MiB)"; a column the table gains later comes along the same way), then the
    meaning, indented."""
    rows = config_table(readme_text)
    header, body = rows[0], rows[1:]
    lines = []
    for cells in body:
        notes, meaning = [], ""
        for name, cell in zip(header[1:], cells[1:]):
            if name.lower() == "meaning":
                meaning = markdown_to_scd(cell)
            elif cell not in ("", "\u2014", "-"):
                notes.append("%s: %s" % (scd_escape(name.lower()), markdown_to_scd(cell)))
        key = markdown_to_scd(cells[0])
        lines.append(key + (" (%s)" % "; ".join(notes) if notes else ""))
        if meaning:
            lines.append("\t" + meaning[:1].upper() + meaning[1:] +
                         ("" if meaning.endswith(".") else "."))
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def scd_text(source, readme, version):
    with open(source, encoding="utf-8") as f:
        text = f.read()
    text = text.replace("@VERSION@", version)
    if "@CONFIG_TABLE@" in text:
        with open(readme, encoding="utf-8") as f:
            table = config_section(f.read())
        text = re.sub(r"^@CONFIG_TABLE@$", lambda _m: table, text, flags=re.M)
    return text


def main(argv):
    if len(argv) == 5 and argv[1] == "--scd":
        sys.stdout.write(scd_text(argv[2], argv[3], argv[4]))
        return 0
    if len(argv) != 5:
        sys.stderr.write(__doc__)
        return 2
    source, readme, version, output = argv[1:]
    scdoc = os.environ.get("SCDOC", "scdoc")
    roff = subprocess.run([scdoc], input=scd_text(source, readme, version).encode(),
                          stdout=subprocess.PIPE, check=True).stdout
    with open(output, "wb") as f:
        f.write(roff)
    # gzip -9n: no name or time stamp in the header, so the same page compresses to the same
    # bytes (Debian policy for man pages; lintian checks it).
    with open(output + ".gz", "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
            gz.write(roff)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
