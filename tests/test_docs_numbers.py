"""The docs quote the committed benchmark results, and their links resolve.

A number taken from a result file carries a marker right after it (an HTML comment, invisible on the rendered page)
that names the file under `benchmarks/results/` (or, from `studies/` on, under the repository's root) and the JSON
path of the value, e.g. after "4.14 s":

    <!-- result: b16_model_cpu_fp32_2threads/results.json#points[resolution=1024,budget=64].latency_ms.median/1000 -->

`<!-- results: RUN/FILE.json -->` sets the file for the markers after it in the same page, which then name only the
path (`<!-- result: #summary[0].veca_per_token_latency_ratio -->`). A path is keys joined by dots; `[3]` indexes a
list, `[key=value,...]` picks the one element of a list whose fields have those values (`null` for None), and
`["a key"]` quotes a key with spaces or dots. `*100` or `/1000` after the path scales the value (a fraction written
as a percentage, milliseconds written as seconds; `*-1` a gap written as "points behind"). The number written before
the marker (its unit, `%`, `x`, `s`, ... and closing `**` or `)` may stand between them) must equal the value rounded
to the decimals written.
"""

import ast
import json
import re
from pathlib import Path

import pytest


ROOT = Path(__file__).parent.parent
RESULTS = ROOT / "benchmarks" / "results"
STUDY_RESULTS = sorted((ROOT / "studies").glob("*/results/*/README.md"))
DOCS = sorted([*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *RESULTS.glob("*/README.md"), *STUDY_RESULTS])

MARKER = re.compile(r"<!--\s*(?P<kind>results?):\s*(?P<body>.*?)\s*-->")
# the number just before a marker: a sign (not a range's hyphen, as in 19-34), digits with optional thousands commas,
# decimals and exponent, then at most a unit and closing emphasis or brackets
NUMBER = re.compile(
    r"(?:(?<![\w.])(?P<sign>[-+−]))?(?<![\w.,])(?P<number>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?)"
    r"(?:\s?(?:%|x|s|ms|MB|GB|GiB|GFLOPs|GFLOP/s|px|points?|img/s))?[*)\]]*\s*$"
)
SCALE = re.compile(r"^(?P<path>.*?)\s*(?P<op>[*/])\s*(?P<factor>-?\d+(?:\.\d+)?)$")
SEGMENT = re.compile(
    r'\.?(?:\["(?P<quoted>(?:[^"\\]|\\.)*)"\]|\[(?P<index>\d+)\]|\[(?P<select>[^\]]+)\]|(?P<key>[^.\[\]]+))'
)


def parse_path(path: str) -> list:
    """`a.b[2]["c d"][k=v]` -> [("key", "a"), ("key", "b"), ("index", 2), ("key", "c d"), ("select", {"k": "v"})]."""
    segments, position = [], 0
    while position < len(path):
        match = SEGMENT.match(path, position)
        if match is None or match.end() == position:
            raise ValueError(f"path {path!r}: cannot read it from {path[position:]!r}")
        if match["quoted"] is not None:
            segments.append(("key", json.loads(f'"{match["quoted"]}"')))
        elif match["index"] is not None:
            segments.append(("index", int(match["index"])))
        elif match["select"] is not None:
            pairs = [pair.split("=", 1) for pair in match["select"].split(",")]
            if any(len(pair) != 2 for pair in pairs):
                raise ValueError(f"path {path!r}: a selector is key=value[,key=value], got [{match['select']}]")
            segments.append(("select", {key.strip(): value.strip() for key, value in pairs}))
        else:
            segments.append(("key", match["key"]))
        position = match.end()
    return segments


def as_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def resolve(data, path: str):
    """The value at `path` in `data`, or a `ValueError` naming the step that fails."""
    value = data
    for kind, step in parse_path(path):
        if kind == "key":
            if not isinstance(value, dict) or step not in value:
                keys = sorted(value)[:20] if isinstance(value, dict) else type(value).__name__
                raise ValueError(f"path {path!r}: no key {step!r} (there: {keys})")
            value = value[step]
        elif kind == "index":
            if not isinstance(value, list) or step >= len(value):
                raise ValueError(f"path {path!r}: no element [{step}]")
            value = value[step]
        else:
            if not isinstance(value, list):
                raise ValueError(f"path {path!r}: a selector needs a list, got {type(value).__name__}")
            found = [
                item
                for item in value
                if isinstance(item, dict) and all(as_text(item.get(key)) == want for key, want in step.items())
            ]
            if len(found) != 1:
                raise ValueError(f"path {path!r}: {len(found)} elements match {step}, not exactly one")
            value = found[0]
    return value


def written_number(text: str) -> str | None:
    match = NUMBER.search(text)
    return None if match is None else (match["sign"] or "") + match["number"]


def tolerance(number: str) -> float:
    """Half a unit of the last digit written: 0.518 -> 0.0005, 1,290 -> 0.5, 8e-07 -> 5e-08."""
    mantissa, _, exponent = number.lower().partition("e")
    return 0.5 * 10 ** (int(exponent or 0) - len(mantissa.partition(".")[2]))


