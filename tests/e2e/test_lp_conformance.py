"""Line-protocol conformance: every decode case of the InfluxDB corpus through bucketd-parse.

The corpus (../shared/corpus/line-protocol/corpus.json, beside the repository; see its
README.md) is the reference for which inputs are accepted and for the values of the points
they hold. Each case is checked for accept/reject, and for accepted cases every point's name,
tags, field keys, kinds and values, and time. The agreement rate and every disagreement are
printed; anything below 100% fails.

Environment: BUCKETD_PARSE_BIN (default build/bucketd-parse under the repository root),
BUCKETD_LP_CORPUS (default ../shared/corpus/line-protocol/corpus.json from the repository root).
Without the corpus the test is skipped (and the skip listed by tools/test.sh), except with
BUCKETD_TEST_REQUIRE_ALL=1, as CI runs it, where a missing corpus fails.

Batching: one bucketd-parse run per (precision, default time) pair rather than per case keeps
the test at a second or two. Cases are separated by two marker lines that always fail:
  MARK1 = '"\\x01'  if the case ended inside an open string value, bucketd-parse joins the next
                    line to it; the quote closes the string and \\x01 then fails that entry, so
                    the case still reports an error (the reference rejects an unterminated
                    string) and nothing leaks into the next case. Otherwise it fails by itself.
  MARK2 = '\\x01'   can never be joined (MARK1 closed any string), so its error object, which
                    carries its line number, reliably ends the case's output.
Points carry no line number, so this is what assigns them to cases.
"""

import base64
import json
import math
import os
import subprocess
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.environ.get("BUCKETD_SOURCE_DIR") or os.path.dirname(os.path.dirname(HERE))
PARSE_BIN = os.environ.get("BUCKETD_PARSE_BIN") or os.path.join(REPO, "build", "bucketd-parse")
CORPUS = os.environ.get("BUCKETD_LP_CORPUS") or os.path.join(
    REPO, "..", "shared", "corpus", "line-protocol", "corpus.json")

PRECISIONS = {"1ns": "ns", "1µs": "us", "1us": "us", "1ms": "ms", "1s": "s"}
MARK1 = b'"\x01'
MARK2 = b"\x01"


def case_text(case):
    text = case["input"]["text"]
    if isinstance(text, dict):
        return base64.b64decode(text["binary"])
    return text.encode("utf-8")


def run_batch(precision, default_time, cases):
    """Runs cases (a list of (key, bytes)) through one bucketd-parse; returns {key: [objects]}."""
    data = bytearray()
    layout = []  # (key, first line, MARK1 line, MARK2 line)
    line = 1
    for key, text in cases:
        first = line
        block = text + b"\n"
        line += block.count(b"\n")
        mark1 = line
        mark2 = line + 1
        line += 2
        data += block + MARK1 + b"\n" + MARK2 + b"\n"
        layout.append((key, first, mark1, mark2))

    proc = subprocess.run(
        [PARSE_BIN, "--precision", precision, "--default-time", str(default_time)],
        input=bytes(data), stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=120)
    if proc.returncode != 0:
        raise AssertionError("bucketd-parse exited %d: %s" % (
            proc.returncode, proc.stderr.decode("utf-8", "replace")))
    # Strict decoding: invalid UTF-8 or invalid JSON in the output is itself a failure.
    objs = [json.loads(l) for l in proc.stdout.decode("utf-8").splitlines()]

    out = {}
    it = iter(objs)
    for key, first, mark1, mark2 in layout:
        got = []
        for obj in it:
            if "error" in obj:
                if obj["line"] == mark2:
                    break
                if obj["line"] == mark1:
                    continue
                if not first <= obj["line"] < mark1:
                    raise AssertionError("case %s: error on line %d, outside lines %d-%d: %r" % (
                        key, obj["line"], first, mark1 - 1, obj))
            got.append(obj)
        else:
            raise AssertionError("output ended before the end of case %s" % key)
        out[key] = got
    return out


