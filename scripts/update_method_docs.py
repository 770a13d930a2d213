#!/usr/bin/env python3
"""Writes each method's parameter table into its page docs/methods/<name>.md.

The table comes from the method table itself (`kvq list --markdown NAME`) and goes between the
page's `<!-- params:begin ... -->` and `<!-- params:end -->` markers; tests/registry_test.cc fails
when a page is missing, has no markers, or holds a table that differs from the method table.

    scripts/update_method_docs.py [path/to/kvq]      (default build/kvq)
"""
import json
import pathlib
import re
import subprocess
import sys

repo = pathlib.Path(__file__).resolve().parent.parent
kvq = sys.argv[1] if len(sys.argv) > 1 else str(repo / "build" / "kvq")
methods = json.loads(subprocess.run([kvq, "list", "--json"], check=True, capture_output=True,
                                    text=True).stdout)
for m in methods:
    page = repo / "docs" / "methods" / f"{m['name']}.md"
    if not page.exists():
        sys.exit(f"missing {page}: every method needs its page")
    table = subprocess.run([kvq, "list", "--markdown", m["name"]], check=True,
                           capture_output=True, text=True).stdout
    text = page.read_text()
    pattern = re.compile(r"(<!-- params:begin[^\n]*-->\n)(.*?)(<!-- params:end -->)", re.S)
    if not pattern.search(text):
        sys.exit(f"{page}: no <!-- params:begin --> ... <!-- params:end --> markers")
    new = pattern.sub(lambda g: g.group(1) + table + g.group(3), text)
    if new != text:
        page.write_text(new)
        print(f"updated {page.relative_to(repo)}")