def check_markers(text: str, results_dir: Path = RESULTS) -> tuple[int, list[str]]:
    """Checks every marker of one page: (markers checked, what is wrong, one line each with its line number)."""
    errors, checked, default_file, loaded = [], 0, None, {}
    for line_number, line in enumerate(text.splitlines(), start=1):
        for match in MARKER.finditer(line):
            body = match["body"]
            if match["kind"] == "results":
                default_file = body
                continue
            where = f"line {line_number}"
            file_name, _, path = body.partition("#")
            file_name = file_name or default_file
            if not file_name or not path:
                errors.append(f"{where}: a marker is `result: RUN/FILE.json#PATH` (or `#PATH` after `results:`)")
                continue
            scale = SCALE.match(path)
            op, factor = (scale["op"], float(scale["factor"])) if scale else ("*", 1.0)
            path = scale["path"] if scale else path
            number = written_number(MARKER.sub("", line[: match.start()]))
            if number is None:
                errors.append(f"{where}: no number right before the marker for {file_name}#{path}")
                continue
            try:
                if file_name not in loaded:
                    folder = ROOT if file_name.startswith("studies/") else results_dir
                    loaded[file_name] = json.loads((folder / file_name).read_text())
                value = resolve(loaded[file_name], path)
            except (OSError, ValueError) as error:
                errors.append(f"{where}: {file_name}: {error}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                errors.append(f"{where}: {file_name}#{path} is {value!r}, not a number")
                continue
            value = value * factor if op == "*" else value / factor
            written = float(number.replace(",", "").replace("−", "-"))
            checked += 1
            if abs(written - value) > tolerance(number) * (1 + 1e-9):
                errors.append(
                    f"{where}: the page writes {number}, {file_name}#{path} is {value:.6g}; write the file's number"
                )
    return checked, errors


def test_a_number_that_differs_from_its_result_file_fails(tmp_path):
    """The checker itself: the right number passes, a changed one, a wrong path or a missing file do not."""
    run = tmp_path / "run"
    run.mkdir()
    points = [{"resolution": 512, "budget": None, "ms": 1290.4}, {"resolution": 512, "budget": 64, "ms": 1124.0}]
    (run / "results.json").write_text(json.dumps({"points": points, "summary": {"a ratio": 0.5180, "gap": -0.83}}))
    page = (
        "<!-- results: run/results.json -->\n"
        "| VECA | 1.12 s<!-- result: #points[resolution=512,budget=64].ms/1000 --> |\n"
        'paired **0.518**<!-- result: run/results.json#summary["a ratio"] -->, '
        '51.8%<!-- result: #summary["a ratio"]*100 -->\n'
        "DINOv3 1,290<!-- result: #points[budget=null].ms -->\n"
    )
    assert check_markers(page, tmp_path) == (4, [])

    checked, errors = check_markers(page.replace("1.12 s", "1.13 s"), tmp_path)
    assert checked == 4 and len(errors) == 1
    assert "writes 1.13" in errors[0] and "points[resolution=512,budget=64].ms" in errors[0] and "1.124" in errors[0]
    assert not check_markers(page.replace("51.8%", "52%"), tmp_path)[1]  # the precision written is the one checked
    assert not check_markers("0.83<!-- result: run/results.json#summary.gap*-1 --> points behind\n", tmp_path)[1]
    assert check_markers(page.replace("51.8%", "51.7%"), tmp_path)[1]
    assert "no key 'b ratio'" in check_markers(page.replace('["a ratio"] -->,', '["b ratio"] -->,'), tmp_path)[1][0]
    assert (
        "2 elements match" in check_markers(page.replace("resolution=512,budget=64", "resolution=512"), tmp_path)[1][0]
    )
    assert not check_markers("19-34<!-- result: run/results.json#points[1].ms/33 -->\n", tmp_path)[1]  # a range
    assert not check_markers('8e-04<!-- result: run/results.json#summary["a ratio"]/650 -->\n', tmp_path)[1]
    assert "no number" in check_markers("VECA <!-- result: run/results.json#summary -->\n", tmp_path)[1][0]
    assert check_markers("1.0<!-- result: missing/results.json#a -->\n", tmp_path)[1]


def test_every_number_the_docs_quote_matches_its_result_file():
    total, problems = 0, []
    for page in DOCS:
        checked, errors = check_markers(page.read_text())
        total += checked
        problems += [f"{page.relative_to(ROOT)}: {error}" for error in errors]
    assert not problems, "\n".join(problems)
    assert total > 0


@pytest.mark.parametrize("page, at_least", [("docs/performance.md", 200), ("docs/results.md", 40)])
def test_the_performance_pages_quote_their_numbers_with_markers(page, at_least):
    """The pages whose numbers all come from result files keep marking them (a table pasted without them fails)."""
    checked, errors = check_markers((ROOT / page).read_text())
    assert not errors and checked >= at_least, (checked, errors)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks too) dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def without_fences(text: str) -> str:
    """The page without fenced code blocks, whose lines are neither headings nor links."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)


def outside_code(text: str) -> str:
    """The page without fenced code blocks and inline code."""
    return re.sub(r"`[^`\n]*`", "", without_fences(text))


def anchors(page: Path) -> set[str]:
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*$", without_fences(page.read_text()), flags=re.M):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@pytest.mark.parametrize("page", DOCS, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page):
    """Every relative link and picture points to a file of the repository, and an anchor to a heading there."""
    broken = []
    for target in LINK.findall(outside_code(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_no_snippet_sizes_the_bank_with_num_core_tokens():
    """The bank is `core_bank_size`; `num_core_tokens` is the per-call budget (a config still reads the old name)."""
    misuses = []
    for page in DOCS:
        for block in python_blocks(page.read_text()):
            try:
                tree = ast.parse(block)
            except SyntaxError:
                continue
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                name = ast.unparse(node.func)
                if name in ("dict", "VecaConfig") or name.startswith("VecaConfig."):
                    if any(keyword.arg == "num_core_tokens" for keyword in node.keywords):
                        misuses.append(f"{page.relative_to(ROOT)}: {ast.unparse(node)}")
    assert not misuses, "use core_bank_size for the bank:\n" + "\n".join(misuses)
