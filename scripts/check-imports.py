#!/usr/bin/env python3
"""Finds import circles between the files of Rust source directories.

    scripts/check-imports.py DIR...       exit 1 if any DIR holds a circle
    scripts/check-imports.py --self-test  run on scripts/tests/imports/

A file A depends on a file B when A names an item that B defines: through
`use crate::...`, `use super::...`, `use self::...`, `use child::...`, or a
path in code that starts with `crate::`, `super::`, `self::` or a child
module's name. A name a module re-exports (`pub use x::Y`) is followed to
the file that defines it, so naming `crate::Error` depends on error.rs, not
on lib.rs. Declaring a module (`mod x;`) is not a dependency: a parent owns
its children; it depends on one only when it names something in it.
Modules are found from the crate root (lib.rs or main.rs in DIR or the
closest directory above it, and DIR/bin/*.rs), following `mod` and
`#[path]`; `#[cfg]` is ignored, so every configuration counts. Comments
and strings are not read.

For each circle it prints the files and, for each dependency inside it, the
line that makes it. scripts/test.sh runs it on the directories listed
there; docs/testing.md says how to read its output.
"""

import os
import re
import sys

KEYWORDS_ITEM = {"fn", "struct", "enum", "trait", "type", "const", "static", "union"}
TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<line>//[^\n]*)
  | (?P<block>/\*)
  | (?P<raw>b?r(?P<hashes>\#*)")
  | (?P<str>b?"(?:\\.|[^"\\])*")
  | (?P<char>b?'(?:\\.|[^'\\])')
  | (?P<life>'[A-Za-z_][A-Za-z0-9_]*)
  | (?P<ident>r\#[A-Za-z_][A-Za-z0-9_]*|[A-Za-z_][A-Za-z0-9_]*)
  | (?P<path>::)
  | (?P<num>[0-9][A-Za-z0-9_.]*)
  | (?P<punct>.)
""",
    re.X | re.S,
)


def tokenize(text):
    """(kind, value, line) for identifiers, `::`, strings and punctuation."""
    out, pos, line = [], 0, 1
    while pos < len(text):
        m = TOKEN.match(text, pos)
        kind = m.lastgroup if m.lastgroup != "hashes" else "raw"
        if kind == "block":
            depth, end = 1, m.end()
            while depth and end < len(text):
                if text.startswith("/*", end):
                    depth, end = depth + 1, end + 2
                elif text.startswith("*/", end):
                    depth, end = depth - 1, end + 2
                else:
                    end += 1
            chunk = text[pos:end]
        elif kind == "raw":
            close = '"' + m.group("hashes")
            end = text.find(close, m.end())
            end = len(text) if end < 0 else end + len(close)
            chunk = text[pos:end]
            out.append(("str", chunk[chunk.index('"') + 1 : -len(close)], line))
        else:
            end, chunk = m.end(), m.group(0)
            if kind == "str":
                out.append(("str", chunk[chunk.index('"') + 1 : -1], line))
            elif kind in ("ident", "path", "punct"):
                out.append((kind, chunk, line))
        line += chunk.count("\n")
        pos = end
    return out


class Module:
    def __init__(self, file, parent, name):
        self.file, self.parent, self.name = file, parent, name
        self.children = {}  # name -> Module
        self.items = set()  # names defined here
        self.bindings = {}  # name -> [segments] a `use` brings in
        self.globs = []  # [segments] of `use ...::*`
        self.refs = []  # (segments, line, is_use) named from here
        self.root = parent.root if parent else self

    def __repr__(self):
        return self.file


def parse_use_tree(toks, i, prefix, out):
    """Parses a use tree at toks[i]; appends (segments, alias) to out."""
    segs = list(prefix)
    while True:
        kind, val, _ = toks[i]
        if val == "{":
            i += 1
            while toks[i][1] != "}":
                i = parse_use_tree(toks, i, segs, out)
                if toks[i][1] == ",":
                    i += 1
            return i + 1
        if val == "*":
            out.append((segs, "*"))
            return i + 1
        if kind == "path":
            i += 1
            continue
        if kind != "ident":
            return i + 1
        i += 1
        if toks[i][1] == "as":
            alias = toks[i + 1][1]
            i += 2
            out.append((segs + [val] if val != "self" or not segs else segs, alias))
            return i
        if toks[i][0] == "path":
            segs = segs + [val]
            continue
        if val == "self" and segs:
            out.append((segs, segs[-1]))
        else:
            out.append((segs + [val], val))
        return i


def parse_file(path, module, modules):
    """Reads one file into `module`, creating its inline and file children."""
    with open(path, encoding="utf-8") as f:
        toks = tokenize(f.read())
    stack = [(module, 0)]  # (module, brace depth its body ends at)
    depth, i, path_attr, test_attr = 0, 0, None, False
    while i < len(toks):
        kind, val, line = toks[i]
        cur = stack[-1][0]
        prev = toks[i - 1][1] if i else ""
        if val == "#" and i + 5 < len(toks) and toks[i + 1][1] == "[":
            if toks[i + 2][1] == "path" and toks[i + 3][1] == "=":
                path_attr = toks[i + 4][1]
            if [t[1] for t in toks[i + 2 : i + 6]] == ["cfg", "(", "test", ")"]:
                test_attr = True
        elif val == "{":
            depth += 1
        elif val == "}":
            depth -= 1
            if len(stack) > 1 and depth == stack[-1][1]:
                stack.pop()
        elif kind == "ident" and val == "mod" and toks[i + 1][0] == "ident":
            name = toks[i + 1][1]
            child = cur.children.get(name) or Module(cur.file, cur, name)
            cur.children[name] = child
            if toks[i + 2][1] == "{":
                if test_attr:
                    # Nothing names a test module: it depends, nothing on it.
                    child.file = f"{cur.file}#{name}"
                stack.append((child, depth))
                depth += 1
                i += 3
                path_attr, test_attr = None, False
                continue
            if toks[i + 2][1] == ";":
                base = os.path.dirname(path)
                if os.path.basename(path) not in ("lib.rs", "main.rs", "mod.rs") or module.parent is None:
                    if module.parent is not None:
                        base = os.path.join(base, os.path.splitext(os.path.basename(path))[0])
                for m in inline_path(cur, module):
                    base = os.path.join(base, m)
                if path_attr:
                    file = os.path.normpath(os.path.join(os.path.dirname(path), path_attr))
                else:
                    file = os.path.join(base, name + ".rs")
                    if not os.path.exists(file):
                        file = os.path.join(base, name, "mod.rs")
                if os.path.exists(file):
                    child.file = file
                    modules.append(child)
                    parse_file(file, child, modules)
            path_attr, test_attr = None, False
            i += 3
            continue
        elif kind == "ident" and val == "use" and prev not in ("::",):
            trees = []
            j = parse_use_tree(toks, i + 1, [], trees)
            for segs, alias in trees:
                if alias == "*":
                    cur.globs.append(segs)
                else:
                    cur.bindings[alias] = segs
                cur.refs.append((segs, line, True))
            while toks[j - 1][1] != ";" and j < len(toks):
                j += 1
            i = j
            continue
        elif kind == "ident" and val in KEYWORDS_ITEM and i + 1 < len(toks):
            nxt = toks[i + 1]
            if nxt[0] == "ident" and nxt[1] not in ("fn", "unsafe", "extern", "async"):
                cur.items.add(nxt[1])
        elif kind == "ident" and val == "macro_rules" and toks[i + 1][1] == "!":
            cur.items.add(toks[i + 2][1])
        elif kind == "ident" and prev != "::" and i + 1 < len(toks) and toks[i + 1][0] == "path":
            # `pub(in crate::x)` is a visibility, not a dependency.
            named = prev != "in"
            segs, j = [val], i + 1
            while j + 1 < len(toks) and toks[j][0] == "path" and toks[j + 1][0] == "ident":
                segs.append(toks[j + 1][1])
                j += 2
            if named:
                cur.refs.append((segs, line, False))
            i = j
            continue
        i += 1


def inline_path(mod, file_module):
    """Names of the inline modules from file_module down to mod."""
    names = []
    while mod is not file_module and mod is not None:
        names.append(mod.name)
        mod = mod.parent
    return reversed(names)


def start(mod, first):
    """The module a path's first segment names from mod, or None."""
    if first == "crate":
        return mod.root
    if first == "super":
        return mod.parent
    if first == "self":
        return mod
    return mod.children.get(first)


def resolve(mod, segs, seen):
    """The file that defines what segs (a path named in mod) names, or None
    when it is outside the crate."""
    if not segs:
        return None
    cur = start(mod, segs[0])
    if cur is None:
        return None
    rest = segs[1:]
    while rest and rest[0] == "super" and cur.parent:
        cur, rest = cur.parent, rest[1:]
    for k, name in enumerate(rest):
        if name in cur.children:
            cur = cur.children[name]
            continue
        if name in cur.items:
            return cur.file
        key = (id(cur), name)
        if key in seen:
            return cur.file
        seen.add(key)
        if name in cur.bindings:
            return resolve(cur, cur.bindings[name] + rest[k + 1 :], seen) or cur.file
        for glob in cur.globs:
            target = resolve(cur, glob + rest[k:], seen)
            if target:
                return target
        return cur.file
    return cur.file


def crate_roots(directory):
    """The crate root files whose modules hold directory's files."""
    roots, d = [], os.path.abspath(directory)
    while True:
        found = [os.path.join(d, f) for f in ("lib.rs", "main.rs") if os.path.exists(os.path.join(d, f))]
        if found or d == os.path.dirname(d):
            roots += found
            break
        d = os.path.dirname(d)
    bindir = os.path.join(os.path.abspath(directory), "bin")
    if os.path.isdir(bindir):
        roots += sorted(os.path.join(bindir, f) for f in os.listdir(bindir) if f.endswith(".rs"))
    return roots


def dependencies(directory):
    """{file: {file it depends on: first line naming it}} inside directory."""
    modules = []
    for root in crate_roots(directory):
        top = Module(root, None, "crate")
        modules.append(top)
        parse_file(root, top, modules)
    inside = os.path.abspath(directory) + os.sep
    deps = {}
    todo = [m for m in modules if m.parent is None]
    while todo:
        m = todo.pop()
        todo += m.children.values()
        if not m.file.startswith(inside):
            continue
        edges = deps.setdefault(m.file, {})
        for segs, line, _ in m.refs:
            target = resolve(m, segs, set())
            if target and target != m.file and target.startswith(inside):
                edges.setdefault(target, (line, "::".join(segs)))
    return deps


def circles(deps):
    """Strongly connected components of more than one file (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    sys.setrecursionlimit(10000)

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in deps.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(deps):
        if v not in index:
            visit(v)
    return out


def check(directory, quiet=False):
    """Prints directory's circles; returns how many there are."""
    deps = dependencies(directory)
    found = circles(deps)
    rel = lambda f: os.path.relpath(f, os.path.abspath(directory))
    for comp in found:
        print(f"{directory}: import circle of {len(comp)} files: {' '.join(rel(f) for f in comp)}")
        for f in comp:
            for target, (line, path) in sorted(deps[f].items()):
                if target in comp:
                    print(f"    {rel(f)}:{line} -> {rel(target)}  ({path})")
    if not found and not quiet:
        print(f"{directory}: no import circle among {len(deps)} files")
    return len(found)


def self_test():
    """Each fixture under scripts/tests/imports/ names its expected circles
    in a file `expected` (one line per circle, its files sorted; empty for
    none); fails if the script finds other ones."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tests", "imports")
    failed = 0
    for name in sorted(os.listdir(here)):
        fixture = os.path.join(here, name)
        with open(os.path.join(fixture, "expected"), encoding="utf-8") as f:
            want = sorted(line.split() for line in f if line.strip())
        got = sorted(
            [os.path.relpath(p, fixture) for p in comp] for comp in circles(dependencies(fixture))
        )
        ok = got == want
        failed += not ok
        print(f"check-imports self-test {name}: {'ok' if ok else f'FAILED: expected {want}, found {got}'}")
    return failed


def main(argv):
    if argv == ["--self-test"]:
        return 1 if self_test() else 0
    if not argv or any(a.startswith("-") for a in argv):
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        print("usage: check-imports.py DIR... | --self-test", file=sys.stderr)
        return 2
    total = 0
    for d in argv:
        if not os.path.isdir(d):
            print(f"check-imports: {d} is not a directory; give the source directories to check", file=sys.stderr)
            return 2
        total += check(d)
    if total:
        print(
            f"check-imports: {total} import circle(s); make one side stop naming the other "
            "(move the shared item down into a module both can depend on)"
        )
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