def same_number(want, got):
    if isinstance(want, bool) or isinstance(got, bool):
        return False
    if isinstance(want, int) and isinstance(got, int):
        return want == got
    return float(want) == float(got) or (math.isnan(float(want)) and math.isnan(float(got)))


def same_value(want, got):
    """Field values as {kind: value}; kinds must match exactly, numbers by value."""
    if not isinstance(got, dict) or set(want) != set(got) or len(want) != 1:
        return False
    kind = next(iter(want))
    w, g = want[kind], got[kind]
    if kind == "float":
        return isinstance(g, float) and same_number(w, g)
    if kind in ("int", "uint"):
        return isinstance(g, int) and not isinstance(g, bool) and w == g
    if kind == "bool":
        return isinstance(g, bool) and w == g
    return isinstance(g, str) and w == g


def compare(case, got):
    """None if bucketd-parse agrees with the case, else a description of the difference."""
    want = case["output"]
    errors = [o for o in got if "error" in o]
    if "error" in want:
        if not errors:
            return "accepted, want rejection (%s); got %s" % (want["error"], json.dumps(got))
        return None
    if errors:
        return "rejected (%s), want %d point(s)" % (
            "; ".join("line %d: %s" % (e["line"], e["error"]) for e in errors),
            len(want["result"]))
    points = want["result"]
    if len(points) != len(got):
        return "%d point(s), want %d" % (len(got), len(points))
    for n, (w, g) in enumerate(zip(points, got)):
        where = "point %d: " % n
        if w["name"] != g.get("name"):
            return where + "name %r, want %r" % (g.get("name"), w["name"])
        wtags = [(t["key"], t["value"]) for t in w["tags"]]
        gtags = [(t["key"], t["value"]) for t in g.get("tags", [])]
        if wtags != gtags:
            return where + "tags %r, want %r" % (gtags, wtags)
        wf, gf = w["fields"], g.get("fields", [])
        if [f["key"] for f in wf] != [f["key"] for f in gf]:
            return where + "field keys %r, want %r" % ([f["key"] for f in gf],
                                                        [f["key"] for f in wf])
        for a, b in zip(wf, gf):
            if not same_value(a["value"], b["value"]):
                return where + "field %r is %r, want %r" % (a["key"], b["value"], a["value"])
        if w["time"] != g.get("time"):
            return where + "time %r, want %r" % (g.get("time"), w["time"])
    return None


class LineProtocolConformance(unittest.TestCase):
    def test_corpus(self):
        if not os.path.exists(CORPUS):
            if os.environ.get("BUCKETD_TEST_REQUIRE_ALL") == "1":
                self.fail("no corpus at %s (BUCKETD_TEST_REQUIRE_ALL=1: the conformance test "
                          "must run; set BUCKETD_LP_CORPUS)" % CORPUS)
            self.skipTest("no corpus at %s" % CORPUS)
        if not os.access(PARSE_BIN, os.X_OK):
            self.fail("bucketd-parse not built: %s (set BUCKETD_PARSE_BIN)" % PARSE_BIN)
        with open(CORPUS, "rb") as f:
            cases = json.load(f)["decode"]

        groups = {}
        for key in sorted(cases):
            inp = cases[key]["input"]
            prec = PRECISIONS[inp["precision"]]
            groups.setdefault((prec, inp["defaultTime"]), []).append(
                (key, case_text(cases[key])))
        results = {}
        for (prec, dt), batch in sorted(groups.items()):
            results.update(run_batch(prec, dt, batch))

        bad = []
        for key in sorted(cases):
            why = compare(cases[key], results[key])
            if why is not None:
                bad.append((key, why))
        total = len(cases)
        rate = 100.0 * (total - len(bad)) / total
        print("\nline-protocol conformance: %d/%d cases agree (%.2f%%)" % (
            total - len(bad), total, rate), file=sys.stderr)
        for key, why in bad:
            text = case_text(cases[key])
            print("  %s %r: %s" % (key, text[:120], why), file=sys.stderr)
        self.assertEqual(bad, [], "%d of %d corpus cases disagree" % (len(bad), total))


if __name__ == "__main__":
    unittest.main(verbosity=2)
